"""A Shard layer's attention on the GPU path (Triton, `kvshrink.kernels.shard_code_attention`): each middle block
and the stream straight from their codes, with the inputs the kernels read built once per block. The kernels are
trusted on a device once a fresh layer of the same options has answered the same through them as through the
torch path (`kvshrink.kernels.selfcheck`, one check of the whole step: see there why)."""

from __future__ import annotations

import copy
import math

import torch

from kvshrink.cache.attention import Partial, group_queries
from kvshrink.cache.base import StepContext
from kvshrink.cache.probe import step_trusted
from kvshrink.codecs.rope import pair_order
from kvshrink.codecs.table_decoder import SlotPlan, slot_plan
from kvshrink.kernels import backend
from kvshrink.methods.shard import reference
from kvshrink.methods.shard.segments import MiddleBlock, stack_scopes


class GpuAttention:
    """`ShardLayer`'s GPU path: the Triton kernels' partials and their inputs, kept on the blocks."""

    # set on the self-check's probe layers only: True runs the kernels unchecked, False takes the torch path
    kernels_verdict: bool | None = None

    def use_triton_kernel(self, query: torch.Tensor) -> bool:
        """The GPU path (`kernels.backend.gpu_path`) takes the Triton kernels (middle blocks, the stream and its
        encoder) whatever ``kernel`` says, when Triton imports and they agree with the torch path on this device
        (`kernels_trusted`): the reference path syncs with the host (table bounds) and ``kernel`` chooses between
        CPU implementations; the reference stays callable as the oracle (`reference_middle_partials`)."""
        return backend.gpu_path(query) and backend.triton_available() and self.kernels_trusted(query.device)

    def kernels_trusted(self, device: torch.device) -> bool:
        """Whether a Shard step through the Triton kernels agrees with the torch path on ``device``: a fresh layer
        of these options (its own copy of the shared codebooks and rotations) through sinks, one middle block and
        the window, then three decode steps (the stream encoded, then read), both ways (`cache.probe`)."""
        cfg = self.cfg
        return step_trusted(self, "shard_step", device, cfg, lambda: type(self)(self.spec, copy.deepcopy(self.shared)),
                            cfg.sinks + cfg.min_block + cfg.window + 2)

    def triton_middle_partial(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> Partial:
        """The block's partial from the Triton kernels (`kernels.shard_code_attention.block_attention`): the
        same result as `fused_middle_partial`, on any device, with no host synchronisation and nothing but
        its three kernels launched once the block's `BlockInputs` are built (first use, kept on the block).
        Query rows are taken in slices whose scores stay under ``reference.SCORE_ELEMENTS`` (prefill-with-past)."""
        from kvshrink.kernels import shard_code_attention as sca

        qg = group_queries(query, self.h_kv)        # the model's channel order: the kernel pairs them
        inputs = self.block_inputs(block)
        cos, sin = self.shared.pair_rope(ctx, block.start, block.covers, self.block_rows(block))
        b, _, r, _ = qg.shape
        step = max(1, min(r, reference.SCORE_ELEMENTS // max(1, b * self.h_kv * block.n)))
        rotation = self.shared.rotation.matrix(qg.device, torch.float32)
        parts = [sca.block_attention(inputs, cos, sin, qg[:, :, start:start + step], ctx.scaling, rotation)
                 for start in range(0, r, step)]
        out, lse = (torch.cat(x, dim=2) if len(x) > 1 else x[0] for x in zip(*parts))
        return Partial.from_grouped(out, lse, query.shape[1])

    def block_inputs(self, block: MiddleBlock):
        """The block's `kernels.shard_code_attention.BlockInputs`, built on first use and kept on the block
        (`MiddleBlock.derived`, counted in `breakdown`): its scopes' codes and int8 bases stacked in place
        (`stack_scopes`: no second copy), the bit layout, the small basis factors, the held rows as bits,
        the value codebook and scales in float32."""
        from kvshrink.kernels import shard_code_attention as sca

        derived = block.derived
        if derived.gpu is None:
            device = block.v_codes.device
            codes, basis_q = stack_scopes(block.keys)
            plan = sca.component_plan(self.slot_plan(block), max(code.rank for code in block.keys), device)
            held = None if block.salient is None else sca.held_bits(block.salient.index, block.n)
            k_entries, group = block.v_codebook.shape
            derived.gpu = sca.BlockInputs(codes, plan, sca.stored_basis(block.keys, basis_q), held, block.v_codes,
                                          int(math.log2(k_entries)), self.d // group, block.v_codebook.float(),
                                          block.v_scale.float(),
                                          None if block.v_mean is None else block.v_mean.float())
        return derived.gpu

    def block_rows(self, block: MiddleBlock) -> torch.Tensor | None:
        """`MiddleBlock.rows`, kept on the block after the first call (found with a host sync once per
        block, not per step; set when the block is made when it is made on the GPU path)."""
        if block.kept is None:
            return None
        if block.derived.rows is None:
            block.derived.rows = block.rows()
        return block.derived.rows

    def slot_plan(self, block: MiddleBlock) -> SlotPlan:
        """The block's `SlotPlan` in the decoded columns' order (RoPE pairs per head), from which the GPU
        path's component plan is built once (not kept: `block_inputs` keeps what the kernels read)."""
        pairs = pair_order(self.d, device=block.v_codes.device)
        columns = torch.cat([h * self.d + pairs for h in range(self.h_kv // len(block.keys))])
        return slot_plan(block.keys, columns=columns)

    def triton_stream_partial(self, query: torch.Tensor, scaling: float) -> Partial:
        """The stream's partial from the Triton kernels: scores and weighted sums straight from the codes, nothing
        decoded."""
        from kvshrink.kernels.shard_code_attention import turbo_attention

        out, lse = turbo_attention(self.shared.turbo, group_queries(query, self.h_kv), self.stream.keys,
                                   self.stream.values, scaling, self.stream.centre)
        return Partial.from_grouped(out, lse, query.shape[1])
