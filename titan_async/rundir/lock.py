"""One run at a time per run directory: an exclusive flock on <run-dir>/run.lock.

The lock belongs to the open file, so the kernel releases it when the process holding it
exits, however it exits: a killed run never leaves the directory locked."""

from __future__ import annotations

import fcntl
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from titan_async.core.errors import UserError
from titan_async.rundir.directory import check_creatable, writing

LOCK_FILE = "run.lock"


@contextmanager
def run_dir_lock(run_dir: Path, argument: str = "--run-dir") -> Iterator[None]:
    """Hold `run_dir`'s lock (creating the directory) for the block; UserError naming `argument`
    if another run holds it, or the directory cannot be made or written. Child processes do not
    inherit the lock file."""
    check_creatable(run_dir, argument)
    with writing(argument, run_dir):
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run_dir / LOCK_FILE, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UserError(f"{argument} {run_dir}: in use by a running titan-async ({holder}); wait for it to end or stop it") from None
    with handle:
        handle.truncate(0)
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield
