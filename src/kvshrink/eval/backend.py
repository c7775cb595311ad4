"""The harness's only contact with the rest of kvshrink: load a model, parse a method spec, build a
cache, read a cache's figures. Tests may pass another backend with the same four methods."""
from __future__ import annotations

from typing import Any


class KVShrinkBackend:
    """Methods come from kvshrink's registry, so any registered method spec works."""

    def __init__(self, model_ref: str | None = None, device: str | None = None, dtype: str | None = None):
        self.model_ref, self.device, self.dtype = model_ref, device, dtype

    def load_model(self):
        import kvshrink

        return kvshrink.load_model(self.model_ref or None, dtype=self.dtype or "float32", device=self.device)

    def parse(self, spec: str) -> tuple[str, dict[str, Any]]:
        import kvshrink

        from kvshrink.cache.registry import get_method, resolve_options

        # Unknown methods and options raise ValueError listing the valid ones, before any model loads.
        name, options = kvshrink.parse_method_spec(spec)
        resolve_options(get_method(name), options)
        return name, options

    def make_cache(self, spec: str, model):
        import kvshrink

        name, options = self.parse(spec)
        return kvshrink.make_cache(name, model, **options)

    def prefill_together(self, model, caches: list, input_ids: list[int]):
        """One forward of the prompt filling every cache as its own prefill would: ``(logits, seconds)``.

        Raises ``FanoutMismatch`` if a cache's prefill attention is not exact (then run it alone)."""
        import time

        import torch

        from kvshrink.eval.fanout import prefill_together

        device = next(model.parameters()).device
        start = time.perf_counter()
        logits = prefill_together(model, caches, torch.tensor([input_ids], device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return logits, time.perf_counter() - start


def cache_figures(cache) -> dict[str, Any]:
    """Bytes and method metrics of a cache after a run (the kvshrink cache interface), and the options it ran
    with (``cache_options``: the spec's, resolved, with any an option such as Shard's ``kl_budget`` chose)."""
    nbytes = int(cache.nbytes())
    fp16 = int(cache.fp16_nbytes())
    return {
        "cache_options": _jsonable(dict(getattr(cache, "options", {}))),
        "nbytes": nbytes,
        "fp16_nbytes": fp16,
        "ratio": float(cache.compression_ratio()),
        "breakdown": {k: int(v) for k, v in dict(cache.breakdown()).items()},
        "stats": _jsonable(dict(cache.stats() or {})),
    }


def _jsonable(value):
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "item") and getattr(value, "numel", lambda: 2)() == 1:
        return value.item()
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return str(value)
