"""Gradient compression of the data-parallel reduction (spec ``data_parallel.compression``;
methods, sources and the combinations allowed: ``parallelizer/plan/compression.py``).

One :class:`GradCompression` per rank drives a DDP communication hook ``hook(state, bucket)
-> Future[Tensor]`` (torch's ``fp16_compress_hook``, ``bf16_compress_hook``,
``powerSGD_hook``, or :func:`topk_hook`) through three entry points:

- DDP (zero_stage 0/1, pp = 1): ``register_comm_hook`` on the replicated module;
- pipeline parallelism (zero_stage 0/1, pp > 1), where DDP is not used: :meth:`reduce`
  runs the hook on one flat bucket of all the stage's gradients after the schedule;
- HSDP (zero_stage 2/3, ``mesh.dp_replicate`` > 1), powersgd/topk: FSDP2 shards over
  ``dp_shard`` only and ``set_all_reduce_hook`` runs the hook over the ``dp_replicate`` group
  on each unit's reduce-scatter output, in place of HSDP's plain all-reduce (torch 2.13's
  hook runs *after* native HSDP's all-reduce, so it cannot replace it there).

The hooks take any object with ``index() buffer() gradients() is_last() parameters()``:
:class:`FlatBucket` gives the second and third paths the bucket DDP would have built.
Error-feedback state is per rank (each rank's residual differs): :meth:`state_dict`.
(No ``from __future__ import annotations``: DDP checks the hook's return annotation object.)
"""
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook as psgd

from ..plan.compression import topk_count
from ..errors import CheckpointError


class FlatBucket:
    """A ``GradBucket`` look-alike over a flat ``buffer`` holding tensors of ``shapes`` at
    ``offsets`` (elements); gradients() are views into the buffer, as DDP's are."""

    def __init__(self, index: int, buffer: torch.Tensor, shapes, offsets, params=(), wrap=None):
        self._index, self._buffer, self._params, self.wrap = index, buffer, list(params), wrap
        self._views = [buffer[o:o + _numel(s)].view(s) for s, o in zip(shapes, offsets)]

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:
        self._buffer.copy_(tensor)

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list:
        return self._params

    def is_last(self) -> bool:
        return False  # iterations are counted by GradCompression.finish_step


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


class TopKState:
    """State of :func:`topk_hook`: the process group, the ratio, and per bucket index the
    residual ``error_dict[i]`` (flat, like the bucket) when error feedback is on."""

    def __init__(self, process_group, ratio: float, error_feedback: bool = True):
        self.process_group, self.ratio, self.error_feedback = process_group, ratio, error_feedback
        self.error_dict: dict[int, torch.Tensor] = {}
        # per bucket, [(parameter, this rank's residual of the last step, shaped like its
        # .grad)], for --verify: reduced gradient + mean residual = uncompressed mean
        self.last_residuals: dict[int, list] = {}


def topk_hook(state: TopKState, bucket) -> torch.futures.Future[torch.Tensor]:
    """Top-K sparsified all-reduce with error feedback (Stich et al. 2018, "Sparsified SGD
    with Memory", Alg. 1; Lin et al. 2018, "Deep Gradient Compression", §3.1), a DDP comm hook.

    Per gradient tensor of the bucket (flat, n entries) this rank adds its residual, keeps
    the ``ceil(ratio n)`` entries of largest magnitude, stores the rest as the new residual,
    and all-gathers (values, int32 indices) of all tensors in one call (bytes per rank:
    k (elem + 4)); every rank then sums the gathered sparse tensors and divides by the group
    size, so all ranks hold the same averaged, sparse gradient. Returns a future of the
    bucket buffer, written in place.
    """
    group = state.process_group if state.process_group is not None else dist.group.WORLD
    world = group.size()
    buf = bucket.buffer()
    index = bucket.index()
    if state.error_feedback and index in state.error_dict:
        buf.add_(state.error_dict[index])
    chosen = []
    for t in bucket.gradients():
        start = t.storage_offset() - buf.storage_offset()
        flat = buf[start:start + t.numel()]
        k = topk_count(flat.numel(), state.ratio)
        chosen.append(flat.abs().topk(k, sorted=False).indices + start)
    idx = torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long, device=buf.device)
    vals = buf[idx]
    residual = buf.clone()
    residual[idx] = 0
    if state.error_feedback:
        state.error_dict[index] = residual
    wrap = getattr(bucket, "wrap", None) or (lambda i, t: t)
    state.last_residuals[index] = [
        (p, wrap(i, residual[g.storage_offset() - buf.storage_offset():][:g.numel()].view(g.shape)))
        for i, (p, g) in enumerate(zip(bucket.parameters(), bucket.gradients()))]
    packed = torch.cat([vals.contiguous().view(torch.uint8), idx.to(torch.int32).view(torch.uint8)])
    gathered = torch.empty(world * packed.numel(), dtype=torch.uint8, device=buf.device)
    nval = vals.numel() * vals.element_size()

    def decompress(fut):
        rows = gathered.view(world, -1)
        all_vals = rows[:, :nval].contiguous().view(buf.dtype).reshape(-1)
        all_idx = rows[:, nval:].contiguous().view(torch.int32).reshape(-1).long()
        buf.zero_()
        buf.index_add_(0, all_idx, all_vals)
        return buf.div_(world)

    work = dist.all_gather_single(gathered, packed, group=group, async_op=True)
    return work.get_future().then(decompress)


