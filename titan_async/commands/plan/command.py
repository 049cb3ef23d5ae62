"""The plan command: the estimate and the dry run of a config on a cluster as one JSON-ready
object, printed, with what `train` would refuse as warnings (the dry run then builds nothing:
the trainer never builds what `train` refuses)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable

from titan_async.cluster.advise import advise, draw
from titan_async.commands.plan.dry_run import ESTIMATE_ONLY_NOTE, NOT_BUILT_NOTE, dry_run
from titan_async.cluster.estimate import (
    Cluster,
    Estimate,
    check_world_size,
    communication,
    estimate,
    estimate_model,
    mixture_of_experts,
)
from titan_async.cluster.memory import compare_schedules, gib
from titan_async.cluster.balance import balanced_split, gains, with_split
from titan_async.commands.plan.render import advice_text, print_plan
from titan_async.commands.plan.staleness import staleness_report, staleness_text
from titan_async.cluster.schedule_memory import busiest, schedule_memory
from titan_async.cluster.simulate import SimulationOptions, data_parallel_name, simulate_plan
from titan_async.config.assemble import plain_parameters, resolve_vocab_size
from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError
from titan_async.model.meta import MetaModel, build_meta_model
from titan_async.pipeline.schedules import SCHEDULE_NAMES, register as register_schedules


def make_plan(run: RunConfig, cluster: Cluster, gpu: bool = True, simulation: SimulationOptions | None = None) -> dict[str, Any]:
    """Everything `plan` reports, as one JSON-ready object; with `gpu` False its memory is that of
    CPU processes (gloo, CPU Newton-Schulz dtype) in place of the cluster's GPUs; with
    `simulation`, each schedule simulated on the cluster under "simulation", with its peak memory
    (`schedule_memory`). The dry run builds the layout only where `train` would start it."""
    check_world_size(run, cluster)
    _check_mixture_of_experts(run)
    name = run.parallelism.pipeline_parallel_schedule
    if name.lower() not in {known.lower() for known in SCHEDULE_NAMES}:
        raise UserError(
            f"{run.source}: parallelism.pipeline_parallel_schedule = {name!r}: unknown schedule; "
            f"valid names are {', '.join(SCHEDULE_NAMES)}"
        )
    register_schedules()
    warnings = []
    try:
        run.check(cluster.world_size)
    except UserError as err:
        warnings.append(f"titan-async train would stop with: {err}")
    refused = bool(warnings)
    parallelism = run.parallelism
    planned = estimate(run, cluster, gpu)
    vocab, model, layout, setup, shapes, rows = (planned.vocab, planned.model, planned.layout, planned.setup,
                                                 planned.shapes, planned.rows)
    moe = mixture_of_experts(layout, shapes, setup)
    for row in rows:
        if not row["fits"]:
            first, last = row["gpus"]
            warnings.append(
                f"pipeline rank {row['pp_rank']} (GPUs {first}-{last}) needs {gib(row['memory']['total']):.1f} GiB "
                f"per GPU, more than --gpu-memory {gib(cluster.gpu_memory):.1f} GiB: it will not fit"
            )
    sizes = run.model.resolved(vocab)
    t = run.training
    tokens_per_step = t.local_batch_size * t.seq_len * run.data_parallel_degree(cluster.world_size) * layout.accumulation_steps
    simulated = simulation and simulate_plan(run, layout, model.module, shapes, setup, cluster, simulation, tokens_per_step,
                                             simulated_memory(run, cluster, planned, gpu))
    schedules = compare_schedules(layout.pipeline_stages(), layout.microbatches, layout.accumulation_steps, layout.pp)
    for entry in schedules:
        entry["selected"] = entry["name"].lower() == layout.schedule.lower() and layout.pipeline_stages() > 1
    return {
        "config": run.source,
        "nodes": cluster.nodes,
        "gpus_per_node": cluster.gpus_per_node,
        "world_size": cluster.world_size,
        "gpu_memory_bytes": cluster.gpu_memory,
        "model": {
            "preset": run.model.preset,
            "family": run.model.family,
            "parameters": sum(p.numel() for p in model.module.parameters()),
            **{k: sizes[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "weight_tying")},
            "ffn_dim": setup.ffn_dim,
            **({key: sum(rank[key] for rank in moe["ranks"]) for key in ("active_parameters", "expert_parameters")} if moe else {}),
        },
        "layout": {
            "pipeline_parallel": layout.pp,
            "pipeline_stages": layout.pipeline_stages(),
            "data_parallel_shard": layout.fsdp,
            "data_parallel_replicate": parallelism.data_parallel_replicate_degree,
            "tensor_parallel": parallelism.tensor_parallel_degree,
            "sequence_parallel": setup.sequence_parallel,
            "context_parallel": parallelism.context_parallel_degree,
            "schedule": layout.schedule,
            "sync_start_steps": t.sync_start_steps,
            "microbatches": layout.microbatches,
            "accumulation_steps": layout.accumulation_steps,
            "window": layout.window,
            "windows_per_step": layout.windows_per_step,
            "gradient_delay": layout.delay,
            "microbatch_tokens": setup.tokens,
            "tokens_per_step": tokens_per_step,
            "fsdp_applied": layout.fsdp_applied,
            "param_dtype": t.dtype,
            "compute_dtype": t.mixed_precision_param if layout.fsdp_applied else t.dtype,
            "reduce_dtype": t.mixed_precision_reduce,
            "activation_checkpoint": run.activation_checkpoint.mode,
            "float8": run.model.float8,
            "optimizer": run.optimizer.name,
            "error_feedback": run.optimizer.error_feedback.enabled,
        },
        "ranks": rows,
        "peak_bytes": planned.peak_bytes,
        "fits": all(row["fits"] for row in rows),
        "schedules": schedules,
        "communication": communication(layout, shapes, setup, run.parallelism.paci.accumulation),
        **({"mixture_of_experts": moe} if moe else {}),
        "dry_run": {"ranks": [], "note": NOT_BUILT_NOTE} if refused else
                   {"ranks": dry_run(run, layout, model, cluster.world_size, rows), "note": ESTIMATE_ONLY_NOTE},
        "warnings": warnings,
        **({"simulation": simulated} if simulated else {}),
    }


def simulated_memory(run: RunConfig, cluster: Cluster, planned: Estimate, gpu: bool = True) -> dict[str, dict[str, Any] | str]:
    """The memory of every row `simulate_plan` gives: each schedule's (`schedule_memory`), or
    without a pipeline the config's own under its one row's name (`data_parallel_name`)."""
    if planned.layout.pp == 1 and not planned.layout.emulated:
        return {data_parallel_name(planned.setup): busiest(planned, cluster.gpu_memory)}
    return schedule_memory(run, cluster, planned, list(SCHEDULE_NAMES), gpu)


def _check_mixture_of_experts(run: RunConfig) -> None:
    """UserError, one line naming the key, for what `plan` does not estimate for MoE models yet:
    tensor parallelism (the streaming schedules refuse it too). Expert parallelism is estimated
    (its all-to-all bytes; `estimate.all_to_all_bytes`)."""
    if run.model.family != "qwen3_moe":
        return
    p = run.parallelism
    if p.tensor_parallel_degree > 1:
        raise UserError(
            f"{run.source}: parallelism.tensor_parallel_degree = {p.tensor_parallel_degree}: plan estimates "
            "model.family = \"qwen3_moe\" without tensor parallelism so far; set it to 1"
        )


def run_plan(run: RunConfig, cluster: Cluster, strict: bool, as_json: bool, simulation: SimulationOptions | None = None,
             balance: bool = False, staleness: bool = False) -> int:
    """Print the plan (with `simulation`, the simulated schedules too; with `balance`, the
    balanced split and every schedule simulated with it; with `staleness`, the delay's predicted
    cost); 1 if `strict` and some rank does not fit, else 0. Warnings go to stderr."""
    plan = make_plan(run, cluster, simulation=simulation)
    if balance:
        split = balanced_split(run, cluster, simulation)
        balanced = make_plan(with_split(run, split["module_fqns_per_model_part"]), cluster, simulation=simulation)
        plan["balance"] = {**split, "schedules": gains(plan["simulation"], balanced["simulation"])}
    if staleness:
        layout = plan["layout"]
        plan["staleness"] = staleness_report(run, plan["model"]["parameters"], layout["tokens_per_step"], layout["gradient_delay"],
                                             layout["pipeline_stages"], layout["window"])
    print_plan(plan, as_json)
    if staleness and not as_json:
        print(staleness_text(plan["staleness"]))
    for warning in plan["warnings"]:
        print(f"titan-async: warning: {warning}", file=sys.stderr)
    return 1 if strict and not plan["fits"] else 0


def advice_simulator(simulation: SimulationOptions) -> Callable[[RunConfig, Cluster], dict[str, Any]]:
    """`advise`'s simulate: `run` on `cluster` as `make_plan` simulates it ("layout" with its
    microbatches, accumulation steps and pipeline degree, "fits" of the config's schedule and
    "simulation" with every schedule's memory), without the dry run; the meta model is built
    once per vocabulary and FSDP wrapping (the advisor changes batch, microbatch size,
    recomputation and FSDP degree, none of which changes the model)."""
    models: dict[tuple[int, bool], MetaModel] = {}
    register_schedules()

    def simulate(run: RunConfig, cluster: Cluster) -> dict[str, Any]:
        check_world_size(run, cluster)
        vocab, fsdp = resolve_vocab_size(run), not plain_parameters(run, cluster.world_size)
        if (vocab, fsdp) not in models:
            models[vocab, fsdp] = build_meta_model(run, vocab, fsdp)
        planned = estimate_model(run, cluster, vocab, models[vocab, fsdp])
        layout, t = planned.layout, run.training
        tokens = t.local_batch_size * t.seq_len * run.data_parallel_degree(cluster.world_size) * layout.accumulation_steps
        memory = simulated_memory(run, cluster, planned)
        return {
            "layout": {"pipeline_parallel": layout.pp, "microbatches": layout.microbatches,
                       "accumulation_steps": layout.accumulation_steps, "data_parallel_shard": layout.fsdp},
            "parameters": sum(p.numel() for p in planned.model.module.parameters()),
            "fits": all(row["fits"] for row in planned.rows),
            "simulation": simulate_plan(run, layout, planned.model.module, planned.shapes, planned.setup, cluster,
                                        simulation, tokens, memory),
        }

    return simulate


def run_advice(run: RunConfig, cluster: Cluster, simulation: SimulationOptions, gpu_counts: list[int], as_json: bool,
               picture: Path | None) -> int:
    """Print which schedule is fastest at each GPU count for the config's global batch (`advise`)."""
    _check_mixture_of_experts(run)
    advice = advise(run, cluster, gpu_counts, advice_simulator(simulation))
    if picture is not None and advice["points"]:
        draw(advice, picture)
    if as_json:
        print(json.dumps(advice))
        return 0
    print(advice_text(advice))
    return 0
