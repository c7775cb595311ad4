"""``hf-quantized``: transformers' own ``QuantizedCache`` (quanto or hqq backend), with honest bytes.

This is what a transformers user has today, so it is the comparison they ask for. It is not a
kvshrink ``CacheLayer``: the model attends over the tensors the cache returns (transformers
dequantizes the whole history on every step and re-quantizes it whenever its exact residual of
``residual`` tokens fills up). The wrapper only adds the accounting every kvshrink cache has:
``nbytes()`` counts every tensor the layers really hold (packed codes, scales, zero points, the exact
residual), walking quanto's tensor subclasses down to their plain storages.

Backends: ``quanto`` needs ``optimum-quanto`` (>= 0.2.5), ``hqq`` needs ``hqq``; both come with
``pip install 'kvshrink[baselines]'``. GQA and left-padded batches are handled by the model's own attention and mask.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import QuantizedCache

from kvshrink.cache.base import CacheAccounting, ModelInfo
from kvshrink.cache.option_text import format_options
from kvshrink.cache.registry import option, register_method
from kvshrink.cache.store import held_bytes
from kvshrink.extras import require

BACKEND_PACKAGES = {"quanto": ("optimum.quanto", "optimum-quanto"), "hqq": ("hqq", "hqq")}


def plain_tensors(obj: Any) -> list[torch.Tensor]:
    """Every plain tensor inside ``obj``: tensor subclasses (quanto's packed/quantized tensors) are
    flattened to the tensors that really hold memory; tuples, lists and dicts (hqq's metadata) are walked."""
    if obj is None:
        return []
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in plain_tensors(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in plain_tensors(item)]
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return [t for name in names for t in plain_tensors(getattr(obj, name))]
        return [obj]
    return []


def require_backend(backend: str) -> None:
    module, package = BACKEND_PACKAGES[backend]
    require(module, package, "baselines", f"hf-quantized with backend '{backend}'")


class MeasuredQuantizedCache(CacheAccounting, QuantizedCache):
    """transformers' ``QuantizedCache`` plus kvshrink's accounting (``nbytes``, ``compression_ratio``...)."""

    def __init__(self, backend: str, config, info: ModelInfo, bits: int, group: int, residual: int):
        super().__init__(backend, config, nbits=bits, q_group_size=group, residual_length=residual)
        self.method = "hf-quantized"
        self.options = {"backend": backend, "bits": bits, "group": group, "residual": residual}
        self.info = info

    def _quantized(self, layer) -> list[torch.Tensor]:
        return plain_tensors([layer._quantized_keys, layer._quantized_values])

    def _exact(self, layer) -> list[torch.Tensor]:
        return [t for t in (getattr(layer, "keys", None), getattr(layer, "values", None)) if isinstance(t, torch.Tensor)]

    @property
    def batch_size(self) -> int:
        for layer in self.layers:
            for t in self._exact(layer):
                if t.dim() == 4:
                    return t.shape[0]
        return 1

    def nbytes(self) -> int:
        """Bytes of every tensor the cache holds: packed codes, scales, zero points, exact residual."""
        return sum(held_bytes(self._quantized(layer) + self._exact(layer)) for layer in self.layers)

    def breakdown(self) -> dict[str, int]:
        quantized = sum(held_bytes(self._quantized(layer)) for layer in self.layers)
        exact = sum(held_bytes(self._exact(layer)) for layer in self.layers)
        return {"quantized": quantized, "exact": exact}

    def stats(self) -> dict[str, float]:
        """Tokens per layer held exactly (the residual) and quantized."""
        keys = getattr(self.layers[0], "keys", None)
        exact = keys.shape[-2] if isinstance(keys, torch.Tensor) and keys.dim() == 4 else 0
        return {"exact_tokens": float(exact), "quantized_tokens": float(self.get_seq_length() - exact)}

    def __deepcopy__(self, memo: dict):
        raise NotImplementedError(
            "kvshrink: an 'hf-quantized' cache cannot be copied, forked or saved: the quantized tensors of "
            "its backends do not support copy.deepcopy; use method 'kivi' (the same 2/4-bit group "
            "quantization, built from kvshrink layers) to reuse a quantized prefix")

    def __repr__(self) -> str:
        opts = format_options(self.options)
        return f"MeasuredQuantizedCache(hf-quantized:{opts}, tokens={self.get_seq_length()})"


@dataclass
class HFQuantizedOptions:
    backend: str = option("quanto", "quantization backend", choices=("quanto", "hqq"))
    bits: int = option(4, "bits per element", choices=(2, 4))
    group: int = option(64, "quantization group size (transformers' q_group_size)", low=1)
    residual: int = option(128, "exact residual length before re-quantizing (transformers' residual_length)", low=1)


def build_hf_quantized(model: torch.nn.Module, info: ModelInfo, **options: Any) -> MeasuredQuantizedCache:
    opts = HFQuantizedOptions(**options)
    require_backend(opts.backend)
    # The model keeps (or gets back) ordinary attention: this cache returns plain dequantized tensors,
    # which the kvshrink attention function would hand to SDPA anyway.
    return MeasuredQuantizedCache(opts.backend, model.config, info, opts.bits, opts.group, opts.residual)


register_method(
    "hf-quantized",
    "transformers' QuantizedCache (quanto or hqq backend), bytes measured on what it really holds",
    options=HFQuantizedOptions,
    build=build_hf_quantized,
)(build_hf_quantized)
