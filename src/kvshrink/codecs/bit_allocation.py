"""DP bit allocation over groups of PCA components.

`allocate_bits(variances, sizes, budget)` chooses bits in ``choices`` (default `PCA_BITS`, {0, 2, 4, 6,
8}) per group of components minimising the modelled error: ``D(b) * g`` for a group of summed variance
``g`` coded at ``b > 0`` bits, where ``D(b)`` is the measured error of the coefficient quantizer on a unit
Gaussian (`scalar_levels.gaussian_distortion`: 0.117 at 2 bits with Lloyd-Max levels), and
``drop_penalty * g`` for a dropped group (its whole variance; 1 = plain squared error), subject to
``sum(size * bits) <= budget``. Exact DP over the budget in units of the gcd of the costs. Several
layers can share one pool: pass all their groups at once.
"""

from __future__ import annotations

import math

import torch

from .scalar_levels import gaussian_distortion

# The widths a component may be coded at (0 = dropped): the allocation's default choices and what
# `codecs.pca.encode_pca` accepts.
PCA_BITS = (0, 2, 4, 6, 8)


def group_sizes(rank: int, group_size: int) -> list[int]:
    """Split ``rank`` components into consecutive groups of ``group_size`` (the last may be smaller)."""
    if group_size < 1:
        raise ValueError(f"group_size must be positive, got {group_size}")
    return [min(group_size, rank - s) for s in range(0, rank, group_size)]


def group_variances(variances: torch.Tensor, sizes: list[int]) -> list[float]:
    out, start = [], 0
    for size in sizes:
        out.append(float(variances[start:start + size].sum()))
        start += size
    return out


def modelled_error(g: float, bits: int, drop_penalty: float = 1.0, levels: str = "lloyd") -> float:
    """The DP's error model for a group of summed variance ``g`` coded at ``bits`` with ``levels``."""
    return drop_penalty * g if bits == 0 else g * gaussian_distortion(bits, levels)


def allocate_bits(variances: list[float], sizes: list[int], budget: int, *,
                  choices: tuple[int, ...] = PCA_BITS, drop_penalty: float = 1.0, levels: str = "lloyd") -> list[int]:
    """Bits per group minimising the summed modelled error with ``sum(size*bits) <= budget``
    (``levels``: the coefficient quantizer's `scalar_levels.unit_levels` kind).

    Exact dynamic programme; ``choices`` must contain 0 so a zero budget is feasible.
    """
    if len(variances) != len(sizes):
        raise ValueError("variances and sizes must have the same length")
    if 0 not in choices:
        raise ValueError(f"choices must contain 0, got {choices}")
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    costs = [[s * b for b in choices] for s in sizes]
    unit = 0
    for row in costs:
        for c in row:
            unit = math.gcd(unit, c)
    unit = max(unit, 1)
    cap = min(budget // unit, sum(max(r) for r in costs) // unit)
    inf = float("inf")
    best = torch.zeros(cap + 1, dtype=torch.float64)  # best[u]: min error using at most u units
    picks = torch.zeros(len(sizes), cap + 1, dtype=torch.int8)
    for i, (g, row) in enumerate(zip(variances, costs)):
        cand = torch.full((len(choices), cap + 1), inf, dtype=torch.float64)
        for j, (b, c) in enumerate(zip(choices, row)):
            u = c // unit
            if u <= cap:
                cand[j, u:] = best[: cap + 1 - u] + modelled_error(g, b, drop_penalty, levels)
        best, picks[i] = cand.min(dim=0)
    bits, u = [0] * len(sizes), cap
    for i in range(len(sizes) - 1, -1, -1):
        j = int(picks[i, u])
        bits[i] = choices[j]
        u -= costs[i][j] // unit
    return bits
