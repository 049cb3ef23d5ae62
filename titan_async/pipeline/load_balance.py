"""Auxiliary-loss-free load balancing of mixture-of-experts blocks, at each stage's own step.

torchtitan moves each MoE block's `expert_bias_E` in a pre-hook of `OptimizersContainer.step()`
from the tokens its router sent to each expert since the last step (`tokens_per_expert_E`),
all-reduced over the data ranks: bias += coeff * sign(mean - count), centred. Synchronous
training keeps that hook. A streaming stage steps on its own, inside a window, while other
microbatches are in flight: `StageLoadBalance` keeps each microbatch's counts from its forward
and, at the stage's step, applies the rule to exactly the microbatches whose gradient that step
applies (those whose backward completed since the last step: 2BW's delayed batch, PACI's `a`
backwards). Under 2BW the biases are versioned with the weights (`versioned_tensors`), so a
batch routes with the biases of its own weight version, and the update writes the new version.
`DelayedLoadBalance` is the same rule for `training.gradient_delay = 1`: the counts of the
step's whole batch, read from the blocks' own accumulators when the step applies it.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

BIAS = "expert_bias_E"


def moe_blocks(module: nn.Module) -> list[nn.Module]:
    """The MoE modules of `module` that balance their load (an `expert_bias_E` buffer), in module order."""
    return [m for m in module.modules() if getattr(m, BIAS, None) is not None and hasattr(m, "tokens_per_expert_E")]


def versioned_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of what a weight version holds: the parameters, then the expert biases."""
    yield from module.named_parameters()
    for name, buffer in module.named_buffers():
        if name.endswith(BIAS):
            yield name, buffer


def update_biases(blocks: list[nn.Module], counts: torch.Tensor, group: dist.ProcessGroup | None) -> None:
    """torchtitan's bias rule for `counts` (one row of tokens per expert per block), summed over `group`."""
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(counts, group=group)
    with torch.no_grad():
        for block, row in zip(blocks, counts.float()):
            delta = block.load_balance_coeff * torch.sign(row.mean() - row)
            getattr(block, BIAS).add_(delta - delta.mean())


class StageLoadBalance:
    """Per-microbatch expert counts of one streaming stage, applied at its step (module docstring)."""

    def __init__(self, blocks: list[nn.Module], group: dist.ProcessGroup | None) -> None:
        self.blocks, self.group = blocks, group
        self.counts: dict[int, torch.Tensor] = {}
        self.completed: list[int] = []

    def before_forward(self) -> None:
        """Forget what the blocks counted outside training forwards (validation, recomputation)."""
        for block in self.blocks:
            block.tokens_per_expert_E.zero_()

    def after_forward(self, microbatch: int) -> None:
        self.counts[microbatch] = torch.stack([block.tokens_per_expert_E.clone() for block in self.blocks])

    def after_backward(self, microbatch: int) -> None:
        self.completed.append(microbatch)

    def step(self) -> None:
        """Move the biases by the counts of the microbatches whose backward completed since the last step."""
        counts = sum(self.counts.pop(k) for k in self.completed)
        self.completed.clear()
        update_biases(self.blocks, counts, self.group)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """After a drain: the counts of the completed microbatches the next step will apply
        (PACI between local steps; none under 2BW, whose drain completes its last batch)."""
        pending = [self.counts[k] for k in self.completed]
        zeros = torch.zeros(len(self.blocks), *self.blocks[0].tokens_per_expert_E.shape, device=self.blocks[0].tokens_per_expert_E.device)
        return {"pending_counts": sum(pending, zeros)}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.counts = {_CARRIED: state["pending_counts"].clone()}
        self.completed = [_CARRIED]


_CARRIED = -1
"""The key of counts carried over a checkpoint (microbatch ids are never negative)."""


class DelayedLoadBalance:
    """The bias rule for one synchronous step of the delayed-gradient reference (module docstring)."""

    def __init__(self, blocks: list[nn.Module], group: dist.ProcessGroup | None) -> None:
        self.blocks, self.group = blocks, group

    def step(self) -> None:
        counts = torch.stack([block.tokens_per_expert_E.clone() for block in self.blocks])
        for block in self.blocks:
            block.tokens_per_expert_E.zero_()
        update_biases(self.blocks, counts, self.group)
