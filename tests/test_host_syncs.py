"""Host syncs between windows, against a model of CUDA's asynchronous execution.

On a GPU the host enqueues a window's kernels and runs ahead; any wait for the device
between windows (a stream or event synchronize, a copy to the host) leaves the device idle
while the host then loads the next batch. `FakeDevice` models what CUDA events promise: an
event completes once the device has run the work enqueued before it, `query` never waits,
`synchronize` is a host sync (counted), and `elapsed_time` is device time.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import TINY, cli_in_process, sets

from titan_async.optim import ErrorFeedback, Muon
from titan_async.pipeline.stream import StreamEngine
from titan_async.pipeline.trace import Timeline
from titan_async.train.health import HealthGuard, HealthSection, skips_on_device


class FakeDevice:
    """The device's clock (ms at which the work enqueued so far ends) and how far it has run."""

    def __init__(self) -> None:
        self.enqueued_until = 0.0
        self.ran_until = 0.0
        self.host_syncs = 0

    def run(self, ms: float) -> None:
        """The host enqueues `ms` of work behind what is queued."""
        self.enqueued_until += ms

    def idle(self, ms: float) -> None:
        """The device has finished its queue and waits `ms` for the host."""
        self.ran_until = max(self.ran_until, self.enqueued_until)
        self.enqueued_until += ms
        self.ran_until = self.enqueued_until

    def event_class(self):
        device = self

        class Event:
            def __init__(self, enable_timing: bool = False) -> None:
                self.at = None

            def record(self) -> None:
                self.at = device.enqueued_until

            def query(self) -> bool:
                return device.ran_until >= self.at

            def synchronize(self) -> None:
                device.host_syncs += 1
                device.ran_until = max(device.ran_until, self.at)

            def elapsed_time(self, end) -> float:
                assert self.query() and end.query(), "elapsed_time of an event the device has not reached"
                return end.at - self.at

        return Event


@pytest.fixture
def device(monkeypatch) -> FakeDevice:
    fake = FakeDevice()
    monkeypatch.setattr(torch.cuda, "Event", fake.event_class())
    return fake


def window(timeline: Timeline, device: FakeDevice, busy_ms: list[float], idle_before_ms: float = 0.0) -> float | None:
    if idle_before_ms:
        device.idle(idle_before_ms)
    timeline.start_window()
    for k, ms in enumerate(busy_ms):
        with timeline.action(f"0F{k}"):
            device.run(ms)
    return timeline.end_window()


def test_without_a_trace_no_window_waits_for_the_device_and_bubbles_are_read_once_run(device):
    timeline = Timeline(0, keep_events=False, device=torch.device("cuda"))
    assert window(timeline, device, [5, 5]) is None  # the device has not run it yet
    assert window(timeline, device, [10]) is None
    assert device.host_syncs == 0
    device.idle(0)  # the device catches up while the host loads the next batch
    assert window(timeline, device, [4], idle_before_ms=0) == pytest.approx(0.0)
    assert device.host_syncs == 0
    assert timeline.unread  # the third window is read once the device has run it
    device.idle(0)
    window(timeline, device, [1])
    assert timeline.last_bubble == pytest.approx(0.0) and device.host_syncs == 0


@pytest.mark.parametrize("drained, bubble", [(False, 0.5), (True, 0.0)])
def test_the_gap_between_windows_counts_in_the_bubble_unless_a_drain_came_between(device, drained, bubble):
    """The device waits 10 ms for the host (logging, loading the batch), then runs 10 ms; after a
    drain that wait is checkpoint or validation time, no pipeline bubble."""
    timeline = Timeline(0, keep_events=False, device=torch.device("cuda"))
    window(timeline, device, [10])
    if drained:
        timeline.restart()
    window(timeline, device, [10], idle_before_ms=10)
    device.idle(0)
    window(timeline, device, [1])
    assert timeline.last_bubble == pytest.approx(bubble)


def test_a_trace_waits_once_per_window_and_keeps_device_times_drains_included(device):
    timeline = Timeline(0, keep_events=True, device=torch.device("cuda"))
    for _ in range(3):
        window(timeline, device, [2, 3])
    assert device.host_syncs == 3
    with timeline.action("0B9"):  # a drain runs actions outside any window
        device.run(4)
    timeline.restart()
    durations = [end - start for _, start, end in timeline.events]
    assert durations == pytest.approx([0.002, 0.003] * 3 + [0.004], abs=1e-6)
    assert timeline.events[-1][0] == "0B9"


