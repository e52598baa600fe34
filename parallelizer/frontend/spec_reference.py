"""docs/spec.md, rendered from the schema of :mod:`parallelizer.frontend.spec`.

Every key's row is its field's ``description`` (the "what is allowed" phrase a SpecError
quotes) followed by its ``json_schema_extra["doc"]`` (what it does beyond that), so the
reference cannot drift from the validator: ``tests/unit/frontend/test_spec_reference.py`` fails when
``docs/spec.md`` differs from :func:`render` or a field has no description. Regenerate with::

    python -m parallelizer.frontend.spec_reference > docs/spec.md
"""
from __future__ import annotations

import re
from typing import Any, Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from parallelizer.frontend.spec import Spec

COMMAND = "python -m parallelizer.frontend.spec_reference > docs/spec.md"

_INTRO = """\
# Spec reference

<!-- Generated from the field descriptions of parallelizer/frontend/spec.py by
`{command}`; tests/unit/frontend/test_spec_reference.py fails when this file is stale. -->

A spec is YAML read with OmegaConf, so `${{...}}` interpolation works, and `${{package:NAME}}`
gives the directory of the installed Python package NAME. Any key can be overridden after the
spec on the command line (`parallelize model.py spec.yaml -o out mesh.tp=2 optimizer.lr=3e-4`;
values parse as YAML). Unknown keys, wrong types and out-of-range values are errors that name
the dotted key, the value and what is allowed (the *allowed* phrase below is the one the error
quotes). The world size is `mesh.dp x mesh.tp x mesh.pp`: pass it to `torchrun --nproc-per-node`.
Every key has a default: an empty spec is valid (one process, no parallelism).
"""


def sections() -> Iterator[tuple[str, FieldInfo, type[BaseModel]]]:
    """(dotted name, field, model) of every section of :class:`Spec`, the top level first
    as ``("", None, Spec)``, then depth-first in declaration order."""
    def walk(prefix: str, info: Any, model: type[BaseModel]):
        yield prefix, info, model
        for name, field in model.model_fields.items():
            if _section(field):
                yield from walk(f"{prefix}{name}.", field, field.annotation)
    yield from walk("", None, Spec)


def fields() -> Iterator[tuple[str, FieldInfo]]:
    """(dotted key, field) of every field of :class:`Spec`, sections included."""
    for prefix, _, model in sections():
        for name, field in model.model_fields.items():
            yield prefix + name, field


def _section(field: FieldInfo) -> bool:
    return isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)


def _default(value: Any) -> str:
    """A default as written in YAML: null, true, 1f1b, 0.001."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _cell(text: str) -> str:
    """One table cell: one line, ``|`` escaped, ``docs/X.md`` as a link beside this page."""
    text = " ".join(text.split()).replace("|", "\\|")
    return re.sub(r"\bdocs/([\w-]+\.md)", r"[\1](\1)", text)


def _row(key: str, field: FieldInfo) -> str:
    doc = (field.json_schema_extra or {}).get("doc", "") if isinstance(field.json_schema_extra, dict) else ""
    what = _cell(field.description or "")
    if doc:
        what += ". " + _cell(doc)
    return f"| `{key}` | `{_default(field.default)}` | {what} |"


def render() -> str:
    """The whole of docs/spec.md: the intro, then per section its description and a table of
    its keys (key, default, allowed value and what it does)."""
    out = [_INTRO.format(command=COMMAND)]
    for prefix, info, model in sections():
        leaves = [(n, f) for n, f in model.model_fields.items() if not _section(f)]
        if not leaves:
            continue
        title = f"`{prefix[:-1]}`" if prefix else "Top level"
        out.append(f"## {title}\n")
        if info is not None:
            text = _cell(info.description or "")
            out.append(text[:1].upper() + text[1:] + ".\n")
        out.append("| key | default | allowed; what it does |")
        out.append("|---|---|---|")
        out.extend(_row(prefix + name, field) for name, field in leaves)
        out.append("")
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
