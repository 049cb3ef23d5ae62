"""Every numeric key has a declared range (`titan_async.config.ranges`), and a value outside it is
refused in one line by `config show` and `train` alike, before anything is built."""

from __future__ import annotations

import types
import typing

import pytest

from conftest import CONFIGS, cli_in_process, sets

from titan_async.config.fields import describe, settable_fields, subsections
from titan_async.config.ranges import RANGES
from titan_async.config.run_config import build_run_config
from titan_async.core.errors import UserError


def fail(capsys, *args: str) -> str:
    status, _, err = cli_in_process(capsys, *args)
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    return err.strip()


def numeric(hint) -> bool:
    """Whether `hint` holds numbers: int or float, optional, a union of them, or a list of them."""
    if hint in (int, float):
        return True
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return all(numeric(a) for a in args if a is not type(None))
    return origin is list and bool(args) and numeric(args[0])


def numeric_keys() -> set[str]:
    """Dotted names of every settable numeric key (int, float, their optional and list forms)."""
    found = set()

    def walk(name, section) -> None:
        found.update(f"{name}.{key}" for key, hint in settable_fields(type(section)).items() if numeric(hint))
        for key, nested in subsections(section).items():
            walk(f"{name}.{key}", nested)

    for name, section in build_run_config({}, "defaults").sections().items():
        walk(name, section)
    return found


def test_every_numeric_key_has_a_declared_range():
    keys = numeric_keys()
    assert keys - RANGES.keys() == set(), "numeric keys without a range"
    assert RANGES.keys() - keys == set(), "ranges of keys that do not exist"


def _just_outside(key: str) -> list[float]:
    """Values a hand's width outside each end of the key's declared range that no special value admits."""
    declared = RANGES[key]
    specials = {value for value, _ in declared.special}
    outside = []
    if declared.low is not None:
        outside.append(declared.low if declared.low_open else declared.low - 1)
    if declared.high is not None:
        outside.append(declared.high if declared.high_open else declared.high + 1)
    outside = [value for value in outside if value not in specials]
    if -1 in specials and declared.low is not None and declared.low > 0:
        outside.append(-2)
    return outside


def _document(key: str, value: float, hint) -> dict:
    """The TOML document that sets `key` to `value`, wrapped in as many lists as its type `hint` nests."""
    *sections, name = key.split(".")
    document = table = {}
    for section in sections:
        table = table.setdefault(section, {})
    while typing.get_origin(hint) is list:
        value, hint = [value], typing.get_args(hint)[0]
    table[name] = value
    return document


@pytest.mark.parametrize("key", sorted(RANGES))
def test_each_key_refuses_the_values_just_outside_its_range(key):
    *path, name = key.split(".")
    section = build_run_config({}, "defaults")
    for part in path:
        section = getattr(section, part)
    hint = settable_fields(type(section))[name]
    integer = "integer" in describe(hint)
    for value in _just_outside(key):
        value = int(value) if integer else float(value)
        with pytest.raises(UserError) as error:
            build_run_config(_document(key, value, hint), "t.toml")
        assert f"t.toml: {key}: expected " in str(error.value) and f"got {value!r}" in str(error.value), str(error.value)


@pytest.mark.parametrize("assignment, message", [
    # Gradient ascent, all-zero gradients, a negative decay: each trained before without a word.
    ("training.max_norm=-1", "training.max_norm: expected a number > 0, got -1.0"),
    ("training.max_norm=0", "training.max_norm: expected a number > 0, got 0.0"),
    ("optimizer.weight_decay=-0.1", "optimizer.weight_decay: expected a number >= 0, got -0.1"),
    ("optimizer.eps=-1e-8", "optimizer.eps: expected a number >= 0, got -1e-08"),
    ("lr_scheduler.min_lr_factor=1.5", "lr_scheduler.min_lr_factor: expected a number in [0, 1], got 1.5"),
    ("model.dim=-2", "model.dim: expected a positive integer, or -1 (the preset's), got -2"),
    ("parallelism.emulated_stages=1", "parallelism.emulated_stages: expected an integer >= 2, or 0 (off), got 1"),
])
def test_config_show_and_train_refuse_a_value_out_of_range(capsys, tmp_path, assignment, message):
    for command in (["config", "show"], ["train", "--run-dir", str(tmp_path / "run")]):
        err = fail(capsys, *command, *sets(assignment))
        assert err == f"titan-async: --set {assignment!r}: {message}", err
    assert not (tmp_path / "run").exists()


def test_config_show_makes_the_cross_key_checks_of_train(capsys):
    pp2 = ("--config", str(CONFIGS / "debug_cpu_pp2.toml"))
    err = fail(capsys, "config", "show", *pp2, *sets("parallelism.pipeline_parallel_microbatch_size=3"))
    assert "training.local_batch_size (8) is not divisible into microbatches" in err
    err = fail(capsys, "config", "show", *pp2, "--nproc-per-node", "3")
    assert "parallelism.pipeline_parallel_degree (2) = 2, but 3 process(es) run this job" in err
    status, out, _ = cli_in_process(capsys, "config", "show", *pp2)
    assert status == 0 and "pipeline_parallel_degree = 2" in out


def test_sync_start_over_every_step_is_said(capsys):
    """A run that Sync Start keeps synchronous throughout (before: without a word); valid, as a
    run trained in parts streams once resumed with more steps."""
    status, _, err = cli_in_process(capsys, "config", "show", "--config", str(CONFIGS / "debug_cpu_pp2_2bw.toml"),
                                    *sets("training.steps=5", "training.sync_start_steps=5"))
    assert status == 0 and err.strip() == ("titan-async: warning: training.sync_start_steps = 5 covers every step of "
                                           "training.steps = 5: this run is synchronous throughout, and streams only if "
                                           "resumed with more steps"), err


def test_a_config_that_is_not_utf8_is_refused_naming_its_line(capsys, tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes("[training]\nsteps = 5\n# r\u00e9sum\u00e9 of the run\n".encode("latin-1"))
    err = fail(capsys, "config", "show", "--config", str(path))
    assert err == f"titan-async: {path}: line 3: byte 0xe9 is not UTF-8; TOML files are UTF-8 text (save it as UTF-8)"


def test_a_schedule_shorter_than_the_run_is_refused(capsys):
    """Past lr_scheduler.total_steps torchtitan's linear decay makes the lr negative: gradient ascent."""
    err = fail(capsys, "config", "show", *sets("training.steps=10", "lr_scheduler.total_steps=8"))
    assert "lr_scheduler.total_steps (8) < training.steps (10): past the end of its schedule the decay turns the lr negative" in err
