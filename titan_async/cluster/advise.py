"""`plan --simulate --gpu-counts N,N,...`: which layout and schedule reach the synchronous run's
final loss first at each cluster size, for a fixed global batch.

The config's global batch (tokens per step on the `--nodes` x `--gpus-per-node` cluster) is kept
at every GPU count. At each count the advisor tries these layouts (`candidates`), FSDP taking the
GPUs left and each data rank's batch shrinking as they grow (a layout whose degrees do not divide
the count, or whose data ranks do not divide the batch, says why):

- "config": the config's pipeline, tensor-parallel and replica degrees;
- "fewer stages": pipeline degree p / 2, p / 4, ... down to 2, the config's TP and replicas
  (a degree the model's blocks cannot split into says why);
- "no pipeline": pipeline degree 1 with tensor-parallel degree 1, the config's, and the GPUs of
  a node (where it divides the attention and KV heads), each as FSDP over every GPU and, on
  more than one node, as HSDP (the FSDP group inside a node, one replica per node).

With a pipeline every schedule is simulated as `plan --simulate` simulates the config, at each
setting of `settings` (activation checkpointing mode x microbatch size) that divides the data
rank's batch, and keeps its best setting (least time to target, `rank_key`) whose peak memory
(`schedule_memory`) fits `--gpu-memory` and that `train` would run with it (selective
recomputation is refused with the split-backward schedules and PACI; torch's 1F1B and DualPipeV
refuse fewer microbatches than stages); a schedule with none shows why. With fewer microbatches
than stages PipeDream2BW delays by d = ceil((p - 1) / m) steps and PACI by up to
ceil((p - 1) / a) local steps (`schedule_delay`), each costed at that delay. Without a pipeline
there is no schedule: one step of FSDP / HSDP (+TP) is simulated
(`simulate.simulate_data_parallel`), its microbatch (the local batch of one forward) each size of
`NO_PIPELINE_SIZES` and the whole data rank's batch that divides it, gradient accumulation
making up the rest. Memory headroom buys speed: a layout that fits without recomputation is
simulated without it.

Each schedule's predicted time to the synchronous run's final loss (`time_to_target`) is
training.steps x tokens per step / (tokens/s x token efficiency): efficiency 1 for synchronous
schedules and no pipeline; for the streaming ones the staleness law's at their delay
(`staleness.estimate`, a law passed in or the shipped one; unknown at a delay of several steps
before the law has its delay term), PACI's bounded from above by that of its delay. A layout's
best schedule, each kind's best layout and the recommended one are those of least time (a row
of unknown time after every known one); with an optimizer the law does not cover, those of most
tokens/s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from functools import cache
from pathlib import Path
from typing import Any, Callable

from titan_async.cluster import staleness
from titan_async.cluster.estimate import Cluster, check_world_size
from titan_async.cluster.schedule_memory import with_schedule
from titan_async.config.run_config import RunConfig
from titan_async.core.errors import UserError
from titan_async.pipeline.actions import gradient_delay
from titan_async.pipeline.config import accumulation_steps, check_activation_checkpoint
from titan_async.pipeline.schedules import STREAMING_SCHEDULES

ACTIVATION_CHECKPOINT_MODES = ("none", "selective", "full")
MICROBATCH_SIZES = (1, 2, 4)
"""Microbatch sizes tried besides the config's own, with a pipeline."""
NO_PIPELINE_SIZES = (1, 2, 4, 8)
"""Sequences per forward tried without a pipeline, besides the data rank's whole batch."""
KINDS = ("no pipeline", "fewer stages", "config")
FALLBACK_SCHEDULE = "GPipe"
"""The schedule a setting is simulated as when the config's refuses it (torch's GPipe runs any
number of microbatches): the simulation covers every schedule whichever the config names."""
SYNCHRONOUS_SCHEDULE = "1F1B"
"""The schedule name a layout without a pipeline carries (no weight versions: its memory is that of a synchronous run)."""


