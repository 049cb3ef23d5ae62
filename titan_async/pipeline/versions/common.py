"""What every weight-version policy uses: in-place updates that keep saved graphs valid, and
a rank's own storage of a (possibly FSDP-sharded) parameter."""

from __future__ import annotations

from contextlib import ExitStack, contextmanager

import torch
from torch.autograd import _unsafe_preserve_version_counter
from torch.distributed.tensor import DTensor


@contextmanager
def preserved_versions(params: list[torch.nn.Parameter]):
    """Let an optimizer update parameters in place without invalidating the graphs that saved them.

    Autograd saved the parameter objects of in-flight microbatches; 2BW updates a buffer
    none of them uses, and PACI's semantics is that their backward sees the new weights."""
    with ExitStack() as stack:
        for param in params:
            stack.enter_context(_unsafe_preserve_version_counter(param))
        yield


def local_storage(param: torch.Tensor) -> torch.Tensor:
    """The storage this rank holds of `param` (its FSDP shard for a DTensor)."""
    return param._local_tensor if isinstance(param, DTensor) else param.data


def sharded_like(param: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """`local` as a tensor sharded like `param` (a DTensor view for FSDP parameters)."""
    if not isinstance(param, DTensor):
        return local
    return DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape, stride=param.stride())
