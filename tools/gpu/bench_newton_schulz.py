"""Muon's Newton-Schulz time for the matrix shapes of a config, on one CUDA GPU.

    python tools/gpu/bench_newton_schulz.py --config train_configs/10b_2bw_muon.toml --out ns.json

The shapes are those Muon orthogonalises for the config's model (routed and split into blocks
as the optimizer does it; the fused QKV matrix gives Q, K and V). Each distinct block shape is
timed through `titan_async.optim.newton_schulz.orthogonalize` in bfloat16, float32 (torch's
default: no TF32) and float32 with TF32 matrix multiplies, with CUDA events: min / median / max
over --reps calls after --warmup calls, rotating over three random float32 inputs (as the
momentum is stored). The batched time is `newton_schulz_batched.orthogonalize_batched` (as Muon
runs it) over the same-shape blocks of one pipeline stage; its result is compared with the
per-matrix function's. Totals per optimizer step: the whole model,
one stage of --stage-layers layers on one GPU, and the busiest of --fsdp ranks of that stage
(each full matrix is orthogonalised on one owner rank, as `map_full_matrices` assigns them).
Runs on CPU too (host timer), for trying the script with --small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titan_async.core import platform  # noqa: E402

platform.configure()
from titan_async.config.run_config import load_run_config  # noqa: E402
from titan_async.experiments.accuracy import relative_difference  # noqa: E402
from titan_async.model.llama import build_model_spec  # noqa: E402
from titan_async.optim.full_matrix import assign_owners  # noqa: E402
from titan_async.optim.newton_schulz import orthogonalize  # noqa: E402
from titan_async.optim.newton_schulz_batched import orthogonalize_batched  # noqa: E402
from titan_async.optim.routing import route_parameters  # noqa: E402

PRECISIONS = {"bfloat16": (torch.bfloat16, False), "float32": (torch.float32, False), "tf32": (torch.float32, True)}
"""name -> (iteration dtype, TF32 matrix multiplies allowed)."""


@dataclasses.dataclass(frozen=True)
class MuonMatrix:
    """One parameter of a transformer block that Muon updates, and its blocks' shapes."""

    name: str
    shape: tuple[int, int]
    blocks: tuple[tuple[int, int], ...]


def layer_matrices(config: Path, small: bool) -> tuple[list[MuonMatrix], int, int]:
    """The Muon matrices of one transformer block of `config`'s model, its layer count and ns_steps."""
    run = load_run_config(config)
    section = dataclasses.replace(run.model, float8="none")
    if small:
        section = dataclasses.replace(section, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=512)
    spec = build_model_spec(section, tokenizer_vocab_size=2048)
    with torch.device("meta"):
        model = spec.model.build()
    matrices = [
        MuonMatrix(route.name.removeprefix("layers.0."), tuple(route.param.shape), tuple(route.blocks.shapes(tuple(route.param.shape))))
        for route in route_parameters(model)
        if route.optimizer == "muon" and route.name.startswith("layers.0.")
    ]
    return matrices, len(model.layers), run.optimizer.muon.ns_steps


def oriented(shape: tuple[int, int]) -> tuple[int, int]:
    """The shape the iteration works on: tall matrices are transposed."""
    return (min(shape), max(shape))


def flops(shape: tuple[int, int], steps: int) -> float:
    """Multiply-add FLOPs of `steps` iterations: X X^T, B = bA + cA^2, aX + B X."""
    m, n = oriented(shape)
    return steps * (4 * m * m * n + 2 * m**3)


@contextmanager
def tf32(allowed: bool):
    before = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = allowed
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


def time_ms(fn, inputs: list[torch.Tensor], warmup: int, reps: int) -> list[float]:
    """Milliseconds of each of `reps` calls of fn(input), rotating over `inputs`, after `warmup` calls."""
    for i in range(warmup):
        fn(inputs[i % len(inputs)])
    times = []
    for i in range(reps):
        if torch.cuda.is_available():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn(inputs[i % len(inputs)])
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            begin = time.perf_counter()
            fn(inputs[i % len(inputs)])
            times.append(1e3 * (time.perf_counter() - begin))
    return times


def summary(times: list[float], work: float) -> dict[str, float]:
    median = statistics.median(times)
    return {"min_ms": min(times), "median_ms": median, "max_ms": max(times), "reps": len(times), "tflops": work / median / 1e9}


