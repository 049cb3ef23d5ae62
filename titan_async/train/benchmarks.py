"""Benchmarks during training (`[eval]`): lm-evaluation-harness tasks on the run's own checkpoints.

After the save of every `eval.freq`-th step the reporting rank (the one that writes
metrics.jsonl) pins the checkpoint (`rundir.pins`: `checkpoint.keep_latest_k` keeps it until the
evaluation has read it) and queues it; one background thread evaluates the queued checkpoints in
save order, one at a time, each in a process of its own on `eval.device`
(`benchmark_process`), while training goes on: the checkpoint is the drained stream's weights
(every schedule drains before a save), and no pipeline stage waits for the evaluation. An
evaluation starts once every rank has recorded the checksums of the files it saved, and verifies
the files it reads against them as it reads them (`benchmark_process`). At most
`eval.max_pending` checkpoints wait: a newer one pushes out the oldest waiting, with a one-line
warning naming its step. A finished evaluation is logged at the next step, under its own step:
metrics.jsonl rows of kind "benchmark" and TensorBoard scalars `benchmark/<task>/<metric>`; the
results also go to RUN/benchmarks/step-N.json, which `report` and `compare` show. At the end of
training the reporting rank waits for the evaluations still queued or running. A failed
evaluation is a warning naming its log (RUN/logs/eval-step-N.log); training does not stop for it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import importlib.util
import logging
import os
import queue
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from titan_async.rundir import directory as runs
from titan_async.rundir import pins
from titan_async.train.benchmark_process import evaluate
from titan_async.train.eval_device import DEVICE_PATTERN, eval_device, visible_gpus


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
    device: str = "cpu"
    """Where the evaluation runs: "cpu", or "cuda:N" a GPU of the reporting rank's node that no training rank uses."""
    max_pending: int = 1
    """Checkpoints that may wait while one is evaluated; a newer one skips the oldest waiting."""

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
        if not re.fullmatch(DEVICE_PATTERN, self.device):
            return f"eval.device = {self.device!r}: expected \"cpu\" or \"cuda:N\""
        if self.num_fewshot is not None and self.num_fewshot < 0:
            return f"eval.num_fewshot: expected 0 or more, got {self.num_fewshot}"
        return None


class PeriodicBenchmarks:
    """Evaluates checkpoints in a background thread (a bounded queue, in save order) and hands
    finished results to `log(metrics, step)` when `log_finished` or `finish` is called (from the
    training loop). Construction checks `section.device` on this node (UserError)."""

    def __init__(self, section: EvalSection, checkpoint_interval: int, run_dir: Path,
                 log: Callable[[dict[str, Any], int], None]) -> None:
        self.section = section
        self.freq = section.freq or checkpoint_interval
        self.run_dir = run_dir
        self.log = log
        self.device = eval_device(section.device, int(os.environ.get("LOCAL_WORLD_SIZE", "1")), visible_gpus())
        self.ranks = int(os.environ.get("WORLD_SIZE", "1"))
        """The ranks that save each checkpoint, each recording the checksums of its files."""
        self.waiting: collections.deque[int] = collections.deque()
        self.changed = threading.Condition()
        self.closing = False
        self.saving: list[concurrent.futures.Future] = []
        self.finished: queue.Queue[tuple[int, dict | None]] = queue.Queue()
        self.thread: threading.Thread | None = None
        self.evaluated: set[int] = set()

    def checkpoint(self, step: int) -> Path:
        return self.run_dir / runs.CHECKPOINT_DIR / f"step-{step}"

    def after_save(self, step: int, pending: concurrent.futures.Future | None = None) -> None:
        """Pin and queue the checkpoint of `step` (just saved; `pending`: its asynchronous write,
        queued once done) if it is a benchmark step."""
        if step % self.freq or step in self.evaluated:
            return
        self.evaluated.add(step)
        pins.pin(self.checkpoint(step))
        if self.thread is None:
            self.thread = threading.Thread(target=self._work, name="benchmarks", daemon=True)
            self.thread.start()
        if pending is not None and not pending.done():
            self.saving.append(pending)
            pending.add_done_callback(lambda future: self._queue(step))
        else:
            self._queue(step)

    def _queue(self, step: int) -> None:
        with self.changed:
            skipped = self.waiting.popleft() if len(self.waiting) >= self.section.max_pending else None
            self.waiting.append(step)
            self.changed.notify()
        if skipped is not None:
            pins.release(self.checkpoint(skipped))
            logging.getLogger("titan_async").warning(
                f"the benchmark of step {skipped} is skipped: the evaluations fall behind "
                f"(eval.max_pending = {self.section.max_pending} checkpoint(s) waiting); step {step} waits instead")

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
            concurrent.futures.wait(self.saving)
            with self.changed:
                self.closing = True
                self.changed.notify()
            self.thread.join()
            self.thread = None
        self.log_finished()

    def _next(self) -> int | None:
        """The oldest waiting step, waiting for one; None once closing with none left."""
        with self.changed:
            self.changed.wait_for(lambda: self.waiting or self.closing)
            return self.waiting.popleft() if self.waiting else None

    def _work(self) -> None:
        while (step := self._next()) is not None:
            checkpoint = self.checkpoint(step)
            try:
                tasks = evaluate(checkpoint, step, self.section, self.device, self.run_dir / "logs" / f"eval-step-{step}.log",
                                 self.ranks)
            finally:
                pins.release(checkpoint)
            self.finished.put((step, tasks))


def benchmark_scalars(tasks: dict[str, dict]) -> dict[str, float]:
    """Task name -> result (as `eval --tasks --json` prints it) as scalars `benchmark/<task>/<metric>`."""
    return {f"benchmark/{name}/{metric}": value for name, result in tasks.items()
            for metric, value in result["metrics"].items() if value is not None}
