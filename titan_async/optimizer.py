"""The `[optimizer]` section, turned into torchtitan's optimizer container config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig


@dataclass(kw_only=True, slots=True)
class OptimizerSection:
    """Optimizer and its hyperparameters."""

    name: Literal["adamw"] = "adamw"
    """Optimizer for every parameter."""
    lr: float = 8e-4
    """Peak learning rate (the lr_scheduler scales it)."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """Kernel implementation of the update."""

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"optimizer.lr must be > 0, got {self.lr}")
        for key in ("beta1", "beta2"):
            if not 0 <= getattr(self, key) < 1:
                raise ValueError(f"optimizer.{key} must be in [0, 1), got {getattr(self, key)}")

    def container_config(self) -> OptimizersContainer.Config:
        """torchtitan's config: one AdamW group over all parameters."""
        group = ParamGroupConfig(
            pattern=r".*",
            optimizer_name="AdamW",
            optimizer_kwargs={
                "lr": self.lr,
                "betas": (self.beta1, self.beta2),
                "eps": self.eps,
                "weight_decay": self.weight_decay,
            },
        )
        return OptimizersContainer.Config(param_groups=[group], implementation=self.implementation)
