"""Lloyd-Max scalar quantizer for a Gaussian, and the TurboQuant vector quantizer built on it.

Lloyd-Max for ``N(0, sigma^2)``: start from quantile centroids, then alternate boundaries = midpoints
of adjacent centroids and centroid = conditional mean of the interval, which for a Gaussian is closed
form: ``E[X | a < X < b] = sigma * (phi(a/s) - phi(b/s)) / (Phi(b/s) - Phi(a/s))``. Computed once per
bit width (float64, vectorised), stored in gaussian_levels.py, scaled by ``sigma``.

TurboQuant (Zandieh et al., arXiv:2504.19874), data-oblivious: for a vector ``x`` store its norm
(fp16); rotate the unit vector by a seeded randomized Hadamard; each coordinate then follows about
``N(0, 1/d)`` whatever the data, so one fixed Lloyd-Max codebook quantizes every coordinate. Optional
QJL: a 1-bit sign sketch ``sign(S r)`` of the residual ``r`` (in the rotated domain, ``S`` a seeded
Gaussian matrix) plus the residual's norm, decoded as ``sqrt(pi/2)/d * |r| * S^T sign(S r)``
(unbiased for inner products). Here QJL is *added* to the ``bits``-bit codes (``bits + 1`` bits per
coordinate in all); the paper's ``Q_prod`` instead spends ``bits - 1`` on the codes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .gaussian_levels import UNIT_GAUSSIAN_LEVELS
from .bitpack import byte_codes, lookup_packed, pack_bits, unpack_bits
from .hadamard import RandomRotation

__all__ = ["lloyd_max_centroids", "lloyd_max_boundaries", "TurboCode", "TurboQuantizer", "TURBO_BITS"]

TURBO_BITS = (1, 2, 3, 4, 8)


def _unit_gaussian_centroids(bits: int) -> tuple[float, ...]:
    return UNIT_GAUSSIAN_LEVELS[bits]    # solve_unit_gaussian(bits), stored: seconds to solve for 6 and 8 bits


def solve_unit_gaussian(bits: int) -> tuple[float, ...]:
    """The ``2**bits`` Lloyd-Max levels of a unit Gaussian, iterated to convergence (float64)."""
    n = 1 << bits
    normal = torch.distributions.Normal(torch.tensor(0.0, dtype=torch.float64), torch.tensor(1.0, dtype=torch.float64))
    c = normal.icdf((torch.arange(n, dtype=torch.float64) + 0.5) / n)
    inf = torch.tensor([math.inf], dtype=torch.float64)
    sqrt2pi = math.sqrt(2 * math.pi)
    for _ in range(20000):
        bounds = torch.cat((-inf, (c[1:] + c[:-1]) / 2, inf))
        a, b = bounds[:-1], bounds[1:]
        mass = torch.special.ndtr(b) - torch.special.ndtr(a)
        dens = (torch.exp(-0.5 * a * a) - torch.exp(-0.5 * b * b)) / sqrt2pi
        new = torch.where(mass > 1e-300, dens / mass.clamp_min(1e-300), c)
        done = (new - c).abs().max().item() < 1e-12
        c = new
        if done:
            break
    return tuple(c.tolist())


def lloyd_max_centroids(bits: int, sigma: float = 1.0, *, device=None, dtype=torch.float32) -> torch.Tensor:
    """Sorted Lloyd-Max centroids (``2**bits``) for ``N(0, sigma^2)``."""
    if not isinstance(bits, int) or not 1 <= bits <= 8:
        raise ValueError(f"bits must be an integer in 1..8, got {bits!r}")
    return torch.tensor(_unit_gaussian_centroids(bits), dtype=torch.float64).mul(sigma).to(device=device, dtype=dtype)


def lloyd_max_boundaries(centroids: torch.Tensor) -> torch.Tensor:
    """Decision boundaries (midpoints of adjacent centroids), ``len(centroids) - 1`` of them."""
    return (centroids[1:] + centroids[:-1]) / 2


@dataclass
class TurboCode:
    """Packed TurboQuant codes of vectors of shape ``shape + (dim,)``."""

    norm: torch.Tensor  # [...] fp16
    codes: torch.Tensor  # [..., ceil(dim*bits/8)] uint8
    qjl_signs: torch.Tensor | None = None  # [..., ceil(dim/8)] uint8
    qjl_norm: torch.Tensor | None = None  # [...] fp16

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.norm, self.codes, self.qjl_signs, self.qjl_norm) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def _fields(self) -> tuple:
        return (self.norm, self.codes, self.qjl_signs, self.qjl_norm)

    def tokens(self, start: int, stop: int, dim: int = 2) -> "TurboCode":
        """The codes of vectors ``start..stop-1`` along ``dim`` (a view)."""
        return TurboCode(*[None if x is None else x.narrow(dim, start, stop - start) for x in self._fields()])

    def select(self, i: int) -> "TurboCode":
        """The codes of ``x[i]`` when this code holds ``x`` (index along the first dim, a view)."""
        return TurboCode(*[None if x is None else x[i] for x in self._fields()])

    @staticmethod
    def cat(a: "TurboCode | None", b: "TurboCode", dim: int = 2) -> "TurboCode":
        """``a`` then ``b`` along ``dim`` (``a`` may be None: then ``b``)."""
        if a is None:
            return b
        return TurboCode(*[None if x is None else torch.cat([x, y], dim=dim)
                           for x, y in zip(a._fields(), b._fields())])


class TurboQuantizer:
    """Data-oblivious vector quantizer (TurboQuant MSE, optional QJL residual sketch).

    ``encode(x)`` takes ``[..., dim]`` and returns a `TurboCode`; ``decode(code)`` returns
    ``[..., dim]`` float32 on the code's device. ``decode_rotated`` skips the final inverse rotation:
    inner products and weighted sums can be computed in the rotated domain (rotate the query once,
    unrotate the weighted sum once), which `inner_products` and `weighted_sum` do.
    """

    def __init__(self, dim: int, bits: int, qjl: bool = False, seed: int = 0):
        if bits not in TURBO_BITS:
            raise ValueError(f"TurboQuant bits must be one of {TURBO_BITS}, got {bits!r}")
        if dim < 2:
            raise ValueError(f"dim must be at least 2, got {dim}")
        self.dim, self.bits, self.qjl, self.seed = dim, bits, bool(qjl), seed
        self.rotation = RandomRotation(dim, seed)
        sigma = 1.0 / math.sqrt(dim)
        self._codebook64 = lloyd_max_centroids(bits, sigma, dtype=torch.float64)
        self._sketch64 = None
        if self.qjl:
            g = torch.Generator().manual_seed(seed + 7919)
            self._sketch64 = torch.randn(dim, dim, generator=g, dtype=torch.float64)
        self._cache: dict[tuple, tuple] = {}

    def _tables(self, device, dtype=torch.float32):
        key = (str(device), dtype)
        t = self._cache.get(key)
        if t is None:
            cb = self._codebook64.to(device=device, dtype=dtype)
            sk = None if self._sketch64 is None else self._sketch64.to(device=device, dtype=dtype)
            # the centroids of the codes in each byte value, for one-gather decoding
            per_byte = cb[byte_codes(self.bits, device)] if 8 % self.bits == 0 else None
            t = (cb, lloyd_max_boundaries(cb).contiguous(), sk, per_byte)
            self._cache[key] = t
        return t

    def encode(self, x: torch.Tensor) -> TurboCode:
        if x.shape[-1] != self.dim:
            raise ValueError(f"last dim must be {self.dim}, got {tuple(x.shape)}")
        xf = x.float()
        cb, bounds, sketch, _ = self._tables(x.device)
        norm = xf.norm(dim=-1)
        unit = xf / norm.clamp_min(1e-12).unsqueeze(-1)
        y = self.rotation.rotate(unit)
        idx = torch.bucketize(y, bounds)
        code = TurboCode(norm=norm.to(torch.float16), codes=pack_bits(idx, self.bits))
        if self.qjl:
            resid = y - cb[idx]
            code.qjl_norm = resid.norm(dim=-1).to(torch.float16)
            code.qjl_signs = pack_bits((resid @ sketch.T >= 0).to(torch.uint8), 1)
        return code

    def decode_rotated(self, code: TurboCode, dtype=torch.float32) -> torch.Tensor:
        """Reconstruction in the rotated domain, ``rotate(decode(code))``."""
        cb, _, sketch, per_byte = self._tables(code.codes.device, dtype)
        if per_byte is not None:
            y = lookup_packed(code.codes, per_byte, self.dim)
        else:
            y = cb[unpack_bits(code.codes, self.bits, self.dim)]
        if self.qjl:
            z = unpack_bits(code.qjl_signs, 1, self.dim).to(dtype) * 2 - 1
            y = y + (math.sqrt(math.pi / 2) / self.dim) * code.qjl_norm.to(dtype).unsqueeze(-1) * (z @ sketch)
        return y * code.norm.to(dtype).unsqueeze(-1)

    def decode(self, code: TurboCode, dtype=torch.float32) -> torch.Tensor:
        return self.rotation.unrotate(self.decode_rotated(code, dtype))

    def inner_products(self, q: torch.Tensor, code: TurboCode) -> torch.Tensor:
        """``q @ decode(code).T`` for ``q [..., m, dim]`` and a code of ``[..., n]`` vectors -> ``[..., m, n]``."""
        y = self.decode_rotated(code, q.dtype if q.dtype.is_floating_point else torch.float32)
        return self.rotation.rotate(q) @ y.transpose(-1, -2)

    def weighted_sum(self, p: torch.Tensor, code: TurboCode) -> torch.Tensor:
        """``p @ decode(code)`` for weights ``p [..., m, n]`` -> ``[..., m, dim]`` (one inverse rotation)."""
        y = self.decode_rotated(code, p.dtype)
        return self.rotation.unrotate(p @ y)

    def nbytes(self, code: TurboCode) -> int:
        return code.nbytes()
