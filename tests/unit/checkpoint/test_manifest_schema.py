"""Hostile checkpoints (issue 18 item 6): a manifest naming files outside its folder is
refused before any read, and a property test mutates manifests and safetensors headers at
random: every outcome is a CheckpointError or a correct result, never another exception,
a read outside the folder or a partial output."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from parallelizer.checkpoint import load_full, write_checkpoint
from parallelizer.convert.reshard import reshard
from parallelizer.cli.parallelize import main as cli
from parallelizer.errors import CheckpointError
from tests.unit.convert.test_reshard import make_plan, optim_state, state_dict

_OPENED: list = []  # paths opened from Python (open / os.open) while _WATCH is set
_WATCH = [False]


def _audit(event, args):
    if _WATCH[0] and event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.fsdecode(args[0]))


sys.addaudithook(_audit)


def _sha(p: Path) -> dict:
    return {"sha256": hashlib.sha256(p.read_bytes()).hexdigest(), "bytes": p.stat().st_size}


@pytest.fixture(scope="module", params=["file per (stage, tp)", "chunks per rank"])
def base(tmp_path_factory, request):
    """A (tp=2, pp=2) checkpoint as the compiler writes it, or with every piece split in
    two row chunks in per-rank files, as ``run.py --save`` writes one at dp=2."""
    root = tmp_path_factory.mktemp("hostile")
    plan = make_plan(2, 2)
    sd = state_dict(plan)
    write_checkpoint(sd, plan, root / "src", optim_state=optim_state(sd),
                     train={"step": 2, "optimizer": "adamw"})
    if request.param == "file per (stage, tp)":
        return root / "src", sd
    _rechunk(root / "src", root / "chunked")
    assert _equal(load_full(root / "chunked"), sd) and _equal(sd, load_full(root / "chunked"))
    return root / "chunked", sd


def _rechunk(src: Path, dst: Path) -> None:
    """``src`` with each file's tensors split by rows over two 'dp ranks' (0-d ones on the
    first), pieces listing their ``chunks`` (the format of runtime/sharded_save.py)."""
    from safetensors.torch import load_file
    dst.mkdir()
    m = json.loads((src / "manifest.json").read_text())
    where = {}
    for name in sorted(m["files"]):
        tensors, parts = load_file(str(src / name)), ({}, {})
        for k, t in tensors.items():
            cut = -(-t.shape[0] // 2) if t.dim() else 0
            for d, (lo, hi) in enumerate([(0, cut), (cut, t.shape[0] if t.dim() else 0)]):
                if hi > lo or (d == 0 and t.dim() == 0):
                    parts[d][k] = t[lo:hi].clone() if t.dim() else t
                    where.setdefault((name, k), []).append({"file": name.replace(".safe", f"-dp{d}.safe"),
                                                           "rows": [lo, hi]})
        for d, part in enumerate(parts):
            save_file(part, str(dst / name.replace(".safe", f"-dp{d}.safe")))
    for entry in m["tensors"].values():
        for pc in entry["pieces"]:
            pc["chunks"] = where[(pc.pop("file"), pc["name"])]
    m["files"] = {p.name: _sha(p) for p in sorted(dst.iterdir())}
    (dst / "manifest.json").write_text(json.dumps(m))


def _with_secret(tmp: Path) -> Path:
    """``tmp/outside/secret.safetensors``: a valid shard-shaped file outside the checkpoint."""
    (tmp / "outside").mkdir()
    secret = tmp / "outside" / "secret.safetensors"
    save_file({"norm.weight": torch.full((8,), 12345.0)}, str(secret))
    return secret


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_manifest_entry_outside_folder_refused_before_any_read(base, tmp_path, capsys, how):
    """The issue's repro: a files entry (and the pieces pointing at it) naming a file outside
    the folder, with that file's true size and sha256; reshard refuses it naming the entry,
    reads nothing outside and writes nothing."""
    src = tmp_path / "ckpt"
    shutil.copytree(base[0], src)
    secret = _with_secret(tmp_path)
    entry = {"dotdot": "../outside/secret.safetensors", "absolute": str(secret),
             "symlink": "link.safetensors"}[how]
    if how == "symlink":
        (src / entry).symlink_to(secret)
    m = json.loads((src / "manifest.json").read_text())
    m["files"][entry] = _sha(secret)
    m["tensors"]["norm.weight"]["pieces"][0]["file"] = entry
    (src / "manifest.json").write_text(json.dumps(m))
    _OPENED.clear()
    _WATCH[0] = True
    try:
        assert cli(["reshard", str(src), "-o", str(tmp_path / "dst"), "--tp", "1"]) == 2
    finally:
        _WATCH[0] = False
    err = capsys.readouterr().err
    assert repr(entry) in err and "nothing was read" in err and "Traceback" not in err
    assert not any(Path(p).resolve().is_relative_to(secret.parent) for p in _OPENED)
    assert not (tmp_path / "dst").exists() and not list(tmp_path.glob(".dst*"))


# -- property test ----------------------------------------------------------------------

def _paths(obj, prefix=()):
    """Every JSON path (tuple of keys / indices) in ``obj``, containers included."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


