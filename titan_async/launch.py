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


def restart_count() -> int:
    """How many times torch's elastic agent has restarted this worker (0 on the first attempt)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def exit_with_parent() -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere nothing), so
    that killing a launcher ends its whole run instead of leaving workers behind."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call
        os._exit(1)


def run(run_dir: Path, nproc_per_node: int, verbose: bool, run_config=None, max_restarts: int = 0) -> int:
    """Train the run in `run_dir` on this node; returns the exit status.

    Under an external launcher this process is one worker and trains `run_config`
    (every rank resolved it from the same command line) instead of re-reading the file, and
    restarts are that launcher's (torchrun --max-restarts). Otherwise, with
    `max_restarts` > 0, torch's elastic agent restarts every worker up to that many times
    after one fails, and each resumes from the run's latest intact checkpoint.
    """
    if launched_externally():
        print(describe_process(), flush=True)
        return worker.train(run_dir, verbose, run_config)
    if nproc_per_node == 1 and not max_restarts:
        become_single_process()
        return worker.train(run_dir, verbose)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone",
        f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}", "--tee=0",
        "-m", "titan_async.worker", str(run_dir),
    ] + (["--verbose"] if verbose else [])
    # Restarted workers would read the first attempt's gloo addresses from the agent's shared
    # store and fail to connect; with their own store each attempt starts clean.
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if max_restarts else None
    child = subprocess.Popen(command, env=env, preexec_fn=exit_with_parent)

    def forward(signum: int, frame) -> None:
        child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return child.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
