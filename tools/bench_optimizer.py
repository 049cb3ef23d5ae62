"""Optimizer step time of Muon (and Muon + error feedback) relative to AdamW on the default model.

Runs on 1 process and on FSDP=2 (2 gloo processes, one thread each) in the same invocation;
repetitions of the optimizers are interleaved (order rotated each repetition) and medians reported.

    .venv/bin/python tools/bench_optimizer.py [--reps 8] [--steps 3]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from titan_async import platform

platform.configure()

from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from titan_async.model import ModelSection, build_model_spec  # noqa: E402
from titan_async.optimizer import ErrorFeedbackSection, OptimizerSection  # noqa: E402

VOCAB = 2048
OPTIMIZERS = {
    "AdamW": OptimizerSection(),
    "Muon": OptimizerSection(name="muon"),
    "Muon+EF": OptimizerSection(name="muon", error_feedback=ErrorFeedbackSection(enabled=True)),
}


def default_model() -> nn.Module:
    """The default run's model (debugmodel llama3 with the built-in tokenizer's vocabulary)."""
    torch.manual_seed(0)
    model = build_model_spec(ModelSection(), VOCAB).model.build()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    return model


def set_random_gradients(model: nn.Module) -> None:
    for param in model.parameters():
        if isinstance(param, DTensor):
            local = torch.randn_like(param.to_local())
            param.grad = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
        else:
            param.grad = torch.randn_like(param)


def shard(model: nn.Module) -> nn.Module:
    """FSDP2 as torchtitan applies it: each block, then the root."""
    for block in model.layers.values():
        fully_shard(block)
    fully_shard(model)
    return model


def time_steps(optimizers, steps: int) -> float:
    """Seconds per step, the slowest rank's when distributed."""
    if dist.is_initialized():
        dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        optimizers.step()
    elapsed = torch.tensor((time.perf_counter() - start) / steps)
    if dist.is_initialized():
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def measure(distributed: bool, reps: int, steps: int) -> dict[str, float]:
    """Median seconds per optimizer step for each entry of OPTIMIZERS."""
    base = default_model()
    built = {}
    for name, section in OPTIMIZERS.items():
        model = copy.deepcopy(base)
        if distributed:
            shard(model)
        set_random_gradients(model)
        built[name] = section.container_config().build(model_parts=[model])
        time_steps(built[name], 2)
    samples: dict[str, list[float]] = {name: [] for name in built}
    names = list(built)
    for rep in range(reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            samples[name].append(time_steps(built[name], steps))
    return {name: statistics.median(values) for name, values in samples.items()}


def _fsdp_worker(rank: int, init_file: str, reps: int, steps: int, results: dict) -> None:
    platform.configure()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        medians = measure(distributed=True, reps=reps, steps=steps)
        if rank == 0:
            results.update(medians)
    finally:
        dist.destroy_process_group()


def measure_fsdp2(reps: int, steps: int) -> dict[str, float]:
    with mp.Manager() as manager, tempfile.TemporaryDirectory() as folder:
        results = manager.dict()
        mp.spawn(_fsdp_worker, args=(os.path.join(folder, "init"), reps, steps, results), nprocs=2)
        return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=8, help="interleaved repetitions per optimizer")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per repetition")
    args = parser.parse_args()

    load_before = os.getloadavg()[0]
    rows = {
        f"1 process, {torch.get_num_threads()} threads": measure(distributed=False, reps=args.reps, steps=args.steps),
        "FSDP=2, 2 processes x 1 thread": measure_fsdp2(args.reps, args.steps),
    }
    load_after = os.getloadavg()[0]

    names = list(OPTIMIZERS)
    header = f"{'setting':<32}" + "".join(f"{name + ' ms':>12}" for name in names)
    header += "".join(f"{name + '/AdamW':>15}" for name in names[1:])
    print(f"debugmodel llama3 (vocab {VOCAB}), median of {args.reps} interleaved reps x {args.steps} steps")
    print(header)
    for setting, medians in rows.items():
        line = f"{setting:<32}" + "".join(f"{medians[name] * 1e3:>12.1f}" for name in names)
        line += "".join(f"{medians[name] / medians['AdamW']:>15.2f}" for name in names[1:])
        print(line)
    print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after")


if __name__ == "__main__":
    main()
