"""The device-time replay against timelines worked out by hand."""

from __future__ import annotations

import pytest

import device_replay

GROUPS = [{"op": "group", "group": "w", "ranks": [0, 1]}, {"op": "group", "group": "p", "ranks": [0, 1]}]


def two_stages(agreement_wait: str) -> dict[int, list[dict]]:
    """Two stages, two one-microbatch windows each, then a drain (as at a run's end); a world
    all-reduce at each step boundary, waited either at once on the compute stream ("compute")
    or a step later on a side stream ("side")."""
    def boundary(rank: int, issue: int, wait: int | None) -> list[dict]:
        records = [{"op": "coll", "kind": "all_reduce", "group": "w", "bytes": 8, "id": issue}]
        if agreement_wait == "compute":
            records.append({"op": "wait", "id": issue, "stream": "compute"})
        elif wait is not None:
            records.append({"op": "wait", "id": wait, "stream": "side"})
        return records

    first = [
        *GROUPS,
        {"op": "step", "step": 1}, {"op": "compute", "action": "0F0"},
        {"op": "send", "group": "p", "peer": 1, "bytes": 4, "id": 1},
        {"op": "recv", "group": "p", "peer": 1, "bytes": 4, "id": 2}, {"op": "wait", "id": 2, "stream": "compute"},
        {"op": "compute", "action": "0B0"}, *boundary(0, 3, None),
        {"op": "step", "step": 2}, {"op": "compute", "action": "0F1"},
        {"op": "send", "group": "p", "peer": 1, "bytes": 4, "id": 4},
        {"op": "recv", "group": "p", "peer": 1, "bytes": 4, "id": 5}, {"op": "wait", "id": 5, "stream": "compute"},
        {"op": "compute", "action": "0B1"}, {"op": "drain"}, *boundary(0, 6, 3),
    ]
    last = [
        *GROUPS,
        {"op": "step", "step": 1},
        {"op": "recv", "group": "p", "peer": 0, "bytes": 4, "id": 1}, {"op": "wait", "id": 1, "stream": "compute"},
        {"op": "compute", "action": "1F0"}, {"op": "compute", "action": "1B0"},
        {"op": "send", "group": "p", "peer": 0, "bytes": 4, "id": 2}, *boundary(1, 3, None),
        {"op": "step", "step": 2},
        {"op": "recv", "group": "p", "peer": 0, "bytes": 4, "id": 4}, {"op": "wait", "id": 4, "stream": "compute"},
        {"op": "compute", "action": "1F1"}, {"op": "compute", "action": "1B1"},
        {"op": "send", "group": "p", "peer": 0, "bytes": 4, "id": 5}, {"op": "drain"}, *boundary(1, 6, 3),
    ]
    return {0: first, 1: last}


def replay(logs: dict[int, list[dict]], stage_of=lambda rank: rank, stale_agreement: bool = False) -> device_replay.DeviceReplay:
    """`device_replay.replay` of `logs` with the issue edges the stream model records when every
    operation's stream waited for the compute stream (each action one kernel): `after` and
    `writes` are the compute position at issue. With `stale_agreement`, the world all-reduces are
    those of a side stream that waited on itself (the defect the stream model found): ordered
    only after the compute of the previous step boundary, while they use what the compute stream
    wrote since."""
    position, last_boundary = 0, 0
    for records in logs.values():
        position = last_boundary = 0
        for record in records:
            if record["op"] == "compute":
                record["position"] = position
                position += 1
            elif record["op"] in ("send", "recv", "batch", "coll"):
                stale = stale_agreement and record.get("kind") == "all_reduce" and record["group"] == "w"
                record["after"], record["writes"] = (last_boundary if stale else position), position
                if stale:
                    last_boundary = position
    return device_replay.replay(logs, stage_of)


