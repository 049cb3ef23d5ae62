"""One benchmark evaluation during training: `titan-async eval --tasks ... --json` on a saved
checkpoint, in a process of its own on `[eval] device`, its output in RUN/logs/eval-step-N.log.

It starts once every rank has recorded the checksums of the files it wrote (its manifest, written
after the save by `rundir.after_save`; the evaluation verifies the files it reads against them),
waiting at most `CHECKSUMS_TIMEOUT_S`: past that the benchmark fails with one line, a warning and
the "failure" of RUN/benchmarks/step-N.json (`rundir.benchmarks.save_failure`)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from titan_async.rundir.benchmarks import save_failure
from titan_async.rundir.checksums import manifest_name

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
"""What makes a process a worker of this job; the evaluation process runs on its own."""
CHECKSUMS_TIMEOUT_S = 1800.0
"""How long a benchmark waits, after the save, for every rank's checksums of the checkpoint."""


def _warn(message: str) -> None:
    logging.getLogger("titan_async").warning(message)


def unrecorded_ranks(checkpoint: Path, ranks: int, timeout_s: float) -> list[int]:
    """The ranks of `ranks` whose checksum manifest `checkpoint` still lacks after waiting up to
    `timeout_s` seconds for them (polled; empty once all are there, or at once if the checkpoint is gone)."""
    deadline = time.monotonic() + timeout_s
    while True:
        missing = [rank for rank in range(ranks) if not (checkpoint / manifest_name(rank)).is_file()]
        if not missing or not checkpoint.is_dir() or time.monotonic() >= deadline:
            return missing
        time.sleep(0.2)


def evaluate(checkpoint: Path, step: int, section, device: str, log_path: Path, ranks: int,
             timeout_s: float = CHECKSUMS_TIMEOUT_S) -> dict | None:
    """The "tasks" results of `eval --tasks` (`section`: the [eval] section) on the finished save
    `checkpoint` of `step` by `ranks` ranks, once each has recorded its checksums (waiting up to
    `timeout_s`), run on the torch `device` (a CPU evaluation sees no GPU); None, with a one-line
    warning, when the checkpoint is gone (DCP writes .metadata last), its checksums did not come
    (also recorded as the step's benchmark failure) or the evaluation failed."""
    missing = unrecorded_ranks(checkpoint, ranks, timeout_s)
    if not (checkpoint / ".metadata").is_file():
        _warn(f"the benchmark of step {step} is skipped: its checkpoint {checkpoint} is gone")
        return None
    if missing:
        reason = (f"the benchmark of step {step} failed: rank(s) {', '.join(map(str, missing))} did not record their checksums "
                  f"of {checkpoint} ({manifest_name(missing[0])}) within {timeout_s:g} s")
        _warn(reason)
        save_failure(checkpoint.parent.parent, step, checkpoint, reason)
        return None
    command = [sys.executable, "-m", "titan_async.cli", "eval", "--checkpoint", str(checkpoint), "--tasks",
               ",".join(section.tasks), "--batch-size", str(section.batch_size), "--device", device, "--json"]
    command += ["--limit", str(section.limit)] if section.limit else []
    command += ["--num-fewshot", str(section.num_fewshot)] if section.num_fewshot is not None else []
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    result = subprocess.run(command, capture_output=True, text=True, env=env)
    log_path.write_text(result.stdout + result.stderr)
    printed = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not printed:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        _warn(f"the benchmark of step {step} failed (exit {result.returncode}): {last}; log: {log_path}")
        return None
    return json.loads(printed[-1])["tasks"]
