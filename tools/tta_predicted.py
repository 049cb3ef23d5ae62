"""Time to target at p = 2 on the CPU, measured beside predicted.

Measured: the Muon arms of the time-to-target study (docs/results/tta/results.json, written by
tools/tta_study.py): each arm's speed-up = 1F1B + Muon's time to its own final validation loss
over the arm's. Predicted, as `plan` predicts a run: the simulated tokens/s of the arm's schedule
over 1F1B's (`plan --simulate --costs-from TRACE`, the costs of a traced 1F1B + Muon run of the same
config) x the staleness law's token efficiency for the delayed schedules (`plan --staleness`:
Muon, the corrector, the config's parameters and the study's steps). Writes predicted.json and a
section of docs/results/tta/PREDICTED.md.

    .venv/bin/python tools/tta_predicted.py [--trace-steps 20] [--trace RUN_DIR]
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tomllib
from pathlib import Path

from titan_async.cluster import staleness
from titan_async.experiments.jobs import ROOT, Job, git_state, run_job
from titan_async.pipeline.schedules import STREAMING_SCHEDULES

TTA = ROOT / "docs" / "results" / "tta"
ARMS = {"muon": "none", "muon-ef": "ef"}
"""The measured study's Muon arms (tools/tta_study.py OPTIMIZERS) and their staleness corrector."""
BASELINE = "1F1B-muon"


def trace(config: str, steps: int, run_dir: Path) -> Job:
    """A traced 1F1B + Muon run of `config` on 2 processes (no validation, no checkpoint)."""
    return Job("trace", run_dir, config, [
        "parallelism.pipeline_parallel_schedule=1F1B", "optimizer.name=muon", f"training.steps={steps}",
        "metrics.pipeline_trace=true", "checkpoint.enable=false", "validation.enable=false", "metrics.enable_tensorboard=false",
    ], ["--nproc-per-node", "2"])


def simulated(config: str, trace_dir: Path) -> dict:
    """`plan --simulate --costs-from trace_dir --json` of `config` with Muon on one 2-GPU node."""
    command = [sys.executable, "-m", "titan_async.cli", "plan", "--config", config, "--gpus-per-node", "2", "--simulate",
               "--costs-from", str(trace_dir), "--json", "--set", "optimizer.name=muon"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr}")
    return json.loads(result.stdout)


def predict(measured: dict, plan: dict, steps: int, law: staleness.Law | None = None) -> list[dict]:
    """Per measured Muon arm: its measured speed-ups (per seed, mean), the simulated tokens/s
    ratio to 1F1B, the token efficiency (1 for a synchronous schedule), the predicted speed-up
    and measured / predicted."""
    tokens = {row["name"]: row["tokens_per_second"] for row in plan["simulation"]["schedules"]}
    parameters = plan["model"]["parameters"]
    rows = []
    for row in measured["table"]:
        schedule, _, optimizer = row["arm"].partition("-")
        if optimizer not in ARMS or schedule not in tokens:
            continue
        if schedule in STREAMING_SCHEDULES:
            found = staleness.estimate("muon", ARMS[optimizer], steps, parameters, law)
            efficiency, span, notes = found.efficiency, (found.low, found.high), found.extrapolated
        else:
            efficiency, span, notes = 1.0, (1.0, 1.0), ()
        ratio = tokens[schedule] / tokens["1F1B"]
        speedups = [s["speedup"] for s in row["seeds"].values()]
        mean = statistics.fmean(x for x in speedups if x is not None) if any(x is not None for x in speedups) else None
        rows.append({"arm": row["arm"], "measured_speedups": speedups, "measured_speedup": mean,
                     "measured_tokens_per_s_ratio": row["mean_tokens_per_s"] / _baseline(measured)["mean_tokens_per_s"],
                     "simulated_tokens_per_s_ratio": ratio, "token_efficiency": efficiency, "token_efficiency_range": list(span),
                     "predicted_speedup": ratio * efficiency, "predicted_speedup_range": [ratio * span[0], ratio * span[1]],
                     "measured_over_predicted": None if mean is None else mean / (ratio * efficiency), "extrapolated": list(notes)})
    return rows


def _baseline(measured: dict) -> dict:
    return next(row for row in measured["table"] if row["arm"] == BASELINE)


def markdown(rows: list[dict], parameters: int, steps: int, how: str) -> str:
    lines = ["# Time to target at p = 2: measured beside predicted", "",
             f"Measured: docs/results/tta (README.md there), 1F1B + Muon's final validation loss as the target. Predicted: "
             f"the simulated tokens/s ratio to 1F1B (`plan --simulate --costs-from` a traced 1F1B + Muon run) x the staleness "
             f"law's token efficiency at {parameters:,} parameters and {steps} steps (`titan_async/cluster/staleness.py`).", "",
             "| arm | measured speed-up per seed | measured mean | measured tokens/s ratio | simulated tokens/s ratio "
             "| token efficiency (range) | predicted speed-up (range) | measured / predicted |",
             "|---|---|---:|---:|---:|---|---|---:|"]
    for r in rows:
        per_seed = ", ".join("not reached" if s is None else f"{s:.2f}x" for s in r["measured_speedups"])
        lines.append(
            f"| {r['arm']} | {per_seed} | {_x(r['measured_speedup'])} | {r['measured_tokens_per_s_ratio']:.3f} | "
            f"{r['simulated_tokens_per_s_ratio']:.3f} | {r['token_efficiency']:.3f} ({r['token_efficiency_range'][0]:.3f}.."
            f"{r['token_efficiency_range'][1]:.3f}) | {r['predicted_speedup']:.2f}x ({r['predicted_speedup_range'][0]:.2f}.."
            f"{r['predicted_speedup_range'][1]:.2f}) | {_number(r['measured_over_predicted'])} |")
    notes = sorted({note for r in rows for note in r["extrapolated"]})
    lines += ["", "The law extrapolates here: " + "; ".join(notes) + "." if notes else "", "", "## How it was run", "", how]
    return "\n".join(lines) + "\n"


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace-steps", type=int, default=20, help="steps of the traced 1F1B + Muon run")
    p.add_argument("--trace", type=Path, help="an existing traced run to take the costs from (default: train one)")
    args = p.parse_args(argv)
    measured = json.loads((TTA / "results.json").read_text())
    config_file = TTA / "configs" / f"{BASELINE}-seed0.toml"
    config = "train_configs/debug_cpu_pp2.toml"
    steps = tomllib.loads(config_file.read_text())["training"]["steps"]
    trace_dir = args.trace
    if trace_dir is None:
        trace_dir = ROOT / "runs" / "tta_trace"
        wall = run_job(trace(config, args.trace_steps, trace_dir))
        print(f"traced {args.trace_steps} steps in {wall:.0f} s")
    plan = simulated(config, trace_dir)
    rows = predict(measured, plan, steps)
    how = (f"- `.venv/bin/python tools/tta_predicted.py {shlex.join(sys.argv[1:] if argv is None else argv)}` at git revision "
           f"`{git_state()}`: trace `{shlex.join(trace(config, args.trace_steps, Path('RUN')).command()[1:])}`, then "
           f"`plan --config debug_cpu_pp2 --gpus-per-node 2 --simulate --costs-from RUN --json --set optimizer.name=muon`")
    (TTA / "predicted.json").write_text(json.dumps({"rows": rows, "parameters": plan["model"]["parameters"], "steps": steps}, indent=1))
    text = markdown(rows, plan["model"]["parameters"], steps, how)
    (TTA / "PREDICTED.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
