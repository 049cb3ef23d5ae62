"""What the one-step delay (PipeDream-2BW, PACI) costs a run in tokens: the staleness law fitted by
tools/staleness_scaling.py to its studies (docs/results/staleness_scaling), evaluated for a run.

Token efficiency eta: the synchronous run reaches the delayed run's final loss with eta x the
tokens, so the delayed run needs about 1 / eta times the synchronous run's tokens to reach the
synchronous run's final loss, and its time to that loss is its step time x 1 / eta. The law:

    ln(1 / eta) = c[optimizer, corrector] x (steps / 1000) ** -steps_exponent[optimizer]
                                          x (parameters / 1e6) ** -parameters_exponent

with its range a factor either way on ln(1 / eta) (`Law.range_factor`: the fit's residuals and the
seed-to-seed spread of the optimizer and corrector's points), widened on the pessimistic side to
the paper's points (`Law.out_of_sample_factors`) wherever the prediction extrapolates. The loss
gap at equal tokens follows from the synchronous loss's slope in log tokens, s = -dL/d ln D:
gap = s x ln(1 / eta). The study's own slope is that of its tiny models and data set; for a run
the slope is Chinchilla's (Hoffmann et al. 2022, L = E + A / N^alpha + B / D^beta, so
s = beta x B x D^-beta), stated as such wherever a gap is shown.

A PipeDream2BW with fewer microbatches than stages delays by d = ceil((p - 1) / m) steps; the
law's delay term, fitted where the studies trained d = 2 and 4 (`Law.delay_exponents`), scales
ln(1 / eta) by d ** delay_exponent[optimizer, corrector]. A PACI microbatch crosses at most one
update of its stage when the stage steps every a >= p - 1 backwards (docs/schedules.md), so the
delay-1 law bounds PACI's cost from above there; with fewer it crosses up to ceil((p - 1) / a),
bounded by the law at that delay.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

LAW_FILE = Path(__file__).with_name("staleness_law.json")
CORRECTORS = ("none", "ef", "predict")
"""The delayed run's correction: none, error feedback (`optimizer.error_feedback.enabled`), or
weight prediction (`training.weight_prediction`)."""
CHINCHILLA = {"B": 410.7, "beta": 0.28}
"""Hoffmann et al. 2022, approach 3: the data term of the loss, B / D^beta."""


@dataclass(frozen=True)
class Law:
    """The fitted law (LAW_FILE): `coefficients` by "optimizer+corrector" ("muon+none", ...),
    its two exponents, `residual_factor` >= 1 (the largest factor between a fitted point's
    ln(1 / eta) and the law's), `range_factors` >= 1 by coefficient (where the seeds of its
    points spread wider than that), and the `steps` and `parameters` ranges it was fitted on."""

    coefficients: dict[str, float]
    steps_exponent: float
    parameters_exponent: float
    residual_factor: float
    steps: tuple[int, int]
    parameters: tuple[int, int]
    source: str
    range_factors: dict[str, float] = field(default_factory=dict)
    out_of_sample_factors: dict[str, float] = field(default_factory=dict)
    """By coefficient: how many times the law underestimates the paper's points (their ln(1 / eta)
    over the law's at their steps and size, at least 1); an extrapolating prediction's pessimistic
    end goes that far."""
    delay_exponents: dict[str, float] = field(default_factory=dict)
    """By coefficient: ln(1 / eta) at a delay of d steps is d ** exponent times the delay-1 law's
    (fitted on the studies' d = 2 and 4 runs; a coefficient without one has no estimate at d > 1)."""
    delays: tuple[int, int] = (1, 1)
    """The delays the studies trained."""
    steps_exponents: dict[str, float] = field(default_factory=dict)
    """By optimizer, where its points identify one of its own: the steps exponent, in place of
    `steps_exponent`."""

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Law:
        return cls(dict(data["coefficients"]), data["steps_exponent"], data["parameters_exponent"], data["residual_factor"],
                   tuple(data["steps"]), tuple(data["parameters"]), data["source"], dict(data.get("range_factors", {})),
                   dict(data.get("out_of_sample_factors", {})), dict(data.get("delay_exponents", {})),
                   tuple(data.get("delays", (1, 1))), dict(data.get("steps_exponents", {})))

    def steps_exponent_of(self, optimizer: str) -> float:
        return self.steps_exponents.get(optimizer, self.steps_exponent)

    def range_factor(self, optimizer: str, corrector: str) -> float:
        """The factor either way on ln(1 / eta) that bounds the prediction's range."""
        return max(self.residual_factor, self.range_factors.get(f"{optimizer}+{corrector}", 1.0))

    def log_inefficiency(self, optimizer: str, corrector: str, steps: int, parameters: int, delay: int = 1) -> float:
        """ln(1 / eta) at these steps and parameters and a delay of `delay` steps; KeyError for an
        optimizer or corrector the studies did not train (at that delay, for d > 1)."""
        key = f"{optimizer}+{corrector}"
        scale = 1.0 if delay == 1 else delay ** self.delay_exponents[key]
        return (self.coefficients[key] * (steps / 1000) ** -self.steps_exponent_of(optimizer)
                * (parameters / 1e6) ** -self.parameters_exponent * scale)


@cache
def law() -> Law:
    """The law shipped with the package (LAW_FILE)."""
    return Law.from_json(json.loads(LAW_FILE.read_text()))


@dataclass(frozen=True)
class Estimate:
    """The delay's predicted cost for one run and corrector: token efficiency with its range
    (low <= efficiency <= high), and what the prediction extrapolates beyond the studies."""

    efficiency: float
    low: float
    high: float
    extrapolated: tuple[str, ...]

    @property
    def tokens_factor(self) -> float:
        """Tokens (and time) the delayed run needs to reach the synchronous run's final loss, as a
        multiple of the synchronous run's."""
        return 1 / self.efficiency


def estimate(optimizer: str, corrector: str, steps: int, parameters: int, fitted: Law | None = None, delay: int = 1) -> Estimate:
    """The token efficiency of `optimizer` (adamw, muon) with `corrector` (CORRECTORS) after
    `steps` optimizer steps of a `parameters`-parameter model at a delay of `delay` steps: the
    law's, within its range factor either way; where the steps, parameters or delay lie outside
    the studies', the pessimistic end also reaches the paper's points
    (`Law.out_of_sample_factors`). Raises KeyError for an optimizer or corrector the studies did
    not train (at that delay). Below the studies' fewest steps the law is held at its value there
    instead of extrapolated: its steps term would grow without bound (Muon's exponent is about
    1.5), where the 100-step CPU runs measure about the fewest-steps cell's cost."""
    fitted = fitted or law()
    y = fitted.log_inefficiency(optimizer, corrector, max(steps, fitted.steps[0]), parameters, delay)
    notes = []
    ranges = [("steps", steps, fitted.steps, "lie"), ("parameters", parameters, fitted.parameters, "lie")]
    ranges += [("a delay of", delay, fitted.delays, "lies")] if delay > 1 else []
    for what, value, (low, high), verb in ranges:
        if not low <= value <= high:
            notes.append(f"{what} {value:,} {verb} outside the studies' {low:,}..{high:,} "
                         f"({max(value / high, low / value):,.0f}x beyond)")
    f = fitted.range_factor(optimizer, corrector)
    pessimistic = max(f, fitted.out_of_sample_factors.get(f"{optimizer}+{corrector}", 1.0)) if notes else f
    return Estimate(math.exp(-y), math.exp(-y * pessimistic), math.exp(-y / f), tuple(notes))


def corrector_of(error_feedback: bool, weight_prediction: float) -> str:
    """The CORRECTORS name of a run's settings (error feedback wins when both are on: the studies
    trained neither together)."""
    return "ef" if error_feedback else "predict" if weight_prediction else "none"


def chinchilla_slope(tokens: float) -> float:
    """-dL / d ln D of Chinchilla's loss at `tokens` (CHINCHILLA): beta x B x D^-beta."""
    return CHINCHILLA["beta"] * CHINCHILLA["B"] * tokens ** -CHINCHILLA["beta"]


def gap(efficiency: float, tokens: float) -> float:
    """The loss gap at equal tokens that `efficiency` means on Chinchilla's loss curve at `tokens`."""
    return chinchilla_slope(tokens) * -math.log(efficiency)
