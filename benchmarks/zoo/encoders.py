"""Encoder and encoder-decoder Hugging Face families the suite does not use. Dropout stays at
each config's default (0.1 for most of them). Encoders are called as masked LMs with
``labels=`` (or their pretraining head), encoder-decoders as translation models with
``labels=`` (decoder inputs shifted from the labels inside forward)."""
from __future__ import annotations

from .family import VOCAB, hf

IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}


def bert_like(**over) -> dict:
    base = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "intermediate_size": 64, "max_position_embeddings": 64, "pad_token_id": 0}
    base.update(over)
    return base


def bart_like(**over) -> dict:
    """fairseq-style seq2seq config names (d_model, encoder_layers, ...)."""
    base = {"vocab_size": VOCAB, "d_model": 32, "encoder_layers": 2, "decoder_layers": 2,
            "encoder_attention_heads": 4, "decoder_attention_heads": 4, "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64, "max_position_embeddings": 64, "decoder_start_token_id": 2, **IDS}
    base.update(over)
    return base


ENCODERS = [
    hf("deberta_v2", "encoder", "disentangled relative attention (c2p + p2c over log buckets, "
       "share_att_key), relative embeddings shared by all layers (DeBERTa-v3 settings)",
       "DebertaV2Config", "DebertaV2ForMaskedLM",
       bert_like(relative_attention=True, position_buckets=8, max_relative_positions=16,
                 pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
                 position_biased_input=False), inputs="lm", cache=False, attn="eager"),
    hf("electra", "encoder", "embedding_size 16 < hidden 32 (embeddings_project linear), "
       "replaced-token-detection head with per-token labels", "ElectraConfig",
       "ElectraForPreTraining", bert_like(embedding_size=16), inputs="token_labels", cache=False),
    hf("distilbert", "encoder", "q_lin/k_lin/v_lin/out_lin, sa/output LayerNorms, no token types",
       "DistilBertConfig", "DistilBertForMaskedLM",
       {"vocab_size": VOCAB, "dim": 32, "n_layers": 2, "n_heads": 4, "hidden_dim": 64,
        "max_position_embeddings": 64, "pad_token_id": 0}, inputs="lm", cache=False),
    hf("xlm_roberta", "encoder", "positions from the padding mask (cumsum, padding_idx 1 offset), "
       "tied MLM head", "XLMRobertaConfig", "XLMRobertaForMaskedLM",
       bert_like(pad_token_id=1, max_position_embeddings=66), inputs="lm", cache=False),
    hf("mpnet", "encoder", "one relative-position bias table computed once and added to every "
       "layer's scores", "MPNetConfig", "MPNetForMaskedLM", bert_like(pad_token_id=1),
       inputs="lm", cache=False, attn="eager"),
    hf("mobilebert", "encoder", "bottleneck blocks (intra_bottleneck 16), 2 stacked FFNs, NoNorm "
       "(elementwise affine), trigram embedding concat", "MobileBertConfig", "MobileBertForMaskedLM",
       bert_like(embedding_size=16, intra_bottleneck_size=16, true_hidden_size=16,
                 num_feedforward_networks=2), inputs="lm", cache=False),
    hf("albert", "encoder", "one layer's weights shared by every layer (ALBERT), factorised "
       "embeddings (embedding_size 16)", "AlbertConfig", "AlbertForMaskedLM",
       bert_like(embedding_size=16), inputs="lm", cache=False),
    hf("modernbert", "encoder", "rotary, alternating local (window 8) / global attention, fused "
       "Wqkv, GeGLU Wi split by chunk, no biases", "ModernBertConfig", "ModernBertForMaskedLM",
       bert_like(global_attn_every_n_layers=2, local_attention=8, pad_token_id=0,
                 bos_token_id=1, eos_token_id=2, cls_token_id=1, sep_token_id=2),
       inputs="lm", cache=False),
    hf("roformer", "encoder", "rotary (sinusoidal) positions applied to q/k inside each layer",
       "RoFormerConfig", "RoFormerForMaskedLM", bert_like(embedding_size=32), inputs="lm",
       cache=False, attn="eager"),
    hf("convbert", "encoder", "mixed attention: half the heads are span-based dynamic "
       "convolutions (depthwise-separable conv1d), head_ratio 2", "ConvBertConfig",
       "ConvBertForMaskedLM", bert_like(embedding_size=32), inputs="lm", cache=False, attn="eager"),
]

ENCODER_DECODERS = [
    hf("bart", "encoder-decoder", "learned positions with offset 2, post-LN, tied embeddings, "
       "cross-attention", "BartConfig", "BartForConditionalGeneration", bart_like(),
       inputs="seq2seq"),
    hf("mbart", "encoder-decoder", "pre-LN with layernorm_embedding and final layer_norm, "
       "scaled embeddings", "MBartConfig", "MBartForConditionalGeneration",
       bart_like(scale_embedding=True), inputs="seq2seq"),
    hf("pegasus", "encoder-decoder", "sinusoidal positions (a fixed table), pre-LN",
       "PegasusConfig", "PegasusForConditionalGeneration", bart_like(), inputs="seq2seq"),
    hf("marian", "encoder-decoder", "sinusoidal positions, scaled embeddings, final_logits_bias "
       "buffer", "MarianConfig", "MarianMTModel", bart_like(decoder_start_token_id=0),
       inputs="seq2seq"),
    hf("m2m100", "encoder-decoder", "sinusoidal positions computed from the ids (padding offset)",
       "M2M100Config", "M2M100ForConditionalGeneration", bart_like(), inputs="seq2seq"),
    hf("whisper", "encoder-decoder", "audio encoder: conv1d stem (stride 2) over mel features, "
       "sinusoidal encoder positions, learned decoder positions", "WhisperConfig",
       "WhisperForConditionalGeneration",
       bart_like(num_mel_bins=16, max_source_positions=16, max_target_positions=64,
                 decoder_start_token_id=1, suppress_tokens=None, begin_suppress_tokens=None),
       inputs="audio", constants="MELS, FRAMES = 16, 32"),
    hf("umt5", "encoder-decoder", "T5 with a relative-attention bias in every layer (not only "
       "the first), gated-gelu FFN, untied head", "UMT5Config", "UMT5ForConditionalGeneration",
       {"vocab_size": VOCAB, "d_model": 32, "d_kv": 8, "d_ff": 64, "num_layers": 2,
        "num_heads": 4, "relative_attention_num_buckets": 8, "decoder_start_token_id": 0,
        "pad_token_id": 0, "eos_token_id": 2}, inputs="seq2seq"),
]

FAMILIES = ENCODERS + ENCODER_DECODERS
