"""How a model splits into pipeline stages, and which pipeline rank holds which stages, exactly
as torchtitan's pipeline builder (or the single-process emulation) splits it: `train` checks
the split before it launches, `plan` reports it."""

from __future__ import annotations

from types import SimpleNamespace

from torch.distributed.pipelining.schedules import PipelineScheduleSingle, get_schedule_class
from torchtitan.distributed.pipeline_parallel import (
    _generate_llm_fqn_per_model_part,
    _get_pipeline_metadata,
    _get_pp_rank_to_stage_indices_mapping,
)

from titan_async.pipeline.emulation import stage_modules


def split_stages(parallelism, model_config, microbatches: int | None = None) -> tuple[list[list[str]], list[tuple[int, ...]]]:
    """(module names of each stage, stage indices of each pipeline rank); ValueError, in
    torchtitan's words, when the model cannot be split so (more stages than layers, say), and in
    one line naming the key when `module_fqns_per_model_part` does not place every module of the
    model exactly once, or when torch's schedule cannot run `microbatches` per flush on the stages."""
    pp, layers = parallelism.pipeline_parallel_degree, len(model_config.layers)
    if pp > 1:
        # Of the parallel dims, torchtitan's metadata reads only the PP degree.
        stages, _, first, last = _get_pipeline_metadata(SimpleNamespace(pp=pp), parallelism, model_config)
        modules = parallelism.module_fqns_per_model_part or _generate_llm_fqn_per_model_part(stages, layers, first, last)
        _check_placement(modules, _generate_llm_fqn_per_model_part(1, layers)[0])
        _check_stage_count(parallelism.pipeline_parallel_schedule, len(modules), pp, stages)
        schedule = parallelism.pipeline_parallel_schedule
        if microbatches is not None:
            check_microbatches(schedule, microbatches, len(modules), pp)
        return modules, [_get_pp_rank_to_stage_indices_mapping(r, pp, schedule, len(modules)) for r in range(pp)]
    if parallelism.emulated_stages:
        modules = stage_modules(parallelism, layers)
        return modules, [tuple(range(len(modules)))]
    return _generate_llm_fqn_per_model_part(1, layers), [(0,)]


def _check_placement(modules: list[list[str]], known: list[str]) -> None:
    """ValueError unless the stages hold each of the model's modules (`known`) exactly once."""
    key = "parallelism.module_fqns_per_model_part"
    placed = [name for stage in modules for name in stage]
    unknown = [name for name in placed if name not in known]
    if unknown:
        raise ValueError(f"{key} names {unknown[0]!r}, which is no module of this model; its modules are {', '.join(known)}")
    twice = next((name for name in placed if placed.count(name) > 1), None)
    if twice:
        raise ValueError(f"{key} places {twice!r} on more than one stage")
    missing = [name for name in known if name not in placed]
    if missing:
        raise ValueError(f"{key} leaves out {', '.join(missing)}: every module of the model must be on a stage")


V_SCHEDULES = ("ZBVZeroBubble", "DualPipeV")


def _check_stage_count(schedule: str, given: int, pp: int, stages: int) -> None:
    """ValueError, naming the key, when `module_fqns_per_model_part` gives a number of stages the
    schedule cannot place on `pp` ranks: one per rank (`stages` == pp: single-stage schedules),
    two per rank (the V-shaped ones), or a multiple of pp (the other interleaved ones)."""
    v_shaped = schedule.lower() in {name.lower() for name in V_SCHEDULES}
    if given == stages or (stages > pp and not v_shaped and given % pp == 0 and given > pp):
        return
    need = f"{stages} ({stages // pp} per rank)" if stages == pp or v_shaped else f"a multiple of {pp}, at least {2 * pp}"
    raise ValueError(f"parallelism.module_fqns_per_model_part has {given} stages; {schedule} on {pp} pipeline ranks "
                     f"needs {need}")


def schedule_stages(schedule: str, pp: int) -> int:
    """The stages torch's schedule `schedule` runs on `pp` ranks by default: one per rank for a
    single-stage schedule, two per rank for the others (interleaved, V-shaped)."""
    single = issubclass(get_schedule_class(schedule), PipelineScheduleSingle)
    return pp if single else 2 * pp


def check_microbatches(schedule: str, microbatches: int, stages: int, pp: int) -> None:
    """ValueError, naming the keys, where torch's schedule `schedule` refuses `microbatches` per
    flush on `stages` stages over `pp` ranks (torch's own conditions: Schedule1F1B and
    ScheduleDualPipeV want at least one microbatch per stage; the interleaved schedules a whole
    number of microbatches per round of pp)."""
    count = f"training.local_batch_size / parallelism.pipeline_parallel_microbatch_size = {microbatches}"
    name = schedule.lower()
    if name in ("1f1b", "dualpipev") and microbatches < stages:
        raise ValueError(f"parallelism.pipeline_parallel_schedule = {schedule!r} needs at least as many microbatches "
                         f"per flush as stages: {count} < {stages} stages")
    rounds = max(1, microbatches // pp)
    if name in ("interleaved1f1b", "interleavedzerobubble") and microbatches % rounds:
        raise ValueError(f"parallelism.pipeline_parallel_schedule = {schedule!r} needs the microbatches per flush to be "
                         f"a multiple of their rounds (microbatches // pipeline_parallel_degree = {rounds}): {count}")
