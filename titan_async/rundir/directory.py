"""The run directory: resolved config, launch settings, checkpoints, metrics, logs."""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from titan_async.core.errors import UserError

CONFIG_FILE = "config.toml"
STOPPED_FILE = "stopped.json"
LAUNCH_FILE = "launch.json"
CHECKPOINT_DIR = "checkpoint"
RESUME_STAGED_FILE = "resume.staged.json"
RESUME_HISTORY_FILE = "resume_history.jsonl"
DAMAGED_DIR = "damaged_checkpoints"
"""Where checkpoints found damaged in place when loaded are moved (`checkpoints.quarantine`):
outside CHECKPOINT_DIR, so that no scan for step-N directories there finds them."""
OVERWRITTEN_DIR = "overwritten"
RUN_FILES = (CONFIG_FILE, LAUNCH_FILE, CHECKPOINT_DIR, DAMAGED_DIR, "tb", "logs", "metrics.jsonl", "metrics.jsonl.truncated",
             STOPPED_FILE, "comm_traces", "pipeline", "optimizer_groups.txt", "report", "compare", "benchmarks",
             RESUME_STAGED_FILE, RESUME_HISTORY_FILE)
"""What a run writes into its directory, its lock aside: what `train --overwrite` moves away."""


def new_run_dir(config_name: str, job_id: str | None = None, root: Path = Path("runs")) -> Path:
    """A fresh directory name under `root`: <config>-<job id, else timestamp>."""
    return root / f"{config_name}-{job_id or time.strftime('%Y%m%d-%H%M%S')}"


def check_creatable(directory: Path, argument: str = "--run-dir") -> None:
    """UserError naming `argument` when `directory` cannot be a directory: it, or a folder above
    it, is a file."""
    for folder in (directory, *directory.parents):
        if folder.is_dir():
            return
        if folder.exists():
            raise UserError(f"{argument} {directory}: "
                            f"{'is a file; give a directory' if folder == directory else f'{folder} is a file, not a directory'}")


@contextmanager
def writing(argument: str, path: Path) -> Iterator[None]:
    """The block writes into `path`, which `argument` names: an OSError of the file system there
    (no permission, a file where a folder should be, a read-only or full file system) ends in
    one line naming `argument`, the file and the cause, instead of a traceback."""
    try:
        yield
    except OSError as err:
        raise UserError(f"{argument} {path}: cannot write there ({err.filename or path}: {err.strerror or err})") from None


def unreadable_checkpoint(checkpoint: Path, err: BaseException) -> UserError:
    """The one-line error for a checkpoint whose files DCP cannot read."""
    reason = str(err).strip().splitlines()[-1] if str(err).strip() else type(err).__name__
    return UserError(f"--checkpoint {checkpoint}: cannot read the checkpoint ({reason})")


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_launch(run_dir: Path, config_toml: str | None, nproc_per_node: int) -> None:
    """Store the resolved config (None: keep the stored one) and the launch settings; the run's
    `run_id` (what names its W&B runs) is made on the first launch and kept by later ones (`resume`)."""
    launch = run_dir / LAUNCH_FILE
    run_id = json.loads(launch.read_text()).get("run_id") if launch.is_file() else None
    with writing("--run-dir", run_dir):
        if config_toml is not None:
            write_atomic(run_dir / CONFIG_FILE, config_toml)
        write_atomic(launch, json.dumps({"nproc_per_node": nproc_per_node, "run_id": run_id or uuid.uuid4().hex[:16]}))


def record_world_size(run_dir: Path, world_size: int) -> None:
    """Remember how many processes trained the run (eval shards validation data the same way)."""
    launch = load_launch(run_dir)
    write_atomic(run_dir / LAUNCH_FILE, json.dumps({**launch, "world_size": world_size}))


def record_stop(run_dir: Path, step: int, reason: str) -> None:
    """Remember that the run stopped early at `step` ("signal" or "nonfinite"), with a checkpoint."""
    write_atomic(run_dir / STOPPED_FILE, json.dumps({"step": step, "reason": reason}))


def load_launch(run_dir: Path, argument: str = "--run-dir") -> dict:
    """The launch settings of an existing run; UserError naming `argument` if `run_dir` is not a
    run directory."""
    if not run_dir.is_dir():
        raise UserError(f"{argument} {run_dir}: {'is a file; give a directory' if run_dir.exists() else 'no such directory'}")
    if not (run_dir / CONFIG_FILE).is_file():
        raise UserError(f"{argument} {run_dir}: not a titan-async run directory (no {CONFIG_FILE})")
    launch = run_dir / LAUNCH_FILE
    return json.loads(launch.read_text()) if launch.is_file() else {"nproc_per_node": 1}


def clear_stop(run_dir: Path) -> None:
    with writing("--run-dir", run_dir):
        (run_dir / STOPPED_FILE).unlink(missing_ok=True)


def early_stop(run_dir: Path) -> dict | None:
    """{"step", "reason"} if the last launch stopped early, else None."""
    path = run_dir / STOPPED_FILE
    return json.loads(path.read_text()) if path.is_file() else None
