"""Sweep every Hugging Face model type that neither the zoo nor the tests configure by hand.

For each model type of transformers' causal-LM, masked-LM, seq2seq-LM and image-classification
mappings not covered by ``benchmarks/zoo`` or ``tests/tp_zoo_models.py``: derive a tiny config
from the config class's own names (:func:`tiny_kwargs`), write the model.py a user would write
(:func:`benchmarks.zoo.family.hf`), check that the unmodified model runs forward and backward
here (else the family is skipped with a ``harness:`` reason: our harness, not the compiler),
then compile it at each layout as the zoo does (:func:`benchmarks.zoo.runner.run_one`): at
tp > 1 with ``--self-check`` (whatever the input's size: an image batch is past the default
bound), which checks the program's numerics against the unmodified model; under pp the
compile runs each stage on fake tensors. ``--verify`` also runs ``torchrun ... run.py --verify``.

    python -m benchmarks.zoo.sweep --list
    python -m benchmarks.zoo.sweep --json /tmp/sweep.json --keep /tmp/sweep   # hours on 2 cores
"""
from __future__ import annotations

import gc
import re
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from .classify import STATUSES
from .families import FAMILIES
from .family import VOCAB, Family, hf
from .runner import LAYOUTS, REPO, _write_json, counts, errors, run_one, table

