"""A per-rank log of the communication a process issues, in issue order.

Enabled by the environment variable `TITAN_ASYNC_COMM_LOG` (a directory; each rank
appends JSON lines to `rank<R>.jsonl` there). It wraps torch.distributed's Python
entry points (both the `torch.distributed` and `distributed_c10d` names, so torch's
own helpers are seen too) and records, per call:

- `{"op": "send"|"recv", "id", "group", "peer", "bytes"}` for isend/irecv/send/recv;
- `{"op": "batch", "id", "group", "ops": [{"op", "peer", "bytes"}, ...]}` for batch_isend_irecv
  (one coalesced launch, as NCCL runs it);
- `{"op": "coll", "id", "group", "kind", "bytes"}` for collectives;
- `{"op": "wait", "id", "stream"}` when the work of operation `id` is waited on (blocking calls
  record their operation and a wait): `"stream": "compute"` when the wait orders the compute
  stream after the work (every wait on CUDA unless made on a side stream), `"side"` when it
  was made inside `on_side_stream` and orders only that side stream;
- `{"op": "group", "group", "ranks"}` once per process group, its global ranks;
- `{"op": "compute", "action"}` when a pipeline action is issued (`trace.Timeline` names:
  `<stage>F<k>`, `<stage>B<k>`, `<stage>O<step>`), `{"op": "step", "step"}` when a training step
  starts and `{"op": "drain"}` when a streaming schedule drains (`note`): what a replay in device
  time needs besides the communication.
- Under the stream model (`TITAN_ASYNC_STREAM_MODEL`), the issue edges: every operation's
  `"after"` (the compute stream's position its stream is ordered after when it is issued) and
  `"writes"` (the latest position of the compute stream that wrote one of its tensors), and every
  compute marker's `"position"` (the compute stream's position when the action is issued; its
  kernels come after it). An operation issued from a stream that never waited for the compute
  stream has `after` < `writes`: it may read its tensors before they are written.

Peers are global ranks. torch 2.15's FSDP2 gathers and reduces through
`all_gather_single` and `reduce_scatter_single`, which are recorded like the others.
Functional collectives (`torch.ops._c10d_functional`: what DTensor redistributions and
expert parallelism's token all-to-alls issue, also from autograd's backward) are recorded
as blocking collectives of their op's name (`all_to_all_single`, ...): each is waited on
before anything else the rank issues uses its result, and recording the wait at once is the
stricter order for the NCCL model. The log is what a model of NCCL's ordering rules replays
(tests) and what communication accounting counts.
"""

from __future__ import annotations

import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from titan_async.core import stream_model

ENVIRONMENT_VARIABLE = "TITAN_ASYNC_COMM_LOG"
_P2P = ("isend", "irecv", "send", "recv")
_COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "barrier", "all_to_all_single", "reduce", "gather", "scatter",
    "all_gather_single", "reduce_scatter_single",
)
# Ops of torch.ops._c10d_functional (tensor in, tensor out; the group by name).
_FUNCTIONAL = ("all_to_all_single", "all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor")


def _bytes(tensors) -> int:
    if isinstance(tensors, torch.Tensor):
        return tensors.numel() * tensors.element_size()
    if isinstance(tensors, (list, tuple)):
        return sum(_bytes(t) for t in tensors)
    return 0


class _RecordedWork:
    """A work handle that records its wait."""

    def __init__(self, work, op_id: int, log: CommLog) -> None:
        self._work, self._id, self._log = work, op_id, log

    def wait(self, *args, **kwargs):
        self._log.write_wait(self._id)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class CommLog:
    """Records this process's distributed calls to `path` (see module docstring)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", buffering=1)
        self.lock = threading.Lock()
        self.next_id = 0
        self.groups: set[str] = set()
        self.local = threading.local()

    def write(self, record: dict) -> None:
        with self.lock:
            self.file.write(json.dumps(record) + "\n")

    def write_wait(self, op_id: int) -> None:
        self.write({"op": "wait", "id": op_id, "stream": "side" if getattr(self.local, "side", False) else "compute"})

    def new_id(self) -> int:
        with self.lock:
            self.next_id += 1
            return self.next_id

    def group(self, group) -> str:
        group = group or c10d._get_default_group()
        name = group.group_name
        if name not in self.groups:
            self.groups.add(name)
            self.write({"op": "group", "group": name, "ranks": dist.get_process_group_ranks(group)})
        return name

    def nested(self) -> bool:
        return getattr(self.local, "depth", 0) > 0

    def call(self, record: dict, blocking: bool, function, *args, **kwargs):
        """Record `record` with a new id and its issue edges (`stream_model.issue_edges` of the
        tensors among `args`), run `function` with nested calls unrecorded, and wrap its work (or
        record the wait a blocking call implies)."""
        op_id = self.new_id()
        self.write({**record, "id": op_id, **stream_model.issue_edges(_tensors(args))})
        self.local.depth = getattr(self.local, "depth", 0) + 1
        try:
            result = function(*args, **kwargs)
        finally:
            self.local.depth -= 1
        if blocking:
            self.write_wait(op_id)
            return result
        if isinstance(result, list):
            return [_RecordedWork(work, op_id, self) for work in result]
        return _RecordedWork(result, op_id, self) if result is not None else None


def _tensors(value) -> list[torch.Tensor]:
    """The tensors in `value` (nested lists and tuples, P2P ops)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return _tensors(value.tensor) if isinstance(value, dist.P2POp) else []


