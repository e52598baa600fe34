"""Reshard / export / import on real files written from hand-built plans with every tp layout
(fused q|k|v of a Conv1D weight, kv heads replicated at tp > heads, padded vocabulary, tied
weights on two stages), and the bad-checkpoint errors."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from parallelizer.checkpoint import load_full, load_shard, local_piece, read_manifest, write_checkpoint
from parallelizer.convert.export import export_hf, import_hf
from parallelizer.checkpoint.hf import load_hf_state_dict
from parallelizer.convert.reshard import reshard
from parallelizer.convert.target import repartition
from parallelizer.checkpoint.writer import FileLayout, write_layout
from parallelizer.cli.parallelize import main as cli
from parallelizer.errors import CheckpointError
from parallelizer.plan.layouts import Fused, InterleavedHeads, Padded, ReplicatedHeads
from parallelizer.plan.parallel_plan import ParallelPlan, TensorPlan

REPO = Path(__file__).resolve().parents[3]
BLOCKS = ["layers.0", "layers.1", "layers.2"]


def layouts(tp: int) -> dict:
    """The compiler's layouts of the toy model at degree ``tp``."""
    kv = ReplicatedHeads(2, 4) if tp > 2 else InterleavedHeads(2, 4)
    return {"embed.weight": Padded(-(-10 // tp) * tp),
            "layers.0.c_attn.weight": Fused((8, 8, 8)),
            "layers.1.k_proj.weight": kv}


def make_plan(tp: int, pp: int, dp: int = 1) -> ParallelPlan:
    specs = [  # fqn, shape, dtype, tp_dim, uses (cost-model units: 0 pre, 1 + block, 4 post)
        ("embed.weight", (10, 8), "float32", 0, [0, 4]),            # tied with lm_head
        ("layers.0.c_attn.weight", (8, 24), "float32", 1, [1]),     # Conv1D (in, out), q|k|v
        ("layers.0.c_attn.bias", (24,), "bfloat16", None, [1]),
        ("layers.1.k_proj.weight", (8, 8), "float32", 0, [2]),      # 2 kv heads of 4
        ("layers.2.down.weight", (8, 12), "float16", 1, [3]),
        ("norm.weight", (8,), "float32", None, [4]),
        ("rope.inv_freq", (4,), "float32", None, [0]),
    ]
    structure = {"blocks": BLOCKS, "block_costs": [192, 64, 96], "pre_cost": 80, "post_cost": 8,
                 "uses": {f: u for f, *_, u in specs},
                 "state_dict_keys": [f for f, *_ in specs if f != "rope.inv_freq"] + ["lm_head.weight"]}
    stages = repartition(structure, pp)
    lay = layouts(tp)
    tensors = {f: TensorPlan(f, s, d, t, stages[f], f == "rope.inv_freq", "x", lay.get(f) if t is not None else None)
               for f, s, d, t, _ in specs}
    return ParallelPlan(mesh={"pp": pp, "dp": dp, "tp": tp}, zero_stage=0, schedule="1f1b",
                        microbatches=1, seed=0, tensors=tensors,
                        aliases={"lm_head.weight": "embed.weight"}, stages=(), structure=structure)


def state_dict(plan) -> dict:
    g = torch.Generator().manual_seed(1)
    return {f: torch.randn(t.shape, generator=g).to(getattr(torch, t.dtype)) for f, t in plan.tensors.items()}


def optim_state(sd) -> dict:
    return {f: {"exp_avg": t.float() * 2, "exp_avg_sq": t.float() ** 2, "step": torch.tensor(2.0)}
            for f, t in sd.items() if f != "rope.inv_freq"}


def file_hashes(folder: Path) -> dict:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(torch.uint8) if a[k].dim() else a[k], b[k].view(torch.uint8) if b[k].dim() else b[k]), k


@pytest.fixture
def src(tmp_path):
    plan = make_plan(2, 2)
    sd = state_dict(plan)
    out = write_checkpoint(sd, plan, tmp_path / "src", optim_state=optim_state(sd),
                           train={"step": 2, "optimizer": "adamw"})
    return out, plan, sd


def test_reshard_chain_every_layout_bit_exact(src, tmp_path):
    out, plan, sd = src
    before = file_hashes(out)
    optim = load_full(out, optim=True)
    prev = out
    for tp, pp in [(4, 1), (1, 1), (4, 3), (2, 2)]:
        dst = tmp_path / f"tp{tp}-pp{pp}"
        reshard(prev, dst, tp, pp)
        m = read_manifest(dst)
        target = make_plan(tp, pp)
        # the pieces are exactly what the writer makes from the full tensors under the
        # compiler's plan for (tp, pp): fused parts, replicated heads, padding, stages
        assert m["layout_hash"] == read_manifest(write_checkpoint(sd, target, tmp_path / f"w{tp}{pp}"))["layout_hash"]
        for p in range(pp):
            for t in range(tp):
                shard = load_shard(dst, p, t, plan=target)
                assert shard.keys() == {f for f, x in target.tensors.items() if p in x.stages}
                for f, piece in shard.items():
                    assert torch.equal(piece, local_piece(sd[f], target.tensors[f], tp, t)), (f, tp, t)
        same(load_full(dst), sd)
        same(load_full(dst, optim=True), optim)
        assert m["train"] == {"step": 2, "optimizer": "adamw"}
        prev = dst
    assert file_hashes(out) == before  # SRC untouched
    k = read_manifest(tmp_path / "tp4-pp1")["tensors"]["layers.1.k_proj.weight"]
    assert k["layout"]["kind"] == "replicated_heads"
    assert [p["segments"] for p in k["pieces"]] == [[[0, 0, 4]], [[0, 0, 4]], [[4, 0, 4]], [[4, 0, 4]]]
    e = read_manifest(tmp_path / "tp4-pp1")["tensors"]["embed.weight"]
    assert e["layout"]["padded_size"] == 12 and e["pieces"][3]["segments"] == [[9, 0, 1]]


def test_threads_write_the_same_bytes(src, tmp_path):
    """Files written in parallel (reshard's default) are byte-identical to a sequential run."""
    out, _, _ = src
    reshard(out, tmp_path / "one", 4, 1, threads=1)
    reshard(out, tmp_path / "four", 4, 1, threads=4)
    assert file_hashes(tmp_path / "one") == file_hashes(tmp_path / "four")


def test_parallel_writers_hold_at_most_two_largest_pieces(tmp_path):
    """4 writer threads on 4 files of equal pieces: without the byte budget all 4 would hold
    a piece at once; with it, at most 2 x the largest piece is produced and not yet written."""
    specs = {f"w{i}": TensorPlan(f"w{i}", (64, 8), "float32", 0, (0,)) for i in range(4)}
    layout = FileLayout({"pp": 1, "dp": 1, "tp": 4}, specs)
    live, peak, lock = [0], [0], threading.Lock()

    def gone():
        with lock:
            live[0] -= 1

    def piece(name, t):
        out = torch.full((16, 8), float(t))
        with lock:
            live[0] += 1
            peak[0] = max(peak[0], live[0])
        weakref.finalize(out, gone)
        time.sleep(0.02)  # every thread gets to ask for its next piece meanwhile
        return out

    with ThreadPoolExecutor(4) as pool:
        write_layout(layout, piece, tmp_path / "ck", pool=pool)
    assert peak[0] == 2
    assert torch.equal(load_shard(tmp_path / "ck", 0, 3)["w2"], torch.full((16, 8), 3.0))


def test_export_import_round_trip_sharded(src, tmp_path):
    out, plan, sd = src
    export_hf(out, tmp_path / "hf", max_shard_size="300B")
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    hf = load_hf_state_dict(tmp_path / "hf")
    assert list(hf) != [] and set(hf) == set(plan.structure["state_dict_keys"])
    assert torch.equal(hf["lm_head.weight"], sd["embed.weight"])  # tied name exported
    assert hf["embed.weight"].shape == (10, 8)  # padding stripped
    same({k: v for k, v in hf.items() if k != "lm_head.weight"},
         {k: v for k, v in sd.items() if k != "rope.inv_freq"})
    umask = os.umask(0o027)
    try:
        export_hf(out, tmp_path / "hf1")
    finally:
        os.umask(umask)
    assert sorted(os.listdir(tmp_path / "hf1")) == ["model.safetensors"]
    assert oct((tmp_path / "hf1").stat().st_mode & 0o777) == oct(0o750)  # not mkdtemp's 0o700
    same(load_file(tmp_path / "hf1" / "model.safetensors"), hf)
    import_hf(tmp_path / "hf", tmp_path / "imp", plan, tp=4, pp=1, buffers_from=out)
    same(load_full(tmp_path / "imp"), sd)
    with pytest.raises(CheckpointError, match=r"non-persistent buffers\): \['rope.inv_freq'\]"):
        import_hf(tmp_path / "hf", tmp_path / "imp2", plan)


def _peak_rss_bytes() -> int:
    line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM"))
    return int(line.split()[1]) * 1024


def test_import_streams_pieces_not_the_model(tmp_path):
    """import casts bf16 -> fp32 piece by piece: peak RSS rises by a few 4 MB pieces (and
    what malloc keeps of them: 43 MB measured), not by the cast model (160 MB; loading it
    whole, as import did before, rose 275 MB)."""
    hf = tmp_path / "hf.safetensors"
    save_file({f"w{i}": torch.randn(1024, 2048).bfloat16() for i in range(20)}, hf)
    plan = ParallelPlan(mesh={"pp": 1, "dp": 1, "tp": 2}, zero_stage=0, schedule="1f1b",
                        microbatches=1, seed=0, aliases={}, stages=(), structure={},
                        tensors={f"w{i}": TensorPlan(f"w{i}", (1024, 2048), "float32", 0, (0,))
                                 for i in range(20)})
    Path("/proc/self/clear_refs").write_text("5")  # Linux >= 4.0: VmHWM := current RSS
    before = _peak_rss_bytes()
    import_hf(hf, tmp_path / "imp", plan)
    rise = _peak_rss_bytes() - before
    assert rise < 100e6, rise
    same(load_full(tmp_path / "imp"), {k: v.float() for k, v in load_file(hf).items()})


def test_tp_that_does_not_fit_names_tensor_and_valid_values(src, tmp_path):
    out, _, _ = src
    with pytest.raises(CheckpointError, match=r"tp=3 does not fit layers\.0\.c_attn\.weight .*fit "
                                              r"this tensor: 1, 2, 4, 8; tp values that fit every "
                                              r"tensor of this checkpoint: 1, 2, 4\. A compile "
                                              r"at tp=3 may still lay it out .* pass the program "
                                              r"with --plan OUT$"):
        reshard(out, tmp_path / "dst", tp=3)
    assert not (tmp_path / "dst").exists()
    assert cli(["reshard", str(out), "-o", str(tmp_path / "d"), "--pp", "4"]) == 2  # 3 blocks


def _edit_shard(out, name: str, edit) -> None:
    """Change the tensors of shard file ``name`` with ``edit(tensors)`` and record the new
    file's sha256 and size in the manifest: damage only the checks past the digest can see."""
    f = out / name
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)
    m = json.loads((out / "manifest.json").read_text())
    m["files"][f.name] = {"sha256": hashlib.sha256(f.read_bytes()).hexdigest(), "bytes": f.stat().st_size}
    (out / "manifest.json").write_text(json.dumps(m))


