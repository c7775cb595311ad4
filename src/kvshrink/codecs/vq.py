"""k-means vector quantization of channel groups.

A vector ``[..., D]`` is cut into ``D / group`` groups of ``group`` consecutive channels; every group
is replaced by the index of its nearest codeword in a shared codebook of ``k`` (a power of two)
entries, bit-packed at ``log2(k)`` bits per group.

Compression cost is kept small by design: the codebook is fitted on a seeded sample of the vectors
(k-means++ init, a few Lloyd iterations), and all vectors are then assigned in chunks, so no
``N x k`` distance matrix over all vectors is ever materialised (peak extra memory is
``chunk x k`` floats).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .bitpack import pack_bits, unpack_bits

# A nearest-codeword search: ``(x [N, g], codebook [k, g], chunk=..., out_dtype=...) -> indices [N]``
AssignCodes = Callable[..., torch.Tensor]

__all__ = ["kmeans_plus_plus", "fit_codebook", "assign_codes", "gaussian_codebook", "VQCode", "vq_encode",
           "check_codebook_size"]


def check_codebook_size(k: int) -> int:
    """Validate a codebook size (a power of two, 2..256) and return its index width in bits."""
    if not isinstance(k, int) or k < 2 or k > 256 or k & (k - 1):
        raise ValueError(f"codebook size must be a power of two in 2..256, got {k!r}")
    return int(math.log2(k))


def assign_codes(x: torch.Tensor, codebook: torch.Tensor, chunk: int = 2048,
                 out_dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Index of the nearest codeword for each row of ``x`` ``[N, g]`` (exhaustive, chunked over rows:
    small chunks keep the ``chunk x k`` distance block in cache, which measured fastest on CPU; any device).
    ``out_dtype`` (e.g. int32) narrows the result when it is only going to be packed."""
    c = codebook.float()
    c_sq = c.pow(2).sum(1)
    out = torch.empty(x.shape[0], dtype=out_dtype, device=x.device)
    for s in range(0, x.shape[0], chunk):
        xs = x[s:s + chunk].float()
        # ||x - c||^2 = ||x||^2 - 2 x.c + ||c||^2; ||x||^2 does not change the argmin.
        out[s:s + chunk] = torch.addmm(c_sq, xs, c.T, alpha=-2).argmin(dim=1)
    return out


