"""Base class of the emitted stage and block modules.

An emitted module declares its tensors as data (name, local shape, dtype) and creates them
empty on its device; the checkpoint fills them. Names are dotted paths under the module, so
a stage holding ``model.layers.3`` registers ``model.layers.3.self_attn.q_proj.weight``:
the original FQN, which FSDP2, DCP and users' optimizer param groups rely on.
"""
from __future__ import annotations

import torch
from torch import nn


def _parent(root: nn.Module, dotted: str) -> tuple[nn.Module, str]:
    *path, leaf = dotted.split(".")
    mod = root
    for part in path:
        child = mod._modules.get(part)
        if child is None:
            child = nn.Module()
            mod.add_module(part, child)
        mod = child
    return mod, leaf


class EmittedModule(nn.Module):
    """Attributes set by the generated subclass:

    PARAMETERS / BUFFERS: ``(name, local shape, dtype name)`` per tensor.
    SUBMODULES: ``(name, class)`` per outlined block (an FSDP / activation checkpointing unit).
    TIED: ``(alias, name)``: the alias is the very Parameter registered under ``name``, so a
        tied embedding and LM head in one stage stay one tensor with one gradient.
    RETURNS_PARAMETERS: names of the tensors the forward returns (or views of them), read
        by the code after the block: FSDP2 keeps such a block gathered until its backward
        (runtime/data_parallel.py).
    """

    PARAMETERS: tuple = ()
    BUFFERS: tuple = ()
    SUBMODULES: tuple = ()
    TIED: tuple = ()
    FROZEN: tuple = ()
    RETURNS_PARAMETERS: tuple = ()

    def __init__(self, device: torch.device | str = "cpu"):
        super().__init__()
        self.runtime_device = torch.device(device)
        for name, cls in self.SUBMODULES:
            parent, leaf = _parent(self, name)
            parent.add_module(leaf, cls(device))
        for name, shape, dtype in self.PARAMETERS:
            parent, leaf = _parent(self, name)
            t = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
            parent.register_parameter(leaf, nn.Parameter(t, requires_grad=name not in self.FROZEN))
        for name, shape, dtype in self.BUFFERS:
            parent, leaf = _parent(self, name)
            parent.register_buffer(leaf, torch.empty(shape, dtype=getattr(torch, dtype), device=device))
        for alias, name in self.TIED:
            parent, leaf = _parent(self, alias)
            parent.register_parameter(leaf, self.get_parameter(name))

    def emitted_blocks(self) -> list[tuple[str, nn.Module]]:
        """The outlined blocks, in execution order, with their FQNs."""
        return [(name, self.get_submodule(name)) for name, _ in self.SUBMODULES]