def test_replicas_must_be_identical(tmp_path):
    plan = make_plan(4, 1)
    out = write_checkpoint(state_dict(plan), plan, tmp_path / "ck")
    _edit_shard(out, "pp0-tp1.safetensors", lambda t: t["layers.1.k_proj.weight"][0, 0].add_(1))
    with pytest.raises(CheckpointError, match=r"replicas of layers\.1\.k_proj\.weight differ: rows "
                                              r"\[0, 4\) along dim 0 in .*pp0-tp0\.safetensors and .*pp0-tp1"):
        reshard(out, tmp_path / "dst", tp=2)
    assert not (tmp_path / "dst").exists()


def test_copied_parts_of_a_fused_tensor_must_be_identical(tmp_path):
    """Falcon's multi-query query_key_value at tp=2: q heads split, the k and v head copied
    on both ranks; the copies are compared like replicated_heads tensors."""
    rh = ReplicatedHeads(1, 2)
    layout = Fused((4, 2, 2), (None, rh, rh))
    plan = ParallelPlan(mesh={"pp": 1, "dp": 1, "tp": 2}, zero_stage=0, schedule="1f1b",
                        microbatches=1, seed=0, stages=(), aliases={}, tensors={
                            "qkv.weight": TensorPlan("qkv.weight", (8, 3), "float32", 0, (0,),
                                                     False, "column_parallel", layout)})
    sd = {"qkv.weight": torch.arange(24.).reshape(8, 3)}
    out = write_checkpoint(sd, plan, tmp_path / "ck")
    assert torch.equal(load_full(out)["qkv.weight"], sd["qkv.weight"])
    # rank 1's piece: 2 rows of q | 2 of k | 2 of v
    _edit_shard(out, "pp0-tp1.safetensors", lambda t: t["qkv.weight"][4, 0].add_(1))
    with pytest.raises(CheckpointError, match=r"replicas of qkv\.weight differ: rows \[6, 8\) "
                                              r"along dim 0"):
        load_full(out)


