"""Compile and verify every zoo family at each layout, as a new user would, and tabulate.

For each (family, layout): write ``model.py`` and ``spec.yaml``, run
``parallelize model.py spec.yaml -o out`` in a subprocess, then
``torchrun --standalone --nproc-per-node N out/run.py --verify`` (gloo on CPU,
``OMP_NUM_THREADS=1``), each with a timeout, and classify the result
(:mod:`benchmarks.zoo.classify`).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from .classify import STATUSES, classify_compile, classify_run
from .families import FAMILIES
from .family import Family

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int
    pp: int

    @property
    def nproc(self) -> int:
        return self.tp * self.pp

    def spec(self) -> str:
        """The minimal spec of this layout: the mesh, microbatches = 2 under pp (>= pp for 1f1b,
        2 samples each), zero_stage 3; every other key at its default."""
        lines = [f"# benchmarks/zoo layout {self.name}", "mesh:", f"  tp: {self.tp}", f"  pp: {self.pp}"]
        if self.pp > 1:
            lines += ["pipeline:", f"  microbatches: {max(2, self.pp)}"]
        return "\n".join(lines + ["zero_stage: 3", ""])


LAYOUTS = {lay.name: lay for lay in (Layout("tp2", 2, 1), Layout("pp2", 1, 2), Layout("tp2xpp2", 2, 2),
                                      Layout("tp4", 4, 1))}
DEFAULT_LAYOUTS = ("tp2", "pp2", "tp2xpp2")


def env() -> dict:
    """The subprocesses' environment: this repository first on PYTHONPATH, one intra-op
    thread per process (ranks outnumber the cores), offline Hugging Face."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "PYTHONUNBUFFERED": "1", "TRANSFORMERS_VERBOSITY": "error", "MPLBACKEND": "Agg"}


def _tool(name: str, module: str) -> list[str]:
    """The console script ``name`` next to this Python (what a user types), else ``-m module``."""
    script = Path(sys.executable).parent / name
    return [str(script)] if script.exists() else [sys.executable, "-m", module]


