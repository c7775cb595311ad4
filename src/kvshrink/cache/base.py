"""The cache framework: a transformers ``Cache`` holding one ``CacheLayer`` per decoder layer.

A step (one forward of the model) goes: ``cache.update`` stages the new keys/values in the layer and
returns a ``LayerHandle``; the registered "kvshrink" attention function calls ``layer.attend``, which
merges the layer's answer over its stored tokens (``past_partials``) with exact causal attention over
the new tokens, then lets the layer absorb the new tokens (``commit``). See docs/architecture.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvshrink.cache.attention import Partial, causal_chunk_attention, exact_partial, merge_partials, self_partial
from kvshrink.cache.record import Record, RecordReader, Schema, TensorSpec
from kvshrink.cache.option_text import format_options
from kvshrink.cache.store import fp16_kv_bytes, held_bytes
from kvshrink.kernels.deferred import DEFERRED_CHECK_EVERY, defer_nan, raise_deferred
from kvshrink.kernels.backend import gpu_path


class CacheReuseError(RuntimeError):
    """A cache that holds tokens was handed an input that does not continue them."""


@dataclass(frozen=True)
class ModelInfo:
    """What a method needs to know about the model it compresses."""

    model_type: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    dtype: torch.dtype
    rope_type: str = "default"
    rotary: Any = field(repr=False, compare=False, default=None)  # the model's rotary embedding module

    @property
    def groups(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    def __deepcopy__(self, memo: dict) -> "ModelInfo":
        return self  # immutable, and it holds the model's own rotary module: copies share it


@dataclass(frozen=True)
class LayerSpec:
    layer_idx: int
    model: ModelInfo


class StepContext:
    """What every layer needs to know about the current forward step.

    Token *index* is the order in which the cache saw a token (padding included). RoPE *position* is
    ``index - offset[b]`` for row ``b`` (``offset`` = left padding under ``generate``).
    """

    def __init__(self, past_len: int, q_len: int, scaling: float, pad_len: torch.Tensor | None,
                 offset: torch.Tensor, rotary: Any, dtype: torch.dtype):
        self.past_len = past_len
        self.q_len = q_len
        self.scaling = scaling
        self.pad_len = pad_len
        self.offset = offset
        self._rotary = rotary
        self._dtype = dtype
        self._new_index: torch.Tensor | None = None

    @property
    def new_index(self) -> torch.Tensor:
        """Token indices ``[q_len]`` of this step's new tokens (made once per step, shared by the layers;
        it carries its first value on the host as ``kvshrink_first``, see ``store.first_index``)."""
        if self._new_index is None:
            index = torch.arange(self.past_len, self.past_len + self.q_len, device=self.offset.device)
            index.kvshrink_first = self.past_len
            self._new_index = index
        return self._new_index

    def positions(self, index: torch.Tensor) -> torch.Tensor:
        """RoPE positions ``[B, n]`` of token indices ``index`` (``[n]`` or ``[B, n]``)."""
        idx = index if index.dim() == 2 else index.unsqueeze(0)
        return (idx.long() - self.offset[:, None]).clamp(min=0)

    def rope_frequencies(self, device: torch.device) -> torch.Tensor:
        """float32 ``[d/2]``: the rotary module's frequencies (pair ``i`` turns by ``position * f[i]``)."""
        return self._rotary.inv_freq.to(device=device, dtype=torch.float32)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[B, n, d]`` of the model's RoPE rotation at ``positions [B, n]``.

        The pure rotation, from the rotary module's own frequencies: transformers folds
        ``attention_scaling`` (YaRN, longrope) into the cos/sin it returns, so undoing and redoing RoPE
        through the module would scale keys by its square. Undo and redo with this rotation are exact
        inverses whatever the scaling (the keys a method sees "before RoPE" carry the factor), and float32
        whatever the model's dtype. Only rope types whose frequencies never change are accepted by a
        method that undoes RoPE (``kvshrink.models.require_exact_rope``)."""
        freqs = positions[..., None].float() * self.rope_frequencies(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()


class LayerHandle:
    """Returned by ``cache.update`` in place of key/value tensors; the attention function uses it."""

    __slots__ = ("cache", "layer")

    def __init__(self, cache: "KVShrinkCache", layer: "CacheLayer"):
        self.cache = cache
        self.layer = layer


class CacheLayer(CacheLayerMixin):
    """One decoder layer's store. Methods subclass this and implement the four abstract hooks."""

    is_compileable = False
    method_name = "?"
    # False when commit() needs nothing from the step's attention: a shared prefill (eval/fanout.py)
    # then skips this layer's own attention computation.
    commit_needs_attention = True
    # True when what the layer stores is fitted to the tokens it sees (bases, scales, factors): in a batch
    # each row then gets its own layers (cache/rowwise.py), so a row is compressed as if it were alone.
    split_batch_rows = False

    def __init__(self, spec: LayerSpec):
        super().__init__()
        self.spec = spec
        self.info = spec.model
        self.layer_idx = spec.layer_idx
        self.seen = 0
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.is_initialized = True

    # ---- what a method implements -------------------------------------------------------------
    def past_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        """Attention of ``query [B, H_q, q, d]`` over the tokens stored before this step. A layer with
        ``observes_attention`` also takes ``return_probs``: when True it returns ``(Partial, probs [B, H_q,
        q, n_part])`` pairs, the probabilities normalised within each part (as `exact_partial`)."""
        raise NotImplementedError

    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        """Absorb this step's tokens (post-RoPE ``[B, H_kv, q, d]``) into the store."""
        raise NotImplementedError

    def nbytes(self) -> int:
        """Bytes of every tensor this layer holds."""
        raise NotImplementedError

    def breakdown(self) -> dict[str, int]:
        """Bytes per part of the store; the values sum to ``nbytes()``."""
        return {"total": self.nbytes()}

    def stats(self) -> dict[str, float]:
        """Method-specific counters (e.g. miss rates); empty by default."""
        return {}

    def clear(self) -> None:
        """Drop every stored token (called by ``reset``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the layer holds outside Python memory (files, threads); nothing by default."""

    # ---- what a layer that scores tokens by the attention they get implements (H2O, Scissorhands) ----
    # With ``observes_attention`` the step's attention is computed in blocks of `probs_block_rows` query
    # rows, and the probabilities of each block `wants_probs` accepts go to `observe_attention`.
    observes_attention = False

    def wants_probs(self, start: int, stop: int, q_len: int) -> bool:
        """Whether query rows ``start..stop-1`` of a ``q_len``-token step need probabilities."""
        return True

    def probs_block_rows(self, query: torch.Tensor, ctx: StepContext) -> int:
        """Query rows per block (bounds the probabilities held at once)."""
        return ctx.q_len

    def observe_attention(self, probs: torch.Tensor, start: int, stop: int, ctx: StepContext) -> None:
        """``probs [B, H_q, stop-start, n]``: the attention of query rows ``start..stop-1`` over the tokens
        of `past_partials`' parts (in their order), then this step's first ``stop`` tokens, normalised
        over all of them."""

    # ---- framework --------------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if self._pending is not None:
            raise RuntimeError(
                "kvshrink: the previous step's tokens were never attended. The model is not using the "
                "'kvshrink' attention implementation; create the cache with kvshrink.make_cache(name, model)."
            )
        self._pending = (key_states, value_states)
        self.seen += key_states.shape[2]
        return key_states, value_states

    def attend(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Attention output ``[B, q, H_q, d]`` for this step, then commit the new tokens."""
        key, value = self._pending
        if self.observes_attention:
            out = self._observed_attention(query, key, value, ctx)
        else:
            parts = self.past_partials(query, ctx)
            if not parts and ctx.q_len > 1:
                out = causal_chunk_attention(query, key, value, ctx.scaling, ctx.pad_len).float()
            else:
                parts.append(self._chunk_partial(query, key, value, ctx))
                out = merge_partials(parts, query.dtype).out
        self._pending = None
        self.commit(key, value, ctx)
        return out.to(query.dtype).transpose(1, 2).contiguous()

    def _observed_attention(self, query, key, value, ctx: StepContext) -> torch.Tensor:
        """``[B, H_q, q, d]`` (float32) block by block of query rows, each wanted block's probabilities
        handed to `observe_attention`."""
        q, step, outs = ctx.q_len, self.probs_block_rows(query, ctx), []
        for start in range(0, q, step):
            stop = min(q, start + step)
            rows, want = query[:, :, start:stop], self.wants_probs(start, stop, q)
            parts = self.past_partials(rows, ctx, return_probs=want)
            parts.append(exact_partial(rows, key[:, :, :stop], value[:, :, :stop], ctx.scaling,
                                       key_index=ctx.new_index[:stop], query_index=ctx.new_index[start:stop],
                                       pad_len=ctx.pad_len, return_probs=want))
            merged = merge_partials([part for part, _ in parts] if want else parts)
            if want:  # each part's probabilities are normalised within the part: rescale to the whole softmax
                probs = [p * torch.exp(part.lse - merged.lse).unsqueeze(-1) for part, p in parts]
                self.observe_attention(torch.cat(probs, dim=-1), start, stop, ctx)
            outs.append(merged.out)
        return torch.cat(outs, dim=2)

    @staticmethod
    def _chunk_partial(query, key, value, ctx: StepContext) -> Partial:
        """Exact causal attention of the new tokens over themselves."""
        if ctx.q_len == 1:  # a lone new token sees exactly itself: no mask to build, no softmax to take
            return self_partial(query, key, value, ctx.scaling)
        return exact_partial(query, key, value, ctx.scaling, key_index=ctx.new_index, query_index=ctx.new_index,
                             pad_len=ctx.pad_len)

    def absorb_pending(self, ctx: StepContext) -> None:
        """Commit the staged tokens without computing attention (shared prefill)."""
        key, value = self._pending
        self._pending = None
        self.commit(key, value, ctx)

    def get_seq_length(self) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.seen = 0
        self._pending = None
        self.clear()

    def _unsupported(self, what: str):
        raise NotImplementedError(f"kvshrink method '{self.method_name}' does not support {what}")

    def crop(self, max_length: int) -> None:
        self._unsupported("crop (assisted / speculative decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._unsupported("expanding the batch (num_return_sequences > 1, beam search)")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._unsupported("selecting batch rows (contrastive search, beam search)")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._unsupported("beam search")

    def offload(self):
        pass

    def prefetch(self):
        pass

    # ---- fork (copy.deepcopy) -----------------------------------------------------------------------
    # A layer is copied through its ``__getstate__``: a method whose layer holds derived state (tables,
    # masks) or resources (threads, files) overrides ``__getstate__``/``__setstate__`` to leave them out.
    def shared_on_fork(self) -> list[Any]:
        """Objects a fork may share with its parent instead of copying: never modified once made."""
        return []

    # ---- save / load (cache/persist.py, cache/record.py) ---------------------------------------------
    # A method whose caches can be saved writes its layer's state as a `Record` (named tensors, JSON
    # metadata, parts) and reads it back into a layer freshly made from the same options: what the
    # options and the model determine (quantizers, bases of rotations, budgets) is made, not stored.
    def to_record(self) -> Record:
        """This layer's stored state (see cache/record.py)."""
        raise NotImplementedError(f"kvshrink: saving a '{self.method_name}' cache is not supported")

    def load_record(self, reader: RecordReader) -> None:
        """Restore the state `to_record` wrote into this freshly made layer (RecordError when it does not
        match the layer's schema)."""
        raise NotImplementedError(f"kvshrink: loading a '{self.method_name}' cache is not supported")


def _preview(ids: torch.Tensor, shown: int = 6) -> str:
    """The first ids of row 0, for error messages."""
    row = ids[0].tolist()
    return str(row[:shown])[:-1] + (", ...]" if len(row) > shown else "]")


def _sum_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for d in dicts:
        for k, v in d.items():
            out[k] = out.get(k, 0) + v
    return out


class CacheAccounting:
    """fp16 reference size, ratio and summary, for any cache with ``info``, ``batch_size`` and ``nbytes()``."""

    method: str
    info: ModelInfo

    def fp16_nbytes(self) -> int:
        """Bytes an fp16 DynamicCache would hold for the same tokens."""
        i = self.info
        return fp16_kv_bytes(i.num_layers, i.num_kv_heads, i.head_dim, self.get_seq_length(), self.batch_size)

    def compression_ratio(self) -> float:
        held = self.nbytes()
        return self.fp16_nbytes() / held if held else float("nan")

    def fork(self):
        """An independent copy of this cache: a new prompt extending its tokens leaves this one unchanged."""
        return copy.deepcopy(self)

    def save(self, path, entropy: bool = True) -> None:
        """Write this cache to one file (see ``kvshrink.load_cache``); ``entropy=False`` stores the tensors
        as held in memory instead of losslessly coded (larger, faster to write and read)."""
        from kvshrink.cache.persist import save_cache

        save_cache(self, path, entropy=entropy)

    def summary(self) -> str:
        return (f"{self.method}: {self.get_seq_length()} tokens, {self.nbytes() / 2**20:.2f} MiB held, "
                f"fp16 {self.fp16_nbytes() / 2**20:.2f} MiB, ratio {self.compression_ratio():.2f}x")


class KVShrinkCache(CacheAccounting, Cache):
    """A transformers ``Cache`` whose layers compute attention from their own (compressed) stores."""

    def __init__(self, method: str, options: dict[str, Any], info: ModelInfo,
                 layer_factory: Callable[[LayerSpec], CacheLayer]):
        layers = [layer_factory(LayerSpec(i, info)) for i in range(info.num_layers)]
        super().__init__(layers=layers)
        self.method = method
        self.options = dict(options)
        self.info = info
        self._clear_bookkeeping()

    def _clear_bookkeeping(self) -> None:
        self._ctx: StepContext | None = None
        self._pad_len: torch.Tensor | None = None
        self._offset: torch.Tensor | None = None
        self._batch: int | None = None
        self.decode_steps = 0
        self._token_ids: torch.Tensor | None = None
        self._ids_known = True
        self._incoming_ids: torch.Tensor | None = None

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_ctx"] = None  # one step's context (holds the model's rotary module): rebuilt next step
        return state

    # ---- save / load: the cache's own record, its layers' as parts (cache/record.py) ----------------
    RECORD = Schema(tensors=(TensorSpec("pad_len", "b", optional=True), TensorSpec("offset", "b", "int64", optional=True),
                             TensorSpec("token_ids", "b n", "int64", optional=True)),
                    meta=("batch", "decode_steps", "ids_known"), parts=("layers",))

    def to_record(self) -> Record:
        return Record(meta={"batch": self._batch, "decode_steps": self.decode_steps, "ids_known": self._ids_known},
                      tensors={"pad_len": self._pad_len, "offset": self._offset, "token_ids": self._token_ids},
                      parts={"layers": [layer.to_record() for layer in self.layers]})

    def load_record(self, reader: RecordReader) -> None:
        """Restore a saved cache's state into this cache, just made by ``make_cache`` with its method and options."""
        reader.bind(H=self.info.num_kv_heads, D=self.info.head_dim)
        fields = self.RECORD.read(reader)
        layers = reader.parts("layers")
        reader.check(len(layers) == len(self.layers), f"holds {len(layers)} layers, the model has {len(self.layers)}")
        rows = layers[0].list_length("rows") if layers else 0
        if rows:  # a batch whose rows were compressed apart (cache/rowwise.py)
            self._split_rows(rows)
        for layer, layer_reader in zip(self.layers, layers):
            layer.load_record(layer_reader)
        self._batch, self.decode_steps, self._ids_known = fields["batch"], fields["decode_steps"], fields["ids_known"]
        self._pad_len, self._offset, self._token_ids = fields["pad_len"], fields["offset"], fields["token_ids"]
        reader.check(self._token_ids is None or self._token_ids.shape[1] == self.get_seq_length(),
                     "its token ids do not match the tokens its layers hold")

    def fork(self) -> "KVShrinkCache":
        """A copy that shares the parent's immutable compressed blocks (``CacheLayer.shared_on_fork``) and
        copies everything a new prompt may change; the parent is never modified."""
        memo: dict[int, Any] = {}
        for layer in self.layers:
            for obj in layer.shared_on_fork():
                memo[id(obj)] = obj
        return copy.deepcopy(self, memo)

    def __repr__(self) -> str:
        opts = format_options(self.options)
        return f"KVShrinkCache({self.method}{':' + opts if opts else ''}, tokens={self.get_seq_length()})"

    # ---- the token ids the cache holds (see cache/integration.py for who feeds them) -----------
    @property
    def token_ids(self) -> torch.Tensor | None:
        """int64 ``[B, n]`` input ids of every token the cache holds (left padding included), ``n ==
        get_seq_length()``; None when unknown (a step ran from ``inputs_embeds``): then a new input
        cannot be checked against what the cache holds."""
        if not self._ids_known:
            return None
        if self._token_ids is None:
            return torch.zeros(self._batch or 1, 0, dtype=torch.long) if self.get_seq_length() == 0 else None
        return self._token_ids

    def expect_input_ids(self, input_ids: torch.Tensor | None) -> None:
        """The ids of the next forward's new tokens (None: the forward runs from embeddings)."""
        self._incoming_ids = None if input_ids is None else input_ids.detach()

    def check_continues(self, input_ids: torch.Tensor) -> None:
        """Raise CacheReuseError unless ``input_ids [B, m]`` begins with the tokens the cache holds and
        adds at least one token."""
        held = self.token_ids
        n = self.get_seq_length()
        if n == 0 or held is None:
            return
        if input_ids.shape[0] != held.shape[0]:
            raise CacheReuseError(f"kvshrink: this cache holds {n} tokens of a batch of {held.shape[0]} rows; got an "
                                  f"input of {input_ids.shape[0]} rows. Call cache.reset() for a new prompt.")
        m = input_ids.shape[1]
        if m > n and torch.equal(input_ids[:, :n].to(held.device), held):
            return
        what = ("it is no longer than what the cache holds (no new token)" if m <= n and
                torch.equal(input_ids.to(held.device), held[:, :m]) else "it does not begin with them")
        raise CacheReuseError(
            f"kvshrink: this cache holds {n} tokens (ids {_preview(held)}); the new input has {m} tokens "
            f"(ids {_preview(input_ids)}) and {what}. Pass the held tokens followed by the new ones to continue "
            "(e.g. generate(prefix + question) after model(prefix)), or call cache.reset() (or make a new cache) "
            "for an unrelated prompt."
        )

    def _record_ids(self, q: int) -> None:
        ids, self._incoming_ids = self._incoming_ids, None
        if ids is None or ids.dim() != 2 or ids.shape[1] != q:
            self._ids_known, self._token_ids = False, None
            return
        if self._ids_known:
            ids = ids.long()
            self._token_ids = ids if self._token_ids is None else torch.cat([self._token_ids, ids.to(self._token_ids.device)], 1)

    # ---- transformers Cache API ----------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if layer_idx == 0:
            self._start_step(key_states)
        layer = self.layers[layer_idx]
        layer.update(key_states, value_states)
        handle = LayerHandle(self, layer)
        return handle, handle

    def _start_step(self, key_states: torch.Tensor) -> None:
        b, _, q, _ = key_states.shape
        if self._batch is not None and b != self._batch:
            raise ValueError(f"kvshrink: this cache holds a batch of {self._batch} rows, got {b}")
        nan = "NaN in the key states of layer 0; check the model inputs"
        if gpu_path(key_states) and q == 1 and self.get_seq_length():
            # a decode step on the GPU path never waits for the device: its checks are deferred to the next
            # prefill, every DEFERRED_CHECK_EVERY decode steps and nbytes() (kernels.deferred.raise_deferred)
            defer_nan(key_states, nan)
            if (self.decode_steps + 1) % DEFERRED_CHECK_EVERY == 0:
                raise_deferred()
        else:
            raise_deferred()
            if torch.isnan(key_states).any():
                raise ValueError(f"kvshrink: {nan}")
        total, limit = self.get_seq_length() + q, self.info.max_positions
        if limit and total > limit:
            raise ValueError(f"kvshrink: {total} tokens (prompt and answer so far) exceed the model's {limit} positions "
                             "(max_position_embeddings); shorten the prompt or max_new_tokens")
        self._record_ids(q)
        if b > 1 and self.get_seq_length() == 0 and self.layers[0].split_batch_rows:
            self._split_rows(b)
        self._batch = b
        self._ctx = None
        if q == 1:
            self.decode_steps += 1

    def _split_rows(self, b: int) -> None:
        from kvshrink.cache.rowwise import RowSplitLayer

        rows = [copy.deepcopy(self.layers) for _ in range(b)]  # a row's layers share one copy of shared state
        self.layers = [RowSplitLayer([row[i] for row in rows]) for i in range(len(self.layers))]

    def step_context(self, attention_mask: Any, position_ids: torch.Tensor | None, q_len: int,
                     scaling: float, device: torch.device) -> StepContext:
        """The context of the current step, built once (by layer 0's attention call) and shared."""
        if self._ctx is not None:
            return self._ctx
        past_len = self.layers[0].seen - q_len
        if not (past_len and q_len == 1 and self._steps_on_gpu_path(device)):
            # learned on the first step, checked on every later one, except decode steps on the GPU path
            # (checking would wait for the device); there the padding and offsets of the first step hold
            self._record_padding(attention_mask, past_len + q_len, device)
            self._record_positions(position_ids, past_len, q_len, device)
        self._ctx = StepContext(past_len, q_len, scaling, self._pad_len, self._offset, self.info.rotary,
                                self.info.dtype)
        return self._ctx

    def _steps_on_gpu_path(self, device: torch.device) -> bool:
        return self._offset is not None and gpu_path(self._offset)

    def _record_padding(self, attention_mask: Any, kv_len: int, device: torch.device) -> None:
        if attention_mask is None:
            if self._pad_len is None:
                return
            raise ValueError("kvshrink: padding mask disappeared after the first step of a padded batch")
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
            raise NotImplementedError("kvshrink: expected a 4D boolean attention mask from the 'kvshrink' mask function")
        valid = attention_mask[:, 0, -1, :kv_len].bool()
        pad_len = (~valid).int().cumprod(dim=-1).sum(dim=-1)
        positions = torch.arange(valid.shape[1], device=valid.device)
        if not torch.equal(valid, positions[None, :] >= pad_len[:, None]):
            raise NotImplementedError(
                "kvshrink supports left padding only (padding tokens first, then the prompt); got a mask with "
                "holes or right padding"
            )
        pad_len = pad_len.to(device)
        if self._pad_len is not None and not torch.equal(pad_len, self._pad_len):
            raise ValueError("kvshrink: the padding of the batch changed between steps")
        self._pad_len = pad_len if bool((pad_len > 0).any()) else None

    def _record_positions(self, position_ids: torch.Tensor | None, past_len: int, q_len: int,
                          device: torch.device) -> None:
        """Learn (first step) and check (every step) that positions are ``index - offset[row]``."""
        b = self._batch
        if self._offset is None:
            if position_ids is None:
                offset = torch.zeros(b, dtype=torch.long, device=device)
            else:
                pos = position_ids.to(device).expand(b, -1)
                last_index = past_len + q_len - 1
                offset = last_index - pos[:, -1].long()
            self._offset = offset
        if position_ids is None:
            return
        index = torch.arange(past_len, past_len + q_len, device=device)
        expected = index[None, :] - self._offset[:, None]
        valid = index[None, :] >= (self._pad_len[:, None] if self._pad_len is not None else 0)
        got = position_ids.to(device).expand(b, -1).long()
        if not bool(((got == expected) | ~valid).all()):
            raise NotImplementedError(
                "kvshrink needs position_ids that count tokens (index minus left padding), as generate() "
                "makes them; got other positions"
            )

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.layers[layer_idx].get_mask_sizes(query_length)

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False

    def close(self) -> None:
        """Release what layers hold outside Python memory (e.g. LRQK's disk tier files)."""
        for layer in self.layers:
            layer.close()

    def reset(self) -> None:
        """Empty every layer so the cache can take a new prompt."""
        for layer in self.layers:
            layer.reset()
        # a batch's row layers (cache/rowwise.py) go: the next prompt may have another batch size
        self.layers = [getattr(layer, "rows", [layer])[0] for layer in self.layers]
        self._clear_bookkeeping()

    def crop(self, max_length: int) -> None:
        for layer in self.layers:
            layer.crop(max_length)
        if self._token_ids is not None:
            self._token_ids = self._token_ids[:, :self.get_seq_length()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        for layer in self.layers:
            layer.batch_repeat_interleave(repeats)
        self._repeat_bookkeeping(lambda t: t.repeat_interleave(repeats, dim=0))
        if self._batch is not None:
            self._batch *= repeats

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        for layer in self.layers:
            layer.batch_select_indices(indices)
        self._repeat_bookkeeping(lambda t: t.index_select(0, indices.to(t.device)))
        if self._batch is not None:
            self._batch = len(indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for layer in self.layers:
            layer.reorder_cache(beam_idx)
        self._repeat_bookkeeping(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def _repeat_bookkeeping(self, fn) -> None:
        if self._pad_len is not None:
            self._pad_len = fn(self._pad_len)
        if self._offset is not None:
            self._offset = fn(self._offset)
        if self._token_ids is not None:
            self._token_ids = fn(self._token_ids)

    # ---- accounting ---------------------------------------------------------------------------------
    def _bookkeeping(self) -> list[torch.Tensor | None]:
        return [self._pad_len, self._offset, self._token_ids]

    @property
    def batch_size(self) -> int:
        return self._batch or 1

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds (all layers plus the cache's own bookkeeping); raises the
        errors a GPU-path decode step deferred (kernels.deferred.raise_deferred)."""
        raise_deferred()
        return sum(layer.nbytes() for layer in self.layers) + held_bytes(self._bookkeeping())

    def breakdown(self) -> dict[str, int]:
        """Bytes per part, summed over layers (the values sum to ``nbytes()``)."""
        out = {k: int(v) for k, v in _sum_dicts([layer.breakdown() for layer in self.layers]).items()}
        book = held_bytes(self._bookkeeping())
        if book:
            out["bookkeeping"] = out.get("bookkeeping", 0) + book
        return out

    def stats(self) -> dict[str, float]:
        """Method counters summed over layers (keys ending in ``_rate`` are averaged)."""
        per_layer = [layer.stats() for layer in self.layers]
        total = _sum_dicts(per_layer)
        for k in total:
            if k.endswith("_rate"):
                total[k] /= max(1, len(per_layer))
        return total
