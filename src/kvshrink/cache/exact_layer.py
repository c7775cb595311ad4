"""``ExactLayer``: a layer whose whole store is one ``ExactStore`` (full, streaming)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvshrink.cache.attention import exact_kernel_trusted
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.record import Record, RecordReader
from kvshrink.cache.store import ExactStore, partial_or_none
from kvshrink.kernels.backend import gpu_path


class ExactLayer(CacheLayer):
    """Attention over exactly stored tokens; subclasses decide what ``trim`` keeps after each append.

    ``commit`` appends the step's tokens, then calls ``trim``. A decode step appends the new token first
    and answers with one attention over the store (the new token included): on the GPU path one kernel
    written straight into the output in the model's dtype; on CPU, when the store holds the new token
    unchanged (its dtype is the model's) and nothing is padded, one call of torch's
    ``scaled_dot_product_attention``, as transformers' own cache attends. No separate partial for the new
    token, no merge; ``trim`` then runs as after any commit, so the attention is the same as the generic
    path's.
    """

    commit_needs_attention = False

    def __init__(self, spec: LayerSpec, dtype: torch.dtype | None = None):
        super().__init__(spec)
        self.store = ExactStore(dtype)

    def past_partials(self, query: torch.Tensor, ctx: StepContext):
        return partial_or_none(self.store, query, ctx.scaling, ctx.pad_len)

    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        self.store.append(key, value, ctx.new_index)
        self.trim(ctx)

    def trim(self, ctx: StepContext) -> None:
        """Drop what the layer does not keep, after an append (nothing by default)."""

    def attend(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        if ctx.q_len != 1 or not len(self.store):
            return super().attend(query, ctx)
        if not gpu_path(query):
            if ctx.pad_len is None and self.store.dtype in (None, query.dtype):
                return self._decode_from_store(query, ctx)
            return super().attend(query, ctx)
        if not exact_kernel_trusted(query, self.store.keys, self.store.values):
            return super().attend(query, ctx)
        from kvshrink.kernels.exact_attention import exact_attention

        key, value = self._pending
        self._pending = None
        self.store.append(key, value, ctx.new_index)
        b, hq, q, d = query.shape
        out = torch.empty(b, q, hq, d, dtype=query.dtype, device=query.device)
        index = self.store.index
        exact_attention(query, self.store.keys, self.store.values, ctx.scaling,
                        key_index=index if index is not None and ctx.pad_len is not None else None,
                        pad_len=ctx.pad_len, key_start=self.store.start, out=out.transpose(1, 2))
        self.trim(ctx)
        return out

    def _decode_from_store(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """A CPU decode step without padding: the new token appended, then one attention over the store (every
        stored token is visible to it), ``[B, 1, H_q, d]`` in the model's dtype."""
        key, value = self._pending
        self._pending = None
        self.store.append(key, value, ctx.new_index)
        out = F.scaled_dot_product_attention(query, self.store.keys, self.store.values, scale=ctx.scaling,
                                             enable_gqa=query.shape[1] != self.store.keys.shape[1])
        self.trim(ctx)
        return out.transpose(1, 2).contiguous()

    def nbytes(self) -> int:
        return self.store.nbytes()

    def breakdown(self) -> dict[str, int]:
        return {"exact": self.nbytes()}

    def clear(self) -> None:
        self.store.reset()

    def to_record(self) -> Record:
        return Record(meta={"seen": self.seen}, parts={"store": self.store.to_record()})

    def load_record(self, reader: RecordReader) -> None:
        self.seen = reader.meta("seen")
        self.store.load_record(reader.part("store"), self.info.dtype)
