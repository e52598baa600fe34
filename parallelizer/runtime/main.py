"""The emitted program's entry point (``OUT/run.py`` calls ``main``)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import UserError
from ..frontend.model_file import load_model_file, loss_of
from .imports import import_modules
from ..plan.schedules import with_schedule
from ..plan.parallel_plan import ParallelPlan
from .setup import init, world_size_error
from .stage_builder import build_stages
from .periodic import check_periodic_folder, prune, resolve_auto, scan, step_dir
from .loop import TrainOptions, run_train
from .stops import RunStopped
from .train import check_save_target, save_checkpoint, training_state_error
from .verify import run_verify


def _steps(text: str) -> int:
    """--steps: an integer >= 0 (0 trains nothing: with --save it writes the starting point)."""
    try:
        n = int(text)
    except ValueError:
        n = -1
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return n


def _positive(text: str) -> int:
    n = _steps(text)
    if n == 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return n


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run.py", description="Run the program parallelizer emitted.")
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--verify", action="store_true",
                      help="one step on the reference inputs; compare with the unmodified model")
    mode.add_argument("--train", action="store_true", help="train up to step --steps")
    p.add_argument("--steps", type=_steps, default=10,
                   help="optimizer steps in all, counting those of a --resume checkpoint (default 10)")
    p.add_argument("--save", type=Path, help="write the trained weights here, same sharded layout")
    p.add_argument("--load", type=Path, help="start from this checkpoint instead of OUT/checkpoint")
    p.add_argument("--profile", action="store_true",
                   help="with --train: print per rank a MEMORY {json} line (bytes held, peak); "
                        "under pp > 1 (with --train or --verify) also time forward/backward steps and print each rank's "
                        "measured pipeline bubble as a line 'BUBBLE {json}'")
    p.add_argument("--schedule", help="run under this pipeline schedule instead of the compiled "
                                      "one (same stages; e.g. compare zbv with interleaved_1f1b)")
    p.add_argument("--resume", type=Path,
                   help="continue training from a --save checkpoint: weights, optimizer state, step "
                        "counter, LR schedule, data position and RNG state (reshard it to this "
                        "program's layout first); 'auto': the newest complete checkpoint of the "
                        "--save folder (none: start from the weights); --steps counts all steps "
                        "either way, so a job restarted by torchrun --max-restarts reruns the same "
                        "command line")
    p.add_argument("--save-every", type=_positive, metavar="N",
                   help="with --train --save DIR: write DIR/step-NNNNNNNN every N steps and at the end")
    p.add_argument("--keep", type=_positive, metavar="K",
                   help="with --save-every: keep only the K newest complete checkpoints")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="default: cuda (NCCL) when available, else cpu (gloo)")
    p.add_argument("--batch-size", type=_positive, metavar="B",
                   help="with --train: the global batch size of synthetic or data: batches "
                        "(default: data.batch_size, else example_inputs()')")
    p.add_argument("--seq-len", type=_positive, metavar="T",
                   help="with --train: the sequence length of synthetic or data: batches")
    p.add_argument("--log-every", type=_positive, metavar="N",
                   help="with --train: every N steps a 'log step' line (loss, grad norm, lr, "
                        "tokens/s, MFU, peak memory), also to LOG_DIR/metrics.jsonl, TensorBoard "
                        "events and LOG_DIR/loss.png at the end")
    p.add_argument("--eval-every", type=_positive, metavar="N",
                   help="with --train: every N steps the loss and perplexity on data.eval")
    p.add_argument("--log-dir", type=Path, metavar="DIR",
                   help="where --log-every writes (default OUT/logs)")
    p.add_argument("--peak-tflops", type=float, metavar="X",
                   help="the peak TFLOP/s of one device for MFU (default: the GPU's data-sheet "
                        "figure, on CPU a measured matmul rate)")
    return p


def load_model_module(out_dir: Path):
    """OUT/model.py, imported by the front end's loader: it registers the output types (a
    ModelOutput) and holds ``loss_fn`` and ``batches()``; None for a program the API compiled
    from an in-memory model (it emits no model.py).

    Raises:
        ModelFileError: OUT/model.py fails to import or breaks the model.py contract.
    """
    path = Path(out_dir) / "model.py"
    return load_model_file(path) if path.exists() else None


def main(out_dir: Path, argv=None) -> int:
    """Run the program; exits the process with the status (0 PASS/trained, 1 FAIL, 2 error)."""
    code = _main(out_dir, argv)
    sys.stdout.flush()
    sys.stderr.flush()
    # Exit without interpreter teardown: gloo's threads racing static destructors after
    # destroy_process_group aborted about one run in five ('terminate called without an
    # active exception', SIGABRT) after a PASS on dp=2 programs.
    os._exit(code)


def _main(out_dir: Path, argv=None) -> int:
    args = _parser().parse_args(argv)
    out_dir = Path(out_dir)
    plan = ParallelPlan.from_json((out_dir / "plan.json").read_text())
    try:
        plan = with_schedule(plan, args.schedule) if args.schedule else plan
    except UserError as e:
        return _fail_before_init(f"run.py: error: {e}")
    error = world_size_error(plan, str(out_dir / "run.py"))
    if error:
        return _fail_before_init(error)
    spec = plan.settings  # the spec's run-time sections, recorded at compile time
    try:
        model_module = load_model_module(out_dir)
    except UserError as e:
        return _fail_before_init(f"run.py: error: {e}")
    missing = import_modules(plan.imports)  # lazily imported custom ops and output types
    if missing:
        return _fail_before_init(f"run.py: error: {missing}")
    loss_fn = loss_of(model_module)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("run.py: error: --device cuda but CUDA is not available here; use --device cpu", file=sys.stderr)
        return 2
    error = _periodic_args_error(args, plan)
    if error:
        return _fail_before_init(f"run.py: error: {error}")
    state_error = training_state_error(plan) if (args.save or args.resume) and args.train else None
    if state_error:
        return _fail_before_init(f"run.py: error: {state_error}")
    if args.verify and not (out_dir / "reference.safetensors").exists():
        print(f"run.py: error: {out_dir} has no reference.safetensors (compiled with --no-weights, "
              f"or by pz.compile with its own loss_fn); recompile with weights to verify", file=sys.stderr)
        return 2
    ctx = init(plan, args.device)
    done = False
    try:
        code = _run(args, out_dir, plan, spec, ctx, loss_fn, model_module)
        done = True
        return code
    except RunStopped as e:  # every rank stops at the same point; one reports it
        done = True
        if e.rank == ctx.rank:
            print(f"run.py: error (rank {ctx.rank}): {e}{_last_checkpoint(args)}",
                  file=sys.stderr, flush=True)
        return e.code
    except (UserError, ValueError) as e:
        print(f"run.py: error (rank {ctx.rank}): {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        # Only a rank that finished may wait for the others: one that failed alone (its own
        # checkpoint file corrupt) would wait in the barrier while its peers wait in the step's
        # collectives, forever. Exiting instead lets torchrun stop the peers.
        if done:
            _shutdown()


def _last_checkpoint(args) -> str:
    """Where the last complete checkpoint of this run is, for a stop message."""
    if args.save and args.save_every:
        complete, _ = scan(args.save)
        return (f"; the last complete checkpoint is {complete[-1][1]} (step {complete[-1][0]})"
                if complete else f"; {args.save} holds no complete checkpoint yet")
    if args.save:
        return f"; --save {args.save} was not written"
    return ""


def _periodic_args_error(args, plan=None) -> str | None:
    """The --save / --save-every / --keep / --resume combination's error, checked before
    any process group exists."""
    auto = args.resume is not None and str(args.resume) == "auto"
    train_only = [f for f, v in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len),
                                 ("--log-every", args.log_every), ("--eval-every", args.eval_every),
                                 ("--log-dir", args.log_dir)) if v is not None]
    if train_only and not args.train:
        return f"{', '.join(train_only)} go(es) with --train"
    if args.resume and (args.load or not args.train):
        return "--resume goes with --train and replaces --load"
    if (args.save_every or args.keep) and not (args.train and args.save):
        return "--save-every and --keep go with --train --save DIR (the checkpoint folder)"
    if args.keep and not args.save_every:
        return "--keep needs --save-every N (it prunes the periodic checkpoints)"
    if auto and not args.save_every:
        return ("--resume auto needs --save DIR --save-every N: it resumes from the newest "
                "complete checkpoint of DIR")
    try:
        if args.save and args.save_every:
            check_periodic_folder(args.save, -1 if auto else _resumed_step(args.resume))
        elif args.save:
            check_save_target(args.save, plan)
    except UserError as e:
        return str(e)
    for flag, folder in (("--save", args.save), ("--log-dir", args.log_dir)):
        error = _unwritable(flag, folder) if folder is not None and args.train else None
        if error:
            return error
    return None


def _unwritable(flag: str, folder: Path) -> str | None:
    """Why nothing can be written where ``folder`` is or would be made (a read-only folder:
    found before training, not at the save after it); None when a file can be."""
    import tempfile
    at = Path(folder).absolute()
    while not at.exists() and at != at.parent:
        at = at.parent
    if not at.is_dir():
        return None  # a file in the way: the folder checks name it
    try:
        with tempfile.TemporaryFile(dir=at):
            return None
    except OSError as e:
        return (f"{flag} {folder}: cannot write into {at} ({e.strerror}); fix its permissions "
                f"or pass another folder")


def _resumed_step(resume) -> int | None:
    """The step of the ``--resume`` checkpoint (its manifest's ``train.step``); None without
    one. An unreadable manifest counts as step 0 here: loading it names the problem."""
    if resume is None:
        return None
    try:
        return int(json.loads((Path(resume) / "manifest.json").read_text())["train"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


def _run(args, out_dir: Path, plan: ParallelPlan, spec: dict, ctx, loss_fn, model_module) -> int:
    auto = args.resume is not None and str(args.resume) == "auto"
    log = (lambda text: print(text, flush=True)) if ctx.rank == 0 else (lambda text: None)
    resume = resolve_auto(args.save, log) if auto else args.resume
    stage = build_stages(out_dir, plan, ctx, resume or args.load)
    if spec.get("compile"):
        log(f"compile: {len(stage.emitted_blocks())} block(s) of this rank under torch.compile "
            f"(inductor); the first step compiles them")
    if args.verify:
        code = run_verify(out_dir, plan, spec, stage, ctx, loss_fn)
        _profile(args, out_dir, plan, spec, stage, ctx, loss_fn, model_module)
        return code
    name = spec["optimizer"]["name"]
    saved = [None]

    def periodic(step: int, state) -> None:
        if args.save_every and step % args.save_every == 0:
            _save_step(args, stage, plan, ctx, state, step, name, log)
            saved[0] = step

    options = TrainOptions(args.batch_size, args.seq_len, args.log_every, args.eval_every,
                           args.log_dir or out_dir / "logs", args.peak_tflops)
    _, opt, step = run_train(plan, spec, stage, ctx, loss_fn, model_module, args.steps, resume,
                             after_step=periodic, options=options)
    if args.profile:  # MEMORY line per rank (runtime/memory.py)
        from .memory import print_memory
        print_memory(stage, opt.optimizer, ctx)
    if args.save and not args.save_every:
        save_checkpoint(stage, plan, ctx, args.save, opt, step, name, profile=args.profile)
    elif args.save_every and saved[0] != step and step > 0 and not _complete(args.save, step):
        _save_step(args, stage, plan, ctx, opt, step, name, log)  # the last step's
    _profile(args, out_dir, plan, spec, stage, ctx, loss_fn, model_module)
    return 0


def _complete(folder: Path, step: int) -> bool:
    """A complete checkpoint of ``step`` is already there (a resumed job with nothing left)."""
    return (step_dir(folder, step) / "manifest.json").is_file()


def _save_step(args, stage, plan, ctx, opt, step: int, name: str, log) -> None:
    """``--save DIR/step-NNNNNNNN``, then (rank 0) prune the folder to ``--keep``."""
    save_checkpoint(stage, plan, ctx, step_dir(args.save, step), opt, step, name)
    if ctx.rank == 0:
        prune(args.save, args.keep, log)


def _fail_before_init(message: str) -> int:
    """Rank 0 prints ``message`` and exits 2; the other ranks exit 2 a moment later, since
    torchrun kills the remaining ranks as soon as one fails and rank 0 was at times killed
    before it printed (seen under load)."""
    if os.environ.get("RANK", "0") == "0":
        print(message, file=sys.stderr, flush=True)
    else:
        time.sleep(3)
    return 2


def _profile(args, *context) -> None:
    """--profile: the measured pipeline bubble (runtime/bubble.py), after the main work."""
    if args.profile:
        from .bubble import run_profile
        run_profile(*context)


def _shutdown() -> None:
    """Barrier, then destroy: a rank that tears gloo down while its peer still finishes the
    last collective aborted the peer ('terminate called without an active exception')."""
    try:
        dist.barrier()
    finally:
        dist.destroy_process_group()
