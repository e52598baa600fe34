"""Linear layers found by their algebra on a captured graph, and the paths by which their
weights reach them (casts, views, transposes, static pieces of a fused parameter)."""
from __future__ import annotations

import math
import operator
from typing import NamedTuple, Optional

import torch
import torch.fx as fx

from ..frontend.graph_rewrite import swaps_last_two
from .graph_facts import aten, is_tensor, same, shape, weight_fqn


class Linear(NamedTuple):
    """One linear layer of the graph, found by its algebra: ``y = x W^T (+ b)`` or
    ``y = x W (+ b)`` with W a 2-D parameter (a get_attr), whichever op spells it:
    ``aten.linear(x, W, b)`` (nn.Linear, W (out, in)), ``aten.addmm(b, x, W)`` (GPT-2's
    Conv1D, W (in, out)), ``matmul`` / ``mm`` / ``bmm`` / ``addmm`` with W as the right
    operand, and a bias added by a separate ``add`` of a 1-D parameter (Falcon's
    ``x @ W.T + b``). The weight and bias may be read through a *weight path*
    (:func:`weight_source`): casts and copies (``w.to(x.dtype)``, ``type_as``, ``float()``,
    ``contiguous``), views to the same shape, and for W transposes (``W.T``, ``W.t()``,
    ``W.transpose(0, 1)``, ``W.permute(1, 0)``; ``F.linear(x, W.t())`` of a W stored (in,
    out)). A 3-D W (E, in, out) read by ``bmm`` / ``matmul`` from an x (E, rows, in) is E
    linears side by side (:func:`_batched_site`: ``out_dim`` 2, ``in_dim`` 1; 1 and 2 for
    W (E, out, in) read transposed).

    Attributes:
        node: the call_function node of the product.
        x: its input activation.
        weight, bias: get_attr targets (bias None when absent).
        out_dim: the dim of the *parameter* W holding the output features (0 for W (out,
            in), 1 for W (in, out)); ``1 - out_dim`` is the input-features dim.
        w_node: the node the product reads the weight through (the get_attr or the last
            node of its weight path).
        bias_add: the separate ``add`` of the bias, or None (bias inside the op or absent).
        param: the get_attr node of W.
        part, bias_part: ``(lo, hi)`` when the linear reads only that static range of W's
            output-features dim (of the bias): torch's cross-attention
            ``in_proj_weight.split([E, 2E])``, its kdim/vdim ``in_proj_bias.chunk(3)``;
            None when it reads the whole parameter (:func:`piece`).
        merged: for a parameter of 3+ dims viewed as the 2-D weight (an einsum projection's
            per-head ``(H, D_h, D)`` as ``(H * D_h, D)``, :mod:`parallelizer.frontend.einsum`),
            the parameter dim the weight's dim 1 starts at (:func:`merge_point`); None for a
            2-D parameter. ``out_dim`` / ``in_dim`` are then the parameter dims that start
            each merged group: the parameter is sharded along the first dim of the group
            (``H``).
        perm: for a merged parameter whose dims are permuted before the view (TransformerLens'
            ``rearrange(W_Q, "h dm dh -> (h dh) dm")``: ``(0, 2, 1)``), the parameter dim at
            each position of the viewed tensor; None when they are in their own order.
            ``merged`` counts positions of the permuted order.
    """

    node: fx.Node
    x: fx.Node
    weight: str
    bias: Optional[str]
    out_dim: int
    w_node: Optional[fx.Node] = None
    bias_add: Optional[fx.Node] = None
    param: Optional[fx.Node] = None
    part: Optional[tuple] = None
    bias_part: Optional[tuple] = None
    merged: Optional[int] = None
    perm: Optional[tuple] = None

    @property
    def batched(self) -> bool:
        """A 3-D weight (E, in, out) or (E, out, in), E linears side by side
        (:func:`_batched_site`)."""
        return self.merged is None and self.param is not None and len(shape(self.param)) == 3

    @property
    def order(self) -> tuple:
        """The parameter's dims in the order the merged view reads them."""
        return self.perm or tuple(range(len(shape(self.param))))

    @property
    def in_dim(self) -> int:
        if self.merged is not None:
            first = self.order.index(self.out_dim) == 0
            return self.order[self.merged if first else 0]
        if self.batched:
            return 3 - self.out_dim
        return 1 - self.out_dim

    def features(self, dim: int) -> int:
        """The weight matrix's size along parameter dim ``dim`` (``out_dim`` or ``in_dim``):
        the product of the merged group it starts for a merged parameter."""
        sizes = shape(self.param)
        if self.merged is None:
            return sizes[dim]
        read = [sizes[d] for d in self.order]
        return math.prod(read[:self.merged] if self.order.index(dim) == 0 else read[self.merged:])


