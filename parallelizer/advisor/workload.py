"""What one training sequence costs, per unit of a transformer: the planner's model input.

Two sources fill :class:`Workload`: a shape (``layers=..,hidden=..``: Narayanan et al. 2021,
SC'21, §3.5 / eq. 3 for FLOPs, the GPT parameter count ``12 l h^2 + 13 l h + (V + s) h``)
or a captured graph (``analysis/graph_costs.collect_costs``' per-unit FLOPs and parameter
bytes, through ``advisor.capture``). Everything here is per *one sequence* of ``seq`` tokens
(micro-batch size 1); the step-time model scales by the micro-batch size.

Activations per layer follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in
Large Transformer Models", §4, Table 2), 16-bit activations: ``s b h (34 + 5 a s / h)``
without tensor parallelism, ``s b h (10 + 24/t + 5 a s / (h t))`` with it (no sequence
parallelism: LayerNorm and dropout inputs stay replicated), and ``2 s b h`` per layer under
full recomputation (the block input). With fused attention (SDPA / flash) the ``5 a s / h``
score term is not stored (``flash=True``).

Mixture-of-experts layers (:class:`MoELayer`, ``Workload.moe``): a model file's come from the
graph (``analysis/experts.py``: stacked (E, a, b) weights read by grouped matmuls); a shape's
from ``experts=E,topk=k[,moe_ffn=f]`` (every block's MLP replaced by a router and E experts of
feed-forward f, Mixtral / GShard style). They are what the search's ``ep`` splits.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UserError

SHAPE_KEYS = ("layers", "hidden", "heads", "vocab", "seq", "ffn", "kv_heads", "glu",
              "experts", "topk", "moe_ffn")


@dataclass(frozen=True)
class MoELayer:
    """One mixture-of-experts layer, per sequence of the workload.

    Attributes:
        unit: the unit holding it (a block index into ``Workload.fwd_flops``).
        experts: E, the experts its stacked weights hold (dim 0).
        top_k: rows per token (the router's k): ``rows = seq x top_k`` per sequence.
        params: elements of its stacked expert weights (all E experts).
        row_elems: elements of one dispatched row (the hidden size for Mixtral).
        module: FQN of the module holding the experts ('' for a shape).
        tp_sizes: sizes tp must divide to split its FFN dim (the weights' FFN widths, the
            parts and explicit sizes the region cuts it into: ``analysis/expert_ffn.py``).
        tp_blocker: why tp cannot split it at any degree ('' when it can).
    """
    unit: int
    experts: int
    top_k: float
    params: float
    row_elems: float
    module: str = ""
    tp_sizes: tuple = ()
    tp_blocker: str = ""

    def tp_split(self, tp: int) -> bool:
        """Whether its experts are split over ``tp`` along their FFN dim (``planning/experts.py``
        ``plan_expert_tp``'s rule); otherwise they stay whole on every tp rank."""
        return tp > 1 and not self.tp_blocker and all(int(n) % tp == 0 for n in self.tp_sizes)


@dataclass(frozen=True)
class Workload:
    """Costs of one sequence. ``units`` are (before, block 0..L-1, after) as in
    ``analysis.costs.PipelineCosts``; FLOPs per unit are forward and backward separately."""
    name: str
    seq: int
    hidden: int
    heads: int
    vocab: int
    fwd_flops: tuple[float, ...]      # per unit, one sequence
    bwd_flops: tuple[float, ...]
    params: tuple[float, ...]         # per unit, elements (a tied embedding counted in `before`)
    tied_params: float = 0.0          # elements the last stage holds again when pp > 1 (tied head)
    ends_tp_sharded: bool = True      # embedding / head split over tp (Megatron vocab-parallel)
    flash: bool = False               # attention scores not stored (fused SDPA)
    tp_allreduces_per_block: int = 2  # Megatron f/g: attention + MLP (forward; backward again)
    notes: tuple[str, ...] = field(default=())
    attention: str = "graph"          # flash | eager (a shape), graph (what the model file runs)
    tensors: tuple[float, ...] = ()   # parameter tensors per unit
    cut_bytes: tuple[float, ...] = () # fp32 bytes per sequence crossing each unit boundary
    moe: tuple = ()                   # MoELayer per mixture-of-experts layer (what ep splits)
    # per-unit costs the compiler's pipeline split balances (a model file's graph costs, which
    # see no FLOPs inside a grouped matmul); () = fwd + bwd FLOPs
    balance: tuple[float, ...] = ()
    # per-unit kernels at any micro-batch size: .units(b) -> tuple of inventory.UnitKernels
    source: object = field(default=None, compare=False, hash=False, repr=False)

    @property
    def layers(self) -> int:
        return len(self.fwd_flops) - 2

    @property
    def param_count(self) -> float:
        return sum(self.params)

    @property
    def expert_params(self) -> tuple[float, ...]:
        """Per unit: elements of its stacked expert weights (of ``params``; 0 for dense units)."""
        out = [0.0] * len(self.params)
        for layer in self.moe:
            out[layer.unit] += layer.params
        return tuple(out)

    def expert_shard(self, tp: int) -> tuple[float, ...]:
        """Per unit: elements of its stacked expert weights on one tp rank (all E experts):
        1/tp of each layer tp splits along the FFN dim, the others whole."""
        out = [0.0] * len(self.params)
        for layer in self.moe:
            out[layer.unit] += layer.params / tp if layer.tp_split(tp) else layer.params
        return tuple(out)

    def ep_choices(self, dp: int) -> list[int]:
        """The expert-parallel degrees for ``dp`` data-parallel ranks: divisors of dp that
        divide every layer's experts (``mesh.ep``'s rule, docs/expert-parallel.md); [1]
        for a dense model."""
        if not self.moe:
            return [1]
        return [e for e in range(1, dp + 1) if dp % e == 0
                and all(layer.experts % e == 0 for layer in self.moe)]

    def model_flops(self, sequences: int, recompute: bool) -> float:
        """FLOPs of a step over ``sequences``; with ``recompute`` one more forward of every
        block, as eq. 3 of Narayanan et al. 2021 counts (96 instead of 72 B s l h^2)."""
        total = sum(self.fwd_flops) + sum(self.bwd_flops)
        if recompute:
            total += sum(self.fwd_flops[1:-1])
        return total * sequences

    def layer_activation_bytes(self, tp: int, recompute: bool, elem: int = 2,
                               sequence_parallel: bool = False) -> float:
        """Saved activations of one block for one sequence on one tp rank (Korthikanti et
        al. 2022, Table 2: ``10 + 24/t`` without sequence parallelism, ``34/t`` with it),
        scaled from their 16-bit activations to ``elem`` bytes."""
        s, h, a = self.seq, self.hidden, self.heads
        if recompute:
            return 2 * s * h * elem / 2 / (tp if sequence_parallel else 1)
        scores = 0 if self.flash else 5 * a * s / (h * tp)
        replicated = 10 / tp if sequence_parallel else 10
        return s * h * (replicated + 24 / tp + scores) * elem / 2

    def logits_bytes(self, tp: int) -> float:
        """The LM head's output kept for the loss: fp32 logits of one sequence."""
        return self.seq * self.vocab * 4 / (tp if self.ends_tp_sharded else 1)


def parse_shape(text: str) -> dict:
    """``layers=96,hidden=12288,heads=96,vocab=51200,seq=2048[,ffn=..,kv_heads=..,glu=1]``
    ``[,experts=E,topk=k,moe_ffn=f]`` (a mixture of experts in every block: E experts of
    feed-forward ``moe_ffn`` (default ``ffn``), k per token (default 2)).

    Raises:
        UserError: a malformed item, an unknown key, a missing key, a value < 1, or topk /
            moe_ffn without experts, or topk > experts.
    """
    out = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, eq, value = item.partition("=")
        if not eq or key.strip() not in SHAPE_KEYS:
            raise UserError(f"--model-shape: '{item}' is not KEY=INTEGER with KEY one of "
                            f"{', '.join(SHAPE_KEYS)}; e.g. layers=96,hidden=12288,heads=96,"
                            f"vocab=51200,seq=2048")
        try:
            out[key.strip()] = int(float(value))
        except ValueError:
            raise UserError(f"--model-shape: {key} must be an integer, got '{value}'") from None
    missing = [k for k in SHAPE_KEYS[:5] if k not in out]
    if missing:
        raise UserError(f"--model-shape needs {', '.join(missing)} (got {text!r}); e.g. "
                        f"layers=96,hidden=12288,heads=96,vocab=51200,seq=2048")
    bad = [f"{k}={v}" for k, v in out.items() if v < (0 if k == "glu" else 1)]
    if bad:
        raise UserError(f"--model-shape: values must be >= 1, got {', '.join(bad)}")
    if out["hidden"] % out["heads"]:
        raise UserError(f"--model-shape: heads ({out['heads']}) must divide hidden ({out['hidden']})")
    moe = [k for k in ("topk", "moe_ffn") if k in out]
    if moe and "experts" not in out:
        raise UserError(f"--model-shape: {', '.join(moe)} needs experts=E (the experts of each "
                        f"block's mixture-of-experts layer); e.g. experts=8,topk=2")
    if "experts" in out and out.get("topk", 2) > out["experts"]:
        raise UserError(f"--model-shape: topk ({out.get('topk', 2)}) must be <= experts "
                        f"({out['experts']})")
    return out


ATTENTION = ("flash", "eager")


def from_shape(shape: dict, name: str = "", attention: str = "flash") -> Workload:
    """A GPT/Llama-style decoder of ``shape`` (see :func:`parse_shape`); GPT by default
    (ffn = 4 h, no gating, kv_heads = heads, learned positions, tied embedding).
    ``attention``: ``flash`` (fused SDPA / FlashAttention: the scores are neither stored for
    backward nor written to memory) or ``eager`` (scores, softmax and dropout materialised,
    Korthikanti's 5 a s / h term stored; Megatron-LM in 2021). Its kernels:
    :mod:`parallelizer.advisor.shape_kernels`.

    Forward FLOPs per block and sequence: 2 x (matmul parameters) x s + 4 s^2 h (attention
    scores and context), which for GPT is eq. 3's 24 s h^2 (1 + s / 6h); backward twice the
    forward; the head 2 s h V forward. Parameters per GPT block 12 h^2 + 13 h. With
    ``experts=E`` the MLP is a router (h x E) and E experts of ``moe_ffn`` (gated under
    ``glu``), of which a token runs ``topk``: the matmul parameters a token uses are the
    router's and k experts'.
    """
    L, h, a, V, s = (shape[k] for k in ("layers", "hidden", "heads", "vocab", "seq"))
    ffn, kv, glu = shape.get("ffn", 4 * h), shape.get("kv_heads", a), shape.get("glu", 0)
    E, topk = shape.get("experts", 0), shape.get("topk", 2)
    attn_mm = 2 * h * h + 2 * h * (h * kv // a)
    if E:   # router (h x E) and E experts; a token runs the router and k experts
        expert = (3 if glu else 2) * h * shape.get("moe_ffn", ffn)
        mlp_mm, mlp_used = E * expert + h * E, topk * expert + h * E
        biases = 0 if glu else 2 * h + 2 * h * kv // a   # q, out, k, v (experts without)
    else:
        mlp_mm = mlp_used = (3 if glu else 2) * h * ffn
        biases = 0 if glu else 3 * h + 2 * h * kv // a + ffn   # q, k, v, out, fc1, fc2
    block_params = attn_mm + mlp_mm + (2 if glu else 4) * h + biases
    block_fwd = 2 * (attn_mm + mlp_used) * s + 4 * s * s * h
    embed = V * h + (s * h if not glu else 0)   # learned positions for GPT, rotary for Llama
    head_fwd = 2 * s * h * V
    fwd = (0.0,) + (float(block_fwd),) * L + (float(head_fwd),)
    bwd = (0.0,) + (2.0 * block_fwd,) * L + (2.0 * head_fwd,)
    # GPT ties the LM head to the embedding (the last stage holds a copy when pp > 1);
    # a gated (Llama-style) model has its own head
    head = float(2 * h + (V * h if glu else 0))
    params = (float(embed),) + (float(block_params),) * L + (head,)
    label = name or f"shape {','.join(f'{k}={v}' for k, v in shape.items())}"
    if attention not in ATTENTION:
        raise UserError(f"attention must be one of {', '.join(ATTENTION)}, got {attention!r}")
    from .shape_kernels import ShapeKernels
    per_block = (9.0 if glu else 10.0) if E else (9.0 if glu else 12.0)   # weights (+ biases), norms
    tensors = ((1.0 if glu else 2.0),) + (per_block,) * L + ((2.0 if glu else 2.0),)
    moe_f = shape.get("moe_ffn", ffn) if E else 0
    moe = tuple(MoELayer(1 + i, E, float(topk), float(E * expert), float(h), tp_sizes=(moe_f,))
                for i in range(L)) if E else ()
    return Workload(label, s, h, a, V, fwd, bwd, params, tied_params=0.0 if glu else float(V * h),
                    flash=attention == "flash", attention=attention, tensors=tensors,
                    cut_bytes=(4.0 * s * h,) * (L + 1), moe=moe,
                    source=ShapeKernels(dict(shape), attention))


def eq3_flops(shape: dict, batch: int) -> float:
    """Narayanan et al. 2021 eq. 3: FLOPs of one iteration with activation recomputation,
    ``96 B s l h^2 (1 + s / 6h + V / 16 l h)`` (GPT: ffn = 4h, no gating)."""
    L, h, V, s = shape["layers"], shape["hidden"], shape["vocab"], shape["seq"]
    return 96 * batch * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
