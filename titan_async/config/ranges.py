"""The declared range of every numeric config key: a value outside it is refused in one line by
`config show`, `train` and `resume --set` alike, before anything is built.

A range is an interval (either end open, closed or absent) plus special values that mean
something else (-1: the preset's value, derived, or unlimited). Unset optional keys (None) are
left alone; a list of numbers is checked item by item. `tests/test_config_ranges.py` holds every
numeric key of the config to having an entry here."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Range:
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    special: tuple[tuple[int, str], ...] = ()
    """(value, what it means) pairs admitted outside the interval."""

    def admits(self, value: float) -> bool:
        if any(value == special for special, _ in self.special):
            return True
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def describe(self, integer: bool) -> str:
        """What the range admits, e.g. 'a number in [0, 1)', 'a positive integer, or -1 (derived)'."""
        kind = "an integer" if integer else "a number"
        if integer and self.low == 1 and self.high is None:
            text = "a positive integer"
        elif integer and self.low is not None and self.high is not None and self.high - self.low == 1:
            text = f"{self.low:g} or {self.high:g}"
        elif self.low is not None and self.high is not None:
            text = f"{kind} in {'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        elif self.low is not None:
            text = f"{kind} {'>' if self.low_open else '>='} {self.low:g}"
        else:
            text = f"{kind} {'<' if self.high_open else '<='} {self.high:g}"
        return text + "".join(f", or {value} ({meaning})" for value, meaning in self.special)


def at_least(low: float, *special: tuple[int, str]) -> Range:
    return Range(low=low, special=special)


def above(low: float) -> Range:
    return Range(low=low, low_open=True)


def fraction(high_open: bool = False) -> Range:
    """[0, 1], or [0, 1) with `high_open`."""
    return Range(low=0, high=1, high_open=high_open)


PRESET = (-1, "the preset's")
"""Model sizes left at -1 take the preset's value."""

COUNT = at_least(1)

RANGES: dict[str, Range] = {
    "model.dim": at_least(1, PRESET),
    "model.n_layers": at_least(1, PRESET),
    "model.n_heads": at_least(1, PRESET),
    "model.n_kv_heads": at_least(0, PRESET),  # 0: n_heads
    "model.multiple_of": at_least(1, PRESET),
    "model.ffn_dim_multiplier": at_least(0, PRESET),  # 0: none
    "model.vocab_size": at_least(0, PRESET),  # 0: the tokenizer's
    "model.rope_theta": above(0),
    "model.num_experts": at_least(1, PRESET),
    "model.top_k": at_least(1, PRESET),
    "model.moe_hidden_dim": at_least(1, PRESET),
    "model.load_balance_coeff": at_least(0),
    "data.vocab_size": at_least(258),  # the built-in tokenizer's 256 bytes and 2 special tokens
    "training.local_batch_size": COUNT,
    "training.global_batch_size": at_least(1, (-1, "local_batch_size x data-parallel degree")),
    "training.seq_len": COUNT,
    "training.max_norm": above(0),
    "training.steps": COUNT,
    "training.gc_freq": COUNT,
    "training.gradient_delay": Range(low=0, high=16),
    "training.sync_start_steps": at_least(0),
    "training.weight_prediction": at_least(0),
    "training.batch_ramp_steps": at_least(0),
    "training.batch_ramp_sizes": COUNT,
    "parallelism.data_parallel_replicate_degree": COUNT,
    "parallelism.data_parallel_shard_degree": at_least(1, (-1, "the processes left over")),
    "parallelism.tensor_parallel_degree": COUNT,
    "parallelism.pipeline_parallel_degree": COUNT,
    "parallelism.pipeline_parallel_first_stage_less_layers": at_least(0),
    "parallelism.pipeline_parallel_last_stage_less_layers": at_least(0),
    "parallelism.pipeline_parallel_layers_per_stage": COUNT,
    "parallelism.pipeline_parallel_microbatch_size": COUNT,
    "parallelism.context_parallel_degree": COUNT,
    "parallelism.expert_parallel_degree": COUNT,
    "parallelism.emulated_stages": at_least(2, (0, "off")),
    "parallelism.paci.accumulation": COUNT,
    "optimizer.lr": above(0),
    "optimizer.beta1": fraction(high_open=True),
    "optimizer.beta2": fraction(high_open=True),
    "optimizer.eps": at_least(0),
    "optimizer.weight_decay": at_least(0),
    "optimizer.muon.momentum": fraction(high_open=True),
    "optimizer.muon.ns_steps": COUNT,
    "optimizer.muon.adamw_lr": above(0),
    "optimizer.error_feedback.coefficient": Range(low=0, high=2),
    "lr_scheduler.warmup_steps": at_least(0),
    "lr_scheduler.total_steps": COUNT,
    "lr_scheduler.decay_ratio": fraction(),
    "lr_scheduler.min_lr_factor": fraction(),
    "lr_scheduler.delay_rescheduling_steps": at_least(0),
    "checkpoint.interval": COUNT,
    "checkpoint.keep_latest_k": at_least(0),  # 0: keep every checkpoint
    "checkpoint.load_step": at_least(0, (-1, "the latest intact one")),
    "metrics.log_freq": COUNT,
    "validation.freq": COUNT,
    "validation.steps": at_least(1, (-1, "the whole validation set")),
    "eval.freq": COUNT,
    "eval.limit": COUNT,
    "eval.num_fewshot": at_least(0),
    "eval.batch_size": COUNT,
    "eval.max_pending": COUNT,
    "debug.seed": at_least(0),
    "comm.init_timeout_seconds": COUNT,
    "comm.train_timeout_seconds": COUNT,
    "comm.trace_buf_size": at_least(0),
    "health.max_nonfinite_steps": at_least(0),
    "health.inject_nonfinite_steps": COUNT,
    "health.inject_stage": at_least(0),
    "health.inject_rank": at_least(0, (-1, "every rank of the stage")),
    "data.weights": at_least(0),
    "data.stage_steps": at_least(0),
    "data.stage_weights": at_least(0),
}


def out_of_range(key: str, value: object) -> str | None:
    """'expected ..., got V' when `value` of dotted `key` (a number, a list of numbers or of such
    lists, or None) lies outside the key's declared range; None when it is inside or `key` has none."""
    declared = RANGES.get(key)
    if declared is None or value is None:
        return None
    for item in _numbers(value):
        if not declared.admits(item):
            return f"expected {declared.describe(isinstance(item, int))}, got {item!r}"
    return None


def _numbers(value: object) -> list:
    """The numbers of `value`: itself, or every number of its (nested) lists."""
    return [n for item in value for n in _numbers(item)] if isinstance(value, list) else [value]
