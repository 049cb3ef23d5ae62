"""`titan-async eval`: a checkpoint's validation loss and a greedy sample (`loss`), or with
`--tasks` lm-evaluation-harness benchmarks (`tasks`, the optional extra `eval`, imported only
when asked for).
"""

from __future__ import annotations

from pathlib import Path

from titan_async.commands.evaluate.loss import evaluate_checkpoint
from titan_async.core.errors import UserError

__all__ = ["benchmark_checkpoint", "evaluate_checkpoint"]


def benchmark_checkpoint(checkpoint: Path, tasks: str, **options) -> int:
    """`eval --tasks`: lm-evaluation-harness on `checkpoint` (`tasks.evaluate_tasks`); UserError
    naming the optional extra `eval` when lm-eval or transformers is not installed."""
    try:
        from titan_async.commands.evaluate.tasks import evaluate_tasks
    except ModuleNotFoundError as err:
        if (err.name or "").partition(".")[0] not in ("lm_eval", "transformers"):
            raise
        raise UserError(f"--tasks: needs the optional extra `eval` ({err.name} is not installed): "
                        "pip install 'titan-async[eval]'") from None
    return evaluate_tasks(checkpoint, tasks, **options)
