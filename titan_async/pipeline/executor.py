"""Runs one stage's streaming actions; in-flight microbatches survive across windows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.pipelining.schedules import _Action, _ComputationType

from titan_async.pipeline.actions import consumed_before
from titan_async.pipeline.trace import Timeline
from titan_async.pipeline.transport import ACTIVATION, GRADIENT


@dataclass
class Microbatch:
    """What a window feeds one microbatch: first-stage inputs, per-stage kwargs, last-stage target."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    target: torch.Tensor | None


@dataclass
class _InFlight:
    stage_input: torch.Tensor
    output: torch.Tensor


class StageExecutor:
    """Executes F and B actions of one stage with a weight policy (see `versions`).

    `transport` is a `P2PTransport` (one stage per process) or a `LocalTransport`
    (every stage in this process, the single-process emulation).

    `optimizer_step` is called whenever the policy completes a batch (2BW) or an
    accumulation (PACI); it must clip, step and zero this stage's gradients. With
    `hold_updates` (a synchronous window of a Sync Start) a completed update waits in `held`
    until `apply_held`, once every stage has its gradient of the batch.
    """

    def __init__(
        self,
        module: torch.nn.Module,
        stage: int,
        num_stages: int,
        transport,
        policy,
        loss_fn: Callable[..., torch.Tensor],
        timeline: Timeline,
    ) -> None:
        self.module = module
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == num_stages - 1
        self.transport = transport
        self.policy = policy
        self.loss_fn = loss_fn
        self.timeline = timeline
        self.balance = None
        """The stage's `StageLoadBalance` when it has MoE blocks that balance their load."""
        self.in_flight: dict[int, _InFlight] = {}
        self.updates_at_forward: dict[int, int] = {}
        self.crossed: list[int] = []
        self.hold_updates = False
        self.held: list[int] = []
        self.expected_upto = {ACTIVATION: -1, GRADIENT: -1}
        """The latest microbatch of each kind told to the transport (`expect`)."""

    def ready(self, action: _Action) -> bool:
        """Whether the input `action` waits for has arrived (always true for blocking transports)."""
        if action.computation_type == _ComputationType.FORWARD:
            return self.is_first or self.transport.has(ACTIVATION, action.microbatch_index)
        return self.is_last or self.transport.has(GRADIENT, action.microbatch_index)

    def expect(self, actions: list[_Action], previous: list[_Action] | None, following: list[_Action] | None,
               ahead: list[_Action] = ()) -> None:
        """Tell the transport which inputs `actions` will consume, in order, and after which of
        this stage's sends each may be received: the actions of the previous and the following
        stage up to this window say what each consumes before it sends (`consumed_before`).
        Of `ahead` (the backwards that start the next list) the inputs a neighbour sends in this
        window are expected too, so that their receives are posted before the step boundary
        (`transport`); inputs already expected are not told again."""
        for kind, sender, action_type in ((ACTIVATION, previous, _ComputationType.FORWARD), (GRADIENT, following, _ComputationType.FULL_BACKWARD)):
            if sender is None:
                continue
            needs = consumed_before(sender, action_type)
            messages = [(a.microbatch_index, needs[a.microbatch_index]) for a in [*actions, *ahead]
                        if a.computation_type == action_type and a.microbatch_index > self.expected_upto[kind]
                        and a.microbatch_index in needs]
            if messages:
                self.expected_upto[kind] = messages[-1][0]
                self.transport.expect(kind, messages)

    def run_action(
        self, action: _Action, microbatches: dict[int, Microbatch], loss_kwargs: dict[str, Any], optimizer_step: Callable[[], None]
    ) -> torch.Tensor | None:
        """Run one F or B; returns the loss of a forward on the last stage."""
        k = action.microbatch_index
        if action.computation_type == _ComputationType.FORWARD:
            return self._forward(k, microbatches[k], loss_kwargs)
        self._backward(k, optimizer_step)
        return None

    def _forward(self, k: int, microbatch: Microbatch, loss_kwargs: dict[str, Any]) -> torch.Tensor | None:
        self.policy.before_forward(k)
        if self.is_first:
            stage_input = microbatch.args[0]
        else:
            stage_input = self.transport.recv(ACTIVATION, k).requires_grad_(True)
        if self.balance:
            self.balance.before_forward()
        with self.timeline.action(f"{self.stage}F{k}"):
            output = self.module(stage_input, **microbatch.kwargs)
            if self.is_last:
                output = self.loss_fn(output, microbatch.target, **loss_kwargs)
        self.policy.after_forward(k)
        if self.balance:
            self.balance.after_forward(k)
        self.in_flight[k] = _InFlight(stage_input, output)
        self.updates_at_forward[k] = self.policy.updates
        if self.is_last:
            return output.detach()
        self.transport.send(ACTIVATION, k, output)
        return None

    def _backward(self, k: int, optimizer_step: Callable[[], None]) -> None:
        self.policy.before_backward(k)
        entry = self.in_flight.pop(k)
        grad = None if self.is_last else self.transport.recv(GRADIENT, k)
        with self.timeline.action(f"{self.stage}B{k}"):
            torch.autograd.backward(entry.output, grad)
        if not self.is_first:
            self.transport.send(GRADIENT, k, entry.stage_input.grad)
        if self.balance:
            self.balance.after_backward(k)
        self.crossed.append(self.policy.delay(k, self.policy.updates - self.updates_at_forward.pop(k)))
        completed = self.policy.after_backward(k)
        if completed is None:
            return
        if self.hold_updates:
            self.held.append(completed)
        else:
            self._apply_update(completed, optimizer_step)

    def apply_held(self, optimizer_step: Callable[[], None]) -> None:
        """Make the updates held back since `hold_updates` was set, in order."""
        held, self.held = self.held, []
        for completed in held:
            self._apply_update(completed, optimizer_step)

    def _apply_update(self, completed: int, optimizer_step: Callable[[], None]) -> None:
        with self.timeline.action(f"{self.stage}O{completed}"):
            self.policy.apply_update(completed, optimizer_step)

    @torch.no_grad()
    def evaluate(self, microbatches: list[Microbatch], loss_kwargs: dict[str, Any], first_id: int) -> list[torch.Tensor]:
        """Forward-only pass of `microbatches` (ids from `first_id`); losses on the last stage."""
        losses = []
        if not self.is_first:
            self.transport.expect(ACTIVATION, [(k, None) for k in range(first_id, first_id + len(microbatches))])
        for offset, microbatch in enumerate(microbatches):
            k = first_id + offset
            stage_input = microbatch.args[0] if self.is_first else self.transport.recv(ACTIVATION, k)
            output = self.module(stage_input, **microbatch.kwargs)
            if self.is_last:
                losses.append(self.loss_fn(output, microbatch.target, **loss_kwargs).detach())
            else:
                self.transport.send(ACTIVATION, k, output, training=False)
        self.transport.finish_sends()
        return losses
