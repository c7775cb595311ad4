"""`ShardLayer`: one decoder layer's Shard cache (sinks, compressed middle blocks, decode stream,
window), its blockwise attention over the codes and the compression of tokens leaving the window."""

from __future__ import annotations

import math

import torch

from kvshrink.cache.attention import Partial, exact_partial, group_queries, merge_partials, ungroup
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.record import Record, RecordReader, Schema
from kvshrink.cache.store import ExactStore, check_fp16_peak, exact_storage_dtype, held_bytes, to_storage
from kvshrink.codecs.bit_allocation import allocate_bits, group_sizes, group_variances
from kvshrink.codecs.bitpack import pack_bits, packed_size, unpack_bits
from kvshrink.codecs.pca import PCACode, encode_pca, fit_pca
from kvshrink.codecs.rope import apply_rope_paired, pair_order, undo_rope
from kvshrink.codecs.table_decoder import RunLayout, SlotPlan, TableDecoder, run_layout, slot_plan
from kvshrink.codecs.vq import fit_codebook
from kvshrink.kernels import backend
from kvshrink.kernels.cpu import (block_attention, encoders, exact_parts, levels, numba_support, step_parts, stream,
                                  vq_search)
from kvshrink.methods.shard.ring import ExactRing
from kvshrink.methods.shard.salient import observed_importance, pick_salient, salient_partials, tokens_to_keep
from kvshrink.methods.shard.segments import (BasisFactors, BlockArrays, EvictedTokens, MiddleBlock, TurboSegment,
                                             stack_scopes)
from kvshrink.methods.shard.shared import ShardShared

# Floor of a channel's relative query energy in key_weights="query" (its error weight is never zero).
_MIN_QUERY_WEIGHT = 1e-2

# Default PCA components per scope: one per this many bits of its key budget. Measured on the 8K perplexity
# text (KL to full): fewer components at more bits each beat the squared-error-optimal allocation over all
# of them at 1.5, 2 and 2.5 bits per element (docs/methods/shard.md), and the product that rebuilds
# the keys shrinks with them.
_BITS_PER_COMPONENT = 4

# Tokens of one head whose values are rotated and coded at once (bounds compression's transient memory).
_VALUE_ROWS = 2048

# Score elements per block of middle tokens (bounds the transient memory of prefill-with-past).
_SCORE_ELEMENTS = 1 << 22
# Most grouped query rows (query heads per KV head x new tokens) the fused kernel takes: decoding, not
# prefill-with-past, whose many rows the reference path blocks to bound memory.
_FAST_ROWS = 64


