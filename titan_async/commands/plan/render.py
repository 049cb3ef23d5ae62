"""How a plan is printed: one JSON object, rich tables on a terminal, or plain text."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any

from titan_async.cluster.memory import STATE_COMPONENTS, TRANSPORT_COMPONENTS, gib
from titan_async.pipeline.config import sync_start_text

TIGHT = 0.9
"""A rank above this share of --gpu-memory fits, but is reported as tight."""


_SHORT_NAMES = {"tok_embeddings": "embed", "lm_head": "head"}


def _modules(names: list[str]) -> str:
    """A stage's modules, short: consecutive layers folded (embed, L0-4; L37-39, norm, head)."""
    parts: list[str] = []
    layers: list[int] = []

    def flush() -> None:
        if layers:
            parts.append(f"L{layers[0]}" + (f"-{layers[-1]}" if len(layers) > 1 else ""))
            layers.clear()

    for name in names:
        index = name.removeprefix("layers.")
        if index.isdigit():
            if layers and int(index) != layers[-1] + 1:
                flush()
            layers.append(int(index))
        else:
            flush()
            parts.append(_SHORT_NAMES.get(name, name))
    flush()
    return ", ".join(parts)


def _count(n: int) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{suffix}"
    return str(n)


_HEADERS = {"weights": "weights", "expert_weights": "experts", "weight_versions": "2BW", "gradients": "grads", "optimizer": "optim",
            "error_feedback": "EF", "fsdp_buffers": "FSDP", "p2p_buffers": "P2P", "stage_inputs": "stage in",
            "nccl_buffers": "NCCL", "activations": "act (held mb)", "optimizer_step": "opt step"}


def _state_columns(plan: dict[str, Any]) -> tuple[str, ...]:
    """The state components a plan's tables show: "expert_weights" only for an MoE model."""
    return tuple(k for k in STATE_COMPONENTS if k != "expert_weights" or "mixture_of_experts" in plan)


@dataclass
class Table:
    """A titled table of strings; the first `left` columns are text, the rest numbers."""

    title: str
    columns: list[str]
    rows: list[list[str]]
    left: int = 1


def _memory_table(plan: dict[str, Any]) -> Table:
    memory = plan["gpu_memory_bytes"]
    state = _state_columns(plan)
    table = Table(
        "Memory per GPU (GiB); all GPUs of a pipeline rank hold the same (their FSDP and TP shards); peak = state + P2P + stage in "
        "+ NCCL + max(act + FSDP, opt step + what the microbatches in flight and FSDP keep through it)",
        ["pp (GPUs)", "stage: modules", "params", *(_HEADERS[k] for k in (*state, "fsdp_buffers", *TRANSPORT_COMPONENTS)),
         _HEADERS["activations"], _HEADERS["optimizer_step"], "peak", f"of {gib(memory):g} GiB"],
        [],
        left=2,
    )
    for row in plan["ranks"]:
        m = row["memory"]
        share = m["total"] / memory
        verdict = "NO" if share > 1 else "tight" if share > TIGHT else "fits"
        stages = "; ".join(f"{s['index']}: {_modules(s['modules'])}" for s in row["stages"])
        table.rows.append([
            "{} ({}-{})".format(row["pp_rank"], *row["gpus"]), stages, _count(row["parameters"]),
            *(f"{gib(m[key]):.2f}" for key in (*state, "fsdp_buffers", *TRANSPORT_COMPONENTS)),
            f"{gib(m['activations']):.2f} ({row['held_microbatches']:g})", f"{gib(m['optimizer_step']):.2f}",
            f"{gib(m['total']):.2f}", f"{share:.0%} {verdict}",
        ])
    return table


def _schedule_table(plan: dict[str, Any]) -> Table:
    layout = plan["layout"]
    k = layout["accumulation_steps"]
    accumulated = (f" x K = {k} accumulated local batches: synchronous schedules flush K times per step, a streaming "
                   f"window holds K x m = {k * layout['microbatches']}") if k > 1 else ""
    return Table(
        f"Schedules (p = {layout['pipeline_stages']} stages, m = {layout['microbatches']} microbatches{accumulated}; "
        "Interleaved1F1B with v = 2 chunks per rank)",
        ["schedule", "microbatches per flush or window", "bubble", "throughput vs 1F1B", ""],
        [[s["name"], str(s["window"]), f"{s['bubble']:.1%}", f"{s['relative_throughput']:.2f}x",
          "; ".join(filter(None, ["<- this config" if s["selected"] else "", s["note"]]))] for s in plan["schedules"]],
    )


