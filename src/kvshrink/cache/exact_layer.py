"""``ExactLayer``: a layer whose whole store is one ``ExactStore`` (full, streaming)."""

from __future__ import annotations

import torch

from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.store import ExactStore, partial_or_none
from kvshrink.kernels.backend import gpu_path


class ExactLayer(CacheLayer):
    """Attention over exactly stored tokens; subclasses decide what ``trim`` keeps after each append.

    ``commit`` appends the step's tokens, then calls ``trim``. A decode step on the GPU path appends the
    new token first and answers with one kernel over the store (the new token included), written straight
    into the output in the model's dtype: no separate partial for the new token, no merge; ``trim`` then
    runs as after any commit, so the attention is the same as the generic path's.
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
        if ctx.q_len != 1 or not len(self.store) or not gpu_path(query):
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

    def nbytes(self) -> int:
        return self.store.nbytes()

    def breakdown(self) -> dict[str, int]:
        return {"exact": self.nbytes()}

    def clear(self) -> None:
        self.store.reset()