def _softmax_part(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probabilities, log-sum-exp)`` of ``scores [..., n]`` over the last dim."""
    lse = torch.logsumexp(scores, dim=-1)
    # a row whose tokens are all masked (salient rows held exact) has lse -inf and contributes nothing
    return torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)), lse


def kept_rows(x: torch.Tensor, rows: torch.Tensor | None, dim: int) -> torch.Tensor:
    """``x`` itself, or its ``rows`` along ``dim`` (a block's tokens that were not evicted)."""
    return x if rows is None else x.index_select(dim, rows)


def _host_index(start: int, stop: int) -> torch.Tensor:
    """Token indices ``start..stop-1`` on the host, carrying their first value for `store.first_index`
    (which then never reads a tensor element: no device round trip on the GPU path)."""
    index = torch.arange(start, stop)
    index.kvshrink_first = start
    return index


class ShardLayer(CacheLayer):
    split_batch_rows = True  # PCA bases, bit allocation and scales fitted per row
    def __init__(self, spec: LayerSpec, shared: ShardShared):
        super().__init__(spec)
        self.shared = shared
        self.cfg = shared.cfg
        self.h_kv, self.d = self.info.num_kv_heads, self.info.head_dim
        dtype = exact_storage_dtype(self.cfg.exact_dtype, self.info.dtype)
        self._sinks = ExactStore(dtype)
        self._window = ExactStore(dtype)
        self._ring: ExactRing | None = None              # sinks + window while decoding (see `ring_attend`)
        self.middle: list[MiddleBlock] = []
        # evict or ratio > 0: the last prompt's evicted tokens. The prompt ended with its question when a decode
        # step follows it directly; they are dropped then, and kept as middle blocks otherwise (see
        # `settle_unread`): a document compressed before its questions keeps every token. Held uncoded
        # (`evicted`) until then, since a question's prompt drops them unread: coding them would be half of
        # the compression's time; coded (`unread`) once forked or saved.
        self.evicted: list[EvictedTokens] = []
        self.unread: list[MiddleBlock] = []
        self.stream = TurboSegment()
        self.decoding = False
        self._query_energy: torch.Tensor | None = None   # key_weights="query": [H_kv, d] of the prompt
        self._observer: torch.Tensor | None = None       # salient > 0: the chunk's last queries, grouped
        self._sinks_len: int | None = None               # sinks + the prompt's most left padding

    def shared_on_fork(self) -> list:
        self.code_evicted()  # coded once, in the parent: every fork shares the blocks
        return self.middle + self.unread  # a compressed block is never changed once made

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.settle_unread(key_states.shape[2])
        return super().update(key_states, value_states, *args, **kwargs)

    def settle_unread(self, new_tokens: int) -> None:
        """The evicted tokens of the last prompt (`unread`) leave the cache when the step after that prompt
        decodes one token: the prompt ended with its question, whose last queries chose them as unread. A
        step of several tokens continues the prompt (a question asked after the document, another chunk):
        then they become middle blocks for good, since the new text may ask for them."""
        if not (self.unread or self.evicted):
            return
        if new_tokens > 1:
            self.code_evicted()
            self.middle += self.unread
        self.unread, self.evicted = [], []

    def code_evicted(self) -> None:
        """Code the held evicted tokens (`evicted`) as blocks still dropped by a decode step (`unread`)."""
        self.unread += [self.encode_evicted(tokens) for tokens in self.evicted]
        self.evicted = []

    def blocks(self) -> list[MiddleBlock]:
        """Every compressed block attention reads: the middle blocks and the unread ones still held."""
        return self.middle + self.unread if self.unread else self.middle

    # ---- the exact tokens: two stores, or one ring buffer while decoding -------------------------------
    @property
    def sinks(self) -> ExactStore:
        self.unpack_ring()
        return self._sinks

    @property
    def window(self) -> ExactStore:
        self.unpack_ring()
        return self._window

    def unpack_ring(self) -> None:
        """Back to the sinks and window stores in token order (any step but an unpadded decode step, and
        saving, copying, inspecting); the next decode step packs them again."""
        if self._ring is not None:
            self._sinks, self._window = self._ring.stores()
            self._ring = None

    def __getstate__(self) -> dict:
        # saved and copied as the two stores (the ring is a decode-time layout, rebuilt on the next step), the
        # evicted tokens coded (what they hold is unchanged; their step context is not state)
        self.unpack_ring()
        self.code_evicted()
        state = dict(self.__dict__)
        state.pop("_views", None)       # numpy views of this layer's buffers: a copy makes its own
        state["sinks"], state["window"] = state.pop("_sinks"), state.pop("_window")
        del state["_ring"]
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        state["_sinks"], state["_window"] = state.pop("sinks"), state.pop("window")
        self.__dict__.update(state, _ring=None)

    # ---- save / load (cache/record.py) ---------------------------------------------------------------------
    # A new stored field of the layer: its name in RECORD.meta (a JSON value) or a TensorSpec in RECORD.tensors;
    # of a middle block: `MiddleBlock.RECORD` (segments.py); of the stream: `TurboSegment.RECORD`.
    RECORD = Schema(meta=("seen", "decoding", "_sinks_len"), parts=("sinks", "window", "middle", "unread", "stream"))

    def to_record(self) -> Record:
        """The exact tokens as the two stores and the evicted tokens coded, as a fork sees them (`__getstate__`);
        this layer's key bit budget (global allocation: measured on the model when the cache was made)."""
        self.unpack_ring()
        self.code_evicted()
        record = self.RECORD.write(self, sinks=self._sinks.to_record(), window=self._window.to_record(),
                                   middle=[block.to_record() for block in self.middle],
                                   unread=[block.to_record() for block in self.unread], stream=self.stream.to_record())
        record.meta["key_bits"] = self.shared.layer_key_bits[self.layer_idx]
        return record

    def load_record(self, reader: RecordReader) -> None:
        for key, value in self.RECORD.read(reader).items():
            setattr(self, key, value)
        self.shared.layer_key_bits[self.layer_idx] = reader.meta("key_bits")
        self._sinks.load_record(reader.part("sinks"), self.info.dtype)
        self._window.load_record(reader.part("window"), self.info.dtype)
        exact = self._sinks.dtype
        self.middle = [MiddleBlock.from_record(block, exact) for block in reader.parts("middle")]
        self.unread = [MiddleBlock.from_record(block, exact) for block in reader.parts("unread")]
        self.stream = TurboSegment.from_record(reader.part("stream"))

    # ---- attention ---------------------------------------------------------------------------------
    def past_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        if ctx.q_len > 1 and self.cfg.key_weights == "query":
            self._query_energy = self.query_pair_energy(query, ctx)
        if ctx.q_len > 1 and (self.cfg.salient > 0 or self.cfg.evicts):
            self._observer = group_queries(query[:, :, -self.cfg.observe:].float(), self.h_kv)
        exact = self.exact_partial(query, ctx)
        parts = [exact] if exact is not None else []
        return parts + self.code_partials(query, ctx)

    def code_partials(self, query: torch.Tensor, ctx: StepContext,
                      into: step_parts.StepParts | None = None) -> list[Partial]:
        """The partials of the compressed segments: each middle block's, then the stream's; with ``into`` (the CPU
        fast path's decode step) those the numba kernels compute are written there instead."""
        parts = []
        for block in self.blocks():
            if into is not None:
                self.fused_middle_into(block, ctx, into)
            else:
                parts.extend(self.middle_partials(block, query, ctx))
        if self.stream.n:
            if into is not None and stream.turbo_supported(self.shared.turbo):
                into.turbo(self.shared.turbo, *self.stream_arrays(),
                           stream.centre_array(self.stream.centre, into.query.shape))
            else:
                parts.append(self.stream_partial(query, ctx.scaling))
        if self.layer_idx == self.info.num_layers - 1:
            self.shared.end_of_step()
        return parts

    # ---- a decode step on the ring --------------------------------------------------------------------
    def attend(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if not self.ring_step(ctx):
            self.unpack_ring()
            return super().attend(query, ctx)
        return self.ring_attend(query, ctx)

    def ring_step(self, ctx: StepContext) -> bool:
        """Whether this step decodes on the ring: one new token, no padding, the sinks complete (a prompt
        shorter than the sinks, or a step with several tokens, takes the generic path on the stores)."""
        if ctx.q_len != 1 or ctx.pad_len is not None or self._sinks_len is None or ctx.past_len < self._sinks_len:
            return False
        return self._ring is not None or (self._sinks.index is None and self._window.index is None)

    def ring_attend(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """`CacheLayer.attend` for a decode step on the ring: the same attention, with the sinks and the
        window read in place (one exact partial, plus the salient rows' own) and the new token written into
        its slot. When the exact dtype holds the new token unchanged (a 16-bit model) it is written first
        and attended from the ring; otherwise (fp32 keys, fp16 store) it is attended exactly, as the
        generic path does, and stored after."""
        key, value = self._pending
        self._pending = None
        ring = self.decode_ring(key, ctx)
        inside = ring.slots > self.cfg.window
        if inside:
            ring.put(key, value)
        if self.on_cpu_fast_path(query):
            out = self.fast_ring_attend(query, ctx, ring, None if inside else (key, value))
        else:
            salient = [block.salient for block in self.middle if block.salient is not None]
            # 8-bit salient codes are read in place on the GPU path (one kernel, not a dozen torch ops decoding
            # them); on CPU they are attended with the ring's tokens in one call (a few dozen rows per block: one
            # kernel and one partial fewer per block)
            gpu = backend.gpu_path(query)
            extra = [] if gpu else [tokens.key_values(ring.dtype) for tokens in salient]
            # on the GPU path the token the ring does not hold (an fp32 model's, unrounded) is attended in
            # the ring's launch: one exact kernel per layer, not two
            fold = not inside and gpu and backend.triton_available()
            parts = [part for part in (ring.partial(query, ctx.scaling, extra, (key, value) if fold else None),)
                     if part is not None]
            if not inside and not fold:
                parts.append(self._chunk_partial(query, key, value, ctx))
            parts += salient_partials(query, salient if gpu else [], ctx.scaling, ring.dtype)
            out = merge_partials(parts + self.code_partials(query, ctx), query.dtype).out
        self.decoding = True
        self.ring_commit(ring, None if inside else (key, value))
        return out.transpose(1, 2).contiguous()

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

    def decode_ring(self, key: torch.Tensor, ctx: StepContext) -> ExactRing:
        """The ring, packed from the sinks and window stores on the first decode step after anything else;
        one slot more than the window when the new token is attended from it (see `ring_attend`)."""
        if self._ring is None:
            slots = self.cfg.window + int(key.dtype == self._window.dtype)
            self._ring = ExactRing(self._sinks, self._window, slots, key, ctx.past_len)
            dtype = self._window.dtype
            self._sinks, self._window = ExactStore(dtype), ExactStore(dtype)
        return self._ring

    def ring_commit(self, ring: ExactRing, new: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Tokens beyond the window leave the ring for the stream (the oldest first); ``new`` (the step's
        key and value when not already in the ring) is stored after them."""
        if self.stream.centre is None and ring.count + (new is not None) > self.cfg.window:
            self.centre_stream(*self.ring_window(ring, new))
        if new is not None and self.ring_step_compiled(ring, *new):
            return
        while ring.count + (new is not None) > self.cfg.window and ring.count:
            self.stream_append(*ring.pop_oldest())
        if new is None:
            return
        if ring.slots:
            ring.put(*new)
        else:  # no window at all: the token goes straight to the stream, rounded as a stored one
            self.stream_append(torch.stack([to_storage(x, ring.dtype) for x in new]), ring.start)
            ring.start += 1

    @staticmethod
    def ring_window(ring: ExactRing, new: tuple[torch.Tensor, torch.Tensor] | None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values ``[B, H_kv, n, d]`` of the ring's window, then ``new`` (when not in the ring; rounded
        to the ring's dtype, as the window stores it)."""
        keys, values = (x.float() for x in ring.window())
        if new is not None:
            keys, values = (torch.cat([held, x.to(ring.dtype).float()], 2) for held, x in zip((keys, values), new))
        return keys, values

    def centre_stream(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """The stream's centre (`TurboSegment`), as its first tokens arrive: the mean of the exact window's keys
        and values ``[B, H_kv, n, d]`` (post-RoPE: the slowly turning channels, where a key projection's bias
        and outliers sit, keep their value over the tokens that follow; the fast ones average out). Zero for a
        stream already holding tokens coded without one."""
        centre = torch.stack([keys.float().mean(2), values.float().mean(2)])
        self.stream.centre = (torch.zeros_like(centre) if self.stream.n else centre).contiguous()

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

    def stream_append(self, both: torch.Tensor, index: int) -> None:
        """TurboQuant codes of tokens ``index ..`` (keys and values ``[2, B, H_kv, n, d]``, encoded together:
        half the small ops of a decode step's commit) added to the stream; on the GPU path (Triton) and the
        CPU fast path (numba) by one kernel writing into the stream's buffer."""
        turbo, n = self.shared.turbo, both.shape[-2]
        encode_into = None
        if not turbo.qjl and self.use_triton_kernel(both):
            from kvshrink.kernels.shard_code_attention import turbo_encode_into as encode_into
        elif self.on_cpu_fast_path(both) and stream.turbo_supported(turbo):
            encode_into = encoders.turbo_encode_into
        if encode_into is not None:
            buffer = self.stream.room(n, tuple(both.shape[1:-2]), packed_size(self.d, turbo.bits), both.device)
            encode_into(turbo, both, buffer.codes, buffer.norm, self.stream.n, self.stream.centre)
            self.stream.filled(index, n)
            return
        code = turbo.encode(both.float() - self.stream.centre.unsqueeze(-2))
        self.stream.append(code.select(0), code.select(1), index, n)

    def exact_partial(self, query: torch.Tensor, ctx: StepContext) -> Partial | None:
        """One exact attention over the sinks, the salient middle tokens and the window together (they
        are few: one kernel call and one partial to merge per layer and step)."""
        runs = [run for run in (self.sinks, self.window) if len(run)]
        salient = [block for block in self.middle if block.salient is not None]
        if not runs and not salient:
            return None
        if len(runs) == 1 and not salient:
            return runs[0].partial(query, ctx.scaling, ctx.pad_len)
        device = (runs[0].keys if runs else salient[0].salient.index).device
        keys, values, index = [], [], []
        for run in runs:
            keys.append(run.keys), values.append(run.values)
            index.append(run.token_index())
        for block in salient:
            # rows differ per head, but the index only serves the padding mask: middle tokens are never
            # padding, so the block's first index stands for all of them
            k, v = block.salient.key_values(self._sinks.dtype)
            keys.append(k), values.append(v)
            index.append(torch.full((block.salient.index.shape[-1],), block.start, device=device))
        return exact_partial(query, torch.cat(keys, dim=2), torch.cat(values, dim=2), ctx.scaling,
                             key_index=torch.cat(index), pad_len=ctx.pad_len)

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
        """``probs [B, H_kv, R, n] @ V[start:stop]`` ``[B, H_kv, R, d]`` from the VQ codes."""
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

    def middle_partials(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        if self.use_triton_kernel(query):
            return [self.triton_middle_partial(block, query, ctx)]
        if self.use_fast_kernel(query):
            return [self.fused_middle_partial(block, query, ctx)]
        return self.reference_middle_partials(block, query, ctx)

    def use_triton_kernel(self, query: torch.Tensor) -> bool:
        """The GPU path (`kernels.backend.gpu_path`) takes the Triton kernels (middle blocks and the stream)
        whatever ``kernel`` says, when Triton imports: the reference path syncs with the host (table
        bounds) and ``kernel`` chooses between CPU implementations; the reference stays callable as the
        oracle (`reference_middle_partials`)."""
        return backend.gpu_path(query) and backend.triton_available()

    def use_fast_kernel(self, query: torch.Tensor) -> bool:
        rows = query.shape[1] // self.h_kv * query.shape[2]
        return self.on_cpu_fast_path(query) and rows <= _FAST_ROWS

    def on_cpu_fast_path(self, x: torch.Tensor) -> bool:
        """Whether work on ``x`` takes the numba kernels: ``kernel="fast"``, a CPU tensor, the GPU path not forced."""
        return self.shared.fast and x.device.type == "cpu" and not backend.gpu_path(x)

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
        cos_t, sin_t = self.shared.channel_rope(ctx, block.start, block.covers)
        rows = None if block.kept is None else block_attention.set_bit_positions(block.kept, block.span)
        k_entries, group = block.v_codebook.shape
        scaled = (factors.scaled_bases_t(block.keys) if arrays.bases is None else
                  block_attention.scaled_bases(arrays.bases, factors.factor, factors.column))
        parts.code(arrays.scopes, self.run_layout(block), scaled, factors.mean, cos_t, sin_t, arrays.hidden,
                   arrays.v_codes, int(math.log2(k_entries)), self.d // group, rows, block.v_codebook, block.v_scale,
                   self.shared.rotation.matrix(block.v_codes.device))

    def block_arrays(self, block: MiddleBlock) -> BlockArrays:
        """Numpy views of what the CPU fast path's kernels read of ``block`` (`BlockArrays`), made on first use
        and kept on the block (`MiddleBlock.derived`): a few calls each per layer and step otherwise."""
        derived = block.derived
        if derived.arrays is None:
            derived.arrays = BlockArrays.of(block)
        return derived.arrays

    def triton_middle_partial(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> Partial:
        """The block's partial from the Triton kernels (`kernels.shard_code_attention.block_attention`): the
        same result as `fused_middle_partial`, on any device, with no host synchronisation and nothing but
        its three kernels launched once the block's `BlockInputs` are built (first use, kept on the block).
        Query rows are taken in slices whose scores stay under ``_SCORE_ELEMENTS`` (prefill-with-past)."""
        from kvshrink.kernels import shard_code_attention as sca

        qg = group_queries(query, self.h_kv)        # the model's channel order: the kernel pairs them
        inputs = self.block_inputs(block)
        cos, sin = self.shared.pair_rope(ctx, block.start, block.covers, self.block_rows(block))
        b, _, r, _ = qg.shape
        step = max(1, min(r, _SCORE_ELEMENTS // max(1, b * self.h_kv * block.n)))
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
                                          block.v_scale.float())
        return derived.gpu

    def block_rows(self, block: MiddleBlock) -> torch.Tensor | None:
        """`MiddleBlock.rows`, kept on the block after the first call (found with a host sync once per
        block, not per step; set when the block is made when it is made on the GPU path)."""
        if block.kept is None:
            return None
        if block.derived.rows is None:
            block.derived.rows = block.rows()
        return block.derived.rows

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

    def slot_plan(self, block: MiddleBlock) -> SlotPlan:
        """The block's `SlotPlan` in the decoded columns' order (RoPE pairs per head), from which the GPU
        path's component plan is built once (not kept: `block_inputs` keeps what the kernels read)."""
        pairs = pair_order(self.d, device=block.v_codes.device)
        columns = torch.cat([h * self.d + pairs for h in range(self.h_kv // len(block.keys))])
        return slot_plan(block.keys, columns=columns)

    def reference_middle_partials(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        qg = group_queries(query.float(), self.h_kv)  # [B, H_kv, R, d]
        qg = qg[..., pair_order(self.d, device=qg.device)]  # the keys come in RoPE pair order
        b, _, r, _ = qg.shape
        step = max(64, min(self.cfg.block_tokens, _SCORE_ELEMENTS // max(1, b * self.h_kv * r)))
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

    def stream_partial(self, query: torch.Tensor, scaling: float) -> Partial:
        turbo = self.shared.turbo
        if self.use_triton_kernel(query):
            # the Triton kernels: scores and weighted sums straight from the codes, nothing decoded
            from kvshrink.kernels.shard_code_attention import turbo_attention

            out, lse = turbo_attention(turbo, group_queries(query, self.h_kv), self.stream.keys, self.stream.values,
                                       scaling, self.stream.centre)
            return Partial.from_grouped(out, lse, query.shape[1])
        qg = group_queries(query.float(), self.h_kv)
        if self.use_fast_kernel(query) and stream.turbo_supported(turbo):
            out, lse = stream.turbo_attention(turbo, qg, self.stream.keys, self.stream.values, scaling,
                                             self.stream.centre)
            return Partial.from_grouped(out, lse, query.shape[1])
        probs, lse = _softmax_part(turbo.inner_products(qg, self.stream.keys) * scaling)
        out = turbo.weighted_sum(probs, self.stream.values)
        if self.stream.centre is not None:   # the centres added back: q . centre to every score, to the output
            key_centre, value_centre = self.stream.centre_of(0), self.stream.centre_of(1)
            lse = lse + (qg @ key_centre.transpose(-1, -2)).squeeze(-1) * scaling
            out = out + value_centre
        return Partial.from_grouped(out, lse, query.shape[1])

    # ---- storing ---------------------------------------------------------------------------------------
    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        q = key.shape[2]
        if q == 1:
            self.decoding = True
        first = ctx.past_len
        # With left padding the sinks are each row's first real tokens: keep every index below
        # max(pad) + sinks exact (padding included, masked in attention). Found once (the padding is the
        # prompt's): found in prefill, not with a host sync every decode step.
        if q > 1 or getattr(self, "_sinks_len", None) is None:
            self._sinks_len = self.cfg.sinks + (int(ctx.pad_len.max()) if ctx.pad_len is not None else 0)
        to_sinks = max(0, min(q, self._sinks_len - first))
        # token indices on the host: the stores read their first index (no device round trip); a store
        # holding explicit indices (never Shard's contiguous runs, but kept correct) takes them on its device
        explicit = self.sinks.index is not None or self.window.index is not None
        def index(start: int, stop: int) -> torch.Tensor:
            if explicit:
                return ctx.new_index[start:stop]
            return _host_index(first + start, first + stop)
        if to_sinks:
            self.sinks.append(key[:, :, :to_sinks], value[:, :, :to_sinks], index(0, to_sinks))
        if to_sinks < q:
            self.window.append(key[:, :, to_sinks:], value[:, :, to_sinks:], index(to_sinks, q))
        overflow = len(self.window) - self.cfg.window
        if overflow <= 0:
            return
        start = self.window.start
        k, v = (x.float() for x in self.window.pop_front(overflow))
        if not self.decoding and overflow >= self.cfg.min_block:
            blocks, evicted = self.compress_block(k, v, start, ctx)
            self.middle += blocks
            if evicted is not None:
                self.evicted.append(evicted)
        else:
            if self.stream.centre is None:   # the tokens leaving and the window left
                held = self.window
                self.centre_stream(k if held.keys is None else torch.cat([k, held.keys.float()], 2),
                                   v if held.values is None else torch.cat([v, held.values.float()], 2))
            turbo = self.shared.turbo
            self.stream.append(turbo.encode(k - self.stream.centre_of(0)), turbo.encode(v - self.stream.centre_of(1)),
                               start, overflow)

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
        observer, self._observer = self._observer, None  # this chunk's; a later chunk brings its own
        importance = None
        if observer is not None and (self.cfg.salient > 0 or self.cfg.evicts):
            importance = observed_importance(observer, key, ctx.scaling, self.cfg.salient_pool)
        keep = None
        if importance is not None and self.cfg.evicts:
            count = self.tokens_within_ratio(key.shape[2], key.shape[0]) if self.cfg.ratio > 0 else None
            keep = tokens_to_keep(importance, self.cfg.evict, count)
            dropped = int((~keep).sum())
            # fewer than min_block tokens are not worth a block of their own (bases, scales): all stay
            keep = keep if dropped >= self.cfg.min_block else None
        hot = self.hot_tokens(importance, keep)
        # One helper call per block, so each block's full-size temporaries are freed before the next starts
        # (extra peak memory stays below one layer's prompt K+V; measured by a test).
        if hot is None:
            kept = [self.encode_block(key, value, start, ctx, keep, importance)]
        else:
            stored = key.shape[2] if keep is None else int(keep.sum())
            kept = [self.encode_block(key, value, start, ctx, hot, importance, salient_of=stored),
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
        values = held_bytes([self.shared.v_codebook.half()]) + 2 * dim  # codebook, fp16 scales
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
                     cold: bool = False) -> MiddleBlock:
        """A `MiddleBlock` of the tokens ``keep [span]`` marks (all when None), its salient rows the most
        important of them when ``importance [B, H_kv, span]`` is given (``salient`` of ``salient_of`` tokens when
        the block holds part of them: the hot part of a split); coded at the cold budget when ``cold``."""
        span, rows = key.shape[2], None if keep is None else keep.nonzero().squeeze(-1)
        bits = self.shared.layer_key_bits[self.layer_idx]
        if cold:
            bits *= self.cfg.cold_key_bits / self.cfg.key_bits
        # The block's rows are selected one head at a time inside the encoders: a copy of the layer's kept
        # K/V would double the compression's extra peak memory.
        keys = self.encode_keys(key, self.shared.rope(ctx, start, span), rows, bits)
        v_codes, codebook, scale = self.encode_values(value, rows, self.shared.cold_codebook if cold else None)
        salient = None
        if self.cfg.salient > 0 and importance is not None:
            n = span if rows is None else rows.numel()
            fraction = self.cfg.salient if salient_of is None else min(1.0, self.cfg.salient * salient_of / n)
            salient = pick_salient(kept_rows(importance, rows, 2), key, value, fraction, self._sinks.dtype,
                                   rows, held=self.cfg.salient_dtype)
        n = span if rows is None else rows.numel()
        kept = None if keep is None else pack_bits(keep.to(torch.uint8), 1)
        block = MiddleBlock(start=start, n=n, keys=keys, v_codes=v_codes, v_codebook=codebook, v_scale=scale,
                            salient=salient, kept=kept, span=span if kept is not None else 0)
        if rows is not None and backend.gpu_path(key):
            block.derived.rows = rows  # the decode steps' RoPE positions, without a sync on first use
        return block

    def encode_evicted(self, tokens: EvictedTokens) -> MiddleBlock:
        """The held evicted tokens as a block of their own (their own PCA fit, no salient rows): the block
        `encode_block` makes of them from the prompt's chunk, code for code."""
        key, value = tokens.key.float(), tokens.value.float()
        keys = self.encode_keys(key, self.shared.rope_of(tokens.ctx, tokens.rows + tokens.start))
        v_codes, codebook, scale = self.encode_values(value)
        kept = torch.zeros(tokens.span, dtype=torch.uint8, device=tokens.rows.device)
        kept[tokens.rows] = 1
        block = MiddleBlock(start=tokens.start, n=tokens.rows.numel(), keys=keys, v_codes=v_codes, v_codebook=codebook,
                            v_scale=scale, kept=pack_bits(kept, 1), span=tokens.span)
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
            x = kept_rows(undo_rope(key[:, s], cos, sin), rows, 1) if scopes == h else \
                kept_rows(undo_rope(key, cos, sin), rows, 2).transpose(1, 2).reshape(b, n, h * d)
            return x if scales[s] is None else x.div_(scales[s].float())

        rank = self.key_rank(width, bits)
        fits = [fit_pca(scope_rows(s).reshape(b * n, width), rank, seed=self.cfg.seed) for s in range(scopes)]
        widths = self.key_bits_per_component([f.variances for f in fits], bits)
        # RoPE is undone again rather than kept from the fits: one scope's keys are alive at a time
        return [encode_pca(scope_rows(s), fits[s], widths[s], levels=self.cfg.k_levels, column_scale=scales[s],
                           quantize=levels.quantize_unit)
                for s in range(scopes)]

    def encode_values(self, value: torch.Tensor, rows: torch.Tensor | None = None,
                      codebook: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Values ``[B, H_kv, span, d]`` (all rows, or the block rows ``rows`` only) -> packed VQ indices,
        the codebook (``codebook``'s group size, by default the shared `v_codebook`), per-(head, channel) scales.

        One head and ``_VALUE_ROWS`` tokens at a time (the rotation is redone rather than kept), so a
        layer's rotated values never exist at once; only ``v_fit="kmeans"`` rotates the whole layer to
        sample from it."""
        b, h, _, d = value.shape
        n = value.shape[2] if rows is None else rows.numel()
        codebook = (self.shared.v_codebook if codebook is None else codebook).to(value.device)
        group = codebook.shape[1]
        rotate = self.shared.rotation.rotate

        def rotated(s: int):
            """``(first row, rotated values [B, m, d])`` of head ``s``, block rows in chunks."""
            for i in range(0, n, _VALUE_ROWS):
                part = value[:, s, i:i + _VALUE_ROWS] if rows is None else \
                    value[:, s].index_select(1, rows[i:i + _VALUE_ROWS])
                yield i, rotate(part)

        power = torch.stack([sum(x.pow(2).sum(dim=(0, 1)) for _, x in rotated(s)) for s in range(h)])
        scale = (power / (b * n)).sqrt().clamp_min(1e-6).to(torch.float16)            # [H, d]
        if self.cfg.v_fit == "kmeans":
            groups = rotate(kept_rows(value, rows, 2)).div_(scale.float()[None, :, None, :]).reshape(-1, group)
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
        return pack_bits(idx, int(math.log2(self.cfg.v_codebook))), codebook, scale

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

    # ---- accounting -------------------------------------------------------------------------------------
    def breakdown(self) -> dict[str, int]:
        if self._ring is not None:  # the window's bytes include the ring's free slot
            sinks = self._ring.sinks_nbytes()
            out = {"sinks": sinks, "window": self._ring.nbytes() - sinks}
        else:
            out = {"sinks": held_bytes(self._sinks.tensors()), "window": held_bytes(self._window.tensors())}
        for kind in ("k_codes", "k_scales", "k_bases", "v_codes", "v_scales", "v_codebooks", "salient", "kept"):
            out[f"middle_{kind}"] = 0
        for block in self.blocks():
            for kind, tensors in block.parts().items():
                out[f"middle_{kind}"] += held_bytes(tensors)
        out["stream"] = held_bytes(self.stream.tensors())
        out["evicted"] = sum(held_bytes(tokens.tensors()) for tokens in self.evicted)  # uncoded until the next call
        # what the decode paths derive per block (built on first use): the fast kernel's run layouts
        # (integers) and basis factors, the GPU path's kept rows, bit layout and kernel inputs
        out["middle_run_layouts"] = sum(block.derived.runs_nbytes() for block in self.blocks())
        out["middle_key_factors"] = sum(block.derived.key_factors_nbytes() for block in self.blocks())
        out["middle_device_plans"] = sum(block.derived.device_nbytes() for block in self.blocks())
        return out

    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def stats(self) -> dict[str, float]:
        return {"middle_tokens": float(sum(b.n for b in self.middle)),
                "unread_tokens": float(sum(b.n for b in self.unread) + sum(t.rows.numel() for t in self.evicted)),
                "stream_tokens": float(self.stream.n)}

    def clear(self) -> None:
        dtype = exact_storage_dtype(self.cfg.exact_dtype, self.info.dtype)
        self._sinks, self._window, self._ring = ExactStore(dtype), ExactStore(dtype), None
        self.middle, self.unread, self.evicted, self.stream, self.decoding = [], [], [], TurboSegment(), False
        self._query_energy = self._observer = self._sinks_len = None