@dataclass(frozen=True)
class Setting:
    """What the advisor varies per schedule: activation checkpointing mode and microbatch size
    (without a pipeline: the local batch of one forward, gradient accumulation over the rest)."""

    activation_checkpoint: str
    microbatch_size: int

    @property
    def label(self) -> str:
        return f"ac={self.activation_checkpoint} mb={self.microbatch_size}"

    def apply(self, run: RunConfig) -> RunConfig:
        """`run` with this setting, nothing else changed (without a pipeline the local batch is
        the microbatch, the global batch stays)."""
        training = run.training
        if run.parallelism.pipeline_parallel_degree == 1:
            training = replace(training, local_batch_size=self.microbatch_size)
        return replace(run, training=training,
                       activation_checkpoint=replace(run.activation_checkpoint, mode=self.activation_checkpoint),
                       parallelism=replace(run.parallelism, pipeline_parallel_microbatch_size=self.microbatch_size))


def settings(run: RunConfig) -> list[Setting]:
    """Every activation checkpointing mode x each microbatch size that splits `run`'s local batch
    (into fewer microbatches than stages too): with a pipeline `MICROBATCH_SIZES` and the
    config's; without one `NO_PIPELINE_SIZES` and the whole local batch."""
    local, pp = run.training.local_batch_size, run.parallelism.pipeline_parallel_degree
    tried = {*NO_PIPELINE_SIZES, local} if pp == 1 else {*MICROBATCH_SIZES, run.parallelism.pipeline_parallel_microbatch_size}
    return [Setting(mode, size) for size in sorted(tried) if local % size == 0 for mode in ACTIVATION_CHECKPOINT_MODES]


@dataclass(frozen=True)
class Candidate:
    """A layout the advisor tries at one GPU count: its kind (`KINDS`) and degrees (CP is the config's)."""

    kind: str
    pp: int
    tp: int
    replicas: int

    def label(self, gpus: int, cp: int) -> str:
        """"PP 8 x FSDP 8", "TP 8 x FSDP 2 x replicas 4", ...: the degrees above 1."""
        shard = gpus // (self.pp * self.tp * cp * self.replicas)
        parts = [f"{name} {degree}" for name, degree in (("PP", self.pp), ("TP", self.tp), ("CP", cp),
                                                          ("FSDP", shard), ("replicas", self.replicas)) if degree > 1]
        return " x ".join(parts) or "1 GPU"


def candidates(run: RunConfig, gpus: int, gpus_per_node: int) -> list[Candidate]:
    """The layouts tried on `gpus` GPUs with `gpus_per_node` per node (module docstring), each once
    (a mixture-of-experts model without TP)."""
    p = run.parallelism
    sizes = run.model.resolved(0)
    found = [Candidate("config", p.pipeline_parallel_degree, p.tensor_parallel_degree, p.data_parallel_replicate_degree)]
    stages = p.pipeline_parallel_degree // 2
    while stages >= 2:
        found.append(Candidate("fewer stages", stages, p.tensor_parallel_degree, p.data_parallel_replicate_degree))
        stages //= 2
    nodes = gpus // gpus_per_node
    moe = run.model.family == "qwen3_moe"  # plan estimates MoE without TP
    for tp in [1] if moe else sorted({1, p.tensor_parallel_degree, gpus_per_node}):
        if sizes["n_heads"] % tp or sizes["n_kv_heads"] % tp:
            continue
        found.append(Candidate("no pipeline", 1, tp, 1))
        if nodes > 1 and gpus_per_node // (tp * p.context_parallel_degree) > 1:
            found.append(Candidate("no pipeline", 1, tp, nodes))
    unique: dict[tuple[int, int, int], Candidate] = {}
    for candidate in found:
        unique.setdefault((candidate.pp, candidate.tp, candidate.replicas), candidate)
    return list(unique.values())


