"""A tied Llama called with labels= whose vocabulary (1001) tp=2 does not divide: the table
is padded to 1002 rows (vocab_parallel), the in-graph cross-entropy runs on the logits' tp
shards, and the logits output is handed over sharded (gathered for --verify)."""
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 1001


def build_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=True, use_cache=False, attn_implementation="sdpa")
    return LlamaForCausalLM(cfg)


def example_inputs():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (4, 8), generator=g)
    labels = ids.clone()
    labels[:, :2] = -100  # ignored positions
    return {"input_ids": ids, "labels": labels}
