"""Where the shipped configs are: train_configs/ of a source checkout, or its copy installed in the package."""

from __future__ import annotations

from importlib import resources
from pathlib import Path


def shipped_configs() -> Path:
    """The folder of the shipped TOML configs."""
    checkout = Path(__file__).resolve().parents[2] / "train_configs"
    return checkout if checkout.is_dir() else Path(str(resources.files("titan_async") / "train_configs"))
