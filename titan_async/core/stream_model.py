"""CUDA's stream semantics on the CPU: the streams, events, stream contexts, cross-stream waits,
non-blocking copies, pinned buffers and `record_stream` calls of `titan_async.core.streams`, executed
in issue order, and (once `enable`d) a checker that reports every cross-stream use of memory that
no happens-before edge orders: a race, naming both sides.

The rules modelled, as CUDA and torch 2.15 define them:
- Kernels on one stream run in issue order. The host issues them, so a kernel is ordered after
  every host action (a host write, a synchronize) that came before its issue.
- `a.wait_stream(b)` orders a's later kernels after the kernels issued to b so far;
  `a.wait_event(e)` after those `e` recorded; `e.synchronize()`, `s.synchronize()` and a host
  read of a device value (`.item()`) order the host after them.
- A collective or point-to-point op runs on its process group's stream (one per group for
  collectives, one per group and peer for point-to-point, as ProcessGroupNCCL keys them), which
  waits for the stream current at issue. Its tensors are safe on a stream only once `work.wait()`
  was called there; a blocking call makes that wait on the current stream. Functional collectives
  (`torch.ops._c10d_functional`) are waited by `wait_tensor`.
- A freed block goes back to the pool of the stream that allocated it, whose next allocation may
  reuse it at once (the caching allocator's per-stream pools): every use of the block on another
  stream must be ordered before that allocation, on that stream or on the host, unless
  `record_stream` named that stream (the allocator then delays the reuse until that use ends).
- The host reads pinned memory (`read_pinned`) only once a sync orders it after the copy that
  wrote it; a host read of device memory (`read_now`, `.item()`) waits for the current stream.

Happens-before is kept with vector clocks, one counter per stream and one for the host, as
torch's CUDA sanitizer (torch/cuda/_sanitizer.py) keeps it. Memory is tracked per storage: every
aten op seen by a dispatch mode reads the tensors of its read-only arguments and writes those of
its mutable arguments and its new outputs, on the stream current at issue (DTensors by their local
tensor). `enable` also makes `torch.cpu`'s stream stubs this model's, so FSDP2's own streams on the
CPU (copy-in, all-gather, reduce-scatter) take part. On the CPU every op has run when its call
returns: the model changes no value, it only judges the order.
"""

from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch.distributed._functional_collectives import AsyncCollectiveTensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

HOST = 0
"""The host's index in every clock."""


class StreamRace(RuntimeError):
    """A use of memory on one stream that no happens-before edge orders after a use on another."""


@dataclass(frozen=True)
class Access:
    stream: int
    seq: int
    kind: str  # "read", "write"
    op: str
    where: str

    def describe(self, model: StreamModel) -> str:
        return f"{self.kind} on the {model.names[self.stream]} by {self.op} at {self.where}"


@dataclass
class Block:
    """The uses of one storage since its allocation."""

    storage: StorageWeakRef
    """Which storage (an address is reused once its storage is freed), and whether it was freed."""
    allocated_on: int | None
    """The stream that allocated it; None where the model did not see the allocation."""
    label: str
    write: Access | None = None
    reads: list[Access] = field(default_factory=list)
    recorded: set[int] = field(default_factory=set)

    def uses(self) -> list[Access]:
        return ([self.write] if self.write else []) + self.reads


class ModelStream:
    """A stream of the model (the `torch.cpu.Stream` signature, so that FSDP2 can create one)."""

    def __init__(self, priority: int = 0, name: str | None = None, model: StreamModel | None = None) -> None:
        self.model = model or MODEL
        self.clock: dict[int, int] = {}
        self.index = self.model._register(self, name or f"stream {len(self.model.names)} (made at {_where()})")
        self.priority = priority

    @property
    def name(self) -> str:
        return self.model.names[self.index]

    def wait_stream(self, other: ModelStream) -> None:
        if isinstance(other, ModelStream):
            _join(self.clock, other.clock)

    def wait_event(self, event: ModelEvent) -> None:
        if isinstance(event, ModelEvent) and event.clock is not None:
            _join(self.clock, event.clock)

    def record_event(self, event: ModelEvent | None = None) -> ModelEvent:
        event = event or ModelEvent(model=self.model)
        event.record(self)
        return event

    def synchronize(self) -> None:
        _join(self.model.host, self.clock)

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<model stream: {self.name}>"


