"""PCA transform coding: randomized PCA, DP bit allocation over component groups, int8 basis,
symmetric integer coefficients.

* `fit_pca(x, rank)`: centred PCA, by randomized SVD (``torch.svd_lowrank``, ``niter=24``: fewer
  iterations gave unstable bases in the source's tests) or, when ``D`` is small enough, exactly from
  the covariance; returns the mean, an orthonormal basis ``[D, r]`` and each component's variance.
* `allocate_bits(variances, sizes, budget)`: choose bits in ``choices`` (default {0, 2, 4, 6, 8}) per
  group of components minimising the modelled error ``g / (3 * 4**b)`` (``b > 0``) or
  ``drop_penalty * g`` (``b = 0``; dropping a direction is penalised, 4x by default) subject to
  ``sum(size * bits) <= budget``. Exact DP over the budget in units of the gcd of the costs. Several
  layers can share one pool: pass all their groups at once.
* `encode_pca(x, fit, bits_per_group)`: int8 basis with a per-column scale, coefficients as symmetric
  integers ``[-(2**(b-1)-1), 2**(b-1)-1]`` (``levels="uniform"``, the source's int4) or as the
  ``2**b`` Lloyd-Max levels of a Gaussian (``levels="lloyd"``), with a per-component step scaled from
  the component's spread (the Gaussian-optimal step times its standard deviation, then the best of a
  few multipliers on a sample; absmax scaling wasted most levels on the tails), bit-packed per run of
  components with equal bits.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch

from .bitpack import byte_codes, lookup_packed, pack_bits, unpack_bits

__all__ = [
    "COEFF_LEVELS", "unit_levels", "PCAFit", "fit_pca", "group_sizes", "group_variances", "allocate_bits", "modelled_error",
    "PCA_BITS", "gaussian_uniform_step", "PCACode", "TableDecoder", "SlotPlan", "slot_plan", "scaled_bases", "encode_pca", "quantize_basis",
]

PCA_BITS = (0, 2, 4, 6, 8)
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
    centred = xf - mean
    total = float(centred.pow(2).sum() / n)
    if method == "exact" or (method == "auto" and dim <= 1024):
        cov = (centred.T @ centred).double() / n
        evals, evecs = torch.linalg.eigh(cov)
        order = torch.argsort(evals, descending=True)[:rank]
        return PCAFit(mean=mean, basis=evecs[:, order].float().contiguous(),
                      variances=evals[order].clamp_min(0).float(), total_variance=total)
    # svd_lowrank draws from the global RNG: fork it so the fit is reproducible and the caller's
    # random state is untouched.
    devices = [centred.device] if centred.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        _, s, v = torch.svd_lowrank(centred, q=rank, niter=niter)
    return PCAFit(mean=mean, basis=v.contiguous(), variances=s.pow(2) / n, total_variance=total)


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


def modelled_error(g: float, bits: int, drop_penalty: float = 4.0) -> float:
    """The DP's error model for a group of summed variance ``g`` coded at ``bits``."""
    return drop_penalty * g if bits == 0 else g / (3.0 * 4.0 ** bits)


