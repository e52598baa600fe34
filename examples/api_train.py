"""Train the Llama example with your own loop through the Python API.

    torchrun --nproc-per-node 4 examples/api_train.py mesh.tp=2 mesh.pp=2 mesh.dp=1
    torchrun --nproc-per-node 4 examples/api_train.py mesh.dp=2 mesh.tp=2 mesh.pp=1

Arguments are spec overrides. Prints `step i loss x lr y norm z` on rank 0: the global
gradient norm before clipping to MAX_NORM, `pm.clip_grad_norm_` (every mesh dim, each
parameter counted once) against `torch.nn.utils.clip_grad_norm_` of the single model. With `--single` it
trains the unmodified model on one process instead (the reference the tests compare with).
`--save DIR` then writes a checkpoint from every rank (`pm.save_checkpoint`) and checks it
against the explicit gather `pm.full_state_dict()` on rank 0.
"""
import importlib.util
import sys
from pathlib import Path

import torch

import parallelizer as pz

HERE = Path(__file__).resolve().parent
STEPS = 3
MAX_NORM = 0.5  # below the norms of these steps: clipping changes every update


def load_example():
    spec = importlib.util.spec_from_file_location("llama_example", HERE / "llama" / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def batches(example: dict, seed: int):
    """Seeded random token batches shaped like the example inputs."""
    for step in range(STEPS):
        g = torch.Generator().manual_seed(seed + step)
        yield {"input_ids": torch.randint(0, 128, example["input_ids"].shape, generator=g)}


def optimizer_and_scheduler(params):
    opt = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    return opt, sched


def main(argv: list[str]) -> None:
    single = "--single" in argv
    save = Path(argv[argv.index("--save") + 1]) if "--save" in argv else None
    overrides = [a for a in argv if a != "--single" and a != "--save" and Path(a) != save]
    spec = pz.load_spec(HERE / "llama" / "spec.yaml", overrides=overrides)
    example = load_example()
    model = example.build_model()
    if single:
        opt, sched = optimizer_and_scheduler(model.parameters())
        for step, batch in enumerate(batches(example.example_inputs(), spec.seed)):
            loss = example.loss_fn(model(**batch), batch)
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            lr = sched.get_last_lr()[0]
            opt.step(); sched.step(); opt.zero_grad()
            print(f"step {step + 1} loss {loss.item():.6f} lr {lr:.6f} norm {norm.item():.9f}", flush=True)
        return
    pm = pz.parallelize(model, spec, example_inputs=example.example_inputs(), loss_fn=example.loss_fn)
    if torch.distributed.get_rank() == 0:
        print(pm, flush=True)
    opt, sched = optimizer_and_scheduler(pm.parameters())
    for step, batch in enumerate(batches(example.example_inputs(), spec.seed)):
        loss = pm.step(pm.shard_batch(batch))
        norm = pm.clip_grad_norm_(MAX_NORM)  # over every rank, not this rank's shards
        lr = sched.get_last_lr()[0]
        opt.step(); sched.step(); opt.zero_grad()
        if torch.distributed.get_rank() == 0:
            print(f"step {step + 1} loss {loss.item():.6f} lr {lr:.6f} norm {norm.item():.9f}", flush=True)
    if save is not None:
        pm.save_checkpoint(save)  # every rank writes its own shards
        full = pm.full_state_dict()  # an explicit gather to rank 0, for comparison
        if full is not None:
            from parallelizer.checkpoint import load_full
            saved = load_full(save)
            same = all(torch.equal(t, full[k]) for k, t in saved.items())
            print(f"saved checkpoint equals full_state_dict: {same and len(saved) > 0}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