class _InOrderDist:
    """``torch.distributed`` as torch's powerSGD_hook sees it inside :func:`_powersgd_in_order`:
    an async all-reduce is waited for before it returns, so its future is complete and
    ``.then`` runs the next step (P's, then Q's all-reduce) inline, on this thread."""

    def __getattr__(self, name):
        return getattr(dist, name)

    @staticmethod
    def all_reduce(tensor, *args, **kwargs):
        work = dist.all_reduce(tensor, *args, **{**kwargs, "async_op": True})
        work.wait()
        return work


def _powersgd_in_order(state, bucket) -> torch.futures.Future[torch.Tensor]:
    """torch's ``powerSGD_hook`` with its all-reduces completed in program order on the
    calling thread. The hook issues P's and Q's all-reduces from future callbacks; under gloo
    those ran on gloo's thread when the previous all-reduce completed, racing the next
    bucket's first all-reduce from the autograd thread, so ranks issued them in different
    orders (a 'collective mismatch' abort with DDP's two buckets, GPT example at dp=2 x
    tp=2), and a dispatch mode (benchmarks/_comm.py) never saw them. NCCL futures run
    callbacks on the issuing thread, so there torch's hook is used as it is."""
    psgd.dist = _InOrderDist()
    try:
        out = psgd.powerSGD_hook(state, bucket).wait()
    finally:
        psgd.dist = dist
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(out)
    return fut


def _bf16_hook():
    """torch's ``bf16_compress_hook``; on a non-CUDA build the same computation under another
    name, because DDP refuses that hook by name unless NCCL >= 2.10 is present, although
    gloo all-reduces bf16 (checked with torch 2.13)."""
    if torch.version.cuda is not None or torch.version.hip is not None:
        return default_hooks.bf16_compress_hook

    def bf16_compress_hook_gloo(process_group, bucket) -> torch.futures.Future[torch.Tensor]:
        return default_hooks._compress_hook(torch.bfloat16, process_group, bucket)
    return bf16_compress_hook_gloo


