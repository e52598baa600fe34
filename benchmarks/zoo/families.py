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
    external("dit", "facebookresearch/DiT: adaLN-Zero (SiLU + Linear(h, 6h) .chunk(6, dim=1), "
             "modulate), sinusoidal timestep MLP, label dropout by torch.rand, fused qkv, unpatchify"),
    external("mlp_mixer", "MLP-Mixer: token-mixing Linear over the patch dim after transpose(1, 2), "
             "channel-mixing MLP, dropout 0.1"),
    external("clip_dual", "openai/CLIP: nn.MultiheadAttention seq-first with a fill_(-inf).triu_(1) "
             "mask, Parameter projections used with @, logit_scale.exp(), contrastive loss"),
    external("ldm_attention", "CompVis ldm: GroupNorm + 1x1-conv q/k/v AttnBlock (bmm), "
             "SpatialTransformer with einsum CrossAttention and GEGLU, context input"),
    external("ft_transformer", "rtdl FT-Transformer: per-feature numerical tokenizer, categorical "
             "offsets buffer, CLS token appended, ReGLU, first block without attention norm"),
    external("moe_mistral", "mistral-src MoeLayer: topk, softmax over top-k, torch.where(selected "
             "== i) gather and index += per expert (data-dependent shapes)"),
    external("moe_mistral_dense", "moe_mistral with every expert on every token, combined by "
             "the top-k weights scattered to a dense matrix", of="moe_mistral",
             switch=("DENSE = False", "DENSE = True")),
    external("mingpt", "Karpathy's minGPT: separate key/query/value Linears, tril mask buffer "
             "with masked_fill(-inf) and manual softmax, attn dropout 0.1, loss in forward"),
    external("litgpt", "litgpt's CausalSelfAttention: fused attn viewed (B, T, groups, q_per_kv + 2, "
             "hs), k/v .expand to the groups, partial rotary 0.5, LLaMAMLP, hand RMSNorm"),
    external("gemma_pytorch", "google/gemma_pytorch: sqrt(hidden) normalizer tensor, (1 + w) "
             "RMSNorm, GeGLU, fused qkv split, repeat_interleave GQA, soft-capping, tied matmul head"),
    external("x_transformers", "lucidrains' x-transformers: GLU chunk(2) feed-forward, einsum "
             "rotary with rotate_half, qk-norm with per-head (heads, 1, 1) scale, einsum attention"),
    external("rwkv4", "RWKV-4 time-mix/channel-mix: ZeroPad2d token shift, time_mix_k/v/r, "
             "python-loop WKV recurrence, relu^2 channel-mix (attention-free)"),
    external("torch_encoder_cls", "nn.TransformerEncoder(norm_first, gelu, batch_first) with "
             "src_key_padding_mask, masked mean pooling, classification CE loss in forward"),
]

FAMILIES: dict[str, Family] = {f.name: f for f in (
    *decoders.FAMILIES, *encoders.FAMILIES, *vision.FAMILIES, *moe.FAMILIES, *EXTERNAL)}
