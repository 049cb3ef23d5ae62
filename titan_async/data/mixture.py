"""The deterministic order in which a weighted mixture of sources is sampled, by stages.

Within a stage (the steps from one of `stage_steps` to the next), the rule of Megatron-LM's blended
data set: the i-th sample of the stage (i from 0) comes from the source s with the largest
w_s * (i + 1) - n_s, where w_s are the stage's weights normalized to sum to 1 and n_s counts the
stage's samples taken from s so far (ties: the first such source). Megatron-LM's helpers.cpp
multiplies by max(i, 1) instead of i + 1, which targets samples 0 and 1 alike; i + 1 is the count
the source should have after sample i. No random numbers: after any prefix every source's
count is within 1 of its share, and the order continues exactly from the counts. Each source keeps
its own position (the windows it has served, over all stages).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MixtureSchedule:
    """Stage k runs from step stage_steps[k] (stage_steps[0] == 0, strictly increasing) with
    stage_weights[k], one non-negative weight per source, not all zero."""

    stage_steps: tuple[int, ...]
    stage_weights: tuple[tuple[float, ...], ...]

    def stage_at(self, step: int) -> int:
        return sum(1 for start in self.stage_steps[1:] if start <= step)

    def normalized(self, stage: int) -> tuple[float, ...]:
        weights = self.stage_weights[stage]
        return tuple(w / sum(weights) for w in weights)


@dataclass
class MixtureState:
    """Where the mixture's order stands: the stage, its samples so far per source, and every
    source's position (windows served over the whole run)."""

    stage: int = 0
    stage_counts: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)


def next_sample(schedule: MixtureSchedule, state: MixtureState, step: int) -> tuple[int, int]:
    """(source, its window number) of the next sample, drawn at `step`; advances `state`."""
    stage = schedule.stage_at(step)
    if stage != state.stage:
        state.stage, state.stage_counts = stage, [0] * len(state.positions)
    weights = schedule.normalized(stage)
    i = sum(state.stage_counts)
    errors = [w * (i + 1) - n for w, n in zip(weights, state.stage_counts)]
    source = errors.index(max(errors))
    state.stage_counts[source] += 1
    state.positions[source] += 1
    return source, state.positions[source] - 1
