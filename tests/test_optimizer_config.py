"""The [optimizer] TOML section: what each choice builds, the group table, and one-line errors."""

from __future__ import annotations

import math

import pytest
import torch

from titan_async.config.run_config import build_run_config
from titan_async.core.errors import UserError
from titan_async.model.llama import ModelSection, build_model_spec
from titan_async.optim import ErrorFeedback, Muon, RoutedOptimizersContainer, param_group_rows, write_param_group_table
from torchtitan.components.optimizer import OptimizersContainer

ISSUE_TOML = {
    "optimizer": {
        "name": "muon",
        "lr": 0.02,
        "muon": {"momentum": 0.95, "nesterov": True, "ns_steps": 5, "lr_scaling": "match_rms_adamw", "adamw_lr": 3e-4},
        "error_feedback": {"enabled": True, "coefficient": 1.0},
    }
}


def optimizer_config(document: dict) -> OptimizersContainer.Config:
    return build_run_config(document, "t.toml").optimizer.container_config()


def small_model() -> torch.nn.Module:
    with torch.device("meta"):
        return build_model_spec(ModelSection(dim=64, n_layers=2, n_heads=4), 128).model.build()


def test_default_is_torchtitans_plain_adamw():
    config = optimizer_config({})
    assert type(config) is OptimizersContainer.Config
    (group,) = config.param_groups
    assert group.pattern == ".*" and group.optimizer_name == "AdamW"
    assert group.optimizer_kwargs == {"lr": 8e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def test_issue_toml_builds_muon_with_error_feedback():
    config = optimizer_config(ISSUE_TOML)
    assert isinstance(config, RoutedOptimizersContainer.Config)
    assert config.muon_kwargs == {
        "lr": 0.02, "momentum": 0.95, "nesterov": True, "weight_decay": 0.1,
        "ns_steps": 5, "ns_dtype": "auto", "lr_scaling": "match_rms_adamw",
    }
    assert config.adamw_kwargs["lr"] == 3e-4
    assert config.error_feedback_coefficient == 1.0
    container = config.build(model_parts=[small_model()])
    assert sorted(type(o.base).__name__ for o in container) == ["AdamW", "Muon"]
    assert all(isinstance(o, ErrorFeedback) for o in container)


def test_adamw_with_error_feedback_wraps_adamw_for_every_parameter():
    config = optimizer_config({"optimizer": {"error_feedback": {"enabled": True, "coefficient": 0.5}}})
    assert isinstance(config, RoutedOptimizersContainer.Config) and config.muon_kwargs is None
    model = small_model()
    (optimizer,) = config.build(model_parts=[model])
    assert isinstance(optimizer, ErrorFeedback) and isinstance(optimizer.base, torch.optim.AdamW)
    assert optimizer.coefficient == 0.5
    assert len(optimizer.param_groups[0]["params"]) == len(list(model.parameters()))


def test_group_table_lists_effective_learning_rates(tmp_path):
    container = optimizer_config(ISSUE_TOML).build(model_parts=[small_model()])
    rows = {row.name: row for row in param_group_rows(container)}
    assert rows["layers.0.attention.wo.weight"].lr == pytest.approx(0.02 * 0.2 * math.sqrt(64))
    assert rows["layers.0.feed_forward.w1.weight"].lr == pytest.approx(0.02 * 0.2 * math.sqrt(256))
    assert rows["layers.0.attention.qkv_linear.wqkv.weight[k]"].shape == (64, 64)
    assert rows["lm_head.weight"].optimizer == "AdamW" and rows["lm_head.weight"].lr == 3e-4
    assert rows["norm.weight"].optimizer == "AdamW"
    assert {row.error_feedback for row in rows.values()} == {1.0}

    path = write_param_group_table(container, tmp_path)
    text = path.read_text()
    assert path.name == "optimizer_groups.txt"
    assert "layers.1.attention.qkv_linear.wqkv.weight[v]" in text and "tok_embeddings.weight" in text
    assert "Muon" in text and "AdamW" in text


def test_muon_rejects_a_non_matrix():
    with pytest.raises(ValueError, match="2-D"):
        Muon([torch.nn.Parameter(torch.zeros(3))], lr=0.1)


@pytest.mark.parametrize(
    "optimizer, message",
    [
        ({"name": "sgd"}, 'optimizer.name: expected one of "adamw", "muon"'),
        ({"muon": {"momentum": 0.9}}, 'optimizer.muon is only used when optimizer.name = "muon"'),
        ({"muon": {"adamw_lr": 1e-3}}, 'optimizer.muon is only used when optimizer.name = "muon"'),
        ({"lr": 0}, "optimizer.lr: expected a number > 0, got 0.0"),
        ({"name": "muon", "lr": -1.0}, "optimizer.lr: expected a number > 0, got -1.0"),
        ({"name": "muon", "muon": {"adamw_lr": -3e-4}}, "optimizer.muon.adamw_lr: expected a number > 0"),
        ({"error_feedback": {"coefficient": 2.5}}, "optimizer.error_feedback.coefficient: expected a number in [0, 2], got 2.5"),
        ({"error_feedback": {"coefficient": -0.1}}, "optimizer.error_feedback.coefficient: expected a number in [0, 2]"),
        ({"name": "muon", "muon": {"lr_scaling": "spectral"}}, 'optimizer.muon.lr_scaling: expected one of "match_rms_adamw", "original"'),
        ({"name": "muon", "muon": {"ns_dtype": "float16"}}, 'optimizer.muon.ns_dtype: expected one of "auto", "float32", "bfloat16"'),
        ({"muon": {"bogus": 1}}, "unknown key 'bogus'"),
    ],
    ids=[
        "unknown-name", "muon-options-for-adamw", "adamw-lr-for-adamw", "zero-lr", "negative-lr",
        "negative-adamw-lr", "ef-above-2", "ef-below-0", "unknown-lr-scaling", "unknown-ns-dtype", "unknown-key",
    ],
)
def test_bad_input_is_one_line_naming_the_key(optimizer, message):
    with pytest.raises(UserError) as error:
        build_run_config({"optimizer": optimizer}, "t.toml")
    text = str(error.value)
    assert message in text, text
    assert "\n" not in text