def kmeans_plus_plus(x: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k-means++ seeding on rows of ``x`` ``[N, g]`` (``N >= 1``); duplicates rows if ``N < k``."""
    n = x.shape[0]
    first = int(torch.randint(n, (1,), generator=generator))
    centres = [x[first]]
    d2 = (x - x[first]).pow(2).sum(1)
    for _ in range(1, k):
        total = float(d2.sum())
        if total <= 0:
            idx = int(torch.randint(n, (1,), generator=generator))
        else:  # sample proportionally to d2 by inverting its cumulative sum
            u = float(torch.rand(1, generator=generator)) * total
            idx = min(int(torch.searchsorted(torch.cumsum(d2, 0), torch.tensor([u], device=d2.device))), n - 1)
        centres.append(x[idx])
        d2 = torch.minimum(d2, (x - x[idx]).pow(2).sum(1))
    return torch.stack(centres)


def fit_codebook(x: torch.Tensor, k: int, *, iters: int = 6, sample: int = 16384, seed: int = 0,
                 init: "str | torch.Tensor" = "kmeans++", assign: AssignCodes = assign_codes) -> torch.Tensor:
    """Fit a ``[k, g]`` float32 codebook on (a seeded sample of at most ``sample``) rows of ``x``.

    ``init``: ``"kmeans++"``, ``"random"`` (k sampled rows) or a ``[k, g]`` starting codebook (e.g.
    `gaussian_codebook` for data that is close to Gaussian: then a few iterations suffice). ``assign``: the
    nearest-codeword search each iteration runs (`assign_codes`, or a faster one that gives the same indices).
    """
    check_codebook_size(k)
    if x.dim() != 2 or x.shape[0] == 0:
        raise ValueError(f"fit_codebook needs a non-empty [N, g] matrix, got {tuple(x.shape)}")
    g = torch.Generator().manual_seed(seed)
    xs = x.float()
    if xs.shape[0] > sample:
        xs = xs[torch.randperm(xs.shape[0], generator=g)[:sample].to(xs.device)]
    if isinstance(init, torch.Tensor):
        if init.shape != (k, xs.shape[1]):
            raise ValueError(f"initial codebook must be {(k, xs.shape[1])}, got {tuple(init.shape)}")
        c = init.to(device=xs.device, dtype=torch.float32).clone()
    elif init == "kmeans++":
        c = kmeans_plus_plus(xs, k, g)
    elif init == "random":
        c = xs[torch.randint(xs.shape[0], (k,), generator=g).to(xs.device)].clone()
    else:
        raise ValueError(f"init must be 'kmeans++' or 'random', got {init!r}")
    for _ in range(iters):
        idx = assign(xs, c)
        sums = torch.zeros_like(c).index_add_(0, idx, xs)
        counts = torch.bincount(idx, minlength=k).to(c.dtype)
        filled = counts > 0
        c[filled] = sums[filled] / counts[filled].unsqueeze(1)  # empty clusters keep their centre
    return c


@functools.lru_cache(maxsize=16)
def _gaussian_codebook(group: int, k: int, seed: int, assign: AssignCodes) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    samples = torch.randn(max(64 * k, 16384), group, generator=g)
    return fit_codebook(samples, k, iters=25, sample=samples.shape[0], seed=seed, assign=assign)


def gaussian_codebook(group: int, k: int, *, seed: int = 0, device=None,
                      assign: AssignCodes = assign_codes) -> torch.Tensor:
    """k-means codebook ``[k, group]`` for the standard Gaussian in ``group`` dims (computed once per ``assign``,
    cached; ``assign`` as `fit_codebook` takes it).

    After a random rotation and per-channel scaling, groups of channels are close to Gaussian, so this
    is a data-independent codebook (and a good start for refining on the data).
    """
    check_codebook_size(k)
    return _gaussian_codebook(group, k, seed, assign).to(device)


@dataclass
class VQCode:
    """Vectors ``[..., D]`` as bit-packed codeword indices ``[..., ceil(D/group * bits / 8)]``."""

    codebook: torch.Tensor  # [k, group] fp16
    codes: torch.Tensor  # uint8
    group: int
    dim: int

    @property
    def bits(self) -> int:
        return check_codebook_size(self.codebook.shape[0])

    @property
    def n_groups(self) -> int:
        return self.dim // self.group

    def indices(self) -> torch.Tensor:
        """Codeword index per group, ``[..., D/group]`` int64."""
        return unpack_bits(self.codes, self.bits, self.n_groups)

    def decode(self, dtype=torch.float32) -> torch.Tensor:
        idx = self.indices()
        return self.codebook.to(dtype)[idx].reshape(*idx.shape[:-1], self.dim)

    def nbytes(self) -> int:
        return self.codebook.numel() * self.codebook.element_size() + self.codes.numel() * self.codes.element_size()


def vq_encode(x: torch.Tensor, group: int, k: int, *, fit_mask: torch.Tensor | None = None,
              iters: int = 6, sample: int = 16384, seed: int = 0, assign: AssignCodes = assign_codes) -> VQCode:
    """Fit a codebook on groups of ``x`` ``[..., D]`` (rows where ``fit_mask`` is true, default all)
    and code every group (``assign`` as `fit_codebook` takes it)."""
    bits = check_codebook_size(k)
    dim = x.shape[-1]
    if group < 1 or dim % group:
        raise ValueError(f"group size {group} must divide the vector size {dim}")
    groups = x.reshape(-1, group)
    fit_rows = groups if fit_mask is None else x[fit_mask].reshape(-1, group)
    codebook = fit_codebook(fit_rows if fit_rows.shape[0] else groups, k, iters=iters, sample=sample, seed=seed,
                            assign=assign)
    codebook16 = codebook.to(torch.float16)
    idx = assign(groups, codebook16.float()).reshape(*x.shape[:-1], dim // group)
    return VQCode(codebook=codebook16, codes=pack_bits(idx, bits), group=group, dim=dim)
