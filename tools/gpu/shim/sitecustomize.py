"""torch 2.15 names that torchtitan 0.3.0 uses, added to an older torch (the GPU image's 2.11).

Only for measuring on a machine whose torch is older than the project's pin: put this directory
on PYTHONPATH (Python imports `sitecustomize` at start-up). Each addition is skipped when torch
already has the name, and none changes a result on the single-process paths measured there:
- `torch.distributed.fsdp.DataParallelMeshDims`: imported at module level; only the full-DTensor
  SPMD backend uses it, which titan-async does not select.
- `torch.distributed.set_timeout`: older releases have the same function as `_set_pg_timeout`.
- `create_block_mask(separate_full_blocks=...)`: older releases always store fully unmasked
  blocks separately (torchtitan passes True except in batch-invariant mode, where False only
  makes the kernels apply the mask to those blocks too: the same mask).
- `FSDPState._fsdp_param_groups`: older releases hold one group per state, as `_fsdp_param_group`.
One thing cannot work on an older torch and is turned off instead: torchtitan's CUDA-graph
capture of the forward-backward step (on by default on CUDA). It requires a BlockMask to flatten
to the same structure every step; torch 2.15 moves the tensors that mask_mod closes over into
the leaves, older releases keep mask_mod itself in the context, so the per-step document mask
differs at step 2 ("CUDA graph BlockMask structure must remain constant across training steps").
Without capture, the step runs the same operations eagerly.
"""

import functools
import importlib.abc
import importlib.util
import inspect
import sys
from dataclasses import dataclass

import torch.distributed as dist
import torch.distributed.fsdp as fsdp
from torch.distributed import distributed_c10d
from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
from torch.nn.attention import flex_attention

if not hasattr(fsdp, "DataParallelMeshDims"):

    @dataclass
    class DataParallelMeshDims:
        shard: str | tuple[str, ...] | None = None
        replicate: str | tuple[str, ...] | None = None

    fsdp.DataParallelMeshDims = DataParallelMeshDims

if not hasattr(dist, "set_timeout"):
    dist.set_timeout = distributed_c10d._set_pg_timeout

if "separate_full_blocks" not in inspect.signature(flex_attention.create_block_mask).parameters:
    _create_block_mask = flex_attention.create_block_mask

    @functools.wraps(_create_block_mask)
    def create_block_mask(*args, separate_full_blocks: bool = True, **kwargs):
        return _create_block_mask(*args, **kwargs)

    flex_attention.create_block_mask = create_block_mask

if not isinstance(getattr(FSDPState, "_fsdp_param_group", None), property):
    FSDPState._fsdp_param_groups = property(lambda state: [state._fsdp_param_group] if state._fsdp_param_group else [])


class _WithoutCudaGraphs(importlib.abc.MetaPathFinder):
    """Makes torchtitan's `wrap_with_cuda_graph` return the step unchanged once the module loads."""

    MODULE = "torchtitan.distributed.cudagraph"

    def find_spec(self, name, path, target=None):
        if name != self.MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            module.wrap_with_cuda_graph = lambda fwd_bwd_fn: fwd_bwd_fn

        spec.loader.exec_module = exec_module
        return spec


if not hasattr(flex_attention, "_extract_callable_pytree"):
    sys.meta_path.insert(0, _WithoutCudaGraphs())