def test_times_of_a_two_stage_stream_worked_by_hand():
    """F = 1, B = 2. Rank 0: 0F0 [0, 1]; its gradient arrives when 1B0 ends (1 + 1 + 2 = 4), so
    0B0 runs [4, 6]; the next 0F1 may start at 6. Rank 1: 1F0 [1, 2], 1B0 [2, 4]; the next
    activation is sent after 0F1 [6, 7], so 1F1 runs [7, 8]."""
    result = replay(two_stages("side"))
    assert not result.stuck and not result.stalls
    assert result.ranks[0].actions == [("0F0", 0, 1), ("0B0", 4, 6), ("0F1", 6, 7), ("0B1", 10, 12)]
    assert result.ranks[1].actions == [("1F0", 1, 2), ("1B0", 2, 4), ("1F1", 7, 8), ("1B1", 8, 10)]
    assert result.ranks[0].window_end == {1: 6, 2: 12}


def slower_last_stage(logs: dict[int, list[dict]]) -> dict[int, list[dict]]:
    """Five optimizer steps of 0.5 on rank 1 before its first all-reduce: it issues it at 6.5,
    after rank 0 (at 6)."""
    at = next(i for i, r in enumerate(logs[1]) if r["op"] == "coll")
    logs[1][at:at] = [{"op": "compute", "action": "1O0"}] * 5
    return logs


def test_an_all_reduce_waited_at_once_on_the_compute_stream_is_a_stall():
    """Rank 0 reaches the step boundary at 6 and waits for rank 1's all-reduce, issued at 6.5."""
    result = replay(slower_last_stage(two_stages("compute")))
    assert result.stalls == ["rank 0, step 1: the compute stream waits 0.50 for all_reduce@w#3"]
    assert result.ranks[0].actions[2] == ("0F1", 6.5, 7.5)
    assert result.ranks[1].actions[7] == ("1F1", 7.5, 8.5)


def test_the_same_all_reduce_on_a_side_stream_holds_no_compute():
    result = replay(slower_last_stage(two_stages("side")))
    assert not result.stalls
    assert result.ranks[0].actions[2] == ("0F1", 6, 7)


def test_collectives_inside_one_stage_are_no_stall():
    """Both ranks in one stage (an FSDP group): the wait delays, but on no other stage."""
    result = replay(slower_last_stage(two_stages("compute")), lambda rank: 0)
    assert not result.stalls and result.ranks[0].actions[2] == ("0F1", 6.5, 7.5)


def test_the_stop_agreement_as_it_was_stalls_in_the_replay():
    """`with_immediate_world_waits` turns the side-stream agreement into the former one."""
    before = device_replay.with_immediate_world_waits(slower_last_stage(two_stages("side")))
    assert replay(before).stalls == ["rank 0, step 1: the compute stream waits 0.50 for all_reduce@w#3"]


def test_torchtitans_barrier_after_the_first_step_is_kept_apart():
    """A barrier in a process's first step is torchtitan's timeout switch (one flush per start);
    anywhere later it is a stall like any other."""
    logs = slower_last_stage(two_stages("compute"))
    for records in logs.values():
        for record in records:
            if record.get("kind") == "all_reduce":
                record["kind"] = "barrier"
    result = replay(logs)
    assert result.start_barriers == ["rank 0, step 1: the compute stream waits 0.50 for barrier@w#3"] and not result.stalls
    for records in logs.values():
        for record in records:
            if record["op"] == "step":
                record["step"] += 1
    logs[0].insert(2, {"op": "step", "step": 1})  # rank 0 started a step earlier: its barrier is in its second step
    assert replay(logs).stalls == ["rank 0, step 2: the compute stream waits 0.50 for barrier@w#3"]


def test_a_side_stream_that_waited_on_itself_replays_as_a_race():
    """The stop agreement as the stream model found it: the side stream's all-reduce is ordered
    after the compute of the previous boundary only, and uses the stop code written since. The
    replay takes the edge from the log (the all-reduce may start before the step's compute) and
    names the race; with the edge the fix records, none."""
    assert not replay(two_stages("side")).races
    racy = replay(two_stages("side"), stale_agreement=True)
    assert racy.races and all("coll#" in race and "uses what the compute stream wrote" in race for race in racy.races), racy.races
    assert "rank 0, step 1: coll#3 is ordered after compute position 0 but uses what the compute stream wrote at 2" in racy.races


def test_a_log_without_issue_edges_is_refused():
    with pytest.raises(ValueError, match="no issue edges"):
        device_replay.replay(two_stages("side"), lambda rank: rank)
