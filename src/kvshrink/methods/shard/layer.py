"""`ShardLayer`: one decoder layer's Shard cache (sinks, compressed middle blocks, decode stream, window): its
state, its commit, and the choice of path for each part of a step's attention. The work is done by its bases:
the encoding of tokens leaving the window (`encoding`), attention on the CPU fast path (`cpu_attention`), on the
GPU path (`gpu_attention`) and in torch ops, the oracle (`reference`)."""

from __future__ import annotations

import torch

from kvshrink.cache.attention import Partial, exact_partial, group_queries, merge_partials
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.record import Record, RecordReader, Schema
from kvshrink.cache.store import ExactStore, exact_storage_dtype, held_bytes, to_storage
from kvshrink.codecs.bitpack import packed_size
from kvshrink.kernels import backend
from kvshrink.kernels.cpu import encoders, step_parts, stream
from kvshrink.methods.shard.cpu_attention import CpuAttention
from kvshrink.methods.shard.encoding import ShardEncoding
from kvshrink.methods.shard.gpu_attention import GpuAttention
from kvshrink.methods.shard.reference import ReferenceAttention
from kvshrink.methods.shard.ring import ExactRing
from kvshrink.methods.shard.salient import salient_partials
from kvshrink.methods.shard.segments import EvictedTokens, MiddleBlock, TurboSegment
from kvshrink.methods.shard.shared import ShardShared


def _host_index(start: int, stop: int) -> torch.Tensor:
    """Token indices ``start..stop-1`` on the host, carrying their first value for `store.first_index`
    (which then never reads a tensor element: no device round trip on the GPU path)."""
    index = torch.arange(start, stop)
    index.kvshrink_first = start
    return index


class ShardLayer(ShardEncoding, CpuAttention, GpuAttention, ReferenceAttention, CacheLayer):
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
        self._observers: list[torch.Tensor] | None = None  # salient > 0: the chunk's last queries, grouped
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
            self._observers = [group_queries(query[:, :, -n:].float(), self.h_kv) for n in self.cfg.observations]
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

    def middle_partials(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        if self.use_triton_kernel(query):
            return [self.triton_middle_partial(block, query, ctx)]
        if self.use_fast_kernel(query):
            return [self.fused_middle_partial(block, query, ctx)]
        return self.reference_middle_partials(block, query, ctx)

    def stream_partial(self, query: torch.Tensor, scaling: float) -> Partial:
        if self.use_triton_kernel(query):
            return self.triton_stream_partial(query, scaling)
        if self.use_fast_kernel(query) and stream.turbo_supported(self.shared.turbo):
            return self.fused_stream_partial(query, scaling)
        return self.reference_stream_partial(query, scaling)

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
        self._query_energy = self._observers = self._sinks_len = None
