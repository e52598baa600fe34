"""Which modules are the model's repeated blocks: the units of pipeline stages, FSDP and
activation checkpointing.

Models hold their layers in different containers: an ``nn.ModuleList`` (Hugging Face
``model.layers``, ``encoder.layer``), an ``nn.Sequential`` (vision models, many research
models: ``stem, block, block, ..., head``), or plain attributes of one class
(``self.block1, self.block2``). The candidates are every ModuleList's children, every run
of two or more consecutive children of one class in an ``nn.Sequential``, and, only when
the model has neither, every such run of sibling attributes that are not leaves (a run of
leaf siblings such as ``q_proj, k_proj, v_proj`` is part of a block, not blocks). The
candidate holding the most parameters wins. Containers come first because two sibling
stacks (T5's ``encoder`` and ``decoder``, both ``T5Stack``) are a run too, and much coarser
than the layers inside them, unless the best run holds :data:`SMALL_PART` times the
parameters of the best container (CoaT's stages, ``serial_blocks1 = nn.ModuleList([Block()])``
..., against its position encodings' lists of convs); a container of one block repeats
nothing and comes last, for a one-layer model.
"""
from __future__ import annotations

import torch

SEARCHED = ("the children of an nn.ModuleList, a run of >= 2 consecutive children of one "
            "class in an nn.Sequential, or a run of >= 2 sibling submodules of one class")


def _runs(children: list[tuple[str, torch.nn.Module]], leaves_ok: bool) -> list[list[str]]:
    """Maximal runs (length >= 2) of consecutive children of one class (of non-leaf
    children only, unless ``leaves_ok``)."""
    runs, cur, cls = [], [], None
    for name, mod in children:
        if not leaves_ok and next(mod.children(), None) is None:
            runs.append(cur)
            cur, cls = [], None
            continue
        if type(mod) is not cls:
            runs.append(cur)
            cur, cls = [], type(mod)
        cur.append(name)
    runs.append(cur)
    return [r for r in runs if len(r) >= 2]


def _candidates(model: torch.nn.Module) -> tuple[list, list]:
    """(container candidates, sibling-run candidates): lists of (parent FQN, child names)."""
    containers, siblings = [], []
    for name, mod in model.named_modules():
        # _modules, not named_children(): a module repeated in a list (ALBERT-style shared
        # block) is one block per position, and later refused by name
        children = [(c, m) for c, m in mod._modules.items() if m is not None]
        if isinstance(mod, torch.nn.ModuleList):
            if children:
                containers.append((name, [c for c, _ in children]))
        elif isinstance(mod, torch.nn.Sequential):
            containers += [(name, run) for run in _runs(children, leaves_ok=True)]
        else:
            siblings += [(name, run) for run in _runs(children, leaves_ok=False)]
    return containers, siblings


def _size(model: torch.nn.Module, parent: str, names: list[str]) -> int:
    mod = model.get_submodule(parent)
    seen = {id(p): p.numel() for c in names for p in mod.get_submodule(c).parameters()}
    return sum(seen.values())


def find_blocks(model: torch.nn.Module) -> tuple[str, ...]:
    """FQNs of the repeated blocks, in registration order (see the module docstring);
    ``()`` when the model has none of the candidates in :data:`SEARCHED` with parameters.
    Works on the meta device (counts parameters, reads no values)."""
    containers, siblings = _candidates(model)
    # a container of one block repeats nothing: the one-block container only where there is
    # nothing else (a one-layer model)
    several = _best(model, [c for c in containers if len(c[1]) > 1])
    run = _best(model, siblings)
    single = _best(model, [c for c in containers if len(c[1]) == 1])
    # containers before sibling runs (T5's encoder and decoder stacks are a run), unless the
    # run holds the model and the containers a small part of it: CoaT's stages, each an
    # nn.ModuleList of one block, against the three convs of one position encoding
    if several and not (run and run[0] > SMALL_PART * several[0]):
        found = several
    else:
        found = run or several or single
    if not found:
        return ()
    _, parent, names = found
    return tuple(f"{parent}.{c}" if parent else c for c in names)


# a sibling run holding this many times a container's parameters is the model's blocks
SMALL_PART = 4


def _best(model: torch.nn.Module, group: list):
    """(parameters, parent, names) of the candidate holding the most parameters (the first
    found, outermost, on a tie), or None when none holds any."""
    sized = [(_size(model, p, names), -i, p, names) for i, (p, names) in enumerate(group)]
    sized = [s for s in sized if s[0] > 0]
    if not sized:
        return None
    size, _, parent, names = max(sized, key=lambda s: (s[0], s[1]))
    return size, parent, names
