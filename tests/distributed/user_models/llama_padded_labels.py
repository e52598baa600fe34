"""A Llama called with labels= on a left-padded batch: the padding's labels are -100, spread
unevenly over the rows, so each dp x microbatch chunk's cross-entropy averages over a different
number of tokens. The program divides every chunk's sum by the whole batch's count
(runtime/token_mean.py), so its loss and gradients are the whole batch's."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96


def build_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (8, 12), generator=g)
    mask = torch.ones(8, 12, dtype=torch.long)
    for row, pad in ((0, 9), (1, 2), (4, 11), (6, 5)):  # left padding, uneven over the chunks
        mask[row, :pad] = 0
    labels = ids.masked_fill(mask == 0, -100)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