def _peer(args, kwargs, name: str) -> int:
    """The global rank of the peer of an isend/irecv/send/recv call."""
    group = kwargs.get("group", args[2] if len(args) > 2 else None)
    key = "dst" if name in ("isend", "send") else "src"
    peer = kwargs.get(key, args[1] if len(args) > 1 else None)
    if peer is None:
        local = kwargs.get(f"group_{key}")
        peer = dist.get_global_rank(group or c10d._get_default_group(), local)
    return peer


def _wrap_p2p(log: CommLog, name: str, original):
    def wrapper(*args, **kwargs):
        if log.nested():
            return original(*args, **kwargs)
        tensor = kwargs.get("tensor", args[0] if args else None)
        group = kwargs.get("group", args[2] if len(args) > 2 else None)
        record = {"op": "send" if name in ("isend", "send") else "recv", "group": log.group(group),
                  "peer": _peer(args, kwargs, name), "bytes": _bytes(tensor)}
        return log.call(record, name in ("send", "recv"), original, *args, **kwargs)

    return wrapper


def _wrap_batch(log: CommLog, original):
    def wrapper(p2p_op_list):
        if log.nested():
            return original(p2p_op_list)
        ops = [
            {"op": "send" if op.op in (dist.isend, c10d.isend) else "recv", "peer": op.peer, "bytes": _bytes(op.tensor)}
            for op in p2p_op_list
        ]
        return log.call({"op": "batch", "group": log.group(p2p_op_list[0].group), "ops": ops}, False, original, p2p_op_list)

    return wrapper


def _wrap_collective(log: CommLog, name: str, original):
    def wrapper(*args, **kwargs):
        if log.nested():
            return original(*args, **kwargs)
        record = {"op": "coll", "kind": name, "group": log.group(kwargs.get("group")), "bytes": _bytes(args[0] if args else None)}
        return log.call(record, not kwargs.get("async_op", False), original, *args, **kwargs)

    return wrapper


class _LoggedFunctionalOp:
    """A functional collective op packet whose calls, `packet(input, ..., group_name)` returning
    the output tensor, are logged; its attributes (`.default` and the other overloads, which
    libraries such as torchao look up and compare) are the original packet's."""

    def __init__(self, log: CommLog, name: str, packet) -> None:
        self._log, self._name, self._packet = log, name, packet

    def __call__(self, *args, **kwargs):
        if self._log.nested():
            return self._packet(*args, **kwargs)
        group = c10d._resolve_process_group(kwargs.get("group_name", args[-1]))
        record = {"op": "coll", "kind": self._name, "group": self._log.group(group), "bytes": _bytes(args[0])}
        return self._log.call(record, True, self._packet, *args, **kwargs)

    def __getattr__(self, attribute: str):
        return getattr(self._packet, attribute)


_installed: CommLog | None = None


@contextmanager
def on_side_stream(stream_context):
    """Enter `stream_context` (a side stream, or nothing on the CPU); the waits made inside are
    logged as the side stream's, which orders no compute."""
    log = _installed
    if log is not None:
        log.local.side = True
    try:
        with stream_context:
            yield
    finally:
        if log is not None:
            log.local.side = False


def note(record: dict) -> None:
    """Write `record` (compute, step and drain markers) when the log is installed; a compute
    marker carries the compute stream's position (`stream_model.compute_position`)."""
    if _installed is not None:
        _installed.write({**record, **stream_model.compute_position()} if record["op"] == "compute" else record)


def install(directory: Path, rank: int) -> CommLog:
    """Record this process's communication into `directory/rank<rank>.jsonl` (idempotent). A
    function an older torch lacks (torch 2.11 has no `all_gather_single`) is left out."""
    global _installed
    if _installed is not None:
        return _installed
    log = CommLog(Path(directory) / f"rank{rank}.jsonl")
    for name in _P2P + _COLLECTIVES + ("batch_isend_irecv",):
        original = getattr(c10d, name, None)
        if original is None:
            continue
        if name == "batch_isend_irecv":
            wrapped = _wrap_batch(log, original)
        elif name in _P2P:
            wrapped = _wrap_p2p(log, name, original)
        else:
            wrapped = _wrap_collective(log, name, original)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    functional = torch.ops._c10d_functional
    for name in _FUNCTIONAL:
        # Python callers look the op up on the namespace at each call.
        setattr(functional, name, _LoggedFunctionalOp(log, name, getattr(functional, name)))
    _installed = log
    return log


def install_from_environment() -> CommLog | None:
    """`install` into $TITAN_ASYNC_COMM_LOG for this process's $RANK, if that variable is set."""
    directory = os.environ.get(ENVIRONMENT_VARIABLE)
    return install(Path(directory), int(os.environ.get("RANK", "0"))) if directory else None
