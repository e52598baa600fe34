"""A tied LM head the tp plan already shards (OPT-350m's shape: the embedding narrower than the
hidden size, ``project_out`` to the embedding's width before the tied head).

The tp plan pairs ``project_out`` (column) with the head (row), splitting the tied table along
its embedding dim; vocab_parallel then split the same table along its rows too, and the
compile stopped on an internal error ("the gradient of emb.weight is Mixed over tp", a
held-out zoo's OPT at tp2, tp4 and tp2 x pp2). One tensor is split one way: vocab_parallel
stays off, saying why, and the compiled program passes its self-check (every tp rank against
the model: outputs and every gradient, fp32).
"""
import textwrap

from test_vocab_parallel import ids, planned

MODEL = textwrap.dedent("""
    import torch, torch.nn.functional as F
    from torch import nn

    V = 61


    class ProjectedTiedLM(nn.Module):
        def __init__(self, e=16, d=32):
            super().__init__()
            self.emb = nn.Embedding(V, e)
            self.project_in = nn.Linear(e, d, bias=False)
            self.fc1, self.fc2 = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)
            self.project_out = nn.Linear(d, e, bias=False)
            self.head = nn.Linear(e, V, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, input_ids):
            x = self.project_in(self.emb(input_ids))
            x = x + self.fc2(F.relu(self.fc1(x)))
            return self.head(self.project_out(x))


    def build_model():
        torch.manual_seed(0)
        return ProjectedTiedLM()


    def example_inputs():
        g = torch.Generator().manual_seed(1)
        return {"input_ids": torch.randint(0, V, (4, 8), generator=g)}


    def loss_fn(logits, batch):
        ids = batch["input_ids"]
        return F.cross_entropy(logits[:, :-1].reshape(-1, V), ids[:, 1:].reshape(-1))
""")


def test_a_tied_head_the_tp_plan_shards_keeps_vocab_parallel_off():
    scope: dict = {}
    exec(MODEL, scope)
    _cap, _gm, d, v = planned(scope["build_model"](), {"input_ids": ids()}, 2)
    assert "head.weight" in d.row and not v.vocab, (d.report, v.report)
    assert v.off == ("vocab_parallel: off (the tp plan shards the LM head head.weight as a "
                     "row_parallel linear (split along dim 1); one tensor is split one way); "
                     "the embedding table split as the tp plan splits its head")


def test_the_compile_passes_its_self_check_at_tp2(tools, tmp_path):
    (tmp_path / "model.py").write_text(MODEL)
    (tmp_path / "spec.yaml").write_text("mesh: {tp: 2, pp: 1}\n")
    res = tools.parallelize(tmp_path / "model.py", tmp_path / "spec.yaml", tmp_path / "out")
    assert res.code == 0, res.explain()
    assert "self-check: 2 tp rank(s) of the program against the model" in res.stdout, res.explain()
    assert "vocab_parallel: off (the tp plan shards the LM head" in res.stdout, res.explain()
