"""Every family of the held-out zoo, by name, in the order the table lists them."""
from __future__ import annotations

from . import decoders, encoders, moe, vision
from .family import Family, external

EXTERNAL = [
    external("nanogpt", "Karpathy's nanoGPT model.py: fused c_attn split, tied head, loss in "
             "forward with targets, dropout 0.1"),
    external("titan_llama", "torchtitan's Llama 3: complex64 freqs_cis buffer (torch.polar, "
             "view_as_complex), blocks in a ModuleDict, GQA by repeat_interleave, nn.RMSNorm"),
    external("cast_linear", "modded-nanogpt style: F.linear(x, self.weight.to(x.dtype)), "
             "weight-free F.rms_norm on q/k per head, rotary from cos/sin buffers, relu^2"),
    external("timm_vit", "timm's ViT: fused qkv reshape(B, N, 3, H, D).permute(2, 0, 3, 1, 4)"
             ".unbind(0), LayerScale, blocks in an nn.Sequential, class-token head"),
    external("torch_seq2seq", "torch's nn.Transformer encoder-decoder: packed in_proj, "
             "cross-attention in_proj_weight.split([E, 2E]), dropout 0.1"),
    external("perceiver_resampler", "Flamingo-style resampler: latents cross-attend with "
             "nn.MultiheadAttention kdim/vdim (in_proj_bias.chunk(3)), dropout 0.1"),
    external("detr_decoder", "DETR-style: conv backbone, learned queries, nn.TransformerDecoder "
             "cross-attention into the feature map, class and box heads"),
]

FAMILIES: dict[str, Family] = {f.name: f for f in (
    *decoders.FAMILIES, *encoders.FAMILIES, *vision.FAMILIES, *moe.FAMILIES, *EXTERNAL)}
