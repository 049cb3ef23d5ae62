"""Quintic Newton-Schulz orthogonalisation, the core of Muon."""

from __future__ import annotations

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of x -> a x + b x^3 + c x^5, from Keller Jordan's Muon."""

_EPS = 1e-7


def orthogonalize(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately U V^T for `matrix` = U S V^T (a plain 2-D tensor), computed in `dtype`.

    The matrix is divided by its Frobenius norm, so every singular value starts in (0, 1];
    `steps` iterations then map each one into a band around 1 (about [0.68, 1.13] for 5 steps
    once it starts above 0.01). Tall matrices are transposed so the Gram matrix is the small one.
    Returns a tensor of `matrix`'s dtype and shape.
    """
    if matrix.ndim != 2:
        raise ValueError(f"orthogonalize needs a 2-D matrix, got shape {tuple(matrix.shape)}")
    a, b, c = COEFFICIENTS
    x = matrix.to(dtype)
    tall = x.size(0) > x.size(1)
    if tall:
        x = x.T
    x = x / x.float().norm().clamp(min=_EPS).to(dtype)
    for _ in range(steps):
        gram = x @ x.T
        polynomial = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, polynomial, x, beta=a)
    if tall:
        x = x.T
    return x.to(matrix.dtype)