def at_layout(run: RunConfig, sequences: int, gpus: int, candidate: Candidate) -> RunConfig | str:
    """`run` on `gpus` GPUs in `candidate`'s layout with `sequences` per step, or why it cannot be."""
    p, t, c = run.parallelism, run.training, candidate
    fixed = c.pp * c.tp * p.context_parallel_degree * c.replicas
    if gpus % fixed:
        return f"{gpus} GPUs do not divide into the pipeline x TP x CP x replica degrees ({fixed})"
    data_ranks = gpus // fixed * c.replicas
    local, rest = divmod(sequences, data_ranks)
    if rest or local == 0:
        return f"{sequences} sequences per step do not divide over {data_ranks} data ranks"
    parallelism = replace(p, pipeline_parallel_degree=c.pp, tensor_parallel_degree=c.tp, data_parallel_replicate_degree=c.replicas,
                          data_parallel_shard_degree=-1)
    if c.pp != p.pipeline_parallel_degree:
        parallelism = replace(parallelism, module_fqns_per_model_part=None)
    training = replace(t, local_batch_size=local, global_batch_size=-1)
    if c.pp == 1:
        parallelism = replace(parallelism, pipeline_parallel_schedule=SYNCHRONOUS_SCHEDULE, emulated_stages=0)
        training = replace(training, global_batch_size=sequences, weight_prediction=0.0, gradient_delay=0, sync_start_steps=0)
    return replace(run, training=training, parallelism=parallelism)


def _candidates(name: str, plans: dict[Setting, dict]) -> tuple[list[tuple[float, Setting, dict]], list[tuple[float, str]]]:
    """Schedule `name`'s simulated rows that `train` would run and that fit, as (tokens/s,
    setting, row), and each other setting as (its peak bytes, inf where unknown; why)."""
    fitting, why = [], []
    for setting, plan in plans.items():
        if check_activation_checkpoint(with_schedule(plan["run"], name).parallelism, setting.activation_checkpoint):
            continue
        row = next((r for r in plan["simulation"]["schedules"] if r["name"] == name), None)
        if row is None:
            why.append((math.inf, f"{setting.label}: not simulated: {plan['simulation']['skipped'].get(name, 'unknown')}"))
        elif row.get("memory") is None:
            why.append((math.inf, f"{setting.label}: memory not estimated: {row.get('memory_note', '')}"))
        elif not row["memory"]["fits"]:
            peak = row["memory"]["peak_bytes"]
            why.append((peak, f"no setting fits --gpu-memory; the smallest peak is {peak / 2**30:.1f} GiB ({setting.label})"))
        else:
            fitting.append((row["tokens_per_second"], setting, row))
    return fitting, why


def schedule_delay(name: str, plan: dict) -> int:
    """The delay in steps whose staleness schedule `name` pays at `plan`'s layout: 0 when
    synchronous; PipeDream2BW's d = ceil((p - 1) / m) (at least 1, m the microbatches of its
    window); PACI's bound, ceil((p - 1) / a) local steps (at least 1, a the backwards of each)."""
    if name not in STREAMING_SCHEDULES:
        return 0
    layout = plan["layout"]
    window = layout["microbatches"] * layout["accumulation_steps"]
    every = window if name == "PipeDream2BW" else plan["run"].parallelism.paci.accumulation or window
    return gradient_delay(layout["pipeline_parallel"], every)


def best_fitting(name: str, plans: dict[Setting, dict], goal: Target | None = None) -> dict[str, Any] | str:
    """Schedule `name`'s best fitting setting among `plans` (setting -> plan with its "run"): of
    least time to `goal` (`rank_key`; most tokens/s without one), with its tokens/s, setting,
    m / p, delay (`schedule_delay`) and peak bytes; or, when none fits, why in one line (the
    setting with the smallest peak, or why the first could not be simulated or estimated)."""
    fitting, why = _candidates(name, plans)
    if not fitting:
        return min(why, key=lambda found: found[0])[1] if why else "every setting refused with this schedule"
    rows = []
    for tokens, setting, row in fitting:
        chosen = {"tokens_per_second": tokens, "setting": setting.label, "activation_checkpoint": setting.activation_checkpoint,
                  "microbatch_size": setting.microbatch_size, "m_over_p": _m_over_p(plans[setting]),
                  "delay": schedule_delay(name, plans[setting]), "peak_bytes": row["memory"]["peak_bytes"]}
        rows.append(chosen | (time_to_target(tokens, goal, name, chosen["delay"]) if goal else {}))
    return min(rows, key=lambda row: rank_key(row, goal))