# --- a non-finite update skipped on the device ------------------------------------------------

def _optimizer(kind: str, weight: torch.nn.Parameter):
    if kind == "adamw":
        return torch.optim.AdamW([weight], lr=0.1, weight_decay=0.1, fused=True)
    muon = Muon([{"params": [weight]}], lr=0.1, weight_decay=0.1)
    return ErrorFeedback(muon) if kind == "muon+ef" else muon


def _train(kind: str, gradients: list[torch.Tensor], guard: HealthGuard | None):
    """Weights and optimizer state after stepping on `gradients`; with `guard`, each step goes
    through the device-side health check, as a streaming stage steps."""
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 6))
    optimizer = _optimizer(kind, weight)
    if kind == "adamw+ef":
        optimizer = ErrorFeedback(optimizer)
    for step, gradient in enumerate(gradients):
        weight.grad = gradient.clone()
        if guard is not None:
            optimizer.found_inf = guard.found_nonfinite(step, 0, [weight], group=None)
        optimizer.step()
        optimizer.__dict__.pop("found_inf", None)
    state = {k: v.clone() for k, v in optimizer.state[weight].items() if isinstance(v, torch.Tensor)}
    return weight.detach().clone(), state


@pytest.fixture
def one_process_group():
    """The health check logs the rank that saw a non-finite gradient."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.usefixtures("one_process_group")
@pytest.mark.parametrize("kind", ["adamw", "muon", "muon+ef", "adamw+ef"])
@pytest.mark.parametrize("bad_step", [0, 2])
def test_a_non_finite_gradient_is_skipped_on_the_device_as_if_never_seen(kind, bad_step):
    torch.manual_seed(1)
    gradients = [torch.randn(8, 6) for _ in range(4)]
    poisoned = gradients[:bad_step] + [torch.full((8, 6), float("nan"))] + gradients[bad_step:]
    guard = HealthGuard(HealthSection())
    weight, state = _train(kind, poisoned, guard)
    expected_weight, expected_state = _train(kind, gradients, None)
    assert torch.equal(weight, expected_weight)
    assert state.keys() == expected_state.keys()
    assert all(torch.equal(state[k], expected_state[k]) for k in state)
    assert guard.skipped == 0  # counted only when read, at the end of the next step
    guard.settle()
    assert guard.skipped == 1


def test_only_optimizers_that_take_found_inf_skip_on_the_device():
    weight = torch.nn.Parameter(torch.zeros(2, 2))
    assert skips_on_device(torch.optim.AdamW([weight], fused=True))
    assert not skips_on_device(torch.optim.AdamW([weight], foreach=True))
    assert skips_on_device(ErrorFeedback(Muon([weight], lr=0.1)))


# --- a real streaming run: no value read from the device inside a window ----------------------

READS = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default, torch.ops.aten.equal.default}


class CountReads(TorchDispatchMode):
    """Counts the ops that hand a tensor's value to the host (`item`, `bool`, `equal`): on a GPU
    each one waits for every kernel queued before it."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.reads += func in READS
        return func(*args, **(kwargs or {}))


def test_streaming_windows_with_per_microbatch_updates_never_read_the_device(tmp_path, monkeypatch, capsys):
    """PACI updating after every backward, with Muon and error feedback, in the emulation: the
    health check and every optimizer step run inside the window without reading the device."""
    windows = []
    run_window = StreamEngine.run_window

    def counted(self, *args, **kwargs):
        with CountReads() as mode:
            losses = run_window(self, *args, **kwargs)
        windows.append(mode.reads)
        return losses

    monkeypatch.setattr(StreamEngine, "run_window", counted)
    status, _, err = cli_in_process(
        capsys, "train", "--run-dir", str(tmp_path / "run"),
        *sets(*TINY, "training.steps=4", "checkpoint.enable=false", "optimizer.name=muon",
              "optimizer.error_feedback.enabled=true", "parallelism.pipeline_parallel_schedule=PACI",
              "parallelism.paci.accumulation=1", "parallelism.emulated_stages=2",
              "parallelism.pipeline_parallel_microbatch_size=1"),
    )
    assert status == 0, err[-3000:]
    assert windows == [0, 0, 0, 0]
