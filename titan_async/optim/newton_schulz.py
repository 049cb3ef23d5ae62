"""Quintic Newton-Schulz orthogonalisation, the core of Muon: one matrix, or same-shape stacks."""

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


def flops(shape: tuple[int, int], steps: int) -> int:
    """Floating-point operations of `steps` iterations on a matrix of `shape`: X X^T, b A + c A A, a X + B X."""
    m, n = sorted(shape)
    return steps * (4 * m * m * n + 2 * m**3)


def orthogonalize(matrix: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Approximately U V^T for `matrix` = U S V^T (a plain 2-D tensor), computed in `dtype`.

    The matrix is divided by its Frobenius norm, so every singular value starts in (0, 1];
    `steps` iterations then map each one into a band around 1 (about [0.68, 1.13] for 5 steps
    once it starts above 0.01). Tall matrices are transposed so the Gram matrix is the small one.
    Returns a tensor of `matrix`'s dtype and shape. The one-matrix reference form of
    `orthogonalize_batched`.
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


def orthogonalize_batched(stack: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`orthogonalize` of every matrix of a (batch, rows, cols) stack, as one batched iteration.

    Each matrix is copied (wide side first, contiguous, in `dtype`) and divided by its own norm;
    the iteration then reuses four work buffers instead of allocating per step, so the result
    does not depend on the input's memory layout. Returns a stack of `stack`'s dtype and shape.
    """
    if stack.ndim != 3:
        raise ValueError(f"orthogonalize_batched needs a (batch, rows, cols) stack, got shape {tuple(stack.shape)}")
    a, b, c = COEFFICIENTS
    tall = stack.size(1) > stack.size(2)
    source = stack.mT if tall else stack
    x = source.new_empty(source.shape, dtype=dtype).copy_(source)
    norms = torch.linalg.vector_norm(x, dim=(1, 2), keepdim=True, dtype=torch.float32)
    x.div_(norms.clamp_(min=_EPS).to(dtype))
    batch, rows, _ = x.shape
    spare = torch.empty_like(x)
    gram = x.new_empty((batch, rows, rows))
    polynomial = torch.empty_like(gram)
    for _ in range(steps):
        torch.bmm(x, x.mT, out=gram)
        torch.baddbmm(gram, gram, gram, beta=b, alpha=c, out=polynomial)
        torch.baddbmm(x, polynomial, x, beta=a, out=spare)
        x, spare = spare, x
    return (x.mT if tall else x).to(stack.dtype)


def orthogonalize_all(matrices: list[torch.Tensor], steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """`orthogonalize` of each 2-D matrix, one `orthogonalize_batched` call per distinct shape.

    A tall matrix joins the stack of its transpose's shape (the iteration works on the wide
    side either way); matrices of different dtypes or devices go to different stacks.
    """
    stacks: dict[tuple, list[int]] = {}
    for i, matrix in enumerate(matrices):
        rows, cols = matrix.shape
        stacks.setdefault((min(rows, cols), max(rows, cols), matrix.dtype, matrix.device), []).append(i)
    results: list[torch.Tensor | None] = [None] * len(matrices)
    for indices in stacks.values():
        wide = [matrices[i].T if matrices[i].size(0) > matrices[i].size(1) else matrices[i] for i in indices]
        for i, result in zip(indices, orthogonalize_batched(torch.stack(wide), steps, dtype)):
            results[i] = result.T if matrices[i].size(0) > matrices[i].size(1) else result
    return results
