"""Plugging kvshrink into transformers: the "kvshrink" attention and mask functions, and the hooks that
route each call of a model to them only when it uses a kvshrink cache.

``install(model)`` (called by ``make_cache``, idempotent) adds to the model:

- a forward pre-hook: a call whose ``past_key_values`` is a kvshrink cache (or a shared prefill of
  several) runs with the "kvshrink" attention implementation; any other call (another cache, or none)
  runs with the implementation the model had (eager, sdpa, flash_attention_2, ...), restored by a
  forward hook after every call, errors included. The pre-hook also hands the cache the input ids of
  the tokens it is about to store (``KVShrinkCache.token_ids``) and refuses ``use_cache=False``.
- a wrapper of ``prepare_inputs_for_generation``: when ``generate`` starts with a cache that already
  holds tokens, the full input must begin with them (``CacheReuseError`` otherwise).

The attention function recognises a ``LayerHandle`` (what a kvshrink cache returns from ``update``)
and lets the layer compute attention from its own store; given ordinary tensors (a submodule called
directly with another cache) it is plain SDPA.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from kvshrink.cache.base import KVShrinkCache, LayerHandle
from kvshrink.kernels.deferred import raise_deferred
from kvshrink.kernels.backend import gpu_path, gpu_path_forced

ATTENTION_NAME = "kvshrink"
_INSTALLED = "_kvshrink_installed"
_USER_ATTENTION = "_kvshrink_user_attention"

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
    out = key.layer.attend(query, ctx)
    if ctx.q_len > 1 and key.layer is key.cache.layers[-1]:
        raise_deferred()  # the end of a prefill (which synchronises anyway): checks deferred by the GPU path
    return out, None


# True during a forward whose past_key_values is a KVShrinkCache itself (not a cache feeding several, like
# the evaluation's shared prefill, whose attention may read the mask): set by the model hooks.
_skip_decode_mask = False


def kvshrink_mask(batch_size: int, q_length: int, kv_length: int, *args, **kwargs):
    """The mask function of the "kvshrink" implementation: transformers' SDPA mask, except for a decode
    step (one new token after a past) on the GPU path, which gets None: a kvshrink cache learns each row's
    left padding on its first step and needs no mask after it, and building one costs launches and a host
    sync (``padding_mask.all()`` in transformers' check whether the mask can be skipped)."""
    if q_length == 1 and kv_length > 1 and _skip_decode_mask:
        mask = kwargs.get("attention_mask")
        device = kwargs.get("device", "cpu")
        on_gpu = gpu_path(mask) if isinstance(mask, torch.Tensor) else (
            torch.device(device).type == "cuda" or gpu_path_forced())
        if on_gpu:
            return None
    return sdpa_mask(batch_size, q_length, kv_length, *args, **kwargs)


_registered = False


def register() -> None:
    """Register the attention and mask functions with transformers (idempotent)."""
    global _registered
    if _registered:
        return
    AttentionInterface.register(ATTENTION_NAME, kvshrink_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvshrink_mask)
    _registered = True


def kvshrink_caches(cache: Any) -> list[KVShrinkCache]:
    """The kvshrink caches behind ``cache``: itself, or the ``kvshrink_members`` of a cache that feeds
    several at once (e.g. the evaluation's shared prefill), or none."""
    if isinstance(cache, KVShrinkCache):
        return [cache]
    return [c for c in getattr(cache, "kvshrink_members", ()) if isinstance(c, KVShrinkCache)]


def install(model: torch.nn.Module) -> None:
    """Add kvshrink's hooks to ``model`` once (see the module docstring); the model's own attention
    implementation stays in place for every call without a kvshrink cache."""
    register()
    if getattr(model, _INSTALLED, False):
        return
    user = _attention_of(model)
    setattr(model, _USER_ATTENTION, "sdpa" if user == ATTENTION_NAME else user)
    model.set_attn_implementation(ATTENTION_NAME)  # validates the name once; calls then switch cheaply
    _use_attention(model, getattr(model, _USER_ATTENTION))
    signature = inspect.signature(model.forward)
    model.register_forward_pre_hook(functools.partial(_before_forward, signature=signature), with_kwargs=True)
    model.register_forward_hook(_after_forward, with_kwargs=True, always_call=True)
    model.prepare_inputs_for_generation = _checking_prepare(model.prepare_inputs_for_generation)
    setattr(model, _INSTALLED, True)


def _attention_of(model: torch.nn.Module) -> str | None:
    return model.config._attn_implementation


def _use_attention(model: torch.nn.Module, name: str | None) -> None:
    # the plain attribute behind config._attn_implementation: switching per call must stay cheap, and
    # set_attn_implementation already validated both names once (install / the user's own choice)
    model.config._attn_implementation_internal = name


def _before_forward(model: torch.nn.Module, args: tuple, kwargs: dict, signature: inspect.Signature):
    current = _attention_of(model)
    if current != ATTENTION_NAME:  # the user may have changed it since install: remember their choice
        setattr(model, _USER_ATTENTION, current)
    bound = signature.bind_partial(*args, **kwargs).arguments if args else kwargs
    caches = kvshrink_caches(bound.get("past_key_values"))
    if not caches:
        _use_attention(model, getattr(model, _USER_ATTENTION))
        return None
    if bound.get("use_cache") is False:
        raise ValueError("kvshrink: use_cache=False with a kvshrink cache; a kvshrink cache only works with "
                         "use_cache=True (the default). Drop past_key_values to run without a cache.")
    ids = bound.get("input_ids") if bound.get("inputs_embeds") is None else None
    if ids is not None and ids.shape[-1] == 0:
        raise ValueError("kvshrink: empty input (0 tokens); give at least one token")
    for cache in caches:
        cache.expect_input_ids(ids)
    global _skip_decode_mask
    _skip_decode_mask = isinstance(bound.get("past_key_values"), KVShrinkCache)
    _use_attention(model, ATTENTION_NAME)
    return None


def _after_forward(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any):
    global _skip_decode_mask
    _skip_decode_mask = False
    _use_attention(model, getattr(model, _USER_ATTENTION))
    return None


def _checking_prepare(prepare):
    """``prepare_inputs_for_generation`` that first checks a non-empty kvshrink cache is continued."""
    if getattr(prepare, "_kvshrink_checks", False):
        return prepare

    @functools.wraps(prepare)
    def checked(input_ids, *args, **kwargs):
        # generate's first step sees the whole input (next_sequence_length set: it slices the new tail
        # itself); next_sequence_length None means the caller passed only the new tokens
        if (kwargs.get("is_first_iteration") and kwargs.get("next_sequence_length") is not None
                and kwargs.get("inputs_embeds") is None and input_ids is not None):
            for cache in kvshrink_caches(kwargs.get("past_key_values")):
                cache.check_continues(input_ids)
        return prepare(input_ids, *args, **kwargs)

    checked._kvshrink_checks = True
    return checked
