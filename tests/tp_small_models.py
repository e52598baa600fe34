"""Small models the tensor-parallel planner and pass tests share (nanoGPT-style MLP, SwiGLU,
attention and block on hidden size ``H``), their example batches, and where a line of code
is in a test file (the source line a report names)."""
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from parallelizer.frontend.capture import capture

aten = torch.ops.aten
H = 32


def captured(model: nn.Module, batch):
    return capture(model, batch, Path(__file__))


def x_batch(b=2, t=5, seed=0):
    return (torch.randn(b, t, H, generator=torch.Generator().manual_seed(seed)),)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(H, 4 * H)
        self.fc2 = nn.Linear(4 * H, H)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(H, 64, bias=False)
        self.up = nn.Linear(H, 64, bias=False)
        self.down = nn.Linear(64, H, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    def __init__(self, n_head=4):
        super().__init__()
        self.n_head = n_head
        self.q, self.k, self.v, self.o = (nn.Linear(H, H) for _ in range(4))

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q = self.q(x).view(B, T, self.n_head, hd).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, hd).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, hd).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    """Pre-norm transformer block: the attention and MLP live under named submodules."""

    def __init__(self):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(H), nn.LayerNorm(H)
        self.attn = Attention()
        self.mlp = SwiGLU()

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def ids_batch(b=2, t=8, seed=0):
    return {"input_ids": torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))}



def tiny_llama():
    """transformers' LlamaForCausalLM: 4 query heads, 2 kv heads, tied embeddings, SDPA."""
    import pytest
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=64, hidden_size=H, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg).eval()


class LMLogits(nn.Module):
    """A transformers causal LM called on ``input_ids``, returning its logits only."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids):
        return self.lm(input_ids=input_ids).logits


def tiny_lm(family: str, **config) -> nn.Module:
    """transformers' ``{family}ForCausalLM`` built from ``{family}Config(**config)`` after
    ``torch.manual_seed(0)``, in eval mode, as :class:`LMLogits` (the test skips without
    transformers)."""
    import pytest
    transformers = pytest.importorskip("transformers")
    cfg = getattr(transformers, f"{family}Config")(**config)
    torch.manual_seed(0)
    return LMLogits(getattr(transformers, f"{family}ForCausalLM")(cfg).eval())


def line_of(path, code: str) -> int:
    """Line number of ``code`` in the file ``path`` (the source line a report names)."""
    return next(i for i, text in enumerate(Path(path).read_text().splitlines(), 1)
                if code in text and "line_of(" not in text)


def compile_steps(model: nn.Module, batch, spec: dict, mutate_tp=None):
    """The compiler's steps up to the stage graphs (parallelizer/analyse.py: analyse;
    compiler.py: plan, apply_passes), for tests that mutate a real plan or decision before the compile-time
    checks. ``mutate_tp(decision)`` edits the TPDecision before the passes apply it.
    Returns (analysis, planned, stages, sequence)."""
    from parallelizer import compiler
    from parallelizer.analyse import analyse
    from parallelizer.frontend.spec import Spec
    from parallelizer.passes.manager import PassManager

    spec_ = Spec.model_validate(spec)
    passes = PassManager(None)
    analysis = analyse(model, batch, Path(__file__), passes, pp=spec_.mesh.pp)
    planned = compiler.plan(analysis, spec_, passes)
    if mutate_tp is not None:
        mutate_tp(planned.tp)
    stages, sequence = compiler.apply_passes(analysis, planned, spec_, batch, passes)
    return analysis, planned, stages, sequence


class ConvBN(nn.Module):
    """A convolution and a BatchNorm1d (running statistics, ``num_batches_tracked``)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(4, 8, 3, padding=1)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.conv(x)).relu()


class Hyper(nn.Module):
    """A linear of a (small, H) weight a hypernetwork makes from the mean token (Ha et al.
    2016, "HyperNetworks", section 3.2): the output of a linear tp shards as a column."""

    def __init__(self, small: int = 4):
        super().__init__()
        self.small = small
        self.make = nn.Linear(H, small * H)

    def forward(self, x):
        return F.linear(x, self.make(x.mean((0, 1))).view(self.small, H))


class MLPThen(MLP):
    """A residual :class:`MLP` tp shards, then ``layer`` (``width`` output features) with a
    linear after it."""

    def __init__(self, layer: nn.Module, width: int):
        super().__init__()
        self.layer, self.out = layer, nn.Linear(width, H)

    def forward(self, x):
        x = x + super().forward(x)
        return x + self.out(torch.tanh(self.layer(x)))

