"""Model-parallel random streams for dropout (Megatron-LM, Shoeybi et al. 2019, §3, and its
``tensor_parallel.random.get_cuda_rng_tracker``; Korthikanti et al. 2022, §4.2, for dropout
in sequence-parallel regions).

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

The streams' states are this rank's RNG state for ``--save`` / ``--resume``
(:func:`state_dict`); ``--verify`` runs with dropout inactive (:func:`dropout_active`) and
computes the reference under :class:`EagerDropoutOff`.
"""
from __future__ import annotations

import contextlib
import hashlib

import torch
from torch.overrides import TorchFunctionMode

from ..plan.parallel_plan import DROPOUT_OPS, REPLICATED, TP_LOCAL  # noqa: F401  (re-exported)


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
    """Run ATen ``op`` (a key of :data:`DROPOUT_OPS`) on ``args`` drawing from ``stream``.

    Outputs are ``op``'s (same shapes). Eager-identical when the stream's generator is in
    the state the default generator would be in. Without seeded streams (a stage module
    used outside ``init``), under FakeTensor/meta tracing, or on a device without a default
    generator, it is ``op`` itself on the default generator. With dropout made inactive
    (:func:`dropout_active`) the probability is 0 and nothing is drawn.
    """
    fn = _ops.get(op)
    if fn is None:
        fn = _ops[op] = _resolve(op)
    if not _active:
        args, kwargs = _without_dropout(op, args, kwargs)
        return fn(*args, **kwargs)
    x = _first_tensor(args, kwargs)
    if x is None or x.is_meta or isinstance(x, torch._subclasses.FakeTensor):
        return fn(*args, **kwargs)
    gen, default = _generator(stream, x.device), _default_generator(x.device)
    if gen is None or default is None:
        return fn(*args, **kwargs)
    saved = default.get_state()
    default.set_state(gen.get_state())
    try:
        return fn(*args, **kwargs)
    finally:
        gen.set_state(default.get_state())
        default.set_state(saved)


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


@contextlib.contextmanager
def dropout_active(active: bool):
    """Within the block, ``random_op`` runs dropout with probability 0 when not ``active``
    (``--verify``: the reference runs under :class:`EagerDropoutOff`)."""
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


class EagerDropoutOff(TorchFunctionMode):
    """Dropout inactive in an eager model that stays in training mode: ``F.dropout`` and
    its variants return their input (what they return with ``training=False``) and
    ``scaled_dot_product_attention`` runs with ``dropout_p=0``."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _eager_dropout_fns():
            return args[0] if args else kwargs["input"]
        if func is torch.nn.functional.scaled_dot_product_attention:
            args, kwargs = _without_dropout("aten.scaled_dot_product_attention.default", args, kwargs)
        return func(*args, **kwargs)