_TRANSPOSES = {aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default,
               aten.mT.default}
_PRODUCTS = {aten.matmul.default, aten.mm.default, aten.bmm.default}
# same values, same shape: a weight read through these is still the weight
_CASTS = {aten.to.dtype, aten.to.dtype_layout, aten.to.device, aten._to_copy.default,
          aten.type_as.default, aten.contiguous.default, aten.clone.default, aten.alias.default,
          aten.detach.default}  # detach: a read under torch.no_grad (regions.inline_regions)
# a tensor under another shape: view, reshape (the sizes in args[1])
VIEWS = frozenset({aten.view.default, aten.reshape.default, aten._unsafe_view.default})
_PATH_LIMIT = 8


def _param(n, rank: int) -> bool:
    return bool(weight_fqn(n)) and is_tensor(n) and len(shape(n)) == rank


def _swaps(n: fx.Node) -> bool:
    """A transpose of a 2-D value's two dims."""
    if n.target is aten.transpose.int:
        return sorted(a % 2 for a in n.args[1:3]) == [0, 1]
    if n.target is aten.permute.default:
        return [a % 2 for a in n.args[1]] == [1, 0]
    return True


def weight_source(w, rank: int = 2) -> tuple[Optional[fx.Node], bool]:
    """``(get_attr node, transposed)`` when ``w`` is a parameter of ``rank`` dims read through
    a weight path: casts and copies (:data:`_CASTS`), views to the same shape, for 2-D
    transposes (``transposed``: an odd number of them), and one static piece along a dim
    (:func:`piece`); ``(None, False)`` otherwise. For ``rank`` 2 the parameter may also have
    more dims, merged into two by a view (:func:`merge_point`)."""
    param, transposed, _part, _merged, _perm = _walk_weight(w, rank)
    return param, transposed


def merge_point(src_shape, view_shape) -> Optional[int]:
    """``k`` when the 2-D ``view_shape`` is ``src_shape`` (of 3+ static dims) with dims
    ``[0, k)`` merged into its first and ``[k, n)`` into its second (an einsum's per-head
    weight ``(H, D_h, D)`` viewed ``(H * D_h, D)``: 2); None otherwise."""
    if len(view_shape) != 2 or len(src_shape) < 3 or not all(
            isinstance(v, int) for v in (*src_shape, *view_shape)):
        return None
    for k in range(1, len(src_shape)):
        if math.prod(src_shape[:k]) == view_shape[0] and math.prod(src_shape[k:]) == view_shape[1]:
            return k
    return None


