"""Reading device values on the host without waiting for the work queued after them."""

from __future__ import annotations

import torch
import torch.distributed as dist

from titan_async.core import comm_log, streams


class LateRead:
    """`value` as it is once the work queued before this call has run, read later.

    The value is copied to a pinned host buffer behind that work, and `read` waits on an event
    for the copy only: the host never waits for what it queued since, so the device keeps
    running while the host reads.
    """

    def __init__(self, value: torch.Tensor) -> None:
        self.streams = streams.for_device(value.device)
        self.host = self.streams.pinned_like(value)
        self.host.copy_(value, non_blocking=True)
        self.copied = self.streams.event()
        self.copied.record()

    def read(self) -> list:
        """The value as a (nested) Python list."""
        self.copied.synchronize()
        return self.streams.read_pinned(self.host)


class LateAllReduce:
    """`value` reduced by `op` over `group`'s ranks, started now and read later (at a later step
    boundary), without ever holding up a compute stream.

    The all-reduce is issued, waited on and copied to the host on a side stream, which first
    waits for the stream that wrote `value` (the one current here, taken before the side stream
    becomes current) and alone is ordered after the all-reduce. `read` waits for the all-reduce,
    which every rank started a step earlier, and for its copy, never for the compute queued
    since: no rank's compute waits at a step boundary for another rank's.
    """

    _side_streams: dict[torch.device, object] = {}

    def __init__(self, value: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None = None) -> None:
        self.value, self.streams = value, streams.for_device(value.device)
        self.side = self._side_stream(value.device)
        written_on = self.streams.current()
        with self._on_side():
            self.side.wait_stream(written_on)
            self.work = dist.all_reduce(value, op=op, group=group, async_op=True)

    def read(self) -> list:
        """The reduced value as a (nested) Python list."""
        with self._on_side():
            self.work.wait()
            copy = LateRead(self.value)
        return copy.read()

    def _on_side(self):
        return comm_log.on_side_stream(self.streams.use(self.side))

    def _side_stream(self, device: torch.device):
        if device not in self._side_streams:
            self._side_streams[device] = self.streams.new_stream("late all-reduce side stream")
        return self._side_streams[device]