def _communication_table(plan: dict[str, Any]) -> Table:
    def total(row: dict[str, Any]) -> float:
        return sum(row["busiest"].values())

    rows = plan["communication"]
    keys = ["all_gather", "reduce_scatter", "all_reduce"]
    columns = ["all-gather", "reduce-scatter", "replica all-reduce"]
    if plan["layout"]["tensor_parallel"] > 1:
        keys += ["tp_all_gather", "tp_reduce_scatter"]
        columns += ["TP all-gather", "TP reduce-scatter"]
    baseline = next(total(r) for r in rows if r["name"] == "1F1B")
    return Table(
        "FSDP, replica and TP communication per step, busiest rank (GB; steady state, the tensor bytes each collective "
        "takes, titan_async.cluster.memory.fsdp_traffic_bytes and tp_traffic_bytes)",
        ["schedule", *columns, "total", "vs 1F1B", ""],
        [[r["name"], *(f"{r['busiest'][key] / 1e9:.2f}" for key in keys),
          f"{total(r) / 1e9:.2f}", f"{total(r) / baseline:.2f}x",
          "<- this config" if r["selected"] else ""] for r in rows],
    )


def _dry_run_table(plan: dict[str, Any]) -> Table:
    state = _state_columns(plan)
    table = Table(
        f"Dry run: {plan['world_size']} ranks on a fake process group, meta device (GiB; {plan['dry_run']['note']})",
        ["rank", "pp", "local params", *(_HEADERS[k] for k in state), "allocated", "estimate", "ratio", "actions"],
        [],
    )
    for r in plan["dry_run"]["ranks"]:
        table.rows.append([
            str(r["rank"]), str(r["pp_rank"]), _count(r["local_parameters"]),
            *(f"{gib(r['allocated'][k]):.2f}" for k in state),
            f"{gib(sum(r['allocated'].values())):.2f}", f"{gib(sum(r['estimate'].values())):.2f}", f"{r['ratio']:.3f}",
            ", ".join(f"{n} {kind}" for kind, n in r["action_counts"].items()) or "-",
        ])
    return table


def _moe_table(plan: dict[str, Any]) -> Table:
    moe = plan["mixture_of_experts"]
    muon = "newton_schulz" in moe["ranks"][0]
    expert_parallel = moe["expert_parallel"] > 1
    table = Table(
        f"Mixture of experts ({moe['num_experts']} experts, top-{moe['top_k']}, expert hidden {moe['moe_hidden_dim']}): "
        "parameters per pipeline rank, active = non-expert + top_k / experts of the expert weights"
        + ("; Muon's Newton-Schulz per expert matrix (each expert's matrix on its own, batched per shape) and the "
           "busiest owner's per step (GFLOP per matrix, TFLOP per owner)" if muon else ""),
        ["pp", "params", "active", "experts", *(["all-to-all/step"] if expert_parallel else []),
         *(["expert matrices", "per matrix", "busiest owner"] if muon else [])],
        [],
    )
    for r in moe["ranks"]:
        row = [str(r["pp_rank"]), _count(r["parameters"]), _count(r["active_parameters"]), _count(r["expert_parameters"])]
        if expert_parallel:
            row.append(f"{r['all_to_all_bytes'] / 1e9:.3f} GB")
        if muon:
            ns = r["newton_schulz"]
            row += ["; ".join(f"{s['matrices']} x {s['rows']}x{s['cols']}" for s in ns["stacks"]) or "-",
                    "; ".join(f"{s['flops_each'] / 1e9:.2f}" for s in ns["stacks"]) or "-",
                    f"{ns['busiest_owner_flops'] / 1e12:.2f}"]
        table.rows.append(row)
    return table


def _peak(schedule: dict[str, Any], gpu_memory: int) -> str:
    """A simulated schedule's peak memory per GPU (GiB) and pipeline rank, "NO" past `gpu_memory`."""
    memory = schedule.get("memory")
    if not memory:
        return "-"
    return f"{gib(memory['peak_bytes']):.1f} (pp {memory['pp_rank']}){'' if memory['fits'] else ' NO'}"


