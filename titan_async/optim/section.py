"""The `[optimizer]` section, turned into torchtitan's optimizer container config."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Literal

from torchtitan.components.optimizer import OptimizersContainer
from torchtitan.components.optimizer.optimizer import ParamGroupConfig

from titan_async.optim.container import RoutedOptimizersContainer


@dataclass(kw_only=True, slots=True)
class MuonSection:
    """Muon for hidden matrices; embeddings, the output head, norms and biases get AdamW."""

    toml_subsection: ClassVar[bool] = True

    momentum: float = 0.95
    """Momentum of the gradient average that is orthogonalised."""
    nesterov: bool = True
    """Orthogonalise the Nesterov look-ahead instead of the momentum buffer."""
    ns_steps: int = 5
    """Newton-Schulz iterations."""
    ns_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """Precision of the Newton-Schulz iterations; auto: bfloat16 on CUDA, float32 elsewhere."""
    lr_scaling: Literal["match_rms_adamw", "original"] = "match_rms_adamw"
    """Per-matrix lr multiplier: match_rms_adamw = 0.2 sqrt(max(rows, cols)); original = sqrt(max(1, rows/cols))."""
    adamw_lr: float = 8e-4
    """Peak lr of the AdamW group (embeddings, output head, norms, biases)."""


@dataclass(kw_only=True, slots=True)
class ErrorFeedbackSection:
    """Error feedback for one-step-delayed updates: w -= u_t + c (u_t - u_{t-1})."""

    toml_subsection: ClassVar[bool] = True

    enabled: bool = False
    """Wrap the optimizer(s) in error feedback."""
    coefficient: float = 1.0
    """c in [0, 2]; 0 is the plain optimizer."""


ON_RESUME: dict[str, str | None] = {
    "optimizer.name": "the checkpoints hold that optimizer's state (AdamW's moments; with muon, Muon's momentum too)",
    "optimizer.lr": None,
    "optimizer.beta1": None,
    "optimizer.beta2": None,
    "optimizer.eps": None,
    "optimizer.weight_decay": None,
    "optimizer.implementation": None,
    "optimizer.muon.momentum": None,
    "optimizer.muon.nesterov": None,
    "optimizer.muon.ns_steps": None,
    "optimizer.muon.ns_dtype": None,
    "optimizer.muon.lr_scaling": None,
    "optimizer.muon.adamw_lr": None,
    "optimizer.error_feedback.enabled": "the checkpoints hold error feedback's previous updates, or none",
    "optimizer.error_feedback.coefficient": None,
}
"""Every [optimizer] key and what `resume --set` does with a new value: None, it applies from the
first resumed step (the param groups get their configured values back after the checkpoint load,
`train.checkpoint_state.configured_over_loaded`; the error-feedback coefficient is not
checkpointed); otherwise why resume refuses it (before launch, one line, exit status 2)."""


@dataclass(kw_only=True, slots=True)
class OptimizerSection:
    """Optimizer and its hyperparameters."""

    name: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW for every parameter; muon: Muon for hidden matrices, AdamW for the rest."""
    lr: float = 8e-4
    """Peak learning rate (the lr_scheduler scales it); with muon, the Muon lr."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    eps: float = 1e-8
    """AdamW denominator epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay (AdamW and Muon)."""
    implementation: Literal["fused", "foreach", "for-loop"] = "fused"
    """Kernel implementation of the AdamW update."""
    muon: MuonSection = field(default_factory=MuonSection)
    error_feedback: ErrorFeedbackSection = field(default_factory=ErrorFeedbackSection)

    def __post_init__(self) -> None:
        if self.name != "muon" and self.muon != MuonSection():
            raise ValueError(f'optimizer.muon is only used when optimizer.name = "muon" (it is "{self.name}")')

    def _adamw_kwargs(self, lr: float) -> dict[str, object]:
        return {"lr": lr, "betas": (self.beta1, self.beta2), "eps": self.eps, "weight_decay": self.weight_decay}

    def container_config(self, delay: int = 1) -> OptimizersContainer.Config:
        """torchtitan's plain config for AdamW alone (one group over all parameters), else the
        RoutedOptimizersContainer config for Muon and/or error feedback (its correction scaled
        by the gradients' `delay` in steps)."""
        if self.name == "adamw" and not self.error_feedback.enabled:
            group = ParamGroupConfig(pattern=r".*", optimizer_name="AdamW", optimizer_kwargs=self._adamw_kwargs(self.lr))
            return OptimizersContainer.Config(param_groups=[group], implementation=self.implementation)
        muon_kwargs = None
        if self.name == "muon":
            muon_kwargs = {
                "lr": self.lr,
                "momentum": self.muon.momentum,
                "nesterov": self.muon.nesterov,
                "weight_decay": self.weight_decay,
                "ns_steps": self.muon.ns_steps,
                "ns_dtype": self.muon.ns_dtype,
                "lr_scaling": self.muon.lr_scaling,
            }
        return RoutedOptimizersContainer.Config(
            implementation=self.implementation,
            adamw_kwargs=self._adamw_kwargs(self.muon.adamw_lr if self.name == "muon" else self.lr),
            muon_kwargs=muon_kwargs,
            error_feedback_coefficient=self.error_feedback.coefficient if self.error_feedback.enabled else None,
            error_feedback_delay=max(1, delay),
        )