def _m_over_p(plan: dict) -> float:
    layout = plan["layout"]
    return layout["microbatches"] * layout["accumulation_steps"] / layout["pipeline_parallel"]


def advise_point(run: RunConfig, cluster: Cluster, simulate: Callable[[RunConfig, Cluster], dict],
                 goal: Callable[[int], Target] | None = None) -> dict[str, Any] | str:
    """Every schedule at its best fitting setting (`best_fitting`, each with its time to
    `goal(parameters)` where given) for `run` on `cluster`, the best synchronous and streaming
    ones by tokens/s, the gain of the one over the other, the fastest schedule and the model's
    parameters; or why no setting could be simulated."""
    plans, errors = {}, []
    for setting in settings(run):
        applied = setting.apply(run)
        try:
            plans[setting] = {**simulate(applied, cluster), "run": applied}
        except UserError as err:
            try:  # the config's schedule refuses this setting (1F1B with fewer microbatches than stages): every other is still simulated
                plans[setting] = {**simulate(with_schedule(applied, FALLBACK_SCHEDULE), cluster), "run": applied, "refused": str(err)}
            except UserError:
                errors.append(f"{setting.label}: {err}")
    if not plans:
        return errors[0]
    names = dict.fromkeys(name for plan in plans.values()
                          for name in [*(r["name"] for r in plan["simulation"]["schedules"]), *plan["simulation"]["skipped"]])
    aim = goal(next(iter(plans.values()))["parameters"]) if goal else None
    chosen = {name: best_fitting(name, plans, aim) for name in names}
    fits = {name: c for name, c in chosen.items() if isinstance(c, dict)}
    tokens = {name: c["tokens_per_second"] for name, c in fits.items()}
    synchronous = {name: v for name, v in tokens.items() if name not in STREAMING_SCHEDULES}
    streaming = {name: v for name, v in tokens.items() if name in STREAMING_SCHEDULES}
    best_sync = max(synchronous, key=synchronous.get) if synchronous else None
    best_stream = max(streaming, key=streaming.get) if streaming else None
    own = Setting(run.activation_checkpoint.mode, run.parallelism.pipeline_parallel_microbatch_size)
    fastest = max(tokens, key=tokens.get) if tokens else None
    unfit = {name: c for name, c in chosen.items() if isinstance(c, str)}
    return {
        "tokens_per_second": tokens,
        "settings": fits,
        "unfit": unfit,
        **({} if fits else {"reason": none_fits(names, plans, unfit)}),
        "m_over_p": fits[fastest]["m_over_p"] if fastest else None,
        "best_synchronous": best_sync,
        "best_streaming": best_stream,
        "streaming_gain": streaming[best_stream] / synchronous[best_sync] if best_sync and best_stream else None,
        "fastest": fastest,
        "config_schedule_fits": plans[own]["fits"] if own in plans and "refused" not in plans[own] else None,
        "data_parallel_shard": next(iter(plans.values()))["layout"]["data_parallel_shard"],
        "parameters": next(iter(plans.values()))["parameters"],
    }


def none_fits(names: dict[str, None], plans: dict[Setting, dict], unfit: dict[str, str]) -> str:
    """Why no schedule of a layout fits, in one line: the schedule with the smallest peak at any
    setting `train` would run (`_candidates`), or why the first could not be simulated or estimated."""
    peaks = [(min(why)[0], name) for name in names for _, why in [_candidates(name, plans)] if why]
    peak, name = min(peaks, default=(math.inf, None))
    if name is None or peak == math.inf:
        return next(iter(unfit.items()), ("", "every setting refused"))[1]
    return f"{name}: {unfit[name]}"