def _walk_weight(w, rank: int):
    """``(param, transposed, part, merged, perm)``: :func:`weight_source`'s pair, ``part``,
    ``(dim, lo, hi)`` of the parameter (its own dims) when the path takes only that static
    range of it (None: the whole parameter), ``merged`` (:func:`merge_point`, None for a
    parameter of ``rank`` dims) and ``perm`` (:attr:`Linear.perm`), from one walk back from
    ``w`` to the parameter. Between a merged parameter and its view only casts and one
    permutation of its dims may stand, and no piece is taken of it."""
    transposed, part, merged, perm, masked = False, None, None, None, False
    for _ in range(_PATH_LIMIT):
        if _param(w, rank):
            return w, transposed, part, merged, perm
        cut = piece(w)
        if cut is not None and part is None and merged is None and not masked \
                and is_tensor(cut[0]) and len(shape(cut[0])) == rank:
            w, part = cut[0], cut[1:]
            continue
        if not (is_tensor(w) and w.op == "call_function" and w.args
                and is_tensor(path_source(w)) and len(shape(w)) == rank):
            return _NO_WEIGHT
        src = path_source(w)
        if masked and w.target not in _CASTS:  # the mask holds the parameter's own dims
            return _NO_WEIGHT
        if mask_of(w) is not None:  # of a weight only: a bias's would need its own cut
            if masked or merged is not None or rank < 2:
                return _NO_WEIGHT
            masked = True
        elif w.target in VIEWS and rank == 2 and part is None and merged is None \
                and merge_point(shape(src), shape(w)) is not None:
            merged = merge_point(shape(src), shape(w))
            rank = len(shape(src))
        elif merged is not None and perm is None and permutation(w) is not None:
            perm = permutation(w)
        elif w.target in _TRANSPOSES and merged is None \
                and (rank == 2 and _swaps(w) or rank == 3 and swaps_last_two(w)):
            transposed = not transposed
            if part is not None:  # the piece was cut after this transpose: the other dim
                a, b = (0, 1) if rank == 2 else (1, 2)
                part = ({a: b, b: a}.get(part[0], part[0]),) + part[1:]
        elif not (w.target in _CASTS or w.target in VIEWS) \
                or len(shape(src)) != rank or not all(map(same, shape(src), shape(w))):
            return _NO_WEIGHT
        w = src
    return _NO_WEIGHT


_NO_WEIGHT = (None, False, None, None, None)


def permutation(n: fx.Node) -> Optional[tuple]:
    """``perm`` when ``n`` is ``permute(src, perm)`` or ``transpose(src, a, b)`` of a tensor of
    3+ dims: the source dim at each position of the output; else None."""
    rank = len(shape(n.args[0]))
    if rank < 3:
        return None
    if n.target is aten.permute.default:
        return tuple(d % rank for d in n.args[1])
    if n.target is aten.transpose.int:
        a, b = (d % rank for d in n.args[1:3])
        order = list(range(rank))
        order[a], order[b] = b, a
        return tuple(order)
    return None


# a static piece of a tensor along one dim: ``t.split(sizes)[i]``, ``t.chunk(n)[i]``,
# ``t[a:b]``, ``t.narrow(d, a, n)``
PIECE_SPLITS = frozenset({aten.split_with_sizes.default, aten.split.Tensor, aten.chunk.default})
PIECE_SLICES = frozenset({aten.slice.Tensor, aten.narrow.default})


def piece(n) -> Optional[tuple[fx.Node, int, int, int]]:
    """``(source, dim, lo, hi)`` when ``n`` is the static range ``[lo, hi)`` of its source's
    dim ``dim`` (step 1, int bounds); None otherwise."""
    if not isinstance(n, fx.Node) or n.op != "call_function":
        return None
    if n.target is operator.getitem and isinstance(n.args[0], fx.Node) \
            and n.args[0].target in PIECE_SPLITS and isinstance(n.args[1], int):
        split = n.args[0]
        src, vals = split.args[0], split.meta.get("val")
        if not is_tensor(src) or not isinstance(vals, (list, tuple)):
            return None
        d = piece_dim(split)
        sizes = [int(v.shape[d]) if isinstance(v.shape[d], int) else None for v in vals]
        if None in sizes:
            return None
        lo = sum(sizes[:n.args[1]])
        return src, d, lo, lo + sizes[n.args[1]]
    if n.target not in PIECE_SLICES or not is_tensor(n.args[0]):
        return None
    src = n.args[0]
    d = piece_dim(n)
    size = shape(src)[d]
    args = list(n.args) + [None] * 5
    if n.target is aten.narrow.default:
        start, length = args[2], args[3]
        if not (isinstance(start, int) and isinstance(length, int) and isinstance(size, int)):
            return None
        start = start + size if start < 0 else start
        return src, d, start, start + length
    start, end, step = args[2] or 0, args[3], args[4] or 1
    if step != 1 or not isinstance(size, int) or not isinstance(start, int) \
            or not isinstance(end if end is not None else 0, int):
        return None
    lo, hi = slice_bound(start, size), slice_bound(size if end is None else end, size)
    return (src, d, lo, hi) if hi > lo else None


