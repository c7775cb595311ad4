"""Triton kernels for Shard's compressed middle: `code_attention`, the GPU twin of
`kvshrink.kernels.cpu.block_attention.code_attention` (same inputs, same outputs, so the layer calls either).

One block of coded tokens is answered in two kernels, without materialising the block's keys or values:

1. `_scores_kernel`, grid ``(B * H_kv, token tiles)``: for a tile of tokens of one KV head, each PCA
   coefficient is read from the packed key codes (bit offset, width and level table of every component
   come from a `ComponentPlan`, precomputed once per block as device tensors), turned into its level, and
   the tile's pre-RoPE keys are ``mean + coefficients @ scaled basis`` (one ``tl.dot`` per chunk of
   components, even and odd RoPE channels apart), the basis scaled in the kernel from the block's stored
   int8 basis and its per-row steps (`KeyBasis`: no scaled copy kept or rebuilt per step); RoPE is one
   complex product per pair; held (salient) rows, given as bits, are set to ``-inf``; the scores against
   the grouped queries (row tiles, any number of rows) are written out ``[B, H_kv, R, n]`` (float32:
   scores, not keys).
2. `_bins_kernel`, grid ``(B * H_kv, value group tiles, row tiles)``: the rows' log-sum-exp (a pass over
   their scores), then the softmax probabilities ``exp(score - lse)`` summed per value codeword of each
   group: one ``tl.dot`` of the probability tile with the one-hot of the tile's codes (a few groups side
   by side, up to 256 columns), accumulated over the tokens in the program (no atomics: the same result
   on every run).

The decode stream (tokens that left the window while decoding, TurboQuant codes) has its own two kernels,
`turbo_attention`: scores straight from the codes against the rotated queries (QJL sketch term included),
then the log-sum-exp and the probabilities times the norms summed against the codes' centroids, the
queries rotated in the first kernel (decode-sized rows; more rows are rotated once in torch) and the
sums unrotated in the second; `turbo_encode_into` encodes the tokens leaving the window in one more
kernel, into the stream's buffer.

Everything accumulates in float32 (``tl.dot`` with ``input_precision="ieee"``, no TF32); codes, bases and
queries may be float16/bfloat16/float32. Triton is imported through `kvshrink.kernels.backend.triton`
(interpreted on CPU tensors when no GPU exists), so this module is only imported on the GPU path.
The kernels call only Triton builtins (``tl.full``, not the ``@jit`` helpers such as ``tl.zeros``): torch
imports Triton before kvshrink can choose the interpreter, and the helpers decorated then cannot be
called from an interpreted kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvshrink.codecs.pca import stack_fields
from kvshrink.kernels import counting
from kvshrink.kernels.backend import triton as _load_triton

triton = _load_triton()     # the backend chose interpreter or GPU before (or despite) the import
tl = triton.language

__all__ = ["ComponentPlan", "component_plan", "KeyBasis", "paired_basis", "stored_basis", "BlockInputs", "held_bits",
           "block_attention", "code_attention", "code_scores", "code_bins", "code_values", "turbo_encode_into", "Tiles",
           "GPU_TILES"]


@dataclass(frozen=True)
class Tiles:
    """Tile sizes (powers of two, >= 16 for ``tl.dot``): tokens per program / per step of the bins kernel,
    PCA components per dot, query rows per dot, and one-hot columns per bins program (value groups x
    codewords). They change the work per program, never the result."""

    n: int = 32
    k: int = 32
    r: int = 16
    bin_columns: int = 256


GPU_TILES = Tiles()
# The interpreter pays per operation, not per element: big tiles, few programs (tests run in seconds).
INTERPRETER_TILES = Tiles(n=128, k=128, r=16, bin_columns=8192)


def default_tiles() -> Tiles:
    from kvshrink.kernels.backend import interpreting

    return INTERPRETER_TILES if interpreting() else GPU_TILES


@dataclass
class ComponentPlan:
    """Where each PCA component's code lies in a row of packed key codes, per scope, as device tensors
    ``[S, r]`` int32: ``bit`` (bit offset in the row), ``bits`` (width; 0: the component was dropped,
    its coefficient is 0), ``level`` (offset of its width's unit levels in ``levels``); ``levels``
    float32. Derived from a `codecs.table_decoder.SlotPlan` (a few hundred integers per block)."""

    bit: torch.Tensor
    bits: torch.Tensor
    level: torch.Tensor
    levels: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.bit, self.bits, self.level, self.levels))


def component_plan(plan, rank: int, device) -> ComponentPlan:
    """The `ComponentPlan` of a `SlotPlan` whose scopes have at most ``rank`` components (the rows of
    the scaled bases). Built on the host from the plan's numpy arrays, copied once to ``device``."""
    import numpy as np

    byte, shift, _, row, counts = plan.slots
    n_scopes = len(counts)
    at_row = {}
    for s in range(n_scopes):
        for k in range(int(counts[s])):
            at_row[(s, int(row[s, k]))] = int(byte[s, k]) * 8 + int(shift[s, k])
    bit = np.zeros((n_scopes, max(1, rank)), np.int32)
    bits = np.zeros_like(bit)
    level = np.zeros_like(bit)
    for scope, first, real, width, _, slot_row, level_at in np.asarray(plan.jobs).reshape(-1, 7).tolist():
        start = at_row[(scope, slot_row)]
        for m in range(real):
            bit[scope, first + m] = start + m * width
            bits[scope, first + m] = width
            level[scope, first + m] = level_at
    levels = np.asarray(plan.levels, np.float32)
    if levels.size == 0:
        levels = np.zeros(1, np.float32)
    return ComponentPlan(*(torch.from_numpy(a).to(device) for a in (bit, bits, level, levels)))


def _pow2(x: int, low: int = 16) -> int:
    return max(low, triton.next_power_of_2(max(1, x)))


@triton.jit
def _scores_kernel(codes_ptr, bit_ptr, bits_ptr, level_ptr, levels_ptr, basis_ptr, row_a_ptr, row_b_ptr,
                   col_scale_ptr, mean_ptr, held_ptr, cos_ptr, sin_ptr, q_ptr, out_ptr, scaling, n, n_bytes, rank,
                   width, heads, rows, heads_per_scope, n_scopes, basis_scope_stride, basis_k_stride,
                   basis_col_stride, odd_offset, held_bytes, HEAD_DIM: tl.constexpr, HALF: tl.constexpr,
                   PAIR_STEP: tl.constexpr, COL_SCALE: tl.constexpr, HELD: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    pid_bh = tl.program_id(0)
    pid_n = tl.program_id(1)
    b = pid_bh // heads
    h = pid_bh % heads
    s = h // heads_per_scope
    col0 = (h % heads_per_scope) * HEAD_DIM     # this head's columns in its scope's rows
    half = HEAD_DIM // 2

    offs_t = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < n
    offs_p = tl.arange(0, HALF)
    p_ok = offs_p < half
    # channel of each RoPE pair's even and odd half, in the basis columns and the queries alike
    ch_e = PAIR_STEP * offs_p
    ch_o = ch_e + odd_offset
    even = col0 + ch_e
    odd = col0 + ch_o

    # pre-RoPE keys of the tile, even and odd channels of each RoPE pair apart, starting at the mean
    mean_e = tl.load(mean_ptr + s * width + even, mask=p_ok, other=0.0).to(tl.float32)
    mean_o = tl.load(mean_ptr + s * width + odd, mask=p_ok, other=0.0).to(tl.float32)
    if COL_SCALE:
        cs_e = tl.load(col_scale_ptr + s * width + even, mask=p_ok, other=0.0).to(tl.float32)
        cs_o = tl.load(col_scale_ptr + s * width + odd, mask=p_ok, other=0.0).to(tl.float32)
        mean_e = mean_e * cs_e
        mean_o = mean_o * cs_o
    k_e = tl.full((BLOCK_N, HALF), 0.0, tl.float32) + mean_e[None, :]
    k_o = tl.full((BLOCK_N, HALF), 0.0, tl.float32) + mean_o[None, :]

    row_codes = codes_ptr + ((b * n_scopes + s) * n + offs_t) * n_bytes        # [BLOCK_N] row starts
    for k0 in range(0, rank, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < rank
        at = tl.load(bit_ptr + s * rank + offs_k, mask=k_ok, other=0)
        nb = tl.load(bits_ptr + s * rank + offs_k, mask=k_ok, other=0)
        lv = tl.load(level_ptr + s * rank + offs_k, mask=k_ok, other=0)
        byte = at >> 3
        shift = at & 7
        live = t_ok[:, None] & (k_ok & (nb > 0))[None, :]
        lo = tl.load(row_codes[:, None] + byte[None, :], mask=live, other=0).to(tl.int32)
        two = live & ((shift + nb) > 8)[None, :]                                 # the code straddles bytes
        hi = tl.load(row_codes[:, None] + byte[None, :] + 1, mask=two, other=0).to(tl.int32)
        value = ((lo | (hi << 8)) >> shift[None, :]) & ((1 << nb[None, :]) - 1)
        coeff = tl.load(levels_ptr + lv[None, :] + value, mask=live, other=0.0)      # [BLOCK_N, BLOCK_K]
        # each basis row times its two steps, in the order the torch path multiplies them (same floats)
        a = tl.load(row_a_ptr + s * rank + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        a2 = tl.load(row_b_ptr + s * rank + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        basis = basis_ptr + s * basis_scope_stride + offs_k[:, None] * basis_k_stride
        b_ok = k_ok[:, None] & p_ok[None, :]
        basis_e = tl.load(basis + even[None, :] * basis_col_stride, mask=b_ok, other=0.0).to(tl.float32)
        basis_o = tl.load(basis + odd[None, :] * basis_col_stride, mask=b_ok, other=0.0).to(tl.float32)
        basis_e = basis_e * a[:, None] * a2[:, None]                                  # [BLOCK_K, HALF]
        basis_o = basis_o * a[:, None] * a2[:, None]
        if COL_SCALE:
            basis_e = basis_e * cs_e[None, :]
            basis_o = basis_o * cs_o[None, :]
        k_e = tl.dot(coeff, basis_e, k_e, input_precision="ieee")
        k_o = tl.dot(coeff, basis_o, k_o, input_precision="ieee")

    # RoPE: each pair times cos + i sin of its token
    rope_at = (b * n + offs_t[:, None]) * half + offs_p[None, :]
    rope_ok = t_ok[:, None] & p_ok[None, :]
    c = tl.load(cos_ptr + rope_at, mask=rope_ok, other=0.0).to(tl.float32)
    sn = tl.load(sin_ptr + rope_at, mask=rope_ok, other=0.0).to(tl.float32)
    re = k_e * c - k_o * sn
    im = k_e * sn + k_o * c
    if HELD:   # rows held exact elsewhere (salient): their codes are not attended
        bit = tl.load(held_ptr + pid_bh * held_bytes + (offs_t >> 3), mask=t_ok, other=0).to(tl.int32)
        held = ((bit >> (offs_t & 7)) & 1) != 0

    for r0 in range(0, rows, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_ok = offs_r < rows
        q_at = q_ptr + (pid_bh * rows + offs_r[:, None]) * HEAD_DIM
        q_ok = r_ok[:, None] & p_ok[None, :]
        q_e = tl.load(q_at + ch_e[None, :], mask=q_ok, other=0.0).to(tl.float32)
        q_o = tl.load(q_at + ch_o[None, :], mask=q_ok, other=0.0).to(tl.float32)
        sc = tl.dot(q_e, tl.trans(re), input_precision="ieee")
        sc = tl.dot(q_o, tl.trans(im), sc, input_precision="ieee") * scaling          # [BLOCK_R, BLOCK_N]
        if HELD:
            sc = tl.where(held[None, :], float("-inf"), sc)
        tl.store(out_ptr + (pid_bh * rows + offs_r[:, None]) * n + offs_t[None, :], sc,
                 mask=r_ok[:, None] & t_ok[None, :])


@triton.jit
def _rows_lse(scores_ptr, row0, offs_r, r_ok, n, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """Log-sum-exp ``[BLOCK_R]`` of score rows ``row0 + offs_r`` (``n`` each; -inf where all are -inf):
    the maximum first, then the sum of the shifted exponentials, as ``torch.logsumexp``."""
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    for t0 in range(0, n, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        sc = tl.load(scores_ptr + (row0 + offs_r[:, None]) * n + offs_t[None, :],
                     mask=r_ok[:, None] & (offs_t < n)[None, :], other=float("-inf"))
        top = tl.maximum(top, tl.max(sc, 1))
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.full((BLOCK_R,), 0.0, tl.float32)
    for t0 in range(0, n, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        sc = tl.load(scores_ptr + (row0 + offs_r[:, None]) * n + offs_t[None, :],
                     mask=r_ok[:, None] & (offs_t < n)[None, :], other=float("-inf"))
        total += tl.sum(tl.exp(sc - top[:, None]), 1)
    # no log of 0 (a row of -inf, or a row past the rows): -inf directly
    return tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf"))


@triton.jit
def _bins_kernel(scores_ptr, lse_ptr, vcodes_ptr, bins_ptr, n, v_bytes, rows, n_groups,
                 V_BITS: tl.constexpr, ENTRIES: tl.constexpr, ENTRIES_P: tl.constexpr, GROUPS: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # GROUPS value groups per program: their one-hots side by side, one dot of GROUPS * ENTRIES_P columns
    pid_bh = tl.program_id(0)
    g0 = tl.program_id(1) * GROUPS
    pid_r = tl.program_id(2)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    # every program of a row tile finds its log-sum-exp (a pass over the scores, no extra launch); the
    # first group tile writes it
    lse = _rows_lse(scores_ptr, pid_bh * rows, offs_r, r_ok, n, BLOCK_N, BLOCK_R)
    if g0 == 0:
        tl.store(lse_ptr + pid_bh * rows + offs_r, lse, mask=r_ok)
    # a row whose tokens are all held exact elsewhere has lse -inf: its probabilities are zeros
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    offs_g = g0 + tl.arange(0, GROUPS)
    g_ok = offs_g < n_groups
    bit = offs_g * V_BITS
    at = bit >> 3
    shift = bit & 7
    entry = tl.arange(0, ENTRIES_P)
    acc = tl.full((BLOCK_R, GROUPS * ENTRIES_P), 0.0, tl.float32)
    for t0 in range(0, n, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < n
        ok = r_ok[:, None] & t_ok[None, :]
        sc = tl.load(scores_ptr + (pid_bh * rows + offs_r[:, None]) * n + offs_t[None, :], mask=ok,
                     other=float("-inf"))
        prob = tl.exp(sc - lse[:, None])                                                 # 0 where masked
        row = vcodes_ptr + (pid_bh * n + offs_t[:, None]) * v_bytes + at[None, :]       # [BLOCK_N, GROUPS]
        live = t_ok[:, None] & g_ok[None, :]
        lo = tl.load(row, mask=live, other=0).to(tl.int32)
        hi = tl.load(row + 1, mask=live & ((shift + V_BITS) > 8)[None, :], other=0).to(tl.int32)
        code = ((lo | (hi << 8)) >> shift[None, :]) & (ENTRIES - 1)
        one_hot = (code[:, :, None] == entry[None, None, :]).to(tl.float32)             # [BLOCK_N, GROUPS, E]
        acc = tl.dot(prob, tl.reshape(one_hot, (BLOCK_N, GROUPS * ENTRIES_P)), acc, input_precision="ieee")
    col = tl.arange(0, GROUPS * ENTRIES_P)
    g = g0 + col // ENTRIES_P
    e = col % ENTRIES_P
    tl.store(bins_ptr + (pid_bh * rows + offs_r[:, None]) * (n_groups * ENTRIES) + (g * ENTRIES + e)[None, :],
             acc, mask=r_ok[:, None] & ((g < n_groups) & (e < ENTRIES))[None, :])


@triton.jit
def _values_kernel(bins_ptr, codebook_ptr, scale_ptr, mean_ptr, rot_ptr, out_ptr, rows, n_bins, head_dim, heads,
                   rot_row_stride, rot_col_stride, ENTRIES: tl.constexpr, GROUP: tl.constexpr, DP: tl.constexpr,
                   BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr, HAS_MEAN: tl.constexpr):
    # out = unrotate((bins per group @ codebook) * scale) + mean: the per-group products as one dot with the
    # block-diagonal codebook (bin j = group g, codeword k feeds channels g*GROUP ..), built per chunk; the
    # mean the values were coded less of is added once (a row's probabilities sum to one)
    pid_bh = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    offs_c = tl.arange(0, DP)
    c_ok = offs_c < head_dim
    acc = tl.full((BLOCK_R, DP), 0.0, tl.float32)
    for j0 in range(0, n_bins, BLOCK_J):
        offs_j = j0 + tl.arange(0, BLOCK_J)
        j_ok = offs_j < n_bins
        b = tl.load(bins_ptr + (pid_bh * rows + offs_r[:, None]) * n_bins + offs_j[None, :],
                    mask=r_ok[:, None] & j_ok[None, :], other=0.0)
        mine = j_ok[:, None] & c_ok[None, :] & ((offs_j // ENTRIES)[:, None] == (offs_c // GROUP)[None, :])
        cb = tl.load(codebook_ptr + (offs_j % ENTRIES)[:, None] * GROUP + (offs_c % GROUP)[None, :], mask=mine,
                     other=0.0).to(tl.float32)
        acc = tl.dot(b, cb, acc, input_precision="ieee")
    scale = tl.load(scale_ptr + (pid_bh % heads) * head_dim + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    rot = _square(rot_ptr, offs_c, c_ok, rot_row_stride, rot_col_stride)
    out = tl.dot(acc * scale[None, :], tl.trans(rot), input_precision="ieee")
    if HAS_MEAN:
        out += tl.load(mean_ptr + (pid_bh % heads) * head_dim + offs_c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + (pid_bh * rows + offs_r[:, None]) * head_dim + offs_c[None, :], out,
             mask=r_ok[:, None] & c_ok[None, :])


def code_values(bins: torch.Tensor, codebook: torch.Tensor, scale: torch.Tensor, rotation: torch.Tensor,
                tiles: Tiles | None = None, mean: torch.Tensor | None = None) -> torch.Tensor:
    """Attention output ``[B, H_kv, R, d]`` float32 from ``bins [B, H_kv, R, groups * entries]`` (see
    `code_bins`) in one launch: summed against the value ``codebook [entries, group]``, times the block's
    ``scale [H_kv, d]``, unrotated by ``rotation [d, d]`` (``out = x @ rotation.T``), plus the ``mean [H_kv, d]``
    the values were coded less of (None: none), as the layer's `middle_values` does in a few ops."""
    batch, heads, rows, n_bins = bins.shape
    entries, group = codebook.shape
    head_dim = scale.shape[-1]
    out = torch.empty(batch, heads, rows, head_dim, dtype=torch.float32, device=bins.device)
    if rows == 0:
        return out
    tiles = tiles or default_tiles()
    with counting.kernel_launch("shard_values"):
        _values_kernel[(batch * heads, triton.cdiv(rows, tiles.r))](
            bins.contiguous(), codebook.contiguous(), scale.contiguous(), scale if mean is None else mean.contiguous(),
            rotation, out, rows, n_bins, head_dim, heads, *rotation.stride(), ENTRIES=entries, GROUP=group,
            DP=_pow2(head_dim), BLOCK_J=128, BLOCK_R=tiles.r, HAS_MEAN=mean is not None)
    return out


@dataclass
class KeyBasis:
    """A block's key basis as `_scores_kernel` reads it: ``basis`` (any dtype) addressed as ``[scope,
    component, column]`` by ``strides``, each component times ``row_a`` then ``row_b`` ``[S, r]`` and each
    column times ``column_scale [S, W]`` (None: 1), as `codecs.table_decoder.scaled_bases` multiplies
    them; ``mean [S, W]`` (times the column scale too). ``paired``: columns and the queries' channels in
    RoPE `pair_order`, else in the model's order."""

    basis: torch.Tensor
    strides: tuple[int, int, int]
    row_a: torch.Tensor
    row_b: torch.Tensor
    column_scale: torch.Tensor | None
    mean: torch.Tensor
    paired: bool

    @property
    def rank(self) -> int:
        return self.row_a.shape[1]

    def nbytes(self) -> int:
        """Bytes of the tensors made for the kernel (``basis`` is a view of the block's own)."""
        made = (self.row_a, self.row_b, self.column_scale, self.mean)
        return sum(t.numel() * t.element_size() for t in made if t is not None)


def paired_basis(scaled: torch.Tensor, mean: torch.Tensor) -> KeyBasis:
    """The `KeyBasis` of bases already scaled (`scaled_bases` ``[S, r, W]``, columns in pair order)."""
    if scaled.shape[1] == 0:   # no component kept: the keys are the means
        scaled = torch.zeros(scaled.shape[0], 1, scaled.shape[2], dtype=torch.float32, device=scaled.device)
    ones = torch.ones(scaled.shape[:2], dtype=torch.float32, device=scaled.device)
    return KeyBasis(scaled, tuple(scaled.stride()), ones, ones, None, mean.contiguous(), paired=True)


def stored_basis(codes: list, basis_q: torch.Tensor) -> KeyBasis:
    """The `KeyBasis` of a block's PCA scopes ``codes`` read where they are stored: the int8 bases stacked
    ``basis_q [S, W, r]`` (`segments.stack_scopes`), columns in the model's order; their small per-row
    and per-column factors stacked once (zero past a scope's rank)."""
    rank = max(1, basis_q.shape[2])
    if basis_q.shape[2] == 0:
        basis_q = torch.zeros(basis_q.shape[0], basis_q.shape[1], 1, dtype=torch.int8, device=basis_q.device)
    scope, column, component = basis_q.stride()
    width = basis_q.shape[1]
    column_scale = None if codes[0].column_scale is None else stack_fields(codes, "column_scale", width)
    return KeyBasis(basis_q, (scope, component, column), stack_fields(codes, "basis_scale", rank),
                    stack_fields(codes, "coeff_step", rank), column_scale, stack_fields(codes, "mean", width),
                    paired=False)


@dataclass
class BlockInputs:
    """What `block_attention` reads of one middle block, prepared once per block (kept on it, see
    `segments.BlockDerived`): the stacked key codes ``[B, S, n, bytes]`` (a view of the block's), their
    `ComponentPlan` and `KeyBasis`, the held rows as bits ``[B, H_kv, ceil(n/8)]`` (None: none), the value
    codes and their width, and the value codebook, scales and mean (None: the values were not centred) in
    float32."""

    codes: torch.Tensor
    plan: ComponentPlan
    basis: KeyBasis
    held: torch.Tensor | None
    v_codes: torch.Tensor
    v_bits: int
    n_groups: int
    codebook: torch.Tensor
    v_scale: torch.Tensor
    v_mean: torch.Tensor | None = None

    def nbytes(self) -> int:
        """Bytes made for the kernels (the codes are the block's own)."""
        made = [self.held, self.codebook, self.v_scale, self.v_mean]
        return self.plan.nbytes() + self.basis.nbytes() + sum(t.numel() * t.element_size()
                                                              for t in made if t is not None)


def held_bits(hidden: torch.Tensor, n: int) -> torch.Tensor:
    """Block rows ``hidden [B, H_kv, m]`` as packed bits ``[B, H_kv, ceil(n/8)]`` (bit ``t % 8`` of byte
    ``t // 8`` set when row ``t`` is held), what `_scores_kernel` masks."""
    from kvshrink.codecs.bitpack import pack_bits

    mask = torch.zeros(*hidden.shape[:2], n, dtype=torch.uint8, device=hidden.device)
    return pack_bits(mask.scatter_(2, hidden.long(), 1), 1)


def code_scores(codes: torch.Tensor, plan: ComponentPlan, basis: KeyBasis, cos: torch.Tensor, sin: torch.Tensor,
                query: torch.Tensor, scaling: float, held: torch.Tensor | None = None,
                tiles: Tiles | None = None) -> torch.Tensor:
    """Scaled scores ``[B, H_kv, R, n]`` float32 of grouped ``query [B, H_kv, R, d]`` (channels in the
    basis's order) against the block's keys rebuilt from ``codes [B, S, n, bytes]``, ``-inf`` at the
    ``held`` rows (see `code_attention`)."""
    batch, heads, rows, head_dim = query.shape
    n_scopes, n, n_bytes = codes.shape[1], codes.shape[2], codes.shape[3]
    width = basis.mean.shape[1]
    out = torch.empty(batch, heads, rows, n, dtype=torch.float32, device=query.device)
    if n == 0 or rows == 0:
        return out
    tiles = tiles or default_tiles()
    grid = (batch * heads, triton.cdiv(n, tiles.n))
    column_scale = basis.mean if basis.column_scale is None else basis.column_scale
    held_at = codes if held is None else held
    with counting.kernel_launch("shard_scores"):
        _scores_kernel[grid](codes.contiguous(), plan.bit, plan.bits, plan.level, plan.levels, basis.basis,
                             basis.row_a, basis.row_b, column_scale, basis.mean, held_at, cos.contiguous(),
                             sin.contiguous(), query.contiguous(), out, float(scaling), n, n_bytes, basis.rank,
                             width, heads, rows, heads // n_scopes, n_scopes, *basis.strides,
                             1 if basis.paired else head_dim // 2, held_at.shape[-1],
                             HEAD_DIM=head_dim, HALF=_pow2(head_dim // 2), PAIR_STEP=2 if basis.paired else 1,
                             COL_SCALE=basis.column_scale is not None, HELD=held is not None,
                             BLOCK_N=tiles.n, BLOCK_K=tiles.k, BLOCK_R=tiles.r)
    return out


def code_bins(scores: torch.Tensor, v_codes: torch.Tensor, v_bits: int, n_groups: int,
              tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(bins [B, H_kv, R, n_groups * 2**v_bits], lse [B, H_kv, R])``: the softmax probabilities of
    ``scores`` summed per value group and codeword, and the scores' log-sum-exp (``-inf`` for a fully
    masked row, whose bins are zeros)."""
    batch, heads, rows, n = scores.shape
    entries = 1 << v_bits
    if n == 0 or rows == 0:
        return (torch.zeros(batch, heads, rows, n_groups * entries, dtype=torch.float32, device=scores.device),
                torch.full((batch, heads, rows), float("-inf"), dtype=torch.float32, device=scores.device))
    # the kernel writes every element of both (no fill launched)
    bins = torch.empty(batch, heads, rows, n_groups * entries, dtype=torch.float32, device=scores.device)
    lse = torch.empty(batch, heads, rows, dtype=torch.float32, device=scores.device)
    tiles = tiles or default_tiles()
    entries_p = _pow2(entries)
    groups = min(triton.next_power_of_2(n_groups), max(1, tiles.bin_columns // entries_p))
    grid = (batch * heads, triton.cdiv(n_groups, groups), triton.cdiv(rows, tiles.r))
    with counting.kernel_launch("shard_bins"):
        _bins_kernel[grid](scores.contiguous(), lse, v_codes.contiguous(), bins, n, v_codes.shape[-1],
                           rows, n_groups, V_BITS=v_bits, ENTRIES=entries, ENTRIES_P=entries_p, GROUPS=groups,
                           BLOCK_N=tiles.n, BLOCK_R=tiles.r)
    return bins, lse


def block_attention(inputs: BlockInputs, cos: torch.Tensor, sin: torch.Tensor, query: torch.Tensor,
                    scaling: float, rotation: torch.Tensor,
                    tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out [B, H_kv, R, d], lse [B, H_kv, R])`` float32 of grouped ``query [B, H_kv, R, d]`` (the
    model's channel order) over one block prepared as `BlockInputs`, its values rotated by ``rotation``:
    three kernels (scores, bins, values), nothing else launched."""
    scores = code_scores(inputs.codes, inputs.plan, inputs.basis, cos, sin, query, scaling, inputs.held, tiles)
    bins, lse = code_bins(scores, inputs.v_codes, inputs.v_bits, inputs.n_groups, tiles)
    return code_values(bins, inputs.codebook, inputs.v_scale, rotation, tiles, inputs.v_mean), lse


def code_attention(codes: torch.Tensor, plan, scaled: torch.Tensor, mean: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, query: torch.Tensor, scaling: float, hidden: torch.Tensor | None,
                   v_codes: torch.Tensor, v_bits: int, n_groups: int,
                   tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`kvshrink.kernels.cpu.block_attention.code_attention` on the GPU path: the same arguments (``plan`` a `SlotPlan`,
    or its `ComponentPlan` already on the device) and the same result, ``(bins [B, H_kv, R, n_groups *
    2**v_bits], lse [B, H_kv, R])`` float32. The layer prepares a block once instead (`block_attention`)."""
    if not isinstance(plan, ComponentPlan):
        plan = component_plan(plan, scaled.shape[1], codes.device)
    held = held_bits(hidden, codes.shape[2]) if hidden is not None and hidden.shape[-1] else None
    scores = code_scores(codes, plan, paired_basis(scaled, mean), cos, sin, query, scaling, held, tiles)
    return code_bins(scores, v_codes, v_bits, n_groups, tiles)


@triton.jit
def _pair_rope_kernel(freq_ptr, offset_ptr, cos_ptr, sin_ptr, start, n, half, frame, HALF: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    # row b, tokens start .. start+n-1: position max(index - offset[b], 0), rounded down to its frame, times each
    # pair's frequency
    b = tl.program_id(0)
    offs_t = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = offs_t < n
    offs_p = tl.arange(0, HALF)
    p_ok = offs_p < half
    position = tl.maximum(start + offs_t.to(tl.int64) - tl.load(offset_ptr + b).to(tl.int64), 0)
    position = (position - position % frame).to(tl.float32)
    angle = position[:, None] * tl.load(freq_ptr + offs_p, mask=p_ok, other=0.0)[None, :]
    at = (b * n + offs_t[:, None]) * half + offs_p[None, :]
    ok = t_ok[:, None] & p_ok[None, :]
    tl.store(cos_ptr + at, tl.cos(angle), mask=ok)
    tl.store(sin_ptr + at, tl.sin(angle), mask=ok)


def pair_rope(frequencies: torch.Tensor, offset: torch.Tensor, start: int, n: int,
              frame: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(cos, sin)`` ``[B, n, d/2]`` of each RoPE pair of token indices ``start .. start+n-1`` (row
    ``b`` at positions ``index - offset[b]``, at least 0, rounded down to a multiple of ``frame``; ``frequencies
    [d/2]`` float32): what `StepContext.rope` gives for the first half of the channels, in one launch instead of a
    dozen torch ops."""
    batch, half = offset.shape[0], frequencies.shape[0]
    cos = torch.empty(batch, n, half, dtype=torch.float32, device=offset.device)
    sin = torch.empty_like(cos)
    if n == 0:
        return cos, sin
    block_n = 64
    with counting.kernel_launch("shard_pair_rope"):
        _pair_rope_kernel[(batch, triton.cdiv(n, block_n))](frequencies.contiguous(), offset.contiguous(), cos, sin,
                                                             int(start), n, half, int(frame), HALF=_pow2(half),
                                                             BLOCK_N=block_n)
    return cos, sin


# ---- the decode stream: TurboQuant codes -------------------------------------------------------------------

@triton.jit
def _turbo_rows(codes_ptr, row0, offs_t, t_ok, offs_i, i_ok, n_bytes, centroids_ptr, BITS: tl.constexpr):
    """``[BLOCK_N, DP]`` centroids of the tokens' codes (coordinate ``i`` at bit ``i * BITS``)."""
    bit = offs_i * BITS
    at = (row0 + offs_t[:, None]) * n_bytes + (bit >> 3)[None, :]
    ok = t_ok[:, None] & i_ok[None, :]
    lo = tl.load(codes_ptr + at, mask=ok, other=0).to(tl.int32)
    hi = tl.load(codes_ptr + at + 1, mask=ok & (((bit & 7) + BITS) > 8)[None, :], other=0).to(tl.int32)
    code = ((lo | (hi << 8)) >> (bit & 7)[None, :]) & ((1 << BITS) - 1)
    return tl.load(centroids_ptr + code, mask=ok, other=0.0)


@triton.jit
def _turbo_signs(signs_ptr, row0, offs_t, t_ok, offs_i, i_ok, sign_bytes):
    """``[BLOCK_N, DP]`` QJL signs (+-1) of the tokens, 0 outside."""
    at = (row0 + offs_t[:, None]) * sign_bytes + (offs_i >> 3)[None, :]
    ok = t_ok[:, None] & i_ok[None, :]
    byte = tl.load(signs_ptr + at, mask=ok, other=0).to(tl.int32)
    bit = (byte >> (offs_i & 7)[None, :]) & 1
    return tl.where(ok, bit.to(tl.float32) * 2.0 - 1.0, 0.0)


@triton.jit
def _stream_attention_kernel(k_codes_ptr, k_norm_ptr, k_signs_ptr, k_qjl_ptr, v_codes_ptr, v_norm_ptr, v_signs_ptr,
                             v_qjl_ptr, centroids_ptr, q_ptr, qs_ptr, rot_ptr, sketch_ptr, k_centre_ptr, v_centre_ptr,
                             out_ptr, lse_ptr, scaling,
                             qjl_scale, n, capacity, n_bytes, sign_bytes, rows, dim, rot_row_stride, rot_col_stride,
                             BITS: tl.constexpr, QJL: tl.constexpr, ROTATE: tl.constexpr, DP: tl.constexpr,
                             BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    # one pass over the stream per block of query rows, softmax online: scores from the key codes against
    # the rotated queries (QJL sketch term included), probabilities times norms summed against the value
    # codes' centroids, unrotated at the end. ROTATE: the queries come as they are and are rotated here
    # (decode: few rows); else rotated (and sketched) already. The tokens were coded less their centres
    # [B*H, d]: the key centre (in the queries' domain as they come) adds q . centre to every score, so to the
    # lse alone; the value centre (the model's channels) adds itself to the output
    pid_bh = tl.program_id(0)
    offs_r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = offs_r < rows
    offs_i = tl.arange(0, DP)
    i_ok = offs_i < dim
    row0 = pid_bh * capacity    # the codes' rows are `capacity` tokens apart (the stream's buffer)
    q_at = (pid_bh * rows + offs_r[:, None]) * dim + offs_i[None, :]
    q_ok = r_ok[:, None] & i_ok[None, :]
    q = tl.load(q_ptr + q_at, mask=q_ok, other=0.0).to(tl.float32)
    k_centre = tl.load(k_centre_ptr + pid_bh * dim + offs_i, mask=i_ok, other=0.0)
    shift = tl.sum(q * k_centre[None, :], 1) * scaling
    if ROTATE:
        q = tl.dot(q, _square(rot_ptr, offs_i, i_ok, rot_row_stride, rot_col_stride), input_precision="ieee")
    if QJL:
        if ROTATE:
            qs = tl.dot(q, tl.trans(_square(sketch_ptr, offs_i, i_ok, dim, 1)), input_precision="ieee")
        else:
            qs = tl.load(qs_ptr + q_at, mask=q_ok, other=0.0)
    top = tl.full((BLOCK_R,), float("-inf"), tl.float32)
    total = tl.full((BLOCK_R,), 0.0, tl.float32)
    acc = tl.full((BLOCK_R, DP), 0.0, tl.float32)
    acc_z = tl.full((BLOCK_R, DP), 0.0, tl.float32)
    for t0 in range(0, n, BLOCK_N):
        offs_t = t0 + tl.arange(0, BLOCK_N)
        t_ok = offs_t < n
        y = _turbo_rows(k_codes_ptr, row0, offs_t, t_ok, offs_i, i_ok, n_bytes, centroids_ptr, BITS)
        sc = tl.dot(q, tl.trans(y), input_precision="ieee")
        if QJL:
            z = _turbo_signs(k_signs_ptr, row0, offs_t, t_ok, offs_i, i_ok, sign_bytes)
            resid = tl.load(k_qjl_ptr + row0 + offs_t, mask=t_ok, other=0.0).to(tl.float32) * qjl_scale
            sc += tl.dot(qs, tl.trans(z), input_precision="ieee") * resid[None, :]
        norm = tl.load(k_norm_ptr + row0 + offs_t, mask=t_ok, other=0.0).to(tl.float32)
        sc = tl.where(t_ok[None, :], sc * norm[None, :] * scaling, float("-inf"))
        new_top = tl.maximum(top, tl.max(sc, 1))
        shrink = tl.exp(top - new_top)
        p = tl.exp(sc - new_top[:, None])
        total = total * shrink + tl.sum(p, 1)
        top = new_top
        w = p * tl.load(v_norm_ptr + row0 + offs_t, mask=t_ok, other=0.0).to(tl.float32)[None, :]
        y = _turbo_rows(v_codes_ptr, row0, offs_t, t_ok, offs_i, i_ok, n_bytes, centroids_ptr, BITS)
        acc = tl.dot(w, y, acc * shrink[:, None], input_precision="ieee")
        if QJL:
            z = _turbo_signs(v_signs_ptr, row0, offs_t, t_ok, offs_i, i_ok, sign_bytes)
            resid = tl.load(v_qjl_ptr + row0 + offs_t, mask=t_ok, other=0.0).to(tl.float32) * qjl_scale
            acc_z = tl.dot(w * resid[None, :], z, acc_z * shrink[:, None], input_precision="ieee")
    if QJL:   # the sketch term, back from the sketch's space
        acc = tl.dot(acc_z, _square(sketch_ptr, offs_i, i_ok, dim, 1), acc, input_precision="ieee")
    # unrotated here: out = acc @ rotation.T
    out = tl.dot(acc / total[:, None], tl.trans(_square(rot_ptr, offs_i, i_ok, rot_row_stride, rot_col_stride)),
                 input_precision="ieee")
    out += tl.load(v_centre_ptr + pid_bh * dim + offs_i, mask=i_ok, other=0.0)[None, :]
    tl.store(out_ptr + q_at, out, mask=q_ok)
    tl.store(lse_ptr + pid_bh * rows + offs_r, top + tl.log(total) + shift, mask=r_ok)


@triton.jit
def _square(ptr, offs_i, i_ok, row_stride, col_stride):
    """A ``[DP, DP]`` float32 tile of a ``dim x dim`` matrix (zeros past ``dim``)."""
    return tl.load(ptr + offs_i[:, None] * row_stride + offs_i[None, :] * col_stride,
                   mask=i_ok[:, None] & i_ok[None, :], other=0.0).to(tl.float32)


def _token_rows(code, capacity: int | None = None):
    """``(code, capacity)``: ``code`` (``[B, H, n, ...]``) laid out as the stream kernels read it, row
    ``b * H + h`` starting ``capacity`` tokens after the previous one, every field alike: the stream
    buffer's views as they are (no copy per step), anything else made contiguous (capacity ``n``)."""
    from kvshrink.codecs.lloyd_max import TurboCode

    b, h, n, n_bytes = code.codes.shape
    cap = capacity or (code.codes.stride(1) // max(1, n_bytes))
    strided = (code.qjl_signs is None and code.codes.stride() == (h * cap * n_bytes, cap * n_bytes, n_bytes, 1)
               and code.norm.stride() == (h * cap, cap, 1))
    if strided:
        return code, cap
    fields = [None if x is None else x.contiguous() for x in (code.norm, code.codes, code.qjl_signs, code.qjl_norm)]
    return TurboCode(*fields), n


# Most query rows (batch x heads x grouped rows) the stream's scores kernel rotates itself, in each program.
_ROTATE_IN_KERNEL_ROWS = 256


def turbo_attention(turbo, query: torch.Tensor, keys, values, scaling: float, centre: torch.Tensor | None = None,
                    tiles: Tiles | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of grouped ``query [B, H_kv, R, d]`` over TurboQuant-coded ``keys`` and ``values``
    (`codecs.lloyd_max.TurboCode` of ``[B, H_kv, n]`` vectors, quantizer ``turbo``), with no host
    synchronisation and nothing decoded to memory: ``(out [B, H_kv, R, d], lse [B, H_kv, R])`` float32,
    `TurboQuantizer.inner_products` / softmax / `weighted_sum` in one kernel launch (scores from the key
    codes against the rotated queries, QJL sketch term included, softmax online; probabilities times norms
    summed against the value codes' centroids, then unrotated). ``keys`` and ``values`` may be views of the stream's buffer.
    ``centre [2, B, H_kv, d]``: what each key and value was coded less of (the keys', the values'; None: zero), added
    back in the same launch.
    """
    tiles = tiles or default_tiles()

    batch, heads, rows, dim = query.shape
    n = keys.codes.shape[2]
    device = query.device
    centroids, _, sketch, _ = turbo._tables(device)
    qjl = turbo.qjl
    qjl_scale = math.sqrt(math.pi / 2) / dim
    dp = _pow2(dim)
    rotation = turbo.rotation.matrix(device, torch.float32)
    dummy = keys.norm   # stands for the QJL tensors when there are none (never read): no allocation
    # decode rotates its few query rows inside the kernel; many rows (prefill after decoding) once here
    rotate = batch * heads * rows <= _ROTATE_IN_KERNEL_ROWS
    q = query.contiguous() if rotate else turbo.rotation.rotate(query.float()).contiguous()
    qs = dummy if rotate or not qjl else (q @ sketch.T).contiguous()
    if centre is None:
        centre = torch.zeros(2, batch, heads, dim, dtype=torch.float32, device=device)
    centre = centre.float().contiguous()
    k_centre = centre[0] if rotate else turbo.rotation.rotate(centre[0]).contiguous()  # in the queries' domain
    sketch_arg = sketch.contiguous() if qjl else dummy

    keys, capacity = _token_rows(keys)
    values, values_capacity = _token_rows(values, capacity)
    if values_capacity != capacity:   # values made contiguous: the keys too (one capacity for both)
        keys, capacity = _token_rows(keys, values_capacity)

    def qjl_args(code):
        if not qjl:
            return dummy, dummy, 1
        return code.qjl_signs, code.qjl_norm, code.qjl_signs.shape[-1]

    lse = torch.empty(batch, heads, rows, dtype=torch.float32, device=device)
    out = torch.empty(batch, heads, rows, dim, dtype=torch.float32, device=device)
    k_signs, k_qjl, sign_bytes = qjl_args(keys)
    v_signs, v_qjl, _ = qjl_args(values)
    with counting.kernel_launch("shard_stream_attention"):
        _stream_attention_kernel[(batch * heads, triton.cdiv(rows, tiles.r))](
            keys.codes, keys.norm, k_signs, k_qjl, values.codes, values.norm, v_signs, v_qjl, centroids, q, qs,
            rotation, sketch_arg, k_centre, centre[1], out, lse, float(scaling), qjl_scale, n, capacity,
            keys.codes.shape[-1], sign_bytes, rows, dim, *rotation.stride(), BITS=turbo.bits, QJL=qjl,
            ROTATE=rotate, DP=dp, BLOCK_N=tiles.n, BLOCK_R=tiles.r)
    return out, lse


@triton.jit
def _turbo_encode_kernel(x_ptr, centre_ptr, rotation_ptr, bounds_ptr, codes_ptr, norm_ptr, n_rows, n, x_row_stride,
                         x_token_stride, rot_row_stride, rot_col_stride, out_row_stride, at, dim, n_bytes,
                         BITS: tl.constexpr, N_BOUNDS: tl.constexpr, GROUP: tl.constexpr,
                         GROUP_BYTES: tl.constexpr, DP: tl.constexpr, BLOCK_M: tl.constexpr):
    # rows m = row * n + token of x, less its row's centre [n_rows, dim]; each: norm, unit vector rotated, the
    # index of its interval among the boundaries (torch.bucketize), packed little-endian (GROUP codes fill
    # GROUP_BYTES bytes exactly)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < n_rows * n
    row = offs_m // n
    token = offs_m % n
    offs_i = tl.arange(0, DP)
    i_ok = offs_i < dim
    ok = m_ok[:, None] & i_ok[None, :]
    x = tl.load(x_ptr + (row * x_row_stride + token * x_token_stride)[:, None] + offs_i[None, :], mask=ok,
                other=0.0).to(tl.float32)
    x = x - tl.load(centre_ptr + row[:, None] * dim + offs_i[None, :], mask=ok, other=0.0)
    norm = tl.sqrt(tl.sum(x * x, 1))
    unit = x / tl.maximum(norm, 1e-12)[:, None]
    rot = _square(rotation_ptr, offs_i, i_ok, rot_row_stride, rot_col_stride)
    y = tl.dot(unit, rot, input_precision="ieee")                                          # [BLOCK_M, DP]
    code = tl.full((BLOCK_M, DP), 0, tl.int32)
    for j in tl.static_range(N_BOUNDS):
        code += (y > tl.load(bounds_ptr + j)).to(tl.int32)
    code = tl.where(ok, code, 0)
    shifts = tl.arange(0, GROUP) * BITS
    words = tl.sum(tl.reshape(code, (BLOCK_M, DP // GROUP, GROUP)) << shifts[None, None, :], 2)
    group = tl.arange(0, DP // GROUP)
    out_row = codes_ptr + (row * out_row_stride + at + token) * n_bytes
    for w in tl.static_range(GROUP_BYTES):
        byte = group * GROUP_BYTES + w
        tl.store(out_row[:, None] + byte[None, :], ((words >> (8 * w)) & 255).to(tl.uint8),
                 mask=m_ok[:, None] & (byte < n_bytes)[None, :])
    tl.store(norm_ptr + row * out_row_stride + at + token, norm.to(tl.float16), mask=m_ok)


def turbo_encode_into(turbo, x: torch.Tensor, codes: torch.Tensor, norm: torch.Tensor, at: int,
                      centre: torch.Tensor | None = None) -> None:
    """`TurboQuantizer.encode` (no QJL) of ``x [..., n, d]`` less ``centre [..., d]`` (one vector per leading row;
    None: zero) in one launch, written into tokens
    ``at .. at+n-1`` of ``codes [..., capacity, bytes]`` and ``norm [..., capacity]`` (same leading dims,
    contiguous): the stream's buffer, nothing allocated. ``x`` may be strided (rows of a ring buffer) as
    long as its leading dims collapse to one row stride."""
    if turbo.qjl:
        raise ValueError("turbo_encode_into: QJL residuals are encoded by TurboQuantizer.encode")
    *lead, n, dim = x.shape
    rows = x.numel() // max(1, n * dim)
    flat = x.reshape(rows, n, dim) if x.stride(-1) == 1 else x.contiguous().reshape(rows, n, dim)
    _, bounds, _, _ = turbo._tables(x.device)
    rotation = turbo.rotation.matrix(x.device, torch.float32)
    centre = (torch.zeros(rows, dim, dtype=torch.float32, device=x.device) if centre is None
              else centre.float().reshape(rows, dim).contiguous())
    group = 8 // math.gcd(8, turbo.bits)            # codes per whole number of bytes
    dp = max(_pow2(dim), group)
    block_m = 16
    with counting.kernel_launch("shard_stream_encode"):
        _turbo_encode_kernel[(triton.cdiv(rows * n, block_m),)](
            flat, centre, rotation, bounds, codes, norm, rows, n, flat.stride(0), flat.stride(1), *rotation.stride(),
            codes.shape[-2], at, dim,
            codes.shape[-1], BITS=turbo.bits, N_BOUNDS=bounds.numel(), GROUP=group,
            GROUP_BYTES=group * turbo.bits // 8, DP=dp, BLOCK_M=block_m)
