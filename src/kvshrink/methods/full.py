"""``full``: every token exactly, in the model's dtype. The reference every method is judged against."""

from __future__ import annotations

import torch

from kvshrink.cache.base import StepContext
from kvshrink.cache.exact_layer import ExactLayer
from kvshrink.cache.registry import register_method


@register_method("full", "exact cache in the model's dtype (the reference)")
class FullLayer(ExactLayer):
    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        self.store.append(key, value, ctx.new_index)

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
