"""runtime/token_data.py (the spec's data: section) and runtime/lr_schedule.py in one process:
windows, the seeded shuffle, each dp rank's rows, files of a folder, every DataError; the
schedule's learning rates and its state round trip."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from parallelizer.runtime.lr_schedule import load_schedule_state, make_schedule
from parallelizer.runtime.token_data import DataError, TokenData


def _bin(path, n, dtype=np.uint16, top=256, seed=0):
    ids = np.random.default_rng(seed).integers(0, top, n).astype(dtype)
    ids.tofile(path)  # as nanoGPT's prepare.py writes train.bin
    return ids


def test_windows_shuffle_and_dp_rows(tmp_path):
    ids = _bin(tmp_path / "train.bin", 4 * 10 + 3)  # 10 windows of 4 (3 tokens dropped)
    data = TokenData(tmp_path / "train.bin", "uint16", seq_len=4, batch_size=4, seed=7, vocab_size=256)
    assert (data.windows, data.per_epoch) == (10, 2)
    for k in range(5):  # epochs 0, 1, 2: a permutation each, seeded by seed + epoch
        w = data.batch_windows(k)
        perm = torch.randperm(10, generator=torch.Generator().manual_seed(7 + k // 2))
        assert torch.equal(w, perm[(k % 2) * 4:(k % 2) * 4 + 4])
        rows = data.rows(w)
        assert rows.dtype == torch.int64 and rows.shape == (4, 4)
        for i, win in enumerate(w.tolist()):
            assert rows[i].tolist() == ids[win * 4:win * 4 + 4].tolist()
        halves = [data.local_batch(k, r, 2) for r in (0, 1)]  # each dp rank its own rows
        assert torch.equal(torch.cat(halves), rows)
    assert not torch.equal(data.batch_windows(0), data.batch_windows(2))
    again = TokenData(tmp_path / "train.bin", "uint16", 4, 4, seed=7)
    assert torch.equal(again.rows(again.batch_windows(3)), data.rows(data.batch_windows(3)))
    ordered = TokenData(tmp_path / "train.bin", "uint16", 4, 4, seed=7, shuffle=False)
    assert ordered.batch_windows(1).tolist() == [4, 5, 6, 7]


def test_npy_and_folders(tmp_path):
    np.save(tmp_path / "a.npy", np.arange(10, dtype=np.int64))  # 2 windows of 4
    ids = _bin(tmp_path / "b.bin", 8, np.uint32, top=70000)  # data.dtype uint32
    assert TokenData(tmp_path / "b.bin", "uint32", 4, 2, 0, shuffle=False).rows([1]).tolist() == [ids[4:].tolist()]
    data = TokenData(tmp_path / "a.npy", "uint16", 4, 2, seed=0, shuffle=False)
    assert data.rows([1]).tolist() == [[4, 5, 6, 7]]
    (tmp_path / "mix").mkdir()
    np.save(tmp_path / "mix" / "0.npy", np.arange(6, dtype=np.int32))  # 1 window: 0..3
    np.save(tmp_path / "mix" / "1.npy", np.arange(100, 108, dtype=np.int32))  # 2 windows
    data = TokenData(tmp_path / "mix", "uint16", 4, 3, seed=0, shuffle=False)
    assert data.rows([0, 1, 2]).tolist() == [[0, 1, 2, 3], [100, 101, 102, 103], [104, 105, 106, 107]]


def test_errors_name_the_file_and_the_fix(tmp_path):
    missing = tmp_path / "nope.bin"
    with pytest.raises(DataError, match=rf"data.path: {missing} does not exist; pass a .bin or .npy"):
        TokenData(missing, "uint16", 4, 2, 0)
    _bin(tmp_path / "small.bin", 7)
    with pytest.raises(DataError, match=r"small.bin holds 7 tokens = 1 windows of seq_len 4, fewer than "
                                        r"one batch of 2; use more data, a smaller --batch-size"):
        TokenData(tmp_path / "small.bin", "uint16", 4, 2, 0)
    ids = np.zeros(64, np.uint16)
    ids[37] = 300
    ids.tofile(tmp_path / "big.bin")
    with pytest.raises(DataError, match=r"big.bin holds token id 300 \(first bad one at position 37\) but "
                                        r"the model's vocabulary has 256 ids \(0..255\)"):
        TokenData(tmp_path / "big.bin", "uint16", 4, 2, 0, vocab_size=256)
    # negative ids (an .npy of int64): a tp2 program trained on them as rows from the end
    # of its vocabulary shard, where the model raises IndexError (a break test)
    np.save(tmp_path / "neg.npy", np.arange(64, dtype=np.int64) % 100 - 5)
    for vocab in (256, None):
        with pytest.raises(DataError, match=r"neg.npy holds token id -5 \(first negative one at "
                                            r"position 0\); token ids are 0 or more"):
            TokenData(tmp_path / "neg.npy", "uint16", 4, 2, 0, vocab_size=vocab)
    (tmp_path / "odd.bin").write_bytes(b"\0" * 7)
    with pytest.raises(DataError, match="odd.bin has 7 bytes, not a multiple of uint16's 2; set data.dtype"):
        TokenData(tmp_path / "odd.bin", "uint16", 2, 1, 0)
    (tmp_path / "text.txt").write_text("hello")
    with pytest.raises(DataError, match="text.txt is neither a .bin nor a .npy file"):
        TokenData(tmp_path / "text.txt", "uint16", 2, 1, 0)
    np.save(tmp_path / "two.npy", np.zeros((2, 8), np.int64))
    with pytest.raises(DataError, match=r"data.eval: .*two.npy must be a 1-D array of integer token ids"):
        TokenData(tmp_path / "two.npy", "uint16", 2, 1, 0, key="data.eval")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="the folder .*empty holds no .bin or .npy file"):
        TokenData(tmp_path / "empty", "uint16", 2, 1, 0)


def _lrs(sched_cfg, steps, lr=1.0, n=None):
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=lr)
    sched = make_schedule(opt, {"lr": lr, "schedule": sched_cfg}, steps)
    out = []
    for _ in range(n or steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out, opt, sched


def test_warmup_then_cosine_and_linear():
    lrs, _, _ = _lrs({"warmup_steps": 3, "decay": "cosine", "min_lr": 0.1}, 9, n=11)
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    for k in range(3, 9):  # cosine over decay_steps = 9 - 3, then min_lr
        assert lrs[k] == pytest.approx(0.1 + 0.9 * (1 + math.cos(math.pi * (k - 3) / 6)) / 2)
    assert lrs[9:] == pytest.approx([0.1, 0.1])
    lrs, _, _ = _lrs({"decay": "linear", "min_lr": 0.0, "decay_steps": 4}, 100, n=6)
    assert lrs == pytest.approx([1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    assert _lrs({}, 5)[0] == [1.0] * 5


def test_schedule_state_round_trips_exactly():
    cfg = {"warmup_steps": 2, "decay": "cosine", "min_lr": 0.01}
    want, _, _ = _lrs(cfg, 10)
    _, opt, sched = _lrs(cfg, 10, n=5)
    state = json.loads(json.dumps(sched.state_dict()))  # as the manifest stores it
    p = torch.nn.Parameter(torch.zeros(1))
    opt2 = torch.optim.SGD([p], lr=1.0)
    sched2 = make_schedule(opt2, {"lr": 1.0, "schedule": cfg}, 10)
    load_schedule_state(sched2, opt2, state)
    rest = []
    for _ in range(5):
        rest.append(opt2.param_groups[0]["lr"])
        opt2.step()
        sched2.step()
    assert want[5:] == rest  # bit-exact
