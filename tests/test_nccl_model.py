"""The NCCL ordering model itself: small hand-made logs with known outcomes, and the recorded
run of the transport this project had before (receives posted ahead of sends on one
communicator for both directions), which deadlocks under NCCL."""

from __future__ import annotations

from pathlib import Path

import pytest

import nccl_model

POSTED_AHEAD = Path(__file__).parent / "fixtures" / "comm_2bw_p2_m4_posted_ahead"
RECEIVES_AHEAD_OF_SENDS = Path(__file__).parent / "fixtures" / "comm_2bw_p2_m4_receives_ahead_of_sends"


def log(*records) -> list[dict]:
    groups = [{"op": "group", "group": "g", "ranks": [0, 1]}, {"op": "group", "group": "ab", "ranks": [0, 1]}, {"op": "group", "group": "ba", "ranks": [0, 1]}]
    return groups + [dict(r) for r in records]


def op(kind, op_id, peer, group="g", nbytes=4):
    return {"op": kind, "id": op_id, "peer": peer, "group": group, "bytes": nbytes}


def wait(op_id):
    return {"op": "wait", "id": op_id}


def test_crossed_receives_on_one_communicator_deadlock():
    # each rank first receives what the other sends second: tags would save this on gloo, not on NCCL
    logs = {0: log(op("recv", 1, 1), op("send", 2, 1)), 1: log(op("recv", 1, 0), op("send", 2, 0))}
    result = nccl_model.replay(logs)
    assert result.deadlocked and result.completed == 0


def test_same_order_on_one_communicator_completes():
    logs = {0: log(op("send", 1, 1), op("recv", 2, 1)), 1: log(op("recv", 1, 0), op("send", 2, 0))}
    assert not nccl_model.replay(logs).deadlocked


def test_one_communicator_per_direction_lets_crossed_orders_complete():
    logs = {0: log(op("recv", 1, 1, "ba"), op("send", 2, 1, "ab")), 1: log(op("recv", 1, 0, "ab"), op("send", 2, 0, "ba"))}
    assert not nccl_model.replay(logs).deadlocked


def test_an_operation_issued_after_a_wait_waits_for_it():
    # rank 0 waits for its receive before sending what rank 1 needs before rank 1 sends: a cycle
    logs = {0: log(op("recv", 1, 1, "ba"), wait(1), op("send", 2, 1, "ab")),
            1: log(op("recv", 1, 0, "ab"), wait(1), op("send", 2, 0, "ba"))}
    assert nccl_model.replay(logs).deadlocked
    logs[1] = log(op("send", 2, 0, "ba"), op("recv", 1, 0, "ab"), wait(1))
    assert not nccl_model.replay(logs).deadlocked


def test_a_batch_completes_its_parts_together():
    batch = lambda op_id, first, second: {"op": "batch", "id": op_id, "group": "g", "ops": [first, second]}
    logs = {0: log(batch(1, {"op": "recv", "peer": 1, "bytes": 4}, {"op": "send", "peer": 1, "bytes": 4})),
            1: log(batch(1, {"op": "recv", "peer": 0, "bytes": 4}, {"op": "send", "peer": 0, "bytes": 4}))}
    assert not nccl_model.replay(logs).deadlocked


def test_sizes_of_matched_messages_must_agree():
    logs = {0: log(op("send", 1, 1, nbytes=8)), 1: log(op("recv", 1, 0, nbytes=4))}
    assert nccl_model.replay(logs).mismatches


def test_a_collective_needs_every_member():
    coll = {"op": "coll", "id": 1, "kind": "all_reduce", "group": "g", "bytes": 4}
    assert nccl_model.replay({0: log(coll), 1: log(coll)}).completed == 2
    assert nccl_model.replay({0: log(coll), 1: log()}).deadlocked


def test_outstanding_counts_operations_not_yet_waited():
    records = log(op("send", 1, 1), op("send", 2, 1), wait(1), op("send", 3, 1), op("recv", 4, 1))
    assert nccl_model.outstanding(records) == {"send:1": 2, "recv:1": 1}


def test_the_former_posted_ahead_transport_deadlocks_under_nccl():
    """A 5-step PipeDream2BW run at p=2, m=4 with the former transport: both directions on one
    communicator and a window's receives posted before its sends. NCCL stops it at once:
    rank 0 sends activation 1 while rank 1 sends its gradient header."""
    logs = nccl_model.read_logs(POSTED_AHEAD)
    result = nccl_model.replay(logs)
    assert result.deadlocked and result.completed < 10 and not result.mismatches
    assert result.stuck[0][0].startswith("send->1") and result.stuck[1][0].startswith("send->0")
    assert max(nccl_model.outstanding(logs[0]).values()) > 4  # and its sends were unbounded


def test_a_device_sync_waits_for_a_receive_posted_ahead_of_the_send_it_depends_on():
    # rank 0 posts the receive of rank 1's reply before sending what rank 1 replies to
    logs = {0: log(op("recv", 1, 1, "ba"), op("send", 2, 1, "ab")),
            1: log(op("recv", 1, 0, "ab"), wait(1), op("send", 2, 0, "ba"))}
    assert not nccl_model.replay(logs).deadlocked
    assert nccl_model.replay({**logs, 0: nccl_model.with_device_sync(logs[0], 0)}).deadlocked
    logs[0] = log(op("send", 2, 1, "ab"), op("recv", 1, 1, "ba"))  # the receive posted after the send
    nccl_model.assert_safe_under_device_syncs(logs)


def test_the_former_receives_ahead_of_sends_transport_hangs_at_a_device_sync():
    """A 3-step PipeDream2BW run at p=2, m=4 with the transport before receives waited for the
    sends they depend on: it completes, but a device-wide sync on stage 0 before it sends
    activation 2 waits for the receive of gradient 2, posted ahead, which needs that activation."""
    logs = nccl_model.read_logs(RECEIVES_AHEAD_OF_SENDS)
    assert not nccl_model.replay(logs).deadlocked
    with pytest.raises(AssertionError, match="a device-wide sync on rank 0 before its send #3 hangs"):
        nccl_model.assert_safe_under_device_syncs(logs)


def test_members_issuing_a_groups_collectives_in_different_orders_fail():
    """FSDP's reduce-scatter and the replica all-reduce of a stage: the n-th collective of a group
    is matched across its members, so two members issuing them in different orders mismatch."""
    scatter = {"op": "coll", "id": 1, "kind": "reduce_scatter_tensor", "group": "g", "bytes": 64}
    reduce = {"op": "coll", "id": 2, "kind": "all_reduce", "group": "g", "bytes": 16}
    assert not nccl_model.replay({0: log(scatter, reduce), 1: log(scatter, reduce)}).mismatches
    swapped = nccl_model.replay({0: log(scatter, reduce), 1: log({**reduce, "id": 1}, {**scatter, "id": 2})})
    assert swapped.mismatches or swapped.deadlocked
