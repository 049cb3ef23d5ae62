"""What a zero-bubble schedule's split backward costs: one transformer block of a config's model.

    python tools/gpu/bench_split_backward.py --config train_configs/10b_2bw_muon.toml --out split.json

For each variant (bfloat16 or float8 rowwise linears, eager or compiled per block as torchtitan
compiles, with or without torchtitan's selective activation checkpointing) the script times, with
CUDA events, the forward (F), a full backward (B), and the backward split as torch's zero-bubble
schedules run it: the input gradient alone (I, `stage_backward_input`) and then the weight gradient
alone (W, `stage_backward_weight`). min / median / max over --reps repetitions after --warmup; the
ratio (I + W) / B is what `plan --simulate` charges a split backward, and I / (I + W) its input
share. The split's gradients are compared with the full backward's once per variant. A variant
torch cannot split (selective recomputation: "Trying to backward an extra time") is recorded with
its error. Runs on CPU too (host timer) for trying the script with --small.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from titan_async.core import platform  # noqa: E402

platform.configure()
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight  # noqa: E402
from torchtitan.distributed.activation_checkpoint import SelectiveAC  # noqa: E402

from titan_async.config.run_config import load_run_config  # noqa: E402
from titan_async.model.init import reinitialize_by_name  # noqa: E402
from titan_async.model.llama import build_model_spec  # noqa: E402

VARIANTS = (
    "bf16-eager",
    "float8-eager",
    "bf16-eager-sac",
    "bf16-eager-donate",
    "float8-compiled",
    "bf16-compiled",
    "float8-compiled-sac",
    "bf16-compiled-donate",
)
"""name = linears-compilation[-options]; options: donate (torch._functorch.config.donated_buffer left
on, as torch and torchtitan leave it: then a compiled backward, FlexAttention's on CUDA included,
cannot run twice; every other variant turns it off), sac (torchtitan's selective activation checkpointing, the 10B config's mode)."""


@dataclasses.dataclass
class Block:
    """One transformer block on the device, its attention masks and a hidden-state input."""

    module: torch.nn.Module
    masks: object
    x: torch.Tensor
    grad_out: torch.Tensor


def build_block(config: Path, variant: str, small: bool, device: torch.device, seq_len: int) -> Block:
    """Layer 0 of `config`'s model (vocabulary cut to 2048: no head here), bfloat16 weights."""
    linears, compilation, *options = variant.split("-")
    run = load_run_config(config)
    section = dataclasses.replace(run.model, n_layers=1, vocab_size=2048, float8="rowwise" if linears == "float8" else "none")
    if small:
        section = dataclasses.replace(section, dim=256, n_heads=4, n_kv_heads=2, multiple_of=256)
    compiled = compilation == "compiled"
    spec = build_model_spec(section, 2048, fsdp=False, compiled=compiled)
    with torch.device(device):
        model = spec.model.build()
    reinitialize_by_name([model], seed=0)
    for param in model.parameters():  # bfloat16 weights as FSDP gathers them; the RoPE table stays complex
        param.data = param.data.to(torch.bfloat16)
    if "sac" in options:
        SelectiveAC(SelectiveAC.Config()).apply(model)
    block = model.layers["0"]
    if compiled:
        block = torch.compile(block, fullgraph=True)
    positions = torch.arange(seq_len, device=device).unsqueeze(0)
    masks = model.get_attention_masks(positions)
    generator = torch.Generator(device=device).manual_seed(0)
    dim = section.resolved(2048)["dim"]
    x = torch.randn(1, seq_len, dim, device=device, dtype=torch.bfloat16, generator=generator)
    grad_out = torch.randn(x.shape, device=device, dtype=torch.bfloat16, generator=generator)
    return Block(block, masks, x, grad_out)


