"""What a run directory recorded, read once: its config, launch settings, training and
validation scalars by step (metrics.jsonl) and each pipeline stage's measured bubble."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path

from titan_async.core.errors import UserError
from titan_async.rundir import directory as runs
from titan_async.rundir.jsonl import set_aside_path

TRAIN_LOSS = "loss_metrics/global_avg_loss"
VALIDATION_LOSS = "validation_metrics/loss"
THROUGHPUT = "throughput(tps)"
MEMORY = "memory/max_reserved(GiB)"
BUBBLE = "pipeline/bubble"
STALENESS = "staleness/stage"
STALENESS_MAX = "staleness_max/stage"
"""Prefixes of the streaming runs' per-stage staleness (mean, largest) of the gradients applied since the previous row."""


@dataclass
class RunRecord:
    """What a run directory holds, read once."""

    directory: Path
    config_text: str
    config: dict
    launch: dict
    train: dict[int, dict]
    """Step -> training scalars (the last row logged for that step)."""
    validation: dict[int, dict]
    stage_bubbles: dict[int, dict[int, float]]
    """Pipeline stage -> step -> measured bubble (of the stage's first rank), from pipeline/stage<s>.jsonl."""


def _json_rows(path: Path) -> list[dict]:
    """The JSON objects of a JSON-lines file; a line cut short by a killed run is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def read_run(directory: Path, argument: str = "--run-dir") -> RunRecord:
    """Read `directory`; UserError naming `argument` if it is not a run directory or has logged
    no training step."""
    launch = runs.load_launch(directory, argument)
    metrics_file = directory / "metrics.jsonl"
    rows = _json_rows(metrics_file) if metrics_file.is_file() else []
    train = {row["step"]: row for row in rows if row.get("kind") == "train"}
    if not train:
        raise UserError(f"{argument} {directory}: no training step logged yet ({metrics_file.name} is missing or empty)")
    bubbles = {}
    for path in sorted((directory / "pipeline").glob("stage*.jsonl")):
        per_step = {row["step"]: row["bubble"] for row in _json_rows(path) if row.get("bubble") is not None}
        if per_step:
            bubbles[int(path.stem.removeprefix("stage"))] = per_step
    config_text = (directory / runs.CONFIG_FILE).read_text()
    return RunRecord(
        directory=directory,
        config_text=config_text,
        config=tomllib.loads(config_text),
        launch=launch,
        train=train,
        validation={row["step"]: row for row in rows if row.get("kind") == "validation"},
        stage_bubbles=bubbles,
    )


def unlogged_steps(record: RunRecord) -> tuple[int, list[int]]:
    """(how many training steps up to the last logged one the run should have logged, which of
    them have no row): torchtitan logs step 1 and every `metrics.log_freq`-th step. A row is
    missing where a killed run cut it short, or where a resume changed `metrics.log_freq`."""
    log_freq = record.config.get("metrics", {}).get("log_freq")
    if not isinstance(log_freq, int) or log_freq < 1:  # a config.toml not written by titan-async: no claim
        return len(record.train), []
    expected = [step for step in range(1, max(record.train) + 1) if step == 1 or step % log_freq == 0]
    return len(expected), [step for step in expected if step not in record.train]


def set_aside_fragments(record: RunRecord) -> tuple[Path, int] | None:
    """(file, count) of the rows cut short by killed runs that writers set aside from
    metrics.jsonl (`titan_async.rundir.jsonl`), or None."""
    path = set_aside_path(record.directory / "metrics.jsonl")
    return (path, len(path.read_bytes().splitlines())) if path.is_file() else None


def series(rows: dict[int, dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that logged `key`, in step order."""
    steps = [step for step in sorted(rows) if rows[step].get(key) is not None]
    return steps, [rows[step][key] for step in steps]


def stage_series(rows: dict[int, dict], prefix: str) -> dict[int, tuple[list[int], list[float]]]:
    """Stage -> (steps, values) of the keys `prefix<stage>` (e.g. staleness/stage0), in step order."""
    stages = sorted({int(key.removeprefix(prefix)) for row in rows.values() for key in row
                     if key.startswith(prefix) and key.removeprefix(prefix).isdigit()})
    return {stage: series(rows, f"{prefix}{stage}") for stage in stages}


def diverged_validation(directory: Path) -> tuple[int, float] | None:
    """(step, loss) of the last validation in `directory`'s metrics.jsonl when that loss is not finite."""
    path = directory / "metrics.jsonl"
    rows = [row for row in _json_rows(path) if row.get("kind") == "validation"] if path.is_file() else []
    loss = rows[-1].get(VALIDATION_LOSS) if rows else None
    return (rows[-1]["step"], loss) if isinstance(loss, float) and not math.isfinite(loss) else None
