"""TOML front end: shipped configs, overrides, and the resolved rendering."""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from typing import ClassVar

import pytest

from conftest import CONFIGS
from titan_async.core import platform
from titan_async.config import run_config
from titan_async.config.assemble import compile_config
from titan_async.config.run_config import apply_set, build_run_config, load_run_config, render_toml

SHIPPED = sorted(CONFIGS.glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_shipped_config_is_valid_and_round_trips(path):
    config = load_run_config(path)
    rendered = render_toml(config)
    again = build_run_config(tomllib.loads(rendered), "rendered")
    assert render_toml(again).splitlines()[1:] == rendered.splitlines()[1:]


@pytest.mark.parametrize("path", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_key_in_shipped_configs_is_commented(path):
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if "=" in line and not line.lstrip().startswith("#"):
            assert "#" in line, f"{path.name}:{number} has no comment: {line}"


def test_set_overrides_parse_toml_values_and_bare_strings():
    document = {"training": {"steps": 10}}
    apply_set(document, "training.steps=50")
    apply_set(document, "optimizer.lr=3e-4")
    apply_set(document, "parallelism.pipeline_parallel_schedule=GPipe")
    apply_set(document, "checkpoint.enable=false")
    config = build_run_config(document, "test")
    assert config.training.steps == 50
    assert config.optimizer.lr == 3e-4
    assert config.parallelism.pipeline_parallel_schedule == "GPipe"
    assert config.checkpoint.enable is False


def test_integer_accepted_where_a_float_is_expected():
    config = build_run_config({"optimizer": {"lr": 1}}, "test")
    assert config.optimizer.lr == 1.0 and isinstance(config.optimizer.lr, float)


def test_data_parallel_degree_uses_leftover_ranks():
    config = build_run_config({"parallelism": {"pipeline_parallel_degree": 2}}, "test")
    assert config.data_parallel_degree(8) == 4
    config.check(8)


@dataclass(kw_only=True, slots=True)
class Inner:
    toml_subsection: ClassVar[bool] = True
    coefficient: float = 1.0


@dataclass(kw_only=True, slots=True)
class Outer:
    name: str = "x"
    inner: Inner = field(default_factory=Inner)


def test_nested_subsections_are_set_checked_and_rendered():
    section = run_config._section("outer", Outer(), {"inner": {"coefficient": 0.5}}, "t.toml")
    assert section.inner.coefficient == 0.5
    with pytest.raises(run_config.UserError, match=r"t.toml: \[outer.inner\]: unknown key 'coef' \(did you mean 'coefficient'\?\)"):
        run_config._section("outer", Outer(), {"inner": {"coef": 0.5}}, "t.toml")
    with pytest.raises(run_config.UserError, match="outer.inner.coefficient: expected a finite number"):
        run_config._section("outer", Outer(), {"inner": {"coefficient": "big"}}, "t.toml")


def test_initial_load_in_hf_loads_the_model_only_from_an_absolute_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    document = {"checkpoint": {"initial_load_path": "exports/try1", "initial_load_in_hf": True}}
    checkpoint = build_run_config(document, "test").checkpoint
    assert checkpoint.initial_load_model_only is True
    assert checkpoint.initial_load_path == str(tmp_path / "exports" / "try1")


@pytest.mark.parametrize("path", sorted(p for p in CONFIGS.glob("10b_*.toml") if "_moe_" not in p.stem), ids=lambda p: p.stem)
def test_10b_configs_compile_on_cuda_and_stay_eager_on_cpu(path, monkeypatch):
    """The dense 10B configs (the MoE one stays eager: torchtitan offers no float8 for its experts)."""
    run = load_run_config(path)
    assert run.model.float8 == "rowwise" and run.compile.enable
    assert not compile_config(run).enable  # this machine is a CPU
    monkeypatch.setattr(platform, "is_cpu", lambda: False)
    assert compile_config(run).enable
