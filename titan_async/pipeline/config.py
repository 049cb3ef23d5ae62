"""Config sections and checks for the streaming schedules and the delayed-gradient reference."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torchtitan.config.configs import ParallelismConfig, TrainingConfig

from titan_async.pipeline.actions import gradient_delay
from titan_async.pipeline.schedules import SCHEDULE_NAMES, SchedulePACI, SchedulePipeDream2BW, streaming_schedule


@dataclass(kw_only=True, slots=True)
class PACISection:
    """`[parallelism.paci]`: PACI's local accumulation."""

    toml_subsection: ClassVar[bool] = True
    accumulation: int | None = None
    """a: local backwards per optimizer step on each stage; unset = the number of microbatches."""


@dataclass(kw_only=True, slots=True)
class PipelineParallelism(ParallelismConfig):
    """torchtitan's parallelism settings plus the streaming schedules' own."""

    emulated_stages: int = 0
    """With pipeline_parallel_degree = 1 and a streaming schedule: run that many stages of it in this
    one process (the single-process emulation of its update timing)."""
    paci: PACISection = field(default_factory=PACISection)


CLIPPING_MODES = ("per_stage", "lagged_global")


@dataclass(kw_only=True, slots=True)
class DelayTraining(TrainingConfig):
    """torchtitan's training settings plus the delayed-gradient reference and the batch-size ramp."""

    gradient_delay: int = 0
    """d >= 1: train without pipeline parallelism on the 2BW rule W[k+1] = W[k] - Opt(grad f(W[k-d]))
    (d = 1: PipeDream-2BW's; d > 1: the bounded delay of PipeDream2BW with fewer microbatches
    than stages, `pipeline_delay`)."""
    clipping: str = "per_stage"
    """How the streaming schedules apply `max_norm` (synchronous ones clip the global norm, as
    torchtitan does): "per_stage", each stage clips its own gradient to max_norm; "lagged_global",
    every stage scales the update applying the batch of step t by min(1, max_norm / G), G the
    global norm logged at step t - 3 (the latest every stage knows without waiting), and clips its
    own gradient to max_norm / sqrt(stages) until such a norm exists."""
    sync_start_steps: int = 0
    """N > 0 (Sync Start): train steps 1..N synchronously, then go on with the streaming schedule
    (or `gradient_delay = 1`) as if it started from the weights after step N; 0: off."""
    weight_prediction: float = 0.0
    """h > 0: PipeDream2BW (or `gradient_delay`) takes each delayed gradient at the weights
    extrapolated along the last update by the delay d, W[k-d] + h d (W[k-d] - W[k-d-1])
    (`versions.PredictedVersions`);
    PACI runs a stage's forwards at W + h d (W - W_prev), d its mean delay in local steps
    (`versions.PredictedAccumulation`); 0: off."""
    batch_ramp_steps: list[int] = field(default_factory=list)
    """A global batch-size ramp: the steps (counted from 0, strictly increasing from 0) from which
    the global batch is the size at the same place of batch_ramp_sizes; empty: no ramp."""
    batch_ramp_sizes: list[int] = field(default_factory=list)
    """The ramp's global batch sizes in sequences, one per batch_ramp_steps entry, each a multiple
    of local_batch_size x the data-parallel degree (the local batches accumulate); the last is the
    run's global_batch_size. PipeDream2BW drains where the size changes; PACI refuses a ramp."""

    def __post_init__(self) -> None:
        if self.clipping not in CLIPPING_MODES:
            raise ValueError(f"training.clipping must be one of {', '.join(map(repr, CLIPPING_MODES))}, got {self.clipping!r}")


def sync_start_text(steps: int, schedule: str) -> str:
    """How a Sync Start of `steps` steps trains before `schedule` (what plan and report print)."""
    return f"steps 1..{steps} synchronous (the stream drained after each), then {schedule}"


def microbatches(training: TrainingConfig, parallelism: PipelineParallelism) -> int:
    """Microbatches per batch: with pipeline parallelism or its emulation, local batch / microbatch size."""
    if parallelism.pipeline_parallel_degree == 1 and not parallelism.emulated_stages:
        return 1
    return training.local_batch_size // parallelism.pipeline_parallel_microbatch_size


