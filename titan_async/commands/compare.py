"""`titan-async compare`: several runs' losses against step, tokens and training wall-clock, and
the training time each takes to reach a target validation loss, against a baseline run.

Training wall-clock is the sum of the logged `time_metrics/training(s)`: the time spent in
training steps, without validation and checkpoints. A validation after step s is placed at the
training time, tokens and step of step s. Time to target is interpolated linearly between the
two validations around the first one at or below the target.
"""

from __future__ import annotations

import html
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from titan_async.commands import pages
from titan_async.core.errors import UserError
from titan_async.rundir import directory as run_dir
from titan_async.rundir.benchmarks import latest_results, read_results
from titan_async.rundir.record import TRAIN_LOSS, VALIDATION_LOSS, RunRecord, read_run, series
from titan_async.train.progress import TRAINING_SECONDS

TOKENS = "n_tokens_seen"
SMOOTHING = 0.9
AXES = {"step": "step", "tokens": "tokens", "seconds": "training wall-clock (s)"}
VALIDATION_DATA = (("data", None), ("validation", "steps"), ("training", "seq_len"), ("training", "local_batch_size"))
"""Config entries that decide the held-out tokens a validation loss is measured on (None: the whole section)."""


def smooth(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """Bias-corrected exponential moving average."""
    out, average = [], 0.0
    for i, value in enumerate(values, 1):
        average = beta * average + (1 - beta) * value
        out.append(average / (1 - beta**i))
    return out


def time_to_target(x: list[float], losses: list[float], target: float) -> float | None:
    """Where `losses` (validation losses at increasing `x`) first reach `target`, interpolated
    linearly between that validation and the one before; None if they never do."""
    for i, loss in enumerate(losses):
        if loss <= target:
            if i == 0:
                return x[0]
            previous = losses[i - 1]
            return x[i - 1] + (previous - target) / (previous - loss) * (x[i] - x[i - 1])
    return None


@dataclass
class RunCurves:
    """A run's curves; every x axis (AXES) holds the same points: the logged training steps
    (`train`), and the validations (`validation`)."""

    label: str
    record: RunRecord
    train: dict[str, list[float]]
    train_loss: list[float]
    validation: dict[str, list[float]]
    validation_loss: list[float]

    @property
    def training_seconds(self) -> float:
        return self.train["seconds"][-1]

    @property
    def tokens_per_second(self) -> float:
        return self.train["tokens"][-1] / self.training_seconds


def curves_of(record: RunRecord, label: str, argument: str) -> RunCurves:
    """The curves of a read run; UserError if it did not log its training time."""
    steps, seconds = series(record.train, TRAINING_SECONDS)
    if len(steps) != len(record.train):
        raise UserError(f"{argument} {record.directory}: metrics.jsonl lacks {TRAINING_SECONDS} (a run from an older titan-async)")
    _, tokens = series(record.train, TOKENS)
    train = {"step": steps, "tokens": tokens, "seconds": list(np.cumsum(seconds))}
    val_steps, val_losses = series(record.validation, VALIDATION_LOSS)
    validation = {axis: list(np.interp(val_steps, steps, values)) for axis, values in train.items()}
    return RunCurves(label, record, train, smooth(series(record.train, TRAIN_LOSS)[1]), validation, val_losses)


def _setting(config: dict, section: str, key: str | None):
    return config.get(section, {}) if key is None else config.get(section, {}).get(key)


def check_comparable(baseline: RunCurves, other: RunCurves) -> list[str]:
    """Warnings for runs whose losses compare but whose models differ; UserError if `other`
    validates on different held-out tokens than `baseline` (its losses measure something else)."""
    for section, key in VALIDATION_DATA:
        ours, theirs = (_setting(run.record.config, section, key) for run in (baseline, other))
        if ours != theirs:
            name = section if key is None else f"{section}.{key}"
            raise UserError(f"RUN_DIR {other.record.directory}: validates on different data than the baseline "
                            f"{baseline.record.directory} ({name} differs); their losses do not compare")
    if baseline.record.config.get("model") != other.record.config.get("model"):
        return [f"{other.label} trains a different model ([model] differs from the baseline {baseline.label}'s)"]
    return []


def parse_target(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UserError(f"--target {text}: expected a positive validation loss")
    return value


def compare(directories: list[Path], baseline: Path | None = None, target: float | None = None) -> tuple[list[RunCurves], dict]:
    """Read the runs (the baseline first: `baseline`, else the first directory) and return their
    curves and the results: target, baseline, warnings and per run its tokens/s, final and best
    validation loss, time (and tokens, steps) to the target, speed-up over the baseline and the
    latest benchmark result of each task (`eval --tasks`)."""
    ordered = list(dict.fromkeys([baseline or directories[0], *directories]))
    names = [d.resolve().name for d in ordered]
    labels = names if len(set(names)) == len(names) else [str(d) for d in ordered]
    runs = [curves_of(read_run(d, "RUN_DIR"), label, "RUN_DIR") for d, label in zip(ordered, labels)]
    warnings = [w for run in runs[1:] for w in check_comparable(runs[0], run)]
    if target is None:
        if not runs[0].validation_loss:
            raise UserError(f"--baseline {ordered[0]}: no validation loss logged yet; give --target")
        target = runs[0].validation_loss[-1]
    results = []
    for run in runs:
        reached = {axis: time_to_target(x, run.validation_loss, target) for axis, x in run.validation.items()}
        results.append({
            "run": str(run.record.directory),
            "label": run.label,
            "steps": max(run.record.train),
            "training_s": run.training_seconds,
            "tokens_per_s": run.tokens_per_second,
            "final_validation_loss": run.validation_loss[-1] if run.validation_loss else None,
            "best_validation_loss": min(run.validation_loss, default=None),
            "time_to_target_s": reached["seconds"],
            "tokens_to_target": reached["tokens"],
            "steps_to_target": reached["step"],
            "benchmarks": {name: {"step": step, **result}
                           for name, (step, result) in latest_results(read_results(run.record.directory)).items()},
        })
    base_time = results[0]["time_to_target_s"]
    for row in results:
        row["speedup"] = base_time / row["time_to_target_s"] if base_time and row["time_to_target_s"] else None
    return runs, {"target": target, "baseline": str(runs[0].record.directory), "warnings": warnings, "runs": results}


def cell(value: float | None, form: str, missing: str = "-") -> str:
    """`value` in `form`, or `missing` for None."""
    return missing if value is None else form.format(value)


def table_rows(results: dict) -> list[list[str]]:
    """The comparison table as text cells (header first)."""
    rows = [["run", "steps", "training s", "tokens/s", "final val loss", "best val loss", "time to target (s)", "speed-up"]]
    for row in results["runs"]:
        rows.append([
            row["label"], str(row["steps"]), f"{row['training_s']:.1f}", f"{row['tokens_per_s']:,.0f}",
            cell(row["final_validation_loss"], "{:.4f}"), cell(row["best_validation_loss"], "{:.4f}"),
            cell(row["time_to_target_s"], "{:.1f}", "not reached"), cell(row["speedup"], "{:.2f}x"),
        ])
    return rows


def benchmark_rows(results: dict) -> list[list[str]]:
    """Each run's latest result of every benchmark task and metric as text cells (header first);
    empty when no run has one."""
    keys = dict.fromkeys((task, metric) for row in results["runs"] for task, result in row["benchmarks"].items()
                         for metric in result["metrics"])
    if not keys:
        return []
    rows = [["task", "metric", *(row["label"] for row in results["runs"])]]
    for task, metric in keys:
        cells = []
        for row in results["runs"]:
            result = row["benchmarks"].get(task, {"metrics": {}})
            value = result["metrics"].get(metric)
            cells.append("-" if value is None else f"{value:.4f} (step {result['step']})")
        rows.append([task, metric, *cells])
    return rows


def print_rows(rows: list[list[str]]) -> None:
    """Text cells as aligned columns on stdout."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(text.ljust(width) for text, width in zip(row, widths)).rstrip())


def draw_plots(runs: list[RunCurves], target: float, folder: Path) -> list[tuple[str, Path]]:
    """Validation and smoothed training loss against every axis, one PNG each; (caption, file)."""
    plots = []
    for axis, xlabel in AXES.items():
        path = folder / f"validation_loss_by_{axis}.png"
        lines = [(run.label, run.validation[axis], run.validation_loss) for run in runs if run.validation_loss]
        ends = [x for _, xs, _ in lines for x in (xs[0], xs[-1])]
        if ends:
            lines.append((f"target {target:.4f}", [min(ends), max(ends)], [target, target]))
        pages.line_chart(path, f"validation loss by {xlabel}", "cross-entropy", lines, xlabel)
        plots.append((f"Validation loss by {xlabel}, with the target", path))
    for axis, xlabel in AXES.items():
        path = folder / f"training_loss_by_{axis}.png"
        pages.line_chart(path, f"training loss (EMA {SMOOTHING}) by {xlabel}", "cross-entropy",
                          [(run.label, run.train[axis], run.train_loss) for run in runs], xlabel)
        plots.append((f"Training loss, smoothed (bias-corrected EMA {SMOOTHING}), by {xlabel}", path))
    return plots


def render_html(results: dict, plots: list[tuple[str, Path]]) -> str:
    header, *rows = table_rows(results)
    parts = [
        f'<section id="summary"><h2>Time to validation loss {results["target"]:.4f}</h2>',
        f"<p>Baseline: {html.escape(results['baseline'])}. Training wall-clock excludes validation and checkpoints; "
        "time to target is interpolated between validations.</p>",
        pages.html_table(header, rows),
        "".join(f"<p><strong>Warning:</strong> {html.escape(w)}</p>" for w in results["warnings"]),
        "</section>",
    ]
    if benchmarks := benchmark_rows(results):
        header, *rows = benchmarks
        parts.append('<section id="benchmarks"><h2>Benchmarks (eval --tasks, lm-evaluation-harness)</h2>'
                     f"{pages.html_table(header, rows)}</section>")
    parts.append('<section id="curves"><h2>Curves</h2>' + "".join(pages.html_figure(c, p) for c, p in plots) + "</section>")
    return pages.html_page("titan-async comparison", parts)


def run_compare(directories: list[Path], baseline: Path | None, target: str | None, out: Path | None, as_json: bool) -> int:
    """The command: JSON on stdout with `as_json`, else the HTML page (default
    BASELINE/compare/compare.html) with its PNGs beside it, and the table on stdout."""
    runs, results = compare(directories, baseline, parse_target(target))
    if as_json:
        print(json.dumps(results, indent=1))
        return 0
    for warning in results["warnings"]:
        print(f"titan-async: warning: {warning}", file=sys.stderr)
    with run_dir.writing(*(("--out", out) if out else ("--baseline" if baseline else "RUN_DIR", runs[0].record.directory))):
        out = pages.page_path(out or runs[0].record.directory / "compare" / "compare.html")
        run_dir.write_atomic(out, render_html(results, draw_plots(runs, results["target"], out.parent)))
    print(f"target validation loss {results['target']:.4f}")
    print_rows(table_rows(results))
    if benchmarks := benchmark_rows(results):
        print("benchmarks (latest step of each run)")
        print_rows(benchmarks)
    print(f"compare: {out}")
    return 0