# ------------------------------------------------------------ bad checkpoints (via the CLI)


def run_cli(capsys, *args) -> str:
    assert cli([str(a) for a in args]) == 2
    return capsys.readouterr().err


def test_bad_flipped_byte(src, tmp_path, capsys):
    out, _, _ = src
    f = out / "pp1-tp0.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    err = run_cli(capsys, "reshard", out, "-o", tmp_path / "d", "--tp", "1")
    assert "pp1-tp0.safetensors is corrupt: sha256" in err and not (tmp_path / "d").exists()


def test_bad_header_byte_reports_sha256_not_a_parse_error(src, tmp_path, capsys):
    """Files are written while the inputs are hashed: a corrupt header makes reading a piece
    fail first, and the error must still be the input's checksum, with nothing published."""
    out, _, _ = src
    f = out / "pp0-tp0.safetensors"
    data = bytearray(f.read_bytes())
    data[8] ^= 0x01  # the first byte of the JSON header
    f.write_bytes(bytes(data))
    err = run_cli(capsys, "reshard", out, "-o", tmp_path / "d", "--tp", "1", "--pp", "1")
    assert "pp0-tp0.safetensors is corrupt: sha256" in err and not (tmp_path / "d").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["src"]  # no temporary folder left


def test_bad_truncated_file(src, tmp_path, capsys):
    out, _, _ = src
    f = out / "pp0-tp1.safetensors"
    f.write_bytes(f.read_bytes()[:-10])
    err = run_cli(capsys, "export", out, "-o", tmp_path / "d")
    assert f"{f} is truncated" in err and "bytes, manifest.json records" in err


