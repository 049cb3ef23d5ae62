"""Pipeline scalars of each stage, written by one rank per stage.

The stage's first rank writes them: the first of its data- and tensor-parallel ranks. pp is the
outermost dimension of torchtitan's mesh, so stage s holds ranks [s * n, (s + 1) * n) with
n = world / pp and rank s * n writes stage s; without a pipeline, or with emulated stages (pp = 1),
rank 0 writes "stage 0". Scalars that differ between the ranks of a stage (memory, FSDP bytes) are
that rank's own. At 512 ranks this keeps the run directory and W&B at one writer per stage, and a
step costs each writer one append: the folder is created and the file opened once.
"""

from __future__ import annotations

import json
from pathlib import Path

from titan_async.rundir.jsonl import set_aside_cut_line
from titan_async.train.wandb_runs import stage_run


def written_stage(rank: int, world: int, pp: int) -> int | None:
    """The stage whose scalars `rank` writes; None for the other ranks of a stage."""
    n = world // pp
    return rank // n if rank % n == 0 else None


class StageRecords:
    """One stage's scalars: appended to RUN/pipeline/stage<s>.jsonl (line-buffered, so flushed at
    each step), written to TensorBoard under tb/pipeline/stage<s> (`metrics.enable_tensorboard`)
    and to the stage's W&B run (`metrics.enable_wandb` and `metrics.wandb_rank_runs`)."""

    def __init__(self, run_dir: Path, stage: int, metrics) -> None:
        folder = run_dir / "pipeline"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"stage{stage}.jsonl"
        set_aside_cut_line(path)  # a row a killed run left cut short would swallow the next one
        self.file = open(path, "a", buffering=1)
        tb_folder = run_dir / "tb" / "pipeline" / f"stage{stage}"
        self.tensorboard = None
        if metrics.enable_tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tensorboard = SummaryWriter(tb_folder)
        self.wandb = stage_run(run_dir, stage, metrics, tb_folder) if metrics.enable_wandb and metrics.wandb_rank_runs else None

    def write(self, record: dict) -> None:
        """Append `record` (with "step") as one JSON line; its numbers other than step, time and
        rank also go to TensorBoard and W&B as pipeline/<key>."""
        self.file.write(json.dumps(record) + "\n")
        scalars = {f"pipeline/{key}": value for key, value in record.items()
                   if key not in ("step", "time", "rank") and value is not None}
        if self.tensorboard is not None:
            for key, value in scalars.items():
                self.tensorboard.add_scalar(key, value, record["step"])
        if self.wandb is not None:
            self.wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        self.file.close()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
