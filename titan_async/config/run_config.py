"""A run's configuration: the TOML sections, checked, and their TOML rendering."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from torchtitan.components.checkpointer import CheckpointManager
from torchtitan.config.configs import CommConfig, CompileConfig, DebugConfig

from titan_async.config.fields import closest, coerce, describe, settable_fields, subsections, type_name
from titan_async.config.ranges import out_of_range
from titan_async.core import platform
from titan_async.core.errors import UserError
from titan_async.data.batch_ramp import after_ramp, check_batch_ramp
from titan_async.data.section import DataSection
from titan_async.model.llama import ModelSection
from titan_async.optim.lr_schedule import RunLRSchedulers
from titan_async.optim.section import OptimizerSection
from titan_async.parallel.expert import expert_parallel_problem
from titan_async.pipeline.config import (
    DelayTraining, PipelineParallelism, check_activation_checkpoint, check_delay, check_delay_rescheduling, check_pipeline, microbatches,
)
from titan_async.pipeline.schedules import streaming_schedule
from titan_async.train.benchmarks import EvalSection
from titan_async.train.health import HealthSection
from titan_async.train.progress import RunMetrics, RunValidator


@dataclass(kw_only=True, slots=True)
class ActivationCheckpointSection:
    """Recomputation of activations in the backward pass."""

    mode: Literal["none", "selective", "full"] = "selective"
    """none: keep all activations; selective: torchtitan's per-op policy (refused with PACI); full: recompute each block."""


def _default_sections() -> dict[str, Any]:
    """Section name -> default section object, before the user's values."""
    return {
        "model": ModelSection(),
        "data": DataSection(),
        "training": DelayTraining(disable_cuda_graphs=platform.is_cpu()),
        "parallelism": PipelineParallelism(),
        "optimizer": OptimizerSection(),
        "lr_scheduler": RunLRSchedulers.Config(),
        "checkpoint": CheckpointManager.Config(enable=True, last_save_model_only=False, initial_load_model_only=False),
        "metrics": RunMetrics.Config(log_freq=1, enable_tensorboard=True),
        "validation": RunValidator.Config(enable=True, freq=100, steps=20),
        "eval": EvalSection(),
        "activation_checkpoint": ActivationCheckpointSection(),
        "compile": CompileConfig(),
        "debug": DebugConfig(seed=0),
        "comm": CommConfig(),
        "health": HealthSection(),
    }


