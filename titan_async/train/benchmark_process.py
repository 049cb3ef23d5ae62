"""One benchmark evaluation during training: `titan-async eval --tasks ... --json` on a saved
checkpoint, in a process of its own on `[eval] device`, its output in RUN/logs/eval-step-N.log."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
"""What makes a process a worker of this job; the evaluation process runs on its own."""


def _warn(message: str) -> None:
    logging.getLogger("titan_async").warning(message)


def evaluate(checkpoint: Path, step: int, section, device: str, log_path: Path) -> dict | None:
    """The "tasks" results of `eval --tasks` (`section`: the [eval] section) on the finished save
    `checkpoint` of `step`, run on the torch `device` (a CPU evaluation sees no GPU); None, with a
    one-line warning, when the checkpoint is gone (DCP writes .metadata last) or the evaluation failed."""
    if not (checkpoint / ".metadata").is_file():
        _warn(f"the benchmark of step {step} is skipped: its checkpoint {checkpoint} is gone")
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
