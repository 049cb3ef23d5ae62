"""Starting the worker processes of a run: in-process, through torch's elastic launcher,
or as one worker of a job that torchrun or Slurm already started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from titan_async.run import worker
from titan_async.run.process import become_single_process, describe_process, exit_with_parent, launched_externally


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
        "-m", "titan_async.run.worker", str(run_dir),
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
