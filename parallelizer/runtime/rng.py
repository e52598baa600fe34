"""Model-parallel random streams for dropout and the other random ops (Megatron-LM,
Shoeybi et al. 2019, §3, and its ``tensor_parallel.random.get_cuda_rng_tracker``;
Korthikanti et al. 2022, §4.2, for dropout in sequence-parallel regions).

The compiler rewrites every dropout of the captured graph (``aten.dropout`` and its
variants, ``scaled_dot_product_attention`` with ``dropout_p`` > 0) into
``random_op(stream, op, *args)``: the very same ATen op, run while one of this rank's own
generators stands in for the device's default generator, as Megatron's tracker ``fork``
does. The stream is data recorded at compile time from the sharding placement of the
dropout's input (``planning/dropout.py``):

- ``replicated``: the value is replicated over tp (residual stream, embeddings, outputs of
  g): every tp rank must draw the same mask, or the replicas drift apart. Seeded from
  (seed, pp rank, dp rank): equal on the tp ranks of one (pp, dp) coordinate, different
  across dp ranks and pipeline ranks. At pp rank 0, dp rank 0 the seed is ``seed`` itself,
  so a one-rank program draws exactly what the eager model draws after
  ``torch.manual_seed(seed)`` (the graph keeps eager's op order).
- ``tp``: the value is sharded over tp (attention probabilities of this rank's heads, a
  column_parallel activation; sequence-sharded activations under sequence parallelism):
  each tp rank draws its own mask. Seeded from (seed, pp, dp, tp rank). At tp = 1 it is the
  replicated generator itself: one stream, drawn in graph order.

The other random ops of the graph (:data:`RANDOM_OPS`: a drop path's ``torch.rand``,
``bernoulli``, Gumbel noise) run through ``random_op`` on the ``replicated`` stream, the same
values on every tp rank; one whose output is sharded over tp is drawn whole and sliced
(``runtime/sequence.random_op_on_tp_shard``).

The streams' states are this rank's RNG state for ``--save`` / ``--resume``
(:func:`state_dict`); ``--verify`` runs with dropout inactive and the other random ops on
fixed stand-ins (:func:`dropout_active`) and computes the reference under
:class:`EagerDropoutOff` and :class:`RandomStandIns`.
"""
from __future__ import annotations

import contextlib
import hashlib
import math

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..plan.parallel_plan import DROPOUT_OPS, RANDOM_OPS, REPLICATED, TP_LOCAL  # noqa: F401  (re-exported)


_seeds: dict[str, int] = {}          # stream -> seed
_generators: dict = {}               # (stream, device type) -> torch.Generator
_ops: dict = {}                      # op name -> OpOverload
_active = True


def stream_seeds(seed: int, pp_rank: int, dp_rank: int, tp_rank: int, tp: int,
                 restart: int = 0) -> dict[str, int]:
    """Seed of each stream of the rank at (pp_rank, dp_rank, tp_rank); see the module doc.
    ``restart`` > 0 (a resume without saved states for this layout) gives other seeds, so
    the masks of the steps before it are not drawn again."""
    first = (pp_rank, dp_rank, restart) == (0, 0, 0)
    seeds = {REPLICATED: seed if first else _mix(seed, REPLICATED, pp_rank, dp_rank, restart)}
    if tp > 1:
        seeds[TP_LOCAL] = _mix(seed, TP_LOCAL, pp_rank, dp_rank, tp_rank, restart)
    return seeds


def _mix(*parts) -> int:
    """A 63-bit seed from ``parts`` (distinct coordinates give distinct, unrelated seeds)."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little") >> 1


def seed_streams(seed: int, pp_rank: int, dp_rank: int, tp_rank: int, tp: int,
                 restart: int = 0) -> None:
    """(Re)start this process's streams for its mesh coordinates (``runtime/setup.py`` init)."""
    global _active
    _seeds.clear()
    _seeds.update(stream_seeds(seed, pp_rank, dp_rank, tp_rank, tp, restart))
    _generators.clear()
    _active = True


def _generator(stream: str, device: torch.device):
    """This rank's generator of ``stream`` on ``device``'s type; None when unseeded."""
    name = stream if stream in _seeds else REPLICATED  # tp = 1: one stream
    if name not in _seeds:
        return None
    key = (name, device.type)
    if key not in _generators:
        _generators[key] = torch.Generator(device).manual_seed(_seeds[name])
    return _generators[key]


