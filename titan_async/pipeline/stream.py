"""The stream of windows: feeds one batch per optimizer step into the stages this process runs.

With one stage per process the actions run in order and block on their inputs; with
every stage in this process (the emulation) a ready action of some stage runs next,
which yields the same result as any real timing, because each stage's actions and
updates depend only on its own stream.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from titan_async.core import comm_log
from titan_async.pipeline import actions as plan
from titan_async.pipeline.executor import Microbatch, StageExecutor


class StreamEngine:
    """Windows, drains and the stage-local optimizer steps of a streaming schedule."""

    def __init__(self, executors: list[StageExecutor], num_stages: int, microbatches: int, optimizer_steps: dict[int, Callable[[], None]]) -> None:
        self.executors = executors
        self.num_stages = num_stages
        self.microbatches = microbatches
        self.optimizer_steps = optimizer_steps
        self.window = -1
        self.drained = True
        self.since = 0
        """The first microbatch fed after the last drain: earlier ones have run their backwards."""
        self.previous_actions: Callable[[int], list] = lambda stage: []
        self.loss_kwargs: dict[str, Any] = {}

    def _run(self, actions_of: Callable[[int], list], microbatches: dict[int, Microbatch],
             ahead_of: Callable[[int], list] = lambda stage: []) -> list[torch.Tensor]:
        """Run every local stage's `actions_of(stage)`. A neighbour's actions of the previous run
        and this one (computed, not run here: a message consumed now was produced in one of
        them) tell each stage's transport when its receives may be posted; `ahead_of(stage)`,
        the backwards that start the stage's next list, which of its next inputs are sent now."""
        previous = self.previous_actions

        def neighbour(stage: int) -> list | None:
            return previous(stage) + actions_of(stage) if 0 <= stage < self.num_stages else None

        queues = {}
        for executor in self.executors:
            stage = executor.stage
            queues[stage] = deque(actions_of(stage))
            executor.expect(list(queues[stage]), neighbour(stage - 1), neighbour(stage + 1), ahead_of(stage))
        self.previous_actions = actions_of
        losses = []
        while any(queues.values()):
            progressed = False
            for executor in self.executors:
                queue = queues[executor.stage]
                if queue and executor.ready(queue[0]):
                    loss = executor.run_action(queue.popleft(), microbatches, self.loss_kwargs, self.optimizer_steps[executor.stage])
                    if loss is not None:
                        losses.append(loss)
                    progressed = True
            if not progressed:
                raise RuntimeError(f"pipeline stream stalled in window {self.window}: {dict(queues)}")
        return losses

    def run_window(self, window: int, microbatches: list[Microbatch], loss_kwargs: dict[str, Any],
                   synchronous: bool = False) -> list[torch.Tensor]:
        """Feed batch `window` (0-based training step); returns its microbatches' losses (last stage).

        Microbatch ids are global (window * microbatches + j), so a run resumed from a
        (drained) checkpoint continues the same ids and weight versions. `synchronous` (a step
        of a Sync Start, drained next): every stage's update of the batch waits for the end of
        the drain, where each stage's gradient of the whole batch is complete (a global norm
        exists) and no message is in flight."""
        for executor in self.executors:
            executor.hold_updates = synchronous
        self.window = window
        m, p = self.microbatches, self.num_stages  # the lists are computed again later (`_run`): after a resize too
        first = window * m
        self.loss_kwargs = loss_kwargs
        if self.drained:
            self.since = first
        since = self.since
        losses = self._run(lambda stage: plan.window_actions(stage, p, m, window, since),
                           dict(enumerate(microbatches, start=first)),
                           lambda stage: plan.drain_actions(stage, p, m, window, since))
        self.drained = False
        return losses

    def drain(self) -> None:
        """Run the backwards still in flight, so no microbatch crosses this point; then the
        updates a synchronous window held back, stage by stage."""
        if self.drained:
            return
        comm_log.note({"op": "drain"})
        window, since, m, p = self.window, self.since, self.microbatches, self.num_stages
        self._run(lambda stage: plan.drain_actions(stage, p, m, window, since), {})
        for executor in self.executors:
            executor.transport.finish_sends()
        self.drained = True
        for executor in self.executors:
            executor.apply_held(self.optimizer_steps[executor.stage])
