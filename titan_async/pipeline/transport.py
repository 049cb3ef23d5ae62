"""Point-to-point transport of activations and gradients between neighbouring stages.

Correct under NCCL's rules by construction (../shared/DESIGN.md section 7: point-to-point
operations between two ranks on one communicator run in issue order on one stream, and
tags are ignored):

- One communicator per direction of each pipeline edge (torch's directed rank-edge groups,
  `torch.distributed.pipelining._p2p._build_p2p_edge_groups`). Each carries one kind of
  message from one sender to one receiver: activations s -> s+1, gradients s+1 -> s.
- Both ends of a communicator issue its messages in the same order: for activations the
  first message is a shape header, then the tensors in the order the receiver's actions
  consume them (microbatch order, which is also the order the sender produces them).
  Gradients have no header: a gradient has the shape and dtype of the activation it answers.
- Receives are posted only for messages the receiver's action lists will consume (`expect`),
  in that order, at most `depth` ahead; each is waited right before its tensor is used. With
  fewer microbatches per window than in flight (m < w) a gradient sent in one window is
  consumed in the next: it is expected (and its receive posted) in the window that sends
  it, so no send waits across a step boundary. No receive is left posted across a drain,
  so validation traffic cannot match a receive meant for training.
- A receive is posted only once this rank has issued every send the peer consumes before it
  sends that message (`expect`'s second number; as torch's `_batch_p2p` pairs a receive with
  the send before it). On NCCL a posted receive is a kernel that spins until its message
  arrives, and a device-wide synchronisation (an allocator retry after an out-of-memory,
  `empty_cache`, `synchronize`) waits for it: were it posted ahead of a send it depends on,
  a synchronisation before that send would never end.
- At most `depth` sends per direction are outstanding: a new send first waits for the
  oldest, and a drain waits for all. Each sent tensor is held until its send is waited.

So every wait, and every posted receive, is on a message whose matching operation the peer
issues without waiting for anything this rank issues later, and per rank at most `depth`
receive buffers and `depth` sent tensors are live per direction. A stage with w microbatches
in flight uses depth = w + 1 (`depth_for`).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from titan_async.core import streams

ACTIVATION, GRADIENT = 0, 1
_HEADER = 8
_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


def depth_for(stage: int, num_stages: int) -> int:
    """Receives posted ahead and sends outstanding per direction for `stage`: w + 1."""
    return num_stages - stage


def edge_groups(group: dist.ProcessGroup, stage_to_rank: dict[int, int], device: torch.device) -> dict[tuple[int, int], dist.ProcessGroup]:
    """(source group rank, destination group rank) -> that direction's communicator (collective: every rank of `group` calls it)."""
    from torch.distributed.pipelining._p2p import _build_p2p_edge_groups

    groups, _ = _build_p2p_edge_groups(group, stage_to_rank, device)
    return groups


class _Inbound:
    """Receives of one kind from one peer on that direction's communicator, in order, each
    posted once `replies` (the sends to the same peer) has sent what it depends on."""

    def __init__(self, peer: int, group: dist.ProcessGroup, device: torch.device, depth: int, replies: _Outbound,
                 headerless: bool = False) -> None:
        """`headerless` (gradients): the messages have the shape and dtype of the `replies` sent."""
        self.peer, self.group, self.device, self.depth, self.replies = peer, group, device, depth, replies
        self.headerless = headerless
        self.meta: tuple[torch.Size, torch.dtype] | None = None
        self.expected: deque[tuple[int, int | None]] = deque()
        self.posted: deque[tuple[int, dist.Work, torch.Tensor]] = deque()

    def _read_header(self) -> None:
        header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
        dist.irecv(header, self.peer, group=self.group).wait()
        values = streams.for_device(self.device).read_now(header)  # one host sync, at the first message of this direction
        self.meta = (torch.Size(values[1 : 1 + values[0]]), _DTYPES[values[-1]])

    def post(self) -> None:
        """Post the expected receives whose dependencies were sent, at most `depth` ahead."""
        if self.meta is None and self.headerless:
            self.meta = self.replies.meta
        if self.meta is None:
            return  # the header is received when the first message is needed (or, headerless, once a reply went)
        shape, dtype = self.meta
        while self.expected and len(self.posted) < self.depth and self.replies.has_sent(self.expected[0][1]):
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            self.posted.append((self.expected.popleft()[0], dist.irecv(buffer, self.peer, group=self.group), buffer))

    def recv(self, microbatch: int) -> torch.Tensor:
        if self.meta is None and not self.headerless:
            self._read_header()
        self.post()
        if not self.posted or self.posted[0][0] != microbatch:
            head = self.posted[0][0] if self.posted else self.expected[0] if self.expected else None
            raise RuntimeError(f"pipeline transport: microbatch {microbatch} requested out of order or before the "
                               f"sends it depends on (next expected, after the send of microbatch: {head})")
        _, work, buffer = self.posted.popleft()
        work.wait()
        self.post()
        return buffer

    def check_idle(self) -> None:
        if self.expected or self.posted:
            raise RuntimeError(f"pipeline transport: receives from rank {self.peer} still expected at a drain")


