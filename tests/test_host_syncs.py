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

from titan_async.pipeline.trace import Timeline


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


def test_the_gap_between_windows_counts_in_the_bubble(device):
    timeline = Timeline(0, keep_events=False, device=torch.device("cuda"))
    window(timeline, device, [10])
    # the device waits 10 ms for the host (logging, loading the batch), then runs 10 ms
    window(timeline, device, [10], idle_before_ms=10)
    device.idle(0)
    window(timeline, device, [1])
    assert timeline.last_bubble == pytest.approx(0.5)


def test_a_drain_restarts_the_window_clock(device):
    timeline = Timeline(0, keep_events=False, device=torch.device("cuda"))
    window(timeline, device, [10])
    timeline.restart()  # checkpoint time is not a pipeline bubble
    window(timeline, device, [10], idle_before_ms=100)
    device.idle(0)
    window(timeline, device, [1])
    assert timeline.last_bubble == pytest.approx(0.0)


def test_a_trace_waits_once_per_window_and_keeps_device_times(device):
    timeline = Timeline(0, keep_events=True, device=torch.device("cuda"))
    for _ in range(3):
        window(timeline, device, [2, 3])
    assert device.host_syncs == 3
    durations = [end - start for _, start, end in timeline.events]
    assert durations == pytest.approx([0.002, 0.003] * 3, abs=1e-6)
