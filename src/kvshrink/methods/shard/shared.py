"""`ShardShared`: what the layers of one Shard cache share (quantizers, codebooks, per-layer key
budgets) and the per-step memo of RoPE tables."""

from __future__ import annotations

import torch

from kvshrink.cache.base import StepContext
from kvshrink.codecs.hadamard import RandomRotation
from kvshrink.codecs.lloyd_max import TurboQuantizer
from kvshrink.codecs.bit_allocation import PCA_BITS
from kvshrink.codecs.rope import rope_phases
from kvshrink.codecs.scalar_levels import unit_levels
from kvshrink.codecs.vq import gaussian_codebook
from kvshrink.kernels.backend import gpu_path, triton_available
from kvshrink.kernels.cpu import first_use, vq_search
from kvshrink.methods.shard.config import ShardConfig


class ShardShared:
    """State shared by the layers of one cache: quantizers, codebooks, per-layer key budgets, and a
    per-step memo of RoPE tables (the middle's positions are the same in every layer; its keys' RoPE is that of
    their frames, `rope_frame`)."""

    def __init__(self, cfg: ShardConfig, num_layers: int, head_dim: int, num_kv_heads: int):
        self.cfg = cfg
        self.rotation = RandomRotation(head_dim, cfg.seed)
        self.turbo = TurboQuantizer(head_dim, cfg.stream_bits, qjl=cfg.qjl, seed=cfg.seed + 1)
        self.v_codebook = gaussian_codebook(cfg.v_group, cfg.v_codebook, seed=cfg.seed, assign=vq_search.assign_codes)
        # the cold tokens' codebook (cold > 0): as many entries over more channels, fewer bits per value
        self.cold_codebook = gaussian_codebook(cfg.cold_group(head_dim), cfg.v_codebook, seed=cfg.seed,
                                               assign=vq_search.assign_codes) if cfg.cold > 0 else None
        self.layer_key_bits: list[float] = [cfg.key_bits] * num_layers
        # The key coefficient levels of every width the bit allocation may pick, computed now (once per
        # process) rather than inside the first prompt's prefill.
        for bits in PCA_BITS[1:]:
            unit_levels(bits, cfg.k_levels)
        self.num_layers = num_layers
        # Without numba, or while its kernels compile in the background on a machine's first use, the fast
        # path is the torch ops (the same answers, slower) for this cache's whole life, as LRQK's kernel option.
        self.fast = cfg.kernel == "fast" and first_use.prepare("shard", "kvshrink.kernels.cpu.warm_up:shard",
                                                               cfg.pca_scopes(num_kv_heads))
        if self.fast:
            if cfg.v_fit == "gaussian":  # the codebook every block uses, as the blocks store it (float16)
                vq_search.index_codebook(self.v_codebook.to(torch.float16))
                if self.cold_codebook is not None:
                    vq_search.index_codebook(self.cold_codebook.to(torch.float16))
        self._rope_ctx: StepContext | None = None
        self._rope_memo: dict[tuple, object] = {}

    def framed(self, positions: torch.Tensor) -> torch.Tensor:
        """The RoPE positions the middle's keys are coded at: each position rounded down to its `rope_frame`."""
        frame = self.cfg.rope_frame
        return positions if frame == 1 else positions - positions % frame

    def frames(self, ctx: StepContext, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The frames of token indices ``start .. start+n-1``, memoised per step: ``(index [B, n]`` int32, each
        token's frame counted from the row's first, ``cos, sin [B, F, d/2]`` float32, each frame's RoPE per pair)."""
        def make():
            device, frame = ctx.offset.device, self.cfg.rope_frame
            first_frame = ctx.positions(torch.arange(start, start + n, device=device)) // frame   # [B, n]
            index = first_frame - first_frame[:, :1]
            count = int(index.max()) + 1 if n else 0
            starts = (first_frame[:, :1] + torch.arange(count, device=device)) * frame             # [B, F]
            angles = starts.float()[..., None] * ctx.rope_frequencies(device)                       # [B, F, d/2]
            return index.to(torch.int32), angles.cos(), angles.sin()

        return self._memo(ctx, ("frames", start, n), make)

    def rope(self, ctx: StepContext, start: int, n: int,
             rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[B, n, d]`` of token indices ``start .. start+n-1``, memoised per step;
        of ``start + rows`` when ``rows`` is given."""
        cos, sin = self._memo(ctx, ("cos_sin", start, n), lambda: self._cos_sin(ctx, start, n))
        if rows is None:
            return cos, sin
        rows = rows.to(cos.device)
        return cos.index_select(1, rows), sin.index_select(1, rows)

    def phases(self, ctx: StepContext, start: int, n: int, rows: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE rotations ``[B, 1, n, d/2]`` (complex) of token indices ``start .. start+n-1`` (memoised:
        every layer's block covers the same tokens), or of ``start + rows`` when ``rows`` is given."""
        phases = self._memo(ctx, ("phases", start, n), lambda: rope_phases(*self.rope(ctx, start, n)).unsqueeze(1))
        return phases if rows is None else phases.index_select(2, rows.to(phases.device))

    def pair_rope(self, ctx: StepContext, start: int, n: int,
                  rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[B, n, d/2]`` of each RoPE pair (the fused kernel's layout), memoised;
        of ``start + rows`` when ``rows`` is given."""
        def make():
            if gpu_path(ctx.offset) and triton_available():  # one launch, not a dozen small ops
                from kvshrink.kernels.shard_code_attention import pair_rope

                return pair_rope(ctx.rope_frequencies(ctx.offset.device), ctx.offset, start, n, self.cfg.rope_frame)
            phases = self.phases(ctx, start, n)[:, 0]
            return phases.real.contiguous(), phases.imag.contiguous()

        cos, sin = self._memo(ctx, ("pair_rope", start, n), make)
        if rows is None:
            return cos, sin
        rows = rows.to(cos.device)
        return cos.index_select(1, rows), sin.index_select(1, rows)

    def channel_rope(self, ctx: StepContext, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[B, d/2, n]`` of each RoPE pair, channel-major (the CPU fast path's layout:
        a pair's tokens contiguous), memoised: every layer's block covering the span reads the same tables."""
        def make():   # `StepContext.rope`'s angles of one half, channel-major: no complex tensor or transpose
            device = ctx.offset.device
            positions = self.framed(ctx.positions(torch.arange(start, start + n, device=device))).float()  # [B, n]
            angles = ctx.rope_frequencies(device)[None, :, None] * positions[:, None, :]          # [B, d/2, n]
            return angles.cos(), angles.sin()

        return self._memo(ctx, ("channel_rope", start, n), make)

    def _cos_sin(self, ctx: StepContext, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rope_of(ctx, torch.arange(start, start + n, device=ctx.offset.device))

    def rope_of(self, ctx: StepContext, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[B, n, d]`` of token indices ``index [n]`` at their frames' positions (not
        memoised)."""
        cos, sin = ctx.rope(self.framed(ctx.positions(index)))
        return cos.float(), sin.float()

    def _memo(self, ctx: StepContext, key: tuple, make):
        if self._rope_ctx is not ctx:
            self._rope_ctx, self._rope_memo = ctx, {}
        if key not in self._rope_memo:
            self._rope_memo[key] = make()
        return self._rope_memo[key]

    def end_of_step(self) -> None:
        self._rope_ctx, self._rope_memo = None, {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rope_ctx": None, "_rope_memo": {}}  # one step's memo is not state
