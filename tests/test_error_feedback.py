"""Error feedback: the update formula on a delayed quadratic and with Muon (in place), c = 0 is the base
optimizer, exact DCP resume."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn

from titan_async.core import platform

platform.configure()

from titan_async.model.llama import ModelSection, build_model_spec  # noqa: E402
from titan_async.optim import ErrorFeedback, Muon, RoutedOptimizersContainer  # noqa: E402
from titan_async.optim.newton_schulz_batched import orthogonalize_batched  # noqa: E402
from titan_async.optim.section import ErrorFeedbackSection, OptimizerSection  # noqa: E402

CURVATURE = torch.tensor([1.0, 3.0, 10.0], dtype=torch.float64)
START = torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64)
LR = 0.05


def hand_written_delayed_ef(coefficient: float, steps: int) -> list[torch.Tensor]:
    """Iterates of w_{t+1} = w_t - u_t - c (u_t - u_{t-1}), u_t = lr * grad(w_{t-1}) for f = sum(h w^2)/2."""
    iterates = [START.clone()]
    stale = START.clone()
    previous_update = None
    for _ in range(steps):
        update = LR * CURVATURE * stale
        stale = iterates[-1]
        correction = 0 if previous_update is None else coefficient * (update - previous_update)
        iterates.append(iterates[-1] - update - correction)
        previous_update = update
    return iterates


@pytest.mark.parametrize("coefficient", [1.0, 0.5, 2.0])
def test_delayed_quadratic_follows_the_formula(coefficient):
    steps = 20
    weight = nn.Parameter(START.clone())
    optimizer = ErrorFeedback(torch.optim.SGD([weight], lr=LR), coefficient=coefficient)
    stale = START.clone()
    iterates = [START.clone()]
    for _ in range(steps):
        weight.grad = CURVATURE * stale
        stale = weight.detach().clone()
        optimizer.step()
        iterates.append(weight.detach().clone())
    expected = hand_written_delayed_ef(coefficient, steps)
    for got, want in zip(iterates, expected):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    assert optimizer.last_correction_norm is not None and optimizer.last_correction_norm > 0


MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}


def hand_written_muon_with_ef(weights: list[torch.Tensor], gradients: list[list[torch.Tensor]], coefficient: float):
    """w_{t+1} = w_t - u_t - c (u_t - u_{t-1}) with Muon's u_t = lr (s O_t + wd w_t): O_t the
    orthogonalised Nesterov momentum, s = 0.2 sqrt(max(rows, cols)). Returns the weights after each step."""
    lr, mu, wd = MUON["lr"], MUON["momentum"], MUON["weight_decay"]
    weights = [w.clone() for w in weights]
    buffers = [torch.zeros_like(w) for w in weights]
    previous: list[torch.Tensor | None] = [None] * len(weights)
    history = []
    for step_gradients in gradients:
        for i, gradient in enumerate(step_gradients):
            buffers[i] = buffers[i].lerp(gradient, 1 - mu)
            orthogonal = orthogonalize_batched(gradient.lerp(buffers[i], mu)[None], 5, torch.float32)[0]
            update = orthogonal * (lr * 0.2 * max(gradient.shape) ** 0.5) + weights[i] * (lr * wd)
            correction = 0 if previous[i] is None else coefficient * (update - previous[i])
            weights[i] = weights[i] - update - correction
            previous[i] = update
        history.append([w.clone() for w in weights])
    return history


@pytest.mark.parametrize("coefficient", [1.0, 0.5])
def test_muon_in_place_follows_the_formula(coefficient):
    """Muon hands its update over (`updates`), so the wrapper never steps it nor copies the weights."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(16, 8, dtype=torch.float64)), nn.Parameter(torch.randn(8, 12, dtype=torch.float64))]
    start = [p.detach().clone() for p in params]
    gradients = [[torch.randn_like(p) for p in params] for _ in range(4)]
    muon = Muon(params, **MUON, ns_dtype="float32")
    muon.step = lambda closure=None: pytest.fail("error feedback stepped Muon instead of applying its updates")
    optimizer = ErrorFeedback(muon, coefficient=coefficient)
    for step_gradients, expected in zip(gradients, hand_written_muon_with_ef(start, gradients, coefficient)):
        for param, gradient in zip(params, step_gradients):
            param.grad = gradient.clone()
        optimizer.step()
        for param, want in zip(params, expected):
            torch.testing.assert_close(param.detach(), want, atol=1e-12, rtol=0)