SYNCHRONOUS = staleness.Estimate(1.0, 1.0, 1.0, ())


@dataclass(frozen=True)
class Target:
    """What time to the synchronous run's final loss needs: the run's total tokens and the
    delay's token efficiency (`staleness.estimate`; None for an optimizer or corrector the law
    does not cover, with `unknown` saying so)."""

    tokens: int
    delay: staleness.Estimate | None
    unknown: str = ""
    longer: Callable[[int], staleness.Estimate | None] = lambda delay: None
    """The estimate at a delay of several steps (None where the law has no delay term for it)."""

    def efficiency(self, name: str, delay: int = 1) -> staleness.Estimate | None:
        """Schedule `name`'s token efficiency: 1 unless streaming; a streaming one's estimate at
        `delay` steps."""
        if name not in STREAMING_SCHEDULES:
            return SYNCHRONOUS
        return self.delay if delay <= 1 or self.delay is None else self.longer(delay)


def target(run: RunConfig, tokens_per_step: int, parameters: int, law: staleness.Law | None) -> Target:
    """`run`'s `Target`: training.steps x `tokens_per_step`, and the delay's efficiency for its
    optimizer and corrector after training.steps steps of a `parameters`-parameter model."""
    tokens = run.training.steps * tokens_per_step
    corrector = staleness.corrector_of(run.optimizer.error_feedback.enabled, run.training.weight_prediction)

    @cache
    def longer(delay: int) -> staleness.Estimate | None:
        try:
            return staleness.estimate(run.optimizer.name, corrector, run.training.steps, parameters, law, delay)
        except KeyError:
            return None

    try:
        return Target(tokens, staleness.estimate(run.optimizer.name, corrector, run.training.steps, parameters, law), longer=longer)
    except KeyError:
        return Target(tokens, None, f"the staleness law covers AdamW and Muon, not optimizer.name = {run.optimizer.name!r} "
                                    f"with corrector {corrector!r}: the streaming schedules' efficiency is unknown, "
                                    "every layout is ranked by tokens/s")


def time_to_target(tokens_per_second: float, goal: Target, name: str, delay: int = 1) -> dict[str, float | None]:
    """Schedule `name`'s token efficiency at `delay` steps with its range and its hours to the
    synchronous run's final loss, goal.tokens / (tokens/s x efficiency), with their range (None
    where unknown)."""
    found = goal.efficiency(name, delay)
    if found is None:
        return dict.fromkeys(("efficiency", "efficiency_low", "efficiency_high", "hours", "hours_low", "hours_high"))

    def hours(efficiency: float) -> float:
        return goal.tokens / (tokens_per_second * efficiency) / 3600

    return {"efficiency": found.efficiency, "efficiency_low": found.low, "efficiency_high": found.high,
            "hours": hours(found.efficiency), "hours_low": hours(found.high), "hours_high": hours(found.low)}


def rank_key(entry: dict[str, Any], goal: Target | None) -> tuple[bool, float]:
    """What orders schedules and layouts, least first: hours to target, a row of unknown hours (a
    delay the law has no term for) after every known one; without a goal or with the efficiency
    unknown, seconds per token."""
    if goal is None or goal.delay is None or entry["hours"] is None:
        return goal is not None and goal.delay is not None, 1 / entry["tokens_per_second"]
    return False, entry["hours"]


def _entries(layout: dict[str, Any]) -> list[dict[str, Any]]:
    """A fitting layout's schedules as rows of the advice (`KINDS` kind, layout, schedule, setting, time)."""
    return [{"kind": layout["kind"], "layout": layout["layout"], "schedule": name, **chosen}
            for name, chosen in layout.get("settings", {}).items()]


