"""``parallelize`` command line.

    parallelize MODEL SPEC -o OUT [--no-weights] [--dump-passes DIR] [--[no-]self-check] [KEY=VALUE ...]
    parallelize SUBCOMMAND ...        (a name registered in SUBCOMMANDS, e.g. inspect)
    parallelize inspect MODEL SPEC [--json] [--plots DIR] [KEY=VALUE ...]
    parallelize estimate MODEL SPEC [--json] [KEY=VALUE ...] | --params PSI --dp N
    parallelize plan MODEL SPEC --cluster C.yaml --global-batch B ... | --model-shape ...
    parallelize check MODEL SPEC --cluster C.yaml [--global-batch B]
    torchrun --nproc-per-node G -m parallelizer calibrate --cluster C.yaml [--thorough]

A user error (:class:`parallelizer.errors.UserError`) prints ``error: <message>`` to stderr
and exits with 2; anything else is a bug in parallelizer and keeps its traceback.
"""
from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading
from pathlib import Path
from typing import Callable, Optional, Sequence

from parallelizer.errors import ModelFileError, UserError

# Subcommand name -> handler(argv after the name) -> exit code. Handlers import their
# modules lazily so that `parallelize --help` stays fast. Planned: reshard.
SUBCOMMANDS: dict[str, Callable[[list[str]], int]] = {}


def _inspect(argv: list[str]) -> int:
    from parallelizer.cli.inspect import main as inspect_main

    return inspect_main(argv)


SUBCOMMANDS["inspect"] = _inspect


def _lazy(module: str, func: str) -> Callable[[list[str]], int]:
    def handler(argv: list[str]) -> int:
        import importlib
        return getattr(importlib.import_module(module), func)(argv)
    return handler


SUBCOMMANDS.update({  # checkpoint conversions (parallelizer/cli/convert.py)
    "reshard": _lazy("parallelizer.cli.convert", "reshard_main"),
    "export": _lazy("parallelizer.cli.convert", "export_main"),
    "import": _lazy("parallelizer.cli.convert", "import_main"),
})


def _estimate(argv: list[str]) -> int:
    from parallelizer.cli.estimate import main as estimate_main

    return estimate_main(argv)


SUBCOMMANDS["estimate"] = _estimate
SUBCOMMANDS.update({  # the layout planner (parallelizer/cli/plan.py, cli/calibrate.py)
    "plan": _lazy("parallelizer.cli.plan", "plan_main"),
    "check": _lazy("parallelizer.cli.plan", "check_main"),
    "calibrate": _lazy("parallelizer.cli.calibrate", "main"),
})


