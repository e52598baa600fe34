"""A trained weight read by two modules of one stage: outlined, each would hold its own
copy and split the gradient. Such a stage is compiled as one module (one FSDP unit, no
per-block activation checkpointing), said in report.md (passes/split_check.shared_weights),
where the weight is read by two blocks (ALBERT) or by the stage root and, under another
name, by a block (an embedding tied to the LM head and to a block's linear)."""
from __future__ import annotations

import textwrap
from pathlib import Path

from parallelizer.compiler import compile_model
from parallelizer.frontend.spec import load_spec

GPT = Path(__file__).resolve().parents[2] / "examples" / "gpt"


def _model(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "model.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_weights_shared_by_blocks_of_one_stage_compile_as_one_unit(tmp_path):
    """ALBERT-style sharing (one block object in every slot; Zamba2's shared transformer
    called from two of its layers) was refused: outlined, each block would hold its own
    copy of the weights and split their gradient. Such a stage is now one module (one
    gradient per weight), said in report.md; the self-check runs its tp ranks against the
    model. Across stages the tied path sums the gradients (tests/distributed/test_user_models.py
    runs it at pp2)."""
    path = _model(tmp_path, """
        import torch
        from torch import nn
        class Albert(nn.Module):
            def __init__(self):
                super().__init__()
                block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))
                self.layers = nn.ModuleList([block] * 3)
            def forward(self, x):
                for layer in self.layers:
                    x = x + layer(x)
                return x
        def build_model():
            torch.manual_seed(0)
            return Albert()
        def example_inputs():
            return (torch.randn(4, 5, 16),)
    """)
    program = compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=2"]))
    assert "- stage 0: layers.0.0.bias and 3 more read by blocks layers.0, layers.1, layers.2; " \
           "stage kept as one FSDP unit" in program.report, program.report
    assert program.plan.stages[0].blocks == ()



_TIED_INTO_A_BLOCK = """
    import torch
    import torch.nn.functional as F
    from torch import nn
    V, D = 64, 16
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.fc, self.proj = nn.LayerNorm(D), nn.Linear(D, V), nn.Linear(V, D)
        def forward(self, x):
            return x + self.proj(F.gelu(self.fc(self.norm(x))))
    class TiedLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(V, D)
            self.blocks = nn.ModuleList(Block() for _ in range(2))
            self.blocks[0].fc.weight = self.emb.weight  # (V, D): the same shape
        def forward(self, ids):
            x = self.emb(ids)
            for block in self.blocks:
                x = block(x)
            return x @ self.emb.weight.t()
    def build_model():
        torch.manual_seed(0)
        return TiedLM()
    def example_inputs():
        return (torch.randint(0, V, (4, 6), generator=torch.Generator().manual_seed(1)),)
"""


def test_a_weight_read_outside_the_blocks_and_inside_one_compiles_as_one_unit(tmp_path):
    """An embedding tied to the LM head and to block 0's linear was refused at tp2 with no
    pipeline: "a trained weight read both outside the blocks and inside one is not
    supported yet" (zoo 22 F1). The stage is now one module; the self-check runs each tp
    rank against the model (outputs and every gradient, fp32)."""
    path = _model(tmp_path, _TIED_INTO_A_BLOCK)
    program = compile_model(path, load_spec(GPT / "spec.yaml", ["mesh.tp=2"]))
    assert "- stage 0: emb.weight read outside the blocks and, under another name, inside " \
           "blocks.0; stage kept as one FSDP unit" in program.report, program.report
    assert program.plan.stages[0].blocks == ()
    assert any(n.startswith("self-check: 2 tp rank(s)") for n in program.notes), program.notes
