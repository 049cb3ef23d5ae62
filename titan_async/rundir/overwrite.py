"""Replacing a run in its directory without losing it: `train --overwrite` moves the old run's
files to RUN/overwritten/, where they stay until the new run has an intact checkpoint.

Invariant: at every moment, including after a crash at any point, the old run's files are
whole in exactly one place: RUN/ itself, RUN/overwritten.partial/ together with RUN/ (a move
under way, undone by the next claim), or RUN/overwritten/.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from titan_async.core.errors import UserError
from titan_async.rundir.checkpoints import has_intact_checkpoint
from titan_async.rundir.directory import CHECKPOINT_DIR, DAMAGED_DIR, OVERWRITTEN_DIR, RUN_FILES

_PARTIAL = OVERWRITTEN_DIR + ".partial"


def _holds_checkpoints(run_dir: Path) -> bool:
    """Whether `run_dir` holds checkpoints, intact or moved aside as damaged."""
    return any((run_dir / name).is_dir() and any((run_dir / name).iterdir()) for name in (CHECKPOINT_DIR, DAMAGED_DIR))


def _undo_interrupted_move(run_dir: Path) -> None:
    partial = run_dir / _PARTIAL
    if partial.is_dir():
        for path in partial.iterdir():
            os.replace(path, run_dir / path.name)
        partial.rmdir()


def release_overwritten(run_dir: Path) -> bool:
    """Delete RUN/overwritten/ once the run in `run_dir` has an intact checkpoint; True if it did."""
    aside = run_dir / OVERWRITTEN_DIR
    if not aside.is_dir() or not has_intact_checkpoint(run_dir):
        return False
    shutil.rmtree(aside)
    return True


def claim(run_dir: Path, overwrite: bool) -> Path | None:
    """Make `run_dir` ready for a new run; returns RUN/overwritten/ while it holds a replaced run.

    A run's checkpoints are replaced only with `overwrite` (UserError otherwise); its files then
    move to RUN/overwritten/. If that already holds a run (the previous overwrite's run has no
    intact checkpoint yet), it stays, and the checkpoint-less files beside it are discarded.
    Files that are not a run's (`RUN_FILES`) are never touched.
    """
    _undo_interrupted_move(run_dir)
    if _holds_checkpoints(run_dir) and not overwrite:
        raise UserError(
            f"--run-dir {run_dir}: already holds checkpoints; continue it with "
            f"`titan-async resume --run-dir {run_dir}` or pass --overwrite to replace them"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    release_overwritten(run_dir)
    aside = run_dir / OVERWRITTEN_DIR
    present = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
    if overwrite and present:
        if aside.is_dir():
            for path in present:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        else:
            partial = run_dir / _PARTIAL
            partial.mkdir()
            for path in present:
                os.replace(path, partial / path.name)
            os.replace(partial, aside)
    return aside if aside.is_dir() else None
