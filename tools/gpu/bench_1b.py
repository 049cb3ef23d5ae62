"""tokens/s, peak memory and MFU of the 1B config on one GPU: bfloat16 against float8 rowwise.

    python tools/gpu/bench_1b.py --out DIR [--variants bf16,float8,bf16-muon] [--steps 30] [--warmup 10]

train_configs/1b_2bw_muon.toml is laid out for 8 GPUs (4 pipeline stages x FSDP 2, PipeDream2BW).
Here it runs as one process without pipeline parallelism (torchtitan then wraps the model in FSDP2
on one rank), compiled, on the offline stdlib corpus (its 2048-token tokenizer; the model keeps its
128256-row embedding and output head, so the head costs what it costs with the Llama 3 tokenizer),
with the shipped seq_len, validation and checkpoints off. The variants differ as VARIANTS says:
`bf16` and `float8` train with AdamW, so that their ratio is the model's; `bf16-muon` keeps the
shipped optimizer (Muon, float32 Newton-Schulz, error feedback), whose cost bench_newton_schulz.py
times on its own. Each variant is one `titan-async train`; tokens/s and MFU (torchtitan's, against
the bfloat16 peak also for float8) are medians over the steps after --warmup, memory the largest
peak any step logged. Results go to DIR/1b.json after every variant, with each run's rank-0 log.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "train_configs" / "1b_2bw_muon.toml"

ONE_GPU = [
    "parallelism.pipeline_parallel_degree=1",
    "parallelism.pipeline_parallel_schedule=1F1B",
    "data.source=stdlib",
    "data.tokenizer=",
    "compile.enable=true",
    "checkpoint.enable=false",
    "validation.enable=false",
    "metrics.log_freq=1",
    "metrics.enable_tensorboard=false",
    "lr_scheduler.warmup_steps=10",
]
ADAMW = ["optimizer.name=adamw", "optimizer.lr=3e-4", "optimizer.error_feedback.enabled=false",
         "optimizer.muon.adamw_lr=8e-4"]  # the [optimizer.muon] default, which a non-Muon run requires
VARIANTS = {
    "bf16": ADAMW,
    "float8": [*ADAMW, "model.float8=rowwise"],
    "bf16-muon": [],
}


def train(variant: str, run_dir: Path, args) -> subprocess.CompletedProcess:
    """One `titan-async train` of `variant`."""
    argv = [sys.executable, "-m", "titan_async.cli", "train", "--config", str(CONFIG), "--run-dir", str(run_dir), "--overwrite"]
    settings = [*ONE_GPU, f"training.steps={args.steps}", f"training.local_batch_size={args.local_batch_size}",
                *VARIANTS[variant], *args.set]
    for setting in settings:
        argv += ["--set", setting]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=args.timeout)


def summarize(run_dir: Path, warmup: int, tokens_per_step: int) -> dict:
    """Medians over the steps after `warmup` and the peak memory over all steps, from metrics.jsonl."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = {row["step"]: row for row in rows if row["kind"] == "train"}
    measured = [steps[s] for s in sorted(steps) if s > warmup]
    result = {
        "steps": len(steps),
        "measured_steps": len(measured),
        "tokens_per_step": tokens_per_step,
        "tokens_per_s": statistics.median(r["throughput(tps)"] for r in measured),
        "tokens_per_s_min": min(r["throughput(tps)"] for r in measured),
        "tokens_per_s_max": max(r["throughput(tps)"] for r in measured),
        "step_s": statistics.median(r["time_metrics/end_to_end(s)"] for r in measured),
        "tflops": statistics.median(r["tflops"] for r in measured),
        "peak_active_gib": max(r["memory/max_active(GiB)"] for r in steps.values()),
        "peak_reserved_gib": max(r["memory/max_reserved(GiB)"] for r in steps.values()),
        "first_loss": steps[min(steps)]["loss_metrics/global_avg_loss"],
        "last_loss": steps[max(steps)]["loss_metrics/global_avg_loss"],
    }
    if all("mfu(%)" in r for r in measured):
        result["mfu_pct"] = statistics.median(r["mfu(%)"] for r in measured)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True, help="folder for 1b.json and the runs' logs")
    parser.add_argument("--runs", type=Path, default=Path("/tmp/bench_1b"), help="folder for the run directories")
    parser.add_argument("--variants", default="bf16,float8,bf16-muon")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the medians (compilation, autotuning)")
    parser.add_argument("--local-batch-size", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=4096, help="only for counting tokens per step; the config sets it")
    parser.add_argument("--timeout", type=float, default=420, help="seconds one run may take")
    parser.add_argument("--deadline", type=float, default=1e9, help="start no variant after this many seconds")
    parser.add_argument("--set", action="append", default=[], help="extra `--set` for every run (e.g. a smaller model)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    begin, results = time.monotonic(), {}
    for variant in args.variants.split(","):
        if time.monotonic() - begin > args.deadline:
            results[variant] = {"skipped": f"deadline of {args.deadline:.0f} s passed"}
            continue
        run_dir = args.runs / variant
        started = time.monotonic()
        try:
            done = train(variant, run_dir, args)
            status = done.returncode
            tail = (done.stdout[-1500:] + done.stderr[-3000:]) if status else ""
        except subprocess.TimeoutExpired:
            status, tail = "timeout", ""
        log = run_dir / "logs" / "rank0.log"
        if log.is_file():
            shutil.copy(log, args.out / f"1b_{variant}.log")
        entry = {"settings": VARIANTS[variant], "exit": status, "wall_s": time.monotonic() - started}
        if status == 0:
            entry.update(summarize(run_dir, args.warmup, args.local_batch_size * args.seq_len))
        else:
            entry["output_tail"] = tail
        results[variant] = entry
        print(variant, json.dumps({k: v for k, v in entry.items() if k != "output_tail"}), flush=True)
        if tail:
            print(tail, flush=True)
        (args.out / "1b.json").write_text(json.dumps({"common_settings": ONE_GPU, "variants": results}, indent=1))
    if {"bf16", "float8"} <= {k for k, v in results.items() if "tokens_per_s" in v}:
        ratio = results["float8"]["tokens_per_s"] / results["bf16"]["tokens_per_s"]
        print(f"float8 / bf16 tokens/s: {ratio:.3f}")
        (args.out / "1b.json").write_text(json.dumps({"common_settings": ONE_GPU, "variants": results, "float8_over_bf16": ratio}, indent=1))


if __name__ == "__main__":
    main()
