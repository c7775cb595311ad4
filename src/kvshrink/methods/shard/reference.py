"""A Shard layer's attention in torch ops, the oracle of the fast paths (``kernel="reference"``, and any device
without the kernels): the middle blocks' keys rebuilt from their codes a slice of tokens at a time, values from the
VQ codes, the stream decoded; and every stored token rebuilt for tests."""

from __future__ import annotations

import math

import torch

from kvshrink.cache.attention import Partial, group_queries
from kvshrink.cache.base import StepContext
from kvshrink.codecs.bitpack import unpack_bits
from kvshrink.codecs.rope import apply_rope_paired, pair_order
from kvshrink.codecs.table_decoder import TableDecoder
from kvshrink.methods.shard.segments import MiddleBlock

# Score elements per block of middle tokens (bounds the transient memory of prefill-with-past).
SCORE_ELEMENTS = 1 << 22


def _softmax_part(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probabilities, log-sum-exp)`` of ``scores [..., n]`` over the last dim."""
    lse = torch.logsumexp(scores, dim=-1)
    # a row whose tokens are all masked (salient rows held exact) has lse -inf and contributes nothing
    return torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)), lse


class ReferenceAttention:
    """`ShardLayer`'s reference path: attention over the codes in torch ops."""

    def reference_middle_partials(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        qg = group_queries(query.float(), self.h_kv)  # [B, H_kv, R, d]
        qg = qg[..., pair_order(self.d, device=qg.device)]  # the keys come in RoPE pair order
        b, _, r, _ = qg.shape
        step = max(64, min(self.cfg.block_tokens, SCORE_ELEMENTS // max(1, b * self.h_kv * r)))
        parts = []
        decoder = self.key_decoder(block)
        hidden = None if block.salient is None else block.salient.hidden(block.n)
        rows = block.rows()
        for start in range(0, block.n, step):
            stop = min(block.n, start + step)
            keys = self.middle_keys(block, start, stop, ctx, paired=True, decoder=decoder, rows=rows)
            scores = qg @ keys.transpose(-1, -2) * ctx.scaling
            if hidden is not None:
                scores.masked_fill_(hidden[..., start:stop], float("-inf"))
            probs, lse = _softmax_part(scores)
            out = self.middle_values(block, probs, start, stop)
            parts.append(Partial.from_grouped(out, lse, query.shape[1]))
        return parts

    def key_decoder(self, block: MiddleBlock) -> TableDecoder:
        """The decoder of ``block``'s key codes (lookup tables built once), giving each head's channels
        in RoPE `pair_order` (a free permutation of the basis) so RoPE is one complex product."""
        pairs = pair_order(self.d, device=block.v_codes.device)
        columns = torch.cat([h * self.d + pairs for h in range(self.h_kv // len(block.keys))])
        # the tables' bound (a float of the codes alone) is kept on the block: found once, not every step
        decoder = TableDecoder(block.keys, columns=columns, table_dtype=torch.float16, bound=block.derived.table_bound)
        block.derived.table_bound = decoder.bound
        return decoder

    def middle_keys(self, block: MiddleBlock, start: int, stop: int, ctx: StepContext,
                    paired: bool = False, decoder: TableDecoder | None = None,
                    rows: torch.Tensor | None = None) -> torch.Tensor:
        """Post-RoPE keys ``[B, H_kv, n, d]`` of block rows ``start:stop``, rebuilt from the codes;
        ``paired=True`` returns each head's channels in RoPE pair order (score them against queries
        in the same order), else in the model's order."""
        pre = (decoder or self.key_decoder(block))(start, stop)     # [B, scopes, n, H*d/scopes]
        if pre.shape[1] != self.h_kv:                                # one PCA over the layer
            b, _, n, _ = pre.shape
            pre = pre.reshape(b, n, self.h_kv, self.d).transpose(1, 2)
        if block.kept is None:
            phases = self.shared.phases(ctx, block.start + start, stop - start)
        else:
            rows = block.rows() if rows is None else rows
            phases = self.shared.phases(ctx, block.start, block.covers, rows[start:stop])
        keys = apply_rope_paired(pre, phases)
        return keys if paired else keys[..., torch.argsort(pair_order(self.d, device=keys.device))]

    def middle_values(self, block: MiddleBlock, probs: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``probs [B, H_kv, R, n] @ V[start:stop]`` ``[B, H_kv, R, d]`` from the VQ codes and the block's mean."""
        coded = self.coded_values(block, probs, start, stop)
        if block.v_mean is None:
            return coded
        return coded + probs.sum(-1, keepdim=True) * block.v_mean.float()[None, :, None, :]

    def coded_values(self, block: MiddleBlock, probs: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``probs [B, H_kv, R, n]`` times the values' VQ codes ``[start:stop]`` (less the block's mean)."""
        k_entries, group = block.v_codebook.shape
        n_groups = self.d // group
        idx = unpack_bits(block.v_codes[:, :, start:stop], int(math.log2(k_entries)), n_groups)  # [B,H,n,G]
        codebook = block.v_codebook.float()
        b, h, r, n = probs.shape
        if r * n_groups <= 2 * self.d:
            # Code domain: sum the probabilities per codeword and group, then one small product.
            flat = idx + torch.arange(n_groups, device=idx.device) * k_entries
            flat = flat.reshape(b, h, 1, n * n_groups).expand(b, h, r, n * n_groups)
            src = probs.unsqueeze(-1).expand(b, h, r, n, n_groups).reshape(b, h, r, n * n_groups)
            bins = torch.zeros(b, h, r, n_groups * k_entries, device=probs.device, dtype=probs.dtype)
            bins.scatter_add_(-1, flat, src)
            return self.values_from_bins(block, bins)
        values = codebook[idx].reshape(b, h, n, self.d)
        return self.unscale_values(block, probs @ values)

    def values_from_bins(self, block: MiddleBlock, bins: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, H_kv, R, d]`` from the probabilities summed per value group and codeword
        ``bins [B, H_kv, R, groups * entries]``: one product with the codebook."""
        k_entries = block.v_codebook.shape[0]
        b, h, r, _ = bins.shape
        rotated = bins.reshape(b, h, r, -1, k_entries) @ block.v_codebook.float()
        return self.unscale_values(block, rotated.reshape(b, h, r, self.d))

    def unscale_values(self, block: MiddleBlock, rotated: torch.Tensor) -> torch.Tensor:
        """Rotated, scaled value sums ``[B, H_kv, R, d]`` -> in the model's value space."""
        return self.shared.rotation.unrotate(rotated * block.v_scale.float()[None, :, None, :])

    def dequantized(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every stored token rebuilt in float32: ``(keys, values [B, H_kv, n, d], index [n])``.

        For tests and debugging only (attention never does this): exact attention over these
        tensors is what `past_partials` computes blockwise from the packed store.
        """
        keys, values, index = [], [], []
        device = ctx.offset.device
        for run in (self.sinks,):
            if len(run):
                keys.append(run.keys.float()), values.append(run.values.float())
                index.append(run.token_index())
        for block in self.blocks():
            k = self.middle_keys(block, 0, block.n, ctx)
            b, h = block.v_codes.shape[:2]
            eye = torch.eye(block.n, device=device).expand(b, h, block.n, block.n)
            v = self.middle_values(block, eye, 0, block.n)
            if block.salient is not None:
                rows = block.salient.index.long().unsqueeze(-1).expand(-1, -1, -1, self.d)
                held_k, held_v = block.salient.key_values(torch.float32)
                k = k.scatter(2, rows, held_k)
                v = v.scatter(2, rows, held_v)
            keys.append(k), values.append(v)
            index.append(block.token_index(device))
        if self.stream.n:
            centre = (0.0, 0.0) if self.stream.centre is None else (self.stream.centre_of(0), self.stream.centre_of(1))
            keys.append(self.shared.turbo.decode(self.stream.keys) + centre[0])
            values.append(self.shared.turbo.decode(self.stream.values) + centre[1])
            index.append(self.stream.index(device))
        if len(self.window):
            keys.append(self.window.keys.float()), values.append(self.window.values.float())
            index.append(self.window.token_index())
        return torch.cat(keys, 2), torch.cat(values, 2), torch.cat(index)

    def reference_stream_partial(self, query: torch.Tensor, scaling: float) -> Partial:
        """The stream's partial in torch ops: its codes' inner products with the rotated queries, the softmax, the
        probability-weighted sum of its value codes, and the centres added back."""
        turbo = self.shared.turbo
        qg = group_queries(query.float(), self.h_kv)
        probs, lse = _softmax_part(turbo.inner_products(qg, self.stream.keys) * scaling)
        out = turbo.weighted_sum(probs, self.stream.values)
        if self.stream.centre is not None:   # the centres added back: q . centre to every score, to the output
            key_centre, value_centre = self.stream.centre_of(0), self.stream.centre_of(1)
            lse = lse + (qg @ key_centre.transpose(-1, -2)).squeeze(-1) * scaling
            out = out + value_centre
        return Partial.from_grouped(out, lse, query.shape[1])
