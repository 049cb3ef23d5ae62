"""Benchmarks during training (`[eval]`): lm-evaluation-harness tasks on the run's own checkpoints.

After the save of every `eval.freq`-th step the reporting rank (the one that writes
metrics.jsonl) runs `titan-async eval --checkpoint RUN/checkpoint/step-N --tasks ... --json` in a
background process, one checkpoint at a time, while training goes on: the checkpoint is the
drained stream's weights (every schedule drains before a save), and no pipeline stage waits for
the evaluation. A finished evaluation is logged at the next step, under its own step: metrics.jsonl
rows of kind "benchmark" and TensorBoard scalars `benchmark/<task>/<metric>`; the results also go
to RUN/benchmarks/step-N.json, which `report` and `compare` show. At the end of training the
reporting rank waits for the evaluations still running. A failed evaluation is a warning naming
its log (RUN/logs/eval-step-N.log); training does not stop for it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_async.rundir import directory as runs

LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID")
"""What makes a process a worker of this job; the evaluation process runs on its own."""
SAVE_WAIT_S = 3600
"""How long an evaluation waits for its checkpoint's save to finish."""


@dataclass(kw_only=True, slots=True)
class EvalSection:
    """Benchmarks of the run's checkpoints during training (lm-evaluation-harness, the extra `eval`)."""

    tasks: list[str] = field(default_factory=list)
    """Task names or task YAML files, as `titan-async eval --tasks` takes them; empty: no benchmarks."""
    freq: int | None = None
    """Evaluate the checkpoint of every step that is a multiple of this; a multiple of checkpoint.interval (default: it)."""
    limit: int | None = None
    """The first N examples of each task (default: all)."""
    num_fewshot: int | None = None
    """Examples in each prompt (default: each task's own)."""
    batch_size: int = 8
    """Sequences per forward of the evaluation."""

    def check(self, checkpoint, model) -> str | None:
        """What stops these benchmarks from running with `checkpoint` (torchtitan's checkpoint
        config) and `model` (the [model] section), as a message naming the key, or None."""
        if not self.tasks:
            return None
        if importlib.util.find_spec("lm_eval") is None:
            return "eval.tasks needs the optional extra `eval` (lm_eval is not installed): pip install 'titan-async[eval]'"
        for task in self.tasks:
            if task.endswith((".yaml", ".yml")) and not Path(task).is_file():
                return f"eval.tasks: no such task file {task}"
        if model.family == "qwen3_moe" and model.load_balance_coeff:
            return ("eval.tasks: benchmarks run on the Hugging Face conversion, and transformers' Qwen3-MoE routes "
                    "without expert biases; set model.load_balance_coeff = 0")
        if not checkpoint.enable:
            return "eval.tasks evaluates the run's checkpoints; set checkpoint.enable = true"
        freq = self.freq or checkpoint.interval
        if freq % checkpoint.interval:
            return (f"eval.freq ({freq}) must be a multiple of checkpoint.interval ({checkpoint.interval}): "
                    "each evaluation reads the checkpoint of its step")
        if self.num_fewshot is not None and self.num_fewshot < 0:
            return f"eval.num_fewshot: expected 0 or more, got {self.num_fewshot}"
        return None


class PeriodicBenchmarks:
    """Evaluates checkpoints in a background process, in save order, and hands finished results
    to `log(metrics, step)` when `log_finished` or `finish` is called (from the training loop)."""

    def __init__(self, section: EvalSection, checkpoint_interval: int, run_dir: Path,
                 log: Callable[[dict[str, Any], int], None]) -> None:
        self.section = section
        self.freq = section.freq or checkpoint_interval
        self.run_dir = run_dir
        self.log = log
        self.pending: queue.Queue[int | None] = queue.Queue()
        self.finished: queue.Queue[tuple[int, dict | None]] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.evaluated: set[int] = set()

    def after_save(self, step: int) -> None:
        """Queue the checkpoint of `step` (just saved) if it is a benchmark step."""
        if step % self.freq or step in self.evaluated:
            return
        self.evaluated.add(step)
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="benchmarks", daemon=True)
            self.thread.start()
        self.pending.put(step)

    def log_finished(self) -> None:
        """Log the results of the evaluations finished since the last call."""
        while not self.finished.empty():
            step, tasks = self.finished.get_nowait()
            if tasks:
                self.log(benchmark_scalars(tasks), step)

    def finish(self) -> None:
        """Wait for the evaluations still queued or running, and log them."""
        if self.thread is not None:
            logging.getLogger("titan_async").warning("training done; waiting for the benchmark evaluations still running")
            self.pending.put(None)
            self.thread.join()
            self.thread = None
        self.log_finished()

    def _work(self) -> None:
        while (step := self.pending.get()) is not None:
            self.finished.put((step, self._evaluate(step)))

    def _evaluate(self, step: int) -> dict | None:
        """`titan-async eval --tasks` on the checkpoint of `step` once its save has finished (DCP
        writes .metadata last; asynchronous checkpointing writes after `save` returns): its
        "tasks" results, or None."""
        checkpoint = self.run_dir / runs.CHECKPOINT_DIR / f"step-{step}"
        deadline = time.monotonic() + SAVE_WAIT_S
        while not (checkpoint / ".metadata").is_file() and time.monotonic() < deadline:
            time.sleep(1)
        s = self.section
        command = [sys.executable, "-m", "titan_async.cli", "eval", "--checkpoint", str(checkpoint),
                   "--tasks", ",".join(s.tasks), "--batch-size", str(s.batch_size), "--json"]
        command += ["--limit", str(s.limit)] if s.limit else []
        command += ["--num-fewshot", str(s.num_fewshot)] if s.num_fewshot is not None else []
        env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
        result = subprocess.run(command, capture_output=True, text=True, env=env)
        log_path = self.run_dir / "logs" / f"eval-step-{step}.log"
        log_path.write_text(result.stdout + result.stderr)
        printed = [line for line in result.stdout.splitlines() if line.startswith("{")]
        if result.returncode != 0 or not printed:
            last = (result.stderr.strip().splitlines() or ["no output"])[-1]
            logging.getLogger("titan_async").warning(
                f"the benchmark of step {step} failed (exit {result.returncode}): {last}; log: {log_path}")
            return None
        return json.loads(printed[-1])["tasks"]


def benchmark_scalars(tasks: dict[str, dict]) -> dict[str, float]:
    """Task name -> result (as `eval --tasks --json` prints it) as scalars `benchmark/<task>/<metric>`."""
    return {f"benchmark/{name}/{metric}": value for name, result in tasks.items()
            for metric, value in result["metrics"].items() if value is not None}
