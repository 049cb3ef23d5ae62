"""The one place where titan-async adapts torchtitan to the machine it runs on.

On a machine with a CUDA device torchtitan's own defaults (FlexAttention, NCCL) stay. Which
machine this is, and its compute capability, is asked of NVML, never of the CUDA runtime, and
torchtitan's quantization package is imported with CUDA hidden, so that the launcher's
processes stay fork-safe (`cuda_visible`, `cuda_capability`, `fork_keeps_cuda`). On a machine
without one, `configure()` must run before torchtitan is first imported; it makes torchtitan
pick device type "cpu" (and so the gloo backend) and closes the gaps torch 2.15 still has on
CPU: memory statistics, a string-valued `current_device()`, and the PREMUL_SUM reduce-scatter
that gloo rejects. The attention swap for CPU lives in
`titan_async.model.llama` and asks `is_cpu()`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys
import warnings
from types import SimpleNamespace

import torch

_device_type: str | None = None


def configure() -> str:
    """Select and return the device type ("cuda" or "cpu"); idempotent.

    On an NVIDIA GPU node it imports torchtitan's quantization package with CUDA hidden
    (`_import_quantization_without_cuda`).

    Raises RuntimeError if torchtitan was imported first on a CPU-only machine,
    because torchtitan caches the device type at import time.
    """
    global _device_type
    if _device_type is not None:
        return _device_type
    if cuda_visible():
        _device_type = "cuda"
        if not torch.version.hip:
            _import_quantization_without_cuda()
        return _device_type
    if "torchtitan.tools.utils" in sys.modules:
        raise RuntimeError(
            "titan_async.core.platform.configure() must run before torchtitan is imported"
        )
    torch._utils._get_available_device_type = lambda: "cpu"
    torch.cuda.is_available = lambda: False  # torch would ask the CUDA runtime where NVML is absent
    _add_cpu_memory_stats()
    _patch_fsdp_premul_sum()
    _quiet_cpu_warnings()
    torch.set_num_threads(_cpu_threads())
    _device_type = "cpu"
    return _device_type


def cuda_visible() -> bool:
    """Whether this process sees a CUDA device, decided without initialising the CUDA runtime
    where NVML can answer (torch's NVML count, CUDA_VISIBLE_DEVICES applied); no NVIDIA
    management library means no NVIDIA driver, so no device. Only where NVML is present but
    cannot count (MIG devices, ROCm) does the CUDA runtime answer, and processes forked from
    this one then cannot use CUDA (`fork_keeps_cuda`)."""
    if not torch.cuda._is_compiled():
        return False
    if not torch.version.hip:
        count = torch.cuda._device_count_nvml()
        if count >= 0:
            return count > 0
        try:
            ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return False
    return torch._C._cuda_getDeviceCount() > 0


def cuda_capability() -> tuple[int, int] | None:
    """(major, minor) compute capability of the first visible CUDA device (CUDA_VISIBLE_DEVICES
    applied), by NVML, never the CUDA runtime; None where NVML cannot say (no NVML, MIG, ROCm)."""
    if torch.version.hip:
        return None
    try:
        index = torch.cuda._get_nvml_device_index(0)
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
        if (nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0
                or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0):
            return None
        return major.value, minor.value
    except (OSError, RuntimeError, AttributeError, IndexError, TypeError, ValueError):
        return None


def fork_keeps_cuda() -> bool:
    """Whether a process forked from this one could use CUDA: False once this process has made
    a CUDA runtime call (torch marks every child forked after one). Asked of a child that exits
    at once (a fork costs milliseconds: its memory is shared until written)."""
    pid = os.fork()
    if pid == 0:
        os._exit(int(forked_after_cuda()))
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 0


def forked_after_cuda() -> bool:
    """Whether this process was forked from one that had made a CUDA runtime call: its first
    CUDA call would fail ("Cannot re-initialize CUDA in forked subprocess")."""
    return bool(getattr(torch._C, "_cuda_isInBadFork", lambda: False)())


def _import_quantization_without_cuda() -> None:
    """Import torchtitan's quantization package (torchtitan's trainer imports it) as a machine
    without CUDA would: the torchao modules under it ask at import whether the GPU suits their
    kernels (torch's Triton check `has_triton`, compute-capability checks), each a CUDA runtime
    call, which a launcher must not make. Every process imports it so, so that workers forked
    from a launcher (which inherit its modules) and workers started afresh see the same. What
    the modules then leave out serves torchao's MoE, MX and NVFP4 recipes, which titan-async does
    not offer. torchtitan's device type is fixed first, with CUDA visible."""
    import torchtitan.tools.utils  # noqa: F401
    from torch.utils._triton import has_triton

    available = torch.cuda.is_available
    torch.cuda.is_available = lambda: False
    try:
        import torchtitan.components.quantization  # noqa: F401
    finally:
        torch.cuda.is_available = available
        has_triton.cache_clear()


def is_cpu() -> bool:
    """True once `configure()` chose the CPU."""
    return configure() == "cpu"


def set_cpu_threads() -> None:
    """Size torch's intra-op pool for this process on the CPU (again in a worker forked from a
    launcher that configured itself as one process)."""
    if is_cpu():
        torch.set_num_threads(_cpu_threads())


def _cpu_threads() -> int:
    """Intra-op threads per process: the cores this process may run on (its affinity, so that
    `taskset` confines a run), shared by the local workers."""
    local_workers = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, cores // local_workers)


class _ResidentMemory:
    """Process resident memory, standing in for the CUDA allocator statistics."""

    def __init__(self) -> None:
        self.peak = 0

    @staticmethod
    def current() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()

    def stats(self, device=None) -> dict[str, int]:
        now = self.current()
        self.peak = max(self.peak, now)
        return {
            "active_bytes.all.peak": self.peak,
            "reserved_bytes.all.peak": self.peak,
            "num_alloc_retries": 0,
            "num_ooms": 0,
        }

    def reset_peak(self, device=None) -> None:
        self.peak = self.current()


def _add_cpu_memory_stats() -> None:
    """Give `torch.cpu` the memory functions torchtitan's monitor calls."""
    memory = _ResidentMemory()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    cpu = torch.cpu
    cpu.get_device_name = lambda device=None: "cpu"
    cpu.get_device_properties = lambda device=None: SimpleNamespace(
        total_memory=total, name="cpu"
    )
    cpu.memory_stats = memory.stats
    cpu.reset_peak_memory_stats = memory.reset_peak
    cpu.empty_cache = lambda: None
    cpu.current_device = lambda: 0


class DropMessages(logging.Filter):
    """Drops log records that contain any of the given fragments."""

    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(fragment in message for fragment in self.fragments)


def _quiet_cpu_warnings() -> None:
    """Silence warnings that only say the machine has no GPU."""
    logging.getLogger().addFilter(DropMessages("lspci", "Peak flops undefined"))
    warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support on cpu")


def _patch_fsdp_premul_sum() -> None:
    """Make FSDP2 reduce-scatter with SUM and divide afterwards.

    FSDP2 otherwise uses PREMUL_SUM(1/factor), which gloo rejects; SUM followed
    by the same division is equivalent (torchtitan's factor is 1).
    """
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives

    original = collectives._get_gradient_divide_factors

    def sum_reduction_factors(*args, **kwargs):
        args = args[:5]
        kwargs["force_sum_reduction_for_comms"] = True
        return original(*args, **kwargs)

    collectives._get_gradient_divide_factors = sum_reduction_factors
