"""Will a run fit the memory its ranks have? `train` and `resume` ask before they launch, and a
worker that an external torchrun started without them asks before it builds its model
(`titan_async.run.memory_check`); under an external launcher local rank 0 asks for its node's workers.

Each rank's need is `plan`'s peak estimate for its pipeline rank (`estimate.estimate`, from the
config and a meta-device model: nothing is allocated). What a rank has: on a CPU, the RAM
available on its node (/proc/meminfo MemAvailable) divided over the node's ranks; on a GPU, its
GPU's free memory as NVML reports it (never the CUDA runtime: the launcher forks its workers, see
`titan_async.core.platform`). Where NVML cannot answer (MIG, ROCm) nothing is checked. A run that
does not fit is refused with one line (UserError) naming its estimate, the memory there is, and
the config changes that lower the estimate (each tried on the estimate, with its result);
`--skip-memory-check` starts it anyway. The estimate counts tensors only: the process itself
(Python, torch, the data loader) comes on top, so a run just under the line can still run out.

`TITAN_ASYNC_MEMORY_AVAILABLE_GIB` stands in for the memory there is (the node's available RAM
on a CPU, each GPU's free memory on a GPU): a hook for tests and operators.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
from dataclasses import dataclass
from typing import Any

from titan_async.cluster.estimate import Cluster, estimate
from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError
from titan_async.core.node_memory import AVAILABLE_ENV, gib, node_ram, override

SKIP_FLAG = "--skip-memory-check"


@dataclass(frozen=True)
class RankMemory:
    """The memory one rank of this node has: bytes, and where they come from in words."""

    rank: int
    local_rank: int
    available: int
    source: str


def ranks_here(nproc: int, external: bool) -> tuple[list[tuple[int, int]], int]:
    """(global rank, local rank) of the ranks this process checks, and the node's rank count:
    the launcher checks all the workers it starts; under an external launcher local rank 0 checks
    its node's workers (`run.node_checks`), whose global ranks torchrun (and Slurm's block
    distribution) makes consecutive."""
    if not external:
        return [(rank, rank) for rank in range(nproc)], nproc
    env = os.environ
    local_world = int(env.get("LOCAL_WORLD_SIZE", "1"))
    first = int(env.get("RANK", "0")) - int(env.get("LOCAL_RANK", "0"))
    return [(first + local, local) for local in range(local_world)], local_world


def rank_memory(ranks: list[tuple[int, int]], local_world: int, cpu: bool) -> list[RankMemory] | None:
    """What each of `ranks` has (None where it cannot be known without the CUDA runtime)."""
    if cpu:
        total, source = node_ram()
        return [RankMemory(r, lr, total // local_world, f"{source} over {local_world} local rank{'s' * (local_world != 1)}")
                for r, lr in ranks]
    given = override()
    if given is not None:
        return [RankMemory(r, lr, given, f"{gib(given)} GiB free on its GPU by {AVAILABLE_ENV}") for r, lr in ranks]
    found = []
    for rank, local in ranks:
        free = _gpu_free(local)
        if free is None:
            return None
        found.append(RankMemory(rank, local, free, f"free on local GPU {local}, by NVML"))
    return found


class _NvmlMemory(ctypes.Structure):
    """NVML's nvmlMemory_t."""

    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]


def _gpu_free(local_rank: int) -> int | None:
    """Free bytes of the GPU that local rank `local_rank` uses (CUDA_VISIBLE_DEVICES applied), by
    NVML; None where NVML cannot say."""
    import torch

    try:
        index = torch.cuda._get_nvml_device_index(local_rank)  # NVML only: no CUDA runtime call
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        if nvml.nvmlInit_v2() != 0:
            return None
        handle, memory = ctypes.c_void_p(), _NvmlMemory()
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != 0:
            return None
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) != 0:
            return None
        return int(memory.free)
    except (OSError, RuntimeError, AttributeError, IndexError, TypeError, ValueError):
        return None


def _with(run: RunConfig, key: str, value: Any) -> RunConfig:
    """`run` with the dotted `key` set to `value`."""
    head, _, rest = key.partition(".")
    if not rest:
        return dataclasses.replace(run, **{head: value})
    return dataclasses.replace(run, **{head: _with(getattr(run, head), rest, value)})


