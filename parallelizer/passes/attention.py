"""attention pass: call scaled_dot_product_attention the way eager code does.

torch.export materialises what eager code leaves to SDPA's flags: Hugging Face builds a
boolean causal mask from ``arange``s (the eager path passes ``attn_mask=None,
is_causal=True``) and repeats the kv heads with ``repeat_kv`` (``x[:, :, None]`` ->
``expand`` -> ``reshape``; eager passes ``enable_gqa=True``). Both cost a step time and
memory the eager model does not spend (the mask read in every layer, the expand's
backward ``sum``, a copy of k and v per layer). This pass rewrites, per SDPA node:

- a mask whose elements are *proven* ``k <= q`` for every size (``analysis.index_algebra``:
  the mask's producer chain evaluated symbolically; any data-dependent input such as a
  padding ``attention_mask``, or a sliding window, fails the proof) -> ``is_causal=True``;
  one proven True everywhere (an encoder's mask without padding) -> no mask;
- k and v both repeated ``R`` times along the heads dim by unsqueeze + expand + reshape
  (query head ``h`` reads kv head ``h // R``) -> the unrepeated k, v and ``enable_gqa=True``
  (SDPA's own definition: query head ``h`` reads kv head ``h // (H / K)``).

It is a pure, always-valid rewrite (the same values for every input), run on the captured
graph before planning, so the tensor-parallel planner sees SDPA with ``enable_gqa`` (its rule
``analysis.sharding.rules._gqa_kv``) and the pipeline stages no longer rebuild the mask. The
orphaned mask and repeat ops are erased. Source: ``torch.nn.functional.
scaled_dot_product_attention`` (the reference implementation in its docstring).
"""
from __future__ import annotations

import sympy
import torch
import torch.fx as fx

from ..analysis.graph_facts import module_path
from ..analysis.index_algebra import element_formula, is_causal_formula

aten = torch.ops.aten
SDPA = aten.scaled_dot_product_attention.default
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_INT_MAX = 2 ** 63 - 1


def apply_eager_attention(gm: fx.GraphModule, rewritten: list | None = None) -> bool:
    """Rewrite every SDPA node whose mask is causal or all True, or whose k/v are repeated
    kv heads. ``rewritten``, when given, receives one ``(module FQN, changes)`` per rewritten
    node (changes: ``"causal mask -> is_causal"``, ``"all-True mask dropped"``, ``"repeated
    kv heads -> enable_gqa"``), for report.md.

    Returns:
        True if the graph changed.
    """
    changed, kinds = False, {}  # mask node -> its kind, proven once (layers share one mask)
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is SDPA:
            where = module_path(node)
            done = _rewrite(gm.graph, node, kinds)
            if done and rewritten is not None:
                rewritten.append((where, tuple(done)))
            changed |= bool(done)
    if changed:
        gm.graph.lint()
        gm.recompile()
    return changed


def _rewrite(graph: fx.Graph, node: fx.Node, kinds: dict) -> list[str]:
    """The changes made to ``node`` (empty: none)."""
    a = dict(zip(_PARAMS, node.args))
    a.update(node.kwargs)
    dropped, done = [], []
    mask = a.get("attn_mask")
    if isinstance(mask, fx.Node) and mask not in kinds:
        kinds[mask] = _mask_kind(mask)
    kind = kinds.get(mask) if isinstance(mask, fx.Node) else None
    if kind and _mask_fits(mask, a["query"], a["key"], whole=kind == "causal"):
        if kind == "causal" and not a.get("is_causal"):
            a["attn_mask"], a["is_causal"] = None, True
            dropped.append(mask)
            done.append("causal mask -> is_causal")
        elif kind == "all":
            a["attn_mask"] = None
            dropped.append(mask)
            done.append("all-True mask dropped")
    rk, rv = _repeated_kv(a["key"]), _repeated_kv(a["value"])
    if (rk and rv and rk[1] == rv[1] and _heads(rk[0]) == _heads(rv[0]) and not a.get("enable_gqa")
            and _heads(a["query"]) == _heads(rk[0]) * rk[1]):
        dropped += [a["key"], a["value"]]
        a["key"], a["value"], a["enable_gqa"] = rk[0], rv[0], True
        done.append("repeated kv heads -> enable_gqa")
    if not dropped:
        return []
    node.args = (a.pop("query"), a.pop("key"), a.pop("value"))
    node.kwargs = {k: v for k, v in a.items() if v is not None}
    for old in dict.fromkeys(dropped):  # k and v may be one node
        _erase_dead(graph, old)
    return done


