"""Simulated time of pipeline schedules: step time, throughput and per-rank bubble.

Model: each pipeline rank is one compute stream running its action list in order; an action
starts when its rank is free and its inputs are there. F(s, k) needs F(s-1, k) plus a transfer
from the rank of stage s-1; the input gradient of (s, k) (a full backward B or torch's I) needs
F(s, k) and the input gradient of (s+1, k) plus a transfer; W(s, k) needs I(s, k). A transfer
costs latency + bytes / bandwidth of the intra-node or inter-node link (nothing between stages
on one rank); links have no contention and transfers overlap compute. The stage -> rank
placement is read off the action lists (torch's looped: stage s on rank s % p; V-shaped: rank r
holds r and 2p-1-r). Optimizer steps: a synchronous schedule steps once per step on every rank
after every rank finished the step's flushes (torchtitan's global norm and step: all wait for
the slowest); a streaming stage steps right after the backward that completes its update
(2BW: every m backwards, PACI: every `accumulation`), as `pipeline.executor` does, with no
barrier. FSDP and replica collectives (`Collectives`) run on a stream of their own, one FSDP unit
at a time: a stage gathers its weights before its first forward after each gradient reduction
(torch's schedules: each flush; 2BW: each step; PACI: each local step) and reduces its gradient
after the backward that completes one, and only the part the unit-by-unit overlap cannot hide
(`exposed`) occupies the compute stream. Since nothing contends but each rank's own streams,
start times are computed in dependency order, which gives the times an event-driven run would.

Steady state: several steps run and the later ones are measured, between step boundaries (the
latest end, over ranks, of a step's optimizer step or, for a streaming window, of its actions).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from functools import lru_cache

from torch.distributed.pipelining.schedules import _Action, _ComputationType

from titan_async.pipeline.actions import drain_actions, window_actions
from titan_async.pipeline.schedules import STREAMING_SCHEDULES, TORCH_SCHEDULES

F = _ComputationType.FORWARD
B = _ComputationType.FULL_BACKWARD
I = _ComputationType.BACKWARD_INPUT  # noqa: E741
W = _ComputationType.BACKWARD_WEIGHT
OVERLAP = _ComputationType.OVERLAP_F_B


@dataclass(frozen=True)
class Link:
    """A point-to-point link: seconds of latency and bytes per second."""

    latency: float = 0.0
    bandwidth: float = math.inf

    def transfer(self, nbytes: float) -> float:
        return self.latency + nbytes / self.bandwidth


@dataclass(frozen=True)
class Collectives:
    """A pipeline rank's FSDP and replica collectives per gradient reduction, in seconds: the
    all-gather of its weights, and the reduce-scatter plus replica all-reduce of its gradient,
    each split evenly over its `units` FSDP units (a rank with v stages: 1/v of each per stage)."""

    gather: float = 0.0
    reduce: float = 0.0
    units: int = 1


def exposed(collective: float, compute: float, units: int) -> float:
    """Seconds a collective split over `units` pieces adds to `compute` (split alike) when they run
    on two streams and each piece must precede its unit's compute (a gather, FSDP2 prefetching the
    next unit's) or follow it (a reduction, as the backward moves to the next unit): the last
    piece always, and whatever of the collective the other units' compute cannot hide,
    max(C / U, C - compute (U - 1) / U)."""
    if collective <= 0:
        return 0.0
    return max(collective / units, collective - compute * (units - 1) / units)


@dataclass(frozen=True)
class Costs:
    """Seconds per pipeline rank (its whole share of the model; a schedule with v stages per rank
    gives each 1/v): one microbatch's forward and backward, and one optimizer step. When a
    schedule splits the backward, I and W together take `split_cost` times it, I
    `input_fraction` of that and W the rest."""

    forward: tuple[float, ...]
    backward: tuple[float, ...]
    optimizer: tuple[float, ...]
    input_fraction: float = 0.5
    split_cost: float = 1.0
    """(I + W) / B: what splitting a backward costs (`tools/gpu/bench_split_backward.py`)."""
    message_bytes: float = 0.0
    intra_node: Link = Link()
    inter_node: Link = Link()
    node_of_rank: tuple[int, ...] | None = None
    """Node of each pipeline rank; None = all on one node."""
    collectives: tuple[Collectives, ...] | None = None
    """Each rank's FSDP and replica collectives; None = none."""
    stage_costs: tuple[tuple[float, float, float], ...] | None = None
    """Measured (forward, input gradient, weight gradient) seconds of each stage, in place of
    the per-rank shares (a full backward takes input + weight gradient) for a schedule with as
    many stages."""
    host: tuple[float, ...] | None = None
    """Seconds per step each rank runs nothing at the step boundary (host work); None = 0."""

    @classmethod
    def uniform(cls, ranks: int, forward: float, backward: float, optimizer: float = 0.0, **kwargs) -> Costs:
        return cls((forward,) * ranks, (backward,) * ranks, (optimizer,) * ranks, **kwargs)

    def link(self, a: int, b: int) -> float:
        """Seconds one message takes from rank a to rank b (0 on the same rank)."""
        if a == b:
            return 0.0
        nodes = self.node_of_rank
        same_node = nodes is None or nodes[a] == nodes[b]
        return (self.intra_node if same_node else self.inter_node).transfer(self.message_bytes)


