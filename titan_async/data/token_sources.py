"""The `[data]` keys of a token-file mixture, checked: its sources, their names and weights by stage.

One source is `data.path` (weight 1); several are `data.paths` with `data.weights` (default: equal)
or, for a mixture that changes during the run, `data.stage_steps` and `data.stage_weights`.
Every problem is a UserError of one line naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from titan_async.core.errors import UserError
from titan_async.data.section import DataSection

MIXTURE_KEYS = ("paths", "weights", "names", "stage_steps", "stage_weights", "validation_paths")


@dataclass(frozen=True)
class TokenSources:
    """Each source's key (for messages), path and name; the first step and the weights of each stage;
    the validation data per source (keys and paths; empty when validation is off)."""

    keys: tuple[str, ...]
    paths: tuple[str, ...]
    names: tuple[str, ...]
    stage_steps: tuple[int, ...]
    stage_weights: tuple[tuple[float, ...], ...]
    validation_keys: tuple[str, ...]
    validation_paths: tuple[str, ...]


def token_sources(data: DataSection, need_validation: bool) -> TokenSources:
    """`data`'s sources and schedule, or UserError naming the key at fault."""
    if data.path and data.paths:
        raise UserError("data.path and data.paths: give one source as data.path or several as data.paths, not both")
    if not data.path and not data.paths:
        raise UserError("data.path is required when data.source = 'tokens' (or data.paths for a mixture)")
    if data.path:
        for key in MIXTURE_KEYS:
            if getattr(data, key):
                raise UserError(f"data.{key} applies to a mixture of data.paths; one source is data.path")
        validation = ("data.validation_path",), (data.validation_path,)
        return TokenSources(("data.path",), (data.path,), (_default_name(data.path),), (0,), ((1.0,),),
                            *(validation if need_validation else ((), ())))
    count = len(data.paths)
    keys = tuple(f"data.paths[{i}]" for i in range(count))
    names = tuple(data.names) or tuple(_default_name(p) for p in data.paths)
    _same_length("data.names", data.names, count)
    if len(set(names)) != count:
        raise UserError(f"data.names = {list(names)}: each source needs its own name (set data.names)")
    if data.weights and (data.stage_steps or data.stage_weights):
        raise UserError("data.weights and data.stage_weights: give the weights once, as data.weights for "
                        "the whole run or as data.stage_weights per stage")
    steps, weights = _stages(data, count)
    validation: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())
    if need_validation:
        if data.validation_path:
            raise UserError("data.validation_path: a mixture of data.paths is validated on data.validation_paths, one per source")
        if not data.validation_paths:
            raise UserError("data.validation_paths is required when validation.enable = true and data.paths is set")
        _same_length("data.validation_paths", data.validation_paths, count)
        validation = tuple(f"data.validation_paths[{i}]" for i in range(count)), tuple(data.validation_paths)
    return TokenSources(keys, tuple(data.paths), names, steps, weights, *validation)


def _default_name(path: str) -> str:
    return Path(path).name or path


def _same_length(key: str, values: list, count: int) -> None:
    if values and len(values) != count:
        raise UserError(f"{key} has {len(values)} entries, data.paths has {count}: give one per source")


def _stages(data: DataSection, count: int) -> tuple[tuple[int, ...], tuple[tuple[float, ...], ...]]:
    if not data.stage_steps and not data.stage_weights:
        _same_length("data.weights", data.weights, count)
        weights = tuple(data.weights) or (1.0,) * count
        _check_weights("data.weights", weights)
        return (0,), (weights,)
    steps, stages = data.stage_steps, data.stage_weights
    if not steps or steps[0] != 0 or any(b <= a for a, b in zip(steps, steps[1:])):
        raise UserError(f"data.stage_steps = {steps}: expected steps strictly increasing from 0, one per stage")
    if len(stages) != len(steps):
        raise UserError(f"data.stage_weights has {len(stages)} stages, data.stage_steps has {len(steps)}: give one weight list per stage")
    for k, weights in enumerate(stages):
        if len(weights) != count:
            raise UserError(f"data.stage_weights[{k}] has {len(weights)} weights, data.paths has {count}: give one per source")
        _check_weights(f"data.stage_weights[{k}]", weights)
    return tuple(steps), tuple(map(tuple, stages))


def _check_weights(key: str, weights) -> None:
    if not sum(weights) > 0:
        raise UserError(f"{key} = {list(weights)}: the weights sum to zero; give at least one source a positive weight")