BASES: dict[str, Callable[[list[nn.Parameter]], torch.optim.Optimizer]] = {
    "adamw-fused": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=True),
    "muon": lambda params: Muon(params, lr=1e-2, weight_decay=0.1),
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("base", list(BASES))
def test_coefficient_zero_is_the_base_optimizer(base):
    torch.manual_seed(0)
    plain_params = [nn.Parameter(torch.randn(16, 8)), nn.Parameter(torch.randn(8, 12))]
    wrapped_params = [nn.Parameter(p.detach().clone()) for p in plain_params]
    plain = BASES[base](plain_params)
    wrapped = ErrorFeedback(BASES[base](wrapped_params), coefficient=0.0)
    for _ in range(5):
        for p, q in zip(plain_params, wrapped_params):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        plain.step()
        wrapped.step()
        for p, q in zip(plain_params, wrapped_params):
            assert torch.equal(p, q)


def test_coefficient_outside_zero_two_is_rejected():
    with pytest.raises(ValueError, match=r"\[0, 2\]"):
        ErrorFeedback(torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1), coefficient=2.5)


def small_llama() -> nn.Module:
    """A 2-layer llama3 with grouped-query attention (2 query heads per KV head)."""
    model = build_model_spec(ModelSection(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, multiple_of=32), 128).model.build()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.05)
    return model


def muon_with_error_feedback(model: nn.Module) -> RoutedOptimizersContainer:
    section = OptimizerSection(name="muon", lr=0.02, error_feedback=ErrorFeedbackSection(enabled=True))
    return section.container_config().build(model_parts=[model])


def train(model: nn.Module, optimizers: RoutedOptimizersContainer, steps: range) -> None:
    """Optimizer steps with gradients that depend only on the step number."""
    for step in steps:
        generator = torch.Generator().manual_seed(step)
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        optimizers.step()
        optimizers.zero_grad()


def test_materialising_state_is_not_a_step():
    """torchtitan's zero-lr init step (state_dict before training) must not count as u_0.

    Both sides take it, because it advances AdamW's own step count."""
    torch.manual_seed(0)
    with_ef, without_ef = small_llama(), small_llama()
    without_ef.load_state_dict(with_ef.state_dict())
    wrapped = muon_with_error_feedback(with_ef)
    plain = OptimizerSection(name="muon", lr=0.02).container_config().build(model_parts=[without_ef])
    wrapped.state_dict()
    plain.state_dict()
    train(with_ef, wrapped, range(1))
    train(without_ef, plain, range(1))
    for p, q in zip(with_ef.parameters(), without_ef.parameters()):
        assert torch.equal(p, q)


def test_checkpoint_round_trip_resumes_exactly(tmp_path):
    torch.manual_seed(0)
    model = small_llama()
    optimizers = muon_with_error_feedback(model)
    train(model, optimizers, range(3))

    saved_weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    saved_state = {k: v.clone() for k, v in optimizers.state_dict().items() if isinstance(v, torch.Tensor)}
    assert any(k.endswith(".momentum_buffer") for k in saved_state)
    assert any(k.endswith(".ef_previous_update") for k in saved_state)
    dcp.save({"optimizer": optimizers}, checkpoint_id=str(tmp_path / "step-3"))
    train(model, optimizers, range(3, 6))

    torch.manual_seed(1)
    resumed = small_llama()
    with torch.no_grad():
        for name, param in resumed.named_parameters():
            param.copy_(saved_weights[name])
    resumed_optimizers = muon_with_error_feedback(resumed)
    dcp.load({"optimizer": resumed_optimizers}, checkpoint_id=str(tmp_path / "step-3"))
    loaded_state = resumed_optimizers.state_dict()
    for key, value in saved_state.items():
        assert torch.equal(loaded_state[key], value), key
    train(resumed, resumed_optimizers, range(3, 6))

    for (name, param), resumed_param in zip(model.named_parameters(), resumed.parameters()):
        assert torch.equal(param, resumed_param), name