def accumulation_steps(training: TrainingConfig, data_parallel: int) -> int:
    """Local batches per optimizer step (torchtitan's gradient accumulation): global batch /
    (local batch x data-parallel degree); 1 when the global batch is left to default."""
    if training.global_batch_size <= 0:
        return 1
    return max(1, training.global_batch_size // (training.local_batch_size * data_parallel))


def synchronous_throughout(training: DelayTraining) -> str | None:
    """A warning when Sync Start covers every step of the run: it streams only once resumed with
    more steps (a run trained in parts), which a whole run set up so by mistake never does."""
    if training.sync_start_steps and training.sync_start_steps >= training.steps:
        return (f"training.sync_start_steps = {training.sync_start_steps} covers every step of training.steps = "
                f"{training.steps}: this run is synchronous throughout, and streams only if resumed with more steps")
    return None


def pipeline_delay(training: DelayTraining, parallelism: PipelineParallelism, data_parallel: int, microbatches: int) -> int:
    """The gradient delay d in steps of 2BW's rule this run trains: `training.gradient_delay`, or
    PipeDream2BW's ceil((stages - 1) / microbatches per step) (`actions.gradient_delay`); 0 for
    the other schedules."""
    if training.gradient_delay:
        return training.gradient_delay
    if streaming_schedule(parallelism.pipeline_parallel_schedule) is not SchedulePipeDream2BW:
        return 0
    stages = parallelism.emulated_stages or parallelism.pipeline_parallel_degree
    return gradient_delay(stages, microbatches * accumulation_steps(training, data_parallel))


def check_delay(training: DelayTraining, parallelism: PipelineParallelism, data_parallel: int, microbatches: int,
                moe: bool) -> str | None:
    """Why a delay of several steps (`pipeline_delay` > 1) cannot run with these settings, naming
    the key; None if it can. d + 1 weight versions are kept of plain and FSDP2 parameters (with
    replicas and TP), predicted on unsharded ones only; no Sync Start, lagged clipping or experts
    yet."""
    delay = pipeline_delay(training, parallelism, data_parallel, microbatches)
    if delay <= 1:
        return None
    source, instead = f"training.gradient_delay = {delay}:", ""
    if not training.gradient_delay:
        stages = parallelism.emulated_stages or parallelism.pipeline_parallel_degree
        source = (f"PipeDream2BW with {microbatches * accumulation_steps(training, data_parallel)} microbatches per step on "
                  f"{stages} stages delays each gradient by d = ceil((stages - 1) / microbatches) = {delay} steps:")
        instead = f", or give each step at least {stages - 1} microbatches"
    unsupported = [
        (data_parallel > 1 and bool(training.weight_prediction),
         f"training.weight_prediction = {training.weight_prediction} and FSDP or replicas (parallelism.data_parallel_shard_degree "
         f"x data_parallel_replicate_degree = {data_parallel})", "set weight_prediction to 0 or both degrees to 1"),
        (bool(training.sync_start_steps), f"training.sync_start_steps = {training.sync_start_steps}", "set it to 0"),
        (training.clipping == "lagged_global", "training.clipping = 'lagged_global'", "set it to 'per_stage'"),
        (moe, "model.family = 'qwen3_moe'", "use a dense model"),
    ]
    for present, feature, fix in unsupported:
        if present:
            return f"{source} a delay of more than one step does not run with {feature} yet: {fix}{instead}"
    return None


def stage_delay(training: DelayTraining, schedule: str, stage: int, stages: int, microbatches: int, accumulation: int | None) -> float:
    """Stage `stage`'s gradient delay in its own updates, as the lr rescheduling divides by it
    (`lr_scheduler.delay_rescheduling_steps`): `training.gradient_delay`, or PipeDream2BW's
    ceil((stages - 1) / microbatches) on every stage; PACI's mean, (stages - 1 - stage) /
    accumulation (`microbatches`: a data rank's per step, accumulation included)."""
    if training.gradient_delay:
        return training.gradient_delay
    if streaming_schedule(schedule) is SchedulePACI:
        return (stages - 1 - stage) / (accumulation or microbatches)
    return gradient_delay(stages, microbatches)


def check_delay_rescheduling(steps: int, training: DelayTraining, parallelism: PipelineParallelism) -> str | None:
    """Why `lr_scheduler.delay_rescheduling_steps` cannot apply, naming the keys; None if it can:
    it divides the lr by a gradient delay, which the synchronous schedules do not have."""
    name = parallelism.pipeline_parallel_schedule
    if not steps or training.gradient_delay or streaming_schedule(name):
        return None
    return (f"lr_scheduler.delay_rescheduling_steps = {steps} divides the lr by a gradient delay; "
            f"parallelism.pipeline_parallel_schedule = {name!r} has none: set it to 0, or use PipeDream2BW or PACI "
            "(or training.gradient_delay)")


def check_pipeline(training: DelayTraining, parallelism: PipelineParallelism) -> str | None:
    """Why this schedule/delay combination cannot run, naming the keys; None if it can (a delay
    of several steps: `check_delay`)."""
    name = parallelism.pipeline_parallel_schedule
    key = f"parallelism.pipeline_parallel_schedule = {name!r}"
    if name.lower() not in {n.lower() for n in SCHEDULE_NAMES}:
        return f"{key}: unknown schedule; valid names are {', '.join(SCHEDULE_NAMES)}"
    if training.gradient_delay and parallelism.pipeline_parallel_degree > 1:
        return (f"training.gradient_delay = {training.gradient_delay} is the single-process reference; with "
                "pipeline_parallel_degree > 1 use pipeline_parallel_schedule = \"PipeDream2BW\"")
    schedule = streaming_schedule(name)
    if training.clipping == "lagged_global" and schedule is None:
        return (f"training.clipping = 'lagged_global' is for the streaming schedules (PipeDream2BW, PACI); {key} "
                "clips each step's global norm (torchtitan's rule): leave training.clipping = 'per_stage'")
    if training.sync_start_steps and schedule is None and not training.gradient_delay:
        return (f"training.sync_start_steps = {training.sync_start_steps} trains the first steps synchronously before a "
                f"streaming schedule (PipeDream2BW, PACI) or training.gradient_delay = 1; {key} is synchronous throughout: "
                "set training.sync_start_steps = 0, or pick a streaming schedule")
    if training.weight_prediction and schedule is None and not training.gradient_delay:
        return (f"training.weight_prediction = {training.weight_prediction:g} predicts the weights a delayed gradient meets; "
                f"{key} has no delay: use PipeDream2BW or PACI (or training.gradient_delay = 1), "
                "or set training.weight_prediction = 0")
    if training.weight_prediction and training.sync_start_steps:
        return "training.weight_prediction does not run with training.sync_start_steps yet: set one of them to 0"
    if parallelism.emulated_stages and schedule is None:
        return f"parallelism.emulated_stages = {parallelism.emulated_stages} emulates a streaming schedule (PipeDream2BW or PACI), not {name!r}"
    if schedule is None:
        return None
    p = parallelism.pipeline_parallel_degree
    if parallelism.emulated_stages:
        if p > 1:
            return "parallelism.emulated_stages runs every stage in one process; set pipeline_parallel_degree = 1"
        p = parallelism.emulated_stages
    if p < 2:
        return (
            f"{key} needs parallelism.pipeline_parallel_degree >= 2, or parallelism.emulated_stages >= 2 "
            "for the single-process emulation"
        )
    unsupported = {
        "parallelism.context_parallel_degree > 1": parallelism.context_parallel_degree > 1,
        "parallelism.pipeline_parallel_layers_per_stage (several stages per rank)": parallelism.pipeline_parallel_layers_per_stage is not None,
        "parallelism.pipeline_parallel_schedule_csv": bool(parallelism.pipeline_parallel_schedule_csv),
    }
    for feature, present in unsupported.items():
        if present:
            return f"{key} does not support {feature} yet"
    return None


SPLIT_BACKWARD_SCHEDULES = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
"""torch's schedules that split each backward into input and weight gradients
(`stage_backward_input`, then `stage_backward_weight` through the same autograd nodes)."""


def prepare_split_backward(schedule: str, compiled: bool) -> str | None:
    """Before a schedule of `SPLIT_BACKWARD_SCHEDULES` builds its model: turn off torch's donated
    buffers, without which a compiled backward (a compiled block's, or FlexAttention's on CUDA,
    also in an eager block) refuses to run twice ("compiled with non-empty donated buffers"); and,
    for `compiled` blocks, a warning that each split backward runs the block's whole backward twice.
    None for other schedules, which are left as torch has them."""
    if schedule.lower() not in {name.lower() for name in SPLIT_BACKWARD_SCHEDULES}:
        return None
    import torch._functorch.config

    torch._functorch.config.donated_buffer = False
    if not compiled:
        return None
    return (f"{schedule} with compiled blocks: a compiled block is one autograd node, so its split backward runs the "
            "whole backward for the input gradients and again for the weight gradients ((I + W) / B = 2.14 measured, "
            "1.03 eager); plan --simulate charges this")


def check_activation_checkpoint(parallelism: PipelineParallelism, mode: str) -> str | None:
    """Why activation checkpointing `mode` cannot run with this schedule, naming the key; None if it can.

    Under PACI a block recomputed in the backward sees the weights current at that moment
    (`versions.LocalAccumulation`): "full" recomputes whole blocks, a rule of its own;
    "selective" keeps some of a block's forward-time outputs and recomputes the rest, a mix
    of both rules, which is refused."""
    name = parallelism.pipeline_parallel_schedule
    if mode == "selective" and name.lower() in {n.lower() for n in SPLIT_BACKWARD_SCHEDULES}:
        return (f"activation_checkpoint.mode = 'selective' cannot run with {name}: its split backward runs a "
                "block's backward twice (input, then weight gradients), which torch refuses under selective "
                "recomputation (\"Trying to backward an extra time\"); set activation_checkpoint.mode = \"full\" or \"none\"")
    if mode != "selective" or streaming_schedule(name) is not SchedulePACI:
        return None
    return (
        "activation_checkpoint.mode = 'selective' cannot run with PACI: a block's backward would mix outputs its "
        "forward saved (every second matmul, attention) with ops recomputed with the weights of later local steps; "
        "set activation_checkpoint.mode = \"full\" (blocks recomputed with the current weights) or \"none\" "
        "(the forward's activations)"
    )
