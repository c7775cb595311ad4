"""PCA transform coding: centred PCA, int8 basis, coefficients quantized per component.

* `fit_pca(x, rank)`: centred PCA, by randomized SVD (``torch.svd_lowrank``, ``niter=24``: fewer
  iterations gave unstable bases in the source's tests) or, when ``D`` is small enough, exactly from
  the covariance; returns the mean, an orthonormal basis ``[D, r]`` and each component's variance.
* `encode_pca(x, fit, bits_per_group)`: int8 basis with a per-column scale, coefficients as symmetric
  integers ``[-(2**(b-1)-1), 2**(b-1)-1]`` (``levels="uniform"``, the source's int4) or as the
  ``2**b`` Lloyd-Max levels of a Gaussian (``levels="lloyd"``), with a per-component step scaled from
  the component's spread (the Gaussian-optimal step times its standard deviation, then the best of a
  few multipliers on a sample; absmax scaling wasted most levels on the tails), bit-packed per run of
  components with equal bits.

The bits per component come from `codecs.bit_allocation`, the levels from `codecs.scalar_levels`;
`codecs.table_decoder` decodes many rows fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .bit_allocation import PCA_BITS
from .bitpack import lookup_packed, pack_bits, unpack_bits
from .scalar_levels import QuantizeUnit, byte_level_table, gaussian_uniform_step, quantize_unit, unit_levels
from .table_decoder import TableDecoder

_SCALE_MULTIPLIERS = (0.7, 0.85, 1.0, 1.2, 1.45)


@dataclass
class PCAFit:
    mean: torch.Tensor  # [D] float32
    basis: torch.Tensor  # [D, r] orthonormal columns, float32
    variances: torch.Tensor  # [r] variance of each component's coefficient
    total_variance: float  # summed variance of all D centred dims (energy incl. what the rank misses)


def fit_pca(x: torch.Tensor, rank: int, *, niter: int = 24, seed: int = 0, method: str = "auto") -> PCAFit:
    """Centred PCA of the rows of ``x`` ``[N, D]`` (deterministic for a given ``seed``).

    ``method``: ``"lowrank"`` = ``torch.svd_lowrank(q=rank, niter=niter)`` (the source's choice, for
    large ``D``); ``"exact"`` = eigendecomposition of the ``D x D`` covariance (``N*D^2`` flops: cheaper
    and more accurate than 24 power iterations whenever ``D`` is a few hundred); ``"auto"`` picks
    ``exact`` for ``D <= 1024``.
    """
    if x.dim() != 2 or x.shape[0] < 2:
        raise ValueError(f"fit_pca needs a [N>=2, D] matrix, got {tuple(x.shape)}")
    if method not in ("auto", "exact", "lowrank"):
        raise ValueError(f"method must be 'auto', 'exact' or 'lowrank', got {method!r}")
    xf = x.float()
    n, dim = xf.shape
    rank = max(1, min(rank, dim, n))
    mean = xf.mean(0)
    if method == "exact" or (method == "auto" and dim <= 1024):
        cov = _centred_covariance(xf, mean)
        evals, evecs = torch.linalg.eigh(cov)
        order = torch.argsort(evals, descending=True)[:rank]
        return PCAFit(mean=mean, basis=evecs[:, order].float().contiguous(),
                      variances=evals[order].clamp_min(0).float(), total_variance=float(cov.trace()))
    centred = xf - mean
    total = float(torch.linalg.vector_norm(centred) ** 2 / n)
    # svd_lowrank draws from the global RNG: fork it so the fit is reproducible and the caller's
    # random state is untouched.
    devices = [centred.device] if centred.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        _, s, v = torch.svd_lowrank(centred, q=rank, niter=niter)
    return PCAFit(mean=mean, basis=v.contiguous(), variances=s.pow(2) / n, total_variance=total)


_SLICE_ROWS = 4096  # rows centred at once by `fit_pca` and `encode_pca`


def _centred_covariance(x: torch.Tensor, mean: torch.Tensor) -> torch.Tensor:
    """``[D, D]`` float64 covariance of the rows of ``x [N, D]`` about ``mean``, summed over slices of rows: a
    centred copy of ``x`` (a layer's prompt keys, in compression) never exists at once."""
    cov = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], _SLICE_ROWS):
        part = x[i:i + _SLICE_ROWS] - mean
        cov.addmm_(part.T, part)
    return cov.double() / x.shape[0]


def quantize_basis(basis: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 basis with one fp16 scale per column (absmax / 127)."""
    scale = basis.abs().amax(dim=0).clamp_min(1e-12) / 127
    q = torch.round(basis / scale).clamp(-127, 127).to(torch.int8)
    return q, scale.to(torch.float16)


@dataclass
class PCACode:
    """Rows ``[..., N, D]`` coded as ``mean + coefficients @ basis.T`` (dropped components excluded).

    ``codes`` ``[..., N, bytes]`` uint8 holds every row's packed coefficients; ``runs`` lists
    ``(bits, start, stop, byte_start, byte_stop)``: components ``start:stop`` (of the kept ones) share
    ``bits`` and are packed in bytes ``byte_start:byte_stop`` of each row.
    """

    mean: torch.Tensor  # [D] fp16
    basis_q: torch.Tensor  # [D, r_kept] int8
    basis_scale: torch.Tensor  # [r_kept] fp16
    coeff_step: torch.Tensor  # [r_kept] fp16
    codes: torch.Tensor  # [..., N, bytes] uint8
    runs: list = field(default_factory=list)
    column_scale: torch.Tensor | None = None  # [D] fp16: rows were coded divided by it (see encode_pca)
    levels: str = "uniform"
    n: int = 0
    lead_shape: tuple = ()  # leading dims of the coded rows (e.g. batch)

    @property
    def rank(self) -> int:
        return self.basis_q.shape[1]

    def parts(self) -> dict[str, list[torch.Tensor]]:
        return {"codes": [self.codes],
                "scales": [self.coeff_step] + ([self.column_scale] if self.column_scale is not None else []),
                "bases": [self.mean, self.basis_q, self.basis_scale]}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for ts in self.parts().values() for t in ts)

    def basis(self, dtype=torch.float32) -> torch.Tensor:
        """Dequantized basis ``[D, r_kept]``."""
        return self.basis_q.to(dtype) * self.basis_scale.to(dtype)

    def coefficients(self, start: int = 0, stop: int | None = None, dtype=torch.float32) -> torch.Tensor:
        """Dequantized coefficients of rows ``start:stop`` -> ``[..., n, r_kept]``."""
        stop = self.n if stop is None else stop
        cols = [self.run_levels(run, start, stop, dtype) for run in self.runs]
        if not cols:
            return torch.zeros(*self.lead_shape, stop - start, 0, dtype=dtype, device=self.mean.device)
        return torch.cat(cols, dim=-1) * self.coeff_step.to(dtype)

    def run_levels(self, run, start: int, stop: int, dtype) -> torch.Tensor:
        """Unit-step levels ``[..., stop-start, components]`` of one run's codes in rows ``start:stop``."""
        bits, a, b, byte_a, byte_b = run
        rows = self.codes[..., start:stop, byte_a:byte_b]
        if 8 % bits == 0:  # one gather per byte: a table from byte value to its codes' levels
            return lookup_packed(rows, byte_level_table(bits, self.levels, str(rows.device)).to(dtype), b - a)
        codes = unpack_bits(rows, bits, b - a)
        return unit_levels(bits, self.levels, rows.device).to(dtype)[codes]

    def decode(self, start: int = 0, stop: int | None = None, dtype=torch.float32,
               columns: torch.Tensor | None = None) -> torch.Tensor:
        """Reconstructed rows ``[..., n, D]`` (only rows ``start:stop``). To decode several blocks of
        rows, build a `decoder` once and call it per block."""
        return self.decoder(dtype, columns)(start, self.n if stop is None else stop)

    def decoder(self, dtype=torch.float32, columns: torch.Tensor | None = None):
        """A function ``(start, stop) -> rows [..., stop-start, D]`` (see `TableDecoder`)."""
        stacked = TableDecoder([self], dtype, columns)
        return lambda start, stop: stacked(start, stop).squeeze(-3)



def stack_fields(codes: list[PCACode], field: str, length: int) -> torch.Tensor:
    """The per-component (or per-column) ``field`` of several scopes' codes stacked ``[S, length]``, zero past
    each one's own size: scopes of a block can keep different numbers of components."""
    rows = [getattr(code, field) for code in codes]
    return torch.stack([torch.nn.functional.pad(x, (0, length - x.shape[-1])) for x in rows])


def _best_steps(coeffs: torch.Tensor, base_step: torch.Tensor, bits: int, levels: str,
                sample: int = 1024, quantize: QuantizeUnit = quantize_unit) -> torch.Tensor:
    """Per component, the multiple of ``base_step`` with the least squared error on a row sample."""
    rows = coeffs.reshape(-1, coeffs.shape[-1])
    if rows.shape[0] > sample:
        rows = rows[torch.linspace(0, rows.shape[0] - 1, sample, device=rows.device).long()]
    mults = torch.tensor(_SCALE_MULTIPLIERS, device=rows.device, dtype=rows.dtype)
    steps = (base_step.unsqueeze(0) * mults.unsqueeze(1)).unsqueeze(1)  # [M, 1, r]
    table = unit_levels(bits, levels, rows.device)
    # Every multiplier at once (M sample-sized temporaries, a few hundred KB): a per-multiplier loop cost
    # ~5 small ops x M per call, 0.3 s of an 8K prefill's compression (the same errors, summed in the same order)
    err = (rows - table[quantize(rows / steps, bits, levels).long()] * steps).pow(2).sum(1)  # [M, r]
    return steps.squeeze(1).gather(0, err.argmin(0, keepdim=True)).squeeze(0)


def _projected(x: torch.Tensor, mean: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``(x - mean) @ basis`` for rows ``x [..., N, D]``, a slice of rows at a time: a centred copy of ``x`` never
    exists at once (centred before the product, not after it: keys with a large shared part, such as a key
    bias, would lose their small differences to float32 rounding)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], basis.shape[1], dtype=torch.float32, device=x.device)
    for i in range(0, rows.shape[0], _SLICE_ROWS):
        torch.mm(rows[i:i + _SLICE_ROWS].float() - mean, basis, out=out[i:i + _SLICE_ROWS])
    return out.reshape(*x.shape[:-1], basis.shape[1])


