"""torchtitan's optimizer container with rule-based routing (Muon/AdamW) and error feedback."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torchtitan.components.optimizer import OptimizersContainer

from titan_async.optim.error_feedback import ErrorFeedback
from titan_async.optim.full_matrix import create_exchange_groups
from titan_async.optim.muon import Muon
from titan_async.optim.routing import Route, route_parameters


def _param_group(routes: list[Route], **options: Any) -> dict[str, Any]:
    return {"params": [r.param for r in routes], "param_names": [r.name for r in routes], **options}


class RoutedOptimizersContainer(OptimizersContainer):
    """Per model part: Muon for hidden matrices and AdamW for the rest, or AdamW for all.

    Parameters are routed one by one (`route_parameters`) instead of by torchtitan's regex
    groups, which must each match on every pipeline stage: a part without parameters of one
    kind simply has no optimizer of that kind; building is collective over the world all the same
    (`create_exchange_groups`). With `error_feedback_coefficient` set, every
    optimizer is wrapped in `ErrorFeedback`. State dicts are torchtitan's flat FQN-keyed ones.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        adamw_kwargs: dict[str, Any] = field(default_factory=dict)
        """torch.optim.AdamW arguments (lr, betas, eps, weight_decay) for every parameter Muon does not take."""
        muon_kwargs: dict[str, Any] | None = None
        """`Muon` arguments for hidden matrices; None gives them to AdamW as well."""
        error_feedback_coefficient: float | None = None
        """Wrap every optimizer in error feedback with this coefficient; None: no wrapper."""
        error_feedback_delay: int = 1
        """The steps the gradients are late, which error feedback's correction scales by (`ErrorFeedback`)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        if config.param_groups:
            raise ValueError("RoutedOptimizersContainer routes parameters by rule; param_groups must be empty")
        impl_kwargs = self._build_impl_kwargs(config)
        self.model_parts = model_parts
        self.optimizers = []
        all_params = []
        use_muon = config.muon_kwargs is not None
        routed = [route_parameters(part) for part in model_parts]
        if use_muon:  # every rank, whether its parts hold Muon's matrices or not
            create_exchange_groups([r.param for routes in routed for r in routes if r.optimizer == "muon"])
        for part_index, routes in enumerate(routed):
            matrices = [r for r in routes if use_muon and r.optimizer == "muon"]
            others = [r for r in routes if not (use_muon and r.optimizer == "muon")]
            if matrices:
                blocks = {r.name: r.blocks for r in matrices}
                muon = Muon([_param_group(matrices)], **config.muon_kwargs, blocks=blocks)
                self.optimizers.append(muon)
                self._log_optimizer(muon, part_index, ["hidden matrices"])
            if others:
                adamw = torch.optim.AdamW([_param_group(others, **impl_kwargs)], **config.adamw_kwargs)
                self.optimizers.append(adamw)
                self._log_optimizer(adamw, part_index, ["embeddings, output head, non-matrices" if use_muon else "all"])
            all_params.extend(r.param for r in routes)
        self._validate_params(all_params)
        if config.implementation == "fused_opt_states_bf16":
            self._register_bf16_optimizer_state_hook()
        if config.error_feedback_coefficient is not None:
            self.optimizers = [ErrorFeedback(o, config.error_feedback_coefficient, config.error_feedback_delay) for o in self.optimizers]
        self._post_init(all_params)

    def error_feedback_norm(self) -> torch.Tensor | None:
        """L2 norm of the last error-feedback correction over this rank's local shards; None before any."""
        norms = [o.last_correction_norm for o in self.optimizers if isinstance(o, ErrorFeedback)]
        norms = [n for n in norms if n is not None]
        return torch.stack(norms).square().sum().sqrt() if norms else None