class ModelEvent:
    """An event of the model (`torch.cpu.Event`'s and `torch.cuda.Event`'s signatures)."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False,
                 model: StreamModel | None = None) -> None:
        self.model = model or MODEL
        self.clock: dict[int, int] | None = None
        self.time: float | None = None

    def record(self, stream: ModelStream | None = None) -> None:
        stream = stream or self.model.current()
        self.model.issue(stream)
        self.clock, self.time = dict(stream.clock), time.time()

    def wait(self, stream: ModelStream | None = None) -> None:
        (stream or self.model.current()).wait_event(self)

    def synchronize(self) -> None:
        if self.clock is not None:
            _join(self.model.host, self.clock)

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: ModelEvent) -> float:
        """Milliseconds between the two records (host time: on the CPU an op has run when issued)."""
        return (end.time - self.time) * 1e3


class StreamModel:
    """The streams of this process, their clocks and, while checking, the uses of memory."""

    def __init__(self) -> None:
        self.names: list[str] = ["host"]
        self.streams: list[ModelStream | None] = [None]
        self.host: dict[int, int] = {HOST: 0}
        self.local = threading.local()
        self.compute = ModelStream(name="compute stream", model=self)
        self.comm_streams: dict[tuple, ModelStream] = {}
        self.blocks: dict[int, Block] = {}
        self.shared: dict[int, tuple[int, Block]] = {}
        """Blocks used on a stream other than their allocator's, until the program frees them."""
        self.pools: dict[int, list[Block]] = {}
        """Per stream, the blocks of `shared` freed since the stream's last allocation."""
        self.works: dict[int, tuple[object, dict[int, int]]] = {}
        self.functional: dict[int, dict[int, int]] = {}
        self.checking = False
        self.races: list[str] = []
        self.raise_on_race = True

    def _register(self, stream: ModelStream, name: str) -> int:
        self.names.append(name)
        self.streams.append(stream)
        return len(self.names) - 1

    # -- the backend interface of titan_async.core.streams ---------------------------------------

    def current(self) -> ModelStream:
        return getattr(self.local, "stream", None) or self.compute

    def new_stream(self, name: str) -> ModelStream:
        return ModelStream(name=name, model=self)

    @contextmanager
    def use(self, stream: ModelStream | None):
        """Make `stream` current in this thread (None: leave it), as `torch.cuda.stream` does."""
        if stream is None:
            yield
            return
        previous = getattr(self.local, "stream", None)
        self.local.stream = stream
        try:
            yield
        finally:
            self.local.stream = previous

    def event(self, timing: bool = False) -> ModelEvent:
        return ModelEvent(enable_timing=timing, model=self)

    def pinned_like(self, value: torch.Tensor) -> torch.Tensor:
        """A host buffer for `value` (page-locked on a GPU)."""
        return torch.empty(value.shape, dtype=value.dtype)

    def read_pinned(self, tensor: torch.Tensor) -> list:
        """`tensor` (pinned host memory) as a list, read by the host now."""
        if self.checking:
            self._access(tensor, HOST, self._host_issue(), "read", "host read", _where())
        return tensor.tolist()

    def read_now(self, tensor: torch.Tensor) -> list:
        """`tensor` (device memory) as a list: copied on the current stream, which the host waits for."""
        if self.checking:
            stream = self.current()
            self._access(tensor, stream.index, self.issue(stream), "read", "copy to the host", _where())
            _join(self.host, stream.clock)
        return tensor.tolist()

    def to_device(self, tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`tensor` (host memory) on `device`: written by the host into a pinned buffer, copied on the
        current stream; the buffer is reused only once the copy has run (CUDA's pinned allocator
        records an event for it)."""
        pinned = self.pinned_like(tensor)
        with torch.utils._python_dispatch._disable_current_modes():  # the host's write, not a kernel
            pinned.copy_(tensor)
        if self.checking:
            self._block(pinned, allocated_on=HOST)
            self._access(pinned, HOST, self._host_issue(), "write", "host write", _where())
        copy = pinned.to(device, copy=True)
        self.record_stream(pinned, self.current())  # the pinned allocator records the copy's stream
        return copy

    def record_stream(self, tensor: torch.Tensor, stream: ModelStream) -> None:
        """The block of `tensor` is used on `stream`: the allocator delays its reuse until that use ends."""
        if self.checking and (block := self._block(tensor)) is not None:
            block.recorded.add(stream.index)

    # -- clocks --------------------------------------------------------------------------------

    def issue(self, stream: ModelStream) -> int:
        """Issue one operation on `stream`: ordered after the host's past and the stream's queue."""
        _join(stream.clock, self.host)
        stream.clock[stream.index] = stream.clock.get(stream.index, 0) + 1
        return stream.clock[stream.index]

    def _host_issue(self) -> int:
        self.host[HOST] += 1
        return self.host[HOST]

    def _clock_of(self, stream: int) -> dict[int, int]:
        return self.host if stream == HOST else self.streams[stream].clock

    def synchronize(self) -> None:
        """The host waits for every stream (`torch.cuda.synchronize`)."""
        for stream in self.streams[1:]:
            _join(self.host, stream.clock)

    def comm_stream(self, group: str, peer: int | None) -> ModelStream:
        key = (group, peer)
        if key not in self.comm_streams:
            name = f"stream of group {group}" + (f" to peer {peer}" if peer is not None else "")
            self.comm_streams[key] = ModelStream(name=name, model=self)
        return self.comm_streams[key]

    # -- memory --------------------------------------------------------------------------------

    def _block(self, tensor: torch.Tensor, allocated_on: int | None = None) -> Block | None:
        """The block of `tensor`'s storage (None for what holds no CPU memory): new where the
        model saw no block at its address or the storage there was freed, allocated on
        `allocated_on` (an allocation the model sees) or an unknown stream."""
        storage = _storage(tensor)
        if storage is None:
            return None
        key = storage.data_ptr()
        block = self.blocks.get(key)
        if allocated_on is not None or block is None or block.storage.cdata != storage._cdata or block.storage.expired():
            block = self.blocks[key] = Block(StorageWeakRef(storage), allocated_on, _label(tensor))
        return block

    def current_block(self, tensor: torch.Tensor) -> Block | None:
        """The block the model tracks for `tensor`'s storage, if any."""
        storage = _storage(tensor)
        block = self.blocks.get(storage.data_ptr()) if storage is not None else None
        return block if block is not None and block.storage.cdata == storage._cdata else None

    def _collect_frees(self) -> None:
        """Blocks the program freed since the last op go back to their allocator's pool."""
        freed = [entry for entry in self.shared.values() if entry[1].storage.expired()]
        for key, block in freed:
            del self.shared[id(block)]
            if self.blocks.get(key) is block:
                del self.blocks[key]
            self.pools.setdefault(block.allocated_on, []).append(block)

    def _check_reuse(self, stream: int, where: str) -> None:
        """An allocation on `stream` may reuse any block freed to its pool: every use of such a
        block on another stream must be ordered before it, or named by `record_stream`."""
        clock = dict(self._clock_of(stream))
        _join(clock, self.host)
        for block in self.pools.pop(stream, []):
            for use in block.uses():
                if use.stream not in (stream, *block.recorded) and clock.get(use.stream, 0) < use.seq:
                    self._race(f"{block.label} allocated on the {self.names[stream]} was freed and its block may be "
                               f"reused by an allocation at {where} while its {use.describe(self)} may still run: "
                               f"no wait, event or record_stream orders the reuse after that use")
                    break

    def _access(self, tensor: torch.Tensor, stream: int, seq: int, kind: str, op: str, where: str) -> None:
        block = self._block(tensor)
        if block is None:
            return
        if block.allocated_on not in (None, stream):
            self.shared.setdefault(id(block), (_storage_key(tensor), block))
        access = Access(stream, seq, kind, op, where)
        clock = self._clock_of(stream)
        earlier = block.uses() if kind == "write" else [block.write] if block.write else []
        for use in earlier:
            if use.stream != stream and clock.get(use.stream, 0) < use.seq:
                self._race(f"{block.label}: {access.describe(self)} is not ordered after its {use.describe(self)}")
                break
        if kind == "write":
            block.write, block.reads = access, []
        else:
            block.reads.append(access)

    def _race(self, message: str) -> None:
        self.races.append(message)
        if self.raise_on_race:
            raise StreamRace(f"stream race: {message}")

    # -- what the dispatch mode sees -----------------------------------------------------------

    def kernel(self, func, args, kwargs, out, stream: ModelStream, issuer: ModelStream | None = None) -> None:
        """Record `func`'s reads and writes on `stream` (issued now). New outputs are allocated on
        `issuer` (the stream current at issue; `stream` if None). A process group's stream
        (`stream` not `issuer`) holds the tensors it uses until its work completes (ProcessGroupNCCL
        stashes them), as `record_stream` would."""
        if func in _METADATA_ONLY or func.is_view:
            return
        name, where = func._schema.name, _where()
        if self.shared:
            self._collect_frees()
        issuer = issuer or stream
        seq = self.issue(stream)
        written, read = _arguments(func, args, kwargs)
        inputs = {_storage_key(t) for t in written + read}
        fresh = [t for t in _tensors(out) if _storage_key(t) not in inputs]
        if fresh and issuer.index in self.pools:
            self._check_reuse(issuer.index, where)
        for tensor in fresh:
            self._block(tensor, allocated_on=issuer.index)
        for kind, tensors in (("read", read), ("write", written + fresh)):
            for tensor in tensors:
                self._access(tensor, stream.index, seq, kind, name, where)
                if issuer is not stream:
                    self.record_stream(tensor, stream)
        if func is torch.ops.aten._local_scalar_dense.default:
            _join(self.host, stream.clock)

    def collective(self, func, args, kwargs):
        """A c10d op: on its group's stream, which waits for the current stream; its work, once
        waited on a stream, orders that stream after it."""
        group, peer = _group_and_peer(func, args)
        stream = self.comm_stream(group, peer)
        stream.wait_stream(self.current())
        out = func(*args, **kwargs)
        self.kernel(func, args, kwargs, out, stream, issuer=self.current())
        works = [o for o in _flat(out) if isinstance(o, torch.ScriptObject)]
        for boxed in works:
            work = torch._C._distributed_c10d.Work.unbox(boxed)
            self.works[id(work)] = (work, dict(stream.clock))
        return out

    def functional_collective(self, func, args, kwargs):
        """A `_c10d_functional` op: on its group's stream; `wait_tensor` of its output waits for it."""
        if func in (torch.ops._c10d_functional.wait_tensor.default, torch.ops._c10d_functional.wait_tensors.default):
            out = func(*args, **kwargs)
            for tensor in _tensors(args):
                self.wait_tensor(tensor)
            return out
        if func is torch.ops._c10d_functional._wrap_tensor_autograd.default:
            return func(*args, **kwargs)  # wraps the output in an AsyncCollectiveTensor, which waits at its first use
        names = [argument.name for argument in func._schema.arguments]
        group = kwargs.get("group_name", args[names.index("group_name")] if len(args) > names.index("group_name") else None)
        stream = self.comm_stream(group if isinstance(group, str) else getattr(group, "group_name", "?"), None)
        stream.wait_stream(self.current())
        out = func(*args, **kwargs)
        self.kernel(func, args, kwargs, out, stream, issuer=self.current())
        for tensor in _tensors(out):
            self.functional[_storage_key(tensor)] = dict(stream.clock)
        return out

    def wait_tensor(self, tensor: torch.Tensor) -> None:
        """The current stream waits for the functional collective that produced `tensor`."""
        clock = self.functional.get(_storage_key(tensor))
        if clock is not None:
            _join(self.current().clock, clock)

    def waited(self, work) -> None:
        """`work.wait()` on the current stream (the first wait of a work: the model lets it go then)."""
        entry = self.works.pop(id(work), None)
        if entry is not None and entry[0] is work:
            _join(self.current().clock, entry[1])


_METADATA_ONLY = (torch.ops.aten.set_.source_Storage, torch.ops.aten.set_.source_Storage_storage_offset,
                  torch.ops.aten.set_.source_Tensor, torch.ops.aten.set_.default, torch.ops.aten.resize_.default)
"""Ops that change which memory a tensor views, not the memory."""


def _join(clock: dict[int, int], other: dict[int, int]) -> None:
    for stream, seq in other.items():
        if clock.get(stream, 0) < seq:
            clock[stream] = seq


def _flat(value) -> list:
    if isinstance(value, (list, tuple)):
        return [item for v in value for item in _flat(v)]
    return [value]


def _local(tensor):
    """The plain tensor holding a DTensor's or an AsyncCollectiveTensor's values."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor._local_tensor
    return tensor.elem if isinstance(tensor, AsyncCollectiveTensor) else tensor


def _tensors(value) -> list[torch.Tensor]:
    return [_local(v) for v in _flat(value) if isinstance(v, torch.Tensor)]


def _storage(tensor: torch.Tensor) -> torch.UntypedStorage | None:
    """The storage `tensor` uses, or None for what holds no CPU memory."""
    if type(tensor) is not torch.Tensor and not isinstance(tensor, torch.nn.Parameter):
        return None
    if tensor.device.type != "cpu" or tensor.is_sparse or tensor.numel() == 0:
        return None
    storage = tensor.untyped_storage()
    return storage if storage.data_ptr() else None


def _storage_key(tensor: torch.Tensor) -> int | None:
    """The address of `tensor`'s storage, or None for what holds no CPU memory."""
    storage = _storage(tensor)
    return storage.data_ptr() if storage is not None else None


def _arguments(func, args, kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The tensors `func` writes and reads: by its schema's mutable arguments; c10d's schemas mark
    none, so there every tensor but an input (or what `send` sends) is written."""
    written, read = [], []
    c10d = func.namespace == "c10d"
    for index, argument in enumerate(func._schema.arguments):
        if index < len(args):
            value = args[index]
        elif argument.name in kwargs:
            value = kwargs[argument.name]
        else:
            continue
        if c10d:
            mutable = "input" not in argument.name and func._schema.name != "c10d::send"
        else:
            mutable = argument.alias_info is not None and argument.alias_info.is_write
        (written if mutable else read).extend(_tensors(value))
    return written, read


def _group_and_peer(func, args) -> tuple[str, int | None]:
    group = "?"
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            try:
                group = torch._C._distributed_c10d.ProcessGroup.unbox(arg).group_name
                break
            except Exception:
                continue
    if func._schema.name in ("c10d::send", "c10d::recv_"):
        return group, int(args[2])
    return group, None


def _label(tensor: torch.Tensor) -> str:
    return f"a {tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')} tensor"


_OWN = ("titan_async/core/stream_model.py", "titan_async/core/streams.py", "titan_async/core/comm_log.py", "contextlib.py")


def _where() -> str:
    """Where the program issued the op: its innermost frame outside torch and this model, after
    the innermost frame of torch.distributed (FSDP, c10d) when one came between."""
    library = None
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename.replace("\\", "/")
        location = f"{'/'.join(path.split('/')[-2:])}:{frame.f_lineno}"
        if "/torch/distributed/" in path:
            library = library or location
        elif "/torch/" not in path and not path.endswith(_OWN):
            return f"{location} (in {library})" if library else location
        frame = frame.f_back
    return library or "?"


class _Checker(TorchDispatchMode):
    """Sees every op this thread runs and records it in the model."""

    def __init__(self, model: StreamModel) -> None:
        super().__init__()
        self.model = model

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        model = self.model
        for tensor in _flat((args, list(kwargs.values()))):
            if isinstance(tensor, AsyncCollectiveTensor) and not tensor.completed:  # its dispatch waits (unseen here)
                model.wait_tensor(tensor.elem)
        if func.namespace == "c10d":
            return model.collective(func, args, kwargs)
        if func.namespace == "_c10d_functional":
            return model.functional_collective(func, args, kwargs)
        out = func(*args, **kwargs)
        model.kernel(func, args, kwargs, out, model.current())
        return out


def issue_edges(tensors: list[torch.Tensor]) -> dict[str, int]:
    """For the comm log, while checking: the compute stream's position that an operation issued
    now on `tensors` is ordered after (its process group's stream waits for the current stream,
    which is ordered after the host's past), and the latest position of the compute stream that
    wrote one of `tensors`."""
    model = MODEL
    if not model.checking:
        return {}
    clock = dict(model.current().clock)
    _join(clock, model.host)
    compute = model.compute.index
    writes = [block.write.seq for tensor in tensors if (block := model.current_block(_local(tensor))) is not None
              and block.write is not None and block.write.stream == compute]
    return {"after": clock.get(compute, 0), "writes": max(writes, default=0)}


def compute_position() -> dict[str, int]:
    """For the comm log, while checking: the compute stream's position (its latest kernel)."""
    return {"position": MODEL.compute.clock.get(MODEL.compute.index, 0)} if MODEL.checking else {}


MODEL = StreamModel()
"""This process's model: the CPU backend of `titan_async.core.streams`."""

_installed: _Checker | None = None


def enable(raise_on_race: bool = True) -> StreamModel:
    """Check this thread's ops against the model from now on (idempotent); FSDP2's streams on the
    CPU and `Work.wait` become the model's."""
    global _installed
    MODEL.raise_on_race = raise_on_race
    if _installed is not None:
        return MODEL
    import torch.cpu

    torch.cpu.Stream = ModelStream
    torch.cpu.Event = ModelEvent
    torch.cpu.current_stream = lambda device=None: MODEL.current()
    torch.cpu.stream = MODEL.use
    torch.cpu.synchronize = lambda device=None: MODEL.synchronize()
    work_class = torch._C._distributed_c10d.Work
    original_wait = work_class.wait

    def wait(self, *args, **kwargs):
        MODEL.waited(self)  # before: gloo's wait may copy the result on the current stream
        return original_wait(self, *args, **kwargs)

    work_class.wait = wait
    _installed = _Checker(MODEL)
    _installed.__enter__()
    MODEL.checking = True
    return MODEL
