"""A replay of per-rank communication logs (titan_async.core.comm_log) in device time.

The NCCL model (`nccl_model`) says whether a run can complete; this replay says when each
rank's compute stream is busy, under the same rules in time, as a CUDA device would run the
logged order (independently of the code that wrote the log):

- Each rank has one compute stream. A logged action (`compute`: F, B, I, W or O) runs on it for
  the cost of its letter, after everything queued before it.
- An operation (send, receive, batch, collective) starts once the compute it is ordered after
  has run and its own communicator stream (`nccl_model.Unit.stream`) has finished the operation
  before it. Which compute that is comes from the log, as the stream model recorded it
  (`titan_async.core.comm_log`, "issue edges"): an operation whose `after` reaches into the
  latest compute action is ordered after everything the compute stream was given so far (its
  stream waited for the compute stream), one with an older `after` only after the compute action
  that held that position. An operation whose `writes` exceeds its `after` uses a tensor the
  compute stream writes after the point it is ordered after: a *race*. It completes when every
  partner has started it (messages and collectives take no time of their own here: the replay
  is about waiting, not bandwidth).
- A wait logged on the compute stream holds that stream until the operation completes. A
  wait on a side stream holds no compute; the host reads its result behind it, so the host
  does not issue later work until it completes (the host is otherwise infinitely fast).

It reports each rank's compute intervals, its window ends (device time at each step marker),
every race and every *stall*: a compute-stream wait, outside drains, on a collective of ranks of more
than one pipeline stage that holds the compute stream up, which makes a stage wait for
another stage's progress at a step boundary. torchtitan's barrier after a process's first step
is reported apart (`DeviceReplay.start_barriers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import nccl_model
from titan_async.pipeline.simulation import Costs, simulate

UNIT_COSTS = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0, "O": 0.5}
"""Device time of each action letter: the simulator's `Costs.uniform(p, 1, 2, 0.5)`."""


@dataclass
class RankTimes:
    actions: list[tuple[str, float, float]] = field(default_factory=list)
    """(action, start, end) in issue order."""
    window_end: dict[int, float] = field(default_factory=dict)
    """Step -> the device time its window's last action ends on this rank (what comes after it
    at the step boundary belongs to the next window)."""
    drained_after: set[int] = field(default_factory=set)
    """Steps whose window was followed by a drain."""


@dataclass
class DeviceReplay:
    ranks: dict[int, RankTimes]
    stalls: list[str]
    stuck: dict[int, str]
    races: list[str] = field(default_factory=list)
    start_barriers: list[str] = field(default_factory=list)
    """Stalls on torchtitan's barrier after a process's first step (`set_pg_timeouts`, which
    also synchronises the device): one flush per start or restart, by design, kept apart."""

    def idle_share(self, rank: int, fill: int = 1) -> float:
        """The rank's idle share of its compute stream over its steady windows: each from the
        end of the previous window's compute to the end of its own, where no drain came in the
        `fill` windows before it (the first `fill` windows after the start or a drain fill the
        pipeline)."""
        times = self.ranks[rank]
        span = busy = 0.0
        for step, end in times.window_end.items():
            if any(step - back not in times.window_end or step - back in times.drained_after for back in range(1, fill + 1)):
                continue
            start = times.window_end[step - 1]
            span += end - start
            busy += sum(max(0.0, min(b, end) - max(a, start)) for _, a, b in times.actions)
        assert span > 0, f"rank {rank} has no steady window"
        return 1 - busy / span


