"""Per-rank action lists of the streaming (no-flush) 1F1B stream, as torch `_Action`s.

Stage s keeps w = p-1-s microbatches in flight: its stream is F(0)..F(w-1), then
F(k+w), B(k) for k = 0, 1, ... Window t (one optimizer step) holds the forwards of
batch t, F(tm)..F(tm+m-1), and the backwards B(tm-w)..B(tm+m-1-w): first the w-long
tail of batch t-1, then the head of batch t. Microbatch ids are global (k = t*m + j).
A drain runs the backwards still owed (at most w), which empties the pipe; backwards resume
with the microbatches fed after it. With fewer microbatches per window than in flight
(m < w) a window's backwards reach back ceil(w / m) batches.
"""

from __future__ import annotations

import csv
from pathlib import Path

from torch.distributed.pipelining.schedules import _Action, _ComputationType

F = _ComputationType.FORWARD
B = _ComputationType.FULL_BACKWARD


def in_flight(stage: int, num_stages: int) -> int:
    """w: microbatches stage `stage` holds between its forward and backward in steady state."""
    return num_stages - 1 - stage


def gradient_delay(num_stages: int, microbatches: int) -> int:
    """PipeDream-2BW's delay d in optimizer steps, the same on every stage: the first stage
    completes batch b's gradient in window b + ceil((p - 1) / m), so the update it makes there
    is first seen by batch b + d + 1 (d = 1 from m >= p - 1 on)."""
    return max(1, -(-(num_stages - 1) // microbatches))


def window_actions(stage: int, num_stages: int, microbatches: int, window: int, since: int = 0) -> list[_Action]:
    """Actions of `stage` in window `window`; the backwards of microbatches before `since` (the
    first one fed after the last drain) already ran."""
    w = in_flight(stage, num_stages)
    first = window * microbatches
    actions = []
    for i in range(microbatches):
        actions.append(_Action(stage, F, first + i))
        backward = first + i - w
        if backward >= since:
            actions.append(_Action(stage, B, backward))
    return actions


def drain_actions(stage: int, num_stages: int, microbatches: int, window: int, since: int = 0) -> list[_Action]:
    """The backwards that window `window` left in flight on `stage` (of microbatches from `since`)."""
    w = in_flight(stage, num_stages)
    end = (window + 1) * microbatches
    return [_Action(stage, B, k) for k in range(max(since, end - w), end)]


def consumed_before(sender: list[_Action], produced: _ComputationType) -> dict[int, int | None]:
    """For each message `sender`'s `produced` actions make for a neighbour (F: an activation for
    the next stage, B: a gradient for the previous one), the latest microbatch of that
    neighbour's messages the sender consumed before it in this list (F consumes activations
    from the previous stage, B gradients from the next), or None: the receive of that message
    depends on the neighbour's sends only up to there."""
    latest, needs = None, {}
    for action in sender:
        if action.computation_type == produced:
            needs[action.microbatch_index] = latest
        else:
            latest = action.microbatch_index
    return needs


def pipeline_order(num_stages: int, microbatches: int, windows: int, drain_every: int = 0) -> dict[int, list[_Action]]:
    """Rank -> actions for `windows` windows, draining after the last one (and every `drain_every`)."""
    order: dict[int, list[_Action]] = {}
    for stage in range(num_stages):
        actions, since = [], 0
        for window in range(windows):
            actions += window_actions(stage, num_stages, microbatches, window, since)
            if window == windows - 1 or (drain_every > 0 and (window + 1) % drain_every == 0):
                actions += drain_actions(stage, num_stages, microbatches, window, since)
                since = (window + 1) * microbatches
        order[stage] = actions
    return order


def format_order(order: dict[int, list[_Action]]) -> str:
    """One line per rank, actions as torch prints them (e.g. 0F3 = stage 0 forward of microbatch 3)."""
    return "\n".join(f"rank {rank}: " + " ".join(str(a) for a in actions) for rank, actions in sorted(order.items()))


def dump_csv(order: dict[int, list[_Action]], path: Path) -> None:
    """Write one row per rank, as torch's `_PipelineScheduleRuntime._dump_csv` does."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        for rank in sorted(order):
            writer.writerow([str(a) for a in order[rank]])
