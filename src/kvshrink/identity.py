"""Model identity: a fingerprint of what a model computes, so a saved cache is refused by another model.

The fingerprint is a SHA-256 of the model's config (without entries that do not change what it
computes), its parameters' dtype, and every weight tensor a checkpoint holds (parameters and persistent
buffers; non-persistent buffers such as RoPE tables are derived from the config): each one's name,
shape and dtype, and a strided sample of its elements. The sample has at least ``_MIN_SAMPLE`` elements
and one in every ``_SAMPLE_EVERY`` of a large tensor, in runs of neighbours spread over its rows and
columns (the stride is prime to the row length), so any change that touches a tensor broadly (a fine-tune, a perturbation of
one layer's weights, another quantization) changes the fingerprint; it is a sample, not a hash of every
byte (that would read the whole model at every ``make_cache``), so a change confined to a few elements
outside the sample goes unseen.

This module depends on torch only: ``cache/`` (making and loading caches) and ``models.py`` both use it.
"""

from __future__ import annotations

import hashlib
import json
import math

import torch

# Config entries that do not change what the model computes (paths, versions, generation defaults).
_CONFIG_IGNORED = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                   "_commit_hash", "use_cache", "_attn_implementation_autoset", "_attn_implementation"}
_MIN_SAMPLE = 4096     # elements hashed from each tensor at least (all of a smaller one)
_SAMPLE_EVERY = 1024   # and one in this many of a larger one
_RUN = 16              # taken as runs of this many neighbours (one 64-byte cache line of float32): the cost is
                       # the cache lines read, so runs read 16 times the elements of single ones for the same time


def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 (hex) of ``model``'s config, dtype and a strided sample of every weight tensor (see above)."""
    h = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_IGNORED}
    if (config.get("quantization_config") or {}).get("quant_method") == "gguf":
        del config["quantization_config"]   # the file the weights were read from, which the weights' sample covers
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    h.update(str(next(model.parameters()).dtype).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            h.update(f"{name}:{list(tensor.shape)}:{tensor.dtype}".encode())
            h.update(_sample(tensor.detach()))
    return h.hexdigest()


def _sample(tensor: torch.Tensor) -> bytes:
    """The bytes of a strided sample of ``tensor``'s elements (all of them when it is small): runs of `_RUN`
    neighbours in its logical order, evenly spaced, read in place (no copy of the tensor)."""
    n = tensor.numel()
    runs = max(_MIN_SAMPLE, n // _SAMPLE_EVERY) // _RUN
    if n <= runs * _RUN:
        sample = tensor.reshape(-1)
    else:
        stride = n // runs
        row = tensor.shape[-1] if tensor.dim() > 1 else 1
        while math.gcd(stride, row) != 1:  # a stride that is a multiple of a row's length would read one column
            stride -= 1
        starts = torch.arange(runs, device=tensor.device) * stride
        index = (starts[:, None] + torch.arange(_RUN, device=tensor.device)).reshape(-1)
        # index_select on the flat view reads just the runs (torch.take and indexing cost ~500x more here);
        # torch.take serves a non-contiguous tensor without copying it
        sample = tensor.view(-1).index_select(0, index) if tensor.is_contiguous() else torch.take(tensor, index)
    sample = sample.to("cpu", copy=True).contiguous()
    if sample.dtype == torch.bool:
        sample = sample.to(torch.uint8)
    return sample.view(torch.uint8).numpy().tobytes()
