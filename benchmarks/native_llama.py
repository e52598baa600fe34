"""The baseline: a Hugging Face ``LlamaForCausalLM`` parallelized by hand with torch's own
APIs, the way torch's TP/FSDP2/pipelining tutorials and torchtitan
(``torchtitan/models/llama3/infra/parallelize.py``, ``distributed/pipeline_parallel.py``) do it:

1. pipeline split (pp > 1): each stage keeps its own slice of the decoder layers (a
   ``ModuleDict`` keyed by the original layer index, as torchtitan does) plus the embedding
   (first stage) or the final norm and LM head (last stage); ``PipelineStage`` + the
   schedule of ``torch.distributed.pipelining``;
2. tensor parallelism: ``parallelize_module`` with the Megatron plan (q/k/v and gate/up
   ``ColwiseParallel``, o and down ``RowwiseParallel``), heads then counted from the local
   shapes (HF views with ``-1`` heads). The vocabulary is sharded as torchtitan does and as
   the emitted program does (vocab_parallel): the embedding ``RowwiseParallel`` (rows over
   tp, output all-reduced), the LM head ``ColwiseParallel`` (logits ``Shard(-1)``) and the
   loss computed on a DTensor under ``loss_parallel``, so both shard the same tensors and
   the comparison is of the runtimes, not of the plans;
3. data parallelism: FSDP2 ``fully_shard`` per decoder layer, then the stage root.

Mesh ``(pp, dp, tp)``, tp innermost, the same rank layout as the emitted program.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                               parallelize_module)
from transformers.masking_utils import create_causal_mask

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}

# torchtitan's Llama plan in Hugging Face names (= LlamaConfig.base_model_tp_plan)
LAYER_TP_PLAN = {
    "self_attn.q_proj": ColwiseParallel(),
    "self_attn.k_proj": ColwiseParallel(),
    "self_attn.v_proj": ColwiseParallel(),
    "self_attn.o_proj": RowwiseParallel(),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(),
}


class LlamaStage(nn.Module):
    """Layers ``[lo, hi)`` of a ``LlamaForCausalLM``, with the embedding when ``lo == 0`` and
    norm + LM head when ``hi`` is the last layer (torchtitan's "model with the other stages'
    modules removed"). Input: token ids (first stage) or hidden states (b, s, h); output:
    hidden states, or logits (b, s, vocab) on the last stage."""

    def __init__(self, model: nn.Module, lo: int, hi: int):
        super().__init__()
        inner = model.model
        n = len(inner.layers)
        self.config = inner.config
        self.embed_tokens = inner.embed_tokens if lo == 0 else None
        self.layers = nn.ModuleDict({str(i): inner.layers[i] for i in range(lo, hi)})
        self.rotary_emb = inner.rotary_emb  # recomputed per stage, as torchtitan's freqs_cis
        self.norm = inner.norm if hi == n else None
        self.lm_head = model.lm_head if hi == n else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        position_ids = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        mask = create_causal_mask(config=self.config, inputs_embeds=h, attention_mask=None,
                                  cache=None, position_ids=position_ids)
        pos = self.rotary_emb(h, position_ids=position_ids)
        for layer in self.layers.values():
            h = layer(h, attention_mask=mask, position_embeddings=pos, position_ids=position_ids)
        if self.lm_head is None:
            return h
        return self.lm_head(self.norm(h))


def split_points(n_layers: int, pp: int) -> list[tuple[int, int]]:
    """Even contiguous layer ranges per stage (torchtitan's default split)."""
    per, extra = divmod(n_layers, pp)
    out, lo = [], 0
    for s in range(pp):
        hi = lo + per + (1 if s < extra else 0)
        out.append((lo, hi))
        lo = hi
    return out


class NativeLlama:
    """This rank's part of ``model`` under mesh ``(pp, dp, tp)``; ``step(ids)`` runs forward and
    backward of this rank's data-parallel share ``ids`` (b_local, s) and returns the mean
    loss over the global batch (0-dim, every rank); the caller steps the optimizer.

    ``loss_fn(logits, ids)``: mean next-token cross-entropy (a mean over samples).
    """

    def __init__(self, model: nn.Module, *, pp: int, dp: int, tp: int, microbatches: int,
                 schedule: str, device: torch.device, loss_fn):
        self.pp, self.dp, self.tp, self.loss_fn = pp, dp, tp, loss_fn
        self.mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
        self.pp_rank = self.mesh.get_local_rank("pp")
        lo, hi = split_points(len(model.model.layers), pp)[self.pp_rank]
        self.module = LlamaStage(model, lo, hi).to(device)
        self.is_last = hi == len(model.model.layers)
        if tp > 1:
            for layer in self.module.layers.values():
                parallelize_module(layer, self.mesh["tp"], LAYER_TP_PLAN)
            vocab = {"embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                     "lm_head": ColwiseParallel()}  # local logits: the loss wraps them
            parallelize_module(self.module, self.mesh["tp"],
                               {k: v for k, v in vocab.items() if getattr(self.module, k) is not None})
        if dp > 1:
            for layer in self.module.layers.values():
                fully_shard(layer, mesh=self.mesh["dp"])
            fully_shard(self.module, mesh=self.mesh["dp"])
        self.schedule = None
        if pp > 1:
            stage = PipelineStage(self.module, self.pp_rank, pp, device, group=self.mesh["pp"].get_group())
            self.schedule = SCHEDULES[schedule](stage, n_microbatches=microbatches,
                                                loss_fn=self._loss)

    def _loss(self, logits, ids):
        """``loss_fn`` on the logits as a DTensor ``Shard(-1)`` (torch's loss_parallel)."""
        if self.tp > 1:
            logits = DTensor.from_local(logits, self.mesh["tp"], [Shard(-1)], run_check=False)
        loss = self.loss_fn(logits, ids)
        return loss.full_tensor() if isinstance(loss, DTensor) else loss

    def parameters(self):
        return self.module.parameters()

    def step(self, ids: torch.Tensor) -> torch.Tensor:
        with loss_parallel() if self.tp > 1 else contextlib.nullcontext():
            return self._step(ids)

    def _step(self, ids: torch.Tensor) -> torch.Tensor:
        if self.schedule is None:
            loss = self._loss(self.module(ids), ids)
            loss.backward()
        elif self.pp_rank == 0:
            self.schedule.step(ids)
            loss = None
        elif self.is_last:
            losses = []
            self.schedule.step(target=ids, losses=losses)
            loss = torch.stack(losses).mean()
        else:
            self.schedule.step()
            loss = None
        return loss
