"""tp > 1 where no linear pairs but vocab_parallel shards the embedding and LM head (zoo 24
F3: an LSTM language model): the compile was refused with "no weight matrix could be
sharded ... Every rank would hold the whole model", false once vocab_parallel runs (with
``tensor_parallel.allow_replicated`` it sharded both and passed --verify). It compiles with
a warning saying only the vocabulary is sharded; with vocab_parallel off it is still the
refusal. A size tp does not divide names ``allow_replicated`` among its fixes."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from parallelizer.cli import parallelize as cli
from parallelizer.errors import PlanError
from parallelizer.planning.tp import plan_tp

from tp_small_models import Block, captured, x_batch

_LSTM_LM = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(61, 32)
        self.rnn = nn.LSTM(32, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 61)

    def forward(self, ids):
        return self.head(self.rnn(self.emb(ids))[0])


def build_model():
    torch.manual_seed(0)
    return Net()


def example_inputs():
    return (torch.randint(0, 61, (2, 8), generator=torch.Generator().manual_seed(0)),)


def loss_fn(out, batch):
    return F.cross_entropy(out[:, :-1].reshape(-1, 61), batch[0][:, 1:].reshape(-1))
'''


def _compile(tmp_path, capsys, *overrides):
    (tmp_path / "model.py").write_text(_LSTM_LM)
    (tmp_path / "spec.yaml").write_text("mesh: {tp: 2}\n")
    code = cli.main([str(tmp_path / "model.py"), str(tmp_path / "spec.yaml"), "-o",
                     str(tmp_path / "out"), *overrides])
    return code, capsys.readouterr()


def test_an_lstm_lm_shards_its_vocabulary_with_a_warning(tmp_path, capsys):
    code, io = _compile(tmp_path, capsys)
    assert code == 0, io.err
    assert ("vocab parallel: embedding emb.weight and LM head head.weight sharded over the "
            "vocabulary (61 rows)") in io.out, io.out
    # the ranks in lockstep against the model: outputs and gradients gathered to full shape
    assert "self-check: 2 tp rank(s) of the program against the model" in io.out, io.out
    assert ("warning: mesh.tp=2 shards only the vocabulary (emb.weight, head.weight, "
            "Shard(0)): no other weight matrix could be sharded (no linear layer feeds "
            "another") in io.err, io.err
    assert "rnn.weight_ih_l0 (128x32, read by aten.lstm.input at model.py:15" in io.err
    assert "so the rest of the model is replicated on every tp rank" in io.err


def test_with_vocab_parallel_off_it_is_still_refused(tmp_path, capsys):
    code, io = _compile(tmp_path, capsys, "tensor_parallel.vocab_parallel=false")
    assert code == 2, io.out
    assert io.err.startswith("error: mesh.tp=2 but no weight matrix could be sharded; no "
                             "linear layer feeds another"), io.err
    assert "set mesh.tp=1, or tensor_parallel.allow_replicated=true" in io.err
    assert not (tmp_path / "out").exists()


def test_an_indivisible_size_names_allow_replicated():
    """4 heads and an FFN of 37 at tp 3: nothing divides; the refusal offered tp 1 and the
    degrees that divide some sizes, not the key that runs at tp 3 anyway (zoo 24 F3's
    prime-width GPT, which then shards its vocabulary and passes --verify)."""
    torch.manual_seed(0)
    model = Block()
    model.mlp.gate, model.mlp.up = nn.Linear(32, 37, bias=False), nn.Linear(32, 37, bias=False)
    model.mlp.down = nn.Linear(37, 32, bias=False)
    graph = captured(model, x_batch()).gm.graph
    with pytest.raises(PlanError) as e:
        plan_tp(graph, 3)
    assert str(e.value).endswith(
        "keeps the others whole; or tensor_parallel.allow_replicated=true runs it replicated"
    ), str(e.value)
    assert plan_tp(graph, 3, allow_replicated=True).warnings[0].startswith(
        "mesh.tp=3 but no weight matrix could be sharded (the first op that stopped it: tp "
        "must divide the number of heads (4) of attn")