def _simulation_table(plan: dict[str, Any]) -> Table:
    layout = plan["layout"]
    return Table(
        f"Simulated schedules (p = {layout['pipeline_parallel']} ranks, m = {layout['microbatches']} microbatches per flush, "
        f"{layout['tokens_per_step']:,} tokens per step; bubble: idle share of the busiest rank, and its mean over ranks, "
        "which adds the stages' imbalance; ratios: tokens/s over theirs; peak GiB: memory per GPU of the busiest pipeline "
        f"rank, NO past {gib(plan['gpu_memory_bytes']):g} GiB)",
        ["schedule", "bubble", "mean", "vs 1F1B", "vs best sync", "tokens/s", "step (s)", "peak GiB", ""],
        [[s["name"], f"{min(s['bubble']):.1%}", f"{sum(s['bubble']) / len(s['bubble']):.1%}", _ratio(s["vs_1f1b"]),
          _ratio(s["vs_best_synchronous"]), f"{s['tokens_per_second']:,.0f}", f"{s['step_seconds']:.3f}",
          _peak(s, plan["gpu_memory_bytes"]), "<- this config" if s["selected"] else ""] for s in plan["simulation"]["schedules"]],
    )


def _ratio(value: float | None) -> str:
    """A throughput ratio; "-" where its reference schedule did not run."""
    return "-" if value is None else f"{value:.3f}x"


def _simulation_notes(simulation: dict[str, Any]) -> list[str]:
    return ([f"not simulated: {name}: {why}" for name, why in simulation["skipped"].items()]
            + [f"memory not estimated: {s['name']}: {s['memory_note']}" for s in simulation["schedules"] if s.get("memory_note")]
            + [f"assumed: {line}" for line in simulation["assumptions"]])


def _header(plan: dict[str, Any]) -> list[str]:
    m, l = plan["model"], plan["layout"]
    schedule = l["schedule"] if l["pipeline_stages"] > 1 else "no pipeline"
    accumulated = f" x {l['accumulation_steps']} accumulated local batches" if l["accumulation_steps"] > 1 else ""
    return [
        f"plan: {plan['config']} on {plan['nodes']} node(s) x {plan['gpus_per_node']} GPU(s) = {plan['world_size']} GPUs "
        f"of {gib(plan['gpu_memory_bytes']):g} GiB",
        f"model: {m['preset']}, {m['parameters']:,} parameters (dim {m['dim']}, {m['n_layers']} layers, "
        f"{m['n_heads']} heads, {m['n_kv_heads']} KV heads, FFN {m['ffn_dim']}, vocab {m['vocab_size']})"
        if "mixture_of_experts" not in plan else
        f"model: {m['family']} {m['preset']}, {m['parameters']:,} parameters, {m['active_parameters']:,} active per token, "
        f"{m['expert_parameters']:,} in experts (dim {m['dim']}, {m['n_layers']} layers, {m['n_heads']} heads, "
        f"{m['n_kv_heads']} KV heads, {plan['mixture_of_experts']['num_experts']} experts, top-{plan['mixture_of_experts']['top_k']}, "
        f"vocab {m['vocab_size']})",
        f"layout: PP {l['pipeline_parallel']} x FSDP {l['data_parallel_shard']} x replicate {l['data_parallel_replicate']} "
        f"x TP {l['tensor_parallel']}{' (sequence parallel)' if l['sequence_parallel'] else ''} x CP {l['context_parallel']}; "
        f"{schedule}, {l['microbatches']} microbatch(es) "
        f"of {l['microbatch_tokens']} tokens per GPU{accumulated}, {l['tokens_per_step']:,} tokens per step",
        f"precision: weights {l['param_dtype']}, compute {l['compute_dtype']}, reduce {l['reduce_dtype']}"
        f"{'' if l['fsdp_applied'] else ' (no FSDP2: streaming stages without data parallelism)'}"
        f"{'' if l['float8'] == 'none' else ', float8 ' + l['float8'] + ' linears'}; "
        f"activation checkpointing {l['activation_checkpoint']}; optimizer {l['optimizer']}"
        f"{' + error feedback' if l['error_feedback'] else ''}",
        *([f"sync start: {sync_start_text(l['sync_start_steps'], schedule if l['pipeline_stages'] > 1 else 'training.gradient_delay = 1')}"]
          if l["sync_start_steps"] else []),
    ]