def encode_pca(x: torch.Tensor, fit: PCAFit, bits_per_component: list[int] | torch.Tensor,
               fit_rows: torch.Tensor | None = None, levels: str = "uniform",
               column_scale: torch.Tensor | None = None, quantize: QuantizeUnit = quantize_unit) -> PCACode:
    """Code rows ``x`` ``[..., N, D]`` with ``fit``; component ``i`` gets ``bits_per_component[i]``
    bits (0 = dropped). ``fit_rows`` (bool ``[..., N]``) marks the rows used to choose the steps
    (e.g. excluding padding); default all. ``levels``: see `unit_levels`.

    ``column_scale`` (``[D]``, stored in fp16): ``x`` (and ``fit``) are rows already divided by it
    column by column (a weighting of the columns' errors); decoding multiplies it back. ``quantize``: the
    coefficients' coding (`quantize_unit`, or a faster one that gives the same codes)."""
    unit_levels(2, levels)  # validates the name
    bits = [int(b) for b in bits_per_component]
    if len(bits) != fit.basis.shape[1]:
        raise ValueError(f"need {fit.basis.shape[1]} bit widths, got {len(bits)}")
    bad = [b for b in bits if b not in PCA_BITS]
    if bad:
        raise ValueError(f"component bits must be in {PCA_BITS}, got {sorted(set(bad))}")
    order = sorted((i for i, b in enumerate(bits) if b > 0), key=lambda i: (-bits[i], i))
    kept = torch.tensor(order, dtype=torch.long, device=fit.basis.device)
    basis_q, basis_scale = quantize_basis(fit.basis[:, kept])
    mean16 = fit.mean.to(torch.float16)
    # Project on the basis the decoder will use (int8), around the mean it will use (fp16).
    deq = basis_q.float() * basis_scale.float()
    coeffs = _projected(x, mean16.float(), deq)
    sample = coeffs if fit_rows is None else coeffs[fit_rows]
    std = sample.reshape(-1, coeffs.shape[-1]).std(0).clamp_min(1e-8) if sample.numel() else \
        torch.ones(coeffs.shape[-1], device=coeffs.device)
    steps = torch.empty_like(std)
    runs, packed, start, n_bytes = [], [], 0, 0
    kept_bits = [bits[i] for i in order]
    while start < len(kept_bits):
        b = kept_bits[start]
        stop = start
        while stop < len(kept_bits) and kept_bits[stop] == b:
            stop += 1
        base = std[start:stop] * (gaussian_uniform_step(b) if levels == "uniform" else 1.0)
        steps[start:stop] = _best_steps(sample.reshape(-1, coeffs.shape[-1])[:, start:stop], base, b, levels,
                                        quantize=quantize) \
            if sample.numel() else base
        step16 = steps[start:stop].to(torch.float16).float()
        steps[start:stop] = step16
        q = quantize(coeffs[..., start:stop] / step16, b, levels)
        packed.append(pack_bits(q, b))
        runs.append((b, start, stop, n_bytes, n_bytes + packed[-1].shape[-1]))
        n_bytes = runs[-1][-1]
        start = stop
    codes = torch.cat(packed, dim=-1) if packed else \
        torch.zeros(*x.shape[:-1], 0, dtype=torch.uint8, device=x.device)
    return PCACode(mean=mean16, basis_q=basis_q, basis_scale=basis_scale, coeff_step=steps.to(torch.float16),
                   codes=codes, runs=runs, levels=levels, n=x.shape[-2], lead_shape=tuple(x.shape[:-2]),
                   column_scale=None if column_scale is None else column_scale.to(torch.float16))
