"""Muon's cost: optimizer step times against AdamW, Muon's projected share of a 10B step, and
batched against one-at-a-time Newton-Schulz.

Default mode: the optimizer step of AdamW, Muon and Muon + error feedback on the default model,
on 1 process and on FSDP=2 (2 gloo processes, one thread each) in the same invocation;
repetitions of the optimizers are interleaved (order rotated each repetition) and medians
reported. Then, per pipeline stage of --config (default the 10B 2BW config on 8 x 8 GPUs),
Muon's projected step time on the busiest rank of the stage's FSDP group (Newton-Schulz FLOPs
of the matrices it owns, owners balanced by FLOPs as `map_full_matrices` assigns them, plus its
all-to-all bytes) and its share of the stage's step (training FLOPs of the stage per rank).
The throughputs and the link bandwidth are assumptions, printed with the result.

--newton-schulz: the Muon blocks of --layers transformer blocks of --config (default
1b_2bw_muon; Q, K, V split from the fused weight) in float32 on this machine, orthogonalised
one matrix at a time (`orthogonalize`, the per-matrix form Muon used before batching: the
baseline) and by `orthogonalize_all` three ways (see NEWTON_SCHULZ_METHODS): as Muon runs it,
in the standard form only, and with batched GEMMs. Timed on Gaussian matrices, interleaved
(order rotated each repetition), min / median / max over --reps after one warm-up each, and
the speed-ups against the baseline: ratios of the medians and of the minimums, and the median
of the ratios within each repetition (the least affected by other load). Then the largest
relative difference of each method's results from the baseline's, on those matrices and on
matrices with a 1/k^2 spectrum.

    .venv/bin/python tools/bench_optimizer.py [--reps 8] [--steps 3]
    .venv/bin/python tools/bench_optimizer.py --newton-schulz [--reps 5] [--layers 1]
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from titan_async.core import platform

platform.configure()

from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402
from torchtitan.config import TORCH_DTYPE_MAP  # noqa: E402

from titan_async.cluster.estimate import Cluster, make_layout  # noqa: E402
from titan_async.config.assemble import resolve_vocab_size  # noqa: E402
from titan_async.config.run_config import load_run_config  # noqa: E402
from titan_async.experiments.accuracy import relative_difference  # noqa: E402
from titan_async.experiments.jobs import repository_path  # noqa: E402
from titan_async.model.llama import ModelSection, build_model_spec  # noqa: E402
from titan_async.model.meta import build_meta_model  # noqa: E402
from titan_async.optim.muon_cost import stage_costs  # noqa: E402
from titan_async.optim.newton_schulz import flops, orthogonalize  # noqa: E402
from titan_async.optim.newton_schulz_batched import orthogonalize_all  # noqa: E402
from titan_async.optim.routing import route_parameters  # noqa: E402
from titan_async.optim.section import ErrorFeedbackSection, OptimizerSection  # noqa: E402
from titan_async.pipeline.schedules import register as register_schedules  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"

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


def optimizer_steps(args: argparse.Namespace) -> None:
    """The AdamW / Muon / Muon+EF step-time table on the default model."""
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


def projection(args: argparse.Namespace) -> None:
    """Muon's projected step time per pipeline stage of --config and its share of the stage's step."""
    run = load_run_config(args.config)
    vocab = resolve_vocab_size(run)
    model = build_meta_model(run, vocab, fsdp=True)
    register_schedules()
    layout = make_layout(run, Cluster.parse(args.nodes, args.gpus_per_node, "80GiB"), model.spec.model)
    t = run.training
    routes = route_parameters(model.module)
    costs = {
        name: stage_costs(
            routes, layout.stage_modules, fsdp=layout.fsdp, ns_steps=run.optimizer.muon.ns_steps, ns_dtype=dtype,
            state_bytes=TORCH_DTYPE_MAP[t.dtype].itemsize, tokens=t.local_batch_size * t.seq_len, seq_len=t.seq_len,
            dim=int(run.model.resolved(vocab)["dim"]),
        )
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32))
    }
    tflops = {"bf16": args.ns_tflops, "fp32": args.ns_tflops_float32}
    print(f"\nMuon step projected for {repository_path(args.config)} on {args.nodes} x {args.gpus_per_node} GPUs "
          f"(PP {layout.pp}, FSDP {layout.fsdp}), busiest FSDP rank of each stage")
    print(f"assumed: Newton-Schulz at {args.ns_tflops:g} TFLOP/s in bfloat16 (ns_dtype auto on CUDA) and "
          f"{args.ns_tflops_float32:g} in float32 (Gram form where it has fewer FLOPs), training at "
          f"{args.train_tflops:g} TFLOP/s, all-to-all at {args.link_gbs:g} GB/s per rank; no pipeline bubble "
          "(the share is an upper bound for 1F1B)")
    print(f"{'stage':>5} {'layers':>6} {'matrices':>8} {'a2a MB':>7} {'step ms':>8} "
          f"{'NS TFLOP bf16':>13} {'Muon ms':>8} {'share':>6} {'NS TFLOP fp32':>13} {'Muon ms':>8} {'share':>6}")
    shares: dict[str, list[float]] = {"bf16": [], "fp32": []}
    for bf16, fp32 in zip(costs["bf16"], costs["fp32"]):
        step_ms = bf16.training_flops / args.train_tflops / 1e9
        line = f"{bf16.stage:>5} {bf16.layers:>6} {bf16.matrices:>8} {bf16.received_bytes / 1e6:>7.0f} {step_ms:>8.0f}"
        for name, cost in (("bf16", bf16), ("fp32", fp32)):
            muon_ms = cost.newton_schulz_flops / tflops[name] / 1e9 + cost.received_bytes / args.link_gbs / 1e6
            shares[name].append(muon_ms / (muon_ms + step_ms))
            line += f" {cost.newton_schulz_flops / 1e12:>13.1f} {muon_ms:>8.1f} {shares[name][-1]:>6.1%}"
        print(line)
    print(f"share of a step (largest stage): {max(shares['bf16']):.1%} with bfloat16 Newton-Schulz, "
          f"{max(shares['fp32']):.1%} with float32")


def power_law(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """A random matrix of `shape` with singular values 1/k^2 (ill-conditioned, like a momentum)."""
    rows, cols = shape
    m = min(shape)
    left, _ = torch.linalg.qr(torch.randn(rows, m, generator=generator))
    right, _ = torch.linalg.qr(torch.randn(cols, m, generator=generator))
    return (left / torch.arange(1, m + 1) ** 2) @ right.T


NEWTON_SCHULZ_METHODS = {
    "one at a time": None,
    "batched (Muon)": {},
    "batched, standard form": {"gram": False},
    "batched, std, bmm": {"gram": False, "batched_gemm": True},
}
"""None: `orthogonalize` per matrix, the baseline. Otherwise `orthogonalize_all` options: as Muon
runs it (Gram form where cheaper, GEMM per matrix on CPU), the standard form only (what batching
alone gives), and the standard form with batched GEMMs (the CUDA path)."""


def newton_schulz(args: argparse.Namespace) -> None:
    """Batched against one-at-a-time Newton-Schulz in float32 on the Muon blocks of --layers blocks of --config."""
    run = load_run_config(args.config)
    routes = route_parameters(build_meta_model(run, resolve_vocab_size(run), fsdp=True).module)
    steps = run.optimizer.muon.ns_steps
    shapes = [
        shape
        for route in routes
        if route.optimizer == "muon" and route.name.startswith("layers.0.")
        for shape in route.blocks.shapes(tuple(route.param.shape))
    ] * args.layers
    generator = torch.Generator().manual_seed(0)
    inputs = {
        "Gaussian": [torch.randn(shape, generator=generator) for shape in shapes],
        "1/k^2 spectrum": [power_law(shape, generator) for shape in shapes],
    }

    def run_method(name: str, matrices: list[torch.Tensor]) -> list[torch.Tensor]:
        options = NEWTON_SCHULZ_METHODS[name]
        if options is None:
            return [orthogonalize(m, steps, torch.float32) for m in matrices]
        return orthogonalize_all(matrices, steps, torch.float32, **options)

    load_before = os.getloadavg()[0]
    names = list(NEWTON_SCHULZ_METHODS)
    results = {kind: {name: run_method(name, matrices) for name in names} for kind, matrices in inputs.items()}
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.reps):
        for name in names[rep % len(names) :] + names[: rep % len(names)]:
            start = time.perf_counter()
            run_method(name, inputs["Gaussian"])
            times[name].append(time.perf_counter() - start)
    load_after = os.getloadavg()[0]

    listing = ", ".join(f"{count} x {shape}" for shape, count in Counter(shapes).items())
    print(f"Newton-Schulz on the Muon blocks of {args.layers} transformer block(s) of {repository_path(args.config)}: {listing}")
    print(f"{steps} steps, float32, {torch.get_num_threads()} threads; timed on Gaussian inputs, "
          f"{args.reps} reps, order rotated each rep, after 1 warm-up each")
    print(f"{'method':<24} {'min s':>7} {'median s':>9} {'max s':>7} {'speed-up: medians':>18} {'minimums':>9} "
          f"{'per rep':>8}" + "".join(f"{'max rel diff, ' + kind:>30}" for kind in inputs))
    baseline = times[names[0]]
    for name in names:
        values = times[name]
        per_rep = statistics.median(b / v for b, v in zip(baseline, values))
        line = (f"{name:<24} {min(values):>7.3f} {statistics.median(values):>9.3f} {max(values):>7.3f} "
                f"{statistics.median(baseline) / statistics.median(values):>17.3f}x {min(baseline) / min(values):>8.3f}x "
                f"{per_rep:>7.3f}x")
        for kind in inputs:
            reference = results[kind][names[0]]
            line += f"{max(relative_difference(r, o) for r, o in zip(results[kind][name], reference)):>30.1e}"
        print(line)
    print("speed-up: one at a time / method, from the medians, the minimums, and the median of each repetition's "
          "ratio; max rel diff: largest Frobenius relative difference of a matrix's result against one at a time")
    work = sum(flops(shape, steps, torch.bfloat16) for shape in shapes)
    rate = work / statistics.median(baseline) / 1e9
    print(f"one at a time: {work / 1e12:.2f} TFLOP per call, {rate:.0f} GFLOP/s at the median")
    print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--newton-schulz", action="store_true", help="batched against one-at-a-time Newton-Schulz only")
    parser.add_argument("--config", type=Path, help="default: 10b_2bw_muon.toml (projection), 1b_2bw_muon.toml (--newton-schulz)")
    parser.add_argument("--reps", type=int, help="interleaved repetitions (default 8, or 5 with --newton-schulz)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per repetition")
    parser.add_argument("--layers", type=int, default=1, help="--newton-schulz: transformer blocks whose matrices are timed")
    parser.add_argument("--nodes", type=int, default=8, help="projection: nodes")
    parser.add_argument("--gpus-per-node", type=int, default=8, help="projection: GPUs per node")
    parser.add_argument("--ns-tflops", type=float, default=600,
                        help="projection: bfloat16 Newton-Schulz TFLOP/s (H200, docs/results/gpu)")
    parser.add_argument("--ns-tflops-float32", type=float, default=47, help="projection: float32 Newton-Schulz TFLOP/s (H200)")
    parser.add_argument("--train-tflops", type=float, default=464, help="projection: training TFLOP/s per GPU (1B bf16 on H200)")
    parser.add_argument("--link-gbs", type=float, default=300, help="projection: all-to-all GB/s per rank")
    args = parser.parse_args(argv)
    if args.newton_schulz:
        args.config = args.config or CONFIGS / "1b_2bw_muon.toml"
        args.reps = args.reps or 5
        with torch.no_grad():
            newton_schulz(args)
        return
    args.config = args.config or CONFIGS / "10b_2bw_muon.toml"
    args.reps = args.reps or 8
    optimizer_steps(args)
    projection(args)


if __name__ == "__main__":
    main()
