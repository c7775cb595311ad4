"""A decode step's partial softmaxes on the CPU (`StepParts`), each written in place by its kernel (exact, 8-bit,
ring, stream, coded block) and merged in one pass."""

from __future__ import annotations

import numpy as np
import torch

from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.block_attention import _block_attention, _row_quads
from kvshrink.kernels.cpu.exact_parts import _NO_TOKENS, _exact_into, _int8_into, _ring_attention
from kvshrink.kernels.cpu.half_words import _HALF_POW2
from kvshrink.kernels.cpu.numba_support import _FASTMATH, _numpy, scratch
from kvshrink.kernels.cpu.softmax import empty_partial
from kvshrink.kernels.cpu.stream import _turbo_into, centre_array

if numba_support.installed():
    from numba import njit

    @njit(cache=True, fastmath=_FASTMATH)
    def _merge(outs, lses, out, total):  # pragma: no cover - compiled
        # outs [P, R, d], lses [P, R]: P partial softmaxes of R query rows -> their union's out [R, d] and
        # log-sum-exp total [R] (rows no part sees: zeros, -inf)
        parts, rows = lses.shape
        weight = np.empty(parts, np.float32)
        for r in range(rows):
            top = np.float32(-np.inf)
            for p in range(parts):
                top = max(top, lses[p, r])
            if top == -np.inf:
                out[r] = 0.0
                total[r] = -np.inf
                continue
            mass = np.float32(0.0)
            for p in range(parts):
                weight[p] = np.exp(lses[p, r] - top)
                mass += weight[p]
            out[r] = 0.0
            for p in range(parts):
                w = weight[p] / mass
                for j in range(out.shape[1]):
                    out[r, j] += w * outs[p, r, j]
            total[r] = top + np.log(mass)


class StepParts:
    """The partial softmaxes of one grouped decode query ``[B, H_kv, R, d]`` on CPU, each written in place by its
    kernel into one buffer (`exact`, `int8`, `turbo`, `code`) and all merged in one pass (`merged`): no tensor,
    `Partial` or stacked copy per part (a decode step has a handful of parts per layer, and each cost a few dozen
    small calls that way). Up to ``capacity`` parts."""

    def __init__(self, query: torch.Tensor, scaling: float, capacity: int):
        self.query = _numpy(query.float())
        self.scaling = np.float32(scaling)
        shape = self.query.shape
        self._outs = scratch("parts_out", (capacity, *shape)).numpy()
        self._lses = scratch("parts_lse", (capacity, *shape[:3])).numpy()
        self._quads = None
        self.count = 0

    def _next(self) -> tuple[np.ndarray, np.ndarray]:
        if self.count == len(self._outs):
            raise RuntimeError(f"StepParts holds {self.count} parts, its capacity")
        self.count += 1
        return self._outs[self.count - 1], self._lses[self.count - 1]

    def exact(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Exact attention over ``keys/values [B, H_kv, m, d]`` (any float dtype, converted by torch), every one
        visible: one pass per head (a decode step's few dozen exact tokens: no attention kernel's setup)."""
        _exact_into(self.query, keys, values, self.scaling, *self._next())

    def int8(self, keys: tuple, values: tuple, dtype: torch.dtype) -> None:
        """Attention over token vectors held as 8-bit `codecs.groupwise.GroupCode`s (``keys/values`` as
        `int8_arrays`), every one visible, in one pass with no decoded copy; the codes decoded as
        ``dequantize_groups(code).to(dtype)`` gives them (rounded to ``dtype``'s mantissa)."""
        _int8_into(self.query, keys, values, self.scaling, dtype, *self._next())

    def turbo(self, turbo, keys: tuple, values: tuple, centre: np.ndarray | None = None) -> None:
        """`turbo_attention` over TurboQuant codes ``keys/values`` (`turbo_arrays`) less their ``centre``
        (`centre_array`; None: zero)."""
        if centre is None:
            centre = centre_array(None, self.query.shape)
        _turbo_into(turbo, self.query, keys, values, self.scaling, *self._next(), centre)

    def ring(self, kv: np.ndarray, live: int, dtype: torch.dtype, new: tuple[torch.Tensor, torch.Tensor] | None
             ) -> None:
        """`exact` over the first ``live`` rows of a 16-bit ring's words ``kv [2, B·H, S, d]`` (`ring_words`;
        ``dtype`` float16 or bfloat16) read in place, and ``new`` (float32 ``[B, H, m, d]`` keys and values), in one
        call: no float32 copy or concatenation of the ring's tokens."""
        new_k, new_v = (_NO_TOKENS, _NO_TOKENS) if new is None else (_numpy(x.float()) for x in new)
        if new is not None and new_k.shape[:2] != self.query.shape[:2]:
            raise ValueError(f"new tokens {new_k.shape} do not match the query {self.query.shape}")
        n, d = live + new_k.shape[2], kv.shape[3]
        _ring_attention(self.query, kv, live, dtype == torch.bfloat16, _HALF_POW2, new_k, new_v, self.scaling,
                        *self._next(), scratch("ring keys", (n, d)).numpy().view(np.uint32),
                        scratch("ring values", (n, d)).numpy().view(np.uint32),
                        scratch("ring scores", (self.query.shape[2] * n,)).numpy())

    def code(self, scopes, layout, basis_t: torch.Tensor, mean: torch.Tensor, cos_t: torch.Tensor,
             sin_t: torch.Tensor, hidden, v_codes, v_bits: int, n_groups: int, rows: torch.Tensor | np.ndarray | None,
             codebook: torch.Tensor, v_scale: torch.Tensor, rotation: torch.Tensor,
             v_mean: torch.Tensor | None = None, frames: tuple | None = None) -> None:
        """`code_attention` (``halves=True``; the scaled bases as ``basis_t [S, W, r]``; the codes and the int32
        ``hidden`` rows as tensors or numpy views) and the value pass (each group's probability-weighted codewords,
        times ``v_scale``, rotated back, plus ``v_mean [H_kv, d]``, the mean the values were coded less of: the
        part's probabilities sum to one): a coded block's partial (`_block_attention`; with ``frames``, keys coded
        at their frames' positions, scored without rebuilding them)."""
        if self._quads is None:
            self._quads = _row_quads(self.query, self.scaling)
        out, lse = self._next()
        values = (_numpy(codebook.float().T.contiguous()), _numpy(v_scale.float()), _numpy(rotation.float()))
        _block_attention(scopes, layout, basis_t, mean, cos_t, sin_t, self._quads, hidden, v_codes, v_bits, n_groups,
                         rows, lse, None, values, out, frames)
        if v_mean is not None:
            out += _numpy(v_mean.float())[None, :, None, :]

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """A part computed elsewhere: grouped ``out [B, H_kv, R, d]``, ``lse [B, H_kv, R]``."""
        into_out, into_lse = self._next()
        into_out[...] = _numpy(out.float())
        into_lse[...] = _numpy(lse.float())

    def merged(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(out [B, H_kv, R, d], lse [B, H_kv, R])``: the softmax over every part's tokens (new tensors)."""
        out, lse = empty_partial(self.query.shape)
        d, n = out.shape[-1], self.count
        _merge(self._outs[:n].reshape(n, -1, d), self._lses[:n].reshape(n, -1), out.reshape(-1, d), lse.reshape(-1))
        return torch.from_numpy(out), torch.from_numpy(lse)
