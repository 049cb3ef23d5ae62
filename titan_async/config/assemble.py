"""Turn a RunConfig into torchtitan's Trainer config for one run directory."""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from pathlib import Path

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.tokenizer import HuggingFaceTokenizer
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

from titan_async.config.run_config import RunConfig, set_value
from titan_async.core import platform
from titan_async.core.errors import UserError
from titan_async.data.batch_ramp import BatchRamp, after_ramp
from titan_async.data.sources import prepare
from titan_async.data.token_loader import TokenDataLoader
from titan_async.model.hf_weights import check_hf_weights
from titan_async.model.llama import build_model_spec
from titan_async.optim.section import ON_RESUME
from titan_async.parallel.expert import with_expert_parallel_backend
from titan_async.pipeline.config import pipeline_delay
from titan_async.pipeline.schedules import register as register_schedules, streaming_schedule
from titan_async.pipeline.split import split_stages
from titan_async.train.source_validation import SourceValidator
from titan_async.train.trainer import AsyncTrainer

ACTIVATION_CHECKPOINTS = {"none": None, "selective": SelectiveAC.Config, "full": FullAC.Config}

RESUME_REFUSES = {
    **{key: reason for key, reason in ON_RESUME.items() if reason},
    "training.gradient_delay": "the checkpoints hold as many weight versions as its delay, or none",
    "training.clipping": "the checkpoints hold the global norms lagged clipping needs, or none",
    "training.sync_start_steps": "the checkpoints' weight versions and update counts follow the step of the switch",
    "training.weight_prediction": "the checkpoints hold the predicted versions made with that horizon, or none",
}
"""The keys whose change resume refuses, and why: those that decide which states a checkpoint holds."""


def tokenizer_vocab_size(tokenizer_dir: Path) -> int:
    return HuggingFaceTokenizer.Config().build(tokenizer_path=str(tokenizer_dir)).get_vocab_size()


def resolve_vocab_size(run: RunConfig) -> int:
    """model.vocab_size, or for 0 the tokenizer's: data.tokenizer's tokenizer.json, else the
    built-in stdlib BPE's data.vocab_size (nothing is downloaded or built)."""
    try:
        vocab = int(run.model.resolved(0)["vocab_size"])
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
    if vocab:
        return vocab
    if not run.data.tokenizer:
        return run.data.vocab_size
    directory = Path(run.data.tokenizer).expanduser()
    if not (directory / "tokenizer.json").is_file():
        raise UserError(
            f"{run.source}: model.vocab_size = 0 takes the tokenizer's size, but data.tokenizer = "
            f"{run.data.tokenizer!r} has no tokenizer.json; set model.vocab_size"
        )
    return tokenizer_vocab_size(directory)


def _weight_versions(run: RunConfig) -> bool:
    return bool(run.training.gradient_delay or streaming_schedule(run.parallelism.pipeline_parallel_schedule))


def checkpoint_contents(run: RunConfig) -> dict[str, object]:
    """The settings that decide which states a checkpoint holds, by the keys that set them."""
    p = run.parallelism
    delay = pipeline_delay(run.training, p, run.data_parallel_degree(run.implied_world_size()), run.microbatches())
    versions = "no weight versions (a synchronous schedule)"
    if run.training.gradient_delay:
        versions = f"gradient_delay = {delay}"
    elif streaming_schedule(p.pipeline_parallel_schedule):
        versions = f"{p.pipeline_parallel_schedule} on {p.emulated_stages or p.pipeline_parallel_degree} stages"
        if delay > 1:
            versions += f", a delay of {delay} steps ({delay + 1} weight versions)"
    return {
        **{key: attrgetter(key)(run) for key, reason in ON_RESUME.items() if reason},
        "parallelism.pipeline_parallel_schedule/pipeline_parallel_degree/emulated_stages, training.gradient_delay": versions,
        "training.clipping": run.training.clipping,
        "data.source, data.paths": _loader_state(run),
    }


def _loader_state(run: RunConfig) -> str:
    """The kind of data-loader state a checkpoint holds: the token loader's has one position per source."""
    if run.data.source != "tokens":
        return f"the {run.data.source} loader"
    return f"the tokens loader with {len(run.data.paths) or 1} source{'s' if len(run.data.paths) > 1 else ''}"


_SWITCH_ADVICE = "start a new run (train --run-dir NEW), or keep the setting"


def model_shape(run: RunConfig) -> dict[str, object]:
    """The keys that decide the shapes of the weights a checkpoint holds, with their resolved values
    (the tokenizer's settings too when the vocabulary is the tokenizer's)."""
    try:
        sizes = run.model.resolved(0)
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
    shape = {"model.family": run.model.family,
             **{f"model.{key}": value for key, value in sizes.items() if key not in ("top_k", "expert_precision")}}
    if sizes["vocab_size"] == 0:
        shape.update({"data.tokenizer": run.data.tokenizer, "data.vocab_size": run.data.vocab_size})
    return shape


