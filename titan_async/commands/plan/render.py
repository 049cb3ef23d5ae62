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
          "<- this config" if s["selected"] else ""] for s in plan["schedules"]],
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
        [[s["name"], f"{min(s['bubble']):.1%}", f"{sum(s['bubble']) / len(s['bubble']):.1%}", f"{s['vs_1f1b']:.3f}x",
          f"{s['vs_best_synchronous']:.3f}x", f"{s['tokens_per_second']:,.0f}", f"{s['step_seconds']:.3f}",
          _peak(s, plan["gpu_memory_bytes"]), "<- this config" if s["selected"] else ""] for s in plan["simulation"]["schedules"]],
    )


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
    """`plan --gpu-counts`' tables (the best schedules per GPU count; every schedule at its fastest
    fitting setting), why a schedule fits no setting, and the GPU counts left out."""
    points = advice["points"]
    summary = Table(
        f"Schedules by GPU count ({advice['tokens_per_step']:,} tokens per step at each; every schedule at its fastest "
        f"setting that fits {advice['gpu_memory_bytes'] / 2**30:g} GiB, ac: activation checkpointing, mb: microbatch "
        "size; m/p: microbatches per step over pipeline ranks at that setting; gain: the best streaming schedule over "
        "the best synchronous one; fits: the config's schedule at the config's setting)",
        ["GPUs", "recommended", "setting", "m/p", "tokens/s", "best synchronous", "setting", "tokens/s", "gain", "fits"],
        [[str(p["gpus"]), *_advised(p, p["recommended"]), *_advised(p, p["best_synchronous"])[:2],
          _tokens(p, p["best_synchronous"]), f"{p['streaming_gain']:.3f}x" if p["streaming_gain"] else "-",
          {True: "yes", False: "no", None: "-"}[p["config_schedule_fits"]]] for p in points],
    )
    names = list(dict.fromkeys(name for p in points for name in [*p["tokens_per_second"], *p["unfit"]]))
    every = Table(
        "Every schedule (tokens/s, setting; -: no setting fits or torch cannot build it, below)",
        ["schedule", *(f"{p['gpus']} GPUs" for p in points)],
        [[name, *(f"{_tokens(p, name)} {_short(p, name)}".strip() for p in points)] for name in names],
    )
    unfit = [f"{p['gpus']} GPUs, {name}: {why}" for p in points for name, why in p["unfit"].items()]
    skipped = [f"{s['gpus']} GPUs left out: {s['reason']}" for s in advice["skipped"]]
    return "\n".join([_plain(summary), "", _plain(every), *unfit, *skipped])


def _advised(point: dict[str, Any], name: str | None) -> list[str]:
    """A schedule's name, setting, m/p and tokens/s at one GPU count; `-` without one."""
    if name is None:
        return ["none fits", "-", "-", "-"]
    chosen = point["settings"][name]
    return [name, chosen["setting"], f"{chosen['m_over_p']:g}", _tokens(point, name)]


def _tokens(point: dict[str, Any], name: str | None) -> str:
    return f"{point['tokens_per_second'][name]:,.0f}" if name in point["tokens_per_second"] else "-"


def _short(point: dict[str, Any], name: str) -> str:
    chosen = point["settings"].get(name)
    return f"({chosen['activation_checkpoint']}, mb {chosen['microbatch_size']})" if chosen else ""


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
