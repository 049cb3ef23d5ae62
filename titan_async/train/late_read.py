"""Reading device values on the host without waiting for the work queued after them."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from titan_async.core import comm_log


class LateRead:
    """`value` as it is once the work queued before this call has run, read later.

    On CUDA the value is copied to pinned host memory behind that work and `read` waits on
    an event for the copy only: the host never waits for what it queued since, so the device
    keeps running while the host reads. Elsewhere the value is read as it is.
    """

    def __init__(self, value: torch.Tensor) -> None:
        self.copied = None
        if value.device.type != "cuda":
            self.host = value
            return
        self.host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        self.host.copy_(value, non_blocking=True)
        self.copied = torch.cuda.Event()
        self.copied.record()

    def read(self) -> list:
        """The value as a (nested) Python list."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class LateAllReduce:
    """`value` reduced by `op` over `group`'s ranks, started now and read later (at a later step
    boundary), without ever holding up a compute stream.

    The all-reduce is issued, waited on and copied to the host on a side stream (CUDA), which
    alone is ordered after it; on the CPU the same calls come in the same order. `read` waits
    for the all-reduce, which every rank started a step earlier, and for its copy, never for the
    compute queued since: no rank's compute waits at a step boundary for another rank's.
    """

    _side_streams: dict[torch.device, torch.cuda.Stream] = {}

    def __init__(self, value: torch.Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None = None) -> None:
        self.value, self.side = value, self._side_stream(value.device)
        with self._on_side():
            if self.side is not None:
                self.side.wait_stream(torch.cuda.current_stream(value.device))  # `value` was written on the compute stream
            self.work = dist.all_reduce(value, op=op, group=group, async_op=True)

    def read(self) -> list:
        """The reduced value as a (nested) Python list."""
        with self._on_side():
            self.work.wait()
            copy = LateRead(self.value)
        return copy.read()

    def _on_side(self):
        stream = torch.cuda.stream(self.side) if self.side is not None else nullcontext()
        return comm_log.on_side_stream(stream)

    @classmethod
    def _side_stream(cls, device: torch.device) -> torch.cuda.Stream | None:
        if device.type != "cuda":
            return None
        if device not in cls._side_streams:
            cls._side_streams[device] = torch.cuda.Stream(device)
        return cls._side_streams[device]
