"""untie pass: give each use of a tied tensor the name its own module knows it by.

export reads a tied weight (embedding = LM head) through one get_attr under one of its
names; splitting into stages would then register the LM head's name in stage 0. Each use
gets its own get_attr named after the module that uses it (``model.embed_tokens.weight``
for the embedding, ``lm_head.weight`` for the head), so every stage keeps the original FQNs.
"""
from __future__ import annotations

import torch.fx as fx

from ..analysis.graph_facts import module_path


def apply_untie(gm: fx.GraphModule, groups: list[list[str]]) -> bool:
    """``groups``: lists of names that share one tensor (from ``named_parameters``)."""
    group_of = {name: g for g in groups if len(g) > 1 for name in g}
    changed = False
    for node in list(gm.graph.nodes):
        if node.op != "get_attr" or node.target not in group_of:
            continue
        for user in list(node.users):
            name = _owner_name(group_of[node.target], module_path(user))
            if name and name != node.target:
                with gm.graph.inserting_before(node):
                    alias = gm.graph.get_attr(name)
                alias.meta = dict(node.meta)
                user.replace_input_with(node, alias)
                changed = True
        if not node.users:
            gm.graph.erase_node(node)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _owner_name(names: list[str], path: str):
    for name in names:
        owner = name.rsplit(".", 1)[0] if "." in name else ""
        if owner == path:
            return name
    return None
