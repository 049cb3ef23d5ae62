"""Config functions for torchtitan's entry point (`--module titan_async.native --config NAME`).

Each returns titan-async's trainer config (`AsyncTrainer.Config`) for a shipped TOML config, as
`titan-async train --config <that file>` would build it, with titan-async's schedules (PipeDream2BW,
PACI) and optimizers registered; torchtitan's flags then override its fields (`--training.steps 5`,
`--dump_folder D`). The world size is torchrun's. What `titan-async train` adds around the trainer
is not done here: the run directory's config.toml and launch.json, checkpoint checksums, the
`--overwrite` and resume checks.
"""

from __future__ import annotations

import os
from pathlib import Path

from titan_async.config.assemble import trainer_config
from titan_async.config.run_config import load_run_config
from titan_async.config.shipped import shipped_configs
from titan_async.train.trainer import AsyncTrainer


def from_shipped(name: str) -> AsyncTrainer.Config:
    """The trainer config of train_configs/`name`.toml on torchrun's world size, writing under
    ./outputs/`name` unless `--dump_folder` says otherwise."""
    run = load_run_config(shipped_configs() / f"{name}.toml")
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    run.check(world_size)
    return trainer_config(run, Path("outputs") / name, world_size)


def pipedream_2bw() -> AsyncTrainer.Config:
    """PipeDream-2BW on 2 pipeline stages, Muon + error feedback, CPU-sized (debug_cpu_pp2_2bw)."""
    return from_shipped("debug_cpu_pp2_2bw")


def paci() -> AsyncTrainer.Config:
    """PACI on 2 pipeline stages, CPU-sized (debug_cpu_pp2_paci)."""
    return from_shipped("debug_cpu_pp2_paci")