SECTION_NAMES = tuple(_default_sections())


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Every section of a run, after the user's TOML and --set overrides."""

    model: ModelSection
    data: DataSection
    training: DelayTraining
    parallelism: PipelineParallelism
    optimizer: OptimizerSection
    lr_scheduler: RunLRSchedulers.Config
    checkpoint: CheckpointManager.Config
    metrics: RunMetrics.Config
    validation: RunValidator.Config
    eval: EvalSection
    activation_checkpoint: ActivationCheckpointSection
    compile: CompileConfig
    debug: DebugConfig
    comm: CommConfig
    health: HealthSection
    source: str = field(default="<defaults>")

    def sections(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in SECTION_NAMES}

    def microbatches(self) -> int:
        """Pipeline microbatches per local batch (1 without pipeline parallelism or its emulation)."""
        return microbatches(self.training, self.parallelism)

    def data_parallel_degree(self, world_size: int) -> int:
        """Data-parallel ranks (shard x replicate) when `world_size` processes run the job."""
        p = self.parallelism
        shard = p.data_parallel_shard_degree
        if shard == -1:
            shard = world_size // (
                p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree * p.data_parallel_replicate_degree
            )
        return shard * p.data_parallel_replicate_degree

    def degree_mismatch(self, world_size: int) -> tuple[str, int] | None:
        """("parallelism.X (a) x ...", product) when the parallel degrees cannot fill
        `world_size` processes, else None."""
        p = self.parallelism
        degrees = {
            "pipeline_parallel_degree": p.pipeline_parallel_degree,
            "tensor_parallel_degree": p.tensor_parallel_degree,
            "context_parallel_degree": p.context_parallel_degree,
            "data_parallel_replicate_degree": p.data_parallel_replicate_degree,
        }
        if p.data_parallel_shard_degree != -1:
            degrees["data_parallel_shard_degree"] = p.data_parallel_shard_degree
        product = 1
        for value in degrees.values():
            product *= value
        if product == world_size or (p.data_parallel_shard_degree == -1 and world_size % product == 0):
            return None
        named = " x ".join(f"parallelism.{k} ({v})" for k, v in degrees.items() if v != 1) or "the parallel degrees (1)"
        return named, product

    def implied_world_size(self) -> int:
        """The processes the parallel degrees name (a data_parallel_shard_degree of -1 counts as 1)."""
        p = self.parallelism
        return (p.pipeline_parallel_degree * p.tensor_parallel_degree * p.context_parallel_degree
                * p.data_parallel_replicate_degree * max(p.data_parallel_shard_degree, 1))

    def check(self, world_size: int) -> None:
        """Raise UserError for settings that cannot work together on `world_size` processes."""
        p, t = self.parallelism, self.training
        mismatch = self.degree_mismatch(world_size)
        if mismatch:
            named, product = mismatch
            raise UserError(
                f"{self.source}: {named} = {product}, but {world_size} process(es) run this job "
                "(set --nproc-per-node, or change the degrees so their product is the number of processes)"
            )
        if p.pipeline_parallel_degree > 1 or p.emulated_stages:
            if t.local_batch_size % p.pipeline_parallel_microbatch_size:
                raise UserError(
                    f"{self.source}: training.local_batch_size ({t.local_batch_size}) is not divisible into "
                    f"microbatches of parallelism.pipeline_parallel_microbatch_size ({p.pipeline_parallel_microbatch_size})"
                )
        if p.pipeline_parallel_degree > 1 and p.pipeline_parallel_schedule.lower() == "zbvzerobubble" and self.validation.enable:
            raise UserError(
                f"{self.source}: parallelism.pipeline_parallel_schedule = 'ZBVZeroBubble' cannot validate (torch's "
                "ZBV schedule fails in eval: its V-shaped stage hand-off needs a backward); set validation.enable = false"
            )
        self._check_tensor_parallel()
        dp = self.data_parallel_degree(world_size)
        self._check_mixture_of_experts(world_size)
        problem = check_pipeline(t, p) or check_batch_ramp(t, p, dp)
        problem = problem or check_delay(after_ramp(t), p, dp, self.microbatches(), self.model.family == "qwen3_moe")
        problem = problem or check_delay_rescheduling(self.lr_scheduler.delay_rescheduling_steps, t, p)
        problem = problem or check_activation_checkpoint(p, self.activation_checkpoint.mode)
        problem = problem or self.eval.check(self.checkpoint, self.model)
        if problem:
            raise UserError(f"{self.source}: {problem}")
        if streaming_schedule(p.pipeline_parallel_schedule) and self.checkpoint.async_mode != "disabled":
            raise UserError(
                f"{self.source}: checkpoint.async_mode = {self.checkpoint.async_mode!r} cannot run with "
                f"{p.pipeline_parallel_schedule}: its stages write weights and optimizer state inside the step, "
                "while the background copy of a save may still read them; set checkpoint.async_mode = \"disabled\""
            )
        total = self.lr_scheduler.total_steps
        if total is not None and total < t.steps:
            raise UserError(
                f"{self.source}: lr_scheduler.total_steps ({total}) < training.steps ({t.steps}): past the end of its "
                "schedule the decay turns the lr negative (linear, sqrt) or back up (cosine); set it to at least "
                "training.steps, or leave it unset (training.steps)"
            )
        if t.global_batch_size > 0 and t.global_batch_size % (t.local_batch_size * dp):
            raise UserError(
                f"{self.source}: training.global_batch_size ({t.global_batch_size}) must be a multiple of "
                f"training.local_batch_size x data-parallel degree ({t.local_batch_size} x {dp})"
            )

    def _check_tensor_parallel(self) -> None:
        """UserError for a tensor-parallel degree that cannot split the attention heads or,
        under sequence parallel, the sequence."""
        p = self.parallelism
        tp = p.tensor_parallel_degree
        if tp == 1:
            return
        try:
            sizes = self.model.resolved(0)
        except ValueError as err:
            raise UserError(f"{self.source}: {err}") from None
        for key in ("n_heads", "n_kv_heads"):
            if sizes[key] % tp:
                raise UserError(
                    f"{self.source}: parallelism.tensor_parallel_degree ({tp}) must divide model.{key} ({sizes[key]}): "
                    "each tensor-parallel rank holds whole heads"
                )
        if p.enable_sequence_parallel and self.training.seq_len % tp:
            raise UserError(
                f"{self.source}: training.seq_len ({self.training.seq_len}) must be divisible by "
                f"parallelism.tensor_parallel_degree ({tp}) under parallelism.enable_sequence_parallel = true "
                "(each rank holds seq_len / tp positions)"
            )
        if p.emulated_stages:
            raise UserError(
                f"{self.source}: parallelism.emulated_stages runs every stage in one process; "
                f"set parallelism.tensor_parallel_degree = 1 (got {tp})"
            )

    def _check_mixture_of_experts(self, world_size: int) -> None:
        """UserError for an expert-parallel degree that cannot lay out the experts, and for the
        MoE layouts the weight-version schedules do not run yet."""
        p = self.parallelism
        if p.expert_parallel_degree != 1:
            try:
                experts = self.model.resolved(0)["num_experts"] if self.model.family == "qwen3_moe" else None
            except ValueError as err:
                raise UserError(f"{self.source}: {err}") from None
            shard = self.data_parallel_degree(world_size) // p.data_parallel_replicate_degree
            problem = expert_parallel_problem(p, self.model.family, experts, shard)
            if problem:
                raise UserError(f"{self.source}: {problem}")
        if streaming_schedule(p.pipeline_parallel_schedule):
            versions = p.pipeline_parallel_schedule
        elif self.training.gradient_delay:
            versions = f"training.gradient_delay = {self.training.gradient_delay}"
        else:
            return
        if self.model.family != "qwen3_moe":
            return
        if p.tensor_parallel_degree > 1:
            raise UserError(
                f"{self.source}: model.family = \"qwen3_moe\" with {versions} runs without tensor "
                f"parallelism so far; parallelism.tensor_parallel_degree is {p.tensor_parallel_degree}, set it to 1"
            )


