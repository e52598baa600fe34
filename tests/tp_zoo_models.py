"""Tiny seeded configs of Hugging Face families for the tensor-parallel model zoo
(tests/features/test_tp_zoo.py): 2 layers, hidden 32-64, dropout 0, sdpa attention.

Each builder returns ``(model, batch, loss_input)``: the model in train mode (dropout is 0),
a batch dict for ``model(**batch)``, and a function picking the tensor the test's loss reads
from the model's output.
"""
from __future__ import annotations

import torch
from torch import nn

V = 64  # vocab


def _ids(b=2, t=8, seed=0, name="input_ids"):
    return {name: torch.randint(0, V, (b, t), generator=torch.Generator().manual_seed(seed))}


def _logits(out):
    return out.logits


def _hidden(out):
    return out.last_hidden_state


def _seeded(make):
    torch.manual_seed(0)
    return make()


def gpt_neox():
    import transformers as T
    cfg = T.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=64, use_cache=False,
                          attn_implementation="sdpa", hidden_dropout=0.0, attention_dropout=0.0,
                          bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.GPTNeoXForCausalLM(cfg)), _ids, _logits


def falcon():
    """multi_query (1 kv head inside the fused query_key_value), old decoder architecture:
    FalconLinear computes ``x @ weight.T`` (+ bias)."""
    import transformers as T
    cfg = T.FalconConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                         bias=True, alibi=False, use_cache=False, attn_implementation="sdpa",
                         hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.FalconForCausalLM(cfg)), _ids, _logits


def phi():
    import transformers as T
    cfg = T.PhiConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64, use_cache=False,
                      attn_implementation="sdpa", resid_pdrop=0.0, embd_pdrop=0.0,
                      attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.PhiForCausalLM(cfg)), _ids, _logits


def gemma():
    """One kv head (multi-query): at tp=2 each rank holds a copy of it."""
    import transformers as T
    cfg = T.GemmaConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=8,
                        max_position_embeddings=64, use_cache=False, attn_implementation="sdpa",
                        attention_dropout=0.0, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.GemmaForCausalLM(cfg)), _ids, _logits


def opt():
    import transformers as T
    cfg = T.OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                      use_cache=False, attn_implementation="sdpa", dropout=0.0,
                      attention_dropout=0.0, layerdrop=0.0, pad_token_id=0, bos_token_id=1,
                      eos_token_id=2)
    return _seeded(lambda: T.OPTForCausalLM(cfg)), _ids, _logits


def bloom():
    import transformers as T
    cfg = T.BloomConfig(vocab_size=V, hidden_size=32, n_layer=2, n_head=4, use_cache=False,
                        hidden_dropout=0.0, attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.BloomForCausalLM(cfg)), _ids, _logits


def mistral():
    import transformers as T
    cfg = T.MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                          max_position_embeddings=64, sliding_window=None, use_cache=False,
                          attn_implementation="sdpa", attention_dropout=0.0,
                          bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.MistralForCausalLM(cfg)), _ids, _logits


def qwen2():
    import transformers as T
    cfg = T.Qwen2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        use_cache=False, attn_implementation="sdpa", attention_dropout=0.0,
                        bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.Qwen2ForCausalLM(cfg)), _ids, _logits


def gpt2():
    import transformers as T
    cfg = T.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4,
                       resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                       bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    return _seeded(lambda: T.GPT2LMHeadModel(cfg)), _ids, _logits


def t5():
    import transformers as T
    cfg = T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                     relative_attention_num_buckets=8, dropout_rate=0.0, use_cache=False,
                     decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)

    def batch(b=2, t=8, seed=0):
        return {**_ids(b, t, seed), **_ids(b, t, seed + 100, "decoder_input_ids")}
    return _seeded(lambda: T.T5ForConditionalGeneration(cfg)), batch, _logits


def vit():
    import transformers as T
    cfg = T.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32,
                      num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                      attn_implementation="sdpa")

    def batch(b=2, t=16, seed=0):
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(b, 3, 16, 16, generator=g)}
    return _seeded(lambda: T.ViTModel(cfg, add_pooling_layer=False)), batch, _hidden


def roberta():
    import transformers as T
    cfg = T.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                          intermediate_size=64, max_position_embeddings=64,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          attn_implementation="sdpa", pad_token_id=0)

    def batch(b=2, t=8, seed=0):
        ids = _ids(b, t, seed)["input_ids"].clamp(min=3)  # no padding tokens
        return {"input_ids": ids}
    return _seeded(lambda: T.RobertaModel(cfg, add_pooling_layer=False)), batch, _hidden


def electra():
    """ELECTRA with embedding_size < hidden_size: ``embeddings_project`` maps the embeddings
    to the blocks' width, and its output is the residual stream the first block adds to its
    attention output (it seeded a pair with that block's q/k/v, which left the block's
    output projection replicated: 11 of 12)."""
    import transformers as T
    cfg = T.ElectraConfig(vocab_size=V, embedding_size=16, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=64,
                          hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                          attn_implementation="sdpa", pad_token_id=0)

    def batch(b=2, t=8, seed=0):
        return {"input_ids": _ids(b, t, seed)["input_ids"].clamp(min=3)}
    return _seeded(lambda: T.ElectraModel(cfg)), batch, _hidden