def test_bad_missing_shard(src, tmp_path, capsys):
    out, _, _ = src
    (out / "pp1-tp1.safetensors").unlink()
    err = run_cli(capsys, "reshard", out, "-o", tmp_path / "d", "--pp", "1")
    assert "pp1-tp1.safetensors is missing (listed in manifest.json)" in err


def test_bad_manifest_from_another_plan(src, tmp_path, capsys):
    out, _, _ = src
    other = make_plan(2, 1)
    with pytest.raises(CheckpointError, match=r"manifest\.json is from another plan: checkpoint mesh "
                                              r"pp=2 tp=2, this program pp=1 tp=2; first difference: "
                                              r"embed\.weight stages \[0, 1\]"):
        load_shard(out, 0, 0, plan=other)
    wrong = ParallelPlan(**{**other.__dict__, "tensors": {**other.tensors, "norm.weight": TensorPlan(
        "norm.weight", (9,), "float32", None, (0,))}})
    (tmp_path / "plan.json").write_text(wrong.to_json())
    err = run_cli(capsys, "reshard", out, "-o", tmp_path / "d", "--plan", tmp_path / "plan.json")
    assert "the plan does not describe this checkpoint's model" in err and "norm.weight" in err


def test_bad_tensor_of_wrong_shape(src, tmp_path, capsys):
    out, _, _ = src
    f = out / "pp0-tp0.safetensors"
    _edit_shard(out, f.name, lambda t: t.update({"layers.0.c_attn.weight": torch.zeros(8, 10)}))
    err = run_cli(capsys, "reshard", out, "-o", tmp_path / "d", "--tp", "1")
    assert f"{f}: tensor layers.0.c_attn.weight has shape (8, 10), manifest.json says (8, 12)" in err