def read_toml(path: Path) -> dict[str, Any]:
    """The parsed TOML file; UserError if missing or malformed (with line and column)."""
    if not path.is_file():
        raise UserError(f"{path}: config file not found")
    try:
        return tomllib.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as err:
        line = path.read_bytes()[:err.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line}: byte 0x{err.object[err.start]:02x} is not UTF-8; TOML files are UTF-8 text "
                        "(save it as UTF-8)") from None
    except OSError as err:
        raise UserError(f"{path}: cannot read the config file ({err.strerror})") from None
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{path}: TOML syntax error: {err}") from None


def set_value(assignment: str) -> Any:
    """The value of `--set key=value`, in TOML syntax; bare words are strings."""
    raw = assignment.partition("=")[2].strip()
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def apply_set(document: dict[str, Any], assignment: str) -> None:
    """Apply one `--set section[.subsection].key=value` (value in TOML syntax; bare words are strings)."""
    key, sep, _ = assignment.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) < 2 or not all(parts):
        raise UserError(f"--set {assignment!r}: expected section.key=value, e.g. training.steps=50")
    value = set_value(assignment)
    table = document
    for part in parts[:-1]:
        table = table.setdefault(part, {})
    table[parts[-1]] = value


def _origin(key: str, source: str, assignments: dict[str, str]) -> str:
    """Where the value of dotted `key` came from: its `--set`, else the config file."""
    return f"--set {assignments[key]!r}" if key in assignments else source


