"""Starting the worker processes of a run: in-process, through torch's elastic launcher,
or as one worker of a job that torchrun or Slurm already started."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from titan_async.run import worker
from titan_async.run.process import (
    become_single_process,
    children,
    describe_process,
    exit_with_parent,
    launched_externally,
)


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
    # A session of its own: a Ctrl-C in the terminal reaches this process only, which asks the
    # workers to stop; torch's agent would meet it with a traceback and a 30 s kill.
    agent = subprocess.Popen(command, env=env, preexec_fn=exit_with_parent, start_new_session=True)
    stop = GracefulStop(agent)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return ABORTED if stop.aborted else status


ABORTED = 130
"""Exit status of a run stopped by a signal (with a checkpoint, or aborted without one)."""


class GracefulStop:
    """Ctrl-C or SIGTERM on the launcher of a multi-process run. The first asks every worker to
    stop at the end of a step with a checkpoint; the second says that the stop is under way;
    the third aborts the run, losing the steps since its last checkpoint."""

    def __init__(self, agent: subprocess.Popen) -> None:
        self.agent = agent
        self.received = 0
        self.aborted = False

    def __call__(self, signum: int, frame) -> None:
        self.received += 1
        if self.received == 1:
            say("stopping: every rank finishes its step and saves a checkpoint (Ctrl-C twice more aborts without one)")
            for pid in children(self.agent.pid) or [self.agent.pid]:
                os.kill(pid, signal.SIGTERM)
        elif self.received == 2:
            say("a stop is under way: the checkpoint is being written; Ctrl-C once more aborts, losing the steps since the last checkpoint")
        else:
            say("aborted: the steps since the last checkpoint are lost")
            self.aborted = True
            self.agent.kill()  # its workers follow it (exit_with_parent)


def say(message: str) -> None:
    print(f"titan-async: {message}", file=sys.stderr, flush=True)
