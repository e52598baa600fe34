"""``parallelize inspect MODEL SPEC [--json] [--plots DIR] [KEY=VALUE ...]``.

Compiles on the meta device (no weights, no reference, nothing written unless ``--plots``)
and prints the pipeline plan: per stage FLOPs, parameter bytes, activation bytes sent and
FQNs, the imbalance and the theoretical bubble. ``--json`` prints one JSON object
(``planning.pipeline_summary.summarize``) on stdout.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import ModelFileError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="parallelize inspect",
        description="Show the pipeline split of MODEL under SPEC (built on the meta device: no "
                    "weights needed): stage FLOPs, parameter bytes, activations sent, bubble.")
    p.add_argument("model", metavar="MODEL", type=Path, help="model.py defining build_model() and example_inputs()")
    p.add_argument("spec", metavar="SPEC", type=Path, help="parallelization spec (YAML)")
    p.add_argument("overrides", metavar="KEY=VALUE", nargs="*", help="spec overrides, e.g. mesh.pp=4")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--plots", metavar="DIR", type=Path, default=None,
                   help="also write pipeline_costs.png and pipeline_schedule.png into DIR")
    return p


def main(argv: list[str]) -> int:
    """Raises ModelFileError / SpecError / PlanError (exit 2 through the CLI)."""
    ns = _parser().parse_intermixed_args(argv)
    from ..compiler import compile_model
    from ..emit.plots import write_pipeline_plots
    from ..emit.report import pipeline_section
    from ..frontend.spec import load_spec

    if not ns.model.is_file():
        raise ModelFileError(f"model file {ns.model} does not exist (or is not a file); "
                             f"pass the path to a model.py defining build_model() and example_inputs()")
    spec = load_spec(ns.spec, ns.overrides)
    program = compile_model(ns.model, spec, weights=False)
    summary = program.pipeline
    if ns.plots is not None:
        summary = {**summary, "plots": [str(ns.plots / f) for f in write_pipeline_plots(summary, ns.plots)]}
    for line in program.warnings:
        print(f"warning: {line}", file=sys.stderr)
    if ns.json:
        print(json.dumps(summary))
    else:
        print("\n".join(pipeline_section(program.plan, summary, pictures=False)[3:]))
        for st in summary["stages"]:
            print(f"stage {st['index']} fqns: {', '.join(st['fqns'])}")
            for block, kids in st["children"].items():
                print(f"stage {st['index']} holds of {block} only: {', '.join(kids)}")
    return 0
