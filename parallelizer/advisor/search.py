"""Enumerate 3D layouts for a Workload on a Cluster and rank them by predicted step time.

Pure search on data (no graph): every (tp, pp, dp, dp_replicate, ZeRO stage, micro-batch
size x count, virtual stages, activation checkpointing) whose degrees multiply to the
cluster's GPUs and whose global batch splits exactly; those that fit each rank's memory
(``step_time.predict``'s analytical estimate) are ranked by predicted step time.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..errors import UserError
from .cluster import Cluster
from .step_time import Candidate, Prediction, predict, rank_stats
from .workload import Workload

TERM_NAMES = {"compute": "compute", "bubble": "pipeline bubble", "tp": "tensor-parallel all-reduces",
              "pp": "pipeline sends", "dp": "data-parallel communication"}


@dataclass(frozen=True)
class SearchResult:
    ranked: list            # Prediction, fastest first, all fitting
    considered: int
    fitting: int
    smallest: Prediction | None  # the layout needing the least memory (for the error message)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(w: Workload, cluster: Cluster, global_batch: int, zero_stages=(0, 1, 2, 3),
               max_micro_batch: int = 16, virtual=(1, 2, 4), accumulate: bool = False):
    """Every layout the search considers (see the module docstring). Micro-batching: at
    pp = 1 one microbatch per step unless ``accumulate`` (parallelizer's runtime runs no
    gradient accumulation at pp = 1; Megatron-LM does); at pp > 1 M >= pp, and M a
    multiple of pp when interleaved (Narayanan et al. 2021, §2.2.2)."""
    world, gpn = cluster.world, cluster.gpus_per_node
    for tp in divisors(world):
        if w.heads % tp or tp > max(gpn, 1) * 2:
            continue
        for pp in divisors(world // tp):
            if pp > w.layers:
                continue
            dp = world // (tp * pp)
            if global_batch % dp:
                continue
            per_dp = global_batch // dp
            for micro in divisors(per_dp):
                m = per_dp // micro
                if micro > max_micro_batch or (pp == 1 and m != 1 and not accumulate) or (pp > 1 and m < pp):
                    continue
                for v in virtual if pp > 1 else (1,):
                    if v > 1 and (m % pp or pp * v > w.layers):
                        continue
                    for z in zero_stages:
                        reps = [1]
                        if z >= 2 and tp < gpn and dp * tp > gpn and dp % (gpn // tp) == 0:
                            reps.append(dp // (gpn // tp))    # shard inside a node, replicate across
                        for rep in reps:
                            for rc in (False, True):
                                yield Candidate(tp, pp, dp, micro, m, z, v, rc, rep)


FIX_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "zero": "zero_stage", "mb": "micro_batch",
            "m": "microbatches", "v": "virtual_stages", "ac": "recompute", "rep": "dp_replicate"}


def parse_fix(text: str) -> dict:
    """``tp=1,pp=1,zero=3`` -> Candidate field values the search must keep (``--fix``).

    Raises:
        UserError: an item that is not KEY=INTEGER with KEY in FIX_KEYS."""
    out = {}
    for item in filter(None, (x.strip() for x in (text or "").split(","))):
        key, eq, value = item.partition("=")
        if not eq or key not in FIX_KEYS or not value.strip().isdigit():
            raise UserError(f"--fix: '{item}' is not KEY=INTEGER with KEY one of "
                            f"{', '.join(FIX_KEYS)}; e.g. --fix tp=1,pp=1,zero=3")
        out[FIX_KEYS[key]] = bool(int(value)) if key == "ac" else int(value)
    return out


def search(w: Workload, cluster: Cluster, global_batch: int, fix: dict | None = None,
           **options) -> SearchResult:
    """Rank the fitting layouts (only those with the field values in ``fix``, if given).
    Raises UserError when no layout fits memory or the global batch cannot be split over
    any data-parallel degree."""
    stats_cache: dict = {}
    fitting, considered, smallest = [], 0, None
    mem_cap = cluster.usable_memory_bytes
    for lay in candidates(w, cluster, global_batch, **options):
        if fix and any(getattr(lay, k) != v for k, v in fix.items()):
            continue
        key = (lay.pp, lay.virtual_stages)
        if key not in stats_cache:
            stats_cache[key] = rank_stats(w, lay.pp, lay.virtual_stages)
        pred = predict(w, cluster, lay, stats_cache[key], global_batch)
        considered += 1
        if smallest is None or pred.memory_bytes < smallest.memory_bytes:
            smallest = pred
        if pred.memory_bytes <= mem_cap:
            fitting.append(pred)
    if not considered and fix:
        raise UserError(f"no layout has {fix} for --global-batch {global_batch} on {cluster.world} "
                        f"GPUs (degrees must multiply to the GPUs, dp x microbatches x micro-batch "
                        f"size to the batch); loosen --fix")
    if not considered:
        raise UserError(f"no layout splits --global-batch {global_batch} over {cluster.world} GPUs "
                        f"(dp must divide the batch, tp the {w.heads} heads, pp <= {w.layers} "
                        f"blocks); use a global batch divisible by a larger power of two")
    if not fitting:
        s = smallest
        raise UserError(f"no layout fits {cluster.usable_memory_bytes / 1e9:.4g} GB per GPU (usable_memory "
                        f"{cluster.usable_memory:g} of {cluster.memory_bytes / 1e9:.4g} GB): the smallest, "
                        f"{s.candidate.short()}, needs {s.memory_bytes / 1e9:.4g} GB on its fullest rank; "
                        f"add GPUs (nodes), use a GPU with more memory, or a smaller model")
    # ties (communication fully hidden in both) go to the layout that sends less, then uses less memory
    fitting.sort(key=lambda p: (p.step_s, sum(p.volumes.values()), p.memory_bytes))
    return SearchResult(fitting, considered, len(fitting), smallest)


def why(pred: Prediction, runner_up: Prediction | None) -> str:
    """One line: the dominant term and what the next-best loses (the term that grows most)."""
    step = pred.step_s
    dom = pred.dominant
    text = f"compute {pred.terms['compute'] / step:.0%} of the step; " + (
        f"largest overhead {TERM_NAMES[dom]} {pred.terms[dom] / step:.0%}" if dom != "compute"
        else "no exposed communication or bubble")
    if runner_up is not None and runner_up.step_s <= step * 1.0005:
        sent = (sum(runner_up.volumes.values()) - sum(pred.volumes.values())) / 1e9
        mem = (runner_up.memory_bytes - pred.memory_bytes) / 1e9
        text += (f"; ties with {runner_up.candidate.short()} (which sends {sent:+.3g} GB per GPU "
                 f"and needs {mem:+.3g} GB)")
    elif runner_up is not None:
        diff = {k: runner_up.terms[k] - pred.terms[k] for k in pred.terms}
        worst = max(diff, key=diff.get)
        text += (f"; next-best ({runner_up.candidate.short()}) is {runner_up.step_s / step - 1:+.1%}, "
                 f"mostly {TERM_NAMES[worst]} ({diff[worst] * 1e3:+.3g} ms)")
    return text


def rank_of(result: SearchResult, match) -> int | None:
    """1-based position of the first ranked layout for which ``match(layout)`` holds."""
    for i, p in enumerate(result.ranked):
        if match(p.candidate):
            return i + 1
    return None