class _Outbound:
    """Sends of one kind to one peer on that direction's communicator, at most `depth` outstanding."""

    def __init__(self, peer: int, group: dist.ProcessGroup, device: torch.device, depth: int, headerless: bool = False) -> None:
        self.peer, self.group, self.device, self.depth, self.headerless = peer, group, device, depth, headerless
        self.meta: tuple[torch.Size, torch.dtype] | None = None
        self.outstanding: deque[tuple[dist.Work, torch.Tensor]] = deque()
        self.last_sent = -1
        """The latest training microbatch sent (training sends go in increasing order)."""

    def has_sent(self, microbatch: int | None) -> bool:
        return microbatch is None or self.last_sent >= microbatch

    def _isend(self, tensor: torch.Tensor) -> None:
        while len(self.outstanding) >= self.depth:
            self.outstanding.popleft()[0].wait()
        self.outstanding.append((dist.isend(tensor, self.peer, group=self.group), tensor))

    def send(self, microbatch: int | None, tensor: torch.Tensor) -> None:
        """Send `tensor`; `microbatch` None for validation's sends, which no receive waits for."""
        tensor = tensor.detach().contiguous()
        if self.meta is None:
            self.meta = (tensor.shape, tensor.dtype)
            if not self.headerless:
                header = torch.zeros(_HEADER, dtype=torch.int64)
                header[0] = tensor.dim()
                header[1 : 1 + tensor.dim()] = torch.tensor(tensor.shape)
                header[-1] = _DTYPES.index(tensor.dtype)
                self._isend(header.to(self.device))
        elif (tensor.shape, tensor.dtype) != self.meta:
            raise RuntimeError(
                f"pipeline transport: a stage output of shape {tuple(tensor.shape)} {tensor.dtype} after "
                f"{tuple(self.meta[0])} {self.meta[1]}; every microbatch (training and validation) must have the same shape"
            )
        self._isend(tensor)
        if microbatch is not None:
            self.last_sent = max(self.last_sent, microbatch)

    def finish(self) -> None:
        while self.outstanding:
            self.outstanding.popleft()[0].wait()


class P2PTransport:
    """isend/irecv between stage `stage` and its neighbours, one communicator per direction (module docstring)."""

    def __init__(self, groups: dict[tuple[int, int], dist.ProcessGroup], stage: int, num_stages: int, device: torch.device) -> None:
        """`groups`: `edge_groups` of the pipeline group, whose rank s holds stage s."""
        depth = depth_for(stage, num_stages)
        self.inbound: dict[int, _Inbound] = {}
        self.outbound: dict[int, _Outbound] = {}
        if stage > 0:
            self.outbound[GRADIENT] = _Outbound(*_link(groups, stage, stage - 1), device, depth, headerless=True)
            self.inbound[ACTIVATION] = _Inbound(*_link(groups, stage - 1, stage), device, depth, self.outbound[GRADIENT])
        if stage < num_stages - 1:
            self.outbound[ACTIVATION] = _Outbound(*_link(groups, stage, stage + 1), device, depth)
            self.inbound[GRADIENT] = _Inbound(*_link(groups, stage + 1, stage), device, depth, self.outbound[ACTIVATION],
                                              headerless=True)

    def expect(self, kind: int, messages: list[tuple[int, int | None]]) -> None:
        """The next `kind` messages this stage will consume, in order, as (microbatch, the latest
        microbatch this stage must have sent to that peer before the receive is posted, or None)."""
        if kind in self.inbound:
            self.inbound[kind].expected.extend(messages)
            self.inbound[kind].post()

    def has(self, kind: int, microbatch: int) -> bool:
        return True

    def recv(self, kind: int, microbatch: int) -> torch.Tensor:
        """The `kind` tensor of `microbatch`; it must be the next one expected in that direction."""
        return self.inbound[kind].recv(microbatch)

    def send(self, kind: int, microbatch: int, tensor: torch.Tensor, training: bool = True) -> None:
        """Send to the stage that receives `kind` from this one (next for activations, previous for
        gradients), then post the receives from that stage that waited for this send (validation's
        sends, `training` False, are no training send a receive waits for)."""
        self.outbound[kind].send(microbatch if training else None, tensor)
        replies = GRADIENT if kind == ACTIVATION else ACTIVATION
        if replies in self.inbound:
            self.inbound[replies].post()

    def finish_sends(self) -> None:
        """At a drain: wait for every send and check that no receive is left expected."""
        for outbound in self.outbound.values():
            outbound.finish()
        for inbound in self.inbound.values():
            inbound.check_idle()


def _link(groups: dict[tuple[int, int], dist.ProcessGroup], source: int, destination: int) -> tuple[int, dist.ProcessGroup]:
    """(global rank of the other end, communicator) of the directed edge source -> destination."""
    group = groups[(source, destination)]
    return next(r for r in dist.get_process_group_ranks(group) if r != dist.get_rank()), group


class LocalTransport:
    """Mailboxes between stages that all live in this process (the single-process emulation)."""

    def __init__(self, mailbox: dict[tuple[int, int, int], torch.Tensor], stage: int) -> None:
        self.mailbox = mailbox
        self.stage = stage

    def send(self, kind: int, microbatch: int, tensor: torch.Tensor, training: bool = True) -> None:
        destination = self.stage + 1 if kind == ACTIVATION else self.stage - 1
        self.mailbox[(destination, kind, microbatch)] = tensor.detach().clone()

    def has(self, kind: int, microbatch: int) -> bool:
        return (self.stage, kind, microbatch) in self.mailbox

    def recv(self, kind: int, microbatch: int) -> torch.Tensor:
        return self.mailbox.pop((self.stage, kind, microbatch))

    def expect(self, kind: int, microbatches: list[int]) -> None:
        pass

    def finish_sends(self) -> None:
        pass
