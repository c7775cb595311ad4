"""Fast decoding of `PCACode` rows: byte lookup tables summed by ``embedding_bag`` (`TableDecoder`),
and the run layout the fused kernel decodes slot by slot (`SlotPlan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .scalar_levels import byte_level_table, unit_levels

if TYPE_CHECKING:
    from .pca import PCACode


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


def _scaled_basis(code: PCACode, dtype, columns: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(basis rows times their steps [r_kept, D], mean [D])`` of one code as decoding uses them."""
    scaled, mean = _scaled_bases([code], dtype, columns)
    return scaled[0], mean[0]


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
                 table_dtype: torch.dtype | None = None, bound: float | None = None):
        self.codes, self.dtype = codes, dtype
        # the bound only serves the choice of table dtype: a caller that keeps it (`bound`, a float that
        # depends only on the codes) spares the next decoder of the same codes its ops and host sync
        self._need_bound = table_dtype is not None and table_dtype != dtype and bound is None
        if _same_byte_layout(codes):
            found = self._build_together(codes, dtype, columns)
        else:
            found = self._build_each(codes, dtype, columns)
        self.bound = found if bound is None else bound
        # Narrower tables halve the memory the gathers stream through; only where no value can overflow.
        if table_dtype is not None and table_dtype != dtype and self.bound < torch.finfo(table_dtype).max / 2:
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
        return _row_bound(scaled, mean, runs, codes[0].levels) if self._need_bound else None

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
            scaled, mean = _scaled_basis(code, dtype, columns)
            if self._need_bound:
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
                part += code.run_levels(run, start, stop, self.dtype) @ scaled
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
    levels_of_byte = byte_level_table(bits, levels, str(rows.device)).to(rows.dtype)   # [256, per]
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
    pairs = [_scaled_basis(code, torch.float32, columns) for code in codes]
    rank = max(p[0].shape[0] for p in pairs)
    scaled = torch.stack([torch.nn.functional.pad(p[0], (0, 0, 0, rank - p[0].shape[0])) for p in pairs])
    return scaled, torch.stack([p[1] for p in pairs])
