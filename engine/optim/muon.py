"""Muon's update, as torch.optim.Muon computes it (torch/optim/_muon.py), in pieces that sharding can call.

For a matrix W with gradient g and momentum buffer B (zero at first):

    B ← B + (1 - μ)(g - B)                     (torch's lerp: B = μB + (1 - μ)g)
    U = g + μ(B - g) if nesterov else B
    O = NS(U)                                  quintic Newton–Schulz in `ns_dtype`, on the whole matrix
    W ← W·(1 - lr·λ) - lr·scale(shape)·O       decoupled weight decay, then the shape-scaled step

The momentum and the two lines that touch W are elementwise, so they run on whatever piece of W a rank holds
(a TP slice, a ZeRO shard); only NS needs the whole matrix (engine/optim/muon_owners.py brings it together).
"""
from __future__ import annotations

import math

import torch

NS_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def momentum_input(grad: torch.Tensor, buf: torch.Tensor, momentum: float, nesterov: bool) -> torch.Tensor:
    """Advance the momentum buffer `buf` in place with `grad`; returns what Newton–Schulz orthogonalises."""
    buf.lerp_(grad, 1 - momentum)
    return grad.lerp(buf, momentum) if nesterov else buf


def orthogonalise(x: torch.Tensor, coefficients, steps: int, eps: float) -> torch.Tensor:
    """Newton–Schulz's approximate U·Vᵀ of the contiguous 2-D matrix `x`, in x's dtype: torch's iteration step
    for step (the wide orientation, the Frobenius normalisation, X ← aX + (bA + cA²)X with A = XXᵀ). `x` is the
    caller's scratch and is overwritten: its storage and one more matrix of its size are the two buffers the
    iterates alternate between, beside A and bA + cA² (`work_bytes`). A tall matrix's first product reads the
    strided transpose, as torch's does (a contiguous copy would change fp32's rounding)."""
    a, b, c = coefficients
    tall = x.size(0) > x.size(1)
    y = x.T if tall else x
    y.div_(y.norm().clamp(min=eps))
    m, n = y.shape
    buffers = (torch.empty(m, n, dtype=x.dtype, device=x.device), x.view(m, n))
    gram, poly = (torch.empty(m, m, dtype=x.dtype, device=x.device) for _ in range(2))
    for i in range(steps):
        torch.mm(y, y.T, out=gram)
        torch.addmm(gram, gram, gram, beta=b, alpha=c, out=poly)
        y = torch.addmm(y, poly, y, beta=a, out=buffers[i % 2])
    return y.T if tall else y


def work_bytes(shape, element_size: int) -> int:
    """What `orthogonalise` allocates beside its input: the second iterate buffer (m·n) and A, bA + cA² (m² each)."""
    m, n = sorted(shape[:2])
    return element_size * (m * n + 2 * m * m)


def lr_scale(adjust_lr_fn: str, shape) -> float:
    """The per-matrix factor on the learning rate: original = sqrt(max(1, A/B)) (Keller Jordan's),
    match_rms_adamw = 0.2·sqrt(max(A, B)) (Moonlight's, so that AdamW's lr and weight decay carry over)."""
    rows, cols = shape[:2]
    if adjust_lr_fn == "match_rms_adamw":
        return 0.2 * math.sqrt(max(rows, cols))
    return math.sqrt(max(1, rows / cols))


def apply(master: torch.Tensor, update: torch.Tensor, lr: float, scale: float, weight_decay: float) -> None:
    """The parameter step on a piece of W (`update` the same piece of O, in its NS dtype, added in fp32)."""
    master.mul_(1 - lr * weight_decay)
    master.add_(update, alpha=-lr * scale)


def ns_flops(shape, steps: int) -> int:
    """Multiply-add FLOPs of `steps` iterations on an m×n matrix (m ≤ n): XXᵀ 2m²n, A² 2m³, (·)X 2m²n."""
    m, n = sorted(shape[:2])
    return steps * (4 * m * m * n + 2 * m ** 3)
