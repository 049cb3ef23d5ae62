"""What each rank does after each checkpoint save of a run: record the checksums of the files it
wrote, once they are written (`checksums`); and rank 0, which writes the run directory, also
deletes the run that `train --overwrite` replaced once this run has an intact checkpoint
(`overwrite`), and keeps `checkpoint.keep_latest_k` also after the final save (torchtitan skips
its purge there, leaving one checkpoint more than asked for). Rank 0's purge leaves the
checkpoints that benchmark evaluations have pinned to them (`pins`)."""

from __future__ import annotations

import logging
from pathlib import Path

from titan_async.rundir import directory as runs
from titan_async.rundir import pins
from titan_async.rundir.checkpoints import saved_checkpoints
from titan_async.rundir.checksums import ChecksumRecorder
from titan_async.rundir.overwrite import release_overwritten


class AfterSaves:
    """The after-save hook (`SaveHooks.after`) of rank `rank`, and on rank 0 its checkpointer's
    purge (`purge`); `finish` waits for the checksums still being computed."""

    def __init__(self, checkpointer, run_dir: Path, rank: int) -> None:
        self.checkpointer = checkpointer
        self.run_dir = run_dir
        self.rank = rank
        self.recorder = ChecksumRecorder(rank)
        if rank == 0:
            pins.clear(run_dir / runs.CHECKPOINT_DIR)
            checkpointer._purge_stale_checkpoints = self.purge

    def __call__(self, step: int, last_step: bool, saved: bool) -> None:
        if not saved:
            return
        checkpoint = self.run_dir / runs.CHECKPOINT_DIR / f"step-{step}"
        pending = getattr(self.checkpointer, "save_future", None)  # asynchronous modes write later
        if pending is not None and not pending.done():
            pending.add_done_callback(lambda future: self.recorder.start(checkpoint))
        else:
            self.recorder.start(checkpoint)
        if self.rank != 0:
            return
        if last_step:
            self.checkpointer._purge_stale_checkpoints()
        if (self.run_dir / runs.OVERWRITTEN_DIR).is_dir() and release_overwritten(self.run_dir):
            logging.getLogger("titan_async").info(f"deleted {self.run_dir / runs.OVERWRITTEN_DIR}: this run has an intact checkpoint")

    def purge(self) -> None:
        """torchtitan's purge (all but the latest `checkpoint.keep_latest_k` checkpoints, deleted
        on its purge thread), except that a pinned checkpoint is handed to its evaluation."""
        if not self.checkpointer._should_purge():
            return
        for _, checkpoint in saved_checkpoints(self.run_dir)[self.checkpointer.keep_latest_k:]:
            if not pins.hand_over(checkpoint):
                self.checkpointer.purge_queue.put(str(checkpoint))

    def finish(self) -> None:
        self.recorder.join()