def _shape(node) -> tuple:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    if not isinstance(val, torch.Tensor):
        return ()
    return tuple(int(s) if isinstance(s, int) else s.node.expr for s in val.shape)


def _heads(node):
    s = _shape(node)
    return s[-3] if len(s) >= 3 else None


def _mask_kind(mask: fx.Node):
    """``"causal"``: a boolean mask whose elements are ``k <= q`` on its last two dims;
    ``"all"``: True everywhere (bidirectional, no padding: no mask at all); else None."""
    val = mask.meta.get("val")
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool:
        return None
    f = element_formula(mask)
    if f is None:
        return None
    return "all" if f.expr is sympy.true else "causal" if is_causal_formula(f) else None


def _mask_fits(mask: fx.Node, q: fx.Node, k: fx.Node, whole: bool) -> bool:
    """The mask broadcasts against the scores (..., H, L, S) without enlarging them, so
    dropping it leaves the output's shape as it is; ``whole``: its last dims are (L, S)
    (its formula's last two indices are the query and key positions)."""
    m, qs, ks = _shape(mask), _shape(q), _shape(k)
    if len(qs) < 3 or len(m) > len(qs):
        return False
    scores = qs[:-1] + ks[-2:-1]
    if any(d != 1 and d != s for d, s in zip(m, scores[len(scores) - len(m):])):
        return False
    return not whole or m[-2:] == scores[-2:]


def _repeated_kv(node):
    """``(x, R)`` if ``node`` is ``x`` (..., K, S, D) with each head repeated R times in
    place: reshape(expand(unsqueeze(x, heads + 1)), (..., K * R, S, D)); else None."""
    if not isinstance(node, fx.Node) or node.target not in (aten.reshape.default, aten.view.default,
                                                           aten._unsafe_view.default):
        return None
    e = _skip_full_slices(node.args[0])
    if e.target is not aten.expand.default:
        return None
    u = _skip_full_slices(e.args[0])
    if u.target is not aten.unsqueeze.default:
        return None
    x = _skip_full_slices(u.args[0])
    xs, es, out = _shape(x), _shape(e), _shape(node)
    if len(xs) < 3 or len(es) != len(xs) + 1:
        return None
    h = len(xs) - 3
    if u.args[1] % len(es) != h + 1:
        return None
    k, r = xs[h], es[h + 1]
    if not isinstance(k, int) or not isinstance(r, int):
        return None
    if es != xs[:h + 1] + (r,) + xs[h + 1:] or out != xs[:h] + (k * r,) + xs[h + 1:]:
        return None
    return x, r


def _skip_full_slices(node):
    while (isinstance(node, fx.Node) and node.target is aten.slice.Tensor
           and node.args[2:] in ((), (0,), (None,), (0, _INT_MAX), (None, None), (0, _INT_MAX, 1))):
        node = node.args[0]
    return node


def _erase_dead(graph: fx.Graph, node) -> None:
    """Erase ``node`` and its producers that no longer have users (pure ops only; export's
    metadata asserts of an otherwise unused value go with it)."""
    todo, erased = [node], set()
    while todo:
        n = todo.pop()
        if not isinstance(n, fx.Node) or n in erased or n.op != "call_function" or n.is_impure():
            continue
        if n.users and all(u.target is aten._assert_tensor_metadata.default for u in n.users):
            for u in list(n.users):
                graph.erase_node(u)
        if n.users:
            continue
        inputs = list(n.all_input_nodes)
        graph.erase_node(n)
        erased.add(n)
        todo += inputs