class GradCompression:
    """This rank's compression of the dp gradient reduction over ``group`` (the dp group,
    or under HSDP the dp_replicate group), by ``settings`` (``ParallelPlan.compression``)."""

    def __init__(self, settings: dict, group):
        self.method, self.group = settings["method"], group
        self.flat_iter = False  # True when iterations are counted by finish_step (not DDP)
        if self.method in ("fp16", "bf16"):
            self.state = group
            self.hook = default_hooks.fp16_compress_hook if self.method == "fp16" else _bf16_hook()
        elif self.method == "powersgd":
            self.state = psgd.PowerSGDState(
                process_group=group, matrix_approximation_rank=settings["rank"],
                start_powerSGD_iter=settings["start_iter"],
                use_error_feedback=settings["error_feedback"], warm_start=True)
            self.hook = psgd.powerSGD_hook if dist.get_backend(group) != "gloo" else _powersgd_in_order
        elif self.method == "topk":
            self.state = TopKState(group, settings["ratio"], settings["error_feedback"])
            self.hook = topk_hook
        else:
            raise ValueError(f"no compression hook for method {self.method!r}")

    def register_ddp(self, module: torch.nn.Module) -> None:
        """DDP (composable ``replicate``): torch runs the hook per bucket; PowerSGD counts
        its iterations on the last bucket (buckets never rebuild: find_unused_parameters)."""
        module.register_comm_hook(self.state, self.hook)

    def reduce(self, grads: list[torch.Tensor], params=(), index: int = 0) -> None:
        """Average ``grads`` (of ``params``) over the group through the hook, in place (one
        flat bucket)."""
        self.flat_iter = True
        flat = torch._utils._flatten_dense_tensors(grads)
        offsets, o = [], 0
        for g in grads:
            offsets.append(o)
            o += g.numel()
        out = self.hook(self.state, FlatBucket(index, flat, [g.shape for g in grads], offsets, params)).wait()
        for g, synced in zip(grads, torch._utils._unflatten_dense_tensors(out, grads)):
            g.copy_(synced)

    def add_fsdp_unit(self, fsdp_module) -> None:
        """Install the hook as ``fsdp_module``'s all-reduce (``set_all_reduce_hook``); units
        are numbered in the order added, which keys their state."""
        if not fsdp_module._get_fsdp_state()._fsdp_param_groups:
            return  # a unit without parameters of its own (a stage root holding only blocks)
        self.units = getattr(self, "units", 0) + 1
        fsdp_module.set_all_reduce_hook(self._fsdp_hook(fsdp_module, self.units - 1))

    def _fsdp_hook(self, fsdp_module, index: int):
        """``set_all_reduce_hook`` callable for one FSDP2 unit: its reduce-scatter output
        (this rank's shards of the unit's gradients, each padded to FSDP2's even chunk)
        averaged over the replicate group in place. Unit ``index`` keys its state."""
        self.flat_iter = True
        params = fsdp_module._get_fsdp_state()._fsdp_param_groups[0].fsdp_params

        def hook(reduce_output: torch.Tensor) -> None:
            shapes, offsets, o = [], [], 0
            for fp in params:
                shapes.append(fp.sharded_size)
                offsets.append(o)
                o += fp.padded_sharded_param_size.numel()
            held = [fp.sharded_param for fp in params]
            if o != reduce_output.numel():  # a parameter without a gradient: one flat tensor
                shapes, offsets, held = [reduce_output.shape], [0], []
            bucket = FlatBucket(index, reduce_output, shapes, offsets, held,
                                wrap=lambda i, t: params[i].to_sharded_dtensor(t))
            out = self.hook(self.state, bucket).wait()
            if out is not reduce_output:
                reduce_output.copy_(out)
        return hook

    def residuals(self) -> dict[int, torch.Tensor]:
        """Top-K: ``{id(parameter): residual}`` of the last step on this rank (a DTensor
        shard under FSDP2, like the parameter's ``.grad``); empty for other methods."""
        if self.method != "topk":
            return {}
        return {id(p): r for pairs in self.state.last_residuals.values() for p, r in pairs}

    def finish_step(self) -> None:
        """After a step's reduction: PowerSGD counts iterations on DDP's last bucket; the
        flat-bucket paths mark no bucket last and count here, once per step."""
        if self.flat_iter and self.method == "powersgd":
            self.state.iter += 1

    def state_dict(self) -> dict:
        """This rank's error-feedback state (tensors on the CPU) and counters."""
        s = self.state
        if self.method == "powersgd":
            return {"iter": s.iter, "rng": s.rng.get_state(), **{
                name: {k: v.cpu() for k, v in getattr(s, name).items()}
                for name in ("error_dict", "p_memory_dict", "q_memory_dict")}}
        if self.method == "topk":
            return {"error_dict": {k: v.cpu() for k, v in s.error_dict.items()}}
        return {}

    def load_state_dict(self, sd: dict, device: torch.device) -> None:
        s = self.state
        if self.method == "powersgd":
            s.iter = sd["iter"]
            s.rng.set_state(sd["rng"])
            for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
                setattr(s, name, {int(k): v.to(device) for k, v in sd[name].items()})
        elif self.method == "topk":
            s.error_dict = {int(k): v.to(device) for k, v in sd["error_dict"].items()}


def state_file(rank: int) -> str:
    """The file holding global rank ``rank``'s compression state inside a checkpoint."""
    return f"compression-rank{rank}.safetensors"


def _identity(plan) -> dict:
    """What a saved state must match to be resumed (error feedback is per rank of one mesh)."""
    return {"settings": plan.compression, "mesh": plan.mesh, "dp_replicate": plan.dp_replicate,
            "zero_stage": plan.zero_stage}


