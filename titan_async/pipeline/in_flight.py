"""Microbatch chunks a pipeline rank holds in flight, counted on the action lists torch builds.

A chunk is one microbatch's activations on one stage. Walking a rank's compute actions in order
(`simulation.compute_actions`; an overlapped F;B, DualPipeV's, counts its F first, so that both
chunks are held while the two overlap), F adds a chunk of its stage and the backward that frees
it removes that chunk: a full backward B, or, for a split backward, the W. torch's I
(`stage_backward_input`) runs with retain_graph=True, so the autograd graph, and every tensor
saved in it, stays alive for the W (`stage_backward_weight`, which needs the inputs of the
weight-gradient matmuls and the gradients at their outputs) and is freed only when the W has
run. The count at I would be a lower bound that torch does not reach; the count at W is what it
keeps.

The peak is the most chunks (or, with per-stage weights such as bytes per chunk, the largest
weighted sum) at any point of one flush; a flush starts and ends with none in flight.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from torch.distributed.pipelining.schedules import _Action

from titan_async.pipeline.schedules import TORCH_SCHEDULES
from titan_async.pipeline.simulation import B, F, W, torch_order


def peak_chunks(actions: list[_Action], weights: Mapping[int, float] | None = None) -> dict[int, int]:
    """Stage -> chunks in flight at the peak of one rank's compute `actions` (module docstring):
    the first point of the walk where the sum over stages of weights[stage] x chunks is largest
    (weights default to 1: the chunk count). Every stage of `actions` is a key."""
    held: Counter[int] = Counter({a.stage_index: 0 for a in actions})
    peak, best = dict(held), 0.0
    for action in actions:
        kind = action.computation_type
        if kind == F:
            held[action.stage_index] += 1
        elif kind in (B, W):
            held[action.stage_index] -= 1
        else:
            continue
        total = sum((1.0 if weights is None else weights[s]) * n for s, n in held.items())
        if total > best:
            peak, best = dict(held), total
    return peak


def rank_chunks(schedule: str, rank: int, ranks: int, microbatches: int, stages_per_rank: int,
                weights: Mapping[int, float] | None = None) -> dict[int, int]:
    """Stage -> chunks pipeline rank `rank` of `ranks` holds at its peak (`peak_chunks`) under
    torch's schedule `schedule` (any case; 1F1B is `simulation.one_f_one_b`, torch's order) with
    `microbatches` per flush and `stages_per_rank` stages on each rank, on the action lists
    torch builds (`simulation.torch_order`; cached). ValueError for a schedule that is not
    torch's; torch's own error where it cannot build the schedule."""
    name = next((known for known in TORCH_SCHEDULES if known.lower() == schedule.lower()), None)
    if name is None:
        raise ValueError(f"{schedule!r} is not one of torch's schedules ({', '.join(TORCH_SCHEDULES)})")
    return peak_chunks(torch_order(name, ranks, microbatches, stages_per_rank if stages_per_rank > 1 else None)[rank], weights)