class Stopwatch:
    """Intervals between marks: CUDA events on a GPU, the host clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def intervals_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def one_rep(block: Block, device: torch.device, split: bool) -> tuple[list[float], list[torch.Tensor | None]]:
    """F then B, or F then I then W: their milliseconds, and the gradients (input first)."""
    params = list(block.module.parameters())
    for p in params:
        p.grad = None
    x = block.x.detach().requires_grad_()
    watch = Stopwatch(device)
    watch.mark()
    out = block.module(x, block.masks)
    watch.mark()
    if split:
        (dx,), groups = stage_backward_input([out], [block.grad_out], [x], iter(params))
        watch.mark()
        stage_backward_weight(iter(params), groups)
    else:
        torch.autograd.backward(out, block.grad_out)
        dx = x.grad
    watch.mark()
    return watch.intervals_ms(), [dx] + [p.grad for p in params]


def largest_relative_difference(a: list[torch.Tensor | None], b: list[torch.Tensor | None]) -> float:
    worst = 0.0
    for u, v in zip(a, b, strict=True):
        if u is None or v is None:
            if (u is None) != (v is None):
                return float("inf")
            continue
        u, v = u.float(), v.float()
        worst = max(worst, ((u - v).norm() / v.norm().clamp_min(1e-30)).item())
    return worst


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def measure(block: Block, device: torch.device, warmup: int, reps: int) -> dict[str, object]:
    """F, B, I, W (ms) over `reps` interleaved full and split repetitions."""
    for _ in range(warmup):
        one_rep(block, device, split=False)
        one_rep(block, device, split=True)
    forward, full, input_grad, weight_grad = [], [], [], []
    _, full_grads = one_rep(block, device, split=False)
    _, split_grads = one_rep(block, device, split=True)
    for _ in range(reps):
        (f, b), _ = one_rep(block, device, split=False)
        (f2, i, w), _ = one_rep(block, device, split=True)
        forward += [f, f2]
        full.append(b)
        input_grad.append(i)
        weight_grad.append(w)
    ratio = [(i + w) / b for i, w, b in zip(input_grad, weight_grad, full)]
    return {
        "F_ms": spread(forward),
        "B_ms": spread(full),
        "I_ms": spread(input_grad),
        "W_ms": spread(weight_grad),
        "split_over_full": spread(ratio),
        "input_share": statistics.median(i / (i + w) for i, w in zip(input_grad, weight_grad)),
        "split_gradients_vs_full": largest_relative_difference(split_grads, full_grads),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", type=Path, default=Path("train_configs/10b_2bw_muon.toml"))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--small", action="store_true", help="dim 256 and 4 heads, for trying the script on CPU")
    parser.add_argument("--deadline", type=float, default=float("inf"), help="seconds after which no variant starts")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    start = time.monotonic()
    results: dict[str, object] = {"config": str(args.config), "seq_len": args.seq_len, "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__, "variants": {}}
    print(f"{'variant':<22}{'F ms':>9}{'B ms':>9}{'I ms':>9}{'W ms':>9}{'(I+W)/B':>10}{'I/(I+W)':>9}{'grads':>10}", flush=True)
    for variant in args.variants.split(","):
        if time.monotonic() - start > args.deadline:
            results["variants"][variant] = {"skipped": "deadline"}
            print(f"{variant:<22}skipped: deadline", flush=True)
            continue
        began = time.monotonic()
        torch._functorch.config.donated_buffer = "donate" in variant.split("-")
        try:
            row = measure(build_block(args.config, variant, args.small, device, args.seq_len), device, args.warmup, args.reps)
        except Exception as error:  # a variant torch cannot split is a result
            while error.__cause__ is not None:  # torch's split wraps the error that stopped it
                error = error.__cause__
            message = " ".join(str(error).split())[:300]
            results["variants"][variant] = {"error": f"{type(error).__name__}: {message}"}
            print(f"{variant:<22}error: {type(error).__name__}: {message}", flush=True)
            continue
        finally:
            torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["seconds"] = round(time.monotonic() - began, 1)
        results["variants"][variant] = row
        m = {k: row[k]["median"] for k in ("F_ms", "B_ms", "I_ms", "W_ms", "split_over_full")}
        print(f"{variant:<22}{m['F_ms']:9.2f}{m['B_ms']:9.2f}{m['I_ms']:9.2f}{m['W_ms']:9.2f}{m['split_over_full']:10.3f}{row['input_share']:9.3f}{row['split_gradients_vs_full']:10.1e}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