def _balance_table(balance: dict[str, Any]) -> Table:
    shares = " ".join(f"{share:.1%}" for share in balance["shares"])
    configured = " ".join(f"{share:.1%}" for share in balance["configured_shares"])
    return Table(
        f"Balanced split (--balance: contiguous modules per stage, the costliest stage as cheap as it can be by the "
        f"simulator's costs; stage shares of a step's work: configured {configured}; balanced {shares})",
        ["schedule", "tokens/s configured", "tokens/s balanced", "gain", ""],
        [[s["name"], f"{s['configured']:,.0f}", f"{s['balanced']:,.0f}", f"{s['gain']:.3f}x",
          "<- this config" if s["selected"] else ""] for s in balance["schedules"]],
    )


def balance_advice(balance: dict[str, Any]) -> str:
    """The balanced split as the config key, or, where it would slow the config's own schedule
    down in the simulation, why the configured split stays (the key still given for the others)."""
    line = "module_fqns_per_model_part = " + json.dumps(balance["module_fqns_per_model_part"])
    own = next((s for s in balance["schedules"] if s["selected"]), None)
    if own is None or own["gain"] >= 1:
        return line
    return (f"keep the configured split for {own['name']} (this config's schedule): the balanced one simulates "
            f"{own['gain']:.3f}x its tokens/s; for the schedules it speeds up:\n{line}")


def advice_text(advice: dict[str, Any]) -> str:
    """`plan --gpu-counts`' tables: each kind of layout's best (least time to the synchronous run's
    final loss) per GPU count with the recommended one marked, the fastest by tokens/s alone where
    it differs; every layout's best schedule, or why it has none; the GPU counts left out."""
    points = advice["points"]
    summary = Table(
        f"Layouts by GPU count ({advice['tokens_per_step']:,} tokens per step at each, {advice['steps']:,} steps; "
        f"each layout's schedules at their best setting (least time) that fits {advice['gpu_memory_bytes'] / 2**30:g} GiB, ac: "
        "activation checkpointing, mb: microbatch size (no pipeline: sequences per forward); efficiency: tokens of the "
        "synchronous run per token to reach its final loss; hours: to that loss, steps x tokens per step / (tokens/s x "
        "efficiency), ranges from the law's)",
        ["GPUs", "kind", "layout", "schedule", "setting", "tokens/s", "efficiency", "hours", ""],
        [[str(p["gpus"]), kind, *_row(p["best"][kind], p["recommended"])] for p in points for kind in p["best"]],
    )
    every = Table(
        "Every layout (its best schedule; -: none fits, below)",
        ["GPUs", "kind", "layout", "schedule", "setting", "tokens/s", "efficiency", "hours"],
        [[str(p["gpus"]), layout["kind"], layout["layout"], *_row(_best_row(layout), None)[1:-1]]
         for p in points for layout in p["layouts"]],
    )
    against = Table(
        "Streaming against synchronous, in time to target (each the best over every layout; no pipeline counts as "
        "synchronous; saving: the synchronous hours over the streaming ones)",
        ["GPUs", "best streaming", "hours", "best synchronous", "hours", "saving"],
        [[str(p["gpus"]), *_versus(p["best_streaming"]), *_versus(p["best_synchronous"]), _saving(p)] for p in points],
    )
    fastest = [f"{p['gpus']} GPUs, by tokens/s alone: {_named(p['fastest'])}, {p['fastest']['tokens_per_second']:,.0f} tokens/s, "
               f"{_hours(p['fastest'])} h" for p in points if not _same(p["fastest"], p["recommended"])]
    unfit = [f"{p['gpus']} GPUs, {layout['layout']}: {layout['reason']}" for p in points for layout in p["layouts"] if "reason" in layout]
    skipped = [f"{s['gpus']} GPUs left out: {s['reason']}" for s in advice["skipped"]]
    return "\n".join([_plain(summary), *fastest, *advice["notes"], "", _plain(against), "", _plain(every), *unfit, *skipped])


def _versus(row: dict[str, Any] | None) -> list[str]:
    return ["none fits", "-"] if row is None else [_named(row), _hours(row)]


def _saving(point: dict[str, Any]) -> str:
    """The best synchronous row's hours over the best streaming row's ("-" when either is missing or unknown)."""
    streaming, synchronous = point["best_streaming"], point["best_synchronous"]
    if not streaming or not synchronous or streaming["hours"] is None:
        return "-"
    return f"{synchronous['hours'] / streaming['hours']:.3f}x"


