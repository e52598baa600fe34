"""A pydantic ValidationError of the spec as one paragraph a user can act on: per error the
dotted key, the value seen and what is allowed (the field's ``description``), an unknown key
with its closest allowed one, and the override that set it."""
from __future__ import annotations

import difflib
from typing import Any, Optional

from pydantic import BaseModel, ValidationError


def format_errors(err: ValidationError, sources: dict[str, str], root: type[BaseModel]) -> str:
    """One paragraph, one sentence per pydantic error, naming key, value and what is allowed;
    ``sources`` maps an override's dotted key to the override, cited when it set the value."""
    out = []
    for d in err.errors(include_url=False):
        key = ".".join(str(p) for p in d["loc"])
        origin = [o for k, o in sources.items() if key == k or key.startswith(k + ".")]
        text = _format_one(d, root)
        out.append(text[:-1] + f" (set by override '{origin[-1]}')." if origin else text)
    return " ".join(out)


def _format_one(d: dict, root: type[BaseModel]) -> str:
    loc = tuple(str(p) for p in d["loc"])
    key = ".".join(loc)
    if d["type"] == "extra_forbidden":
        return _unknown_key(loc, d["input"], root)
    if d["type"] == "value_error":  # a model-level validator (cross-field check)
        return str(d["ctx"]["error"])
    if not loc:  # top level not a mapping
        return f"the spec must be a mapping of {_keys_of(root)}, got {_show(d['input'])}."
    return f"{key} must be {_describe(loc, root)}, got {_show(d['input'])}."


def _unknown_key(loc: tuple[str, ...], value: Any, root: type[BaseModel]) -> str:
    parent = _model_at(loc[:-1], root)
    level = f"under {'.'.join(loc[:-1])}" if loc[:-1] else "at the top level"
    allowed = list(parent.model_fields) if parent else []
    close = difflib.get_close_matches(loc[-1], allowed, n=1, cutoff=0.5)
    hint = f" Did you mean '{'.'.join(loc[:-1] + (close[0],))}'?" if close else ""
    return (f"unknown key '{'.'.join(loc)}' (value {_show(value)}).{hint} "
            f"Allowed keys {level}: {', '.join(allowed)}.")


def _model_at(loc: tuple[str, ...], root: type[BaseModel]) -> Optional[type[BaseModel]]:
    """The schema model class at a dotted location, or None when it is not a section."""
    cls: Any = root
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, BaseModel)) or part not in cls.model_fields:
            return None
        cls = cls.model_fields[part].annotation
    return cls if isinstance(cls, type) and issubclass(cls, BaseModel) else None


def _describe(loc: tuple[str, ...], root: type[BaseModel]) -> str:
    """What is allowed at ``loc``: a section's keys or the field's description (a list
    item, ``pipeline.layers_per_stage.0``, is described by its list's field)."""
    while loc and loc[-1].isdigit():
        loc = loc[:-1]
    section = _model_at(loc, root)
    if section is not None:
        return f"a mapping with keys {_keys_of(section)}"
    parent = _model_at(loc[:-1], root)
    info = parent.model_fields.get(loc[-1]) if parent else None
    return (info.description if info and info.description else "a valid value")


def _keys_of(model: type[BaseModel]) -> str:
    return ", ".join(model.model_fields)


def _show(value: Any) -> str:
    """A value as the user wrote it in YAML (null, true, 'text', 3), cut to 60 characters."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