def advise_gpu_count(run: RunConfig, sequences: int, cluster: Cluster, simulate: Callable[[RunConfig, Cluster], dict],
                     goal: Callable[[int], Target]) -> dict[str, Any]:
    """Every layout of `candidates` on `cluster` (`advise_point`, each schedule with its
    `time_to_target`; `goal(parameters)` the target), each layout's best schedule, each kind's
    best layout ("best": kind -> row, or the reason none fits), the "recommended" row (least
    time), the "fastest" (most tokens/s), and the best streaming and best synchronous rows over
    every layout ("best_streaming", "best_synchronous"; no pipeline counts as synchronous)."""
    layouts = []
    for candidate in candidates(run, cluster.world_size, cluster.gpus_per_node):
        described = {"kind": candidate.kind, "layout": candidate.label(cluster.world_size, run.parallelism.context_parallel_degree),
                     "pipeline_parallel": candidate.pp, "tensor_parallel": candidate.tp, "data_parallel_replicate": candidate.replicas}
        scaled = at_layout(run, sequences, cluster.world_size, candidate)
        point = scaled if isinstance(scaled, str) else advise_point(scaled, cluster, simulate, goal)
        if isinstance(point, str):
            layouts.append({**described, "reason": point})
            continue
        aim = goal(point["parameters"])
        rows = _entries({**described, **point})
        best = min(rows, key=lambda row: rank_key(row, aim))["schedule"] if rows else None
        layouts.append({**described, **point, "best": best})
    rows = [row for layout in layouts if "reason" not in layout for row in _entries(layout) if row["schedule"] == layout["best"]]
    aim = goal(next((layout["parameters"] for layout in layouts if "parameters" in layout), 0)) if rows else None
    best = {}
    for kind in KINDS:
        mine = [row for row in rows if row["kind"] == kind]
        tried = [layout for layout in layouts if layout["kind"] == kind]
        if mine:
            best[kind] = min(mine, key=lambda row: rank_key(row, aim))
        elif tried:
            best[kind] = "; ".join(f"{layout['layout']}: {layout['reason']}" for layout in tried)
    every = [row for layout in layouts if "reason" not in layout for row in _entries(layout)]
    streaming = [row for row in every if row["schedule"] in STREAMING_SCHEDULES]
    synchronous = [row for row in every if row["schedule"] not in STREAMING_SCHEDULES]
    return {
        "layouts": layouts,
        "best": best,
        "recommended": min(rows, key=lambda row: rank_key(row, aim)) if rows else None,
        "fastest": max(every, key=lambda row: row["tokens_per_second"]) if every else None,
        "best_streaming": min(streaming, key=lambda row: rank_key(row, aim)) if streaming else None,
        "best_synchronous": min(synchronous, key=lambda row: rank_key(row, aim)) if synchronous else None,
    }


