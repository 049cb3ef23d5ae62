"""A toy regression problem for pipeline tests: stages of Linear + tanh layers in float64.

Only the problem is defined here (initial weights, data, loss); the pipeline worker and the
hand-written references each implement training on it in their own way.
"""

from __future__ import annotations

import os

import torch

DIM, LAYERS_PER_STAGE, ROWS = 8, 2, 3
LR = {"sgd": 0.05, "adamw": 0.01}
M, WINDOWS, DRAIN_AFTER = int(os.environ.get("TOY_MICROBATCHES", "4")), 5, (1,)
"""Microbatches per batch (TOY_MICROBATCHES, default 4), batches, and the windows after which
the pipeline drains (and the last)."""
EVAL_IDS = 1 << 20


def drains() -> set[int]:
    return set(DRAIN_AFTER) | {WINDOWS - 1}


def evaluation_ids(window: int) -> range:
    """The held-out microbatches evaluated after the drain that follows `window`."""
    return range(EVAL_IDS + 2 * window, EVAL_IDS + 2 * window + 2)


def initial_stage(stage: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(weight, bias) of each layer of `stage`, the same wherever it is built."""
    generator = torch.Generator().manual_seed(1000 + stage)
    return [
        (torch.randn(DIM, DIM, generator=generator, dtype=torch.float64) / DIM**0.5,
         torch.randn(DIM, generator=generator, dtype=torch.float64) * 0.1)
        for _ in range(LAYERS_PER_STAGE)
    ]


def microbatch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of global microbatch `k`."""
    generator = torch.Generator().manual_seed(k)
    x = torch.randn(ROWS, DIM, generator=generator, dtype=torch.float64)
    return x, torch.sin(x.flip(-1))


def loss(output: torch.Tensor, target: torch.Tensor, microbatches: int) -> torch.Tensor:
    """Mean squared error of one microbatch, scaled so a batch's gradients sum to its mean's."""
    return ((output - target) ** 2).mean() / microbatches


def optimizer(name: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=LR[name], momentum=0.9)
    return torch.optim.AdamW(params, lr=LR[name], weight_decay=0.1)
