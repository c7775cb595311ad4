"""Compiling (or loading from numba's cache) the CPU kernels on tiny inputs before anything is timed: Shard's
(`shard`, per number of PCA scopes) and LRQK's (`lrqk`)."""

from __future__ import annotations

import numpy as np
import torch

from kvshrink.codecs.groupwise import quantize_groups
from kvshrink.codecs.lloyd_max import TurboCode, TurboQuantizer
from kvshrink.codecs.pca import PCACode
from kvshrink.kernels.cpu import numba_support
from kvshrink.kernels.cpu.block_attention import code_attention, run_layout, scaled_bases
from kvshrink.kernels.cpu.encoders import ring_step, turbo_encode_into
from kvshrink.kernels.cpu.exact_parts import int8_arrays, ring_words
from kvshrink.kernels.cpu.lrqk_factor import decode_step, resident_decode_step
from kvshrink.kernels.cpu.lrqk_proxy import proxy_top_k
from kvshrink.kernels.cpu.numba_support import each_kernel_variant, threading_layer_usable
from kvshrink.kernels.cpu.step_parts import StepParts
from kvshrink.kernels.cpu.stream import stream_words, turbo_arrays
from kvshrink.kernels.cpu.vq_search import index_codebook, nearest_codewords

_warmed: set = set()   # what `shard` has compiled or loaded in this process: scope counts, and "rest"


def shard(scopes: int = 1) -> None:
    """Compile (or load from numba's cache) Shard's kernels now, on a tiny input, so the first decode
    step is not charged with it. ``scopes``: the caller's number of PCA scopes per layer (the kernels over a
    tuple of scopes are compiled once per tuple length: ~4 s each on a fresh machine, measured)."""
    if not numba_support.available():
        return
    threading_layer_usable()
    for count in sorted({1, scopes} - _warmed):
        _warm_up_scopes(count)
        _warmed.add(count)
    if "rest" not in _warmed:
        _warm_up_rest()
        _warmed.add("rest")


def _warm_up_scopes(scopes: int) -> None:
    # the coded-block kernels over ``scopes`` PCA scopes of one head each
    code = PCACode(mean=torch.zeros(2), basis_q=torch.zeros(2, 4, dtype=torch.int8), basis_scale=torch.ones(4),
                   coeff_step=torch.ones(4), codes=torch.zeros(1, 2, 1, dtype=torch.uint8), runs=[(2, 0, 4, 0, 1)])
    layout, codes = run_layout([code] * scopes), [code.codes] * scopes
    scaled, mean = torch.zeros(scopes, 4, 2), torch.zeros(scopes, 2)
    v_codes = torch.zeros(1, scopes, 2, 1, dtype=torch.uint8)
    for _ in each_kernel_variant():
        code_attention(torch.stack(codes, 1), layout, scaled, mean, torch.ones(1, 1, 2), torch.zeros(1, 1, 2),
                       torch.zeros(1, scopes, 1, 2), 1.0, None, v_codes, 8, 1, rows=torch.arange(2))
        parts = StepParts(torch.zeros(1, scopes, 1, 2), 1.0, 3)   # the decode step's layouts of the same kernels
        hidden = torch.zeros(1, scopes, 1, dtype=torch.int32)    # a row held apart (Shard's salient tokens)
        parts.code(codes, layout, scaled.transpose(1, 2), mean, torch.ones(1, 1, 2), torch.zeros(1, 1, 2), hidden, v_codes, 8, 1,
                   torch.arange(2), torch.zeros(256, 2), torch.ones(scopes, 2), torch.eye(2))
        frames = (torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 1, 1), torch.zeros(1, 1, 1))   # `rope_frame`
        parts.code(codes, layout, scaled.transpose(1, 2), mean, None, None, hidden, v_codes, 8, 1, torch.arange(2),
                   torch.zeros(256, 2), torch.ones(scopes, 2), torch.eye(2), frames=frames)
        parts.add(torch.zeros(1, scopes, 1, 2), torch.zeros(1, scopes, 1))
        parts.merged()
    scaled_bases((np.zeros((2, 1), np.int8),) * scopes, torch.ones(scopes, 1, 1), None)


def _warm_up_rest() -> None:
    # the kernels whose types do not depend on the scopes
    vectors = quantize_groups(torch.ones(1, 1, 1, 2), 8, 2)
    turbo = TurboQuantizer(4, 4)
    code = turbo.encode(torch.ones(1, 2, 1, 4))
    buffer = TurboCode(norm=torch.ones(2, 1, 2, 3, dtype=torch.float16),   # two heads: its first tokens' views
                       codes=torch.zeros(2, 1, 2, 3, 2, dtype=torch.uint8))  # are not contiguous, as in a step
    codes, norm = turbo_arrays(buffer)
    parts = StepParts(torch.zeros(1, 1, 1, 2), 1.0, 6)
    for dtype in (torch.float32, torch.float16):
        parts.exact(torch.zeros(1, 1, 1, 2, dtype=dtype), torch.zeros(1, 1, 1, 2, dtype=dtype))
    parts.int8(int8_arrays(vectors), int8_arrays(vectors), torch.float16)
    ring = ring_words(torch.zeros(2, 1, 1, 2, 2, dtype=torch.float16))
    parts.ring(ring, 2, torch.float16, None)
    parts.ring(ring, 2, torch.bfloat16, (torch.zeros(1, 1, 1, 2), torch.zeros(1, 1, 1, 2)))
    parts = StepParts(torch.ones(1, 2, 1, 4), 1.0, 2)          # the stream: compact codes and a buffer's views
    parts.turbo(turbo, turbo_arrays(code), turbo_arrays(code))
    parts.turbo(turbo, (codes[0, ..., :1, :], norm[0, ..., :1]), (codes[1, ..., :1, :], norm[1, ..., :1]))
    turbo_encode_into(turbo, torch.ones(1, 1, 4), torch.zeros(1, 1, 2, dtype=torch.uint8),
                      torch.zeros(1, 1, dtype=torch.float16), 0)
    ring_step(turbo, ring_words(torch.zeros(2, 1, 2, 2, 4, dtype=torch.float16)), 0, torch.zeros(1, 2, 1, 4),
              torch.zeros(1, 2, 1, 4), *stream_words(buffer.codes, buffer.norm), 0)
    nearest_codewords(torch.zeros(1, 2), torch.zeros(2, 2))
    corners = torch.tensor([[-1.0] * 4, [1.0] * 4])
    index_codebook(corners)
    nearest_codewords(torch.zeros(1, 4), corners)


def lrqk() -> None:
    """Compile (or load from numba's cache) LRQK's kernels now, on a tiny input: the serial or the parallel variant,
    whichever the current thread count runs (the other is compiled on first use if the count changes: each
    variant costs tens of seconds to compile on a small CPU)."""
    if not numba_support.available():
        return
    threading_layer_usable()
    b = torch.eye(2, 4).unsqueeze(0)
    decode_step(torch.ones(1, 1, 4), torch.ones(1, 4), b, b, torch.zeros(1, 2, 2), torch.zeros(1, 1, 2), 1.0, True)
    proxy_top_k(torch.zeros(2, 3), 1.0, None, 1, 2)
    resident_decode_step(torch.ones(1, 1, 4), torch.ones(1, 4), b.clone(), b.clone(), torch.ones(1, 3, 2),
                         torch.zeros(1, 1, dtype=torch.long), torch.ones(1, 1, dtype=torch.bool),
                         torch.ones(1, 1, 4), torch.ones(1, 1, 4), 1, 1, 1.0, True)
