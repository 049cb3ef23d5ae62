"""The memory check of a launch: `cluster.fits.check_fits` for this process's workers, as the
launcher (or a worker no launcher checked) sees them."""

from __future__ import annotations

import os

from titan_async.cluster.fits import check_fits
from titan_async.config.run_config import RunConfig
from titan_async.core import platform
from titan_async.run import process


def check_launch(run: RunConfig, nproc: int, skip: bool = False) -> None:
    """The check of `train` and `resume` before they launch `nproc` local workers (under an
    external launcher: this worker), and of a worker no launcher checked (`process.MEMORY_CHECKED_ENV` unset).
    Not after a restart by torch's elastic agent: the run started once, and its failed
    workers' memory may not be free yet. Marks the workers this process starts as checked."""
    if not skip and not process.restart_count():
        check_fits(run, process.world_size(nproc), nproc, process.launched_externally(), platform.is_cpu())
    os.environ[process.MEMORY_CHECKED_ENV] = "1"
