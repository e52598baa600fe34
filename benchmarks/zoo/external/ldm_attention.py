"""ldm_attention (external): a Stable-Diffusion UNet attention stage as CompVis's
ldm/modules/attention.py and diffusionmodules/model.py write it, in plain PyTorch: a conv in,
an ``AttnBlock`` (GroupNorm, 1x1-conv q/k/v/proj_out, ``torch.bmm`` over the flattened
feature map), a ``SpatialTransformer`` (GroupNorm, 1x1 proj_in, ``BasicTransformerBlock``
with self- and cross-attention: to_q/to_k/to_v Linear without bias, heads split by
reshape/permute by hand, ``einsum('b i d, b j d -> b i j') * scale``, softmax, to_out
Linear + Dropout; a GEGLU feed-forward ``x * gelu(gate)`` from one Linear ``.chunk(2, -1)``;
proj_out back and the residual), a conv out; a context tensor as the second input; MSE.

Held-out zoo family (benchmarks/zoo). Compile it as the README says:
    parallelize model.py spec.yaml -o OUT
"""
import torch
import torch.nn.functional as F
from torch import einsum, nn

BATCH, CHANNELS, SIZE, CTX_LEN, CTX_DIM = 4, 32, 8, 6, 24


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


def Normalize(in_channels):
    return torch.nn.GroupNorm(num_groups=8, num_channels=in_channels, eps=1e-6, affine=True)


class GEGLU(nn.Module):
    def __init__(self, dim_in, dim_out):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out * 2)

    def forward(self, x):
        x, gate = self.proj(x).chunk(2, dim=-1)
        return x * F.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim, dim_out=None, mult=4, glu=False, dropout=0.):
        super().__init__()
        inner_dim = int(dim * mult)
        dim_out = default(dim_out, dim)
        project_in = nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU()) if not glu else GEGLU(dim, inner_dim)
        self.net = nn.Sequential(project_in, nn.Dropout(dropout), nn.Linear(inner_dim, dim_out))

    def forward(self, x):
        return self.net(x)


class CrossAttention(nn.Module):
    def __init__(self, query_dim, context_dim=None, heads=8, dim_head=64, dropout=0.):
        super().__init__()
        inner_dim = dim_head * heads
        context_dim = default(context_dim, query_dim)
        self.scale = dim_head ** -0.5
        self.heads = heads
        self.to_q = nn.Linear(query_dim, inner_dim, bias=False)
        self.to_k = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_v = nn.Linear(context_dim, inner_dim, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner_dim, query_dim), nn.Dropout(dropout))

    def forward(self, x, context=None, mask=None):
        h = self.heads
        q = self.to_q(x)
        context = default(context, x)
        k = self.to_k(context)
        v = self.to_v(context)
        # rearrange(t, 'b n (h d) -> (b h) n d', h=h), by hand
        q, k, v = map(lambda t: t.reshape(t.shape[0], t.shape[1], h, -1).permute(0, 2, 1, 3)
                      .reshape(t.shape[0] * h, t.shape[1], -1), (q, k, v))
        sim = einsum('b i d, b j d -> b i j', q, k) * self.scale
        attn = sim.softmax(dim=-1)
        out = einsum('b i j, b j d -> b i d', attn, v)
        # rearrange(out, '(b h) n d -> b n (h d)', h=h)
        out = out.reshape(-1, h, out.shape[1], out.shape[2]).permute(0, 2, 1, 3)
        out = out.reshape(out.shape[0], out.shape[1], -1)
        return self.to_out(out)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, n_heads, d_head, dropout=0., context_dim=None, gated_ff=True):
        super().__init__()
        self.attn1 = CrossAttention(query_dim=dim, heads=n_heads, dim_head=d_head, dropout=dropout)
        self.ff = FeedForward(dim, dropout=dropout, glu=gated_ff)
        self.attn2 = CrossAttention(query_dim=dim, context_dim=context_dim, heads=n_heads, dim_head=d_head,
                                    dropout=dropout)
        self.norm1 = nn.LayerNorm(dim)
        self.norm2 = nn.LayerNorm(dim)
        self.norm3 = nn.LayerNorm(dim)

    def forward(self, x, context=None):
        x = self.attn1(self.norm1(x)) + x
        x = self.attn2(self.norm2(x), context=context) + x
        x = self.ff(self.norm3(x)) + x
        return x


