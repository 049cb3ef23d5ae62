"""Launching and recording the training runs of a study (tools/staleness_study.py, tools/tta_study.py).

A study describes each run as a `Job` (a `titan-async train` command line and its run directory);
`run_jobs` trains them, a few at a time, each with its console output in RUN.log, and
`run_recorded` records how: the command, the git revision and the machine's load;
`record_config` copies a run's resolved config into the study's output.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from titan_async.rundir.checkpoints import has_intact_checkpoint

ROOT = Path(__file__).resolve().parents[2]
"""The source checkout the studies run from (tools/ lives there)."""
STOPPED_BY_SIGNAL = 130
"""titan-async's exit status after a SIGTERM: it stopped every rank at the same step."""


@dataclass(frozen=True)
class Job:
    """One training run: `titan-async train --config CONFIG --run-dir RUN_DIR --overwrite --set ...`."""

    name: str
    run_dir: Path
    config: str
    settings: list[str]
    extra_args: list[str] = field(default_factory=list)
    resumable: bool = False
    """Whether a run stopped partway (a killed study) resumes from its latest intact checkpoint
    (`titan-async resume`) instead of starting over; its settings must save checkpoints."""

    def command(self) -> list[str]:
        command = [sys.executable, "-m", "titan_async.cli", "train", "--config", self.config, "--run-dir", str(self.run_dir),
                   "--overwrite", *self.extra_args]
        for setting in self.settings:
            command += ["--set", setting]
        return command

    def resumes(self) -> bool:
        """Whether `run_job` continues an earlier, unfinished run of this job."""
        return self.resumable and has_intact_checkpoint(self.run_dir)

    def resume_command(self) -> list[str]:
        return [sys.executable, "-m", "titan_async.cli", "resume", "--run-dir", str(self.run_dir), *self.extra_args]


def run_job(job: Job, sharing: int = 1, budget_s: float | None = None) -> float:
    """Train `job` into its run directory (replacing an earlier run there, unless the job
    `resumes` it); return wall seconds.
    `sharing` runs share the machine at once: each is told so through LOCAL_WORLD_SIZE, from which
    titan-async sizes its intra-op thread pool (cores // LOCAL_WORLD_SIZE) in a one-process run.
    After `budget_s` seconds the run gets a SIGTERM and stops at the next step, which keeps what it
    logged. Console output goes to RUN_DIR.log; raises RuntimeError with its tail on failure."""
    resumes = job.resumes()
    if not resumes:
        if job.run_dir.exists():
            shutil.rmtree(job.run_dir)
        job.run_dir.mkdir(parents=True)
    log_file = job.run_dir.with_name(f"{job.run_dir.name}.log")  # not with_suffix: "lr0.003" has a "suffix"
    env = {**os.environ, "LOCAL_WORLD_SIZE": str(sharing)}
    start = time.perf_counter()
    with open(log_file, "a" if resumes else "w") as log:
        command = job.resume_command() if resumes else job.command()
        process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            status, allowed = process.wait(timeout=budget_s), {0}
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGTERM)
            status, allowed = process.wait(), {0, STOPPED_BY_SIGNAL}
    if status not in allowed:
        tail = "\n".join(log_file.read_text().splitlines()[-20:])
        raise RuntimeError(f"{job.name} failed with exit status {status} (log: {log_file}):\n{tail}")
    return time.perf_counter() - start


def run_jobs(jobs: list[Job], parallel: int = 1, budget_s: float | None = None) -> list[float]:
    """Run the jobs, `parallel` at a time in list order; wall seconds of each, in the same order."""

    def one(job: Job) -> float:
        wall = run_job(job, parallel, budget_s)
        print(f"  {job.name}: {wall:.0f} s, load average {os.getloadavg()[0]:.1f}", flush=True)
        return wall

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        return list(pool.map(one, jobs))


def git_state() -> str:
    """`git rev-parse HEAD`, plus the tracked files with uncommitted changes, if any."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT, capture_output=True, text=True, check=True)
    dirty = [line[3:] for line in status.stdout.splitlines()]
    return head + (f" with uncommitted changes to: {', '.join(dirty)}" if dirty else "")


def run_recorded(script: str, argv: list[str], jobs: list[Job], parallel: int = 1, budget_s: float | None = None) -> tuple[list[float], str]:
    """`run_jobs`, and a markdown line recording the invocation: `script ARGV`, the git revision,
    what it trained in how long, and the 1-minute load average before and after."""
    revision, load_before, start = git_state(), os.getloadavg(), time.perf_counter()
    walls = run_jobs(jobs, parallel, budget_s)
    command = shlex.join([".venv/bin/python", script, *argv])
    line = (f"- `{command}` (from the repository root) at git revision `{revision}`: trained "
            f"{', '.join(job.name for job in jobs) or 'nothing'} in {time.perf_counter() - start:.0f} s, {parallel} at a time; "
            f"1-minute load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after "
            f"({os.cpu_count()} cores, shared with other work)")
    return walls, line


RESOLVED_FROM = re.compile(r"^# resolved from (.+)$", re.MULTILINE)
"""The header line of a run's config.toml naming the config it was resolved from."""


def record_config(run_dir: Path, destination: Path) -> None:
    """Copy `run_dir`'s resolved config.toml to `destination`, its source config named relative to
    the repository (ROOT) when it lies there: a recorded config carries no path of the machine
    that ran it (a source outside the repository keeps its path)."""
    text = (run_dir / "config.toml").read_text()
    destination.write_text(RESOLVED_FROM.sub(lambda m: f"# resolved from {repository_path(m.group(1))}", text, count=1))


def repository_path(path: str) -> str:
    """`path` relative to the repository (ROOT) when it lies inside it, else unchanged."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path