def slice_bound(b: int, n: int) -> int:
    """A slice bound as Python reads it (negative from the end), clamped to ``[0, n]``."""
    return max(0, min(b + n if b < 0 else b, n))


def reads_parameters(node: fx.Node, limit: Optional[int] = None) -> bool:
    """A trained parameter (a get_attr whose value requires grad) is upstream of ``node``:
    its value can carry a gradient. With ``limit``, True as well past that many nodes looked
    at (a caller for which "maybe" means "yes")."""
    todo, seen = [node], set()
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        val = n.meta.get("val")
        if n.op == "get_attr" and isinstance(val, torch.Tensor) and val.requires_grad \
                or limit is not None and len(seen) > limit:
            return True
        todo += n.all_input_nodes
    return False


def full_slice(node: fx.Node) -> bool:
    """``aten.slice`` of the whole dim (``x[:, :, ...]``: a no-op slice), its end left open or
    the dim's size (einops' ``unpack`` slicing ``[0:b * h]`` of a (b * h, ..) value): on a
    rank holding a piece of that dim the global end covers the piece whole as well."""
    start = node.args[2] if len(node.args) > 2 else 0
    end = node.args[3] if len(node.args) > 3 else None
    step = node.args[4] if len(node.args) > 4 else 1
    if start not in (0, None) or step != 1:
        return False
    if end is None or isinstance(end, int) and end >= 2 ** 62:
        return True
    size = end.meta.get("val") if isinstance(end, fx.Node) else end
    dim = node.args[1] if len(node.args) > 1 else 0
    return isinstance(size, (int, torch.SymInt)) and same(size, shape(node.args[0])[dim])


def piece_dim(node: fx.Node) -> int:
    """The dim a split / chunk / slice / narrow node cuts (of its source, non-negative)."""
    at = 1 if node.target in PIECE_SLICES else 2
    d = node.args[at] if len(node.args) > at else node.kwargs.get("dim", 0)
    return d % len(shape(node.args[0]))


def weight_path(w: fx.Node) -> list[fx.Node]:
    """The call_function nodes of ``w``'s weight path (:func:`weight_source`), from the one
    reading the parameter to ``w`` itself ([] when ``w`` is the get_attr)."""
    path = []
    while w.op == "call_function":
        path.append(w)
        w = path_source(w)
    return path[::-1]


def mask_of(n: fx.Node) -> Optional[fx.Node]:
    """The operand by which weight-path node ``n`` multiplies the weight elementwise at the
    same shape when it is a buffer (a get_attr without gradient, through casts: see
    :func:`mask_read`), or None: a pruning mask, torch.nn.utils.prune's
    ``weight_mask.to(dtype) * weight_orig`` (its forward pre-hook) or a hand-written
    ``w * mask``, read by nothing else. The mask is then cut as the weight is
    (planning/tp.py), each rank's product the rank's piece of the model's."""
    if n.op != "call_function" or n.target is not aten.mul.Tensor or len(n.args) != 2 \
            or n.kwargs:
        return None
    if not all(isinstance(a, fx.Node) and is_tensor(a) and tuple(shape(a)) == tuple(shape(n))
               for a in n.args):
        return None
    masks = [a for a in n.args if mask_read(a)]
    return masks[0] if len(masks) == 1 else None