def check_resumable(saved: RunConfig, run: RunConfig) -> None:
    """Raise UserError when `run` would need states that `saved`'s checkpoints do not hold: other
    weight versions or optimizer states, or weights of another shape."""
    before, after = checkpoint_contents(saved), checkpoint_contents(run)
    for key, value in before.items():
        if after[key] != value:
            raise UserError(f"{key}: the checkpoints hold state for {value!r}, resume cannot switch to {after[key]!r}; {_SWITCH_ADVICE}")
    before, after = model_shape(saved), model_shape(run)
    for key, value in before.items():
        if after.get(key) != value:
            raise UserError(f"{key}: the checkpoints hold the weights of a model with {key} = {value!r}, resume cannot "
                            f"switch to {after.get(key)!r}; {_SWITCH_ADVICE}")


def refuse_switches(saved: RunConfig, assignments: list[str]) -> None:
    """UserError naming the first `--set` of resume that changes a key of `RESUME_REFUSES`, and
    why, before the rest of the config is checked (which may otherwise object to what the switch
    leaves behind, e.g. an [optimizer.muon] table under AdamW)."""
    for assignment in assignments:
        key = assignment.partition("=")[0].strip()
        if key in RESUME_REFUSES and set_value(assignment) != (current := attrgetter(key)(saved)):
            raise UserError(f"--set {assignment!r}: resume cannot switch {key} from {current!r}: "
                            f"{RESUME_REFUSES[key]}; {_SWITCH_ADVICE}")


def plain_parameters(run: RunConfig, world_size: int) -> bool:
    """Whether to leave out FSDP, which torchtitan applies even on one rank: weight-version
    policies switch plain parameters for free, and without data parallelism FSDP adds nothing."""
    return _weight_versions(run) and run.data_parallel_degree(world_size) == 1 and run.parallelism.tensor_parallel_degree == 1


def compile_config(run: RunConfig):
    """`[compile]` as it applies on this machine: CPU runs stay eager (the 10B configs compile on
    CUDA, where eager float8 is slower than bfloat16; on CPU float8 is emulated, eager only)."""
    return dataclasses.replace(run.compile, enable=False) if platform.is_cpu() else run.compile


def trainer_config(run: RunConfig, run_dir: Path, world_size: int = 1) -> AsyncTrainer.Config:
    """The AsyncTrainer config that trains `run` on `world_size` processes with its outputs under `run_dir`."""
    register_schedules()
    data = prepare(run.data, need_validation=run.validation.enable)
    compile = compile_config(run)
    try:
        model_spec = build_model_spec(
            run.model,
            tokenizer_vocab_size(data.tokenizer_dir),
            fsdp=not plain_parameters(run, world_size),
            compiled=compile.enable and "model" in compile.components,
        )
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
    try:
        split_stages(run.parallelism, model_spec.model, run.microbatches())
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
    data.check_tokens(model_spec.model.vocab_size, run.training.seq_len)
    if run.checkpoint.initial_load_in_hf:
        check_hf_weights(run.checkpoint.initial_load_path, model_spec, run.source)
    validator = dataclasses.replace(run.validation, dataloader=data.validation_loader)
    if data.validation_sources:
        validator = SourceValidator.Config(**{f.name: getattr(validator, f.name) for f in dataclasses.fields(validator)},
                                           source_names=list(data.validation_sources),
                                           source_loaders=list(data.validation_sources.values()))
    train_loader, dp, training = data.train_loader, run.data_parallel_degree(world_size), after_ramp(run.training)
    if isinstance(train_loader, TokenDataLoader.Config):
        ramp = BatchRamp.of(training, dp)
        train_loader = dataclasses.replace(train_loader, batch_steps=list(ramp.steps), batch_sizes=list(ramp.sizes))
    activation_checkpoint = ACTIVATION_CHECKPOINTS[run.activation_checkpoint.mode]
    try:
        return AsyncTrainer.Config(
            model_spec=model_spec,
            hf_assets_path=str(data.tokenizer_dir),
            dump_folder=str(run_dir),
            loss=CrossEntropyLoss.Config(global_vocab_size=model_spec.model.vocab_size),
            dataloader=train_loader,
            validator=validator,
            optimizer=run.optimizer.container_config(pipeline_delay(training, run.parallelism, dp, run.microbatches())),
            lr_scheduler=run.lr_scheduler,
            training=training,
            parallelism=with_expert_parallel_backend(run.parallelism),
            checkpoint=run.checkpoint,
            metrics=run.metrics,
            activation_checkpoint=activation_checkpoint() if activation_checkpoint else None,
            compile=compile,
            debug=run.debug,
            comm=run.comm,
            health=run.health,
            eval=run.eval,
        )
    except ValueError as err:
        raise UserError(f"{run.source}: {err}") from None
