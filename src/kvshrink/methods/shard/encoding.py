"""How a Shard layer codes the tokens that leave its window: the key bit budget (components per PCA scope, bits
per component, query-weighted columns), the middle blocks (PCA keys, VQ values, salient rows, evicted and cold
tokens) and the evicted tokens held until the prompt proves to end with its question."""

from __future__ import annotations

import math

import torch

from kvshrink.cache.attention import group_queries
from kvshrink.cache.base import StepContext
from kvshrink.cache.store import held_bytes
from kvshrink.codecs.bit_allocation import allocate_bits, group_sizes, group_variances
from kvshrink.codecs.bitpack import pack_bits
from kvshrink.codecs.pca import PCACode, encode_pca, fit_pca
from kvshrink.codecs.rope import undo_rope
from kvshrink.codecs.vq import fit_codebook
from kvshrink.kernels import backend
from kvshrink.kernels.cpu import levels, vq_search
from kvshrink.methods.shard.salient import most_read, pick_salient, pooled, tokens_to_keep
from kvshrink.methods.shard.segments import EvictedTokens, MiddleBlock

# Floor of a channel's relative query energy in key_weights="query" (its error weight is never zero).
_MIN_QUERY_WEIGHT = 1e-2

# Default PCA components per scope: one per this many bits of its key budget. Measured on the 8K perplexity
# text (KL to full): fewer components at more bits each beat the squared-error-optimal allocation over all
# of them at 1.5, 2 and 2.5 bits per element (docs/methods/shard.md), and the product that rebuilds
# the keys shrinks with them.
_BITS_PER_COMPONENT = 4

# Tokens of one head whose values are rotated and coded at once (bounds compression's transient memory).
_VALUE_ROWS = 2048


