"""Parameters a model reads through a plain attribute (a list, tuple or dict a submodule
holds: ``self.shared = [table]``, ``self.tied = {"w": emb.weight}``) rather than through
the module that registers them. Non-strict torch.export swaps registered parameters for its
traced values by their module path, so such a read is a tensor it does not know: it lifts
it as a constant (``blocks.0.lifted_tensor_0``), and the program computed no gradient for
the parameter, which never trained (the compile warned it "not used by forward"). The
model's own forward reads the parameter itself, so the graph reads it as a parameter too.
"""
from __future__ import annotations

import torch


def held_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(FQN, parameter) for each registered parameter some submodule also holds in a plain
    attribute, directly or in a list, tuple or dict (one level)."""
    fqn_of = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqn_of.setdefault(id(p), (name, p))
    found = {}
    for m in model.modules():
        for key, value in vars(m).items():
            if key.startswith("_"):  # the module's own registries and torch's state
                continue
            items = value.values() if isinstance(value, dict) else value \
                if isinstance(value, (list, tuple)) else (value,)
            for t in items:
                if isinstance(t, torch.Tensor) and id(t) in fqn_of:
                    found[id(t)] = fqn_of[id(t)]
    return list(found.values())


def read_as_parameters(gm: torch.fx.GraphModule, held: list) -> list[str]:
    """Point every read of a constant that export lifted from one of ``held`` (the same
    storage, shape, strides and dtype) at the parameter, registered in ``gm`` under its
    FQN; the constants are removed. Returns the FQNs so read."""
    if not held:
        return []
    params = dict(gm.named_parameters(remove_duplicate=False))
    found = []
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node.target in params:
            continue
        value = _attr(gm, node.target)
        fqn = next((f for f, p in held if f in params and _same_tensor(value, p)), None)
        if fqn is None:
            continue
        old, node.target = node.target, fqn
        found.append(fqn)
        if not any(n.op == "get_attr" and n.target == old for n in gm.graph.nodes):
            owner, _, name = old.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, name)
    if found:
        gm.graph.lint()
        gm.recompile()
    return sorted(set(found))


def _attr(gm, target: str):
    owner, _, name = target.rpartition(".")
    try:
        return getattr(gm.get_submodule(owner) if owner else gm, name)
    except AttributeError:
        return None


def _same_tensor(a, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and not isinstance(a, torch.nn.Parameter) \
        and a.device == b.device and a.dtype == b.dtype and a.shape == b.shape \
        and a.stride() == b.stride() and a.data_ptr() == b.data_ptr()
