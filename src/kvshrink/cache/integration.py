"""Plugging kvshrink into transformers: the "kvshrink" attention and mask functions.

The attention function recognises a ``LayerHandle`` (what a kvshrink cache returns from ``update``)
and lets the layer compute attention from its own store. Given ordinary tensors (any other cache, or
no cache) it is plain SDPA, so a model switched to "kvshrink" keeps working with other caches.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from typing import Any, Callable

from kvshrink.cache.base import LayerHandle

ATTENTION_NAME = "kvshrink"

# Handle type -> attention function ``(module, query, handle, attention_mask, scaling, **kwargs) -> out``.
# A cache whose ``update`` returns its own handle type registers here how that handle is attended
# (e.g. the evaluation's shared prefill, kvshrink.eval.fanout); the framework knows only LayerHandle.
HANDLE_ATTENTION: dict[type, Callable[..., torch.Tensor]] = {}


def register_handle_attention(handle_type: type, attention: Callable[..., torch.Tensor]) -> None:
    """Route keys of ``handle_type`` (returned by some cache's ``update``) to ``attention``."""
    HANDLE_ATTENTION[handle_type] = attention


def kvshrink_attention(module: torch.nn.Module, query: torch.Tensor, key: Any, value: Any, attention_mask,
                       dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """The attention function transformers calls: ``(out [B, q, H_q, d], None)``."""
    extension = HANDLE_ATTENTION.get(type(key))
    if extension is not None:
        return extension(module, query, key, attention_mask, scaling=scaling, **kwargs), None
    if not isinstance(key, LayerHandle):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    if dropout:
        raise NotImplementedError("kvshrink caches are for inference; attention dropout must be 0")
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    ctx = key.cache.step_context(attention_mask, kwargs.get("position_ids"), query.shape[2], scaling,
                                 query.device)
    return key.layer.attend(query, ctx), None


_registered = False


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    AttentionInterface.register(ATTENTION_NAME, kvshrink_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, sdpa_mask)
    _registered = True


def install(model: torch.nn.Module) -> None:
    """Switch ``model`` to the kvshrink attention function (a no-op if it already uses it)."""
    register()
    if getattr(model.config, "_attn_implementation", None) != ATTENTION_NAME:
        model.set_attn_implementation(ATTENTION_NAME)
