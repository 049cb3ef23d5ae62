"""What this process is within its job: started by torchrun or Slurm or by titan-async itself,
which rank and node, whether it writes the run directory or may use the CUDA runtime, and how
many restarts it has seen."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path


MEMORY_CHECKED_ENV = "TITAN_ASYNC_MEMORY_CHECKED"
"""Set once a launcher has checked its workers' memory (`titan_async.cluster.fits`), or
was told not to: the workers it starts, which inherit it, do not check again."""


def launched_externally() -> bool:
    """True when torchrun (or a Slurm/cluster launcher using its variables) started this process."""
    return "TORCHELASTIC_RUN_ID" in os.environ or {"RANK", "WORLD_SIZE", "MASTER_ADDR"} <= os.environ.keys()


def may_use_cuda_runtime() -> bool:
    """Whether this process may call the CUDA runtime: a worker may (started by torchrun, Slurm
    or the launcher, or the launcher once it trains as the only worker: `become_single_process`),
    and so may any process on a machine without CUDA. Any other process may be a launcher that
    forks its workers later, which could not use CUDA after such a call
    (`titan_async.core.platform.fork_keeps_cuda`)."""
    from titan_async.core import platform

    return platform.is_cpu() or launched_externally()


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


def name_worker() -> None:
    """Name this process "titan-async rN" after its rank (Linux; `ps -o comm` and `top` show it),
    since workers forked from the launcher share its command line."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    pr_set_name = 15
    ctypes.CDLL(None).prctl(pr_set_name, f"titan-async r{os.environ.get('RANK', '0')}".encode()[:15])


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc; elsewhere none)."""
    found = []
    for entry in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = entry.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry.parent.name))
    return found