def _section(name: str, default: Any, values: Any, source: str, assignments: dict[str, str] | None = None) -> Any:
    assignments = assignments or {}
    where = f"{source}: [{name}]"
    if not isinstance(values, dict):
        raise UserError(f"{source}: {name} must be a table [{name}], got a {type_name(values)}")
    allowed = settable_fields(type(default))
    nested = subsections(default)
    updates = {}
    for key, value in values.items():
        origin = _origin(f"{name}.{key}", source, assignments)
        if key in nested:
            updates[key] = _section(f"{name}.{key}", nested[key], value, source, assignments)
            continue
        if key not in allowed:
            raise UserError(f"{origin}: [{name}]: unknown key {key!r}{closest(key, [*allowed, *nested])}")
        ok, converted = coerce(value, allowed[key])
        if not ok:
            raise UserError(
                f"{origin}: {name}.{key}: expected {describe(allowed[key])}, got {type_name(value)} {json.dumps(value)}"
            )
        problem = out_of_range(f"{name}.{key}", converted)
        if problem:
            raise UserError(f"{origin}: {name}.{key}: {problem}")
        updates[key] = converted
    try:
        return dataclasses.replace(default, **updates)
    except (ValueError, AssertionError) as err:
        raise UserError(f"{where}: {err}") from None


def _hf_initial_load(checkpoint: Any) -> None:
    """Starting from Hugging Face weights loads only the model (torchtitan requires saying so), from
    an absolute path (torchtitan's rule; a relative one is taken from the working directory)."""
    if not isinstance(checkpoint, dict) or not checkpoint.get("initial_load_in_hf"):
        return
    checkpoint.setdefault("initial_load_model_only", True)
    if isinstance(checkpoint.get("initial_load_path"), str):
        checkpoint["initial_load_path"] = str(Path(checkpoint["initial_load_path"]).expanduser().resolve())


def build_run_config(document: dict[str, Any], source: str, assignments: dict[str, str] | None = None) -> RunConfig:
    """Check `document` against the sections and return the resolved RunConfig. `assignments`
    maps the dotted keys that `--set` gave to their assignment, which errors then name."""
    assignments = assignments or {}
    defaults = _default_sections()
    for name in document:
        if name not in defaults:
            origin = next((f"--set {a!r}" for key, a in assignments.items() if key.split(".")[0] == name), source)
            raise UserError(f"{origin}: unknown section [{name}]{closest(name, defaults)}")
    if document.get("parallelism", {}).get("pipeline_parallel_degree", 1) != 1:
        # CUDA graphs cannot capture a pipeline schedule.
        defaults["training"] = dataclasses.replace(defaults["training"], disable_cuda_graphs=True)
    _hf_initial_load(document.get("checkpoint"))
    sections = {name: _section(name, default, document.get(name, {}), source, assignments) for name, default in defaults.items()}
    run = RunConfig(source=source, **sections)
    return run


def parse_run_config(text: str, source: str) -> RunConfig:
    """Check the TOML `text` (named `source` in errors)."""
    try:
        return build_run_config(tomllib.loads(text), source)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: TOML syntax error: {err}") from None


def load_run_config(path: Path, assignments: list[str] = ()) -> RunConfig:
    """Read a TOML config, apply `--set` assignments, and check it."""
    document = read_toml(path)
    for assignment in assignments:
        apply_set(document, assignment)
    return build_run_config(document, str(path), {a.partition("=")[0].strip(): a for a in assignments})


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    return "[" + ", ".join(_toml_value(v) for v in value) + "]"


def render_toml(config: RunConfig) -> str:
    """Every settable key of every section as TOML; unset optional keys are commented out."""
    lines = [f"# resolved from {config.source}"]

    def table(name: str, section: Any) -> None:
        lines.append(f"\n[{name}]")
        for key in settable_fields(type(section)):
            value = getattr(section, key)
            lines.append(f"# {key} = (unset)" if value is None else f"{key} = {_toml_value(value)}")
        for key, nested in subsections(section).items():
            table(f"{name}.{key}", nested)

    for name, section in config.sections().items():
        table(name, section)
    return "\n".join(lines) + "\n"