MAPPINGS = (  # kind, transformers' mapping, example inputs (family._INPUTS)
    ("decoder", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "lm"),
    ("encoder", "MODEL_FOR_MASKED_LM_MAPPING_NAMES", "lm"),
    ("encoder-decoder", "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "seq2seq"),
    ("vision", "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "pixels_cls"),
)
IMAGE, LABELS = 32, 4
SWEEP_STATUSES = STATUSES + ("SKIP",)
MAX_PARAMS = 3_000_000

# The standard names (the config's attribute_map maps them onto its own) and their tiny values.
STANDARD = {"vocab_size": VOCAB, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64,
            "max_position_embeddings": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
            "decoder_start_token_id": 2}
FFN_NAMES = r"(intermediate_size|ffn_dim|^d_ff$|^n_inner$|^d_inner$|ffn_hidden_size|^hidden_dim$)"
# Family-specific names of the same sizes, by pattern; an int default is lowered to the value.
PATTERNS = [(re.compile(p), v) for p, v in (
    (r"(kv_heads|key_value_heads|kv_groups)$", 2),
    (r"(^|_)(n_heads?|num_heads|attention_heads)$", 4),
    (r"(^|_)(qk_rope_head_dim|qk_nope_head_dim)$", 4),
    (r"(^|_)(head_dim|d_kv|head_size|v_head_dim)$|^d_head$", 8),
    (r"(^|_)(layers|n_layers?|num_layers|num_hidden_layers)$", 2),
    (FFN_NAMES, 64),
    (r"(^|_)(hidden_size|d_model|n_embd|dim|embed_dim|embedding_size|d_embed|embedding_dim)$", 32),
    (r"(max_position_embeddings|^n_positions$|^n_ctx$|max_seq_len|max_\w*positions|"
     r"max_sequence_length)$", 64),
    (r"(q_lora_rank|kv_lora_rank|lora_rank)$", 16),
    (r"^(num_experts|n_routed_experts|num_local_experts|moe_num_experts)$", 4),
    (r"^(num_experts_per_tok|top_k|moe_topk|num_selected_experts)$", 2),
    (r"vocab_size", VOCAB),
    (r"^image_size$", IMAGE),
    (r"^patch_size$", 8),
)]
LISTS = [(re.compile(p), v) for p, v in ((r"depths$", 1), (r"(num_heads|attention_heads)$", 4),
                                          (r"(hidden_sizes|embed_dims?|hidden_dims)$", 32))]
SUB_MULTIMODAL = ("vision_config", "audio_config", "speech_config", "encoder_config", "decoder_config",
                  "vq_config", "perceiver_config")


def set_ffn(width: int) -> None:
    """Build every tiny config with FFN width ``width`` (``--ffn``)."""
    STANDARD["intermediate_size"] = width
    PATTERNS[:] = [(p, width if p.pattern == FFN_NAMES else v) for p, v in PATTERNS]


def set_heads(heads: int, kv_heads: int) -> None:
    """Build every tiny config with ``heads`` query heads and ``kv_heads`` kv heads of head_dim
    8 (``--heads``): the hidden size follows (``8 * heads``)."""
    hidden = 8 * heads
    STANDARD.update(num_attention_heads=heads, num_key_value_heads=kv_heads, hidden_size=hidden)
    value = {PATTERNS[0][0].pattern: kv_heads, PATTERNS[1][0].pattern: heads, PATTERNS[6][0].pattern: hidden}
    PATTERNS[:] = [(p, value.get(p.pattern, v)) for p, v in PATTERNS]
    LISTS[:] = [(p, heads if "heads" in p.pattern else hidden if "hidden" in p.pattern else v)
                for p, v in LISTS]


def covered_types() -> set[str]:
    """Model types the zoo's families and tests/tp_zoo_models.py build (by config class)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    by_class = {v: k for k, v in CONFIG_MAPPING_NAMES.items()}
    text = "\n".join(f.source for f in FAMILIES.values())
    text += (REPO / "tests" / "tp_zoo_models.py").read_text()
    return {by_class[c] for c in re.findall(r"\b(\w+Config)\(", text) if c in by_class}


def candidates() -> list[tuple[str, str, str, str]]:
    """(model type, kind, model class, inputs) of every uncovered type, each under its first
    mapping (causal LM before masked LM before seq2seq before image classification)."""
    import transformers.models.auto.modeling_auto as auto
    seen, out = covered_types(), []
    for kind, mapping, inputs in MAPPINGS:
        for mtype, cls in getattr(auto, mapping).items():
            if mtype not in seen:
                seen.add(mtype)
                out.append((mtype, kind, cls[0] if isinstance(cls, (tuple, list)) else cls, inputs))
    return out


def _lowered(name: str, default, patterns) -> object | None:
    for rx, value in patterns:
        if rx.search(name):
            if isinstance(default, bool) or default is None:
                return None
            if isinstance(default, int) and default > value:
                return value
            if isinstance(default, list) and default and all(isinstance(x, int) for x in default):
                return [value] * len(default)
            return None
    return None


def tiny_kwargs(config_cls, kind: str, sub: bool = False) -> dict:
    """The kwargs of a tiny ``config_cls``: the standard names it has (itself or through its
    attribute_map), then its own names of the same sizes lowered by pattern; a sub-config
    (``text_config``, T5Gemma's ``encoder``) likewise, as a dict, with ``use_cache=False``.
    Raises ValueError for a multimodal config."""
    default = config_cls()
    amap = getattr(config_cls, "attribute_map", {}) or {}
    have = default.to_dict()
    multimodal = [k for k in SUB_MULTIMODAL if have.get(k) is not None]
    if multimodal:
        raise ValueError(f"multimodal config ({', '.join(multimodal)})")
    kw = {k: v for k, v in STANDARD.items()
          if k in amap or (k in have and not isinstance(have[k], (list, tuple)))}
    for k in ("num_key_value_heads", "head_dim"):  # None: derived from the heads, keep it
        if k in kw and have.get(amap.get(k, k)) is None:
            kw.pop(k)
    mapped = {amap.get(k, k) for k in kw}
    per_layer: dict = {}
    for name, value in have.items():
        if name in mapped or name in kw or name.startswith("_"):
            continue
        inner = getattr(default, name, None)
        if isinstance(value, dict) and hasattr(inner, "to_dict") and hasattr(inner, "model_type"):
            kw[name] = tiny_kwargs(type(inner), kind, sub=True)  # a sub-config (text_config, ...)
            continue
        layers = have.get(amap.get("num_hidden_layers", "num_hidden_layers"))
        if isinstance(value, list) and value and all(isinstance(x, str) for x in value) \
                and len(value) == layers and "num_hidden_layers" in kw:
            per_layer[name] = value[:kw["num_hidden_layers"]]  # layer_types: one per layer
            continue
        new = _lowered(name, value, PATTERNS if not isinstance(value, list) else LISTS)
        if new is not None:
            kw[name] = new
    if per_layer:  # only where the config does not derive them from the layer count
        try:
            config_cls(**kw)
        except Exception:
            kw.update(per_layer)
    if "head_dim" in kw and "qk_rope_head_dim" in have:  # multi-head latent attention:
        kw["head_dim"] = kw.get("qk_rope_head_dim", have["qk_rope_head_dim"])  # rotary's dims
    if "kv_lora_rank" in have and "num_key_value_heads" in kw:  # latent attention: as many
        kw["num_key_value_heads"] = kw.get("num_attention_heads", STANDARD["num_attention_heads"])
    if kind == "encoder-decoder":
        kw.setdefault("decoder_start_token_id", STANDARD["decoder_start_token_id"])
    kw.pop("use_cache", None)
    if sub and "use_cache" in have:
        kw["use_cache"] = False  # hf() sets the top level's
    if kind == "vision":
        kw["num_labels"] = LABELS
    return kw


def family(mtype: str, kind: str, model_cls: str, inputs: str) -> Family:
    """The Family (model.py) of ``mtype``. Raises ValueError with the harness's reason."""
    import transformers as T
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    config_name = CONFIG_MAPPING_NAMES[mtype]
    if not hasattr(T, config_name) or not hasattr(T, model_cls):
        raise ValueError(f"{config_name} or {model_cls} not exported by transformers")
    config_cls, model = getattr(T, config_name), getattr(T, model_cls)
    kw = tiny_kwargs(config_cls, kind)
    attn = "sdpa" if getattr(model, "_supports_sdpa", False) else "eager"
    cache = "use_cache" in config_cls().to_dict()
    constants = f"IMAGE = {IMAGE}" if kind == "vision" else ""
    return hf(mtype, kind, f"auto-configured {model_cls} (benchmarks/zoo/sweep.py)", config_name,
              model_cls, kw, inputs=inputs, constants=constants, attn=attn, cache=cache)


def harness_check(fam: Family) -> str:
    """'' when the unmodified model builds tiny and runs forward and backward here, else why not
    (the loss as parallelizer takes it: outputs.loss, else the mean square of the first float)."""
    import torch
    ns: dict = {}
    try:
        exec(compile(fam.source, f"<{fam.name}/model.py>", "exec"), ns)
        with torch.device("meta"):
            n = sum(p.numel() for p in ns["build_model"]().parameters())
        if n > MAX_PARAMS:
            return f"config not tiny ({n:,} parameters)"
        model = ns["build_model"]()
        batch = ns["example_inputs"]()
        model.train()
        out = model(**batch)
        loss = getattr(out, "loss", None)
        if loss is None:
            first = out[0] if isinstance(out, (tuple, list)) else next(iter(out.values()))
            loss = first.float().pow(2).mean()
        loss.backward()
        if not torch.isfinite(loss):
            return f"loss is {loss.item()}"
        return ""
    except Exception as e:  # the model's own failure on our config: not the compiler's
        frame = traceback.extract_tb(e.__traceback__)[-1]
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''} " \
               f"[{Path(frame.filename).name}:{frame.lineno}]"
    finally:
        ns.clear()
        gc.collect()


def _skip(fam_name: str, kind: str, layout: str, reason: str) -> dict:
    comp = {"status": "SKIP", "tp": None, "error": reason, "source_line": "", "text": ""}
    return {"family": fam_name, "kind": kind, "layout": layout, "compile": comp, "run": None,
            "status": "SKIP", "error": "harness: " + reason}


def main(argv=None) -> int:
    import argparse
    p = argparse.ArgumentParser(prog="python -m benchmarks.zoo.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--types", default="", help="comma-separated model types (default: every uncovered one)")
    p.add_argument("--kinds", default="", help="comma-separated kinds (decoder, encoder, encoder-decoder, vision)")
    p.add_argument("--layouts", default="tp2,tp4,pp2", help="comma-separated, of %s (default: %%(default)s)"
                   % ", ".join(LAYOUTS))
    p.add_argument("--verify", action="store_true", help="also run torchrun ... run.py --verify")
    p.add_argument("--timeout", type=float, default=900, help="seconds per compile and per run")
    p.add_argument("--json", type=Path, default=None, help="write every record here, after each one")
    p.add_argument("--keep", type=Path, default=None, help="keep model.py, spec, out/ and logs under DIR")
    p.add_argument("--list", action="store_true", help="list the uncovered types and exit")
    p.add_argument("--write", type=Path, default=None,
                   help="write each model.py under DIR/TYPE/, print the harness check's verdict and exit")
    p.add_argument("--ffn", type=int, default=64,
                   help="the FFN width (intermediate_size and its names; default 64): 37, as "
                        "transformers' own test configs use, is a width tp does not divide")
    p.add_argument("--heads", default="4,2", metavar="H,K",
                   help="query heads and kv heads (head_dim 8, hidden 8 H; default 4,2): 6,3 "
                        "is a head count tp 4 does not divide and a kv count tp 2 does not")
    a = p.parse_args(argv)
    set_ffn(a.ffn)
    set_heads(*(int(x) for x in a.heads.split(",")))
    types = {t for t in a.types.split(",") if t}
    kinds = {k for k in a.kinds.split(",") if k}
    todo = [c for c in candidates() if (not types or c[0] in types) and (not kinds or c[1] in kinds)]
    layouts = [n for n in a.layouts.split(",") if n]
    if any(n not in LAYOUTS for n in layouts):
        print(f"error: layouts are of {', '.join(LAYOUTS)}", file=sys.stderr)
        return 2
    if a.list:
        for mtype, kind, cls, _ in todo:
            print(f"{mtype:28s} {kind:16s} {cls}")
        return 0
    workdir = a.keep or Path(tempfile.mkdtemp(prefix="pz-sweep-"))
    records: list[dict] = []
    t0 = time.time()
    checked = []  # (type, kind, family or None, harness reason), every type first
    for mtype, kind, cls, inputs in todo:
        try:
            fam = family(mtype, kind, cls, inputs)
            reason = harness_check(fam)
        except Exception as e:
            fam, reason = None, f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        print(f"{mtype:28s} {kind:16s} {'harness: ' + reason if reason else 'ok'}", flush=True)
        if a.write and fam is not None:
            fam.write(a.write / mtype)
        checked.append((mtype, kind, fam, reason))
    if a.write:
        return 0
    try:
        for lay in layouts:  # a whole layout before the next: partial results are whole columns
            for mtype, kind, fam, reason in checked:
                rec = (_skip(mtype, kind, lay, reason) if reason
                       else run_one(fam, LAYOUTS[lay], workdir, a.timeout, verify=a.verify,
                                    flags=("--self-check",) if LAYOUTS[lay].tp > 1 else ()))
                records.append(rec)
                secs = rec["compile"].get("seconds", 0) + (rec["run"] or {}).get("seconds", 0)
                print(f"[{time.time() - t0:6.0f}s] {mtype:24s} {lay:8s} {rec['status']:13s} {secs:5.0f}s "
                      f"{rec['error'][:150]}", flush=True)
                if not a.keep and not reason:
                    shutil.rmtree(workdir / mtype / lay, ignore_errors=True)
                if a.json:
                    _write_json(a.json, records, layouts, "zoo-sweep", SWEEP_STATUSES)
    finally:
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    if records:
        print("\n" + table(records, layouts) + "\n\n" + counts(records, layouts, SWEEP_STATUSES)
              + "\n\n" + errors(records))
    return 0


if __name__ == "__main__":
    sys.exit(main())
