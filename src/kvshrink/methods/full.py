"""``full``: every token exactly, in the model's dtype. The reference every method is judged against."""

from __future__ import annotations

import torch

from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.registry import register_method
from kvshrink.cache.store import ExactStore, partial_or_none


@register_method("full", "exact cache in the model's dtype (the reference)")
class FullLayer(CacheLayer):
    commit_needs_attention = False

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        self.store = ExactStore()

    def past_partials(self, query: torch.Tensor, ctx: StepContext):
        return partial_or_none(self.store, query, ctx.scaling, ctx.pad_len)

    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        self.store.append(key, value, ctx.new_index)

    def nbytes(self) -> int:
        return self.store.nbytes()

    def breakdown(self) -> dict[str, int]:
        return {"exact": self.nbytes()}

    def clear(self) -> None:
        self.store.reset()

    def crop(self, max_length: int) -> None:
        if max_length < 0:
            max_length = self.seen + max_length
        self.store.crop_to(max_length)
        self.seen = min(self.seen, max_length)

    def batch_repeat_interleave(self, repeats: int) -> None:
        if len(self.store):
            rows = torch.arange(self.store.keys.shape[0], device=self.store.keys.device)
            self.store.select_batch(rows.repeat_interleave(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.store.select_batch(indices.to(self.store.keys.device) if len(self.store) else indices)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self.batch_select_indices(beam_idx)
