"""The one home of the project's stream semantics: every stream, event, stream context,
cross-stream wait, non-blocking copy, pinned buffer and `record_stream` goes through a backend of
this module, so that the CPU runs the calls a GPU runs, in the same order.

`for_device(device)` is the only place that asks which device a run uses: CUDA gets `CudaStreams`
(torch.cuda's streams and events), every other device the stream model
(`titan_async.core.stream_model.MODEL`), which executes the same calls on the CPU and, once
enabled (`TITAN_ASYNC_STREAM_MODEL=1` in a worker's environment), reports every cross-stream use
of memory that no wait or event orders. Both backends offer:

- `current()`, `new_stream(name)`, `use(stream)` (a stream context; `None` leaves the stream);
  streams have `wait_stream`, `wait_event`, `record_event`, `synchronize`;
- `event(timing=False)`: `record(stream=None)`, `wait(stream=None)`, `query`, `synchronize`,
  `elapsed_time(end)` (ms);
- `pinned_like(value)`: a host buffer a non-blocking copy may write; `read_pinned(tensor)`: that
  buffer as a list, read by the host (after a sync on the copy's event); `read_now(tensor)`: a
  device tensor as a list, copied on the current stream, which the host waits for;
- `to_device(tensor, device)`: a host tensor on the device through pinned memory, without a host sync;
- `record_stream(tensor, stream)`.
"""

from __future__ import annotations

import os

import torch

from titan_async.core import stream_model

ENVIRONMENT_VARIABLE = "TITAN_ASYNC_STREAM_MODEL"


class CudaStreams:
    """torch.cuda's streams and events on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def current(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def use(self, stream: torch.cuda.Stream | None):
        return torch.cuda.stream(stream)

    def event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def pinned_like(self, value: torch.Tensor) -> torch.Tensor:
        return torch.empty(value.shape, dtype=value.dtype, pin_memory=True)

    def read_pinned(self, tensor: torch.Tensor) -> list:
        return tensor.tolist()

    def read_now(self, tensor: torch.Tensor) -> list:
        return tensor.tolist()

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        return tensor.pin_memory().to(device, non_blocking=True)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


def for_device(device: torch.device):
    """The stream backend of `device`: CUDA's, or the stream model."""
    return CudaStreams(device) if device.type == "cuda" else stream_model.MODEL


def enable_model_from_environment() -> bool:
    """Check this worker's stream use against the model when $TITAN_ASYNC_STREAM_MODEL is set."""
    if os.environ.get(ENVIRONMENT_VARIABLE, "") in ("", "0"):
        return False
    stream_model.enable()
    return True