class SpatialTransformer(nn.Module):
    def __init__(self, in_channels, n_heads, d_head, depth=1, dropout=0., context_dim=None):
        super().__init__()
        self.in_channels = in_channels
        inner_dim = n_heads * d_head
        self.norm = Normalize(in_channels)
        self.proj_in = nn.Conv2d(in_channels, inner_dim, kernel_size=1, stride=1, padding=0)
        self.transformer_blocks = nn.ModuleList(
            [BasicTransformerBlock(inner_dim, n_heads, d_head, dropout=dropout, context_dim=context_dim)
             for d in range(depth)])
        self.proj_out = nn.Conv2d(inner_dim, in_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x, context=None):
        b, c, h, w = x.shape
        x_in = x
        x = self.norm(x)
        x = self.proj_in(x)
        x = x.permute(0, 2, 3, 1).reshape(b, h * w, -1)  # b c h w -> b (h w) c
        for block in self.transformer_blocks:
            x = block(x, context=context)
        x = x.reshape(b, h, w, -1).permute(0, 3, 1, 2)  # b (h w) c -> b c h w
        x = self.proj_out(x)
        return x + x_in


class AttnBlock(nn.Module):
    def __init__(self, in_channels):
        super().__init__()
        self.in_channels = in_channels
        self.norm = Normalize(in_channels)
        self.q = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.k = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.v = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)
        self.proj_out = torch.nn.Conv2d(in_channels, in_channels, kernel_size=1, stride=1, padding=0)

    def forward(self, x):
        h_ = x
        h_ = self.norm(h_)
        q = self.q(h_)
        k = self.k(h_)
        v = self.v(h_)
        # compute attention
        b, c, h, w = q.shape
        q = q.reshape(b, c, h * w)
        q = q.permute(0, 2, 1)   # b,hw,c
        k = k.reshape(b, c, h * w)  # b,c,hw
        w_ = torch.bmm(q, k)     # b,hw,hw    w[b,i,j]=sum_c q[b,i,c]k[b,c,j]
        w_ = w_ * (int(c) ** (-0.5))
        w_ = torch.nn.functional.softmax(w_, dim=2)
        # attend to values
        v = v.reshape(b, c, h * w)
        w_ = w_.permute(0, 2, 1)   # b,hw,hw (first hw of k, second of q)
        h_ = torch.bmm(v, w_)     # b, c,hw (hw of q) h_[b,c,j] = sum_i v[b,c,i] w_[b,i,j]
        h_ = h_.reshape(b, c, h, w)
        h_ = self.proj_out(h_)
        return x + h_


class UNetMidStage(nn.Module):
    def __init__(self, channels=CHANNELS, heads=4, context_dim=CTX_DIM, depth=2, dropout=0.1):
        super().__init__()
        self.conv_in = nn.Conv2d(4, channels, kernel_size=3, padding=1)
        self.attn = AttnBlock(channels)
        self.transformers = nn.ModuleList([
            SpatialTransformer(channels, heads, channels // heads, dropout=dropout, context_dim=context_dim)
            for _ in range(depth)])
        self.norm_out = Normalize(channels)
        self.conv_out = nn.Conv2d(channels, 4, kernel_size=3, padding=1)

    def forward(self, x, context, target):  # target: for loss_fn
        h = self.conv_in(x)
        h = self.attn(h)
        for st in self.transformers:
            h = st(h, context=context)
        return self.conv_out(F.silu(self.norm_out(h)))


def build_model():
    torch.manual_seed(0)
    return UNetMidStage()


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(BATCH, 4, SIZE, SIZE, generator=g),
            torch.randn(BATCH, CTX_LEN, CTX_DIM, generator=g),
            torch.randn(BATCH, 4, SIZE, SIZE, generator=g))


def loss_fn(outputs, batch):
    return F.mse_loss(outputs, batch[2])
