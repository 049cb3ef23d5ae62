"""Weights & Biases for a run (`metrics.enable_wandb`): torchtitan's W&B logger takes the run's
scalars on the reporting rank (the run "<run dir name>", the job's one run by default), and with
`metrics.wandb_rank_runs` each pipeline stage's writing rank (`stage_records`) logs the stage's
scalars (bubble, staleness, collective bytes, memory) to a run of its own, "<run dir name> stage S",
in the same group: W&B wants each run's steps in increasing order, and stages reach a step at
different times.

The ids derive from the run directory's `run_id` (launch.json), which `resume` keeps, so a resumed
run appends to the same W&B runs (resume="allow"); `train --overwrite` starts new ones. Offline
mode (`metrics.wandb_mode = "offline"`) writes each run under its TensorBoard folder
(`wandb/offline-run-*`), for `wandb sync`.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_async.rundir import directory as runs


def configure_main_run(run_dir: Path, config) -> None:
    """Set the environment torchtitan's `WandBLogger` reads; call before the logger is built."""
    run_id = runs.load_launch(run_dir)["run_id"]
    os.environ.update(
        WANDB_PROJECT=config.wandb_project, WANDB_RUN_NAME=run_dir.name, WANDB_RUN_ID=run_id,
        WANDB_RUN_GROUP=run_id, WANDB_RESUME="allow", WANDB_MODE=config.wandb_mode,
    )
    if config.wandb_entity:
        os.environ["WANDB_TEAM"] = config.wandb_entity


def stage_run(run_dir: Path, stage: int, config, folder: Path):
    """Stage `stage`'s W&B run (created, or resumed under the same id), writing under `folder`."""
    import wandb

    run_id = runs.load_launch(run_dir)["run_id"]
    folder.mkdir(parents=True, exist_ok=True)
    return wandb.init(
        project=config.wandb_project, entity=config.wandb_entity, id=f"{run_id}-stage{stage}",
        name=f"{run_dir.name} stage {stage}", group=run_id, job_type="stage", dir=str(folder),
        resume="allow", mode=config.wandb_mode, reinit="create_new", settings=wandb.Settings(quiet=True),
    )
