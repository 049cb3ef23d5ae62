"""Checkpoints that `checkpoint.keep_latest_k` keeps while a benchmark evaluation reads them.

An evaluation pins RUN/checkpoint/step-N with the file RUN/checkpoint/pins/step-N (naming the
pinning process) and releases it when done. The purge (`hand_over`, asked by rank 0 for each
stale checkpoint) leaves a pinned checkpoint and hands its deletion to the evaluation by renaming
its pin to step-N.purge; releasing a handed-over pin deletes the checkpoint. That one rename
decides which side deletes, on one node or across nodes sharing the file system. A run's start
removes the pins of earlier launches (`clear`), so an evaluation that crashed with its run pins
nothing beyond that run.
"""

from __future__ import annotations

import os
import shutil
import socket
from pathlib import Path

PINS_DIR = "pins"
HANDED_OVER = ".purge"


def _pin(checkpoint: Path) -> Path:
    return checkpoint.parent / PINS_DIR / checkpoint.name


def _handed_over(checkpoint: Path) -> Path:
    return checkpoint.parent / PINS_DIR / (checkpoint.name + HANDED_OVER)


def pin(checkpoint: Path) -> None:
    """Keep `checkpoint` from the purge until `release`."""
    path = _pin(checkpoint)
    path.parent.mkdir(exist_ok=True)
    path.write_text(f"pid {os.getpid()} on {socket.gethostname()}\n")


def release(checkpoint: Path) -> None:
    """Unpin `checkpoint`; delete it if the purge handed it over meanwhile."""
    try:
        _pin(checkpoint).unlink()
        return
    except FileNotFoundError:
        pass
    if _handed_over(checkpoint).exists():
        shutil.rmtree(checkpoint, ignore_errors=True)
        _handed_over(checkpoint).unlink(missing_ok=True)


def hand_over(checkpoint: Path) -> bool:
    """For the purge of the stale `checkpoint`: True if it is pinned, its deletion now left to
    `release`; False if the purge may delete it."""
    if _handed_over(checkpoint).exists():
        return True
    try:
        os.rename(_pin(checkpoint), _handed_over(checkpoint))
    except FileNotFoundError:
        return False
    return True


def clear(checkpoint_folder: Path) -> None:
    """Remove every pin of the run whose checkpoints are in `checkpoint_folder` (at its start:
    no evaluation of this launch has pinned one yet)."""
    shutil.rmtree(checkpoint_folder / PINS_DIR, ignore_errors=True)
