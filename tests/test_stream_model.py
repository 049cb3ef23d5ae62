"""The CPU stream model (titan_async.core.stream_model): its rules against torch's own CUDA
sanitizer (torch/cuda/_sanitizer.py, whose race analysis nobody here wrote) and against hand-written
cases for what the sanitizer does not model (collectives, freed blocks, pinned reads); the project's
cross-stream hand-offs run under it (tests/workers/stream_model_checks.py); and every ordering call
site of the project, removed in turn, is caught (tools/stream_mutations.py). The streaming runs of
test_independent_reference.py run with the model on (`TITAN_ASYNC_STREAM_MODEL`)."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.cuda._sanitizer import EventHandler

import device_replay
import nccl_model
from conftest import REPO, fresh_environment

from titan_async.core.stream_model import ModelEvent, StreamModel

aten = torch.ops.aten


def fresh_model() -> StreamModel:
    model = StreamModel()
    model.checking, model.raise_on_race = True, False
    return model


def write(model: StreamModel, stream, target: torch.Tensor, source: torch.Tensor) -> None:
    """A kernel on `stream` that writes `target` and reads `source` (`target.add_(source)`)."""
    model.kernel(aten.add_.Tensor, (target, source), {}, target, stream)


def read(model: StreamModel, stream, source: torch.Tensor) -> None:
    """A kernel on `stream` that reads `source` into a new tensor."""
    model.kernel(aten.neg.default, (source,), {}, torch.empty_like(source), stream)


def test_stream_model_agrees_with_torchs_cuda_sanitizer_on_random_programs():
    """400 random programs of kernels (reads, writes) on three streams, `wait_stream`, event
    records and waits, and event and stream synchronizes, fed to the model and to the sanitizer's
    EventHandler (a wait_stream is an event recorded on one stream and waited on the other, as
    CUDA implements it): the first operation either reports as a race is the same, or neither
    reports one. Half the programs must race, so both outcomes are exercised."""
    racy = 0
    for seed in range(400):
        rng = random.Random(seed)
        model, sanitizer = fresh_model(), EventHandler()
        streams = [model.compute, model.new_stream("a"), model.new_stream("b")]
        for index in range(3):
            sanitizer._handle_stream_creation(index)
        buffers = [torch.zeros(4) for _ in range(3)]
        pointers = [b.untyped_storage().data_ptr() for b in buffers]
        events: list[tuple[ModelEvent, int]] = []
        first = {"model": None, "sanitizer": None}
        for step in range(12):
            kind = rng.choice(["write", "write", "read", "read", "wait_stream", "record", "wait_event", "sync_event", "sync_stream"])
            s, t = rng.randrange(3), rng.randrange(3)
            races_before = len(model.races)
            errors = []
            if kind == "write":
                target, source = rng.sample(range(3), 2)
                write(model, streams[s], buffers[target], buffers[source])
                errors = sanitizer._handle_kernel_launch(s, {pointers[source]}, {pointers[target]}, set(), "add_",
                                                        {p: [] for p in pointers})
            elif kind == "read":
                source = rng.randrange(3)
                read(model, streams[s], buffers[source])
                errors = sanitizer._handle_kernel_launch(s, {pointers[source]}, set(), set(), "neg", {p: [] for p in pointers})
            elif kind == "wait_stream":
                streams[s].wait_stream(streams[t])
                event_id = 1000 + step
                sanitizer._handle_event_creation(event_id)
                sanitizer._handle_event_record(event_id, t)
                sanitizer._handle_event_wait(event_id, s)
            elif kind == "record":
                event = ModelEvent(model=model)
                event.record(streams[s])
                sanitizer._handle_event_creation(step)
                sanitizer._handle_event_record(step, s)
                events.append((event, step))
            elif kind == "wait_event" and events:
                event, event_id = rng.choice(events)
                streams[s].wait_event(event)
                sanitizer._handle_event_wait(event_id, s)
            elif kind == "sync_event" and events:
                event, event_id = rng.choice(events)
                event.synchronize()
                sanitizer._handle_event_synchronization(event_id)
            elif kind == "sync_stream":
                streams[s].synchronize()
                sanitizer._handle_stream_synchronization(s)
            if first["model"] is None and len(model.races) > races_before:
                first["model"] = step
            if first["sanitizer"] is None and errors:
                first["sanitizer"] = step
        assert first["model"] == first["sanitizer"], (seed, first, model.races)
        racy += first["model"] is not None
    assert 50 < racy < 350, racy


def test_stream_model_collectives_run_on_their_groups_stream_and_order_only_where_waited():
    """A c10d op waits for the stream current at issue and runs on its group's stream; its
    output is safe on a stream only after `work.wait()` there (here: the wait's clock join)."""
    model = fresh_model()
    side = model.new_stream("side")
    value = torch.zeros(2)
    write(model, model.compute, value, torch.ones(2))
    group = model.comm_stream("g", None)
    # issued from the side stream, which has not waited for the compute stream's write
    group.wait_stream(side)
    model.kernel(aten.add_.Tensor, (value, value), {}, value, group, issuer=side)
    assert model.races and all("group g" in race and "after its write on the compute stream" in race for race in model.races)
    model.races.clear()
    # issued after side.wait_stream(compute): ordered; the side stream reads only after waiting for the group
    side.wait_stream(model.compute)
    group.wait_stream(side)
    model.kernel(aten.add_.Tensor, (value, value), {}, value, group, issuer=side)
    assert model.races == []
    read(model, model.compute, value)
    assert len(model.races) == 1 and "read on the compute stream" in model.races[0]
    model.races.clear()
    model.compute.wait_stream(group)  # what work.wait() on the compute stream does
    read(model, model.compute, value)
    assert model.races == []


def test_stream_model_reports_a_block_freed_while_another_stream_may_use_it_unless_recorded():
    """The caching allocator's rule: a block freed while a use on another stream is unordered
    may be reused by its stream's next allocation; `record_stream`, or a wait before that
    allocation, makes the reuse safe."""
    for fix in (None, "record_stream", "wait"):
        model = fresh_model()
        side = model.new_stream("side")
        tensor = torch.ones(8)
        model.kernel(aten.mul.Tensor, (torch.ones(8), 2), {}, tensor, model.compute)  # allocated on compute
        side.wait_stream(model.compute)
        read(model, side, tensor)
        if fix == "record_stream":
            model.record_stream(tensor, side)
        elif fix == "wait":
            model.compute.wait_stream(side)
        del tensor  # the program frees it; the next allocation on the compute stream may reuse it
        read(model, model.compute, torch.ones(1))
        assert (len(model.races) == 1 and "may be reused" in model.races[0]) if fix is None else model.races == [], (fix, model.races)


def test_stream_model_host_reads_pinned_memory_only_after_the_copy_event():
    model = fresh_model()
    value, pinned = torch.ones(3), model.pinned_like(torch.ones(3))
    write(model, model.compute, pinned, value)  # the non-blocking copy
    model.read_pinned(pinned)
    assert len(model.races) == 1 and "read on the host" in model.races[0]
    model.races.clear()
    event = ModelEvent(model=model)
    event.record()
    event.synchronize()
    model.read_pinned(pinned)
    assert model.races == []


def run_worker(*checks: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "stream_model_checks.py"), *checks],
                          capture_output=True, text=True, timeout=300, cwd=REPO, env=fresh_environment())


