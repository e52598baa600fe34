"""moe_mistral (external): a top-2 mixture-of-experts decoder as mistral-src's moe.py and
model.py write it, in plain PyTorch: RMSNorm, wq/wk/wv/wo attention with GQA by
``repeat_interleave``, complex rotary (``torch.polar``, ``view_as_complex``), and a MoeLayer
over the flattened tokens: ``gate`` Linear, ``torch.topk``, a softmax over the top-k, then a
loop over experts gathering each one's tokens with ``torch.where(selected_experts == i)``
and accumulating ``results[batch_idx] += w * expert(inputs[batch_idx])`` (data-dependent
shapes). With ``DENSE = True`` (the zoo's moe_mistral_dense) every expert runs on every
token instead, weighted by the top-k softmax scattered back to a dense (tokens, experts)
matrix (``zeros_like(...).scatter``): no data-dependent shapes.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BATCH, SEQ = 96, 4, 16
DIM, N_HEADS, N_KV_HEADS, HIDDEN, N_LAYERS, N_EXPERTS, TOP_K = 32, 4, 2, 64, 2, 4, 2
DENSE = False  # every expert on every token, combined by the (sparse) gate weights


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    return torch.polar(torch.ones_like(freqs), freqs)  # complex64


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis[:, None, :]
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(-2)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(-2)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(keys: torch.Tensor, values: torch.Tensor, repeats: int, dim: int):
    keys = torch.repeat_interleave(keys, repeats=repeats, dim=dim)
    values = torch.repeat_interleave(values, repeats=repeats, dim=dim)
    return keys, values


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads = N_HEADS
        self.head_dim = DIM // N_HEADS
        self.n_kv_heads = N_KV_HEADS
        self.repeats = self.n_heads // self.n_kv_heads
        self.scale = self.head_dim ** -0.5
        self.wq = nn.Linear(DIM, N_HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, N_KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(N_HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs_cis):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        key, val = repeat_kv(xk, xv, self.repeats, dim=2)
        xq, key, val = xq.transpose(1, 2), key.transpose(1, 2), val.transpose(1, 2)
        output = F.scaled_dot_product_attention(xq, key, val, is_causal=True)
        output = output.transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoeLayer(nn.Module):
    def __init__(self, experts, gate, num_experts_per_tok):
        super().__init__()
        self.experts = nn.ModuleList(experts)
        self.gate = gate
        self.num_experts_per_tok = num_experts_per_tok

    def forward(self, inputs: torch.Tensor):
        gate_logits = self.gate(inputs)
        weights, selected_experts = torch.topk(gate_logits, self.num_experts_per_tok)
        weights = F.softmax(weights, dim=1, dtype=torch.float).to(inputs.dtype)
        results = torch.zeros_like(inputs)
        if DENSE:
            dense = torch.zeros_like(gate_logits).scatter(1, selected_experts, weights)
            for i, expert in enumerate(self.experts):
                results = results + dense[:, i, None] * expert(inputs)
            return results
        for i, expert in enumerate(self.experts):
            batch_idx, nth_expert = torch.where(selected_experts == i)
            results[batch_idx] += weights[batch_idx, nth_expert, None] * expert(inputs[batch_idx])
        return results


class TransformerBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = Attention()
        self.attention_norm = RMSNorm(DIM)
        self.ffn_norm = RMSNorm(DIM)
        self.feed_forward = MoeLayer(experts=[FeedForward() for _ in range(N_EXPERTS)],
                                     gate=nn.Linear(DIM, N_EXPERTS, bias=False), num_experts_per_tok=TOP_K)

    def forward(self, x, freqs_cis):
        r = self.attention(self.attention_norm(x), freqs_cis)
        h = x + r
        r = self.feed_forward(self.ffn_norm(h).view(-1, DIM)).view(h.shape)
        return h + r


class Transformer(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList([TransformerBlock() for _ in range(N_LAYERS)])
        self.norm = RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(DIM // N_HEADS, 128), persistent=False)

    def forward(self, input_ids, labels):  # labels: for loss_fn
        h = self.tok_embeddings(input_ids)
        freqs_cis = self.freqs_cis[: input_ids.shape[1]]
        for layer in self.layers:
            h = layer(h, freqs_cis)
        return self.output(self.norm(h)).float()


def build_model():
    torch.manual_seed(0)
    return Transformer()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)
    return (ids, ids.clone())


def loss_fn(outputs, batch):
    return F.cross_entropy(outputs[:, :-1].reshape(-1, VOCAB), batch[1][:, 1:].reshape(-1))
