"""Pipeline stage balance on Llama-3-8B and Llama-3-70B configs (meta device, no weights).

For pp in {2, 4, 8, 16}, the imbalance (max / mean stage cost) of three splits, all measured
with parallelizer's cost model (forward + backward FLOPs by torch.utils.flop_counter, one
step of a batch of 1 x SEQ tokens) in the same run:

- ours: ``planning.pipeline.plan_from_costs`` (contiguous min-max over block boundaries,
  and over the cuts inside blocks that add no communication when whole blocks lose more
  than 1 %; "cut" counts the blocks split across two stages);
- whole blocks: the best split at block boundaries only (the same planner without the
  parts of blocks), what ours was before cuts inside blocks;
- torchtitan: an even split by layer count with the embedding and the head each counted as
  one layer (``generate_llm_fqn_per_model_part``, input_weight = output_weight = 1);
- DeepSpeed: ``PipelineModule(partition_method="parameters")``, a min-max split of the
  layer list [embedding, blocks..., head] weighted by parameter count
  (``ds_utils.partition_balanced``); a stage may hold the embedding or the head alone.

"limit" is the best any contiguous split at block granularity can do (the min-max split of
[embedding, blocks..., head] by FLOPs, with no constraint on what a stage holds): where it
is above 1.05, the target is out of reach without cutting inside blocks. Run: ``python -m benchmarks.pipeline_balance [--seq N] [--json PATH]``.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

PPS = (2, 4, 8, 16)
CONFIGS = {  # https://huggingface.co/meta-llama/Meta-Llama-3-8B (and -70B) config.json
    "Llama-3-8B": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, intermediate_size=14336, vocab_size=128256),
    "Llama-3-70B": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, intermediate_size=28672, vocab_size=128256),
}


def unit_costs(name: str, seq: int):
    """Capture the config on the meta device; return (PipelineCosts, blocks, params per unit)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from parallelizer.frontend.capture import capture
    from parallelizer.passes.cleanup import apply_cleanup
    from parallelizer.analysis.graph_costs import collect_costs
    from parallelizer.planning.pipeline import find_blocks

    cfg = LlamaConfig(**CONFIGS[name], max_position_embeddings=8192, rope_theta=500000.0,
                      tie_word_embeddings=False, use_cache=False, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    ids = torch.zeros(2, seq, dtype=torch.long, device="meta")
    gm = capture(model, {"input_ids": ids}, Path(f"<{name}>")).gm
    apply_cleanup(gm)
    blocks = find_blocks(model)
    costs = collect_costs(gm, blocks, {})
    numel = {n: p.numel() for n, p in model.named_parameters()}
    params = [sum(numel[f] for f in u.params) for u in costs.units]
    return costs, blocks, params


def imbalance(stage_costs) -> float:
    return max(stage_costs) / (sum(stage_costs) / len(stage_costs))


def group(flops: list, sizes: list) -> list:
    """Stage costs of consecutive runs of ``sizes`` units."""
    out, i = [], 0
    for k in sizes:
        out.append(sum(flops[i:i + k]))
        i += k
    return out


def torchtitan_sizes(n_layers: int, pp: int) -> list:
    """Units per stage of torchtitan's generate_llm_fqn_per_model_part(pp, n_layers, 1, 1):
    n_layers + 2 weight units spread evenly, the first ``extra`` stages one more; the
    embedding fills one unit of stage 0 and the head (norm + output) one of the last."""
    total = n_layers + 2
    base, extra = divmod(total, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


def min_max_sizes(weights: list, pp: int) -> list:
    """DeepSpeed's partition_balanced: contiguous parts minimising the largest weight sum."""
    from parallelizer.planning.pipeline import min_max_ranges

    return [len(r) for r in min_max_ranges(weights, pp)]


def ours(costs, blocks, pp: int):
    from parallelizer.planning.pipeline import plan_from_costs

    return plan_from_costs(costs, pp, blocks)


def whole_blocks(costs, blocks, pp: int) -> list:
    from parallelizer.planning.pipeline import plan_pipeline

    flops = [u.flops for u in costs.units]
    return list(plan_pipeline(flops[1:-1], flops[0], flops[-1], pp, blocks).stage_costs)


def run(seq: int) -> list:
    rows = []
    for name in CONFIGS:
        t0 = time.perf_counter()
        costs, blocks, params = unit_costs(name, seq)
        flops = [u.flops for u in costs.units]
        n = len(blocks)
        for pp in PPS:
            decision = ours(costs, blocks, pp)
            mine = imbalance(decision.stage_costs)
            cut = sum(len(decision.stages_of_block(i)) > 1 for i in range(n))
            whole = imbalance(whole_blocks(costs, blocks, pp))
            titan = imbalance(group(flops, torchtitan_sizes(n, pp)))
            deepspeed = imbalance(group(flops, min_max_sizes(params, pp)))
            limit = imbalance(group(flops, min_max_sizes(flops, pp)))
            rows.append({"model": name, "pp": pp, "ours": mine, "blocks_cut": cut,
                         "whole_blocks": whole, "torchtitan_even_layers": titan,
                         "deepspeed_parameters": deepspeed, "limit": limit,
                         "ours_vs_best_baseline": mine / min(titan, deepspeed)})
        print(f"# {name}: {n} blocks, head = {costs.units[-1].flops / costs.units[1].flops:.2f} "
              f"blocks of FLOPs, embedding = {costs.units[0].flops / costs.units[1].flops:.2f}, "
              f"captured and costed in {time.perf_counter() - t0:.1f} s")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096, help="sequence length of the costed batch")
    ap.add_argument("--json", type=Path, default=Path("benchmarks/results/pipeline_balance.json"))
    args = ap.parse_args()
    rows = run(args.seq)
    head = (f"{'model':<12} {'pp':>3} {'ours':>7} {'cut':>4} {'whole blocks':>13} {'torchtitan':>11} "
            f"{'deepspeed':>10} {'limit':>7} {'ours/best':>10}")
    print(f"imbalance = max / mean stage FLOPs (fwd + bwd, batch 2 x {args.seq}); lower is better")
    print(head)
    for r in rows:
        print(f"{r['model']:<12} {r['pp']:>3} {r['ours']:>7.3f} {r['blocks_cut']:>4} "
              f"{r['whole_blocks']:>13.3f} {r['torchtitan_even_layers']:>11.3f} "
              f"{r['deepspeed_parameters']:>10.3f} {r['limit']:>7.3f} {r['ours_vs_best_baseline']:>10.3f}")
    worse = [r for r in rows if r["ours"] > min(r["torchtitan_even_layers"], r["deepspeed_parameters"]) + 1e-12]
    print(f"ours never worse than either baseline: {not worse}")
    args.json.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.json.with_name(f".{args.json.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps({"seq": args.seq, "rows": rows}, indent=1) + "\n")
    os.replace(tmp, args.json)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