def _default_generator(device: torch.device):
    if device.type == "cpu":
        return torch.default_generator
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return torch.cuda.default_generators[index]
    return None


def _first_tensor(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a
    return None


def random_op(stream: str, op: str, *args, **kwargs):
    """Run ATen ``op`` (a key of :data:`DROPOUT_OPS` or :data:`RANDOM_OPS`) on ``args``
    drawing from ``stream``.

    Outputs are ``op``'s (same shapes). Eager-identical when the stream's generator is in
    the state the default generator would be in. Without seeded streams (a stage module
    used outside ``init``), under FakeTensor/meta tracing, or on a device without a default
    generator, it is ``op`` itself on the default generator. Made inactive
    (:func:`dropout_active`), a dropout runs with probability 0 and draws nothing, any other
    random op gives its :class:`RandomStandIns` value.
    """
    fn = _ops.get(op)
    if fn is None:
        fn = _ops[op] = _resolve(op)
    if not _active:
        if op not in DROPOUT_OPS:
            with RandomStandIns():
                return fn(*args, **kwargs)
        args, kwargs = _without_dropout(op, args, kwargs)
        return fn(*args, **kwargs)
    device = _device(args, kwargs)
    if device is None:
        return fn(*args, **kwargs)
    gen, default = _generator(stream, device), _default_generator(device)
    if gen is None or default is None:
        return fn(*args, **kwargs)
    saved = default.get_state()
    default.set_state(gen.get_state())
    try:
        return fn(*args, **kwargs)
    finally:
        gen.set_state(default.get_state())
        default.set_state(saved)


def _device(args, kwargs):
    """The device ``op`` draws on: its first tensor's, a factory's ``device`` (cpu by
    default); None under FakeTensor/meta tracing (nothing real is drawn)."""
    x = _first_tensor(args, kwargs)
    if x is not None:
        fake = x.is_meta or isinstance(x, torch._subclasses.FakeTensor)
        return None if fake else x.device
    if torch._guards.detect_fake_mode() is not None:
        return None
    device = torch.device(kwargs.get("device") or "cpu")
    return None if device.type == "meta" else device


def _resolve(op: str):
    namespace, name, overload = op.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), name), overload)


def _without_dropout(op: str, args, kwargs) -> tuple[list, dict]:
    """``op``'s arguments with its dropout probability set to 0."""
    pos, kw = DROPOUT_OPS[op]
    args = list(args)
    if kw in kwargs:
        kwargs = {**kwargs, kw: 0.0}
    elif len(args) > pos:
        args[pos] = 0.0
    return args, kwargs


def drawing() -> bool:
    """Whether :func:`random_op` draws (False under ``dropout_active(False)``: --verify)."""
    return _active


@contextlib.contextmanager
def dropout_active(active: bool):
    """Within the block, ``random_op`` runs dropout with probability 0 and the other random
    ops on their stand-ins when not ``active`` (``--verify``: the reference runs under
    :class:`EagerDropoutOff` and :class:`RandomStandIns`)."""
    global _active
    before, _active = _active, active
    try:
        yield
    finally:
        _active = before


def state_dict() -> dict[str, torch.Tensor]:
    """This rank's stream states, ``{"<stream>.<device type>": uint8 tensor}`` (CPU mt19937:
    5056 bytes; CUDA Philox: 16), to be saved per rank and given to :func:`load_state_dict`.
    Generators not created yet are at their seed and need no entry."""
    return {f"{s}.{d}": g.get_state() for (s, d), g in sorted(_generators.items())}


def load_state_dict(states: dict[str, torch.Tensor]) -> None:
    """Restore :func:`state_dict`'s states (after :func:`seed_streams` for the same rank).

    Raises:
        KeyError: a state names a stream this rank does not have (another tp degree).
    """
    for key, state in states.items():
        stream, device = key.split(".")
        if stream not in _seeds:
            raise KeyError(f"RNG stream {stream!r} (this rank has {sorted(_seeds)})")
        _generator(stream, torch.device(device)).set_state(state)


