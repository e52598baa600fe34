"""Import Hugging Face checkpoints and match their names onto a model's state_dict.

Formats read (the two the Hub uses for safetensors weights):

- a single ``model.safetensors`` (or any ``*.safetensors`` file given directly);
- a sharded checkpoint: ``model.safetensors.index.json`` whose ``weight_map`` maps each
  tensor name to the shard file holding it (``model-00001-of-00002.safetensors``).

Names in a checkpoint often differ from the model's ``state_dict()`` by one leading
prefix: a ``BertForMaskedLM`` checkpoint stores ``bert.encoder...`` while ``BertModel``
expects ``encoder...`` (and the reverse for task heads loaded from a base model).
:func:`match_to_model` resolves that prefix, tied-weight aliases and known-harmless
leftovers, and refuses anything else with a message listing the names involved.

Complex tensors written by ``parallelize export`` are real views named in the file's
``__metadata__["complex"]`` (:mod:`parallelizer.checkpoint.format`); they are read back
complex. A ``C64`` tensor of another writer is read as safetensors gives it.
"""
from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

import torch
from safetensors import safe_open

from parallelizer.checkpoint.format import complex_names, decode_file
from parallelizer.errors import CheckpointError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Checkpoint keys that older transformers versions saved as persistent buffers and current
# models recompute (non-persistent buffers): safe to drop when the model does not ask for them.
HARMLESS_UNEXPECTED_SUFFIXES = (
    "embeddings.position_ids",   # BERT-family, transformers < 4.31
    "rotary_emb.inv_freq",       # Llama-family, transformers < 4.31
    "attn.bias",                 # GPT-2 causal mask buffer
    "attn.masked_bias",          # GPT-2 masked-fill constant
)

_MAX_LISTED = 5


@dataclass(frozen=True)
class HFTensor:
    """A tensor of a Hugging Face safetensors file, known by its header only (``shape``);
    :meth:`read` maps it (lazily: pages are read when touched, and released with the
    returned tensor), so a converter can hold the whole checkpoint's index, not its data."""

    file: Path
    name: str
    shape: tuple
    complex: bool = False  # stored as its real view (``shape`` is the complex one)

    def read(self) -> torch.Tensor:
        """The tensor, with the dtype and shape stored in the file.

        Raises:
            CheckpointError: the file is unreadable or the tensor's data is; names both.
        """
        try:
            with safe_open(str(self.file), framework="pt") as f:
                t = f.get_tensor(self.name)
            return torch.view_as_complex(t) if self.complex else t
        except Exception as e:  # SafetensorError / OSError
            raise CheckpointError(f"cannot read tensor {self.name} from {self.file}: {e}") from e


