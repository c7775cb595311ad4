"""``full``: every token exactly, in the model's dtype. The reference every method is judged against.

``full:dtype=float16`` keeps every token rounded to fp16 instead: the fp16 cache that compression
ratios are quoted against, and on an fp32 model a measure of how much rounding alone changes answers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshrink.cache.base import LayerSpec
from kvshrink.cache.exact_layer import ExactLayer
from kvshrink.cache.registry import option, register_method
from kvshrink.cache.store import STORAGE_DTYPES

DTYPES = {"model": None, **STORAGE_DTYPES}


@dataclass
class FullOptions:
    dtype: str = option("model", "storage dtype: the model's, or float16/bfloat16/float32", choices=tuple(DTYPES))


@register_method("full", "exact cache in the model's dtype (the reference)", options=FullOptions)
class FullLayer(ExactLayer):
    def __init__(self, spec: LayerSpec, options: FullOptions):
        super().__init__(spec, DTYPES[options.dtype])

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