def checkpoint_contexts():
    """``context_fn`` for ``torch.utils.checkpoint``: its recompute draws the masks the
    forward drew, and runs dropout active or not as the forward did. checkpoint restores the
    default generators itself but not these streams (Megatron's ``CheckpointFunction``
    restores its tracker for the same reason)."""
    at_forward: dict = {}

    @contextlib.contextmanager
    def forward():
        at_forward.update(state_dict())
        at_forward[_ACTIVE] = _active
        yield

    return forward(), _Recompute(at_forward)


class _Recompute:
    """The recompute side of :func:`checkpoint_contexts`. Re-enterable: a split backward
    (zero-bubble schedules' input- then weight-gradient passes) recomputes a checkpointed
    block twice, and a generator-based context manager can be entered only once."""

    def __init__(self, at_forward: dict):
        self.at_forward, self.saved = at_forward, []

    def __enter__(self):
        global _active
        self.saved.append((state_dict(), _active))
        _restore(self.at_forward)
        _active = self.at_forward[_ACTIVE]

    def __exit__(self, *exc):
        global _active
        now, _active = self.saved.pop()
        _restore(now)
        return False


_ACTIVE = "active"  # a key of checkpoint_contexts' record beside the stream states


def _restore(states: dict) -> None:
    """Every generator to its state in ``states``; one created since then to its seed."""
    for (stream, device), gen in _generators.items():
        state = states.get(f"{stream}.{device}")  # not _ACTIVE: no stream has that name
        if state is None:
            gen.manual_seed(_seeds[stream])
        else:
            gen.set_state(state)


_EAGER_DROPOUT = None


def _eager_dropout_fns():
    global _EAGER_DROPOUT
    if _EAGER_DROPOUT is None:
        F = torch.nn.functional
        _EAGER_DROPOUT = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout,
                          F.feature_alpha_dropout, torch.dropout, torch.feature_dropout,
                          torch.alpha_dropout, torch.feature_alpha_dropout}
    return _EAGER_DROPOUT


def _eager_rnn_fns():
    return {torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu}