HOSTILE = st.one_of(
    st.sampled_from(["../outside/secret.safetensors", "SECRET_ABS", "link.safetensors", "",
                     "..", "float64", "int8", "bogus", "padded", "pp0-tp1.safetensors", "0" * 64]),
    st.integers(-3, 40), st.sampled_from([10 ** 12, 2 ** 63, True, False, None, 1.5]),
    st.lists(st.integers(-1, 12), max_size=4), st.just({}), st.text(max_size=6))


@st.composite
def manifest_mutation(draw, manifest):
    paths = sorted(p for p in _paths(manifest) if p)
    path = draw(st.sampled_from(paths))
    return ("manifest", path, draw(st.one_of(st.just("DELETE"), HOSTILE)))


@st.composite
def header_mutation(draw, files):
    name = draw(st.sampled_from(files))
    field = draw(st.sampled_from(["dtype", "shape", "data_offsets", "rename", "raw"]))
    value = draw(HOSTILE)
    return ("header", name, field, value, draw(st.integers(0, 10 ** 6)))


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    if value == "DELETE":
        del obj[path[-1]]
    elif isinstance(obj, dict) and isinstance(path[-1], str) and path[-2:-1] == ("files",) \
            and isinstance(value, str):
        obj[value] = obj.pop(path[-1])  # rename a file entry
    else:
        obj[path[-1]] = value


def _mutate_header(src: Path, name: str, field: str, value, seed: int) -> None:
    """Rewrite ``name``'s safetensors header with one field of one tensor changed (or one
    header byte), and record the new size and sha256 in the manifest, so that the header
    parsing, not the checksum, has to catch it."""
    data = (src / name).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    header = json.loads(data[8:8 + n])
    keys = sorted(k for k in header if k != "__metadata__")
    key = keys[seed % len(keys)]
    if field == "raw":
        raw = bytearray(data[8:8 + n])
        raw[seed % n] = (raw[seed % n] + 1 + seed % 200) % 256
        new_header = bytes(raw)
    else:
        if field == "rename":
            header[str(value)] = header.pop(key)
        else:
            header[key][field] = value
        new_header = json.dumps(header).encode()
    (src / name).write_bytes(struct.pack("<Q", len(new_header)) + new_header + data[8 + n:])
    m = json.loads((src / "manifest.json").read_text())
    m["files"][name] = _sha(src / name)
    (src / "manifest.json").write_text(json.dumps(m))


def _equal(a: dict, b: dict) -> bool:
    """``a``'s tensors are ``b``'s (a manifest with an entry removed is a smaller checkpoint)."""
    return a.keys() <= b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


@settings(max_examples=int(os.environ.get("HOSTILE_EXAMPLES", 100)), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=st.data())
def test_mutated_checkpoints_fail_clearly(base, data):
    src0, sd = base
    manifest = json.loads((src0 / "manifest.json").read_text())
    files = sorted(manifest["files"])
    mutation = data.draw(st.one_of(manifest_mutation(manifest), header_mutation(files)))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        src = tmp / "ckpt"
        shutil.copytree(src0, src)
        secret = _with_secret(tmp)
        (src / "link.safetensors").symlink_to(secret)
        if mutation[0] == "manifest":
            m = json.loads((src / "manifest.json").read_text())
            value = str(secret) if mutation[2] == "SECRET_ABS" else mutation[2]
            try:
                _set(m, mutation[1], value)
            except (KeyError, IndexError, TypeError):
                event("not applicable")
            return  # the mutation does not apply
            (src / "manifest.json").write_text(json.dumps(m))
        else:
            _mutate_header(src, *mutation[1:])
        dst = tmp / "dst"
        _OPENED.clear()
        _WATCH[0] = True
        try:
            result = reshard(src, dst, tp=1)
            loaded = load_full(dst)
        except CheckpointError as e:
            assert str(e), mutation
            event("refused")
            result = None
        finally:
            _WATCH[0] = False
        assert not any(Path(p).resolve().is_relative_to(tmp / "outside") for p in _OPENED), mutation
        if result is None:  # refused: no partial output
            assert not dst.exists() and not list(tmp.glob(".dst*")), mutation
        else:  # accepted: the mutation was harmless, and the data is the original's
            assert _equal(loaded, sd), mutation