TRACE_ACTION = re.compile(r"(\d+)([FBIWO])(\d+)")
"""A `trace.Timeline` event name: stage, action (F, B, I, W, O: optimizer step) and microbatch
(for O: a step count)."""


@dataclass(frozen=True)
class TracedAction:
    stage: int
    kind: str
    microbatch: int
    flush: int
    """How many times this stage ran this action of this microbatch before (torch's schedules
    number microbatches per flush; the streaming ones globally, so 0 there)."""
    rank: int
    start: float
    end: float


def traced_actions(events: list[dict]) -> list[TracedAction]:
    """The actions of Chrome trace events of `trace.Timeline` (microseconds), in start order."""
    seen: Counter[tuple[int, str, int]] = Counter()
    actions = []
    for event in sorted(events, key=lambda e: e["ts"]):
        stage, kind, index = TRACE_ACTION.fullmatch(event["name"]).groups()
        key = int(stage), kind, int(index)
        actions.append(TracedAction(*key, seen[key], event["tid"], event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6))
        seen[key] += 1
    return actions


def costs_from_trace(events: list[dict], microbatches: int, synchronous: bool, flushes: int = 1) -> Costs:
    """The costs a traced run measured (`microbatches` per optimizer step in `flushes` flushes;
    `synchronous`: one of torch's schedules, whose optimizer steps wait for every rank's flush):
    - each stage's median forward, input-gradient and weight-gradient time (a full backward B
      counts as input gradient), and each rank's median optimizer step;
    - the link latency: the median time from a message's producer ending to its consumer
      starting, over the actions that waited for their message (send, receive and the host work
      around them);
    - each rank's host time per step: the time it ran nothing although its next action was ready
      (its message there, or its barrier passed), summed per step, median over steps; it covers
      data loading, logging, gradient clipping and the gaps between actions."""
    actions = traced_actions(events)
    per_flush = microbatches // flushes
    by_key = {(a.stage, a.kind, a.microbatch, a.flush): a for a in actions if a.kind != "O"}
    stages = {a.stage: a.rank for a in actions if a.kind == "F"}
    ranks = sorted(set(stages.values()))
    last_stage = max(stages)
    median = statistics.median

    def durations(stage: int, kind: str) -> list[float]:
        return [a.end - a.start for a in actions if a.stage == stage and a.kind == kind]

    stage_costs = []
    for stage in range(last_stage + 1):
        split = durations(stage, "I")
        stage_costs.append((median(durations(stage, "F")), median(split or durations(stage, "B")),
                            median(durations(stage, "W")) if split else 0.0))
    step_of = {a: (a.flush * per_flush + a.microbatch) // microbatches for a in actions if a.kind != "O"}
    flush_end: dict[int, float] = {}
    for action, step in step_of.items():
        flush_end[step] = max(flush_end.get(step, 0.0), action.end)

    def ready(action: TracedAction, step: int) -> tuple[float, bool]:
        """When its input was there, and whether a message from another rank brought it."""
        s, k, n = action.stage, action.microbatch, action.flush
        if action.kind == "O":
            return (flush_end[step] if synchronous else 0.0), False
        if action.kind == "F" and s > 0:
            producer = by_key.get((s - 1, "F", k, n))
        elif action.kind in "BI" and s < last_stage:
            producer = by_key.get((s + 1, "B", k, n)) or by_key.get((s + 1, "I", k, n))
        else:
            return 0.0, False
        return (producer.end, producer.rank != action.rank) if producer else (0.0, False)

    latencies, host = [], {rank: Counter() for rank in ranks}
    for rank in ranks:
        previous, step = None, 0
        for action in (a for a in actions if a.rank == rank):
            step = step_of.get(action, step)
            if previous is not None:
                at, message = ready(action, step)
                idle = max(0.0, action.start - max(previous, at))
                if message and at > previous:
                    latencies.append(idle)
                else:
                    host[rank][step] += idle
            previous = action.end
    optimizer = [[a.end - a.start for a in actions if a.rank == rank and a.kind == "O"] for rank in ranks]
    return Costs(
        forward=tuple(sum(stage_costs[s][0] for s, r in stages.items() if r == rank) for rank in ranks),
        backward=tuple(sum(sum(stage_costs[s][1:]) for s, r in stages.items() if r == rank) for rank in ranks),
        optimizer=tuple(median(o) if o else 0.0 for o in optimizer),
        intra_node=Link(median(latencies) if latencies else 0.0),
        stage_costs=tuple(stage_costs),
        host=tuple(median(host[rank].values()) if host[rank] else 0.0 for rank in ranks),
    )


@dataclass(frozen=True)
class Task:
    key: Hashable
    duration: float
    deps: tuple[tuple[Hashable, float], ...] = ()
    """(key of a task, delay after its end) pairs."""
    label: str = ""
    """Its name in a trace: stage, action letter (F, B, I, W, O: optimizer step, H: host work), microbatch."""


@dataclass(frozen=True)
class Result:
    """A schedule's steady state: seconds per optimizer step and each rank's idle share."""

    name: str
    step_time: float
    bubble: tuple[float, ...]
    events: tuple[dict, ...] = ()
    """Every simulated task as a Chrome trace event (`trace.Timeline.write`'s format), for Gantt charts."""


def run_tasks(streams: list[list[Task]]) -> list[list[tuple[float, float]]]:
    """(start, end) of every task of every rank's stream; ValueError naming a stuck task on a deadlock."""
    end: dict[Hashable, float] = {}
    times: list[list[tuple[float, float]]] = [[] for _ in streams]
    free = [0.0] * len(streams)
    progressed = True
    while progressed:
        progressed = False
        for rank, stream in enumerate(streams):
            while len(times[rank]) < len(stream):
                task = stream[len(times[rank])]
                if any(key not in end for key, _ in task.deps):
                    break
                start = max([free[rank], *(end[key] + delay for key, delay in task.deps)])
                free[rank] = end[task.key] = start + task.duration
                times[rank].append((start, free[rank]))
                progressed = True
    stuck = [stream[len(t)].key for stream, t in zip(streams, times) if len(t) < len(stream)]
    if stuck:
        raise ValueError(f"schedule deadlocks: ranks wait at {stuck}")
    return times


def compute_actions(actions: list[_Action | None]) -> list[_Action]:
    """The F, B, I, W actions of a list in order (overlapped F;B pairs run one after the other;
    communication, gradient reduction and spacing are left out)."""
    out = []
    for action in actions:
        if action is None:
            continue
        if action.computation_type == OVERLAP:
            out += compute_actions(list(action.sub_actions))
        elif action.computation_type in (F, B, I, W):
            out.append(action)
    return out


def placement(order: dict[int, list[_Action]]) -> dict[int, int]:
    """Stage -> rank, as the action lists place the stages."""
    return {a.stage_index: rank for rank, actions in order.items() for a in actions}


def _durations(stage: int, rank_of: dict[int, int], per_rank: Counter[int], costs: Costs, kind: _ComputationType) -> tuple[float, float, float]:
    """Seconds of one forward, input gradient and weight gradient of `stage` for an action of
    `kind` (I or W: a split backward, `Costs.split_cost`); `per_rank` counts each rank's stages."""
    if costs.stage_costs and len(costs.stage_costs) == len(rank_of):
        return costs.stage_costs[stage]
    rank = rank_of[stage]
    share = 1 / per_rank[rank]
    backward = costs.backward[rank] * share * (costs.split_cost if kind in (I, W) else 1.0)
    return costs.forward[rank] * share, backward * costs.input_fraction, backward * (1 - costs.input_fraction)


def _task(action: _Action, tag: Hashable, rank_of: dict[int, int], per_rank: Counter[int], costs: Costs) -> Task:
    """The task of `action` in flush or window `tag` (keys: (tag, stage, F | dx | W, microbatch))."""
    s, kind, k = action.stage_index, action.computation_type, action.microbatch_index
    rank, stages = rank_of[s], len(rank_of)
    forward, input_gradient, weight_gradient = _durations(s, rank_of, per_rank, costs, kind)
    label = f"{s}{kind.value}{k}"
    if kind == F:
        deps = ((((tag, s - 1, "F", k), costs.link(rank_of[s - 1], rank)),) if s > 0 else ())
        return Task((tag, s, "F", k), forward, deps, label)
    if kind == W:
        return Task((tag, s, "W", k), weight_gradient, (((tag, s, "dx", k), 0.0),), label)
    deps = [((tag, s, "F", k), 0.0)]
    if s < stages - 1:
        deps.append(((tag, s + 1, "dx", k), costs.link(rank_of[s + 1], rank)))
    return Task((tag, s, "dx", k), input_gradient + (weight_gradient if kind == B else 0.0), tuple(deps), label)


def _collective(action: _Action, tag: Hashable, rank_of: dict[int, int], per_rank: Counter[int], costs: Costs) -> list[Task]:
    """The exposed part (`exposed`) of the gather of `action`'s stage before that forward, or of
    its gradient reduction after that backward (B or W), as a task labelled C; none if 0."""
    if not costs.collectives:
        return []
    s, kind, k = action.stage_index, action.computation_type, action.microbatch_index
    shares = per_rank[rank_of[s]]
    collectives = costs.collectives[rank_of[s]]
    units = max(1, round(collectives.units / shares))
    forward, input_gradient, weight_gradient = _durations(s, rank_of, per_rank, costs, kind)
    if kind == F:
        seconds = exposed(collectives.gather / shares, forward, units)
    else:
        seconds = exposed(collectives.reduce / shares, weight_gradient + (input_gradient if kind == B else 0.0), units)
    return [Task((tag, s, "C", kind.value, k), seconds, label=f"{s}C{k}")] if seconds else []


def flush_tasks(actions: list[_Action], tag: Hashable, rank_of: dict[int, int], per_rank: Counter[int], costs: Costs) -> list[Task]:
    """One rank's tasks for one flush of `actions`: each of its stages gathers before its first
    forward and reduces after its last backward (B or W)."""
    last_backward = {a.stage_index: i for i, a in enumerate(actions) if a.computation_type in (B, W)}
    tasks: list[Task] = []
    gathered: set[int] = set()
    for i, action in enumerate(actions):
        s = action.stage_index
        if action.computation_type == F and s not in gathered:
            gathered.add(s)
            tasks += _collective(action, tag, rank_of, per_rank, costs)
        tasks.append(_task(action, tag, rank_of, per_rank, costs))
        if last_backward.get(s) == i:
            tasks += _collective(action, tag, rank_of, per_rank, costs)
    return tasks


def host_time(costs: Costs, rank: int) -> float:
    return costs.host[rank] if costs.host else 0.0


def _measure(name: str, streams: list[list[Task]], times: list[list[tuple[float, float]]], start: float, stop: float,
             steps: int) -> Result:
    """Per-rank idle share of [start, stop], which spans `steps` steps, and every task as an event."""
    wall = stop - start
    bubble = tuple(1 - sum(max(0.0, min(b, stop) - max(a, start)) for a, b in rank) / wall for rank in times)
    events = tuple({"name": task.label, "tid": rank, "ts": a * 1e6, "dur": (b - a) * 1e6}
                   for rank, (stream, spans) in enumerate(zip(streams, times)) for task, (a, b) in zip(stream, spans))
    return Result(name, wall / steps, bubble, events)


def check_order(order: dict[int, list[_Action]], microbatches: int) -> None:
    """ValueError unless every stage runs one forward and one input-gradient action (B or I) of
    each microbatch 0..m-1, and a W for each I."""
    for stage in sorted(placement(order)):
        mine = [a for actions in order.values() for a in actions if a.stage_index == stage]
        for kinds in ((F,), (B, I)):
            ids = sorted(a.microbatch_index for a in mine if a.computation_type in kinds)
            if ids != list(range(microbatches)):
                raise ValueError(f"stage {stage} runs {'/'.join(k.value for k in kinds)} of microbatches {ids}, not 0..{microbatches - 1}")
        if sorted(a.microbatch_index for a in mine if a.computation_type == I) != sorted(a.microbatch_index for a in mine if a.computation_type == W):
            raise ValueError(f"stage {stage}: its I and W actions differ")


def one_f_one_b(ranks: int, microbatches: int) -> dict[int, list[_Action]]:
    """1F1B: one drained window of the streaming stream (`actions`), stage s running min(m, p - s)
    forwards, then a backward and a forward in turn, then the backwards left: the order torch's
    Schedule1F1B runs. (torch 2.x's own IR of it, `_get_pipeline_order`, numbers the last rank's
    forwards 1..m.)"""
    return {s: window_actions(s, ranks, microbatches, 0) + drain_actions(s, ranks, microbatches, 0)
            for s in range(ranks)}


@lru_cache(maxsize=128)
def torch_order(name: str, ranks: int, microbatches: int, stages_per_rank: int | None = None) -> dict[int, list[_Action]]:
    """Rank -> compute actions of one flush of torch's schedule `name` as torch builds them (its
    schedule visualizer's helper, on mock stages; multi-stage schedules get `stages_per_rank`
    stages per rank, by default 2), 1F1B from `one_f_one_b`. torch's error, or `check_order`'s,
    when it cannot be built for p, m. Cached: callers read it, never change it."""
    if name == "1F1B":
        return one_f_one_b(ranks, microbatches)
    from torch.distributed.pipelining._schedule_visualizer import get_schedule_ops

    ops = get_schedule_ops(name, ranks, microbatches, stages_per_rank)
    order = {rank: compute_actions(actions) for rank, actions in enumerate(ops)}
    check_order(order, microbatches)
    return order


def simulate_synchronous(name: str, order: dict[int, list[_Action]], costs: Costs, flushes: int = 1, steps: int = 3) -> Result:
    """`steps` optimizer steps of `flushes` flushes of `order` each, then a global barrier and each
    rank's optimizer step and host work; the steps after the first are measured."""
    rank_of = placement(order)
    per_rank = Counter(rank_of.values())
    ranks = len(order)
    streams: list[list[Task]] = [[] for _ in range(ranks)]
    step_at: list[list[int]] = [[] for _ in range(ranks)]
    for step in range(steps):
        for flush in range(step * flushes, (step + 1) * flushes):
            for rank in range(ranks):
                streams[rank] += flush_tasks(order[rank], flush, rank_of, per_rank, costs)
        barrier = tuple((stream[-1].key, 0.0) for stream in streams)
        for rank in range(ranks):
            streams[rank].append(Task(("step", step, rank), costs.optimizer[rank], barrier, f"{rank}O{step}"))
            streams[rank].append(Task(("host", step, rank), host_time(costs, rank), label=f"{rank}H{step}"))
            step_at[rank].append(len(streams[rank]) - 1)
    times = run_tasks(streams)
    boundary = [max(times[r][step_at[r][step]][1] for r in range(ranks)) for step in range(steps)]
    return _measure(name, streams, times, boundary[0], boundary[-1], steps - 1)


def streaming_streams(ranks: int, microbatches: int, windows: int, costs: Costs, update_every: int) -> tuple[list[list[Task]], list[list[int]]]:
    """Each stage's tasks for `windows` windows of the streaming stream (`actions.window_actions`),
    a reduction and an optimizer step after every `update_every`-th backward, a gather before the
    first forward after each, and each task's window."""
    rank_of = {s: s for s in range(ranks)}
    per_rank = Counter(rank_of.values())
    streams: list[list[Task]] = [[] for _ in range(ranks)]
    window_of: list[list[int]] = [[] for _ in range(ranks)]
    for stage in range(ranks):
        placed: list[tuple[Task, int]] = []
        gathered = False
        for window in range(windows):
            for action in window_actions(stage, ranks, microbatches, window):
                tasks = [_task(action, 0, rank_of, per_rank, costs)]
                if action.computation_type == F and not gathered:
                    gathered = True
                    tasks = _collective(action, 0, rank_of, per_rank, costs) + tasks
                if action.computation_type == B and (action.microbatch_index + 1) % update_every == 0:
                    gathered = False
                    tasks += _collective(action, 0, rank_of, per_rank, costs)
                    tasks.append(Task(("step", stage, action.microbatch_index), costs.optimizer[stage],
                                      label=f"{stage}O{action.microbatch_index}"))
                placed += [(task, window) for task in tasks]
            if host_time(costs, stage):
                placed.append((Task(("host", stage, window), host_time(costs, stage), label=f"{stage}H{window}"), window))
        streams[stage] = [task for task, _ in placed]
        window_of[stage] = [window for _, window in placed]
    return streams, window_of


def simulate_streaming(name: str, ranks: int, microbatches: int, costs: Costs, update_every: int | None = None,
                       windows: int | None = None) -> Result:
    """The streaming stream (one stage per rank) for `windows` windows (default p + 6), stepping
    each stage after every `update_every` backwards (default m: 2BW) and doing its host work at
    the end of each window; measured from the middle window to the third-last (the last two keep
    every rank busy past the end of the measure)."""
    windows = windows or ranks + 6
    streams, window_of = streaming_streams(ranks, microbatches, windows, costs, update_every or microbatches)
    times = run_tasks(streams)
    boundary = [0.0] * windows
    for rank in range(ranks):
        for (_, end), window in zip(times[rank], window_of[rank]):
            boundary[window] = max(boundary[window], end)
    first, last = windows // 2, windows - 3
    return _measure(name, streams, times, boundary[first - 1], boundary[last], last - first + 1)


def simulate(name: str, ranks: int, microbatches: int, costs: Costs, *, flushes: int = 1,
             accumulation: int | None = None) -> Result:
    """Schedule `name`'s steady state at p = `ranks`, m = `microbatches` per flush (a streaming
    window holds `flushes` x m; PACI steps every `accumulation` backwards, default the window);
    torch's error when it cannot build the schedule for p, m."""
    window = microbatches * flushes
    if name in STREAMING_SCHEDULES:
        every = (accumulation or window) if name == "PACI" else window
        return simulate_streaming(name, ranks, window, costs, every)
    return simulate_synchronous(name, torch_order(name, ranks, microbatches), costs, flushes)


@dataclass(frozen=True)
class Comparison:
    """A schedule's result with its throughput ratios (step time of the reference / its own)."""

    result: Result
    vs_1f1b: float | None
    vs_best_synchronous: float | None


def compare(ranks: int, microbatches: int, costs: Costs, *, flushes: int = 1, accumulation: int | None = None,
            schedules: tuple[str, ...] = TORCH_SCHEDULES + tuple(STREAMING_SCHEDULES),
            costs_of: Callable[[str], Costs] | None = None) -> tuple[list[Comparison], dict[str, str]]:
    """Every schedule of `schedules` (`simulate`), and name -> why it was skipped (torch could
    not build it). `costs_of(name)`, when given, replaces `costs` per schedule. Ratios are None
    where their reference (1F1B, any synchronous schedule) is not among the results."""
    results, skipped = [], {}
    for name in schedules:
        try:
            results.append(simulate(name, ranks, microbatches, costs_of(name) if costs_of else costs,
                                    flushes=flushes, accumulation=accumulation))
        except Exception as err:  # torch refuses some (p, m) in its own words
            skipped[name] = f"{type(err).__name__}: {err}".splitlines()[0]
    baseline = next((r.step_time for r in results if r.name == "1F1B"), None)
    best = min((r.step_time for r in results if r.name not in STREAMING_SCHEDULES), default=None)
    return [Comparison(r, baseline and baseline / r.step_time, best and best / r.step_time) for r in results], skipped
