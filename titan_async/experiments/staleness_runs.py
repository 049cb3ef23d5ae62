"""The runs of the staleness studies (tools/staleness_study.py, tools/staleness_scaling.py): an arm
(optimizer, delay, error feedback, corrector, seed), the settings every arm of a study shares, the
model and token budget of a regime, the training command of one arm, its loss curves, and the
choice of the best learning rate of a sweep."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from titan_async.experiments.jobs import Job
from titan_async.rundir.record import TRAIN_LOSS, VALIDATION_LOSS

OPTIMIZERS = ("adamw", "muon")
OPTIMIZER_LABELS = {"adamw": "AdamW", "muon": "Muon"}

MOE = ("model.family=qwen3_moe", "model.top_k=2", "model.load_balance_coeff=0.001")
"""--moe: the qwen3 mixture-of-experts blocks (top-2, expert biases moved at each step); the
number of experts, their hidden size and precision are `Settings.experts`, `.moe_hidden_dim` and
`.expert_precision`."""
CORRECTORS = ("", "sync_start", "predict")
"""Delayed-arm correctors beside EF: none; Sync Start (the first SYNC_START_SHARE of the steps
synchronous, `training.sync_start_steps`); weight prediction (`training.weight_prediction = 1`).
The longer delays also train "reschedule": the lr divided by the delay, fading out over the
first RESCHEDULE_SHARE of the steps (`lr_scheduler.delay_rescheduling_steps`)."""
CORRECTOR_NAMES = {"sync_start": "syncstart", "predict": "predict", "reschedule": "resched"}
CORRECTOR_LABELS = {"sync_start": "Sync Start", "predict": "weight prediction", "reschedule": "lr rescheduling"}
SYNC_START_SHARE = 0.1
RESCHEDULE_SHARE = 0.25


@dataclass(frozen=True)
class Arm:
    """One training configuration of the study at one seed."""

    optimizer: str
    delay: int
    ef: bool
    seed: int = 0
    corrector: str = ""

    @property
    def name(self) -> str:
        """Directory-safe name, e.g. `adamw-delay1-ef`, `muon-delay1-predict` or `muon-sync-seed1`
        (seed 0 unmarked)."""
        parts = [self.optimizer, f"delay{self.delay}" if self.delay else "sync"]
        if self.ef:
            parts.append("ef")
        if self.corrector:
            parts.append(CORRECTOR_NAMES[self.corrector])
        if self.seed:
            parts.append(f"seed{self.seed}")
        return "-".join(parts)

    @property
    def label(self) -> str:
        """Human-readable name without the seed, for tables and legends."""
        text = f"{OPTIMIZER_LABELS[self.optimizer]} {'delay 1' if self.delay else 'sync'}"
        text += " + EF" if self.ef else ""
        return text + (f" + {CORRECTOR_LABELS[self.corrector]}" if self.corrector else "")

    def at(self, seed: int = 0, delay: int | None = None, ef: bool | None = None, corrector: str | None = None) -> Arm:
        """The same optimizer with the given seed and, where given, delay, EF and corrector."""
        return Arm(
            self.optimizer, self.delay if delay is None else delay, self.ef if ef is None else ef, seed,
            self.corrector if corrector is None else corrector,
        )

    def overrides(self, steps: int = 0) -> list[str]:
        """The `--set` values that select this arm (`steps`: the run's length, for Sync Start)."""
        values = [
            f"optimizer.name={self.optimizer}",
            f"training.gradient_delay={self.delay}",
            f"optimizer.error_feedback.enabled={str(self.ef).lower()}",
            f"debug.seed={self.seed}",
        ]
        if self.corrector == "sync_start":
            values.append(f"training.sync_start_steps={sync_start_steps(steps)}")
        elif self.corrector == "predict":
            values.append("training.weight_prediction=1")
        elif self.corrector == "reschedule":
            values.append(f"lr_scheduler.delay_rescheduling_steps={max(1, round(RESCHEDULE_SHARE * steps))}")
        return values


def sync_start_steps(steps: int) -> int:
    """Synchronous steps of a Sync Start arm: SYNC_START_SHARE of `steps`, at least 1."""
    return max(1, round(SYNC_START_SHARE * steps))



@dataclass
class Curves:
    """Loss curves of one run: (step, loss) pairs in step order."""

    train: list[tuple[int, float]] = field(default_factory=list)
    validation: list[tuple[int, float]] = field(default_factory=list)

    @property
    def final_validation(self) -> float:
        """Validation loss at the last evaluation (NaN if the run never validated)."""
        return self.validation[-1][1] if self.validation else math.nan


def load_curves(metrics_file: Path) -> Curves:
    """Parse a run's metrics.jsonl (train and validation records; other records ignored). A step
    logged twice (a resumed run replays the steps after its checkpoint) counts once: the later."""
    train, validation = {}, {}
    for line in metrics_file.read_text().splitlines():
        if not line.strip():
            continue
        record = json.loads(line)
        if record.get("kind") == "validation" and VALIDATION_LOSS in record:
            validation[int(record["step"])] = float(record[VALIDATION_LOSS])
        elif record.get("kind") == "train" and TRAIN_LOSS in record:
            train[int(record["step"])] = float(record[TRAIN_LOSS])
    return Curves(sorted(train.items()), sorted(validation.items()))



@dataclass(frozen=True)
class Settings:
    """What every arm shares: model, data, token budget, schedule, validation, learning rates."""

    steps: int
    adamw_lr: float
    muon_lr: float
    muon_adamw_lr: float
    dim: int
    n_layers: int
    n_heads: int
    seq_len: int
    batch: int
    validation_freq: int
    validation_steps: int
    warmup_steps: int
    moe: bool = False
    vocab_size: int = 0
    multiple_of: int = 0
    moe_hidden_dim: int = 128
    experts: int = 8
    expert_precision: str = ""
    """`model.expert_precision` of the MoE runs; empty: the trainer's default (bfloat16)."""

    def overrides(self) -> list[str]:
        """The `--set` values common to all arms (vocab and FFN rounding only where set)."""
        sizes = [f"data.vocab_size={self.vocab_size}"] if self.vocab_size else []
        sizes += [f"model.multiple_of={self.multiple_of}"] if self.multiple_of else []
        moe = [*MOE, f"model.num_experts={self.experts}", f"model.moe_hidden_dim={self.moe_hidden_dim}"] if self.moe else []
        moe += [f"model.expert_precision={self.expert_precision}"] if self.moe and self.expert_precision else []
        return [*moe, *sizes,
            f"training.steps={self.steps}",
            f"training.seq_len={self.seq_len}",
            f"training.local_batch_size={self.batch}",
            f"model.dim={self.dim}",
            f"model.n_layers={self.n_layers}",
            f"model.n_heads={self.n_heads}",
            f"lr_scheduler.warmup_steps={self.warmup_steps}",
            f"validation.freq={self.validation_freq}",
            f"validation.steps={self.validation_steps}",
            "checkpoint.enable=false",
            "metrics.enable_tensorboard=false",
        ]

    def optimizer_overrides(self, optimizer: str) -> list[str]:
        """The `--set` values of `optimizer`'s learning rates (Muon options only for Muon)."""
        if optimizer == "adamw":
            return [f"optimizer.lr={self.adamw_lr}"]
        return [f"optimizer.lr={self.muon_lr}", f"optimizer.muon.adamw_lr={self.muon_adamw_lr}"]


def job(arm: Arm, settings: Settings, run_dir: Path, checkpoint_every: int = 0) -> Job:
    """The training run of one arm; with `checkpoint_every` steps > 0 it saves checkpoints (the
    latest two) and resumes from them when a study restarts after being killed."""
    overrides = settings.overrides() + settings.optimizer_overrides(arm.optimizer) + arm.overrides(settings.steps)
    if checkpoint_every:
        overrides = [o for o in overrides if o != "checkpoint.enable=false"]
        overrides += ["checkpoint.enable=true", f"checkpoint.interval={checkpoint_every}", "checkpoint.keep_latest_k=2"]
    return Job(run_dir.name, run_dir, "debug_cpu", overrides, resumable=checkpoint_every > 0)


def dense_parameters(dim: int, n_layers: int, vocab: int, multiple_of: int) -> int:
    """Total parameters of the llama3 model (untied embedding and head, no GQA): embedding and
    head 2 x vocab x dim, per block the attention (4 dim^2), the SwiGLU (3 dim x hidden, hidden =
    8 dim / 3 rounded up to `multiple_of`) and two norms, plus the final norm."""
    hidden = multiple_of * math.ceil(int(8 * dim / 3) / multiple_of)
    return 2 * vocab * dim + n_layers * (4 * dim * dim + 3 * dim * hidden + 2 * dim) + dim


def moe_parameters(dim: int, n_layers: int, n_heads: int, vocab: int, experts: int, hidden: int) -> int:
    """Total parameters of the qwen3 MoE model (every expert counted): embedding and head
    2 x vocab x dim, per block the attention (4 dim^2 and the q/k norms, a head each), the
    router (experts x dim), the experts (3 dim x hidden each) and two norms, plus the final norm."""
    return 2 * vocab * dim + n_layers * (4 * dim * dim + 2 * dim // n_heads + experts * dim * (1 + 3 * hidden) + 2 * dim) + dim


@dataclass(frozen=True)
class Regime:
    """A model and a token budget of `tokens_per_param` x its total parameter count (embedding and
    head included, as in the 20-tokens-per-parameter rule; at this size they are a quarter of the
    model, so a non-embedding count would undercount what is trained). `tps`: tokens/s of each of
    two runs sharing the 2 cores (see CALIBRATION), for the wall-time estimate; `moe_tps` the
    same for the MoE blocks."""

    dim: int
    n_layers: int
    n_heads: int
    vocab_size: int
    multiple_of: int
    seq_len: int
    batch: int
    tokens_per_param: float
    tps: float
    moe_tps: float = 14_000.0
    warmup_share: float = 0.05
    evaluations: int = 10
    moe: bool = False
    """The MoE blocks (MOE) in place of the dense ones, trained on tokens_per_param x their own
    (larger) total parameter count."""
    moe_experts: int = 4
    moe_hidden_dim: int = 48
    """Each expert's hidden size: the 2 routed experts hold half the dense SwiGLU's hidden size.
    Four experts, in float32 (`model.expert_precision = "full"`): on the CPU, bfloat16 experts
    halve the throughput and eight experts of half the size cost 2.4 times as long per token
    (CALIBRATION), which would put one arm at about half an hour."""

    @property
    def parameters(self) -> int:
        if self.moe:
            return moe_parameters(self.dim, self.n_layers, self.n_heads, self.vocab_size, self.moe_experts, self.moe_hidden_dim)
        return dense_parameters(self.dim, self.n_layers, self.vocab_size, self.multiple_of)

    @property
    def steps(self) -> int:
        """Optimizer steps that reach tokens_per_param x parameters, rounded up to a multiple of
        `evaluations` (so that the last step validates)."""
        raw = self.tokens_per_param * self.parameters / (self.seq_len * self.batch)
        return self.evaluations * math.ceil(raw / self.evaluations)

    @property
    def tokens(self) -> int:
        return self.steps * self.seq_len * self.batch

    def settings(self, adamw_lr: float, muon_lr: float, muon_adamw_lr: float) -> Settings:
        """Study settings: validation `evaluations` times (32 batches), warm-up `warmup_share`."""
        return Settings(
            self.steps, adamw_lr, muon_lr, muon_adamw_lr, self.dim, self.n_layers, self.n_heads, self.seq_len,
            self.batch, self.steps // self.evaluations, 32, max(1, round(self.warmup_share * self.steps)), self.moe,
            self.vocab_size, self.multiple_of, self.moe_hidden_dim, self.moe_experts, "full" if self.moe else "",
        )



def best_lr(losses: dict[float, float]) -> float:
    """The lr of the lowest final validation loss (NaN losses never win)."""
    return min(losses, key=lambda lr: (math.isnan(losses[lr]), losses[lr]))

