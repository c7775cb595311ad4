"""The cache framework: container, layer interface, attention kernels, registry."""

from kvshrink.cache.attention import Partial, exact_partial, merge_partials
from kvshrink.cache.base import CacheLayer, CacheReuseError, KVShrinkCache, LayerSpec, ModelInfo, StepContext
from kvshrink.cache.registry import Option, make_cache, methods, parse_method_spec, register_method
from kvshrink.cache.store import ExactStore, fp16_kv_bytes, held_bytes

__all__ = [
    "CacheLayer", "CacheReuseError", "ExactStore", "KVShrinkCache", "LayerSpec", "ModelInfo", "Option",
    "Partial", "StepContext", "exact_partial", "fp16_kv_bytes", "held_bytes", "make_cache", "merge_partials",
    "methods", "parse_method_spec", "register_method",
]
