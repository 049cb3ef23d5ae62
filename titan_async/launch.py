"""Starting the worker processes of a run: in-process, through torch's elastic launcher,
or as one worker of a job that torchrun or Slurm already started."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from titan_async import worker


def launched_externally() -> bool:
    """True when torchrun (or a Slurm/cluster launcher using its variables) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= os.environ.keys()


def world_size(nproc_per_node: int) -> int:
    """Processes that will run the job."""
    return int(os.environ["WORLD_SIZE"]) if launched_externally() else nproc_per_node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(run_dir: Path, nproc_per_node: int, verbose: bool) -> int:
    """Train the run in `run_dir` on this node; returns the exit status."""
    if launched_externally():
        return worker.train(run_dir, verbose)
    if nproc_per_node == 1:
        os.environ.update(
            RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
            MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        )
        return worker.train(run_dir, verbose)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc_per_node}", "--tee=0",
        "-m", "titan_async.worker", str(run_dir),
    ] + (["--verbose"] if verbose else [])
    child = subprocess.Popen(command)

    def forward(signum: int, frame) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
