"""Point-to-point transport of activations and gradients between neighbouring stages.

Each message is tagged by (microbatch id, kind), so receives can be posted early and
in-flight microbatches from different windows never mix. Shapes are exchanged once
per direction with a small header.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

ACTIVATION, GRADIENT = 0, 1
_HEADER = 8
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def _tag(kind: int, microbatch: int) -> int:
    return (microbatch % (1 << 24)) * 4 + kind


class P2PTransport:
    """isend/irecv between stage `stage` and its neighbours on the pipeline process group."""

    def __init__(self, group: dist.ProcessGroup, stage: int, num_stages: int, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.peer = {
            ACTIVATION: dist.get_global_rank(group, stage - 1) if stage > 0 else None,
            GRADIENT: dist.get_global_rank(group, stage + 1) if stage < num_stages - 1 else None,
        }
        self.shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self.sent_header: set[int] = set()
        self.posted: dict[tuple[int, int], tuple[dist.Work, torch.Tensor]] = {}
        self.sends: list[tuple[dist.Work, torch.Tensor]] = []

    def send(self, kind: int, microbatch: int, tensor: torch.Tensor) -> None:
        """Send to the stage that receives `kind` from this one (next for activations, previous for gradients)."""
        dst = self.peer[GRADIENT if kind == ACTIVATION else ACTIVATION]
        tensor = tensor.detach().contiguous()
        if kind not in self.sent_header:
            header = torch.zeros(_HEADER, dtype=torch.int64)
            header[0] = tensor.dim()
            header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
            header[-1] = _DTYPES.index(tensor.dtype)
            header = header.to(self.device)
            dist.send(header, dst, group=self.group, tag=kind + 2)
            self.sent_header.add(kind)
        self.sends.append((dist.isend(tensor, dst, group=self.group, tag=_tag(kind, microbatch)), tensor))

    def _shape(self, kind: int) -> tuple[torch.Size, torch.dtype]:
        if kind not in self.shapes:
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, self.peer[kind], group=self.group, tag=kind + 2)
            ndim = int(header[0])
            self.shapes[kind] = (torch.Size(header[1 : 1 + ndim].tolist()), _DTYPES[int(header[-1])])
        return self.shapes[kind]

    def prefetch(self, kind: int, microbatches: list[int]) -> None:
        """Post receives for these microbatches now (once the shape is known)."""
        if kind not in self.shapes:
            return
        shape, dtype = self.shapes[kind]
        for microbatch in microbatches:
            if (kind, microbatch) not in self.posted:
                buffer = torch.empty(shape, dtype=dtype, device=self.device)
                work = dist.irecv(buffer, self.peer[kind], group=self.group, tag=_tag(kind, microbatch))
                self.posted[(kind, microbatch)] = (work, buffer)

    def has(self, kind: int, microbatch: int) -> bool:
        return True

    def recv(self, kind: int, microbatch: int) -> torch.Tensor:
        """The `kind` tensor of `microbatch` from the neighbour that sends it (blocks until it arrives)."""
        self._shape(kind)
        self.prefetch(kind, [microbatch])
        work, buffer = self.posted.pop((kind, microbatch))
        work.wait()
        return buffer

    def finish_sends(self) -> None:
        """Wait until every send so far has completed."""
        for work, _ in self.sends:
            work.wait()
        self.sends.clear()


class LocalTransport:
    """Mailboxes between stages that all live in this process (the single-process emulation)."""

    def __init__(self, mailbox: dict[tuple[int, int, int], torch.Tensor], stage: int) -> None:
        self.mailbox = mailbox
        self.stage = stage

    def send(self, kind: int, microbatch: int, tensor: torch.Tensor) -> None:
        destination = self.stage + 1 if kind == ACTIVATION else self.stage - 1
        self.mailbox[(destination, kind, microbatch)] = tensor.detach().clone()

    def has(self, kind: int, microbatch: int) -> bool:
        return (self.stage, kind, microbatch) in self.mailbox

    def recv(self, kind: int, microbatch: int) -> torch.Tensor:
        return self.mailbox.pop((self.stage, kind, microbatch))

    def prefetch(self, kind: int, microbatches: list[int]) -> None:
        pass

    def finish_sends(self) -> None:
        pass