def _candidates(run: RunConfig, world_size: int) -> list[tuple[str, RunConfig, int]]:
    """Config changes that may lower the estimate: (--set text, changed run, world size)."""
    p, t = run.parallelism, run.training
    found = []
    if run.activation_checkpoint.mode != "full":
        found.append(("activation_checkpoint.mode=full", _with(run, "activation_checkpoint.mode", "full"), world_size))
    if t.local_batch_size > 1:
        half = t.local_batch_size // 2
        found.append((f"training.local_batch_size={half}", _with(run, "training.local_batch_size", half), world_size))
    if (p.pipeline_parallel_degree > 1 or p.emulated_stages) and p.pipeline_parallel_microbatch_size > 1:
        half = p.pipeline_parallel_microbatch_size // 2
        found.append((f"parallelism.pipeline_parallel_microbatch_size={half}",
                      _with(run, "parallelism.pipeline_parallel_microbatch_size", half), world_size))
    if t.dtype == "float32":
        found.append(("training.dtype=bfloat16",
                      _with(run, "training.dtype", "bfloat16"), world_size))
    doubled = 2 * p.pipeline_parallel_degree
    found.append((f"parallelism.pipeline_parallel_degree={doubled} on {2 * world_size} processes",
                  _with(run, "parallelism.pipeline_parallel_degree", doubled), 2 * world_size))
    if p.data_parallel_shard_degree == -1:
        found.append((f"FSDP (parallelism.data_parallel_shard_degree = -1) on {2 * world_size} processes", run, 2 * world_size))
    else:
        doubled = 2 * p.data_parallel_shard_degree
        found.append((f"parallelism.data_parallel_shard_degree={doubled} on {2 * world_size} processes",
                      _with(run, "parallelism.data_parallel_shard_degree", doubled), 2 * world_size))
    return found


def _rank_peaks(run: RunConfig, world_size: int, cpu: bool) -> list[tuple[range, int]]:
    """(global ranks, peak bytes) of each pipeline rank by plan's estimate."""
    rows = estimate(run, Cluster(1, world_size, 0), gpu=not cpu).rows
    return [(range(row["gpus"][0], row["gpus"][1] + 1), row["memory"]["total"]) for row in rows]


def _lowering(run: RunConfig, world_size: int, cpu: bool, need: int) -> list[str]:
    """The changes that lower what this node needs, best first, each with its new estimate.
    On a GPU a change counts when it lowers the per-rank peak (more processes bring more GPUs);
    on a CPU more processes share the same RAM, so one counts when twice its peak is lower."""
    lowered = []
    for text, changed, size in _candidates(run, world_size):
        try:
            changed.check(size)
            peak = max(peak for _, peak in _rank_peaks(changed, size, cpu))
        except (UserError, ValueError):
            continue
        if peak * (size // world_size if cpu else 1) < need:
            lowered.append((peak, f"{text} ({gib(peak)} GiB)"))
    return [text for _, text in sorted(lowered)]


def check_fits(run: RunConfig, world_size: int, nproc: int, external: bool, cpu: bool) -> None:
    """UserError, one line, when some rank of this node would need more memory than it has."""
    ranks, local_world = ranks_here(nproc, external)
    memory = rank_memory(ranks, local_world, cpu)
    if memory is None or (run.model.family == "qwen3_moe" and run.parallelism.tensor_parallel_degree > 1):
        return  # nothing to compare with, or a layout plan does not estimate (its own one-line refusal)
    try:
        peaks = _rank_peaks(run, world_size, cpu)
    except UserError:
        return  # what plan cannot estimate is no reason to stop a run train accepted
    worst = None
    for have in memory:
        need = next((peak for covered, peak in peaks if have.rank in covered), 0)
        if need > have.available and (worst is None or need / max(have.available, 1) > worst[0] / max(worst[1].available, 1)):
            worst = (need, have)
    if worst is None:
        return
    need, have = worst
    changes = _lowering(run, world_size, cpu, need)
    lower = f"; lower the estimate with {', '.join(changes)}" if changes else ""
    raise UserError(
        f"{run.source}: rank {have.rank} needs about {gib(need)} GiB at its peak (titan-async plan's estimate), "
        f"but has {gib(have.available)} GiB ({have.source}){lower}; or start anyway with {SKIP_FLAG}"
    )