def allocate_bits(variances: list[float], sizes: list[int], budget: int, *,
                  choices: tuple[int, ...] = PCA_BITS, drop_penalty: float = 4.0) -> list[int]:
    """Bits per group minimising the summed modelled error with ``sum(size*bits) <= budget``.

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
                cand[j, u:] = best[: cap + 1 - u] + modelled_error(g, b, drop_penalty)
        best, picks[i] = cand.min(dim=0)
    bits, u = [0] * len(sizes), cap
    for i in range(len(sizes) - 1, -1, -1):
        j = int(picks[i, u])
        bits[i] = choices[j]
        u -= costs[i][j] // unit
    return bits


@functools.lru_cache(maxsize=None)
def gaussian_uniform_step(bits: int) -> float:
    """MSE-optimal step of the symmetric mid-tread quantizer with levels ``[-qmax, qmax]``
    (``qmax = 2**(bits-1) - 1``) for a unit Gaussian (numerical integration + grid search)."""
    qmax = (1 << (bits - 1)) - 1
    if qmax < 1:
        raise ValueError(f"symmetric quantization needs bits >= 2, got {bits}")
    z = torch.linspace(-9, 9, 36001, dtype=torch.float64)
    w = torch.exp(-0.5 * z * z)
    w /= w.sum()

    def mse(step: float) -> float:
        q = torch.clamp(torch.round(z / step), -qmax, qmax) * step
        return float((w * (z - q) ** 2).sum())

    lo, hi = 1e-3, 3.0
    for _ in range(3):  # coarse-to-fine log grid search (the MSE is unimodal in the step)
        grid = torch.logspace(math.log10(lo), math.log10(hi), 40, dtype=torch.float64).tolist()
        errs = [mse(s) for s in grid]
        k = min(range(len(grid)), key=errs.__getitem__)
        lo, hi = grid[max(k - 1, 0)], grid[min(k + 1, len(grid) - 1)]
    return (lo + hi) / 2


COEFF_LEVELS = ("uniform", "lloyd")


def unit_levels(bits: int, kind: str, device=None) -> torch.Tensor:
    """Reconstruction value of each code ``0 .. 2**bits-1`` for a unit step.

    ``uniform``: symmetric integers ``code - qmax`` (``2**bits - 1`` levels used, as int4 in [-7, 7]);
    ``lloyd``: the ``2**bits`` Lloyd-Max levels of a unit Gaussian (the step is then the component's
    scale): one more level and non-uniform spacing, which matters most at 2 bits (4 levels, not 3).
    """
    if kind == "uniform":
        return torch.arange(1 << bits, dtype=torch.float32, device=device) - ((1 << (bits - 1)) - 1)
    if kind == "lloyd":
        from .lloyd_max import lloyd_max_centroids

        return lloyd_max_centroids(bits, device=device)
    raise ValueError(f"coefficient levels must be one of {COEFF_LEVELS}, got {kind!r}")


@functools.lru_cache(maxsize=32)
def _byte_level_table(bits: int, levels: str, device: str) -> torch.Tensor:
    """``[256, 8 // bits]``: the levels of the codes packed in each byte value (`pack_bits` order)."""
    return unit_levels(bits, levels, device)[byte_codes(bits, device)]


def _quantize_unit(z: torch.Tensor, bits: int, kind: str) -> torch.Tensor:
    """Codes of ``z`` (coefficients divided by their step) for `unit_levels`."""
    if kind == "uniform":
        qmax = (1 << (bits - 1)) - 1
        return torch.clamp(torch.round(z), -qmax, qmax).long() + qmax
    levels = unit_levels(bits, kind, z.device)
    bounds = (levels[1:] + levels[:-1]) / 2
    if bits > 4:
        return torch.bucketize(z.contiguous(), bounds)
    # Few boundaries: counting the ones below is faster than a binary search on CPU. uint8 codes (an
    # eighth of int64: they are packed next); callers that index with them must widen them first.
    codes = torch.zeros(z.shape, dtype=torch.uint8, device=z.device)
    for b in bounds.tolist():
        codes += z > b
    return codes


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
        cols = [self._run_levels(run, start, stop, dtype) for run in self.runs]
        if not cols:
            return torch.zeros(*self.lead_shape, stop - start, 0, dtype=dtype, device=self.mean.device)
        return torch.cat(cols, dim=-1) * self.coeff_step.to(dtype)

    def _run_levels(self, run, start: int, stop: int, dtype) -> torch.Tensor:
        bits, a, b, byte_a, byte_b = run
        rows = self.codes[..., start:stop, byte_a:byte_b]
        if 8 % bits == 0:  # one gather per byte: a table from byte value to its codes' levels
            return lookup_packed(rows, _byte_level_table(bits, self.levels, str(rows.device)).to(dtype), b - a)
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

    def _scaled_basis(self, dtype, columns: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(basis rows times their steps [r_kept, D], mean [D])`` as decoding uses them."""
        scaled, mean = _scaled_bases([self], dtype, columns)
        return scaled[0], mean[0]


def _scaled_bases(codes: list[PCACode], dtype, columns: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """For codes of one rank: ``(basis rows times their steps [C, r_kept, D], means [C, D])``, column
    scale multiplied back and columns in ``columns`` order, as the decoding tables use them."""
    def stack(field: str) -> torch.Tensor:
        return torch.stack([getattr(code, field) for code in codes]).to(dtype)

    scaled = (stack("basis_q") * stack("basis_scale")[:, None] * stack("coeff_step")[:, None]).transpose(1, 2)
    mean = stack("mean")
    if codes[0].column_scale is not None:
        column_scale = stack("column_scale")
        scaled, mean = scaled * column_scale[:, None], mean * column_scale
    if columns is not None:
        scaled, mean = scaled[..., columns], mean[:, columns]
    return scaled, mean


def _row_bound(scaled: torch.Tensor, mean: torch.Tensor, runs: list, levels: str) -> float:
    """Largest |value| any table entry or decoded row of these codes can take (``scaled [..., r, D]``,
    ``mean [..., D]``; levels are at most 2**7 in size)."""
    if scaled.shape[-2] == 0:
        return 0.0
    top_level = float(unit_levels(max((r[0] for r in runs), default=2), levels).abs().max())
    return float((mean.abs().amax(-1) + top_level * scaled.abs().sum(-2).amax(-1)).max())


class TableDecoder:
    """Decodes rows ``start:stop`` of one or more `PCACode` with the same rows and width at once:
    ``[..., codes, n, D]`` (e.g. the per-head key codes of one block, straight into head layout).

    Byte lookup tables instead of a product with the basis: each packed byte holds ``8/bits``
    codes, so its contribution to a row is one of 256 precomputed ``D``-vectors (the codes' levels
    times their scaled basis rows; the mean is folded into the first byte's table). A row is then one
    table row per byte, summed by ``embedding_bag``: ``bytes x D`` additions instead of ``r x D``
    multiply-adds and a per-code level lookup. The tables of all codes are built once, when the
    decoder is made, and one ``embedding_bag`` serves every code (rows with fewer bytes point their
    spare slots at a zero row). Runs whose codes straddle bytes (6 bits) use the product.

    ``columns`` (a permutation of ``0..D-1``) returns the columns in that order at no extra cost
    (e.g. RoPE pairs side by side, so the caller can rotate them as complex numbers).
    ``table_dtype`` (e.g. float16) keeps the tables narrower when no value can overflow it: the gathers
    then stream half the memory, and the rounding (about 1e-3 relative) is far below the codes' own.
    """

    def __init__(self, codes: list[PCACode], dtype=torch.float32, columns: torch.Tensor | None = None,
                 table_dtype: torch.dtype | None = None):
        self.codes, self.dtype = codes, dtype
        if _same_byte_layout(codes):
            bound = self._build_together(codes, dtype, columns)
        else:
            bound = self._build_each(codes, dtype, columns)
        # Narrower tables halve the memory the gathers stream through; only where no value can overflow.
        if table_dtype is not None and table_dtype != dtype and bound < torch.finfo(table_dtype).max / 2:
            self.tables = self.tables.to(table_dtype)

    def _build_together(self, codes: list[PCACode], dtype, columns: torch.Tensor | None) -> float:
        """Every code packs the same components in the same bytes (the usual case: the heads of one
        block): one product per run for all codes at once. Tables are run-major, ``[run][code][byte]``,
        so each run's product writes its rows in place. Returns the largest |value| a row can take."""
        device = codes[0].codes.device
        runs, count = codes[0].runs, codes[0].codes.shape[-1]
        scaled, mean = _scaled_bases(codes, dtype, columns)                       # [C, r, D], [C, D]
        width_d, n_codes = mean.shape[-1], len(codes)
        self._new_tables(256 * count * n_codes, width_d, dtype, device)
        offsets, row = [], 0
        for bits, a, b, ba, bb in runs:
            table = self.tables[row: row + 256 * (bb - ba) * n_codes].view(n_codes, bb - ba, 256, width_d)
            _byte_lookup_table(bits, codes[0].levels, scaled[:, a:b], out=table)
            offsets.append(row + 256 * torch.arange(n_codes * (bb - ba), device=device).view(n_codes, bb - ba))
            row += 256 * (bb - ba) * n_codes
        # each row takes exactly one entry of its first byte: the mean goes there
        self.tables[: 256 * (runs[0][4] - runs[0][3]) * n_codes].view(n_codes, -1, 256, width_d)[:, 0] += mean[:, None]
        self.offsets = list(torch.cat(offsets, dim=1).int())
        self.byte_cols = [None] * n_codes
        self.products = [(None, [])] * n_codes
        self.width = count
        return _row_bound(scaled, mean, runs, codes[0].levels)

    def _new_tables(self, rows: int, width: int, dtype, device) -> None:
        """One buffer every table is written into in place (the tables of a block are megabytes: no
        copies), plus a zero row at the end for the spare byte slots of codes with fewer bytes."""
        self.tables = torch.empty(rows + 1, width, dtype=dtype, device=device)
        self.tables[-1] = 0
        self.zero_row = rows

    def _build_each(self, codes: list[PCACode], dtype, columns: torch.Tensor | None) -> float:
        """Tables code by code (codes with different byte layouts); returns the largest |value|."""
        device = codes[0].codes.device
        aligned = [[run for run in code.runs if 8 % run[0] == 0] for code in codes]
        n_bytes = [sum(bb - ba for _, _, _, ba, bb in runs) for runs in aligned]
        width_d = codes[0].mean.shape[0]
        self._new_tables(256 * sum(n_bytes), width_d, dtype, device)
        self.offsets, self.byte_cols, self.products = [], [], []
        base, bound = 0, 0.0
        for code, runs, count in zip(codes, aligned, n_bytes):
            scaled, mean = code._scaled_basis(dtype, columns)
            bound = max(bound, _row_bound(scaled, mean, code.runs, code.levels))
            row = base
            for bits, a, b, ba, bb in runs:
                table = self.tables[row: row + 256 * (bb - ba)].view(bb - ba, 256, width_d)
                _byte_lookup_table(bits, code.levels, scaled[a:b], out=table)
                row += 256 * (bb - ba)
            if runs:
                self.tables[base: base + 256] += mean     # each row takes exactly one entry of its first byte
            cols = [torch.arange(ba, bb, device=device) for _, _, _, ba, bb in runs]
            cols = torch.cat(cols) if cols else torch.zeros(0, dtype=torch.long, device=device)
            self.byte_cols.append(None if count == code.codes.shape[-1] else cols)
            self.offsets.append((base + 256 * torch.arange(count, device=device)).int())
            base += 256 * count
            # What the tables cannot hold: the mean when no table takes it, and straddling runs.
            extra = [(run, scaled[run[1]:run[2]]) for run in code.runs if 8 % run[0]]
            self.products.append((None if runs else mean, extra))
        self.width = max(n_bytes)
        return bound

    def __call__(self, start: int, stop: int) -> torch.Tensor:
        if self.width == 0:   # no code has a byte-aligned run: means and products only
            code = self.codes[0]
            out = torch.zeros(*code.lead_shape, len(self.codes), stop - start, self.tables.shape[1],
                              dtype=self.dtype, device=self.tables.device)
            return self._add_products(out, start, stop)
        lead = self.codes[0].lead_shape
        # Table row of every byte: written straight into one int32 buffer (byte + its table's offset).
        index = torch.empty(*lead, len(self.codes), stop - start, self.width, dtype=torch.int32,
                            device=self.tables.device)
        for i, (code, cols, offsets) in enumerate(zip(self.codes, self.byte_cols, self.offsets)):
            rows = code.codes[..., start:stop, :]
            rows = rows if cols is None else rows[..., cols]
            torch.add(rows, offsets, out=index[..., i, :, : offsets.numel()])
            index[..., i, :, offsets.numel():] = self.zero_row
        out = torch.nn.functional.embedding_bag(index.reshape(-1, self.width), self.tables, mode="sum")
        return self._add_products(out.reshape(*index.shape[:-1], -1).to(self.dtype), start, stop)

    def _add_products(self, out: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        for i, (code, (mean, extra)) in enumerate(zip(self.codes, self.products)):
            if mean is None and not extra:
                continue
            part = out[..., i, :, :]
            if mean is not None:
                part += mean
            for run, scaled in extra:
                part += code._run_levels(run, start, stop, self.dtype) @ scaled
        return out


def _same_byte_layout(codes: list[PCACode]) -> bool:
    """Several codes with the same runs, all byte-aligned and covering every byte, and the same levels
    and column scaling (the heads of one block usually are): their tables can be built together."""
    first = codes[0]
    runs = first.runs
    return (len(codes) > 1 and bool(runs) and all(8 % r[0] == 0 for r in runs)
            and sum(r[4] - r[3] for r in runs) == first.codes.shape[-1]
            and all(c.runs == runs and c.levels == first.levels and c.codes.shape == first.codes.shape
                    and (c.column_scale is None) == (first.column_scale is None) for c in codes))


def _byte_lookup_table(bits: int, levels: str, rows: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[..., bytes, 256, D]``: for each byte position of a run's packed codes and each byte value, the
    sum of its codes' levels times their rows of ``rows`` (``[..., components, D]``, scaled basis)."""
    per = 8 // bits
    n_bytes = -(-rows.shape[-2] // per)
    pad = n_bytes * per - rows.shape[-2]
    if pad:  # codes past the last component are zero bits in the byte; give them zero rows
        rows = torch.cat([rows, rows.new_zeros(*rows.shape[:-2], pad, rows.shape[-1])], dim=-2)
    levels_of_byte = _byte_level_table(bits, levels, str(rows.device)).to(rows.dtype)   # [256, per]
    return torch.matmul(levels_of_byte, rows.reshape(*rows.shape[:-2], n_bytes, per, rows.shape[-1]), out=out)


@dataclass
class SlotPlan:
    """How to decode the rows of several `PCACode` (one per scope, same rows) slot by slot: row ``t`` of
    scope ``s`` is ``mean[s] + sum_k tables[row[s, k] + value_k(t)]``, where slot ``k`` is ``bits[s, k]``
    bits at bit ``shift[s, k]`` of byte ``byte[s, k]`` of the row's packed codes: a whole byte of a
    byte-aligned run (its 256 table rows are the levels of its codes times their basis rows, as in
    `TableDecoder`), or one code of a run that straddles bytes (``2**bits`` rows).

    Depends only on the codes' run layout (a few hundred integers); the tables themselves are refilled
    from the bases when needed (`fill_slot_tables`), so nothing large stays resident."""

    slots: tuple  # (byte, shift, bits, row) int32 numpy [S, max_slots], then the slot counts [S]
    jobs: object  # int32 numpy [J, 7]: (scope, component, components, bits, codes per entry, row, level offset)
    levels: object  # float32 numpy: the unit levels of every width used, concatenated
    rows: int  # table rows in all
    columns: torch.Tensor | None  # column order of the decoded rows

    def nbytes(self) -> int:
        arrays = [*self.slots, self.jobs, self.levels]
        return sum(a.nbytes for a in arrays) + (0 if self.columns is None else self.columns.numel() * 8)


def slot_plan(codes: list[PCACode], columns: torch.Tensor | None = None, slot_bits: int = 8) -> SlotPlan:
    """The `SlotPlan` of ``codes`` (decoded columns in ``columns`` order). Runs whose width divides
    ``slot_bits`` (4 or 8) read ``slot_bits`` bits per slot (several codes: ``2**slot_bits`` table rows);
    the others one code per slot."""
    import numpy as np

    if slot_bits not in (4, 8):
        raise ValueError(f"slot_bits must be 4 or 8, got {slot_bits}")
    levels, level_at = [], {}
    slots, jobs, row = [[] for _ in codes], [], 0
    for i, code in enumerate(codes):
        for bits, a, b, byte_a, _ in code.runs:
            if bits not in level_at:
                level_at[bits] = sum(len(x) for x in levels)
                levels.append(unit_levels(bits, code.levels).tolist())
            per = slot_bits // bits if slot_bits % bits == 0 else 1
            for first in range(a, b, per):
                offset = (first - a) * bits
                slots[i].append((byte_a + offset // 8, offset % 8, bits * per, row))
                jobs.append((i, first, min(per, b - first), bits, per, row, level_at[bits]))
                row += 1 << (bits * per)
    count = max(1, max(len(s) for s in slots))
    table = np.zeros((4, len(codes), count), np.int32)
    for i, code_slots in enumerate(slots):
        if code_slots:
            table[:, i, :len(code_slots)] = np.array(code_slots, np.int32).T
    counts = np.array([len(s) for s in slots], np.int32)
    return SlotPlan(tuple(np.ascontiguousarray(t) for t in table) + (counts,),
                    np.array(jobs, np.int32).reshape(-1, 7), np.array([v for x in levels for v in x], np.float32),
                    row, columns)


def scaled_bases(codes: list[PCACode], columns: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(basis rows times their steps [C, r_max, D], means [C, D])`` of codes of any ranks (zero
    rows past a code's rank), columns in ``columns`` order, column scale multiplied back."""
    if all(c.rank == codes[0].rank and (c.column_scale is None) == (codes[0].column_scale is None) for c in codes):
        return _scaled_bases(codes, torch.float32, columns)
    pairs = [code._scaled_basis(torch.float32, columns) for code in codes]
    rank = max(p[0].shape[0] for p in pairs)
    scaled = torch.stack([torch.nn.functional.pad(p[0], (0, 0, 0, rank - p[0].shape[0])) for p in pairs])
    return scaled, torch.stack([p[1] for p in pairs])


def _best_steps(coeffs: torch.Tensor, base_step: torch.Tensor, bits: int, levels: str,
                sample: int = 1024) -> torch.Tensor:
    """Per component, the multiple of ``base_step`` with the least squared error on a row sample."""
    rows = coeffs.reshape(-1, coeffs.shape[-1])
    if rows.shape[0] > sample:
        rows = rows[torch.linspace(0, rows.shape[0] - 1, sample, device=rows.device).long()]
    mults = torch.tensor(_SCALE_MULTIPLIERS, device=rows.device, dtype=rows.dtype)
    steps = base_step.unsqueeze(0) * mults.unsqueeze(1)  # [M, r]
    table = unit_levels(bits, levels, rows.device)
    # One multiplier at a time: a sample-sized temporary rather than M of them.
    err = torch.stack([(rows - table[_quantize_unit(rows / step, bits, levels).long()] * step).pow(2).sum(0)
                       for step in steps])  # [M, r]
    return steps.gather(0, err.argmin(0, keepdim=True)).squeeze(0)


def encode_pca(x: torch.Tensor, fit: PCAFit, bits_per_component: list[int] | torch.Tensor,
               fit_rows: torch.Tensor | None = None, levels: str = "uniform",
               column_scale: torch.Tensor | None = None) -> PCACode:
    """Code rows ``x`` ``[..., N, D]`` with ``fit``; component ``i`` gets ``bits_per_component[i]``
    bits (0 = dropped). ``fit_rows`` (bool ``[..., N]``) marks the rows used to choose the steps
    (e.g. excluding padding); default all. ``levels``: see `unit_levels`.

    ``column_scale`` (``[D]``, stored in fp16): ``x`` (and ``fit``) are rows already divided by it
    column by column (a weighting of the columns' errors); decoding multiplies it back."""
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
    coeffs = (x.float() - mean16.float()) @ deq
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
        steps[start:stop] = _best_steps(sample.reshape(-1, coeffs.shape[-1])[:, start:stop], base, b, levels) \
            if sample.numel() else base
        step16 = steps[start:stop].to(torch.float16).float()
        steps[start:stop] = step16
        q = _quantize_unit(coeffs[..., start:stop] / step16, b, levels)
        packed.append(pack_bits(q, b))
        runs.append((b, start, stop, n_bytes, n_bytes + packed[-1].shape[-1]))
        n_bytes = runs[-1][-1]
        start = stop
    codes = torch.cat(packed, dim=-1) if packed else \
        torch.zeros(*x.shape[:-1], 0, dtype=torch.uint8, device=x.device)
    return PCACode(mean=mean16, basis_q=basis_q, basis_scale=basis_scale, coeff_step=steps.to(torch.float16),
                   codes=codes, runs=runs, levels=levels, n=x.shape[-2], lead_shape=tuple(x.shape[:-2]),
                   column_scale=None if column_scale is None else column_scale.to(torch.float16))
