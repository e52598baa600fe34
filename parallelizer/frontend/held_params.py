"""Parameters a model reads through a plain attribute (a list, tuple or dict a submodule
holds: ``self.shared = [table]``, ``self.tied = {"w": emb.weight}``) rather than through
the module that registers them. Non-strict torch.export swaps registered parameters for its
traced values by their module path, so such a read is a tensor it does not know: it lifts
it as a constant (``blocks.0.lifted_tensor_0``), and the program computed no gradient for
the parameter, which never trained (the compile warned it "not used by forward"). The
model's own forward reads the parameter itself, so the graph reads it as a parameter too.
"""
from __future__ import annotations

import types

import torch


def held_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(FQN, parameter) for each registered parameter some module also holds outside its
    registries: in a plain attribute, a list, tuple or dict, or an object those hold, up to
    :data:`DEPTH` levels below the module; a module found there that is not registered is
    searched the same way. keras 3's torch backend keeps each weight in a ``Variable`` whose
    ``_value`` is the parameter its root's ``ParameterDict`` registers, and its sublayers in
    lists (``_layers``). A copy (``w.detach()``, ``w.clone()``) is another tensor and is not
    matched: the model's forward reads it without a gradient, and so does the graph."""
    fqn_of = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        fqn_of.setdefault(id(p), (name, p))
    found, seen = {}, set()
    modules = list(model.modules())
    seen.update(id(m) for m in modules)
    registered = set(seen)
    while modules:
        m = modules.pop()
        for key, value in vars(m).items():
            # an unregistered module's own registries hold parameters export does not swap
            if key not in _MODULE_STATE or id(m) not in registered and key in _REGISTRIES:
                _walk(value, DEPTH, fqn_of, found, seen, modules)
    return list(found.values())


# how far below a module's attribute the walk looks: Variable._value in a list is 3 levels
DEPTH = 3
# torch.nn.Module's own state (registries, hooks, flags): the registries are what export
# swaps; the rest holds no model tensor
_MODULE_STATE = frozenset(vars(torch.nn.Module()))
_REGISTRIES = ("_parameters", "_modules")
_LEAVES = (str, bytes, int, float, complex, bool, type(None), type, types.ModuleType,
           types.FunctionType, types.BuiltinFunctionType, types.MethodType, torch.dtype,
           torch.device)


def _walk(value, depth: int, fqn_of: dict, found: dict, seen: set, modules: list) -> None:
    if isinstance(value, torch.Tensor):
        if id(value) in fqn_of:
            found[id(value)] = fqn_of[id(value)]
        return
    if isinstance(value, _LEAVES) or id(value) in seen:
        return
    if isinstance(value, torch.nn.Module):  # held, not registered: searched as a module
        seen.add(id(value))
        modules.append(value)
        return
    if depth == 0:
        return
    seen.add(id(value))
    if isinstance(value, dict):
        items = list(value.values())
    elif isinstance(value, (list, tuple, set, frozenset)):
        try:
            items = list(iter(value))
        except Exception:  # noqa: BLE001  (e3nn's Irreps, a tuple whose __len__ raises)
            return
    else:
        try:
            items = list(vars(value).values())
        except TypeError:  # no __dict__ (slots, C types): nothing a model stores tensors in
            return
    for item in items:
        _walk(item, depth - 1, fqn_of, found, seen, modules)


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
        _as_trained(node, params[fqn])
        found.append(fqn)
        if not any(n.op == "get_attr" and n.target == old for n in gm.graph.nodes):
            owner, _, name = old.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, name)
    if found:
        gm.graph.lint()
        gm.recompile()
    return sorted(set(found))


def _as_trained(node: torch.fx.Node, param: torch.nn.Parameter) -> None:
    """The node's example value was the constant's, which needs no gradient: the analyses
    that find a parameter by its value's ``requires_grad`` (sequence parallelism's sum of
    a norm weight's or a bias's gradient over tp) would take the parameter for a buffer and
    leave its gradient one rank's part."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and val.requires_grad != param.requires_grad:
        node.meta["val"] = val.detach().requires_grad_(param.requires_grad)
    tm = node.meta.get("tensor_meta")
    if tm is not None and hasattr(tm, "_replace"):
        node.meta["tensor_meta"] = tm._replace(requires_grad=param.requires_grad)


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