def run_process(cmd: list[str], cwd: Path, timeout: float) -> tuple[int | None, str, str, bool, float]:
    """(exit status, stdout, stderr, timed out, seconds) of ``cmd``; on timeout its whole
    process group (torchrun and its ranks) is killed."""
    t0 = time.monotonic()
    p = subprocess.Popen(cmd, cwd=cwd, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
        return p.returncode, out, err, False, time.monotonic() - t0
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return None, out or "", err or "", True, time.monotonic() - t0


def run_one(family: str | Family, layout: Layout, workdir: Path, timeout: float,
            verify: bool = True, flags: tuple = ()) -> dict:
    """Compile (with the CLI's ``flags``) and verify ``family`` (a zoo name or a
    :class:`Family`) at ``layout`` under ``workdir/family/layout``; with ``verify`` False only
    compile (a compile that succeeds is PASS: at tp > 1 it ran its numerics self-check when
    the model is small enough or ``--self-check`` forces it, under pp its fake-tensor stages)."""
    fam = FAMILIES[family] if isinstance(family, str) else family
    d = workdir / fam.name / layout.name
    if d.exists():
        shutil.rmtree(d)
    fam.write(d)
    (d / "spec.yaml").write_text(layout.spec())
    # `python -m parallelizer` is the `parallelize` console script (pyproject's entry point,
    # parallelizer.cli.parallelize:main) of this checkout, whatever an installed script points at
    cmd = [sys.executable, "-m", "parallelizer", "model.py", "spec.yaml", "-o", "out", *flags]
    rc, out, err, timed_out, secs = run_process(cmd, d, timeout)
    (d / "compile.log").write_text(out + "\n--- stderr ---\n" + err)
    comp = classify_compile(rc, out, err, timed_out)
    comp["seconds"] = round(secs, 1)
    rec = {"family": fam.name, "kind": fam.kind, "layout": layout.name,
           "compile": comp, "run": None, "status": comp["status"] or "PASS"}
    if comp["status"] is None and verify:
        cmd = _tool("torchrun", "torch.distributed.run") + [
            "--standalone", "--nproc-per-node", str(layout.nproc), "out/run.py", "--verify"]
        rc, out, err, timed_out, secs = run_process(cmd, d, timeout)
        (d / "verify.log").write_text(out + "\n--- stderr ---\n" + err)
        run = classify_run(rc, out + "\n" + err, timed_out)
        run["seconds"] = round(secs, 1)
        rec["run"], rec["status"] = run, run["status"]
    rec["error"] = (rec["run"] or comp)["error"]
    return rec


def _cell(rec: dict) -> str:
    """PASS 12/14 (the sharded/total block matrices under tp), FAIL grad 14/14 (the
    mismatched categories), REFUSED (line) when the error names a source line."""
    s = rec["status"]
    tp = rec["compile"].get("tp")
    matrices = f" {tp['sharded']}/{tp['total']}" if tp and LAYOUTS[rec["layout"]].tp > 1 else ""
    if s == "REFUSED":
        return "REFUSED" + (" (line)" if rec["compile"]["source_line"] else "")
    if s == "FAIL":
        return "FAIL " + "+".join(c[:4] for c in rec["run"]["categories"]) + matrices
    return s + matrices


def table(records: list[dict], layouts: list[str]) -> str:
    """Markdown: one row per family, one column per layout; PASS cells under tp show the
    sharded/total block matrices of the compile's tensor-parallel line."""
    by = {(r["family"], r["layout"]): r for r in records}
    families = list(dict.fromkeys(r["family"] for r in records))
    lines = ["| family | kind | " + " | ".join(layouts) + " |", "|---|---|" + "---|" * len(layouts)]
    for f in families:
        cells = [_cell(by[(f, lay)]) if (f, lay) in by else "" for lay in layouts]
        kind = next((r["kind"] for r in records if r["family"] == f and "kind" in r), None) \
            or FAMILIES[f].kind
        lines.append(f"| {f} | {kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def counts(records: list[dict], layouts: list[str], statuses=STATUSES) -> str:
    """Markdown: outcome counts per layout and in all."""
    lines = ["| outcome | " + " | ".join(layouts) + " | all |", "|---|" + "---|" * (len(layouts) + 1)]
    for s in statuses:
        row = [sum(r["status"] == s and r["layout"] == lay for r in records) for lay in layouts]
        lines.append(f"| {s} | " + " | ".join(map(str, row)) + f" | {sum(row)} |")
    return "\n".join(lines)


def errors(records: list[dict]) -> str:
    """One line per record that did not pass: family, layout, status, the error."""
    out = []
    for r in records:
        if r["status"] != "PASS":
            where = r["compile"]["source_line"] if r["status"] == "REFUSED" else ""
            out.append(f"- {r['family']} {r['layout']} {r['status']}: {r['error'][:300]}"
                       + (f" [{where}]" if where else ""))
    return "\n".join(out)


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m benchmarks.zoo", description=__doc__.split("\n\n")[0])
    p.add_argument("--families", default="", help="comma-separated names (default: all; --list shows them)")
    p.add_argument("--layouts", default=",".join(DEFAULT_LAYOUTS),
                   help=f"comma-separated, of {', '.join(LAYOUTS)} (default: %(default)s)")
    p.add_argument("--jobs", type=int, default=1, help="families x layouts run at once (default 1)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per compile and per run")
    p.add_argument("--json", type=Path, default=None, help="write every record (with error texts) here")
    p.add_argument("--keep", type=Path, default=None,
                   help="keep each model.py, spec.yaml, out/ and logs under this directory")
    p.add_argument("--list", action="store_true", help="list the families and exit")
    p.add_argument("--write", type=Path, default=None, help="write each family's model.py under DIR/NAME/ and exit")
    a = p.parse_args(argv)
    names = [n for n in a.families.split(",") if n] or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    layouts = [n for n in a.layouts.split(",") if n]
    bad = [n for n in layouts if n not in LAYOUTS]
    if unknown or bad:
        print(f"error: unknown families {unknown} / layouts {bad}; families: {', '.join(FAMILIES)}; "
              f"layouts: {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    if a.list:
        for n in names:
            print(f"{n:20s} {FAMILIES[n].kind:16s} {FAMILIES[n].note}")
        return 0
    if a.write:
        for n in names:
            print(FAMILIES[n].write(a.write / n))
        return 0
    workdir = a.keep or Path(tempfile.mkdtemp(prefix="pz-zoo-"))
    jobs = [(n, LAYOUTS[lay]) for n in names for lay in layouts]
    records: list[dict] = []
    t0 = time.time()

    def one(job):
        rec = run_one(job[0], job[1], workdir, a.timeout)
        secs = rec["compile"]["seconds"] + (rec["run"] or {}).get("seconds", 0)
        print(f"[{time.time() - t0:6.0f}s] {rec['family']:20s} {rec['layout']:8s} {rec['status']:13s} "
              f"{secs:5.0f}s {rec['error'][:150]}", flush=True)
        if not a.keep:
            shutil.rmtree(workdir / job[0] / job[1].name, ignore_errors=True)
        return rec

    try:
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            for rec in pool.map(one, jobs):
                records.append(rec)
                if a.json:
                    _write_json(a.json, records, layouts)
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    print("\n" + table(records, layouts) + "\n\n" + counts(records, layouts) + "\n\n" + errors(records))
    return 0


def _write_json(path: Path, records: list[dict], layouts: list[str], benchmark: str = "zoo",
                statuses=STATUSES) -> None:
    import subprocess as sp
    commit = sp.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    data = {"benchmark": benchmark, "commit": commit, "date": time.strftime("%Y-%m-%d %H:%M %Z"),
            "layouts": layouts, "table": table(records, layouts),
            "counts": counts(records, layouts, statuses), "records": records}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)
