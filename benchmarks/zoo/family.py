"""A zoo family: a name, its kind, what is new about it, and the text of its ``model.py``.

Hugging Face families are written from a config (:func:`hf`): the model.py a user would
write, building ``transformers.<Model>(<Config>(...))`` seeded, with the config's own dropout
(never zeroed), ``use_cache=False`` and sdpa attention where the family has it. Families from
outside Hugging Face are model.py files in ``external/`` (:func:`external`).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

EXTERNAL = Path(__file__).resolve().parent / "external"

VOCAB, BATCH, SEQ = 96, 4, 16
KINDS = ("decoder", "encoder", "encoder-decoder", "vision", "moe", "hybrid", "external")


@dataclass(frozen=True)
class Family:
    """One architecture of the zoo.

    ``source`` is the complete text of its model.py (the README's contract: ``build_model()``,
    ``example_inputs()``, optional ``loss_fn``).
    """
    name: str
    kind: str
    note: str
    source: str

    def write(self, directory: Path) -> Path:
        """``directory/model.py`` holding :attr:`source`; returns its path."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / "model.py"
        path.write_text(self.source)
        return path


# example_inputs() bodies by input kind (VOCAB, BATCH, SEQ and the generator g are in scope).
# Token ids start at 3: 0-2 are pad/bos/eos in every config here, so no padding is inferred.
_INPUTS = {
    "lm": '    ids = torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)\n'
          '    return {"input_ids": ids, "labels": ids.clone()}\n',
    "ids": '    return {"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}\n',
    "seq2seq": '    return {"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),\n'
               '            "labels": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}\n',
    "token_labels": '    return {"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),\n'
                    '            "labels": torch.randint(0, 2, (BATCH, SEQ), generator=g)}\n',
    "pixels": '    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g)}\n',
    "pixels_cls": '    return {"pixel_values": torch.randn(BATCH, 3, IMAGE, IMAGE, generator=g),\n'
                  '            "labels": torch.randint(0, 4, (BATCH,), generator=g)}\n',
    "audio": '    return {"input_features": torch.randn(BATCH, MELS, FRAMES, generator=g),\n'
             '            "labels": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g)}\n',
}

_LOSSES = {
    None: "",
    "hidden": '\n\ndef loss_fn(outputs, batch):\n'
              '    """Mean square of the last hidden state (a regression-style objective)."""\n'
              '    return outputs.last_hidden_state.pow(2).mean()\n',
    "pooled": '\n\ndef loss_fn(outputs, batch):\n'
              '    """Mean square of the pooled output."""\n'
              '    return outputs.pooler_output.pow(2).mean()\n',
}


_CACHE = "        use_cache=False,\n"


def _literal(value, indent: str) -> str:
    if isinstance(value, dict):
        inner = "".join(f"{indent}    {k!r}: {_literal(v, indent + '    ')},\n" for k, v in value.items())
        return "{\n" + inner + indent + "}"
    return repr(value)


def hf(name: str, kind: str, note: str, config: str, model: str, kwargs: dict, inputs: str = "lm",
       loss: str | None = None, model_args: str = "", constants: str = "", attn: str = "sdpa",
       cache: bool = True) -> Family:
    """A Hugging Face family: ``transformers.<model>(transformers.<config>(**kwargs))``.

    ``kwargs`` are the config's arguments (dropout left to the config's defaults unless a kwarg
    sets the family's published value); ``inputs`` a key of the example-input kinds;
    ``loss`` None (the model's own loss, or parallelizer's default) or a key of the losses;
    ``attn`` the attn_implementation ("sdpa", or "eager" where the family has no sdpa);
    ``cache`` whether the config has ``use_cache`` (set False: the README's rule).
    """
    args = "".join(f"        {k}={_literal(v, '        ')},\n" for k, v in kwargs.items())
    extra = f", {model_args}" if model_args else ""
    source = (
        f'"""{name} ({kind}): {note}\n\n'
        f'Held-out zoo family (benchmarks/zoo). Compile it as the README says:\n'
        f'    parallelize model.py spec.yaml -o OUT\n"""\n'
        f'import torch\nimport transformers as T\n\n'
        f'VOCAB, BATCH, SEQ = {VOCAB}, {BATCH}, {SEQ}\n{constants}\n\n'
        f'def build_model():\n'
        f'    torch.manual_seed(0)\n'
        f'    config = T.{config}(\n{args}'
        f'{_CACHE if cache else ""}'
        f'        attn_implementation={attn!r},\n'
        f'    )\n'
        f'    return T.{model}(config{extra})\n\n\n'
        f'def example_inputs():\n'
        f'    g = torch.Generator().manual_seed(1)\n'
        f'{_INPUTS[inputs]}'
        f'{_LOSSES[loss]}')
    return Family(name, kind, note, source)


def external(name: str, note: str, of: str | None = None, switch: tuple = ()) -> Family:
    """A model.py from ``external/<name>.py`` (plain PyTorch, outside Hugging Face); a
    variant is ``external/<of>.py`` with its module-level ``switch`` (old, new) line
    replaced, which must be there."""
    source = (EXTERNAL / f"{of or name}.py").read_text()
    if switch:
        old, new = switch
        if source.count(old) != 1:
            raise ValueError(f"zoo family {name}: {old!r} is not one line of {of}.py")
        source = source.replace(old, new)
    return Family(name, "external", note, source)