def write_state(comp: "GradCompression", plan, folder: Path, rank: int) -> tuple[str, dict]:
    """Write this rank's compression state into ``folder`` (a checkpoint's ``.partial``
    folder: it is published with the checkpoint, listed in its manifest) as safetensors:
    each residual / PowerSGD memory tensor as ``{dict}.{bucket}``, the PowerSGD generator's
    key as ``rng.key``, the rest as JSON metadata. No pickle: a checkpoint may come from
    anyone. Returns ``(file name, {"sha256", "bytes"})`` for the manifest's ``files``."""
    from ..checkpoint.stream import write_streamed
    sd = comp.state_dict()
    tensors = {f"{d}.{k}": t.contiguous() for d in _DICTS if d in sd for k, t in sd[d].items()}
    meta = {"identity": _identity(plan), "iter": sd.get("iter")}
    if "rng" in sd:  # numpy RandomState: ('MT19937', key[624] uint32, pos, has_gauss, gauss)
        name, key, *rest = sd["rng"]
        tensors["rng.key"] = torch.from_numpy(key.astype("int64"))
        meta["rng"] = [name, *(v.item() if hasattr(v, "item") else v for v in rest)]
    specs = [(k, tuple(t.shape), t.dtype) for k, t in sorted(tensors.items())]
    name = state_file(rank)
    digest, size = write_streamed(Path(folder) / name, specs, tensors.__getitem__,
                                  {"format": "pt", "compression": json.dumps(meta)}, fsync=True)
    return name, {"sha256": digest, "bytes": size}


_DICTS = ("error_dict", "p_memory_dict", "q_memory_dict")


def load_state(comp: "GradCompression", plan, ckpt: Path, rank: int, device,
               files: dict | None = None) -> None:
    """Restore what :func:`write_state` wrote for this rank into checkpoint ``ckpt``, after
    checking its sha256 against ``files`` (the manifest's ``files``; read from ``ckpt``'s
    manifest when None).

    Raises:
        CheckpointError: no state for this rank (a checkpoint saved without compression, or
            resharded), a corrupt file, or one saved under other compression settings or
            another mesh (error feedback is per rank of one mesh).
    """
    from safetensors import SafetensorError
    from ..checkpoint.reader import check_file_sha256, read_manifest
    name = state_file(rank)
    manifest = {"files": files} if files is not None else read_manifest(ckpt)
    if name not in manifest["files"]:
        raise CheckpointError(
            f"--resume {ckpt}: no {name}, the error-feedback state of "
            f"data_parallel.compression={comp.method} (saved by run.py --train --save of a program "
            f"with that compression, on this mesh; a resharded checkpoint has none); resume with "
            f"the program that saved it, or recompile with data_parallel.compression=none")
    check_file_sha256(ckpt, name, manifest)
    try:
        meta, sd = _read_state(Path(ckpt) / name)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, SafetensorError) as e:
        raise CheckpointError(f"--resume {ckpt}: {name} is not compression state this parallelizer "
                              f"wrote ({type(e).__name__}: {e}); resume with the checkpoint the "
                              f"program saved, or recompile with data_parallel.compression=none") from e
    mine = json.loads(json.dumps(_identity(plan)))  # as JSON reads it back (tuples -> lists)
    diff = {k: (meta["identity"].get(k), v) for k, v in mine.items() if meta["identity"].get(k) != v}
    if diff:
        shown = "; ".join(f"{k}: saved {a}, this program {b}" for k, (a, b) in diff.items())
        raise CheckpointError(f"--resume {ckpt}: {name} holds compression state of another "
                              f"program ({shown}); resume with the program that saved it")
    comp.load_state_dict(sd, device)


def _read_state(path: Path) -> tuple[dict, dict]:
    """(metadata, state dict) of a :func:`write_state` file. Raises KeyError, TypeError or
    ValueError on a file of another shape (the caller names the file)."""
    import numpy as np
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:
        meta = json.loads((f.metadata() or {})["compression"])
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if not isinstance(meta, dict) or not isinstance(meta["identity"], dict):
        raise TypeError("metadata 'compression' is not a JSON object with an 'identity'")
    sd: dict = {"iter": meta["iter"]}
    for k, t in tensors.items():
        d, _, bucket = k.rpartition(".")
        if d in _DICTS:
            sd.setdefault(d, {})[int(bucket)] = t
    if "rng" in meta:
        rng_name, *rest = meta["rng"]
        sd["rng"] = (rng_name, tensors["rng.key"].numpy().astype(np.uint32), *rest)
    for d in _DICTS:
        sd.setdefault(d, {})
    return meta, sd