def replay(logs: dict[int, list[dict]], stage_of: Callable[[int], int], costs: dict[str, float] = UNIT_COSTS) -> DeviceReplay:
    """Replay `logs` (rank -> records) in device time; `stage_of(rank)` is a rank's pipeline stage."""
    groups: dict[str, list[int]] = {}
    units = {rank: nccl_model._units(rank, records, groups)[0] for rank, records in logs.items()}
    nccl_model._match(units, groups)
    by_id = {(u.rank, u.op_id): u for rank in units for u in units[rank]}
    before: dict[int, nccl_model.Unit] = {}
    last_on: dict[tuple, nccl_model.Unit] = {}
    for rank in sorted(units):
        for unit in units[rank]:
            if unit.stream in last_on:
                before[id(unit)] = last_on[unit.stream]
            last_on[unit.stream] = unit
    issued: dict[int, float] = {}
    ends: dict[int, float] = {}

    def start(unit) -> float | None:
        if id(unit) not in issued:
            return None
        previous = before.get(id(unit))
        previous_end = end(previous) if previous is not None else 0.0
        return None if previous_end is None else max(issued[id(unit)], previous_end)

    def end(unit) -> float | None:
        if id(unit) in ends:
            return ends[id(unit)]
        members = [unit] + [other for partners in unit.partners for other in partners]
        if any(not partners for partners in unit.partners):
            return None  # a part nobody matched: the run cannot complete
        starts = [start(member) for member in members]
        if any(s is None for s in starts):
            return None
        ends[id(unit)] = max(starts)
        return ends[id(unit)]

    def spans_stages(unit) -> bool:
        kind = unit.parts[0][0]
        ranks = groups[unit.stream[1]]
        return kind.startswith("coll:") and len({stage_of(r) for r in ranks}) > 1

    times = {rank: RankTimes() for rank in logs}
    position = {rank: 0 for rank in logs}
    compute = {rank: 0.0 for rank in logs}
    host = {rank: 0.0 for rank in logs}
    step = {rank: None for rank in logs}
    draining = {rank: True for rank in logs}
    first_step: dict[int, int] = {}
    stalls: list[str] = []
    races: list[str] = []
    start_barriers: list[str] = []
    marks: dict[int, list[tuple[int, float]]] = {rank: [] for rank in logs}
    """Per rank, each compute action's position and device end time, in issue order."""

    def ordered_after(rank: int, record: dict) -> float:
        """The device time of the compute the operation `record` is ordered after (its issue edge)."""
        if "after" not in record:
            raise ValueError(f"rank {rank}'s log has no issue edges ({record}): record it under the stream model "
                             "(TITAN_ASYNC_STREAM_MODEL=1)")
        if record.get("writes", 0) > record["after"]:
            races.append(f"rank {rank}, step {step[rank]}: {record['op']}#{record['id']} is ordered after compute "
                         f"position {record['after']} but uses what the compute stream wrote at {record['writes']}")
        if not marks[rank] or record["after"] > marks[rank][-1][0]:
            return compute[rank]
        return max((end for position, end in marks[rank] if position < record["after"]), default=0.0)

    progress = True
    while progress:
        progress = False
        for rank, records in logs.items():
            while position[rank] < len(records):
                record = records[position[rank]]
                op = record["op"]
                if op == "compute":
                    begin = max(compute[rank], host[rank])
                    compute[rank] = begin + costs[record["action"].lstrip("0123456789")[0]]
                    times[rank].actions.append((record["action"], begin, compute[rank]))
                    marks[rank].append((record.get("position", 0), compute[rank]))
                elif op in ("step", "drain"):
                    if step[rank] is not None and not draining[rank] and times[rank].actions:
                        times[rank].window_end[step[rank]] = times[rank].actions[-1][2]
                        if op == "drain":
                            times[rank].drained_after.add(step[rank])
                    if op == "step":
                        step[rank] = record["step"]
                        first_step.setdefault(rank, step[rank])
                    draining[rank] = op == "drain"
                elif op in ("send", "recv", "batch", "coll"):
                    issued[id(by_id[(rank, record["id"])])] = max(ordered_after(rank, record), host[rank])
                elif op == "wait":
                    unit = by_id[(rank, record["id"])]
                    done = end(unit)
                    if done is None:
                        break
                    if record.get("stream", "compute") == "side":
                        host[rank] = max(host[rank], done)
                    else:
                        if done > compute[rank] and not draining[rank] and spans_stages(unit):
                            at_start = unit.parts[0][0] == "coll:barrier" and step[rank] == first_step[rank]
                            (start_barriers if at_start else stalls).append(
                                f"rank {rank}, step {step[rank]}: the compute stream waits {done - compute[rank]:.2f} "
                                f"for {unit.label}#{unit.op_id}")
                        compute[rank] = max(compute[rank], done)
                position[rank] += 1
                progress = True
    stuck = {rank: str(logs[rank][position[rank]]) for rank in logs if position[rank] < len(logs[rank])}
    return DeviceReplay(times, stalls, stuck, races, start_barriers)


def assert_flows_as_simulated(directory: Path, schedule: str, stages: int, microbatches: int, ranks_per_stage: int = 1,
                              accumulation: int | None = None) -> DeviceReplay:
    """The streaming run logged in `directory` replays without a stall, and each rank's idle
    share of its steady windows (`idle_share`: stage 0 runs its first backward in window
    floor((p - 1) / m) + 1, the last that fills the pipeline) is
    within 5 points of the simulator's prediction for the same unit costs
    (`titan_async.pipeline.simulation`, written from the schedule's definition)."""
    result = replay(nccl_model.read_logs(directory), lambda rank: rank // ranks_per_stage)
    assert not result.stuck and not result.stalls and not result.races, (result.stuck, result.stalls[:4], result.races[:4])
    predicted = simulate(schedule, stages, microbatches, Costs.uniform(stages, UNIT_COSTS["F"], UNIT_COSTS["B"], UNIT_COSTS["O"]),
                         accumulation=accumulation).bubble
    fill = (stages - 1) // microbatches + 1  # stage 0's first backward waits for the gradients' first pass
    for rank in result.ranks:
        share = result.idle_share(rank, fill)
        assert abs(share - predicted[rank // ranks_per_stage]) <= 0.05, (rank, share, predicted)
    return result


def with_immediate_world_waits(logs: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """`logs` with every all-reduce over the whole world waited on the compute stream right after
    it is issued, and not later on a side stream: the stop agreement as it ran on CUDA before it
    moved to a side stream (`work.wait()` at once, which orders the compute stream after the
    all-reduce, and so after every rank's step boundary)."""
    world = len(logs)
    changed = {}
    for rank, records in logs.items():
        groups = {r["group"] for r in records if r["op"] == "group" and len(r["ranks"]) == world}
        reduces = {r["id"] for r in records if r["op"] == "coll" and r["kind"] == "all_reduce" and r["group"] in groups}
        result = []
        for record in records:
            if record["op"] == "wait" and record["id"] in reduces and record.get("stream") == "side":
                continue
            result.append(record)
            if record["op"] == "coll" and record["id"] in reduces:
                result.append({"op": "wait", "id": record["id"], "stream": "compute"})
        changed[rank] = result
    return changed
