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


def is_coordinator() -> bool:
    """True in the process that writes the run directory's files (the launcher, or rank 0)."""
    return not launched_externally() or os.environ.get("RANK") == "0"


def job_id() -> str | None:
    """An id that every rank of an externally launched job shares."""
    return os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("SLURM_JOB_ID")


def describe_process() -> str:
    """Which worker this process is, from the torchrun / Slurm environment."""
    env = os.environ
    node = env.get("GROUP_RANK") or env.get("SLURM_NODEID") or "0"
    return (
        f"rank {env.get('RANK', '0')}/{env.get('WORLD_SIZE', '1')} (local rank {env.get('LOCAL_RANK', '0')}) "
        f"on node {node} ({socket.gethostname()})"
    )


def local_workers() -> int:
    """Workers on this node: torchrun's LOCAL_WORLD_SIZE under an external launcher, else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if launched_externally() else 1


def world_size(nproc_per_node: int) -> int:
    """Processes that will run the job."""
    return int(os.environ["WORLD_SIZE"]) if launched_externally() else nproc_per_node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def become_single_process() -> None:
    """Set the environment torch.distributed needs for a job of one process."""
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
    )


def run(run_dir: Path, nproc_per_node: int, verbose: bool, run_config=None) -> int:
    """Train the run in `run_dir` on this node; returns the exit status.

    Under an external launcher this process is one worker and trains `run_config`
    (every rank resolved it from the same command line) instead of re-reading the file.
    """
    if launched_externally():
        print(describe_process(), flush=True)
        return worker.train(run_dir, verbose, run_config)
    if nproc_per_node == 1:
        become_single_process()
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
