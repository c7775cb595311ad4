"""``streaming`` (StreamingLLM): the first ``sinks`` tokens and a rolling window of recent tokens.

Everything else is evicted. With left padding the sinks are each row's first real tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshrink.cache.base import LayerSpec, StepContext
from kvshrink.cache.exact_layer import ExactLayer
from kvshrink.cache.registry import option, register_method
from kvshrink.kernels.backend import gpu_path


def sinks_and_window(index: torch.Tensor, pad_len: torch.Tensor | None, sinks: int, window: int,
                     seen: int, sync: bool = True) -> torch.Tensor | None:
    """Store positions ``[B, sinks+window]`` to keep, or None while no row needs evicting.

    ``index`` is the ``[B, n]`` token index of each stored token (ascending per row). A row evicts once
    it has seen more than ``sinks + window`` real tokens, exactly as it would alone; a row that has
    not keeps its last ``sinks + window`` stored tokens (all its real tokens, padded with padding).
    ``sync=False`` (the GPU path) never asks the device whether a row evicts: once the store holds more
    than ``sinks + window`` tokens it always returns positions (only padding is dropped from a row that
    does not evict yet).
    """
    b, n = index.shape
    budget = sinks + window
    pad = pad_len if pad_len is not None else torch.zeros(b, dtype=torch.long, device=index.device)
    evicting = (seen - pad) > budget
    if n <= budget or (sync and not bool(evicting.any())):
        return None
    first_real = (index < pad[:, None]).sum(dim=1)  # store position of each row's first real token
    sink_pos = first_real[:, None] + torch.arange(sinks, device=index.device)[None, :]
    window_pos = torch.arange(n - window, n, device=index.device).expand(b, window)
    tail_pos = torch.arange(n - budget, n, device=index.device).expand(b, budget)
    return torch.where(evicting[:, None], torch.cat([sink_pos, window_pos], dim=1), tail_pos)


@dataclass
class StreamingOptions:
    sinks: int = option(4, "tokens kept at the start of each row", low=0)
    window: int = option(1024, "most recent tokens kept", low=1)


@register_method("streaming", "StreamingLLM: keep attention sinks and a recent window, evict the rest",
                 options=StreamingOptions)
class StreamingLayer(ExactLayer):
    def __init__(self, spec: LayerSpec, options: StreamingOptions):
        super().__init__(spec)
        self.sinks, self.window = options.sinks, options.window

    def trim(self, ctx: StepContext) -> None:
        n, budget = len(self.store), self.sinks + self.window
        if n <= budget:
            return
        if ctx.pad_len is None and gpu_path(self.store.keys):
            # no padding: every row evicts alike, decided on the host (no index arithmetic, no sync)
            self.store.keep_ranges([(0, self.sinks), (n - self.window, n)])
            return
        index = self.store.token_index()
        index = index if index.dim() == 2 else index.unsqueeze(0).expand(self.store.keys.shape[0], -1)
        keep = sinks_and_window(index, ctx.pad_len, self.sinks, self.window, self.seen,
                                sync=not gpu_path(self.store.keys))
        if keep is not None:
            self.store.keep(keep)
