"""Benchmark results of a run's checkpoints (`eval --tasks`): RUN/benchmarks/step-N.json, read
back by `report` and `compare`.

A step's file holds {"step", "checkpoint", "harness", "tasks"}; "tasks" maps each task's name
to {"metrics": {name: value}, "stderr": {name: value or null}, "num_fewshot", "samples",
"limit"}. A later evaluation of the same step adds its tasks to the file, replacing those of
the same name. A benchmark during training that could not run records why, in one line, as
"failure" (`save_failure`); a later evaluation of the step drops it.
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_async.rundir import directory as runs

BENCHMARKS_DIR = "benchmarks"
HEADER = ["step", "task", "metric", "value", "stderr", "few-shot", "samples"]


def save_results(run_dir: Path, step: int, checkpoint: Path, harness: str, tasks: dict[str, dict]) -> Path:
    """Add `tasks` (name -> result) to RUN/benchmarks/step-`step`.json; returns the file."""
    path = run_dir / BENCHMARKS_DIR / f"step-{step}.json"
    stored = json.loads(path.read_text())["tasks"] if path.is_file() else {}
    path.parent.mkdir(exist_ok=True)
    record = {"step": step, "checkpoint": str(checkpoint), "harness": harness, "tasks": {**stored, **tasks}}
    runs.write_atomic(path, json.dumps(record, indent=1))
    return path


def save_failure(run_dir: Path, step: int, checkpoint: Path, reason: str) -> Path:
    """Record in RUN/benchmarks/step-`step`.json why its benchmark has no results (`reason`, one
    line), keeping the tasks already stored there; returns the file."""
    path = run_dir / BENCHMARKS_DIR / f"step-{step}.json"
    record = json.loads(path.read_text()) if path.is_file() else {"step": step, "checkpoint": str(checkpoint), "tasks": {}}
    path.parent.mkdir(exist_ok=True)
    runs.write_atomic(path, json.dumps({**record, "failure": reason}, indent=1))
    return path


def read_results(run_dir: Path) -> dict[int, dict[str, dict]]:
    """Step -> task name -> result, of every benchmark file of the run (empty if none)."""
    results = {}
    for path in (run_dir / BENCHMARKS_DIR).glob("step-*.json"):
        record = json.loads(path.read_text())
        results[record["step"]] = record["tasks"]
    return dict(sorted(results.items()))


def latest_results(results: dict[int, dict[str, dict]]) -> dict[str, tuple[int, dict]]:
    """Task name -> (step, result) of the latest step that evaluated it."""
    return {name: (step, result) for step, tasks in results.items() for name, result in tasks.items()}


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:.4f}"


def result_rows(step: int, name: str, result: dict) -> list[list[str]]:
    """One task's result as text rows of HEADER, one per metric."""
    return [
        [str(step), name, metric, _number(value), _number(result["stderr"].get(metric)),
         str(result["num_fewshot"]), str(result["samples"])]
        for metric, value in result["metrics"].items()
    ]


def table_rows(results: dict[int, dict[str, dict]]) -> list[list[str]]:
    """Every step's results as text rows of HEADER (header excluded)."""
    return [row for step, tasks in results.items() for name, result in tasks.items() for row in result_rows(step, name, result)]
