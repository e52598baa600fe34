"""The model's output structure (a pytree ``TreeSpec``) as the plan stores it, JSON.

A ``typing.NamedTuple`` or ``collections.namedtuple`` (infini-transformer-pytorch's
``TransformerReturn``, torch's own ``return_types``) is a tuple to pytree, but torch
serialises one only under a name registered for its class ("Can't serialize TreeSpec of
namedtuple class ...": every layout of such a model was refused, zoo 18 Z2). Each is
registered under ``module.QualName`` before writing, and resolved from its module (imported,
or the model file the run has already loaded) before reading.
"""
from __future__ import annotations

import importlib
import json
import sys

from torch.utils import _pytree as pytree

_NAMEDTUPLE = "collections.namedtuple"


def dumps(spec: pytree.TreeSpec) -> str:
    """``spec`` as JSON, its namedtuple classes registered first.

    Raises:
        NotImplementedError: a node type pytree cannot write (torch's message).
    """
    _register_classes(spec)
    return pytree.treespec_dumps(spec)


def loads(text: str) -> pytree.TreeSpec:
    """The TreeSpec :func:`dumps` wrote.

    Raises:
        ImportError: a namedtuple class whose module cannot be imported (names it).
    """
    for name in _namedtuple_names(json.loads(text)):
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            _register(_resolve(name), name)
    return pytree.treespec_loads(text)


def _register_classes(spec: pytree.TreeSpec) -> None:
    cls = spec.context  # a namedtuple node: its type is pytree's marker, its context the class
    if spec.type is pytree.namedtuple and cls not in pytree.SUPPORTED_SERIALIZED_TYPES:
        _register(cls, f"{cls.__module__}.{cls.__qualname__}")
    for child in spec.children():
        _register_classes(child)


def _register(cls, name: str) -> None:
    pytree._register_namedtuple(cls, serialized_type_name=name)


def _namedtuple_names(node) -> list[str]:
    """The registered names of the namedtuples in a dumped spec (``[version, tree]``)."""
    out, todo = [], [node[1] if isinstance(node, list) else node]
    while todo:
        n = todo.pop()
        if n.get("type") == _NAMEDTUPLE:
            out.append(n["context"])
        todo += n.get("children_spec") or []
    return out


def _resolve(name: str):
    """The class named ``module.QualName``: the longest prefix that is a module (in
    ``sys.modules``, as the model file is, or importable), then attributes."""
    parts = name.split(".")
    for i in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = sys.modules.get(module) or importlib.import_module(module)
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr, None)
        if obj is not None:
            return obj
    raise ImportError(f"the model's output is a namedtuple {name}, whose module cannot be "
                      f"imported here; install it, or return a tuple or dict")
