"""Where the benchmarks during training (`[eval] device`) run: the CPU, or a GPU of this node
that no training rank uses.

torchtitan gives local rank R the GPU cuda:R (cuda:0 to every rank when one GPU is visible), so
on a node of `local_workers` training ranks the spare GPUs are those from cuda:<local_workers> on.
"""

from __future__ import annotations

import re

from titan_async.core.errors import UserError

DEVICE_PATTERN = r"cpu|cuda(:\d+)?"


def visible_gpus() -> int:
    """GPUs this process sees (CUDA_VISIBLE_DEVICES applied), counted without initialising the
    CUDA runtime where NVML can."""
    import torch

    from titan_async.core import platform

    if not platform.cuda_visible():
        return 0
    count = torch.cuda._device_count_nvml()
    return count if count >= 0 else torch.cuda.device_count()


def eval_device(setting: str, local_workers: int, gpus: int) -> str:
    """The torch device for `[eval] device` = `setting` ("cpu", "cuda" or "cuda:N") on a node of
    `local_workers` training ranks and `gpus` visible GPUs; UserError (one line) for a GPU that
    does not exist or that a training rank uses."""
    if not re.fullmatch(DEVICE_PATTERN, setting):
        raise UserError(f"eval.device = {setting!r}: expected \"cpu\" or \"cuda:N\"")
    if setting == "cpu":
        return "cpu"
    index = int(setting.partition(":")[2] or 0)
    if index >= gpus:
        seen = f"its GPUs are cuda:0..cuda:{gpus - 1}" if gpus else "it has none"
        raise UserError(f"eval.device = {setting!r}: no such GPU on this node ({seen}); use \"cpu\"")
    training = {0} if gpus == 1 else set(range(local_workers))
    if index in training:
        spare = f"a spare GPU is cuda:{local_workers}..cuda:{gpus - 1}" if gpus > local_workers else "this node has no spare GPU"
        raise UserError(f"eval.device = {setting!r} is a training rank's GPU on this node (its {local_workers} "
                        f"rank(s) use cuda:0..cuda:{min(local_workers, gpus) - 1}); {spare}, or use \"cpu\"")
    return f"cuda:{index}"
