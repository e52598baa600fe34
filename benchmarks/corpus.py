"""Training on a real corpus end to end: the Python standard library's own sources, bytes as
tokens (a byte-level tokenizer: ids 0..255), written as nanoGPT's prepare.py writes a
``.bin`` (uint16), then ``examples/gpt_bytes`` trained with its spec (AdamW, clipping at
``optimizer.max_norm`` 1.0, 20 warmup steps + cosine decay to 1e-4, ``train.grad_accum`` 2) by
``run.py --train`` at tp2 x pp2 and dp2 x tp2, and by the same spec on one device; besides,
the unmodified model in a plain loop (torch's clip_grad_norm_, the same lr_scheduler
classes, each step's two batches as one batch of twice the size). The loss at every logged
step must agree within ``--tol`` (1e-4, fp32) across all four, and a tp2 x pp2 run stopped
at half-way and resumed with the same command line must log exactly the uninterrupted rows.

    python -m benchmarks.corpus [--steps 200] [--log-every 10] [--out DIR]

Writes DIR/stdlib.bin and DIR/stdlib.eval.bin, each run's metrics.jsonl and loss.png, and
DIR/loss_curves.png (all runs), and prints the table; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import torch

from parallelizer.frontend.model_file import load_model_file
from parallelizer.frontend.spec import load_spec
from parallelizer.runtime.lr_schedule import make_schedule
from parallelizer.runtime.metrics import read_rows
from parallelizer.runtime.periodic import FAULT_ENV
from parallelizer.runtime.token_data import TokenData

from ._common import ENV, REPO, compile_program, free_port, run

EXAMPLE = REPO / "examples" / "gpt_bytes"
MESHES = {"single": dict(dp=1, tp=1, pp=1), "tp2-pp2": dict(dp=1, tp=2, pp=2),
          "dp2-tp2": dict(dp=2, tp=2, pp=1)}
EVAL_FRACTION = 0.05


def write_corpus(out: Path, limit: int) -> tuple[Path, Path, int, int]:
    """The stdlib's .py files (name order) as bytes, the first ``limit`` of them: train and
    eval .bin files (uint16 ids, the last EVAL_FRACTION held out)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    data = bytearray()
    for f in sorted(root.rglob("*.py")):
        if "site-packages" in f.parts:
            continue
        data += f.read_bytes()
        if len(data) >= limit:
            break
    ids = np.frombuffer(bytes(data[:limit]), dtype=np.uint8).astype(np.uint16)
    cut = int(len(ids) * (1 - EVAL_FRACTION))
    train, evals = out / "stdlib.bin", out / "stdlib.eval.bin"
    ids[:cut].tofile(train)
    ids[cut:].tofile(evals)
    return train, evals, cut, len(ids) - cut


def torchrun(out: Path, nproc: int, args: list[str], env: dict | None = None) -> int:
    """run.py under torchrun; its exit status (a crash injected by ``env`` is expected)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), str(out / "run.py"),
           "--device", "cpu", *args]
    if env is None:
        run(cmd, env=ENV, timeout=3600, what=f"run.py {' '.join(args[:3])}")
        return 0
    return subprocess.run(cmd, capture_output=True, text=True, env={**ENV, **env}, cwd=REPO,
                          timeout=3600).returncode


def train_program(name: str, mesh: dict, data: list[str], root: Path, steps: int, every: int,
                  evals: int, extra: list[str] = (), log: str | None = None,
                  env: dict | None = None) -> list[dict]:
    """Compile the example at ``mesh`` and train it; its logged rows."""
    out = root / f"program-{name}"
    if not (out / "plan.json").exists():
        compile_program(out, [f"mesh.{k}={v}" for k, v in mesh.items()] + data,
                        model=EXAMPLE / "model.py", spec=EXAMPLE / "spec.yaml")
    logs = root / (log or f"logs-{name}")
    done = logs / "metrics.jsonl"
    if log is None and done.is_file() and any(r.get("step") == steps for r in read_rows(done)):
        print(f"{name}: reusing the finished run in {logs}")  # a rerun of this script
        return read_rows(done)
    code = torchrun(out, mesh["dp"] * mesh["tp"] * mesh["pp"],
                    ["--train", "--steps", str(steps), "--log-every", str(every), "--log-dir",
                     str(logs), "--eval-every", str(evals), *extra], env)
    if env is not None:
        print(f"{name}: the run with {env} exited {code} (killed mid-save, as intended)")
    return read_rows(logs / "metrics.jsonl")


def eager_reference(data_path: Path, steps: int, every: int) -> list[dict]:
    """The unmodified model, one process: each step's grad_accum batches as one batch."""
    spec = load_spec(EXAMPLE / "spec.yaml", [f"data.path={data_path}"])
    module = load_model_file(EXAMPLE / "model.py")
    torch.manual_seed(spec.seed)
    model = module.build_model().train()
    ocfg = spec.optimizer.model_dump()
    opt = torch.optim.AdamW(model.parameters(), lr=ocfg["lr"], weight_decay=ocfg["weight_decay"])
    sched = make_schedule(opt, ocfg, steps)
    d, accum = spec.data, spec.train.grad_accum
    data = TokenData(data_path, d.dtype, d.seq_len, d.batch_size, spec.seed, d.shuffle)
    rows = []
    for step in range(steps):
        batch = torch.cat([data.rows(data.batch_windows(step * accum + i)) for i in range(accum)])
        opt.zero_grad(set_to_none=True)
        loss = module.loss_fn(model(batch), (batch,))
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), ocfg["max_norm"])
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        if (step + 1) % every == 0:
            rows.append({"step": step + 1, "loss": loss.item(), "grad_norm": norm.item(), "lr": lr})
    return rows


