"""Enumerate 3D layouts for a Workload on a Cluster and rank them by predicted step time.

Pure search on data (no graph): every (tp, pp, dp, dp_replicate, ep, ZeRO stage, micro-batch
size x count, virtual stages, activation checkpointing) whose degrees multiply to the
cluster's GPUs and whose global batch splits exactly; those that fit each rank's memory
(``step_time.predict``'s analytical estimate) are ranked by predicted step time. ep (expert
parallelism, carved out of dp) takes the divisors of dp that divide every mixture-of-experts
layer's experts (``Workload.ep_choices``: only 1 for a dense model), where
:func:`runtime_accepts` says the emitted program runs it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import UserError
from .cluster import Cluster
from .step_time import Candidate, Prediction, memory_of, predict, rank_stats
from .workload import Workload

TERM_NAMES = {"compute": "compute", "bubble": "pipeline bubble", "tp": "tensor-parallel collectives",
              "ep": "expert-parallel all-to-alls",
              "pp": "pipeline sends", "pp_runtime": "pipeline runtime per action", "dp": "data-parallel communication", "optimizer": "optimizer step",
              "other": "loss and tied-weight all-reduces"}


@dataclass(frozen=True)
class SearchResult:
    ranked: list            # Prediction, fastest first, all fitting
    considered: int
    fitting: int
    smallest: Prediction | None  # the layout needing the least memory (for the error message)


def runtime_accepts(tp: int, ep: int, pp: int, zero: int) -> bool:
    """Whether the emitted program runs this (tp, ep, pp, ZeRO stage): the spec's own rule
    (``frontend/spec.py``, ``_check_data_parallel``): ep divides dp (the candidates' ep
    choices already do), with any tp (the experts' FFN dim split over tp,
    docs/expert-parallel.md), pp and ZeRO stage. The one place to change when the runtime
    accepts less or more."""
    return ep >= 1 and tp >= 1 and pp >= 1 and zero in (0, 1, 2, 3)


def divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


def candidates(w: Workload, cluster: Cluster, global_batch: int, zero_stages=(0, 1, 2, 3),
               max_micro_batch: int = 16, virtual=(1, 2, 4), accumulate: bool = False,
               zero_bubble: bool = True, **fields):
    """Every layout the search considers (see the module docstring). Micro-batching: at
    pp = 1 one microbatch per step unless ``accumulate`` (parallelizer's runtime runs no
    gradient accumulation at pp = 1; Megatron-LM does); at pp > 1 M >= pp, and M a
    multiple of pp when interleaved (Narayanan et al. 2021, §2.2.2); micro-batch sizes up to
    ``max_micro_batch`` where there is a choice. Schedules: 1F1B,
    interleaved 1F1B with v > 1 and, with ``zero_bubble``, ZB-V at v = 2 (Qi et al. 2024).
    ``fields``: Candidate fields every layout takes (e.g. ``sequence_parallel=False``)."""
    for lay in _candidates(w, cluster, global_batch, zero_stages, max_micro_batch, virtual, accumulate):
        lay = replace(lay, **fields) if fields else lay
        yield lay
        if zero_bubble and lay.pp > 1 and lay.virtual_stages == 2:
            yield replace(lay, schedule_name="zbv")


def _candidates(w, cluster, global_batch, zero_stages, max_micro_batch, virtual, accumulate):
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
            eps = w.ep_choices(dp)
            # pp = 1 without accumulation: the step is one microbatch of every sequence a dp
            # rank gets, whatever its size (memory decides); otherwise sizes up to the cap
            micros = [per_dp] if pp == 1 and not accumulate else divisors(per_dp)
            for micro in micros:
                m = per_dp // micro
                if (micro > max_micro_batch and len(micros) > 1) or (pp > 1 and m < pp):
                    continue
                for v in virtual if pp > 1 else (1,):
                    if v > 1 and (m % pp or pp * v > w.layers):
                        continue
                    for z in zero_stages:
                        reps = [1]
                        if z >= 2 and tp < gpn and dp * tp > gpn and dp % (gpn // tp) == 0:
                            reps.append(dp // (gpn // tp))    # shard inside a node, replicate across
                        for ep in eps:
                            if not runtime_accepts(tp, ep, pp, z):
                                continue
                            for rep in reps:
                                for rc in (False, True):
                                    yield Candidate(tp, pp, dp, micro, m, z, v, rc, rep, ep=ep)


FIX_KEYS = {"tp": "tp", "pp": "pp", "dp": "dp", "zero": "zero_stage", "mb": "micro_batch",
            "m": "microbatches", "v": "virtual_stages", "ac": "recompute", "rep": "dp_replicate",
            "ep": "ep"}


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
    smallest_mem = None
    for lay in candidates(w, cluster, global_batch, **options):
        if fix and any(getattr(lay, k) != v for k, v in fix.items()):
            continue
        key = (lay.pp, lay.virtual_stages, lay.schedule)
        if key not in stats_cache:
            stats_cache[key] = rank_stats(w, lay.pp, lay.virtual_stages, lay.schedule)
        considered += 1
        mem = memory_of(w, cluster, lay, stats_cache[key])[0]
        if mem <= mem_cap:
            fitting.append(predict(w, cluster, lay, stats_cache[key], global_batch, screen=True))
        elif smallest_mem is None or mem < smallest_mem[0]:
            smallest_mem = (mem, lay, stats_cache[key])
    if smallest_mem is not None and not fitting:
        smallest = predict(w, cluster, smallest_mem[1], smallest_mem[2], global_batch)
    if not considered:
        near = nearest_batches(w, cluster, global_batch, fix, **options)
        hint = (f"; the nearest global batches that do: {' or '.join(map(str, near))}" if near
                else "; loosen --fix" if fix else "")
        what = f"no layout has {_fix_text(fix)}" if fix else "no layout splits"
        raise UserError(f"{what} for --global-batch {global_batch} on {cluster.world} GPUs "
                        f"(degrees multiply to the GPUs; dp x microbatches x micro-batch size is "
                        f"the batch; tp divides the {w.heads} heads; pp <= {w.layers} blocks; ep "
                        f"divides dp and {_experts_text(w)}){hint}")
    if not fitting:
        s = smallest
        raise UserError(f"no layout fits {cluster.usable_memory_bytes / 1e9:.4g} GB per GPU (usable_memory "
                        f"{cluster.usable_memory:g} of {cluster.memory_bytes / 1e9:.4g} GB): the smallest, "
                        f"{s.candidate.short()}, needs {s.memory_bytes / 1e9:.4g} GB on its fullest rank; "
                        f"add GPUs (nodes), use a GPU with more memory, or a smaller model")
    fitting.sort(key=lambda p: p.step_s)
    fitting = _retime(w, cluster, fitting, stats_cache, global_batch)
    return SearchResult(_break_ties(fitting), considered, len(fitting), smallest)


SCREEN_KEEP = 48        # layouts re-timed on their own stage costs after the screen
SCREEN_MARGIN = 0.15    # ... and every one within this fraction of the screen's best


def _retime(w, cluster, screened: list, stats_cache: dict, global_batch) -> list:
    """The screen's leaders predicted again with each stage's own costs (the screen times a
    pipeline as if every stage were the busiest, which can only overestimate it), ranked."""
    if not screened:
        return screened
    cut = screened[0].step_s * (1 + SCREEN_MARGIN)
    n = max(SCREEN_KEEP, sum(1 for p in screened if p.step_s <= cut))
    lead = [p if p.candidate.pp == 1 else
            predict(w, cluster, p.candidate, stats_cache[(p.candidate.pp, p.candidate.virtual_stages,
                                                          p.candidate.schedule)], global_batch)
            for p in screened[:n]]
    lead.sort(key=lambda p: p.step_s)
    return lead + screened[n:]


def _break_ties(ranked: list) -> list:
    """Layouts with the same step time (communication fully hidden in both) ordered by what
    each GPU sends, then by memory."""
    out, i = [], 0
    while i < len(ranked):
        j = i + 1
        while j < len(ranked) and ranked[j].step_s <= ranked[i].step_s * (1 + 1e-12):
            j += 1
        group = ranked[i:j]
        if len(group) > 1:
            group.sort(key=lambda p: (sum(p.volumes.values()), p.memory_bytes))
        out += group
        i = j
    return out


def _experts_text(w: Workload) -> str:
    counts = sorted({layer.experts for layer in w.moe})
    return (f"the experts ({', '.join(map(str, counts))}), at tp 1" if counts
            else "the model has no mixture-of-experts layer: ep 1")


def _fix_text(fix: dict) -> str:
    back = {v: k for k, v in FIX_KEYS.items()}
    return ",".join(f"{back.get(k, k)}={int(v)}" for k, v in fix.items())


def nearest_batches(w: Workload, cluster: Cluster, global_batch: int, fix: dict | None,
                    span: int = 4096, **options) -> list[int]:
    """The closest global batch below and above ``global_batch`` that some layout (with the
    ``fix`` values) splits exactly: dp x microbatches x micro-batch size."""
    def splits(batch: int) -> bool:
        return batch > 0 and any(not fix or all(getattr(lay, k) == v for k, v in fix.items())
                                 for lay in candidates(w, cluster, batch, **options))
    below = next((b for b in range(global_batch - 1, max(0, global_batch - span), -1) if splits(b)), None)
    above = next((b for b in range(global_batch + 1, global_batch + span) if splits(b)), None)
    return [b for b in (below, above) if b is not None]


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