# a read-only folder or a full disk: the user's to fix, not a bug to trace back
_WRITE_ERRORS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); return the process exit code.

    Returns:
        0 on success, 2 on a user error (bad arguments, spec, model file, plan, checkpoint),
        3 on an error the compile's own checks call internal (a bug in parallelizer), so a
        script can tell the two apart.
    """
    args = list(sys.argv[1:] if argv is None else argv)
    handler = _compile
    if args and args[0] in SUBCOMMANDS:
        handler, args = SUBCOMMANDS[args[0]], args[1:]
    previous = _exit_on_sigterm()
    try:
        return handler(args)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 3 if str(e).startswith("internal error") else 2
    except OSError as e:
        if e.errno not in _WRITE_ERRORS:
            raise
        print(f"error: cannot write {e.filename or 'the output'}: {e.strerror}; nothing was "
              f"published (outputs are renamed into place only when complete); free space, fix "
              f"the folder's permissions, or write elsewhere", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a usage error (2, already printed)
        return e.code if isinstance(e.code, int) else 2
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _exit_on_sigterm():
    """SIGTERM (a scheduler's preemption, ``kill``) raises SystemExit, so that the cleanup of
    partial outputs runs as it does on Ctrl-C; Python's default would end the process with
    the hidden temporary folder left behind. Returns the handler it replaced (None off the
    main thread, where no handler can be set)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminated(signum, frame):
        print("error: terminated (SIGTERM); an output not yet complete was not published", file=sys.stderr)
        raise SystemExit(128 + signum)
    return signal.signal(signal.SIGTERM, terminated)


def _compile_parser() -> argparse.ArgumentParser:
    sub = f" | {{{','.join(SUBCOMMANDS)}}} ..." if SUBCOMMANDS else ""
    p = argparse.ArgumentParser(
        prog="parallelize",
        usage=f"%(prog)s MODEL SPEC -o OUT [options] [KEY=VALUE ...]{sub}",
        description="Compile a PyTorch model (model.py) and a YAML spec into a "
                    "tensor/pipeline/data-parallel torchrun program.",
        epilog="Then run the program OUT holds: torchrun --nproc-per-node N OUT/run.py --verify "
               "(or --train ...); `python OUT/run.py --help` lists its flags (docs/run.md). "
               f"Subcommands: parallelize {{{','.join(SUBCOMMANDS)}}} --help.")
    p.add_argument("model", metavar="MODEL", type=Path, help="model.py defining build_model() and example_inputs()")
    p.add_argument("spec", metavar="SPEC", type=Path, help="parallelization spec (YAML)")
    p.add_argument("overrides", metavar="KEY=VALUE", nargs="*", help="spec overrides, e.g. mesh.tp=2")
    p.add_argument("-o", "--out", metavar="OUT", type=Path, required=True, help="output directory")
    p.add_argument("--no-weights", action="store_true",
                   help="do not materialize weights: build on the meta device, write no checkpoint")
    p.add_argument("--dump-passes", metavar="DIR", type=Path, default=None,
                   help="write the graph code after each pass that changed it into DIR")
    p.add_argument("--cluster", metavar="C.yaml", type=Path, default=None,
                   help="cluster file (see specs/clusters/): the spec is checked against it first "
                        "(parallelize check; stop on an error), its nodes x gpus_per_node give "
                        "OUT/launch.sh and launch.sbatch, and a tp group crossing nodes is refused")
    p.add_argument("--global-batch", type=int, metavar="B", default=None,
                   help="with --cluster: sequences per step, checked for divisibility")
    p.add_argument("--nodes", type=int, metavar="N", help="nodes the program runs on (with "
                   "--gpus-per-node; instead of --cluster): OUT/launch.sh and launch.sbatch use "
                   "them, and a tp group crossing nodes is refused")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="processes (GPUs) per node")
    check = p.add_mutually_exclusive_group()
    check.add_argument("--self-check", dest="self_check", action="store_const", const="true",
                       help="run the numerics self-check whatever the model's size "
                            "(self_check.mode=true): every tp rank of the program against the "
                            "unmodified model on the example batch, before OUT is written")
    check.add_argument("--no-self-check", dest="self_check", action="store_const", const="false",
                       help="skip it (self_check.mode=false); by default (auto) it runs at "
                            "mesh.tp > 1 for models within self_check.max_params")
    return p


def _compile(argv: list[str]) -> int:
    """``parallelize MODEL SPEC -o OUT ...``: load the spec, then compile into OUT.

    Raises:
        ModelFileError: MODEL is not a file.
        SpecError: from :func:`parallelizer.frontend.spec.load_spec`.
        UserError: any other user error raised by the compiler.
    """
    ns = _compile_parser().parse_intermixed_args(argv)
    from parallelizer.frontend.spec import load_spec

    if not ns.model.is_file():
        raise ModelFileError(f"model file {ns.model} does not exist (or is not a file); "
                             f"pass the path to a model.py defining build_model() and example_inputs()")
    # the flag wins over the spec file and its overrides, as the last override
    flags = [f"self_check.mode={ns.self_check}"] if ns.self_check else []
    spec = load_spec(ns.spec, list(ns.overrides) + flags)
    if ns.cluster is not None:
        from parallelizer.cli.plan import check_before_compile
        if not check_before_compile(ns.model, spec, ns.cluster, ns.global_batch):
            print("error: the cluster check found errors (above); nothing compiled", file=sys.stderr)
            return 1
    from parallelizer.compiler import compile_to_dir
    from parallelizer.cli.topology import resolve

    # before the compile: a layout the cluster cannot run fails in a second
    topology = resolve(dict(spec.mesh.model_dump()), ns.nodes, ns.gpus_per_node, ns.cluster)
    compile_to_dir(ns.model, spec, ns.out, weights=not ns.no_weights, dump_passes=ns.dump_passes,
                   topology=topology)
    return 0
