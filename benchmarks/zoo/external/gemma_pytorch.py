"""gemma_pytorch (external): Google's gemma_pytorch (gemma/model.py) as written: the embedding
scaled by sqrt(hidden_size) through a ``normalizer`` tensor, RMSNorm with ``(1 + weight)``,
GeGLU MLP (gate_proj, up_proj, down_proj, tanh-approximate gelu), GQA by
``torch.repeat_interleave``, rotary by complex ``freqs_cis``, attention by matmul and softmax
with a causal mask argument, final logit soft-capping ``tanh(logits / cap) * cap``, the
embedder's weight as the head (``hidden @ embedder.weight.t()``).

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import dataclasses
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, BATCH, SEQ = 96, 4, 16


@dataclasses.dataclass
class GemmaConfig:
    vocab_size: int = VOCAB
    max_position_embeddings: int = 64
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    hidden_size: int = 64
    intermediate_size: int = 128
    head_dim: int = 16
    rms_norm_eps: float = 1e-6
    final_logit_softcapping: Optional[float] = 30.0
    attn_logit_softcapping: Optional[float] = 50.0
    query_pre_attn_scalar: Optional[int] = 16
    rope_theta: float = 10000.0


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    """Precomputes the frequency cis."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[:(dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Applies the rotary embedding to the query and key tensors."""
    x_ = torch.view_as_complex(
        torch.stack(torch.chunk(x.transpose(1, 2).float(), 2, dim=-1), dim=-1))
    x_out = torch.view_as_real(x_ * freqs_cis).type_as(x)
    x_out = torch.cat(torch.chunk(x_out, 2, dim=-1), dim=-2)
    x_out = x_out.reshape(x_out.shape[0], x_out.shape[1], x_out.shape[2], -1).transpose(1, 2)
    return x_out


class Embedding(nn.Module):

    def __init__(self, num_embeddings: int, embedding_dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((num_embeddings, embedding_dim)), requires_grad=True)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        return F.embedding(x, self.weight)


class RMSNorm(torch.nn.Module):

    def __init__(self, dim: int, eps: float = 1e-6, add_unit_offset: bool = True):
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        # Llama does x.to(float16) * w whilst Gemma2 is (x * w).to(float16)
        output = self._norm(x.float())
        if self.add_unit_offset:
            output = output * (1 + self.weight.float())
        else:
            output = output * self.weight.float()
        return output.type_as(x)


class Linear(nn.Module):

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty((out_features, in_features)), requires_grad=True)
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x):
        return F.linear(x, self.weight)


class GemmaMLP(nn.Module):

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)

    def forward(self, x):
        gate = self.gate_proj(x)
        gate = F.gelu(gate, approximate="tanh")
        up = self.up_proj(x)
        fuse = gate * up
        outputs = self.down_proj(fuse)
        return outputs


class GemmaAttention(nn.Module):

    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        assert self.num_heads % self.num_kv_heads == 0
        self.num_queries_per_kv = self.num_heads // self.num_kv_heads
        self.hidden_size = config.hidden_size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        if config.query_pre_attn_scalar is not None:
            self.scaling = config.query_pre_attn_scalar ** -0.5
        else:
            self.scaling = self.head_dim ** -0.5
        self.qkv_proj = Linear(self.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)
        self.o_proj = Linear(self.num_heads * self.head_dim, self.hidden_size)
        self.attn_logit_softcapping = config.attn_logit_softcapping

    def forward(self, hidden_states: torch.Tensor, freqs_cis: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        hidden_states_shape = hidden_states.shape
        assert len(hidden_states_shape) == 3
        batch_size, input_len, _ = hidden_states_shape

        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)

        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)

        # Positional embedding.
        xq = apply_rotary_emb(xq, freqs_cis=freqs_cis)
        xk = apply_rotary_emb(xk, freqs_cis=freqs_cis)

        key = xk
        value = xv
        if self.num_kv_heads != self.num_heads:
            # [batch_size, max_seq_len, n_local_heads, head_dim]
            key = torch.repeat_interleave(key, self.num_queries_per_kv, dim=2)
            value = torch.repeat_interleave(value, self.num_queries_per_kv, dim=2)

        # [batch_size, n_local_heads, input_len, head_dim]
        q = xq.transpose(1, 2)
        # [batch_size, n_local_heads, max_seq_len, head_dim]
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)

        # [batch_size, n_local_heads, input_len, max_seq_len]
        q.mul_(self.scaling)
        scores = torch.matmul(q, k.transpose(2, 3))
        if self.attn_logit_softcapping is not None:
            scores = scores / self.attn_logit_softcapping
            scores = torch.tanh(scores)
            scores = scores * self.attn_logit_softcapping
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)

        # [batch_size, n_local_heads, input_len, head_dim]
        output = torch.matmul(scores, v)

        # [batch_size, input_len, hidden_dim]
        output = (output.transpose(1, 2).contiguous().view(batch_size, input_len, -1))
        output = self.o_proj(output)
        return output


