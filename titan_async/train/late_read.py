"""Reading a device value on the host without waiting for the work queued after it."""

from __future__ import annotations

import torch


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