def plot(curves: dict, png: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        train = [(r["step"], r["loss"]) for r in rows if "loss" in r]
        ax.plot(*zip(*train), label=name, linestyle="--" if name == "eager" else "-")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (bytes, nats)")
    ax.set_title("gpt_bytes on the Python standard library")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--tol", type=float, default=1e-4)
    p.add_argument("--bytes", type=int, default=2_000_000, help="corpus size (bytes of source)")
    p.add_argument("--out", type=Path, default=Path("/tmp/pz-corpus"))
    a = p.parse_args()
    for stale in ("ck-tp2-pp2", "logs-resumed"):  # a previous run's
        shutil.rmtree(a.out / stale, ignore_errors=True)
    a.out.mkdir(parents=True, exist_ok=True)
    train, evals, n_train, n_eval = write_corpus(a.out, a.bytes)
    print(f"corpus: {n_train} training and {n_eval} held-out bytes of {sysconfig.get_paths()['stdlib']}")
    data = [f"data.path={train}", f"data.eval={evals}"]
    evals = a.steps // 2
    curves = {name: train_program(name, mesh, data, a.out, a.steps, a.log_every, evals)
              for name, mesh in MESHES.items()}
    curves["eager"] = eager_reference(train, a.steps, a.log_every)
    # a crash mid-schedule: rank 1 kills itself (SIGKILL) during the save after step
    # 3/4 of the run, leaving the half-way checkpoint the newest complete one; the same
    # command line then resumes from it (--resume auto), as a restarted job does
    half, ck = a.steps // 2, a.out / "ck-tp2-pp2"
    line = ["--save", str(ck), "--save-every", str(half // 2), "--resume", "auto"]
    crash = {FAULT_ENV: f"{half + half // 2}:1"}
    train_program("tp2-pp2", MESHES["tp2-pp2"], data, a.out, a.steps, a.log_every, evals, line,
                  "logs-resumed", crash)
    resumed = train_program("tp2-pp2", MESHES["tp2-pp2"], data, a.out, a.steps, a.log_every, evals,
                            line, "logs-resumed")
    return report(curves, resumed, a)


def report(curves: dict, resumed: list[dict], a) -> int:
    ref = {r["step"]: r for r in curves["single"] if "loss" in r}
    worst, ok = {}, True
    print(f"{'step':>5} " + " ".join(f"{n:>12}" for n in curves) + "   max |diff| vs single")
    for step in sorted(ref):
        losses = {n: next(r["loss"] for r in rows if r.get("step") == step and "loss" in r)
                  for n, rows in curves.items()}
        diff = max(abs(v - ref[step]["loss"]) for v in losses.values())
        for n, v in losses.items():
            worst[n] = max(worst.get(n, 0.0), abs(v - ref[step]["loss"]))
        ok &= diff <= a.tol
        print(f"{step:>5} " + " ".join(f"{v:12.6f}" for v in losses.values()) + f"   {diff:.2e}")
    uninterrupted = [r for r in curves["tp2-pp2"]]
    same = [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "peak_memory_bytes")}
            for r in uninterrupted] == \
           [{k: v for k, v in r.items() if k not in ("tokens_per_s", "mfu", "peak_memory_bytes")}
            for r in resumed]
    ok &= same
    ppl = [r for r in curves["tp2-pp2"] if "eval_loss" in r]
    print("max |loss - single-device program| over logged steps: " +
          ", ".join(f"{n} {v:.2e}" for n, v in worst.items()) + f" (tolerance {a.tol:g})")
    print("held-out loss / perplexity at tp2 x pp2: " + ", ".join(
        f"step {r['step']}: {r['eval_loss']:.4f} / {math.exp(r['eval_loss']):.3f}" for r in ppl))
    print(f"killed during the step-{3 * a.steps // 4} save, rerun with the same command line "
          f"(--resume auto, from step {a.steps // 2}): logged rows equal the uninterrupted run's "
          f"exactly (loss, grad norm, lr, eval): {same}")
    plot(curves, a.out / "loss_curves.png")
    (a.out / "corpus.json").write_text(json.dumps({"curves": curves, "resumed": resumed,
                                                   "worst": worst, "resume_exact": same}, indent=1))
    print(f"figures: {a.out / 'loss_curves.png'}, {a.out / 'logs-tp2-pp2' / 'loss.png'}, "
          f"{a.out / 'logs-tp2-pp2' / 'metrics.jsonl'}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
