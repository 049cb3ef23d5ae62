"""Will a checkpoint's model fit in this node's memory for `eval --tasks` on the CPU?

The evaluation holds the model's parameters in float32 (`tasks.hf_model`), and on top of them
the harness's activations, the tokenizer, the task data and the process itself: counted as
`MARGIN` of the parameters' bytes. The parameters are counted on the run's model built on the
meta device (nothing is allocated), and compared with the RAM available on the node
(`core.node_memory.node_ram`: /proc/meminfo MemAvailable, or `TITAN_ASYNC_MEMORY_AVAILABLE_GIB`). A model
that cannot fit is refused with one line before anything is read or allocated.
"""

from __future__ import annotations

from pathlib import Path

import torch

from titan_async.config.assemble import resolve_vocab_size
from titan_async.config.run_config import load_run_config
from titan_async.core.errors import UserError
from titan_async.core.node_memory import GIB, node_ram
from titan_async.model.meta import build_meta_model
from titan_async.rundir import directory as runs

MARGIN = 0.25
"""What the evaluation needs besides the parameters, as a share of their bytes."""


def check_cpu_memory(checkpoint: Path, dtype: torch.dtype) -> None:
    """UserError, one line, when the model of `checkpoint`'s run, in `dtype`, plus `MARGIN`, needs
    more than the RAM available on this node."""
    run = load_run_config(checkpoint.parent.parent / runs.CONFIG_FILE)
    parameters = sum(p.numel() for p in build_meta_model(run, resolve_vocab_size(run), fsdp=False).module.parameters())
    need = parameters * dtype.itemsize * (1 + MARGIN)
    available, source = node_ram()
    if need > available:
        raise UserError(
            f"--checkpoint {checkpoint}: evaluating on the CPU holds the model's {parameters:,} parameters in "
            f"{str(dtype).removeprefix('torch.')}, about {need / GIB:.3g} GiB with the evaluation's {MARGIN:.0%} margin, "
            f"but this node has {source}; evaluate on a GPU (--device cuda:N) or on a node with more memory"
        )