def kept_rows(x: torch.Tensor, rows: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``x`` itself, or its ``rows`` along ``dim`` (a block's tokens that were not evicted)."""
    return x if rows is None else x.index_select(dim, rows)


class ShardEncoding:
    """`ShardLayer`'s encoding: the compression of tokens leaving the window into middle blocks (its state, in
`layer.ShardLayer`)."""

    def key_bits_per_component(self, spectra: list[torch.Tensor], bits: float | None = None) -> list[list[int]]:
        """Bits per component of each PCA scope: one DP over the groups of all scopes of the layer
        under the layer's budget (``bits``, by default ``layer_key_bits``, times ``H_kv * d`` bits per token)."""
        bits = self.shared.layer_key_bits[self.layer_idx] if bits is None else bits
        dim = self.h_kv * self.d
        scope_dim = dim // len(spectra)
        group = self.cfg.pca_group or max(1, scope_dim // 16)
        sizes = [group_sizes(v.shape[0], group) for v in spectra]
        variances = [g for v, sz in zip(spectra, sizes) for g in group_variances(v, sz)]
        flat_sizes = [s for sz in sizes for s in sz]
        budget = int(round(bits * dim))
        bits = iter(allocate_bits(variances, flat_sizes, budget, drop_penalty=self.cfg.drop_penalty,
                                  levels=self.cfg.k_levels))
        return [[b for s in sz for b in [next(bits)] * s] for sz in sizes]

    def key_rank(self, width: int, bits: float | None = None) -> int:
        """PCA components fitted per scope of ``width`` columns: ``rank``, or by default one per
        `_BITS_PER_COMPONENT` bits of the scope's budget (``bits`` per element, by default the layer's: the bit
        allocation then spreads the budget over them)."""
        if self.cfg.rank:
            return min(self.cfg.rank, width)
        budget = (self.shared.layer_key_bits[self.layer_idx] if bits is None else bits) * width
        return max(1, min(width, int(budget // _BITS_PER_COMPONENT)))

    def query_pair_energy(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[H_kv, d]``: mean squared query of each KV head's group per RoPE pair (both channels of a
        pair alike: RoPE only rotates within pairs, so this is position-free), over real tokens."""
        qg = group_queries(query.float(), self.h_kv).pow(2)                      # [B, H_kv, G*q, d]
        q = query.shape[2]
        real = torch.ones(query.shape[0], q, device=qg.device)
        if ctx.pad_len is not None:
            real = (ctx.new_index[None, -q:] >= ctx.pad_len[:, None]).float().to(qg.device)
        real = real.repeat(1, qg.shape[2] // q)[:, None, :, None]               # rows are (group, token)
        energy = (qg * real).sum((0, 2)) / real.sum().clamp_min(1)
        half = self.d // 2
        pair = (energy[:, :half] + energy[:, half:]) / 2
        return torch.cat([pair, pair], dim=-1)

    def key_column_scale(self, width: int) -> torch.Tensor | None:
        """Per scope column, what the pre-RoPE keys are divided by before PCA: ``1/sqrt(weight)``, so
        the PCA and the bit allocation minimise the query-weighted error (fp16, as stored)."""
        energy = self._query_energy
        if self.cfg.key_weights != "query" or energy is None:
            return None
        weight = (energy / energy.mean().clamp_min(1e-30)).clamp_min(_MIN_QUERY_WEIGHT)
        return weight.rsqrt().reshape(-1, width).to(torch.float16)             # [scopes, width]

    def compress_block(self, key: torch.Tensor, value: torch.Tensor, start: int, ctx: StepContext
                       ) -> tuple[list[MiddleBlock], EvictedTokens | None]:
        """The chunk's middle tokens ``start ..`` coded as a block (two when ``cold`` splits off its least-read
        tokens: see `hot_tokens`), and, when ``evict`` drops some, the dropped ones uncoded: the caller holds them until it knows whether the prompt ended with its question (see
        `settle_unread`)."""
        observers, self._observers = self._observers, None  # this chunk's; a later chunk brings its own
        importance = read = None
        if observers is not None and (self.cfg.salient > 0 or self.cfg.evicts):
            read = most_read(observers, key, ctx.scaling)
            importance = pooled(read, self.cfg.salient_pool)
            read = read if self.cfg.salient_read > 0 else None
        keep = None
        if importance is not None and self.cfg.evicts:
            keep = tokens_to_keep(importance, self.cfg.evict, self.tokens_to_store(key.shape[2], key.shape[0]))
            dropped = int((~keep).sum())
            # fewer than min_block tokens are not worth a block of their own (bases, scales): all stay
            keep = keep if dropped >= self.cfg.min_block else None
        hot = self.hot_tokens(importance, keep)
        # One helper call per block, so each block's full-size temporaries are freed before the next starts
        # (extra peak memory stays below one layer's prompt K+V; measured by a test).
        if hot is None:
            kept = [self.encode_block(key, value, start, ctx, keep, importance, read=read)]
        else:
            stored = key.shape[2] if keep is None else int(keep.sum())
            kept = [self.encode_block(key, value, start, ctx, hot, importance, salient_of=stored, read=read),
                    self.encode_block(key, value, start, ctx, ~hot if keep is None else keep & ~hot, None,
                                      cold=True)]
        if keep is None:
            return kept, None
        rows = (~keep).nonzero().squeeze(-1)
        dtype = self._window.dtype  # the dtype they left the window in: narrowing back is exact
        return kept, EvictedTokens(start, key.shape[2], rows, key.index_select(2, rows).to(dtype),
                                   value.index_select(2, rows).to(dtype), ctx)

    def hot_tokens(self, importance: torch.Tensor | None, keep: torch.Tensor | None) -> torch.Tensor | None:
        """``[span]`` bool: the stored tokens coded at the full budget when ``cold`` splits a block (the least-read
        ones, holding at most ``cold`` of every head's observed attention, go to a cold block); None when the
        block stays whole (``cold`` off, no observation, or either part below ``min_block`` tokens)."""
        if self.cfg.cold <= 0 or importance is None:
            return None
        stored = torch.ones(importance.shape[-1], dtype=torch.bool, device=importance.device) if keep is None \
            else keep
        rows = stored.nonzero().squeeze(-1)
        hot = torch.zeros_like(stored)
        hot[rows] = tokens_to_keep(importance.index_select(2, rows), self.cfg.cold)
        cold = int(stored.sum()) - int(hot.sum())
        if cold < self.cfg.min_block or int(hot.sum()) < self.cfg.min_block:
            return None
        return hot

    def tokens_to_store(self, span: int, batch: int) -> int | None:
        """The fewest of a new block's ``span`` middle tokens the layer stores when it evicts: as many as `ratio`'s
        target leaves room for (`tokens_within_ratio`), and no fewer than `keep_tokens` asks the layer to hold;
        None when neither bounds it (`evict`'s guard alone decides)."""
        floor = self.cfg.keep_tokens - self.tokens_held()     # keep_tokens=0: never above zero
        if self.cfg.ratio <= 0:
            return floor if floor > 0 else None
        return max(self.tokens_within_ratio(span, batch), floor)

    def tokens_held(self) -> int:
        """Tokens the layer holds besides a block being made (the exact ones, the compressed blocks, the stream;
        not the last prompt's evicted ones)."""
        return len(self.sinks) + len(self.window) + self.stream.n + sum(block.n for block in self.blocks())

    def tokens_within_ratio(self, span: int, batch: int) -> int:
        """How many of a new block's ``span`` middle tokens the layer can store and still hold ``ratio`` times
        fewer bytes than an fp16 cache of every token it covers (the evicted ones go once the prompt proves
        to end with its question). The block's bytes are estimated from the options: its codes and salient
        rows per token, and its bases, codebook, scales, kept-token map and the decode's float32 basis factors
        once; the cache's token ids (int64, kept to refuse another prompt) are charged to the layers alike."""
        dim = self.h_kv * self.d
        covered = self.seen  # every token so far, this block's included (evicted tokens are counted by fp16 too)
        target = batch * covered * dim * 4 / self.cfg.ratio                 # fp16 K and V: 4 bytes a channel
        target -= batch * covered * 8 / self.info.num_layers                # this layer's share of the token ids
        parts = self.breakdown()  # the last prompt's evicted tokens are not the layer's to keep
        held = sum(parts.values()) - parts["evicted"] - \
            sum(held_bytes(t) for block in self.unread for t in block.parts().values())
        width = dim if self.cfg.pca_scope == "layer" else self.d
        rank, scopes = self.key_rank(width), dim // width
        basis = width * rank + 2 * width + 2 * 2 * rank        # int8 basis, fp16 mean, fp16 scale and step
        factors = 4 * (rank + 2 * width)                        # `BasisFactors`, float32
        values = held_bytes([self.shared.v_codebook.half()]) + 2 * dim * (1 + self.cfg.v_centre)  # fp16 scales, means
        fixed = scopes * (basis + factors) + values + math.ceil(span / 8)   # + the kept-token bitmask
        per_vector = 4 + (2 * (self.d + 4) if self.cfg.salient_dtype == "int8"
                          else 2 * self.d * self._sinks.dtype.itemsize)
        per_token = batch * (dim * (self.shared.layer_key_bits[self.layer_idx] + self.cfg.v_bits_per_element) / 8
                             + self.cfg.salient * self.h_kv * per_vector)
        # Out of reach (a short prompt: its exact sinks and window alone take more; below two, `tokens_to_keep`
        # keeps two) is not an error: `evict`'s guard then decides how many go, as with no target.
        return int((target - held - fixed) // per_token)

    def encode_block(self, key: torch.Tensor, value: torch.Tensor, start: int, ctx: StepContext,
                     keep: torch.Tensor | None, importance: torch.Tensor | None, salient_of: int | None = None,
                     cold: bool = False, read: torch.Tensor | None = None) -> MiddleBlock:
        """A `MiddleBlock` of the tokens ``keep [span]`` marks (all when None), its salient rows the most
        important of them when ``importance [B, H_kv, span]`` is given (``salient`` of ``salient_of`` tokens when
        the block holds part of them: the hot part of a split; ``salient_read`` of them by the attention ``read``
        itself when given, see `pick_salient`); coded at the cold budget when ``cold``."""
        span, rows = key.shape[2], None if keep is None else keep.nonzero().squeeze(-1)
        bits = self.shared.layer_key_bits[self.layer_idx]
        if cold:
            bits *= self.cfg.cold_key_bits / self.cfg.key_bits
        # The block's rows are selected one head at a time inside the encoders: a copy of the layer's kept
        # K/V would double the compression's extra peak memory.
        keys = self.encode_keys(key, self.shared.rope(ctx, start, span), rows, bits)
        v_codes, codebook, scale, v_mean = self.encode_values(value, rows, self.shared.cold_codebook if cold else None)
        salient = None
        if self.cfg.salient > 0 and importance is not None:
            n = span if rows is None else rows.numel()
            fraction = self.cfg.salient if salient_of is None else min(1.0, self.cfg.salient * salient_of / n)
            salient = pick_salient(kept_rows(importance, rows, 2), key, value, fraction, self._sinks.dtype,
                                   rows, held=self.cfg.salient_dtype,
                                   read=None if read is None else kept_rows(read, rows, 2),
                                   read_share=self.cfg.salient_read)
        n = span if rows is None else rows.numel()
        kept = None if keep is None else pack_bits(keep.to(torch.uint8), 1)
        block = MiddleBlock(start=start, n=n, keys=keys, v_codes=v_codes, v_codebook=codebook, v_scale=scale,
                            v_mean=v_mean, salient=salient, kept=kept, span=span if kept is not None else 0)
        if rows is not None and backend.gpu_path(key):
            block.derived.rows = rows  # the decode steps' RoPE positions, without a sync on first use
        return block

    def encode_evicted(self, tokens: EvictedTokens) -> MiddleBlock:
        """The held evicted tokens as a block of their own (their own PCA fit, no salient rows): the block
        `encode_block` makes of them from the prompt's chunk, code for code."""
        key, value = tokens.key.float(), tokens.value.float()
        keys = self.encode_keys(key, self.shared.rope_of(tokens.ctx, tokens.rows + tokens.start))
        v_codes, codebook, scale, v_mean = self.encode_values(value)
        kept = torch.zeros(tokens.span, dtype=torch.uint8, device=tokens.rows.device)
        kept[tokens.rows] = 1
        block = MiddleBlock(start=tokens.start, n=tokens.rows.numel(), keys=keys, v_codes=v_codes, v_codebook=codebook,
                            v_scale=scale, v_mean=v_mean, kept=pack_bits(kept, 1), span=tokens.span)
        if backend.gpu_path(key):
            block.derived.rows = tokens.rows
        return block

    def encode_keys(self, key: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                    rows: torch.Tensor | None = None, bits: float | None = None) -> list[PCACode]:
        """Post-RoPE keys ``[B, H_kv, span, d]`` with their RoPE ``(cos, sin) [B, span, d]`` -> one `PCACode` per
        PCA scope of the pre-RoPE keys of all of them, or of the block rows ``rows`` only, at ``bits`` per key
        element (the layer's budget by default)."""
        bits = self.shared.layer_key_bits[self.layer_idx] if bits is None else bits
        b, h, _, d = key.shape
        n = key.shape[2] if rows is None else rows.numel()
        cos, sin = rope
        scopes = self.cfg.pca_scopes(h)
        width = h * d // scopes
        column_scale = self.key_column_scale(width)
        scales = [None] * scopes if column_scale is None else list(column_scale)

        def scope_rows(s: int) -> torch.Tensor:
            """Pre-RoPE keys of scope ``s`` ``[B, n, width]``, divided by its column scale."""
            if scopes == h:
                x = kept_rows(undo_rope(key[:, s], cos, sin), rows, 1)
            else:  # the heads side by side, each undone into its columns: one head's copy alive at a time
                x = torch.empty(b, n, h * d, dtype=torch.promote_types(key.dtype, cos.dtype), device=key.device)
                for head in range(h):
                    x[:, :, head * d:(head + 1) * d] = kept_rows(undo_rope(key[:, head], cos, sin), rows, 1)
            return x if scales[s] is None else x.div_(scales[s].float())

        rank = self.key_rank(width, bits)
        fits = [fit_pca(scope_rows(s).reshape(b * n, width), rank, seed=self.cfg.seed) for s in range(scopes)]
        widths = self.key_bits_per_component([f.variances for f in fits], bits)
        # RoPE is undone again rather than kept from the fits: one scope's keys are alive at a time
        return [encode_pca(scope_rows(s), fits[s], widths[s], levels=self.cfg.k_levels, column_scale=scales[s],
                           quantize=levels.quantize_unit)
                for s in range(scopes)]

    def encode_values(self, value: torch.Tensor, rows: torch.Tensor | None = None,
                      codebook: torch.Tensor | None = None
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Values ``[B, H_kv, span, d]`` (all rows, or the block rows ``rows`` only) -> packed VQ indices,
        the codebook (``codebook``'s group size, by default the shared `v_codebook`), per-(head, channel) scales
        and, with ``v_centre``, each head's mean ``[H_kv, d]`` (fp16) the codes are taken less of (else None).

        A head's values share a common part (2-54% of their energy on the embedded model and on Qwen2.5), which
        a codebook centred on zero spends its levels on; coding them less it cut the value error by 12%
        (SmolLM2) and 7% (Qwen2.5) at 2 bits (benchmarks/shard-ratio/value_error.py), and attention adds it
        back exactly.

        One head and ``_VALUE_ROWS`` tokens at a time (the rotation is redone rather than kept), so a
        layer's rotated values never exist at once; only ``v_fit="kmeans"`` rotates the whole layer to
        sample from it."""
        b, h, _, d = value.shape
        n = value.shape[2] if rows is None else rows.numel()
        codebook = (self.shared.v_codebook if codebook is None else codebook).to(value.device)
        group = codebook.shape[1]
        rotate = self.shared.rotation.rotate

        def head_rows(s: int):
            """``(first row, values [B, m, d])`` of head ``s``, block rows in chunks."""
            for i in range(0, n, _VALUE_ROWS):
                yield i, (value[:, s, i:i + _VALUE_ROWS] if rows is None else
                          value[:, s].index_select(1, rows[i:i + _VALUE_ROWS])).float()

        mean = torch.zeros(h, d, dtype=torch.float16, device=value.device)
        if self.cfg.v_centre:               # as stored (fp16): the codes are taken less of what decoding adds back
            mean = (torch.stack([sum(x.sum(dim=(0, 1)) for _, x in head_rows(s)) for s in range(h)])
                    / max(1, b * n)).to(torch.float16)

        def rotated(s: int):
            """``(first row, rotated values less the mean [B, m, d])`` of head ``s``, block rows in chunks."""
            for i, x in head_rows(s):
                yield i, rotate(x - mean[s].float() if self.cfg.v_centre else x)

        power = torch.stack([sum(x.pow(2).sum(dim=(0, 1)) for _, x in rotated(s)) for s in range(h)])
        scale = (power / (b * n)).sqrt().clamp_min(1e-6).to(torch.float16)            # [H, d]
        if self.cfg.v_fit == "kmeans":
            centred = kept_rows(value, rows, 2).float() - mean.float()[None, :, None, :]
            groups = rotate(centred).div_(scale.float()[None, :, None, :]).reshape(-1, group)
            codebook = fit_codebook(groups, self.cfg.v_codebook, iters=self.cfg.v_iters, sample=self.cfg.v_sample,
                                    seed=self.cfg.seed + self.layer_idx, init=codebook, assign=vq_search.assign_codes)
            del groups
        codebook = codebook.to(torch.float16)
        idx = torch.empty(b, h, n, d // group, dtype=torch.int32, device=value.device)
        for s in range(h):
            for i, x in rotated(s):
                groups = x.div_(scale[s].float()).reshape(-1, group)
                idx[:, s, i:i + x.shape[1]] = vq_search.assign_codes(groups, codebook.float(), out_dtype=torch.int32
                                                                     ).reshape(b, x.shape[1], d // group)
        return pack_bits(idx, int(math.log2(self.cfg.v_codebook))), codebook, scale, mean if self.cfg.v_centre else None
