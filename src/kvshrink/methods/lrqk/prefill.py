"""Chunked prefill: run a long prompt through a cache a block of tokens at a time.

With ``lrqk`` every chunk after the first attends to the past read back from the slow tier block by
block (``LRQKLayer._streamed_partials``), so the fast tier never holds the whole prompt.
"""

from __future__ import annotations

import torch


def chunked_prefill(model: torch.nn.Module, input_ids: torch.Tensor, cache, chunk: int,
                    attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Run the prompt through ``model`` ``chunk`` tokens at a time with ``cache``; returns the last
    logits ``[B, vocab]``. Continue with ``model.generate(full_ids, past_key_values=cache, ...)``."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    total = input_ids.shape[1]
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
    logits = None
    with torch.no_grad():
        for start in range(0, total, chunk):
            stop = min(total, start + chunk)
            out = model(input_ids=input_ids[:, start:stop], attention_mask=attention_mask[:, :stop],
                        position_ids=positions[:, start:stop], past_key_values=cache, use_cache=True)
            logits = out.logits[:, -1]
    return logits
