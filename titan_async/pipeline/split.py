"""How a model splits into pipeline stages, and which pipeline rank holds which stages, exactly
as torchtitan's pipeline builder (or the single-process emulation) splits it: `train` checks
the split before it launches, `plan` reports it."""

from __future__ import annotations

from types import SimpleNamespace

from torchtitan.distributed.pipeline_parallel import (
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
    _get_pp_rank_to_stage_indices_mapping,
)

from titan_async.pipeline.emulation import stage_modules


def split_stages(parallelism, model_config) -> tuple[list[list[str]], list[tuple[int, ...]]]:
    """(module names of each stage, stage indices of each pipeline rank); ValueError, in
    torchtitan's words, when the model cannot be split so (more stages than layers, say)."""
    pp, layers = parallelism.pipeline_parallel_degree, len(model_config.layers)
    if pp > 1:
        # Of the parallel dims, torchtitan's metadata reads only the PP degree.
        stages, _, first, last = _get_pipeline_metadata(SimpleNamespace(pp=pp), parallelism, model_config)
        modules = parallelism.module_fqns_per_model_part or _generate_llm_fqn_per_model_part(stages, layers, first, last)
        schedule = parallelism.pipeline_parallel_schedule
        return modules, [_get_pp_rank_to_stage_indices_mapping(r, pp, schedule, len(modules)) for r in range(pp)]
    if parallelism.emulated_stages:
        modules = stage_modules(parallelism, layers)
        return modules, [tuple(range(len(modules)))]
    return _generate_llm_fqn_per_model_part(1, layers), [(0,)]
