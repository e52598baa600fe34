"""``parallelize estimate``: memory per rank before launching (parallelizer/advisor/memory.py).

    parallelize estimate MODEL SPEC [--json] [KEY=VALUE ...]
    parallelize estimate --params PSI --dp N [--zero-stage S]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import ModelFileError, UserError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallelize estimate",
        usage="%(prog)s MODEL SPEC [--json] [KEY=VALUE ...] | %(prog)s --params PSI --dp N [--zero-stage S]",
        description="Bytes per rank of parameters, gradients, optimizer state and activations "
                    "of the program MODEL + SPEC compile to (meta device, no weights); or, with "
                    "--params, the ZeRO paper's model-state figures for a parameter count.")
    p.add_argument("model", metavar="MODEL", type=Path, nargs="?", help="model.py")
    p.add_argument("spec", metavar="SPEC", type=Path, nargs="?", help="parallelization spec (YAML)")
    p.add_argument("overrides", metavar="KEY=VALUE", nargs="*", help="spec overrides, e.g. zero_stage=1")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--params", type=float, metavar="PSI", help="parameter count, e.g. 13e9 (no model)")
    p.add_argument("--dp", type=int, metavar="N", help="data-parallel degree (with --params)")
    p.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), metavar="S",
                   help="one ZeRO stage 0-3 (with --params; default: all)")
    return p


def main(argv: list[str]) -> int:
    """Raises UserError (exit 2): bad argument combination, or the compiler's errors."""
    ns = _parser().parse_intermixed_args(argv)
    if ns.params is not None:
        return _paper(ns)
    if ns.model is None or ns.spec is None:
        raise UserError("parallelize estimate needs MODEL SPEC (a model.py and a spec), or "
                        "--params PSI --dp N for the ZeRO paper's figures")
    if ns.dp is not None or ns.zero_stage is not None:
        raise UserError("--dp and --zero-stage go with --params; with MODEL SPEC set them as "
                        "overrides: mesh.dp=N zero_stage=S")
    if not ns.model.is_file():
        raise ModelFileError(f"model file {ns.model} does not exist (or is not a file)")
    from ..advisor.memory import as_json, estimate_model_file
    from ..frontend.spec import load_spec

    from ..plan.compression import dp_collectives, format_dp_collectives

    plan, ranks = estimate_model_file(ns.model, load_spec(ns.spec, ns.overrides))
    if ns.json:
        print(json.dumps({**as_json(plan, ranks), "dp_communication": dp_collectives(plan)}, indent=1))
    else:
        print(_table(plan, ranks))
        rows = format_dp_collectives(dp_collectives(plan))
        if rows:
            print(f"\ndata-parallel gradient communication per step and rank, compression "
                  f"{plan.compression.get('method', 'none')} (bytes; sent = ring algorithms)")
            print("\n".join(rows))
    return 0


def _paper(ns) -> int:
    from ..advisor.memory import format_zero_figures

    if ns.model is not None:
        raise UserError("--params estimates from a parameter count alone; drop MODEL SPEC, or "
                        "drop --params to estimate a model")
    if ns.dp is None or ns.dp < 1 or ns.params <= 0:
        raise UserError(f"--params needs a count > 0 and --dp N >= 1 (got --params {ns.params:g}, "
                        f"--dp {ns.dp}); e.g. --params 13e9 --dp 8")
    stages = (0, 1, 2, 3) if ns.zero_stage is None else (0, ns.zero_stage)
    print(format_zero_figures(ns.params, ns.dp, stages))
    return 0


# below this total the table is in bytes, so that it reads like run.py --profile's MEMORY
# lines (tiny test models); above it in MiB
BYTES_BELOW = 16 * 2**20


def _table(plan, ranks) -> str:
    m = plan.mesh
    in_bytes = max(r.total for r in ranks) < BYTES_BELOW
    unit, fmt = ("bytes", "{:,}".format) if in_bytes else ("MiB", lambda n: f"{n / 2**20:.2f}")
    ep = f" (ep={plan.ep})" if plan.ep > 1 else ""
    head = (f"memory per rank ({unit}), mesh pp={m['pp']} x dp={m['dp']}{ep} x tp={m['tp']}, zero_stage "
            f"{plan.zero_stage}, param_dtype {plan.param_dtype}, activation_checkpointing "
            f"{plan.activation_checkpointing}, schedule {plan.schedule} x {plan.microbatches} "
            f"microbatches, {plan.virtual_stages} stage(s) per pp rank")
    a2a = plan.ep > 1  # the all-to-all buffers' column only under expert parallelism
    cols = ("rank", "pp", "dp", "tp", "params", "grads", "optim", "buffers", "gathered",
            "act/mb", "in flight", "act") + (("all-to-all",) if a2a else ()) + ("total",)
    rows = [cols] + [(str(r.rank), str(r.pp), str(r.dp), str(r.tp), fmt(r.parameters),
                      fmt(r.gradients), fmt(r.optimizer), fmt(r.buffers),
                      fmt(r.gathered_parameters), fmt(r.activations_per_microbatch),
                      str(r.microbatches_in_flight), fmt(r.activations))
                     + ((fmt(r.alltoall_buffers),) if a2a else ()) + (fmt(r.total),)
                     for r in ranks]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = [head] + ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