def load_hf_state_dict(path, lazy: bool = False) -> dict:
    """Read every tensor of a Hugging Face safetensors checkpoint into CPU memory (with
    ``lazy``: only the headers, each tensor an :class:`HFTensor` to read when needed).

    Args:
        path: a ``.safetensors`` file, a ``model.safetensors.index.json`` file, or a folder
            holding ``model.safetensors`` or ``model.safetensors.index.json`` (the index wins
            when both are present, as in ``transformers``).

    Returns:
        checkpoint name -> tensor (or :class:`HFTensor`), with the dtype and shape stored in
        the file.

    Raises:
        CheckpointError: the path does not exist; the folder has neither file; the index is
            not valid JSON or has no ``weight_map``; the index names a shard that is missing
            or a tensor its shard does not hold; a file is unreadable or corrupt. Each message
            names the file.
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"Hugging Face checkpoint {path} does not exist")
    if path.is_dir():
        if (path / INDEX_FILE).is_file():
            return _load_sharded(path / INDEX_FILE, lazy)
        if (path / SINGLE_FILE).is_file():
            return _read_safetensors(path / SINGLE_FILE, lazy=lazy)
        found = sorted(p.name for p in path.iterdir())[:10]
        hint = ("; convert pytorch_model.bin to safetensors first"
                if any(n.startswith("pytorch_model") for n in found) else "")
        raise CheckpointError(
            f"folder {path} holds neither {SINGLE_FILE} nor {INDEX_FILE} "
            f"(found: {', '.join(found) or 'nothing'}){hint}")
    if path.name.endswith(".index.json"):
        return _load_sharded(path, lazy)
    return _read_safetensors(path, lazy=lazy)


def _read_safetensors(file: Path, names: Optional[Iterable[str]] = None, lazy: bool = False) -> dict:
    """All tensors of one safetensors ``file`` (or only ``names``), as CPU tensors (or
    :class:`HFTensor` with ``lazy``)."""
    try:
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            wanted = list(keys) if names is None else list(names)
            absent = [n for n in wanted if n not in keys]
            if absent:
                raise CheckpointError(
                    f"{file} does not hold {len(absent)} tensor(s) its index assigns to it: "
                    f"{_listed(absent)}")
            listed = complex_names(f.metadata())
            if lazy:
                return {n: _lazy(f, file, n, n in listed) for n in wanted}
            return decode_file({n: f.get_tensor(n) for n in wanted}, f.metadata())
    except CheckpointError:
        raise
    except Exception as e:  # safetensors raises SafetensorError / OSError / ValueError
        raise CheckpointError(f"cannot read safetensors file {file}: {e}") from e


def _lazy(f, file: Path, name: str, is_complex: bool) -> HFTensor:
    """An :class:`HFTensor` from an open file's header (a real view: the complex shape)."""
    shape = tuple(f.get_slice(name).get_shape())
    return HFTensor(file, name, shape[:-1] if is_complex else shape, is_complex)


def _load_sharded(index_file: Path, lazy: bool = False) -> dict:
    """Tensors of a sharded checkpoint, read shard by shard as its ``weight_map`` says."""
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"cannot read {index_file}: expected JSON with a 'weight_map' object ({e!r})") from e
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        by_shard.setdefault(shard, []).append(name)
    missing = [s for s in by_shard if not (index_file.parent / s).is_file()]
    if missing:
        raise CheckpointError(
            f"{index_file} names shard file(s) that do not exist in {index_file.parent}: "
            f"{_listed(sorted(missing))}")
    out: dict[str, torch.Tensor] = {}
    for shard, names in sorted(by_shard.items()):
        out.update(_read_safetensors(index_file.parent / shard, names, lazy))
    return out


def match_to_model(ckpt: dict, model_keys: list[str], aliases: dict,
                   shapes: Optional[dict] = None,
                   ignore: tuple[str, ...] = HARMLESS_UNEXPECTED_SUFFIXES) -> dict[str, torch.Tensor]:
    """Rename checkpoint tensors onto the model's state_dict names.

    A checkpoint key matches a model key when the names are equal, or differ by one leading
    prefix used consistently (``bert.`` stripped from the checkpoint, or added to it; the
    prefix is the one that matches the most keys). A tied alias (``aliases``: alias fqn ->
    canonical fqn, both in model names) missing from the checkpoint takes the canonical
    tensor, and the reverse. Checkpoint keys ending in one of ``ignore`` are dropped when
    the model does not ask for them; checkpoint copies of aliases the model does not list
    are dropped too.

    Args:
        ckpt: checkpoint name -> tensor or anything with a ``shape`` (from
            :func:`load_hf_state_dict`).
        model_keys: the model's ``state_dict()`` names.
        aliases: tied-weight alias fqn -> canonical fqn.
        shapes: optional model name -> expected shape; checked when given.
        ignore: name suffixes of checkpoint keys that may be left over.

    Returns:
        model name -> tensor for every name in ``model_keys`` (tensors are not copied).

    Raises:
        CheckpointError: a model key has no tensor, the checkpoint holds keys the model does
            not know, or a shape differs; lists up to 5 names of each kind with shapes.
    """
    model_set = set(model_keys)
    renamed = _apply_prefix(ckpt, model_set, aliases)
    out = {k: renamed[k] for k in model_keys if k in renamed}
    _fill_aliases(out, renamed, model_set, aliases)
    missing = [k for k in model_keys if k not in out]
    alias_names = set(aliases) | set(aliases.values())
    unexpected = [k for k in renamed if k not in model_set and k not in alias_names
                  and not any(k == s or k.endswith("." + s) for s in ignore)]
    bad_shapes = [(k, tuple(shapes[k]), tuple(out[k].shape)) for k in out
                  if shapes is not None and k in shapes and tuple(shapes[k]) != tuple(out[k].shape)]
    if missing or unexpected or bad_shapes:
        raise CheckpointError(_mismatch_message(missing, unexpected, bad_shapes, renamed, ckpt))
    return out


