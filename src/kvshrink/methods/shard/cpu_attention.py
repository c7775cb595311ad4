"""A Shard layer's attention on the CPU fast path (``kernel="fast"``, numba): each middle block, the stream and a
whole decode step on the ring through the kernels of `kvshrink.kernels.cpu`, which read the codes and the ring's
words in place."""

from __future__ import annotations

import math

import torch

from kvshrink.cache.attention import Partial, group_queries, ungroup
from kvshrink.cache.base import StepContext
from kvshrink.cache.store import check_fp16_peak
from kvshrink.codecs.bitpack import packed_size
from kvshrink.kernels import backend
from kvshrink.kernels.cpu import block_attention, encoders, exact_parts, numba_support, step_parts, stream
from kvshrink.kernels.cpu.block_attention import RunLayout, run_layout
from kvshrink.methods.shard.ring import ExactRing
from kvshrink.methods.shard.segments import BasisFactors, BlockArrays, MiddleBlock

# Most grouped query rows (query heads per KV head x new tokens) the fused kernel takes: decoding, not
# prefill-with-past, whose many rows the reference path blocks to bound memory.
_FAST_ROWS = 64


class CpuAttention:
    """`ShardLayer`'s CPU fast path: the numba kernels' partials and their inputs, kept on the blocks."""

    def use_fast_kernel(self, query: torch.Tensor) -> bool:
        rows = query.shape[1] // self.h_kv * query.shape[2]
        return self.on_cpu_fast_path(query) and rows <= _FAST_ROWS

    def on_cpu_fast_path(self, x: torch.Tensor) -> bool:
        """Whether work on ``x`` takes the numba kernels: ``kernel="fast"``, a CPU tensor, the GPU path not forced."""
        return self.shared.fast and x.device.type == "cpu" and not backend.gpu_path(x)

    def fast_ring_attend(self, query: torch.Tensor, ctx: StepContext, ring: ExactRing,
                         new: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
        """`ring_attend`'s attention on the CPU fast path: every part (the ring's tokens with the exact salient
        ones and ``new``, the step's token when not in the ring; each block's 8-bit salient codes read in place;
        the middle blocks; the stream) written by its numba kernel into one `step_parts.StepParts` and merged once."""
        held = [block for block in self.middle if block.salient is not None]
        grouped = group_queries(query.float(), self.h_kv)
        parts = step_parts.StepParts(grouped, ctx.scaling, 2 + len(held) + len(self.blocks()))
        exact = [block.salient.key_values(ring.dtype) for block in held if not block.salient.coded]
        ring.attend_into(parts, exact, new, self.numpy_views())
        for block in held:
            if block.salient.coded:
                parts.int8(*self.block_arrays(block).salient, ring.dtype)
        for part in self.code_partials(query, ctx, parts):    # a stream the kernels do not read
            parts.add(group_queries(part.out, self.h_kv), part.lse.reshape(grouped.shape[:3]))
        return ungroup(parts.merged()[0], query.shape[1]).to(query.dtype)

    def ring_step_compiled(self, ring: ExactRing, key: torch.Tensor, value: torch.Tensor) -> bool:
        """A decode step's commit to a full float16 ring in one numba pass (`encoders.ring_step`: the oldest token
        coded into the stream, the new one stored in its slot, checked for float16's range first); False, having
        done nothing, off the CPU fast path or for other dtypes."""
        turbo = self.shared.turbo
        if not (ring.count == ring.slots == self.cfg.window > 0 and self.on_cpu_fast_path(key)
                and ring.dtype == torch.float16 and key.dtype == value.dtype == torch.float32
                and stream.turbo_supported(turbo) and ring.kv.is_contiguous()):
            return False
        b, h, _, _ = key.shape
        buffer = self.stream.room(1, (b, h), packed_size(self.d, turbo.bits), key.device)
        views = self.numpy_views()
        codes, norm = views.get("stream", buffer, lambda x: stream.stream_words(x.codes, x.norm))
        peak = encoders.ring_step(turbo, views.get("ring", ring.kv, exact_parts.ring_words), ring.n_sinks + ring.head,
                                  key, value, codes, norm, self.stream.n, self.stream.centre)
        if peak is not None:
            check_fp16_peak(peak)
        self.stream.filled(ring.start, 1)
        ring.head = (ring.head + 1) % ring.slots
        ring.start += 1
        return True

    def numpy_views(self) -> numba_support.NumpyViews:
        """Numpy views of the ring's and the stream's buffers for the CPU fast path's kernels, made again when a
        buffer is replaced (never saved)."""
        return self.__dict__.setdefault("_views", numba_support.NumpyViews())

    def stream_arrays(self) -> tuple[tuple, tuple]:
        """The stream's keys' and values' `stream.turbo_arrays` (its first ``n`` tokens): views of its buffer, kept
        while the buffer lives, when it has one."""
        n, buffer = self.stream.n, self.stream.buffer
        if buffer is None:
            return stream.turbo_arrays(self.stream.keys), stream.turbo_arrays(self.stream.values)
        codes, norm = self.numpy_views().get("stream_arrays", buffer.codes,
                                             lambda _: stream.turbo_arrays(buffer))
        return (codes[0, ..., :n, :], norm[0, ..., :n]), (codes[1, ..., :n, :], norm[1, ..., :n])

    def fused_middle_partial(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> Partial:
        """The block's partial from `kernels.cpu.block_attention.code_attention`: its keys rebuilt a slice of tokens at
        a time (coefficients from the codes, one batched product with the bases, RoPE, scores) and one
        pass over its value codes (softmax probabilities summed per codeword), no whole key or value
        block materialised; same result as the reference path within float32 rounding."""
        parts = step_parts.StepParts(group_queries(query.float(), self.h_kv), ctx.scaling, 1)
        self.fused_middle_into(block, ctx, parts)
        return Partial.from_grouped(*parts.merged(), query.shape[1])

    def fused_middle_into(self, block: MiddleBlock, ctx: StepContext, parts: step_parts.StepParts) -> None:
        """`fused_middle_partial`, written into ``parts`` (its query grouped, in the model's channel order: RoPE
        pairs as two halves)."""
        factors, arrays = self.key_factors(block), self.block_arrays(block)
        frames = cos_t = sin_t = None
        if self.cfg.rope_frame > 1:         # each frame's queries projected once: no key rebuilt
            frames = self.shared.frames(ctx, block.start, block.covers)
        else:
            cos_t, sin_t = self.shared.channel_rope(ctx, block.start, block.covers)
        rows = None if block.kept is None else block_attention.set_bit_positions(block.kept, block.span)
        k_entries, group = block.v_codebook.shape
        scaled = (factors.scaled_bases_t(block.keys) if arrays.bases is None else
                  block_attention.scaled_bases(arrays.bases, factors.factor, factors.column))
        parts.code(arrays.scopes, self.run_layout(block), scaled, factors.mean, cos_t, sin_t, arrays.hidden,
                   arrays.v_codes, int(math.log2(k_entries)), self.d // group, rows, block.v_codebook, block.v_scale,
                   self.shared.rotation.matrix(block.v_codes.device), block.v_mean, frames)

    def block_arrays(self, block: MiddleBlock) -> BlockArrays:
        """Numpy views of what the CPU fast path's kernels read of ``block`` (`BlockArrays`), made on first use
        and kept on the block (`MiddleBlock.derived`): a few calls each per layer and step otherwise."""
        derived = block.derived
        if derived.arrays is None:
            derived.arrays = BlockArrays.of(block)
        return derived.arrays

    def key_factors(self, block: MiddleBlock) -> BasisFactors:
        """The block's `BasisFactors` (the fast path's per-scope factors), built on first use and kept on the
        block (`MiddleBlock.derived`, counted in `breakdown`)."""
        if block.derived.key_factors is None:
            block.derived.key_factors = BasisFactors.of(block.keys)
        return block.derived.key_factors

    def run_layout(self, block: MiddleBlock) -> RunLayout:
        """The block's `RunLayout` (its key codes' runs as integers, tens of bytes), built on first use and kept
        on the block (`MiddleBlock.derived`): rebuilt after a block is copied or loaded."""
        if block.derived.runs is None:
            block.derived.runs = run_layout(block.keys)
        return block.derived.runs

    def fused_stream_partial(self, query: torch.Tensor, scaling: float) -> Partial:
        """The stream's partial from `stream.turbo_attention`: one pass over its codes (`stream.turbo_supported`)."""
        qg = group_queries(query.float(), self.h_kv)
        out, lse = stream.turbo_attention(self.shared.turbo, qg, self.stream.keys, self.stream.values, scaling,
                                          self.stream.centre)
        return Partial.from_grouped(out, lse, query.shape[1])
