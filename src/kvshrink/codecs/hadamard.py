"""Orthogonal rotations that spread a vector's energy evenly over its coordinates.

* `hadamard_matrix(n)`: Sylvester Hadamard matrix for ``n`` a power of two, scaled by ``1/sqrt(n)`` so
  it is orthogonal (and symmetric).
* `RandomRotation(dim, seed)`: ``x -> (x * signs) @ H`` with seeded random signs (the randomized
  Hadamard transform). For ``dim`` not a power of two there is no Sylvester matrix; the fallback is a
  seeded random orthogonal matrix (QR of a Gaussian matrix with the signs of ``R``'s diagonal folded
  in, i.e. Haar-distributed), which has the same decorrelating effect at ``O(dim^2)`` cost per vector.

`rotate` / `unrotate` act on the last dim, follow the input's device and dtype (the matrix is built
once in float64 and cached per device/dtype), and are exact inverses up to float rounding.
"""

from __future__ import annotations

import math

import torch

__all__ = ["is_power_of_two", "hadamard_matrix", "random_orthogonal", "RandomRotation"]


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def hadamard_matrix(n: int, *, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix ``H`` (``H @ H.T == I``), ``n`` a power of two."""
    if not is_power_of_two(n):
        raise ValueError(f"Sylvester Hadamard needs a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / math.sqrt(n)).to(dtype=dtype, device=device)


def random_orthogonal(n: int, seed: int, *, dtype: torch.dtype = torch.float64, device=None) -> torch.Tensor:
    """Seeded Haar-random orthogonal ``n x n`` matrix (QR of a Gaussian matrix, sign-corrected)."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(n, n, generator=g, dtype=torch.float64)
    q, r = torch.linalg.qr(a)
    q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
    return q.to(dtype=dtype, device=device)


class RandomRotation:
    """Seeded orthogonal rotation along the last dim: randomized-sign Hadamard, or a random
    orthogonal matrix when ``dim`` is not a power of two (see module docstring).

    ``rotate(x) = x @ M`` and ``unrotate(y) = y @ M.T`` with ``M = diag(signs) @ H``.
    """

    def __init__(self, dim: int, seed: int = 0):
        if dim < 1:
            raise ValueError(f"dim must be positive, got {dim}")
        self.dim = dim
        self.seed = seed
        self.kind = "hadamard" if is_power_of_two(dim) else "random_orthogonal"
        if self.kind == "hadamard":
            g = torch.Generator().manual_seed(seed)
            signs = torch.randint(0, 2, (dim,), generator=g).to(torch.float64) * 2 - 1
            self._matrix64 = signs.unsqueeze(1) * hadamard_matrix(dim)
        else:
            self._matrix64 = random_orthogonal(dim, seed)
        self._cache: dict[tuple, torch.Tensor] = {}

    def matrix(self, device=None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``dim x dim`` orthogonal matrix ``M`` on ``device`` in ``dtype`` (cached)."""
        key = (str(device), dtype)
        m = self._cache.get(key)
        if m is None:
            m = self._matrix64.to(device=device, dtype=dtype)
            self._cache[key] = m
        return m

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] != self.dim:
            raise ValueError(f"last dim must be {self.dim}, got {tuple(x.shape)}")

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        self._check(x)
        return x @ self.matrix(x.device, x.dtype)

    def unrotate(self, y: torch.Tensor) -> torch.Tensor:
        self._check(y)
        return y @ self.matrix(y.device, y.dtype).T

    def nbytes(self) -> int:
        """Bytes needed to rebuild the rotation: the seed alone (the matrix is regenerated)."""
        return 8