class MixtralAttentionStack(nn.Module):
    """Two of Mixtral's attention layers (4 heads, 2 kv heads) over a hidden-state input,
    with the model's rotary embedding; the sparse MoE is not in the zoo."""

    def __init__(self):
        super().__init__()
        import transformers as T
        from transformers.models.mixtral import modeling_mixtral as M
        cfg = T.MixtralConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                              head_dim=8, num_hidden_layers=2, max_position_embeddings=64,
                              attention_dropout=0.0, attn_implementation="sdpa")
        self.layers = nn.ModuleList(M.MixtralAttention(cfg, i) for i in range(2))
        self.rotary = M.MixtralRotaryEmbedding(cfg)

    def forward(self, hidden_states):
        pos = torch.arange(hidden_states.shape[1]).unsqueeze(0)
        cos_sin = self.rotary(hidden_states, pos)
        for layer in self.layers:
            hidden_states = hidden_states + layer(hidden_states, cos_sin, None)[0]
        return hidden_states


def mixtral_attention():
    def batch(b=2, t=8, seed=0):
        g = torch.Generator().manual_seed(seed)
        return {"hidden_states": torch.randn(b, t, 32, generator=g)}
    return _seeded(MixtralAttentionStack), batch, lambda out: out


ZOO = {f.__name__: f for f in (gpt_neox, falcon, phi, gemma, opt, bloom, mistral, qwen2, gpt2,
                               t5, vit, roberta, electra, mixtral_attention)}


def _without_dropout(model):
    """The zoo compares one step with dropout 0 (tests/features/test_dropout.py covers dropout):
    nn.Dropout modules and float dropout attributes of attention modules (MiniLM keeps its
    checkpoint's 0.1) set to 0."""
    for mod in model.modules():
        if isinstance(mod, torch.nn.Dropout):
            mod.p = 0.0
        for attr, value in list(vars(mod).items()):
            if "dropout" in attr and isinstance(value, float):
                setattr(mod, attr, 0.0)
    return model


def _example(name):
    """An example of examples/ with its own example_inputs (every batch is that one)."""
    from pathlib import Path
    from parallelizer.frontend.model_file import build_model, load_model_file

    def make():
        module = load_model_file(Path(__file__).parents[1] / "examples" / name / "model.py")
        torch.manual_seed(0)
        model = _without_dropout(build_model(module, on_meta=False))
        inputs = module.example_inputs()

        def batch(b=None, t=None, seed=0):
            return dict(inputs) if isinstance(inputs, dict) else inputs
        return model, batch, None
    make.__name__ = f"example_{name}"
    return make


EXAMPLES = {f"example_{n}": _example(n) for n in ("gpt", "gpt2", "llama", "minilm")}


def qwen3():
    """Qwen3: an RMSNorm over head_dim on q and k (``q_norm`` / ``k_norm``, weight
    (head_dim,)) applied to the rank's heads: a Partial gradient under tp."""
    import transformers as T
    cfg = T.Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        max_position_embeddings=64, use_cache=False, attn_implementation="sdpa",
                        attention_dropout=0.0, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return _seeded(lambda: T.Qwen3ForCausalLM(cfg)), _ids, _logits


def olmo2():
    """OLMo-2: q/k RMS norms over the whole q/k projections (heads x head_dim) before the
    heads view, 2 kv heads: at tp 4 k_proj is computed whole and attention cuts each rank's
    copy of its kv head (not in ZOO: tests/features/test_self_check.py runs it)."""
    import transformers as T
    cfg = T.Olmo2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        use_cache=False, attn_implementation="sdpa", attention_dropout=0.0,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return _seeded(lambda: T.Olmo2ForCausalLM(cfg)), _ids, _logits


def bart():
    """BART: an encoder-decoder whose decoder's row_parallel linears (self- and
    cross-attention out_proj, fc2) have biases, and whose cross-attention k/v read the
    encoder's output in every decoder layer."""
    import transformers as T
    cfg = T.BartConfig(vocab_size=V, d_model=32, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                       decoder_ffn_dim=64, max_position_embeddings=64, dropout=0.0,
                       attention_dropout=0.0, activation_dropout=0.0, use_cache=False,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=2)

    def batch(b=2, t=8, seed=0):
        return {**_ids(b, t, seed), **_ids(b, t, seed + 100, "decoder_input_ids")}
    return _seeded(lambda: T.BartForConditionalGeneration(cfg)), batch, _logits


# families the zoo does not run, used by the gradient tests (tests/features/test_tp_gradients.py)
GRADIENT_FAMILIES = {f.__name__: f for f in (qwen3, bart)}