def _best_row(layout: dict[str, Any]) -> dict[str, Any] | str:
    if "reason" in layout:
        return "-"
    return {"layout": layout["layout"], "schedule": layout["best"], **layout["settings"][layout["best"]]}


def _row(row: dict[str, Any] | str, recommended: dict[str, Any] | None) -> list[str]:
    """Layout, schedule, setting, tokens/s, efficiency and hours of a row of the advice, and a mark
    when it is the recommended one; a reason (a kind none of whose layouts fits) in one cell."""
    if isinstance(row, str):
        return ["-", "-", "-", "-", "-", "-", ""]
    schedule = _schedule(row) if row["schedule"] not in ("FSDP", "HSDP", "DDP", "TP", "one GPU") else "-"
    if row["efficiency"] is None:
        efficiency = "unknown"
    elif row["efficiency_low"] == row["efficiency_high"]:
        efficiency = f"{row['efficiency']:g}"
    else:
        efficiency = f"{row['efficiency']:.3f} ({row['efficiency_low']:.3f}-{row['efficiency_high']:.3f})"
    return [row["layout"], schedule, row["setting"], f"{row['tokens_per_second']:,.0f}", efficiency, _hours(row),
            "<- recommended" if _same(row, recommended) else ""]


def _hours(row: dict[str, Any]) -> str:
    if row["hours"] is None:
        return "unknown"
    if row["hours_low"] == row["hours_high"]:
        return f"{row['hours']:,.1f}"
    return f"{row['hours']:,.1f} ({row['hours_low']:,.1f}-{row['hours_high']:,.1f})"


def _schedule(row: dict[str, Any]) -> str:
    """A row's schedule, with its delay where a streaming one delays by several steps."""
    return f"{row['schedule']} d={row['delay']}" if row.get("delay", 0) > 1 else row["schedule"]


def _named(row: dict[str, Any]) -> str:
    return f"{row['layout']}, {_schedule(row)} ({row['setting']})"


def _same(row: dict[str, Any] | None, other: dict[str, Any] | None) -> bool:
    return bool(row and other) and (row["layout"], row["schedule"]) == (other["layout"], other["schedule"])


def _plain(table: Table) -> str:
    cells = [table.columns, *table.rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(table.columns))]
    lines = [table.title]
    for row in cells:
        lines.append("  ".join(c.ljust(w) if i < table.left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))).rstrip())
    return "\n".join(lines)


def _print_rich(header: list[str], tables: list[Table]) -> None:
    from rich import box
    from rich.console import Console
    from rich.table import Table as RichTable

    console = Console()
    for line in header:
        console.print(line, highlight=False)
    for table in tables:
        rich_table = RichTable(title=table.title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
        for i, column in enumerate(table.columns):
            rich_table.add_column(column, justify="left" if i < table.left else "right")
        for row in table.rows:
            rich_table.add_row(*row)
        console.print(rich_table)


def print_plan(plan: dict[str, Any], as_json: bool) -> None:
    """One JSON object, rich tables on a terminal, or plain text."""
    if as_json:
        print(json.dumps(plan))
        return
    tables = [_memory_table(plan), *([_moe_table(plan)] if "mixture_of_experts" in plan else []), _schedule_table(plan),
              *([_communication_table(plan)] if plan["communication"] else []), _dry_run_table(plan)]
    if sys.stdout.isatty():
        _print_rich(_header(plan), tables)
    else:
        print("\n".join(_header(plan)))
        for table in tables:
            print("\n" + _plain(table))
    if "mixture_of_experts" in plan:
        print(plan["mixture_of_experts"]["note"])
    flushes = plan["layout"]["windows_per_step"]
    for rank in plan["dry_run"]["ranks"]:
        if rank["actions"]:
            more = " ..." if len(rank["actions"]) > 16 else ""
            repeated = f", {flushes} flushes per step" if flushes > 1 else ""
            print(f"rank {rank['rank']} actions ({len(rank['actions'])}{repeated}): {' '.join(rank['actions'][:16])}{more}")
    if "simulation" in plan:
        table = _simulation_table(plan)
        if sys.stdout.isatty():
            _print_rich([], [table])
        else:
            print("\n" + _plain(table))
        print("\n".join(_simulation_notes(plan["simulation"])))
    if "balance" in plan:
        print("\n" + _plain(_balance_table(plan["balance"])))
        print(balance_advice(plan["balance"]))
