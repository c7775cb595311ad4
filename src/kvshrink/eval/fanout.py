"""One prompt, many caches: run the prefill once and fill every cache as if it had run alone.

Prefill attention is exact in every kvshrink method (a layer compresses or evicts only after the
step's attention), so the model's activations during the prompt do not depend on the method. The
evaluation harness uses this to compare N methods on a long prompt for the price of one forward pass
plus each method's own compression. Each cache still runs its own attention when its layer needs it
(e.g. H2O's attention scores), and that attention is checked against the exact one.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from kvshrink.cache.base import LayerHandle
from kvshrink.cache.integration import install, register_handle_attention


class FanoutMismatch(RuntimeError):
    """A cache's own prefill attention differed from the exact one: it cannot share a prefill."""


class FanoutHandle:
    __slots__ = ("key", "value", "results", "tolerance")

    def __init__(self, key: torch.Tensor, value: torch.Tensor, results: list[tuple[Any, Any]], tolerance: float):
        self.key, self.value, self.results, self.tolerance = key, value, results, tolerance


class FanoutCache(Cache):
    """Feeds every step's keys and values to several fresh caches (prefill only)."""

    def __init__(self, caches: list, tolerance: float = 1e-3):
        if not caches:
            raise ValueError("FanoutCache needs at least one cache")
        if any(c.get_seq_length() for c in caches):
            raise ValueError("FanoutCache takes fresh caches only (it shares a prefill)")
        super().__init__(layers=list(caches[0].layers))
        self.caches = caches
        self.tolerance = tolerance

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        results = [c.update(key_states, value_states, layer_idx, *args, **kwargs) for c in self.caches]
        handle = FanoutHandle(key_states, value_states, results, self.tolerance)
        return handle, handle

    @property
    def kvshrink_members(self) -> list:
        """The caches this one fills (kvshrink's hooks treat each as used by the call)."""
        return self.caches

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.caches[0].get_seq_length(layer_idx)

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(layer_idx) + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    @property
    def is_compileable(self) -> bool:
        return False


def fanout_attention(module: torch.nn.Module, query: torch.Tensor, handle: FanoutHandle, attention_mask,
                     scaling: float, **kwargs) -> torch.Tensor:
    """Exact attention for the model's forward; each kvshrink layer absorbs the step its own way."""
    exact, _ = sdpa_attention_forward(module, query, handle.key, handle.value, attention_mask, scaling=scaling,
                                      **kwargs)
    for key, _ in handle.results:
        if not isinstance(key, LayerHandle):
            continue  # another kind of cache already stored the step in update()
        ctx = key.cache.step_context(attention_mask, kwargs.get("position_ids"), query.shape[2], scaling,
                                     query.device)
        if key.layer.commit_needs_attention:
            own = key.layer.attend(query, ctx)
            error = (own.float() - exact.float()).abs().max().item()
            if error > handle.tolerance:
                raise FanoutMismatch(f"method '{key.cache.method}' attends differently in prefill "
                                     f"(max difference {error:.2e}); run it on its own")
        else:
            key.layer.absorb_pending(ctx)
    return exact


register_handle_attention(FanoutHandle, fanout_attention)


@torch.no_grad()  # not inference_mode: caches update their tensors in place later
def prefill_together(model: torch.nn.Module, caches: list, input_ids: torch.Tensor,
                     attention_mask: torch.Tensor | None = None, tolerance: float = 1e-3) -> torch.Tensor:
    """Run ``input_ids`` once, filling every (fresh) cache in ``caches``; logits ``[B, vocab]`` of the last token.

    Each cache ends up holding exactly what it would hold after running the prompt alone, so decoding
    can continue from each one separately. Raises FanoutMismatch if a cache's own prefill attention
    is not the exact one.
    """
    install(model)
    fan = FanoutCache(caches, tolerance)
    out = model(input_ids=input_ids, attention_mask=attention_mask, past_key_values=fan, use_cache=True,
                logits_to_keep=1)
    return out.logits[:, -1, :]
