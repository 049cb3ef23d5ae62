"""Starting the worker processes of a run: in-process, through torch's elastic launcher,
or as one worker of a job that torchrun or Slurm already started."""

from __future__ import annotations

import logging
import os
import signal
import sys
from pathlib import Path

from titan_async.core import platform
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
    agent = ForkedAgent(run_dir, nproc_per_node, verbose, max_restarts)
    stop = GracefulStop(agent)
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = agent.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return ABORTED if stop.aborted else status


class ForkedAgent:
    """torch's elastic agent (torchrun's `--standalone` configuration) in a forked child that
    forks the workers in turn (`start_method`), so that neither re-imports torch and torchtitan:
    this process has imported them to check the run, and each import costs seconds on a small
    machine. The agent itself never uses CUDA.

    The agent runs in a session of its own: a Ctrl-C in the terminal reaches this process only,
    which asks the workers to stop (`GracefulStop`); torch's agent would meet it with a
    traceback and a 30 s kill. The parent has run no parallel CPU kernel before the fork, so
    the workers' thread pools start fresh. Exit status: 0; 2 when the workers that failed all
    exited 2 (a UserError, said in one line); 1 when a worker failed otherwise (torchrun's), with
    one line naming the failed workers after their own errors. torch's own log lines about the
    workers (`AGENT_LOGGERS`) reach the console only with --verbose.
    """

    def __init__(self, run_dir: Path, nproc_per_node: int, verbose: bool, max_restarts: int) -> None:
        self.pid = os.fork()
        if self.pid == 0:
            status = 1
            try:
                os.setsid()
                exit_with_parent()
                status = _agent(run_dir, nproc_per_node, verbose, max_restarts)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)

    def wait(self) -> int:
        while True:
            try:
                return os.waitstatus_to_exitcode(os.waitpid(self.pid, 0)[1])
            except InterruptedError:
                continue

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)


def _agent(run_dir: Path, nproc_per_node: int, verbose: bool, max_restarts: int) -> int:
    """torchrun --standalone with forked workers; returns the agent's exit status."""
    import uuid

    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    if not verbose:
        quiet_agent_logs()
    no_restart_after_user_errors()

    args = torchrun.parse_args([  # the module named last is torchrun's required argument; the entrypoint below runs
        "--standalone", f"--nproc-per-node={nproc_per_node}", f"--max-restarts={max_restarts}",
        f"--start-method={start_method()}", "-m", "titan_async.run.worker",
    ])
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if max_restarts:
        # Restarted workers would read the first attempt's gloo addresses from the agent's
        # shared store and fail to connect; with their own store each attempt starts clean.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    config, _, _ = torchrun.config_from_args(args)
    try:
        elastic_launch(config=config, entrypoint=worker.run_worker)(str(run_dir), verbose)
    except ChildFailedError as failure:
        if all(process.exitcode == 2 for process in failure.failures.values()):
            return 2  # UserErrors: each failed worker has said why in one line
        say(failed_workers(failure.failures, run_dir))
        return 1
    return 0


AGENT_LOGGERS = ("torch.distributed.run", "torch.distributed.launcher", "torch.distributed.elastic", "torch.multiprocessing")
"""The loggers of torch's elastic agent: torchrun's OMP_NUM_THREADS notice, the workers it stops
after one failed, and each failure's exit code with the traceback of the agent's own wait."""


def quiet_agent_logs() -> None:
    """Keep `AGENT_LOGGERS` (and the loggers below them, which set their own levels) off the console.
    Called in the agent process: the workers it forks log through none of them."""
    below = [name for name in logging.Logger.manager.loggerDict if name.startswith(tuple(f"{n}." for n in AGENT_LOGGERS))]
    for name in {*AGENT_LOGGERS, *below}:
        logging.getLogger(name).setLevel(logging.CRITICAL)


def no_restart_after_user_errors() -> None:
    """torch's elastic agent restarts failed workers whatever failed them; workers that all exited
    2 said why in one line (a UserError: bad input, or no intact checkpoint left), which every
    restart would repeat, so such a failure uses up the restarts (as torch's agent does for a
    wedged worker). Called in the agent process, which runs nothing else."""
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    monitor = LocalElasticAgent._monitor_workers

    def monitor_workers(agent, worker_group):
        result = monitor(agent, worker_group)
        if result.is_failed() and result.failures and all(f.exitcode == 2 for f in result.failures.values()):
            agent._remaining_restarts = 0
        return result

    LocalElasticAgent._monitor_workers = monitor_workers


def failed_workers(failures: dict, run_dir: Path) -> str:
    """One line on the workers that failed otherwise than with a UserError (torch elastic's
    ProcessFailure by rank): the status each exited with, or the signal that killed it."""
    said = "; ".join(f"rank {rank} " + (f"was killed by {failure.signal_name()}" if failure.exitcode < 0
                                        else f"exited with status {failure.exitcode}")
                     for rank, failure in sorted(failures.items()))
    return f"the run failed: {said} (the workers' errors are above; each rank's log is in {run_dir / 'logs'})"


def start_method() -> str:
    """How the agent starts the workers: "fork" (no re-import of torch and torchtitan: seconds
    saved per start on a small machine), or "spawn" once this process has made a CUDA runtime
    call, after which forked workers could not use CUDA. The launcher's own checks ask NVML
    (`platform.cuda_visible`, float8's `platform.cuda_capability`) and torchao is imported with
    CUDA hidden (`platform.configure`), but a library may still reach the runtime, so the fork is
    tried rather than trusted."""
    if platform.fork_keeps_cuda():
        return "fork"
    say("this process has initialised CUDA, so the workers start by spawn (each imports torch and torchtitan again)")
    return "spawn"


ABORTED = 130
"""Exit status of a run stopped by a signal (with a checkpoint, or aborted without one)."""


class GracefulStop:
    """Ctrl-C or SIGTERM on the launcher of a multi-process run. The first asks every worker to
    stop at the end of a step with a checkpoint; the second says that the stop is under way;
    the third aborts the run, losing the steps since its last checkpoint."""

    def __init__(self, agent: ForkedAgent) -> None:
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