def mask_read(a: fx.Node) -> list[fx.Node]:
    """``[get_attr, casts...]`` when ``a`` is a buffer read through casts, each node read by
    the next alone (a metadata assert aside), else []."""
    chain = [a]
    while a.op == "call_function" and a.target in _CASTS and a.args \
            and isinstance(a.args[0], fx.Node):
        a = a.args[0]
        chain.append(a)
    if a.op != "get_attr" or a.meta["val"].requires_grad or not weight_fqn(a):
        return []
    if any(len([u for u in c.users if u.target is not _ASSERT]) != 1 for c in chain):
        return []
    return chain[::-1]


_ASSERT = aten._assert_tensor_metadata.default


def path_source(n: fx.Node) -> fx.Node:
    """The operand weight-path node ``n`` reads the weight through: its first, or the one a
    mask (:func:`mask_of`) multiplies."""
    mask = mask_of(n)
    if mask is None:
        return n.args[0]
    return n.args[1] if n.args[0] is mask else n.args[0]


def weight_masks(site: "Linear") -> list[str]:
    """FQNs of the masks on ``site``'s weight path (:func:`mask_of`)."""
    if site.w_node is None:
        return []
    return [weight_fqn(mask_read(mask_of(n))[0]) for n in weight_path(site.w_node)
            if mask_of(n) is not None]


def _bias_source(b) -> Optional[fx.Node]:
    return weight_source(b, 1)[0] if isinstance(b, fx.Node) else None


def _bias_add(n: fx.Node, out_features) -> tuple[Optional[fx.Node], Optional[fx.Node]]:
    """A separate ``add(y, b)`` of a 1-D parameter (or its weight path) of ``out_features``
    as ``n``'s only use: (the operand it adds, the add)."""
    users = list(n.users)
    if len(users) != 1 or users[0].target is not aten.add.Tensor or len(users[0].args) != 2:
        return None, None
    add = users[0]
    other = add.args[1] if add.args[0] is n else add.args[0]
    src, _t, cut, _m, _p = _walk_weight(other, 1) if isinstance(other, fx.Node) else _NO_WEIGHT
    # a piece of a bias added on its own (``x @ w.T + b[:n]``) is an add like any other
    if src is not None and cut is None and same(shape(other)[0], out_features) \
            and not add.kwargs:
        return other, add
    return None, None


def _range(cut, dim: int, n) -> Optional[tuple]:
    """The ``(lo, hi)`` of parameter dim ``dim`` (of ``n`` elements) that a weight path with
    piece ``cut`` (:func:`_walk_weight`) reads; None for all of it. False: a piece along
    another dim."""
    if cut is None or (cut[1], cut[2]) == (0, n):
        return None
    return (cut[1], cut[2]) if cut[0] == dim else False


def _site(n, x, w, b) -> Optional[Linear]:
    """The :class:`Linear` of product ``n`` with input ``x``, weight operand ``w`` and bias
    operand ``b`` (or None), or None when a piece of the weight or bias is cut along its
    input features (those stay unrecognised: replicated). A bias operand no parameter
    reaches (:func:`computed_bias`) leaves ``bias`` None."""
    param, transposed, cut, merged, perm = _walk_weight(w, 2)
    linear = n.target is aten.linear.default
    if param is None or not linear and (not is_tensor(x) or len(shape(x)) < 2):
        return None
    out_dim = 1 if transposed == linear else 0
    if merged is not None:  # the weight matrix's dim 1 starts at position merged of the read
        out_dim = (perm or range(len(shape(param))))[out_dim * merged]
    part = _range(cut, out_dim, shape(param)[out_dim])
    if part is False:
        return None
    bias_add = None
    if b is None:
        b, bias_add = _bias_add(n, shape(n)[-1])
    elif _bias_source(b) is None:
        b = None  # computed in forward
    bias, _t, bias_cut, _m, _p = _walk_weight(b, 1) if b is not None else _NO_WEIGHT
    bias_part = _range(bias_cut, 0, shape(bias)[0]) if bias is not None else None
    if bias_part is False:
        return None
    return Linear(n, x, param.target, bias.target if bias is not None else None, out_dim, w,
                  bias_add, param, part, bias_part, merged, perm)


