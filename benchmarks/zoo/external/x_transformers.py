"""x_transformers (external): lucidrains' x-transformers decoder style: GLU feed-forward by one
Linear to 2 * inner and ``.chunk(2, dim=-1)``, rotary computed with ``einsum('i , j -> i j')``
and applied with ``rotate_half``, qk-norm (l2-normalised q and k per head times a learned
per-head scale of shape (heads, 1, 1)), attention by ``einsum('b h i d, b h j d -> b h i j')``
and a manual softmax with a causal mask, einops-free rearranges, dropout 0.1.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn.functional as F
from torch import einsum, nn

VOCAB, BATCH, SEQ = 96, 4, 16


def exists(val):
    return val is not None


def l2norm(t, groups=1):
    return F.normalize(t, p=2, dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1. / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer('inv_freq', inv_freq)

    def forward(self, seq_len, device):
        t = torch.arange(seq_len, device=device).type_as(self.inv_freq)
        freqs = einsum('i , j -> i j', t, self.inv_freq)
        freqs = torch.cat((freqs, freqs), dim=-1)
        return freqs


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs, scale=1):
    rot_dim, seq_len = freqs.shape[-1], t.shape[-2]
    freqs = freqs[-seq_len:, :]
    # partial rotary embeddings, Wang et al. GPT-J
    t, t_unrotated = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    return torch.cat((t, t_unrotated), dim=-1)


class GLU(nn.Module):
    def __init__(self, dim_in, dim_out, activation):
        super().__init__()
        self.act = activation
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * self.act(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, glu=True, dropout=0.):
        super().__init__()
        inner_dim = int(dim * mult)
        project_in = GLU(dim, inner_dim, nn.GELU()) if glu else nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU())
        self.ff = nn.Sequential(
            project_in,
            nn.Dropout(dropout),
            nn.Linear(inner_dim, dim),
        )

    def forward(self, x):
        return self.ff(x)


class Attention(nn.Module):
    def __init__(self, dim, dim_head=16, heads=4, causal=True, dropout=0., qk_norm=True, qk_norm_scale=10):
        super().__init__()
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.causal = causal
        inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_k = nn.Linear(dim, inner_dim, bias=False)
        self.to_v = nn.Linear(dim, inner_dim, bias=False)
        self.dropout = nn.Dropout(dropout)
        # cosine sim attention
        self.qk_norm = qk_norm
        if qk_norm:
            self.qk_norm_q_scale = nn.Parameter(torch.ones(heads, 1, dim_head))
            self.qk_norm_k_scale = nn.Parameter(torch.ones(heads, 1, dim_head))
            # learned per-head temperature, (heads, 1, 1)
            self.scale = nn.Parameter(torch.full((heads, 1, 1), float(qk_norm_scale)))
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, rotary_pos_emb=None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        # rearrange(t, 'b n (h d) -> b h n d', h = h)
        q, k, v = map(lambda t: t.reshape(b, n, h, -1).permute(0, 2, 1, 3), (q, k, v))

        if self.qk_norm:
            q, k = map(l2norm, (q, k))
            q = q * self.qk_norm_q_scale
            k = k * self.qk_norm_k_scale

        if exists(rotary_pos_emb):
            q = apply_rotary_pos_emb(q, rotary_pos_emb)
            k = apply_rotary_pos_emb(k, rotary_pos_emb)

        dots = einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        mask_value = -torch.finfo(dots.dtype).max
        if self.causal:
            i, j = dots.shape[-2:]
            causal_mask = torch.ones((i, j), dtype=torch.bool, device=x.device).triu(j - i + 1)
            dots = dots.masked_fill(causal_mask, mask_value)

        attn = dots.softmax(dim=-1)
        attn = self.dropout(attn)
        out = einsum('b h i j, b h j d -> b h i d', attn, v)
        # rearrange(out, 'b h n d -> b n (h d)')
        out = out.permute(0, 2, 1, 3).reshape(b, n, -1)
        return self.to_out(out)


class Decoder(nn.Module):
    def __init__(self, dim, depth, heads, dim_head, attn_dropout=0.1, ff_dropout=0.1, rotary_emb_dim=8):
        super().__init__()
        self.rotary_pos_emb = RotaryEmbedding(rotary_emb_dim)
        self.layers = nn.ModuleList([])
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                nn.LayerNorm(dim),
                Attention(dim, dim_head=dim_head, heads=heads, dropout=attn_dropout),
                nn.LayerNorm(dim),
                FeedForward(dim, dropout=ff_dropout),
            ]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x):
        rotary_pos_emb = self.rotary_pos_emb(x.shape[1], x.device)
        for norm1, attn, norm2, ff in self.layers:
            x = attn(norm1(x), rotary_pos_emb=rotary_pos_emb) + x
            x = ff(norm2(x)) + x
        return self.final_norm(x)


class TransformerWrapper(nn.Module):
    def __init__(self, num_tokens, max_seq_len, dim, depth, heads, dim_head, emb_dropout=0.1):
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.emb_dropout = nn.Dropout(emb_dropout)
        self.attn_layers = Decoder(dim, depth, heads, dim_head)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, x):
        x = self.token_emb(x)
        x = self.emb_dropout(x)
        x = self.attn_layers(x)
        return self.to_logits(x)


def build_model():
    torch.manual_seed(0)
    return TransformerWrapper(num_tokens=VOCAB, max_seq_len=64, dim=64, depth=2, heads=4, dim_head=16)


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),)


def loss_fn(outputs, batch):
    """AutoregressiveWrapper's loss: cross-entropy of logits[:, :-1] against tokens[:, 1:]."""
    (x,) = batch
    logits = outputs[:, :-1]
    return F.cross_entropy(logits.transpose(1, 2), x[:, 1:])
