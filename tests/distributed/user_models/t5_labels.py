"""T5 (encoder-decoder) called with labels=: the loss is computed inside forward (0-dim
``outputs.loss``), and stage outputs include transposed, non-contiguous tensors."""
import torch
from transformers import T5Config, T5ForConditionalGeneration

VOCAB = 64


def build_model():
    torch.manual_seed(0)
    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0, use_cache=False,
                   decoder_start_token_id=0, pad_token_id=0)
    return T5ForConditionalGeneration(cfg)


def example_inputs():
    g = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(1, VOCAB, (4, 8), generator=g),
            "labels": torch.randint(1, VOCAB, (4, 8), generator=g)}