def _apply_prefix(ckpt: dict, model_set: set, aliases: dict) -> dict:
    """``ckpt`` renamed by the one leading prefix (stripped or added) that matches the most
    model keys; unchanged when exact names already match at least as many."""
    known = model_set | set(aliases) | set(aliases.values())
    exact = sum(k in known for k in ckpt)
    strip, add = Counter(), Counter()
    for k in ckpt:
        for i, c in enumerate(k):
            if c == "." and k[i + 1:] in known:
                strip[k[:i + 1]] += 1
    for m in known:
        for i, c in enumerate(m):
            if c == "." and m[i + 1:] in ckpt:
                add[m[:i + 1]] += 1
    best = max([(n, 0, p) for p, n in strip.items()] + [(n, 1, p) for p, n in add.items()],
               default=(0, 0, ""))
    if best[0] <= exact:
        return dict(ckpt)
    _, adding, prefix = best
    out: dict = {}
    for k, v in ckpt.items():
        if adding:
            new = prefix + k if (prefix + k in known or k not in known) else k
        else:
            new = k[len(prefix):] if k.startswith(prefix) else k
        if new in out:
            raise CheckpointError(
                f"checkpoint keys collide after {'adding' if adding else 'stripping'} the "
                f"prefix {prefix!r}: two keys map to {new!r}")
        out[new] = v
    return out


def _fill_aliases(out: dict, renamed: dict, model_set: set, aliases: dict) -> None:
    """Give a tied alias the canonical tensor (or the canonical the alias's), in place."""
    for alias, canonical in aliases.items():
        if alias in model_set and alias not in out:
            src = out.get(canonical, renamed.get(canonical))
            if src is not None:
                out[alias] = src
        if canonical in model_set and canonical not in out and alias in renamed:
            out[canonical] = renamed[alias]


def _mismatch_message(missing, unexpected, bad_shapes, renamed, ckpt) -> str:
    parts = ["checkpoint does not match the model:"]
    if missing:
        parts.append(f"{len(missing)} model key(s) missing from the checkpoint: {_listed(missing)}")
    if unexpected:  # named as the file names them, not as renamed by the prefix
        origin = {id(v): k for k, v in ckpt.items()}
        shown = [f"{origin.get(id(renamed[k]), k)} {tuple(renamed[k].shape)}" for k in unexpected]
        parts.append(f"{len(unexpected)} unexpected checkpoint key(s): {_listed(shown)}")
    if bad_shapes:
        shown = [f"{k}: model {m} vs checkpoint {c}" for k, m, c in bad_shapes]
        parts.append(f"{len(bad_shapes)} shape mismatch(es): {_listed(shown)}")
    sample = ", ".join(list(ckpt)[:3])
    parts.append(f"(checkpoint has {len(ckpt)} keys, e.g. {sample}); check that the checkpoint "
                 "belongs to this model and config")
    return "\n  ".join(parts)


def _listed(names: list) -> str:
    more = f", ... ({len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(str(n) for n in names[:_MAX_LISTED]) + more