def advise(run: RunConfig, cluster: Cluster, gpu_counts: list[int], simulate: Callable[[RunConfig, Cluster], dict],
           law: staleness.Law | None = None) -> dict[str, Any]:
    """The layouts and schedules of `advise_gpu_count` at each of `gpu_counts` for the global batch
    `run` has on `cluster`, ranked by time to target under `law` (default: the shipped one);
    `simulate(run, cluster)` is a plan with its "layout", "fits", "parameters" and "simulation"
    (each schedule's memory included)."""
    check_world_size(run, cluster)
    data_ranks = run.data_parallel_degree(cluster.world_size)
    sequences = run.training.local_batch_size * data_ranks * accumulation_steps(run.training, data_ranks)
    tokens_per_step = sequences * run.training.seq_len
    targets: dict[int, Target] = {}

    def goal(parameters: int) -> Target:
        if parameters not in targets:
            targets[parameters] = target(run, tokens_per_step, parameters, law)
        return targets[parameters]

    points, skipped = [], []
    for gpus in gpu_counts:
        if gpus % cluster.gpus_per_node and gpus > cluster.gpus_per_node:
            skipped.append({"gpus": gpus, "reason": f"not a whole number of {cluster.gpus_per_node}-GPU nodes"})
            continue
        nodes, per_node = (gpus // cluster.gpus_per_node, cluster.gpus_per_node) if gpus >= cluster.gpus_per_node else (1, gpus)
        point = advise_gpu_count(run, sequences, replace(cluster, nodes=nodes, gpus_per_node=per_node), simulate, goal)
        if point["recommended"] is None:
            config = next(layout for layout in point["layouts"] if layout["kind"] == "config")
            skipped.append({"gpus": gpus, "reason": f"no layout fits; the config's: {config['reason']}"})
            continue
        points.append({"gpus": gpus, **point})
    goals = list(targets.values())
    return {"sequences_per_step": sequences, "tokens_per_step": tokens_per_step, "steps": run.training.steps,
            "total_tokens": run.training.steps * tokens_per_step, "gpu_memory_bytes": cluster.gpu_memory,
            "notes": notes(run, goals[0]) if goals else [], "points": points, "skipped": skipped}


def notes(run: RunConfig, goal: Target) -> list[str]:
    """How the streaming schedules' efficiency was found, in lines: the law's estimate (or why
    none), what it extrapolates, and that PACI's is an upper bound of its cost."""
    if goal.delay is None:
        return [goal.unknown]
    corrector = staleness.corrector_of(run.optimizer.error_feedback.enabled, run.training.weight_prediction)
    lines = [f"streaming schedules' token efficiency {goal.delay.efficiency:.3f} ({goal.delay.low:.3f}-{goal.delay.high:.3f}): "
             f"the staleness law for {run.optimizer.name} with corrector {corrector!r} after {run.training.steps:,} steps; "
             "synchronous schedules and no pipeline 1",
             "PACI: the estimate at its delay, an upper bound of its cost (with a >= p - 1 backwards per local step a "
             "microbatch crosses at most one update of its stage; with fewer, up to ceil((p - 1) / a))"]
    longer = goal.longer(2)
    lines.append("fewer microbatches than stages (m < p - 1): PipeDream2BW delays by d = ceil((p - 1) / m) steps, "
                 + ("costed by the law's delay term (ln(1/eta) x d ** exponent)" if longer else
                    "whose efficiency is unknown (the law has no delay term for this optimizer and corrector): "
                    "such rows rank after every row of known time"))
    lines += [f"extrapolated: {note}" for note in goal.delay.extrapolated]
    return lines


def draw(advice: dict[str, Any], path: Path) -> None:
    """Each kind's best layout against the GPU count, as GPU-hours to the synchronous run's final
    loss over those of the count's fastest layout by that measure (tokens/s over the fastest's where
    the efficiency is unknown), with the pessimistic end of each streaming schedule's range as an
    error bar; each point labelled with its schedule."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = advice["points"]
    timed = all(isinstance(row, str) or row["hours"] is not None
                for point in points for row in point["best"].values())
    figure, axes = plt.subplots(figsize=(8, 5))
    for kind in KINDS:
        mine = [(point, point["best"][kind]) for point in points if isinstance(point["best"].get(kind), dict)]
        if not mine:
            continue
        if timed:
            ratios = [row["hours"] / point["recommended"]["hours"] for point, row in mine]
            worst = [row["hours_high"] / point["recommended"]["hours"] - ratio for (point, row), ratio in zip(mine, ratios)]
        else:
            ratios = [row["tokens_per_second"] / point["fastest"]["tokens_per_second"] for point, row in mine]
            worst = [0.0] * len(mine)
        gpus = [point["gpus"] for point, _ in mine]
        axes.errorbar(gpus, ratios, yerr=[[0.0] * len(mine), worst], fmt="-o", capsize=3, label=kind)
        for x, ratio, (_, row) in zip(gpus, ratios, mine):
            axes.annotate(row["schedule"], (x, ratio), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=6)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("GPUs")
    axes.set_ylabel("hours to the synchronous run's final loss / the best layout's" if timed else "tokens/s / the fastest's")
    axes.set_title(f"{advice['tokens_per_step']:,} tokens per step, {advice['steps']:,} steps (error bars: the delay's pessimistic end)",
                   fontsize=9)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)
