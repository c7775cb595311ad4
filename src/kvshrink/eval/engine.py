"""Running a model through a cache: greedy decoding and teacher-forced scoring, timed.

A hand-written greedy loop rather than ``generate`` so prefill and per-token decode time are
measured separately; for batch 1 without padding it produces the same tokens as greedy ``generate``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class DecodeResult:
    tokens: list[int]
    prefill_s: float
    decode_ms_per_token: float | None  # None when no token after the first was decoded
    logprobs: torch.Tensor | None = None  # [len(tokens), vocab] float32: each step's distribution, when kept


@dataclass
class ScoreResult:
    nll_sum: float
    count: int
    prefill_s: float
    decode_ms_per_token: float | None
    logprobs: torch.Tensor | None = None  # [count, vocab] float32 next-token log-probabilities, when kept


def model_device(model) -> torch.device:
    return next(model.parameters()).device


def eos_token_ids(model, tokenizer) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config, tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _step(model, cache, ids: torch.Tensor) -> torch.Tensor:
    """One forward through the cache; logits of the last position only (8K x vocab would be GBs)."""
    out = model(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :]


@torch.no_grad()
def prefill(model, cache, input_ids: list[int]) -> tuple[torch.Tensor, float]:
    """Logits of the last prompt token after running the prompt through ``cache``, and the seconds."""
    device = model_device(model)
    _sync(device)
    t0 = time.perf_counter()
    logits = _step(model, cache, torch.tensor([input_ids], device=device))
    _sync(device)
    return logits, time.perf_counter() - t0


@torch.no_grad()
def greedy_decode(model, cache, input_ids: list[int], max_new_tokens: int,
                  stop_ids: set[int] = frozenset(), prefilled: tuple[torch.Tensor, float] | None = None,
                  keep_logprobs: bool = False) -> DecodeResult:
    """Greedy tokens after ``input_ids``. ``prefilled``: ``(logits, seconds)`` of a prefill already run
    into ``cache`` (a shared prefill, see kvshrink.eval.fanout). ``keep_logprobs``: also return each step's
    next-token log-probabilities (free-running: every step after the first decoded through the cache)."""
    device = model_device(model)
    logits, prefill_s = prefilled or prefill(model, cache, input_ids)
    tokens: list[int] = []
    kept = []
    t1 = time.perf_counter()
    for step in range(max_new_tokens):
        nxt = int(logits[0].argmax())
        tokens.append(nxt)
        if keep_logprobs:
            kept.append(torch.log_softmax(logits[0].float(), dim=-1).cpu())
        if nxt in stop_ids or step == max_new_tokens - 1:
            break
        logits = _step(model, cache, torch.tensor([[nxt]], device=device))
    _sync(device)
    decoded = len(tokens) - 1  # forwards after the prefill
    decode_ms = 1000 * (time.perf_counter() - t1) / decoded if decoded > 0 else None
    return DecodeResult(tokens, prefill_s, decode_ms, torch.stack(kept) if kept else None)


@torch.no_grad()
def score_continuation(model, cache, prefix_ids: list[int], target_ids: list[int],
                       prefilled: tuple[torch.Tensor, float] | None = None,
                       keep_logprobs: bool = False) -> ScoreResult:
    """Negative log-likelihood of ``target_ids`` given the prefix, fed one token at a time so every
    target token is predicted from what the cache holds (as in decoding). ``keep_logprobs``: also
    return every step's next-token log-probabilities (to compare distributions with another cache)."""
    if not target_ids:
        raise ValueError("score_continuation needs at least one target token")
    device = model_device(model)
    logits, prefill_s = prefilled or prefill(model, cache, prefix_ids)
    nll = 0.0
    kept = []
    t1 = time.perf_counter()
    for i, target in enumerate(target_ids):
        logprobs = torch.log_softmax(logits[0].float(), dim=-1)
        nll -= float(logprobs[target])
        if keep_logprobs:
            kept.append(logprobs.cpu())
        if i < len(target_ids) - 1:
            logits = _step(model, cache, torch.tensor([[target]], device=device))
    _sync(device)
    steps = len(target_ids) - 1
    decode_ms = 1000 * (time.perf_counter() - t1) / steps if steps > 0 else None
    return ScoreResult(nll, len(target_ids), prefill_s, decode_ms, torch.stack(kept) if kept else None)