def test_existing_destination_needs_force(src, tmp_path, capsys):
    """--force replaces an earlier checkpoint, never a folder holding anything else (it
    wiped a folder of notes and a compiled program before: a break test)."""
    out, _, sd = src
    assert cli(["reshard", str(out), "-o", str(tmp_path / "d"), "--tp", "1", "--no-progress"]) == 0
    err = run_cli(capsys, "reshard", out, "-o", tmp_path / "d", "--tp", "1")
    assert "already exists" in err and "--force" in err
    assert cli(["reshard", str(out), "-o", str(tmp_path / "d"), "--tp", "1", "--force", "--no-progress"]) == 0
    same(load_full(tmp_path / "d"), sd)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith(".")) == []
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "thesis.txt").write_text("x")
    for cmd in (["reshard", out, "--tp", "1"], ["export", out]):
        err = run_cli(capsys, *cmd, "-o", tmp_path / "notes", "--force")
        assert f"checkpoint destination {tmp_path / 'notes'} holds thesis.txt, which is no " \
               f"checkpoint or export parallelizer wrote" in err, err
    assert (tmp_path / "notes" / "thesis.txt").read_text() == "x"


def test_force_onto_a_folder_holding_the_source_is_refused(tmp_path, capsys):
    """``reshard SRC -o PARENT --force`` (and export) deleted SRC with PARENT (a break test)."""
    plan = make_plan(2, 2)
    sd = state_dict(plan)
    parent = tmp_path / "run1"
    ckpt = write_checkpoint(sd, plan, parent / "ck2")
    for cmd in (["reshard", ckpt, "--tp", "1"], ["export", ckpt]):
        for dst in (parent, tmp_path):
            err = run_cli(capsys, *cmd, "-o", dst, "--force")
            assert f"destination {dst} is the source {ckpt}, inside it or a folder holding it" \
                in err, err
    same(load_full(ckpt), sd)


_KILLED = """
import sys, time
import parallelizer.convert.reshard as r
from parallelizer.cli.parallelize import main
slow = r.target_piece
def target_piece(*a):
    time.sleep(0.05)
    return slow(*a)
r.target_piece = target_piece
sys.exit(main(["reshard", sys.argv[1], "-o", sys.argv[2], "--tp", "1", "--pp", "1", "--no-progress"]))
"""


def _interrupted_reshard(out: Path, tmp_path: Path, sig: int) -> subprocess.CompletedProcess:
    """Run the CLI's reshard of ``out`` into tmp_path/dst, slowed, and send it ``sig`` while
    the output files are being written; returns the finished process."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(out), str(tmp_path / "dst")],
                            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                            stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 60
    while not list(tmp_path.glob(".dst.tmp-*/pp0-tp0.safetensors")):
        assert proc.poll() is None and time.time() < deadline, "reshard ended before the kill"
        time.sleep(0.01)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    return subprocess.CompletedProcess(proc.args, proc.returncode, None, err)


def test_killed_reshard_leaves_no_destination_and_the_next_run_sweeps_its_temp(src, tmp_path, capsys):
    """A real SIGKILL while the output files are being written: nothing at dst, only the
    hidden temporary folder; the next write to dst removes it (it stayed for good: a break
    test) and leaves a live writer's alone."""
    out, _, sd = src
    dst = tmp_path / "dst"
    assert _interrupted_reshard(out, tmp_path, signal.SIGKILL).returncode == -signal.SIGKILL
    assert not dst.exists()
    leftovers = sorted(p.name for p in tmp_path.iterdir() if p.name not in ("src",))
    assert len(leftovers) == 1 and leftovers[0].startswith(".dst.tmp-")  # only the temp folder
    live = tmp_path / f".dst.tmp-{os.getpid()}@{leftovers[0].split('@')[1]}"
    live.mkdir()  # this process's name: a writer still running
    reshard(out, dst, tp=1, pp=1)
    same(load_full(dst), sd)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "dst", "src"])
    assert f"removed {tmp_path / leftovers[0]}, left by an interrupted write" in capsys.readouterr().err


def test_terminated_reshard_removes_its_temp(src, tmp_path):
    """SIGTERM (a scheduler's preemption) ran no cleanup: Python's default ends the process."""
    out, _, _ = src
    done = _interrupted_reshard(out, tmp_path, signal.SIGTERM)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr
    assert "terminated (SIGTERM)" in done.stderr and "Traceback" not in done.stderr, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]