class EagerDropoutOff(TorchFunctionMode):
    """Dropout inactive in an eager model that stays in training mode: ``F.dropout`` and
    its variants return their input (what they return with ``training=False``);
    ``scaled_dot_product_attention`` runs with ``dropout_p=0`` and an RNN (``nn.LSTM``,
    ``nn.GRU``, ``nn.RNN``: ``torch.lstm`` and the like) with ``dropout=0``.

    A ``@torch.jit.script`` function calls no Python (Megatron's ``bias_dropout_add``): its
    dropout runs ATen's, whose mask :class:`RandomStandIns` fixes to its mean (the identity,
    exactly). TorchScript's optimized plan (from its third call) runs a fused
    ``native_dropout`` with its own autodiff instead, out of a stand-in's reach: the
    reference drew a new mask on every step (zoo 17 Z4). Under this mode the JIT runs its
    functions unoptimized, op by op."""

    def __enter__(self):
        self._unoptimized = torch.jit.optimized_execution(False)
        self._unoptimized.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            self._unoptimized.__exit__(None, None, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _eager_dropout_fns():
            return args[0] if args else kwargs["input"]
        if func is torch.nn.functional.scaled_dot_product_attention:
            args, kwargs = _without_dropout("aten.scaled_dot_product_attention.default", args, kwargs)
        elif func in _eager_rnn_fns():
            args = list(args)
            # (input, hx, params, ...) or, packed, (data, batch_sizes, hx, params, ...):
            # dropout is the third argument after params, the last list among the first four
            params = max(i for i in range(1, 4) if isinstance(args[i], (list, tuple)))
            args[params + 3] = 0.0
        return func(*args, **kwargs)


# --verify's value of each random op outside dropout (:class:`RandomStandIns`), from its
# bound arguments: its distribution's mean (for integer draws the mean rounded down, a
# permutation the identity, multinomial the most probable categories).
_STAND_INS = {
    # the model run eagerly calls the ``.generator`` overloads where it passes generator=None
    # (diffusers' randn_tensor); the captured graph has the default ones (capture.py)
    **dict.fromkeys(("aten.rand.default", "aten.rand.generator", "aten.rand_like.default"),
                    lambda a: 0.5),
    **dict.fromkeys(("aten.randn.default", "aten.randn.generator", "aten.randn_like.default"),
                    lambda a: 0.0),
    **dict.fromkeys(("aten.randint.default", "aten.randint.generator",
                     "aten.randint_like.default"), lambda a: (a["high"] - 1) // 2),
    **dict.fromkeys(("aten.randint.low", "aten.randint.low_generator",
                     "aten.randint_like.low_dtype"), lambda a: (a["low"] + a["high"] - 1) // 2),
    **dict.fromkeys(("aten.randperm.default", "aten.randperm.generator"),
                    lambda a: torch.arange(a["n"])),
    **dict.fromkeys(("aten.uniform.default", "aten.uniform_.default"),
                    lambda a: (a["from"] + a["to"]) / 2),
    **dict.fromkeys(("aten.normal_.default", "aten.normal.float_float", "aten.normal.Tensor_float",
                     "aten.normal.float_Tensor", "aten.normal.Tensor_Tensor"),
                    lambda a: a["mean"]),
    **dict.fromkeys(("aten.exponential.default", "aten.exponential_.default"),
                    lambda a: 1.0 / a["lambd"]),
    **dict.fromkeys(("aten.cauchy.default", "aten.cauchy_.default"), lambda a: a["median"]),
    **dict.fromkeys(("aten.log_normal.default", "aten.log_normal_.default"),
                    lambda a: math.exp(a["mean"] + a["std"] ** 2 / 2)),
    **dict.fromkeys(("aten.geometric.default", "aten.geometric_.default"),
                    lambda a: float(math.floor(1.0 / a["p"]))),
    **dict.fromkeys(("aten.bernoulli_.float", "aten.bernoulli.p", "aten.bernoulli.Tensor",
                     "aten.bernoulli_.Tensor"), lambda a: a["p"]),
    **dict.fromkeys(("aten.bernoulli.default", "aten.poisson.default",
                     "aten._standard_gamma.default"), lambda a: a["self"]),
    "aten.multinomial.default": lambda a: _most_probable(a["self"], a["num_samples"],
                                                         a["replacement"]),
    # rrelu: the slope of its inference mode, (lower + upper) / 2 (None: rerun the op so)
    **dict.fromkeys(("aten.rrelu_with_noise.default", "aten.rrelu_with_noise_.default",
                     "aten.rrelu_with_noise_functional.default"), None),
}


def _most_probable(probs: torch.Tensor, n: int, replacement: bool) -> torch.Tensor:
    """multinomial's stand-in: the ``n`` most probable categories of each row (the most
    probable ``n`` times with replacement)."""
    if replacement:
        return probs.argmax(-1, keepdim=True).expand(*probs.shape[:-1], n)
    return probs.topk(n, -1).indices


def _bound(func, args, kwargs) -> dict:
    """``func``'s arguments by schema name, defaults filled in."""
    out = {}
    for i, arg in enumerate(func._schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            out[arg.name] = args[i]
        elif arg.name in kwargs:
            out[arg.name] = kwargs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
    return out


class RandomStandIns(TorchDispatchMode):
    """Every random op of :data:`RANDOM_OPS` gives a fixed value instead of a draw (its
    distribution's mean, :data:`_STAND_INS`), the same for any shape or slice, on any rank:
    ``--verify``'s reference (``emit/reference.py``) and program (:func:`random_op` under
    ``dropout_active(False)``) run under it, so the comparison stays exact as dropout's does
    with dropout inactive. Dispatch level, below autograd: each op keeps its own gradient
    formula. The op still runs (and draws) first, so output dtype, device and memory format
    are its own; then its output is overwritten."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        if name not in _STAND_INS:
            return func(*args, **kwargs)
        value = _STAND_INS[name]
        if value is None:  # rrelu
            args, kwargs = _with_arg(func, args, kwargs, "training", False)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        v = value(_bound(func, args, kwargs))
        if isinstance(v, torch.Tensor):
            out.copy_(v)
        else:
            out.fill_(v)
        return out


def _with_arg(func, args, kwargs, name: str, value) -> tuple:
    """(args, kwargs) of ``func`` with argument ``name`` set to ``value`` (in place of a
    positional one, else as a keyword)."""
    i = [a.name for a in func._schema.arguments].index(name)
    if i < len(args):
        return (*args[:i], value, *args[i + 1:]), kwargs
    return args, {**kwargs, name: value}
