"""The global batch-size ramp (`training.batch_ramp_steps`, `training.batch_ramp_sizes`).

From step index k (counted from 0: the step the trainer numbers k + 1) the global batch holds the
ramp's size for k, in sequences: each data rank accumulates size / (local batch x data ranks) local
batches. A step takes whole rounds of the data ranks, so the data consumed after any step is a
prefix of the run's one sample order, and the step a sample falls in follows from the ramp.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from titan_async.pipeline.actions import gradient_delay
from titan_async.pipeline.config import DelayTraining, PipelineParallelism, microbatches
from titan_async.pipeline.schedules import SchedulePACI, SchedulePipeDream2BW, streaming_schedule


@dataclass(frozen=True)
class BatchRamp:
    """Global batch `sizes[j]` from step index `steps[j]` on (steps strictly increasing from 0)."""

    steps: tuple[int, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, training: DelayTraining, data_parallel: int) -> BatchRamp:
        """The run's ramp; without one, its global batch every step."""
        if not training.batch_ramp_steps:
            size = training.global_batch_size if training.global_batch_size > 0 else training.local_batch_size * data_parallel
            return cls((0,), (size,))
        return cls(tuple(training.batch_ramp_steps), tuple(training.batch_ramp_sizes))

    def size_at(self, step: int) -> int:
        """The global batch of step index `step`."""
        return self.sizes[sum(1 for start in self.steps[1:] if start <= step)]

    def step_of(self, sample: int, step: int = 0, first: int = 0) -> int:
        """The step index whose batch holds global sample `sample`, given that step index `step`
        starts at sample `first` (a resumed loader's position)."""
        while True:
            following = next((start for start in self.steps if start > step), None)
            size = self.size_at(step)
            if following is None or sample < first + (following - step) * size:
                return step + (sample - first) // size
            first, step = first + (following - step) * size, following


def after_ramp(training: DelayTraining) -> DelayTraining:
    """`training` with global_batch_size the ramp's last size (the run's batch), if it has a ramp."""
    return replace(training, global_batch_size=training.batch_ramp_sizes[-1]) if training.batch_ramp_sizes else training


def check_batch_ramp(training: DelayTraining, parallelism: PipelineParallelism, data_parallel: int) -> str | None:
    """Why the batch ramp cannot run with these settings, naming the keys; None if it can. Each size
    accumulates whole local batches; PACI's local steps count microbatches across the run (not yet);
    PipeDream2BW's delay ceil((stages - 1) / microbatches) may not change along the ramp (its
    weight versions)."""
    steps, sizes = training.batch_ramp_steps, training.batch_ramp_sizes
    if not steps and not sizes:
        return None
    if len(steps) != len(sizes):
        return f"training.batch_ramp_sizes has {len(sizes)} entries, training.batch_ramp_steps has {len(steps)}: give one size per step"
    if steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
        return f"training.batch_ramp_steps = {steps}: expected steps strictly increasing from 0, one per size"
    local = training.local_batch_size * data_parallel
    for j, size in enumerate(sizes):
        if size % local:
            return (f"training.batch_ramp_sizes[{j}] = {size} must be a multiple of training.local_batch_size x "
                    f"data-parallel degree ({training.local_batch_size} x {data_parallel})")
    if training.global_batch_size > 0 and training.global_batch_size != sizes[-1]:
        return (f"training.global_batch_size = {training.global_batch_size}: with a batch ramp the run's batch is the "
                f"ramp's last, training.batch_ramp_sizes[-1] = {sizes[-1]}; leave global_batch_size unset or equal to it")
    schedule = streaming_schedule(parallelism.pipeline_parallel_schedule)
    if schedule is SchedulePACI:
        return ("training.batch_ramp_steps: a batch-size ramp does not run with PACI yet (its local steps count "
                "microbatches across the run); use PipeDream2BW or a synchronous schedule")
    if schedule is SchedulePipeDream2BW and not training.gradient_delay:
        stages = parallelism.emulated_stages or parallelism.pipeline_parallel_degree
        counts = [size // local * microbatches(training, parallelism) for size in sizes]
        delays = [gradient_delay(stages, m) for m in counts]
        if len(set(delays)) > 1:
            return (f"training.batch_ramp_sizes = {sizes} give {counts} microbatches per step on {stages} stages, so "
                    f"PipeDream2BW's delay ceil((stages - 1) / microbatches) would change ({delays}); a ramp keeps it: "
                    f"give every step at least {stages - 1} microbatches")
    return None
