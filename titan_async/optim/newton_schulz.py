"""Quintic Newton-Schulz orthogonalisation, the core of Muon: the one-matrix reference form, its
precision and its cost. `newton_schulz_batched` runs it on stacks of same-shape matrices."""

from __future__ import annotations

import torch

COEFFICIENTS = (3.4445, -4.7750, 2.0315)
"""(a, b, c) of x -> a x + b x^3 + c x^5, from Keller Jordan's Muon."""

NS_DTYPES = ("auto", "float32", "bfloat16")
"""Precisions of the iteration; auto is bfloat16 on CUDA and float32 elsewhere."""

_EPS = 1e-7


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """The iteration dtype that `name` (one of NS_DTYPES) gives for matrices on `device`."""
    if name not in NS_DTYPES:
        raise ValueError(f"Newton-Schulz dtype must be one of {', '.join(NS_DTYPES)}, got {name!r}")
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def gram_form(shape: tuple[int, int], steps: int, dtype: torch.dtype) -> bool:
    """Whether `newton_schulz_batched` iterates on the Gram matrix for this shape: in float32 only,
    when it costs fewer FLOPs (the wide side more than 1.5 times the narrow one, 2 steps or more)."""
    m, n = sorted(shape)
    return dtype == torch.float32 and steps >= 2 and 2 * n > 3 * m


def flops(shape: tuple[int, int], steps: int, dtype: torch.dtype) -> int:
    """Floating-point operations of `steps` iterations on a matrix of `shape` (m x n, m <= n once
    transposed), in the form `newton_schulz_batched` uses for `dtype`. Standard form, per step:
    A = X X^T, b A + c A A, a X + B X. Gram form: X X^T and the final product once; per step A A,
    A P and P (A P) on all steps but the last, P Q on all but the first."""
    m, n = sorted(shape)
    if gram_form(shape, steps, dtype):
        return 4 * m * m * n + 2 * m**3 * (4 * steps - 3)
    return steps * (4 * m * m * n + 2 * m**3)


def orthogonalize(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately U V^T for `matrix` = U S V^T (a plain 2-D tensor), computed in `dtype`.

    The matrix is divided by its Frobenius norm, so every singular value starts in (0, 1];
    `steps` iterations then map each one into a band around 1 (about [0.68, 1.13] for 5 steps
    once it starts above 0.01). Tall matrices are transposed so the Gram matrix is the small one.
    Returns a tensor of `matrix`'s dtype and shape. The reference for `newton_schulz_batched`.
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