def as_linear(n: fx.Node) -> Optional[Linear]:
    """``n`` as a :class:`Linear`, or None."""
    if n.op != "call_function":
        return None
    if n.target is aten.linear.default:
        b = n.args[2] if len(n.args) > 2 else None
        return _site(n, n.args[0], n.args[1], b)
    if n.target is aten.addmm.default and len(n.args) == 3 and not n.kwargs:
        b, x, w = n.args
        return _site(n, x, w, b)
    if n.target in _PRODUCTS and len(n.args) == 2:
        return _site(n, n.args[0], n.args[1], None) or _batched_site(n, n.args[0], n.args[1])
    return None


def _batched_site(n: fx.Node, x, w) -> Optional[Linear]:
    """``bmm(x, W)`` / ``matmul(x, W)`` with W a 3-D parameter (E, in, out) read directly or
    through casts and x (E, rows, in) of the same E: E linears side by side, one per slice
    of dim 0 (a dense mixture of experts, every token through every expert's (in, out)
    matrix). Its output features are W's dim 2, its input features dim 1; a column shards
    dim 2, a row dim 1, each rank every expert's block (Megatron's split inside each
    expert, Shoeybi et al. 2019 §3, applied per slice). W stored (E, out, in) and read
    through a swap of its last two dims (``W.transpose(1, 2)``, ``W.mT``) has them the other
    way round; a weight-first ``bmm(W, y)`` reaches here as ``bmm(y.mT, W.mT).mT``
    (``frontend/einsum.py``)."""
    if not is_tensor(x) or not is_tensor(w) or len(shape(x)) != 3 or len(shape(w)) != 3 \
            or not same(shape(x)[0], shape(w)[0]) or not same(shape(x)[2], shape(w)[1]):
        return None
    param, transposed, part, _m, _p = _walk_weight(w, 3)
    if param is None or part is not None:
        return None
    # W stored (E, out, in), each expert an nn.Linear's weight, read as W.transpose(1, 2)
    return Linear(n, x, param.target, None, 1 if transposed else 2, w, None, param)



def computed_bias(site: Linear) -> Optional[fx.Node]:
    """The bias operand of ``aten.linear`` / ``aten.addmm`` when no parameter reaches it
    through a weight path, a value computed in forward (timm's EVA and BEiT attention:
    ``F.linear(x, qkv.weight, torch.cat((q_bias, k_bias, v_bias)))``); else None."""
    n = site.node
    if site.bias is not None or site.bias_add is not None:
        return None
    b = n.args[2] if n.target is aten.linear.default and len(n.args) > 2 else \
        n.args[0] if n.target is aten.addmm.default else None
    return b if isinstance(b, fx.Node) else None


def bias_operand(site: Linear) -> Optional[fx.Node]:
    """The node the linear (or its separate bias add) reads the bias through."""
    n = site.node
    if site.bias_add is not None:
        a, b = site.bias_add.args
        return b if a is n else a
    if site.bias is None:
        return None
    return n.args[2] if n.target is aten.linear.default else n.args[0]


def linear_sites(graph: fx.Graph) -> list[Linear]:
    """Every linear layer of ``graph`` (see :func:`as_linear`), in graph order."""
    return [s for s in map(as_linear, graph.nodes) if s is not None]


def linear_nodes(graph: fx.Graph) -> list[fx.Node]:
    """The nodes of :func:`linear_sites`."""
    return [s.node for s in linear_sites(graph)]
