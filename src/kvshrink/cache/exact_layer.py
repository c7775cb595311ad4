"""``ExactLayer``: a layer whose whole store is one ``ExactStore`` (full, streaming)."""

from __future__ import annotations

import torch

from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.store import ExactStore, partial_or_none


class ExactLayer(CacheLayer):
    """Attention over exactly stored tokens; subclasses decide what ``commit`` keeps."""

    commit_needs_attention = False

    def __init__(self, spec: LayerSpec, dtype: torch.dtype | None = None):
        super().__init__(spec)
        self.store = ExactStore(dtype)

    def past_partials(self, query: torch.Tensor, ctx: StepContext):
        return partial_or_none(self.store, query, ctx.scaling, ctx.pad_len)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def breakdown(self) -> dict[str, int]:
        return {"exact": self.nbytes()}

    def clear(self) -> None:
        self.store.reset()
