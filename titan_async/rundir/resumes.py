"""A resume's config change is transactional, and every resume is remembered.

`resume` stages the config it checked (`stage`) beside the run's config.toml, which it leaves
alone; the workers train on the staged config (`staged_config`), and rank 0 makes it the run's
config only once every rank has loaded the checkpoint and built (`commit`, at the first step),
appending what changed to the run's history. A resume that fails before then leaves
config.toml byte for byte as it was, and the next resume stages its own config over the failed
one's."""

from __future__ import annotations

import json
import time
import tomllib
from pathlib import Path

from titan_async.rundir.directory import (
    CONFIG_FILE, RESUME_HISTORY_FILE, RESUME_STAGED_FILE, save_launch, write_atomic, writing,
)


def stage(run_dir: Path, config_toml: str, nproc_per_node: int, assignments: list[str]) -> None:
    """Hold the resume's checked config, its launch setting and its `--set` assignments until `commit`."""
    record = {"config": config_toml, "nproc_per_node": nproc_per_node, "set": list(assignments)}
    with writing("--run-dir", run_dir):
        write_atomic(run_dir / RESUME_STAGED_FILE, json.dumps(record))


def staged_config(run_dir: Path) -> str | None:
    """The TOML text of the config a resume staged and has not committed, or None."""
    path = run_dir / RESUME_STAGED_FILE
    return json.loads(path.read_text())["config"] if path.is_file() else None


def _flat(document: dict, prefix: str = "") -> dict[str, object]:
    flat = {}
    for key, value in document.items():
        if isinstance(value, dict):
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changes(before_toml: str, after_toml: str) -> dict[str, list]:
    """Dotted key -> [before, after] for every key whose value differs (None where a side lacks it)."""
    before, after = _flat(tomllib.loads(before_toml)), _flat(tomllib.loads(after_toml))
    return {key: [before.get(key), after.get(key)] for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key)}


def commit(run_dir: Path, resumed_step: int) -> None:
    """Make the staged config the run's config.toml (left byte for byte when no value changed) and
    append the resume to the history (rank 0, once every rank has loaded the checkpoint of
    `resumed_step` and built); nothing when no resume is staged."""
    path = run_dir / RESUME_STAGED_FILE
    if not path.is_file():
        return
    staged = json.loads(path.read_text())
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "resumed_step": resumed_step, "set": staged["set"],
             "nproc_per_node": staged["nproc_per_node"],
             "changed": changes((run_dir / CONFIG_FILE).read_text(), staged["config"])}
    save_launch(run_dir, staged["config"] if entry["changed"] else None, staged["nproc_per_node"])
    with open(run_dir / RESUME_HISTORY_FILE, "a") as history:
        history.write(json.dumps(entry) + "\n")
    path.unlink()


def history(run_dir: Path) -> list[dict]:
    """The run's resumes, oldest first."""
    path = run_dir / RESUME_HISTORY_FILE
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
