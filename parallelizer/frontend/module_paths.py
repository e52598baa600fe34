"""Module paths in the captured graph's ``nn_module_stack`` as the model's FQNs: the planners
and passes place nodes by the parameters' names, so every path a node carries must be one
``named_modules()`` gives (frontend/capture.py applies it after export)."""
from __future__ import annotations

import re

import torch


def one_name_per_module(gm: torch.fx.GraphModule, model: torch.nn.Module) -> None:
    """Module paths in ``nn_module_stack`` as the first path ``named_modules()`` gives each
    module, where that path is never called: a module registered twice (Enformer's
    ``self._trunk = nn.Sequential(self.stem, self.conv_tower, ...)``) is called through one
    path and named, with its parameters, by the other; the planners and passes place nodes
    by the parameters' names."""
    first: dict = {}
    paths: dict = {}
    for name, m in model.named_modules(remove_duplicate=False):
        paths[name] = first.setdefault(id(m), name)
    called = {path for n in gm.graph.nodes
              for path, _kind in (n.meta.get("nn_module_stack") or {}).values()}
    # a first path that is called itself stays as it is: one block in every slot (ALBERT's
    # ModuleList([block] * 3)) is called through each slot, the stage check's evidence
    renamed = {p: q for p, q in paths.items() if p != q and q not in called}
    for path in called - paths.keys():  # reached through a slice of a ModuleList
        module = _module_at(model, path)
        if module is not None and id(module) in first:
            renamed[path] = first[id(module)]
    if not renamed:
        return
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if stack:
            node.meta["nn_module_stack"] = {
                k: (renamed.get(path, path), kind) for k, (path, kind) in stack.items()}


_SLICE = re.compile(r"slice\((None|-?\d+), (None|-?\d+), (None|-?\d+)\)")


def _module_at(model: torch.nn.Module, path: str):
    """The module ``nn_module_stack``'s ``path`` names, where export spells a slice of a
    ModuleList as a segment (``layers.slice(None, 4, None).0``: transformers' ``for layer in
    self.layers[:n]`` called through peft's PeftModel, whose paths then matched no FQN and
    the pipeline split found no block: an internal error, zoo 13 Z16); None when it names
    none."""
    module = model
    for part in filter(None, re.split(r"\.(?![^()]*\))", path)):
        cut = _SLICE.fullmatch(part)
        try:
            if cut:
                module = module[slice(*(None if a == "None" else int(a) for a in cut.groups()))]
            elif part.isdigit() and not hasattr(module, part):
                module = module[int(part)]
            else:
                module = getattr(module, part)
        except (AttributeError, IndexError, KeyError, TypeError):
            return None
    return module if isinstance(module, torch.nn.Module) else None
