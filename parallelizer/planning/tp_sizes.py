"""The sizes tensor parallelism splits (heads, kv heads, features, channel groups: the
constraints a propagation collects, :mod:`parallelizer.analysis.sharding.state`) against a tp
degree: whether tp divides them all, which degrees do, and the refusal and warnings that name
them. Reads a Propagation's constraints only."""
from __future__ import annotations

from ..errors import PlanError
from ..analysis.sharding.propagate import Propagation


def divisible(prop: Propagation, tp: int) -> bool:
    kv = frozenset(prop.kv_weights)
    return all(c.allows(tp, kv) for c in prop.constraints)


def not_dividing(prop: Propagation, tp: int) -> list:
    """The constraints tp does not meet, heads first."""
    kv = frozenset(prop.kv_weights)
    return sorted((c for c in prop.constraints if not c.allows(tp, kv)),
                  key=lambda c: c.what != "heads")


def check_divisible(prop: Propagation, tp: int) -> None:
    bad = not_dividing(prop, tp)
    if not bad:
        return
    some = _partial_degrees(prop)
    also = (f"; tp in {{{', '.join(map(str, some))}}} divides some of the sizes: it shards those "
            f"groups and keeps the others whole" if some else "")
    if tp in some:  # that plan was tried at this tp and sharded nothing or did not settle
        kv = frozenset(prop.kv_weights)
        c = next(c for c in prop.constraints if c.allows(tp, kv))
        # which size it divides, not a guess at why that group fell with the others (a
        # zoo's refusal said "a fused projection" of a model that had none: zoo 23 F3)
        also = (f"; tp = {tp} divides some of the sizes (the {c.size} {c.what} of "
                f"{c.module or 'the model'} ({c.detail})), but keeping the groups behind the "
                f"others whole leaves no plan that shards a weight (each divisible group "
                f"needs one of them: a projection fused with them, a row whose column they "
                f"keep whole); or set tensor_parallel.allow_replicated=true to run replicated")
    else:  # the spec key that runs this tp anyway, as every refusal of a tp names it
        also += "; or tensor_parallel.allow_replicated=true runs it replicated"
    raise PlanError(f"mesh.tp ({tp}) must divide {sizes_text(bad, prop)}; valid choices: "
                    f"tp in {{{', '.join(map(str, valid_degrees(prop)))}}} (sharding every "
                    f"group){also}")


def valid_degrees(prop: Propagation) -> list:
    kv = frozenset(prop.kv_weights)
    top = max(x.size for x in prop.constraints)
    return [t for t in range(1, top + 1) if all(x.allows(t, kv) for x in prop.constraints)]


def _partial_degrees(prop: Propagation) -> list:
    """tp degrees > 1 that divide some sizes but not all (6 heads and an FFN of 130: 3, 5,
    6, ...): the compile keeps the other groups whole (``tp_candidates._whole_indivisible``)."""
    kv = frozenset(prop.kv_weights)
    top = max(x.size for x in prop.constraints)
    full = set(valid_degrees(prop))
    def shards_a_group(t: int) -> bool:  # every size of some group (weights in common)
        return any(all(x.allows(t, kv) for x in prop.constraints
                       if x is c or (c.origin and x.origin and x.origin & c.origin))
                   for c in prop.constraints if c.allows(t, kv))
    return [t for t in range(2, min(top, 64) + 1) if t not in full and shards_a_group(t)]


def sizes_text(bad: list, prop: Propagation) -> str:
    """:func:`_size_text` of the first constraint of each distinct size in ``bad`` (heads
    first; 3 heads and an FFN of 37 at tp 2: both), so one message names every size to
    change. A size that every tp dividing a size named before it meets goes unnamed: the 32
    features 4 heads span, or 2 kv heads after those 4 heads (tp 1, 2 or 4 splits or
    copies them)."""
    kv, firsts, roots = frozenset(prop.kv_weights), {}, []
    for c in bad:
        firsts.setdefault(c.size, c)
    for c in firsts.values():
        if not any(not a.replicable(kv) and all(c.allows(t, kv) for t in range(1, a.size + 1)
                                                if a.size % t == 0) for a in roots):
            roots.append(c)
    texts = [_size_text(c, prop) for c in roots]
    more = f", and {len(texts) - 3} more sizes" if len(texts) > 3 else ""
    return ", and ".join(texts[:3]) + more


def _size_text(c, prop: Propagation) -> str:
    """'the number of kv heads (2) of attn (...), or be a multiple of it (...)'."""
    kv_heads = c.what == "heads" and c.replicable(frozenset(prop.kv_weights))
    copies = ", or be a multiple of it (each kv head is then held by tp / kv heads ranks)"
    return (f"the number of {'kv heads' if kv_heads else c.what} ({c.size}) of "
            f"{c.module or 'the model'} ({c.detail}){copies if kv_heads else ''}")


def indivisible_cause(prop: Propagation, bad: set, tp: int) -> str:
    """The heads (or features) of ``bad``'s modules that tp does not divide, named as the
    cause of the conflict they lead to (a per-head op on 2 kv heads split at tp 3); "" when
    every size divides. ``bad``: the pair component of the linears a conflict drops, so
    that a k dropped alone is named with its attention's query heads."""
    kv = frozenset(prop.kv_weights)

    def ours(c) -> bool:
        return not c.allows(tp, kv) and (bool((c.weights | c.origin) & bad) or bool(
            c.module) and any(w.startswith(c.module + ".") for w in bad))
    # heads tp is a multiple of may be copies (their kv role not yet seen): named last
    sizes = sorted(filter(ours, prop.constraints),
                   key=lambda c: (c.what == "heads" and tp % c.size == 0, c.what != "heads"))
    if not sizes:
        return ""
    c = sizes[0]
    return (f"; the cause: tp = {tp} does not divide the {c.size} {c.what} of "
            f"{c.module or 'the model'} ({c.detail})")