def test_stream_model_passes_the_projects_cross_stream_hand_offs():
    """The stop agreement and lagged norms (LateAllReduce), the health flags (LateRead), batches
    through pinned memory and host reads of device values, each with the value it must have."""
    result = run_worker()
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    assert result.stdout.split() == ["late_all_reduce", "ok", "late_read", "ok", "to_device", "ok", "read_now", "ok"]


def test_stream_model_logs_issue_edges_that_replay_the_self_waiting_side_stream_as_a_race(tmp_path):
    """The stop agreement in the order the model found, recorded with the comm log: the model
    names the race, and the device-time replay of the log (tests/device_replay.py, from the
    logged issue edges alone) finds it too; the fixed LateAllReduce's log replays clean."""
    found = {}
    for check in ("self_waiting_side_stream", "late_all_reduce"):
        result = subprocess.run([sys.executable, str(REPO / "tests" / "workers" / "stream_model_checks.py"), check],
                                capture_output=True, text=True, timeout=300, cwd=REPO,
                                env={**fresh_environment(), "TITAN_ASYNC_COMM_LOG": str(tmp_path / check)})
        found[check] = (result.stdout, device_replay.replay(nccl_model.read_logs(tmp_path / check), lambda rank: 0))
    said, racy = found["self_waiting_side_stream"]
    assert "is not ordered after its write on the compute stream by aten::fill_" in said, said
    assert racy.races == ["rank 0, step None: coll#1 is ordered after compute position 0 but uses what the compute stream wrote at 2",
                          "rank 0, step None: coll#2 is ordered after compute position 0 but uses what the compute stream wrote at 4"]
    said, clean = found["late_all_reduce"]
    assert said.split() == ["late_all_reduce", "ok"] and not clean.races and not clean.stuck


def test_stream_model_catches_every_ordering_call_site_removed_in_turn():
    """tools/stream_mutations.py: each wait, event record and wait of the project removed in
    turn fails a check under the model with a race naming both sides."""
    result = subprocess.run([sys.executable, str(REPO / "tools" / "stream_mutations.py")], capture_output=True, text=True,
                            timeout=1200, cwd=REPO, env=fresh_environment())
    print(result.stdout)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    lines = [line for line in result.stdout.splitlines() if "] caught by " in line]
    assert len(lines) >= 7 and all("is not ordered after" in line for line in lines), result.stdout
    assert result.stdout.rstrip().endswith(f"{len(lines)} of {len(lines)} ordering call sites caught")
