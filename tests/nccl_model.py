"""A model of NCCL's ordering rules, replaying per-rank communication logs (titan_async.core.comm_log).

Written from NCCL's and torch's documented behaviour, independently of the transport it checks
(torch/distributed/distributed_c10d.py: "tag is not supported with the NCCL backend";
ProcessGroupNCCL: single point-to-point calls run on a two-rank communicator of the pair,
batched ones on the group's communicator; every communicator has one stream per rank):

- Each rank has one in-order stream per communicator: (group, rank pair) for a single
  isend/irecv, (group) for a batch_isend_irecv and for collectives. An operation starts
  only when everything before it on its stream has completed.
- Tags are ignored: on a communicator the n-th send a->b matches the n-th receive at b
  from a; matched sizes must agree. The n-th collective of a group matches across members
  and must be the same operation of the same size on each (all-to-all's splits may differ).
- Every message is large: a send or receive completes only when both sides have started
  it; a collective, when every member has started it; a batch, when all its parts have.
- `work.wait()` orders the rank's compute stream after the work, and every operation
  issued later waits for the compute stream: it starts only when every operation waited
  on before it was issued has completed.
- A device-wide synchronisation (`torch.cuda.synchronize`, `empty_cache`, the `cudaFree` of
  an allocator retrying after an out-of-memory: any allocation may cause one) completes only
  when every operation issued on the rank has completed, a posted receive included: for the
  rank it is a wait on everything issued before it (`with_device_sync`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Unit:
    """One launch on one stream: a single operation, a batch or a collective."""

    rank: int
    op_id: int
    stream: tuple
    waits_before: int
    parts: list[tuple] = field(default_factory=list)  # (kind, channel key, peer, bytes)
    partners: list[list["Unit"]] = field(default_factory=list)
    started: bool = False
    completed: bool = False
    label: str = ""


@dataclass
class Replay:
    completed: int
    total: int
    stuck: dict[int, list[str]]
    mismatches: list[str]

    @property
    def deadlocked(self) -> bool:
        return self.completed < self.total


def read_logs(directory: Path) -> dict[int, list[dict]]:
    """Rank -> its records, from `rank<R>.jsonl` files."""
    return {
        int(path.stem.removeprefix("rank")): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(Path(directory).glob("rank*.jsonl"))
    }


def _units(rank: int, records: list[dict], groups: dict[str, list[int]]) -> tuple[list[Unit], list[int]]:
    units, waits = [], []
    for record in records:
        op = record["op"]
        if op == "group":
            groups[record["group"]] = record["ranks"]
        elif op == "wait":
            waits.append(record["id"])
        elif op in ("send", "recv"):
            pair = tuple(sorted((rank, record["peer"])))
            unit = Unit(rank, record["id"], (rank, record["group"], pair), len(waits), label=f"{op}->{record['peer']}" if op == "send" else f"recv<-{record['peer']}")
            unit.parts.append((op, (record["group"], pair), record["peer"], record["bytes"]))
            units.append(unit)
        elif op == "batch":
            unit = Unit(rank, record["id"], (rank, record["group"], "all"), len(waits), label="batch[" + ",".join(f"{p['op']}:{p['peer']}" for p in record["ops"]) + "]")
            for part in record["ops"]:
                unit.parts.append((part["op"], (record["group"], "all"), part["peer"], part["bytes"]))
            units.append(unit)
        elif op == "coll":
            unit = Unit(rank, record["id"], (rank, record["group"], "all"), len(waits), label=f"{record['kind']}@{record['group']}")
            unit.parts.append((f"coll:{record['kind']}", (record["group"], "coll"), None, record["bytes"]))
            units.append(unit)
    return units, waits


def with_device_sync(records: list[dict], before_send: int) -> list[dict]:
    """`records` with a device-wide synchronisation right before the `before_send`-th single send
    (0-based): a wait on every operation issued before it."""
    sends = [i for i, record in enumerate(records) if record["op"] == "send"]
    at = sends[before_send]
    issued = [record["id"] for record in records[:at] if record["op"] in ("send", "recv", "batch", "coll")]
    return records[:at] + [{"op": "wait", "id": op_id} for op_id in issued] + records[at:]


def assert_safe_under_device_syncs(logs: dict[int, list[dict]]) -> None:
    """A device-wide synchronisation on any one rank before any of its sends (the others
    running on) lets the run complete: no receive is posted ahead of a send it depends on."""
    for rank, records in logs.items():
        for n in range(sum(record["op"] == "send" for record in records)):
            result = replay({**logs, rank: with_device_sync(records, n)})
            assert not result.deadlocked, f"a device-wide sync on rank {rank} before its send #{n} hangs: {result.stuck}"


def replay(logs: dict[int, list[dict]]) -> Replay:
    """Run the logs under the rules in the module docstring until nothing can progress."""
    groups: dict[str, list[int]] = {}
    units, waits = {}, {}
    for rank, records in logs.items():
        units[rank], waits[rank] = _units(rank, records, groups)
    by_id = {(u.rank, u.op_id): u for rank in units for u in units[rank]}
    mismatches = _match(units, groups)
    streams: dict[tuple, list[Unit]] = defaultdict(list)
    for rank in units:
        for unit in units[rank]:
            streams[unit.stream].append(unit)
    heads = {key: 0 for key in streams}
    waited_done = {rank: 0 for rank in units}
    progress = True
    while progress:
        progress = False
        for rank in units:
            while waited_done[rank] < len(waits[rank]) and by_id[(rank, waits[rank][waited_done[rank]])].completed:
                waited_done[rank] += 1
        for key, queue in streams.items():
            while heads[key] < len(queue) and queue[heads[key]].completed:
                heads[key] += 1
            if heads[key] < len(queue):
                unit = queue[heads[key]]
                if not unit.started and waited_done[unit.rank] >= unit.waits_before:
                    unit.started = progress = True
        for rank in units:
            for unit in units[rank]:
                if unit.started and not unit.completed and all(p and all(x.started for x in p) for p in unit.partners):
                    unit.completed = progress = True
    total = sum(len(u) for u in units.values())
    completed = sum(u.completed for rank in units for u in units[rank])
    stuck = {
        rank: [f"{u.label}#{u.op_id}" + ("" if u.started else " (not started)") for u in units[rank] if not u.completed][:4]
        for rank in units
    }
    return Replay(completed, total, {r: s for r, s in stuck.items() if s}, mismatches)


def _match(units: dict[int, list[Unit]], groups: dict[str, list[int]]) -> list[str]:
    """Pair every part with the parts it completes with; returns size mismatches."""
    sends, recvs, collectives = defaultdict(list), defaultdict(list), defaultdict(list)
    for rank in sorted(units):
        for unit in units[rank]:
            for index, (kind, channel, peer, nbytes) in enumerate(unit.parts):
                unit.partners.append([])
                if kind == "send":
                    sends[(channel, rank, peer)].append((unit, index, nbytes))
                elif kind == "recv":
                    recvs[(channel, peer, rank)].append((unit, index, nbytes))
                else:
                    collectives[(channel, rank)].append((unit, index, nbytes))
    mismatches = []
    for key in set(sends) | set(recvs):
        for (send, i, sent), (recv, j, received) in zip(sends[key], recvs[key]):
            send.partners[i].append(recv)
            recv.partners[j].append(send)
            if sent != received:
                mismatches.append(f"{key}: send #{send.op_id} of {sent} bytes matched receive #{recv.op_id} of {received} bytes")
    for (channel, rank), entries in collectives.items():
        members = groups[channel[0]]
        for n, (unit, index, nbytes) in enumerate(entries):
            others = [collectives.get((channel, member), []) for member in members if member != rank]
            if all(n < len(other) for other in others):
                unit.partners[index].extend([other[n][0] for other in others] or [unit])
                if rank == min(members):
                    mismatches += _collective_mismatches(unit, index, nbytes, [other[n] for other in others])
    return mismatches


def _collective_mismatches(unit: Unit, index: int, nbytes: int, others: list) -> list[str]:
    """The n-th collective of a group must be the same operation on every member, of the same
    size (all-to-all's splits may differ per rank)."""
    kind = unit.parts[index][0]
    found = []
    for other, other_index, other_bytes in others:
        other_kind = other.parts[other_index][0]
        if other_kind != kind or (other_bytes != nbytes and "all_to_all" not in kind):
            found.append(f"group {unit.parts[index][1][0]}: rank {unit.rank}'s {kind} #{unit.op_id} of {nbytes} bytes matched "
                         f"rank {other.rank}'s {other_kind} #{other.op_id} of {other_bytes} bytes")
    return found



def outstanding(records: list[dict]) -> dict[str, int]:
    """Most single sends and receives (per peer direction) issued and not yet waited on at once."""
    live: dict[int, str] = {}
    most: dict[str, int] = defaultdict(int)
    for record in records:
        if record["op"] in ("send", "recv"):
            key = f"{record['op']}:{record['peer']}"
            live[record["id"]] = key
            most[key] = max(most[key], sum(1 for k in live.values() if k == key))
        elif record["op"] == "wait":
            live.pop(record["id"], None)
    return dict(most)


def live_bytes(records: list[dict]) -> int:
    """Most bytes of single sends and receives issued and not yet waited on at once."""
    live: dict[int, int] = {}
    most = 0
    for record in records:
        if record["op"] in ("send", "recv"):
            live[record["id"]] = record["bytes"]
            most = max(most, sum(live.values()))
        elif record["op"] == "wait":
            live.pop(record["id"], None)
    return most


def assert_nccl_safe(directory: Path, stages: int, bounded: bool = True, ranks_per_stage: int = 1) -> None:
    """The run logged in `directory` (rank r holds stage r // ranks_per_stage: the pipeline is
    the outermost mesh dimension) completes under the model without a size mismatch, also with
    a device-wide synchronisation before any one send. With `bounded` (a streaming schedule),
    a rank of stage s never has more than p - s single sends or receives per peer direction
    outstanding (w + 1 for w = p-1-s microbatches in flight), and replayed in device time no
    stage's compute waits on a collective with other stages outside drains (`device_replay`;
    torch's schedules do at every flush, by design)."""
    import device_replay  # it builds on this model

    logs = read_logs(directory)
    assert sorted(logs) == list(range(stages * ranks_per_stage)), sorted(logs)
    result = replay(logs)
    assert not result.mismatches and not result.deadlocked, (result.completed, result.total, result.stuck, result.mismatches[:3])
    assert_safe_under_device_syncs(logs)
    if bounded:
        in_time = device_replay.replay(logs, lambda rank: rank // ranks_per_stage)
        assert not in_time.stuck and not in_time.stalls, (in_time.stuck, in_time.stalls[:4])
        for rank, records in logs.items():
            most = outstanding(records)
            assert most and max(most.values()) <= stages - rank // ranks_per_stage, (rank, most)
