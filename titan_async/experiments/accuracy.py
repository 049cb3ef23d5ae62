"""How far a computed tensor is from a reference."""

from __future__ import annotations

import torch


def relative_difference(result: torch.Tensor, reference: torch.Tensor) -> float:
    """||result - reference|| / ||reference||, in float64."""
    return float((result.double() - reference.double()).norm() / reference.double().norm())
