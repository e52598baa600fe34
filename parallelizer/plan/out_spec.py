"""The model's output structure (a pytree ``TreeSpec``) as the plan stores it, JSON.

A ``typing.NamedTuple`` or ``collections.namedtuple`` (infini-transformer-pytorch's
``TransformerReturn``, torch's own ``return_types``) is a tuple to pytree, but torch
serialises one only under a name registered for its class ("Can't serialize TreeSpec of
namedtuple class ...": every layout of such a model was refused, zoo 18 Z2). Each is
registered under ``module.QualName`` before writing, and resolved from its module (imported,
or the model file the run has already loaded) before reading. A ``@dataclass`` output is no
pytree node until registered (:func:`register_dataclasses`, which the capture calls on the
outputs of a forward export refused): it is registered under the same name, and resolved
the same way before reading.
"""
from __future__ import annotations

import dataclasses
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
        ImportError: a namedtuple or dataclass whose module cannot be imported (names it).
    """
    names, classes = _type_names(json.loads(text))
    for name in names:
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            _register(_resolve(name, "namedtuple"), name)
    for name in classes:
        if name not in pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE:
            cls = _resolve(name, "class")
            if dataclasses.is_dataclass(cls):
                register_dataclasses([cls])
    return pytree.treespec_loads(text)


def register_dataclasses(classes) -> bool:
    """Register each ``@dataclass`` class of ``classes`` that pytree does not know as a node
    (``torch.export.register_dataclass``, serialized as ``module.QualName``), so that export
    can return it and the plan can store it: a forward returning ``Out(logits=..., aux=...)``
    was refused, "not a tensor" (zoo 24). True if any was registered."""
    new = [c for c in dict.fromkeys(classes) if isinstance(c, type)
           and dataclasses.is_dataclass(c) and c not in pytree.SUPPORTED_NODES]
    for cls in new:
        pytree.register_dataclass(cls, serialized_type_name=f"{cls.__module__}.{cls.__qualname__}")
    return bool(new)


def _register_classes(spec: pytree.TreeSpec) -> None:
    cls = spec.context  # a namedtuple node: its type is pytree's marker, its context the class
    if spec.type is pytree.namedtuple and cls not in pytree.SUPPORTED_SERIALIZED_TYPES:
        _register(cls, f"{cls.__module__}.{cls.__qualname__}")
    for child in spec.children():
        _register_classes(child)


def _register(cls, name: str) -> None:
    pytree._register_namedtuple(cls, serialized_type_name=name)


def _type_names(node) -> tuple[list[str], list[str]]:
    """The registered names in a dumped spec (``[version, tree]``): of its namedtuples, and
    of its other node types (a dataclass's)."""
    tuples, classes, todo = [], [], [node[1] if isinstance(node, list) else node]
    while todo:
        n = todo.pop()
        if n.get("type") == _NAMEDTUPLE:
            tuples.append(n["context"])
        elif n.get("type"):
            classes.append(n["type"])
        todo += n.get("children_spec") or []
    return tuples, classes


def _resolve(name: str, kind: str):
    """The class named ``module.QualName``: the longest prefix that is a module (in
    ``sys.modules``, as the model file is, or importable), then attributes. ``kind``: what
    the error calls it (a namedtuple, or a class: a dataclass)."""
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
    raise ImportError(f"the model's output is a {kind} {name}, whose module cannot be "
                      f"imported here; install it, or return a tuple or dict")