class Gemma2DecoderLayer(nn.Module):

    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.self_attn = GemmaAttention(config)
        self.mlp = GemmaMLP(hidden_size=config.hidden_size, intermediate_size=config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, mask):
        # Self Attention
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = self.self_attn(hidden_states=hidden_states, freqs_cis=freqs_cis, mask=mask)
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = residual + hidden_states

        # MLP
        residual = hidden_states
        hidden_states = self.pre_feedforward_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        hidden_states = self.post_feedforward_layernorm(hidden_states)
        hidden_states = residual + hidden_states
        return hidden_states


class GemmaModel(nn.Module):

    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.config = config
        self.layers = nn.ModuleList([Gemma2DecoderLayer(config) for _ in range(config.num_hidden_layers)])
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, hidden_states, freqs_cis, mask):
        for layer in self.layers:
            hidden_states = layer(hidden_states=hidden_states, freqs_cis=freqs_cis, mask=mask)
        hidden_states = self.norm(hidden_states)
        return hidden_states


class GemmaForCausalLM(nn.Module):

    def __init__(self, config: GemmaConfig):
        super().__init__()
        self.config = config
        self.embedder = Embedding(config.vocab_size, config.hidden_size)
        self.model = GemmaModel(config)
        freqs_cis = precompute_freqs_cis(config.head_dim, config.max_position_embeddings * 2,
                                         theta=config.rope_theta)
        self.register_buffer('freqs_cis', freqs_cis)
        mask_tensor = torch.full((1, 1, config.max_position_embeddings, config.max_position_embeddings),
                                 -2.3819763e38).to(torch.float)
        self.register_buffer('mask', torch.triu(mask_tensor, diagonal=1))

    def forward(self, input_token_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_token_ids.shape[1]
        freqs_cis = self.freqs_cis[:seq_len]
        mask = self.mask[:, :, :seq_len, :seq_len]

        # [batch_size, input_len, hidden_size]
        hidden_states = self.embedder(input_token_ids)
        # Gemma normalizes the embedding by sqrt(hidden_size).
        # Gemma2 downcasts the below to float16 if the dtype is float16
        normalizer = torch.tensor(self.config.hidden_size ** 0.5, dtype=hidden_states.dtype)
        hidden_states = hidden_states * normalizer

        hidden_states = self.model(hidden_states=hidden_states, freqs_cis=freqs_cis, mask=mask)
        embedder_weight = self.embedder.weight
        logits = torch.matmul(hidden_states, embedder_weight.t())
        if self.config.final_logit_softcapping is not None:
            logits = logits / self.config.final_logit_softcapping
            logits = torch.tanh(logits)
            logits = logits * self.config.final_logit_softcapping
        return logits


def build_model():
    torch.manual_seed(0)
    return GemmaForCausalLM(GemmaConfig())


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return {"input_token_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)}


def loss_fn(outputs, batch):
    """Next-token cross-entropy on the soft-capped logits."""
    ids = batch["input_token_ids"]
    return F.cross_entropy(outputs[:, :-1].reshape(-1, outputs.size(-1)), ids[:, 1:].reshape(-1))
