"""Vision Hugging Face families the suite does not use (ViT is in the suite): 32 x 32 images,
dropout and drop-path at each config's default. Classifiers are called with ``labels=``."""
from __future__ import annotations

from .family import hf

IMAGE = "IMAGE = 32"


def vit_like(**over) -> dict:
    base = {"image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_size": 32,
            "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 64}
    base.update(over)
    return base


FAMILIES = [
    hf("swin", "vision", "shifted-window attention with a learned relative-position bias table "
       "indexed per window, patch merging between stages", "SwinConfig",
       "SwinForImageClassification",
       {"image_size": 32, "patch_size": 4, "num_channels": 3, "embed_dim": 32, "depths": [2, 2],
        "num_heads": [2, 4], "window_size": 4, "mlp_ratio": 2.0, "num_labels": 4},
       inputs="pixels_cls", constants=IMAGE, cache=False),
    hf("deit", "vision", "class and distillation tokens, two heads averaged (with teacher)",
       "DeiTConfig", "DeiTForImageClassificationWithTeacher", vit_like(num_labels=4),
       inputs="pixels", constants=IMAGE, cache=False),
    hf("beit", "vision", "relative position bias per layer, layer scale (lambda_1/2), mean "
       "pooling, q/v bias without k bias", "BeitConfig", "BeitForImageClassification",
       vit_like(use_relative_position_bias=True, use_mean_pooling=True, num_labels=4),
       inputs="pixels_cls", constants=IMAGE, cache=False),
    hf("dinov2", "vision", "layer scale, interpolated position embeddings, mask token",
       "Dinov2Config", "Dinov2Model", vit_like(mlp_ratio=2), inputs="pixels", loss="pooled",
       constants=IMAGE, cache=False),
    hf("clip_vision", "vision", "CLIP's vision tower: pre-LN, quick_gelu, class embedding, "
       "post-LayerNorm pooled output", "CLIPVisionConfig", "CLIPVisionModel", vit_like(),
       inputs="pixels", loss="pooled", constants=IMAGE, cache=False),
    hf("siglip_vision", "vision", "SigLIP's vision tower: attention-pooling head "
       "(nn.MultiheadAttention with a probe) over the patches", "SiglipVisionConfig",
       "SiglipVisionModel", vit_like(), inputs="pixels", loss="pooled", constants=IMAGE,
       cache=False),
    hf("convnext", "vision", "attention-free: 7x7 depthwise conv, channels-last LayerNorm, "
       "pointwise Linear pair (pwconv1/pwconv2), layer scale", "ConvNextConfig",
       "ConvNextForImageClassification",
       {"num_channels": 3, "patch_size": 4, "num_stages": 2, "hidden_sizes": [16, 32],
        "depths": [2, 2], "image_size": 32, "num_labels": 4},
       inputs="pixels_cls", constants=IMAGE, cache=False, attn="eager"),
]