def measure(args, device: torch.device) -> dict:
    matrices, n_layers, steps = layer_matrices(args.config, args.small)
    per_layer = Counter(block for m in matrices for block in m.blocks)
    generator = torch.Generator(device=device).manual_seed(0)
    single: dict[tuple[str, tuple[int, int]], dict] = {}
    for shape in per_layer:
        inputs = [torch.randn(shape, device=device, generator=generator) for _ in range(3)]
        for name, (dtype, allow_tf32) in PRECISIONS.items():
            reps = args.reps if dtype == torch.bfloat16 or allow_tf32 else args.float32_reps
            with tf32(allow_tf32):
                times = time_ms(lambda m: orthogonalize(m, steps, dtype), inputs, args.warmup, reps)
            single[name, shape] = summary(times, flops(shape, steps))
            print(f"{name:9s} {str(shape):14s} median {single[name, shape]['median_ms']:9.3f} ms", flush=True)
        del inputs
    stage_blocks = Counter({oriented(shape): 0 for shape in per_layer})
    for shape, count in per_layer.items():
        stage_blocks[oriented(shape)] += count * args.stage_layers
    batched = {}
    for shape, count in stage_blocks.items():
        wide = [torch.randn((count, *shape), device=device, generator=generator) for _ in range(2)]
        for name in ("bfloat16", "float32"):
            dtype, allow_tf32 = PRECISIONS[name]
            with tf32(allow_tf32):
                times = time_ms(lambda s: orthogonalize_batched(s, steps, dtype), wide, 1, args.batched_reps)
                agreement = relative_difference(orthogonalize_batched(wide[0], steps, dtype)[0], orthogonalize(wide[0][0], steps, dtype))
            batched[name, shape] = {**summary(times, count * flops(shape, steps)), "count": count, "relative_difference_to_orthogonalize": agreement}
            print(f"{name:9s} batched {count} x {shape}: median {batched[name, shape]['median_ms']:9.3f} ms", flush=True)
        del wide
    return totals(args, matrices, n_layers, steps, per_layer, single, batched)


def totals(args, matrices, n_layers, steps, per_layer, single, batched) -> dict:
    """Per-step milliseconds: whole model, one stage on one GPU, the busiest FSDP rank of that stage."""
    model, stage, rank, stage_batched = {}, {}, {}, {}
    for name in PRECISIONS:
        layer_ms = sum(count * single[name, shape]["median_ms"] for shape, count in per_layer.items())
        model[name] = n_layers * layer_ms
        stage[name] = args.stage_layers * layer_ms
        matrix_ms = [sum(single[name, block]["median_ms"] for block in m.blocks) for m in matrices] * args.stage_layers
        sizes = [m.shape[0] * m.shape[1] for m in matrices] * args.stage_layers
        owners = assign_owners(sizes, args.fsdp)
        rank[name] = max(sum(ms for ms, owner in zip(matrix_ms, owners) if owner == r) for r in range(args.fsdp))
        if any(key[0] == name for key in batched):
            stage_batched[name] = sum(v["median_ms"] for (n, _), v in batched.items() if n == name)
    return {
        "config": str(args.config),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "ns_steps": steps,
        "n_layers": n_layers,
        "stage_layers": args.stage_layers,
        "fsdp": args.fsdp,
        "layer_matrices": [dataclasses.asdict(m) for m in matrices],
        "single": [{"precision": n, "shape": s, **v} for (n, s), v in single.items()],
        "batched": [{"precision": n, "shape": s, **v} for (n, s), v in batched.items()],
        "step_ms": {"model_one_gpu": model, "stage_one_gpu": stage, "stage_busiest_fsdp_rank": rank, "stage_one_gpu_batched": stage_batched},
    }


def print_table(result: dict) -> None:
    print(f"\n{result['config']} on {result['device']} (torch {result['torch']}), {result['ns_steps']} Newton-Schulz steps")
    print(f"{'precision':9s} {'shape':>14s} {'min ms':>9s} {'median ms':>10s} {'max ms':>9s} {'TFLOP/s':>8s}")
    for row in result["single"]:
        print(f"{row['precision']:9s} {str(tuple(row['shape'])):>14s} {row['min_ms']:9.3f} {row['median_ms']:10.3f} {row['max_ms']:9.3f} {row['tflops']:8.1f}")
    for row in result["batched"]:
        print(f"{row['precision']:9s} {row['count']:3d} x {str(tuple(row['shape'])):>12s} batched: median {row['median_ms']:9.3f} ms, "
              f"{row['tflops']:6.1f} TFLOP/s, relative difference to orthogonalize {row['relative_difference_to_orthogonalize']:.1e}")
    for key, values in result["step_ms"].items():
        print(f"per step, {key}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in values.items()))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, default=Path("train_configs/10b_2bw_muon.toml"))
    parser.add_argument("--stage-layers", type=int, default=6, help="layers of the largest pipeline stage (10B: 6, see `titan-async plan`)")
    parser.add_argument("--fsdp", type=int, default=8, help="FSDP ranks per stage (10B: 8)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20, help="timed calls per shape in bfloat16 and TF32")
    parser.add_argument("--float32-reps", type=int, default=6, help="timed calls per shape in float32")
    parser.add_argument("--batched-reps", type=int, default=3)
    parser.add_argument("--small", action="store_true", help="a small model of the same layout (trying the script on CPU)")
    parser.add_argument("--out", type=Path, help="JSON file for the full results")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.no_grad():
        result = measure(args, device)
    print_table(result)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
