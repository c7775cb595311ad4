"""Scores, computed the way NIAH and RULER compute them."""
from __future__ import annotations

import math
import re

import torch


def needle_exact(answer: str, value: str) -> float:
    """100 when the needle's number appears in the answer as a whole digit run, else 0.

    A whole run, so that "12345678" does not count as finding "1234567".
    """
    return 100.0 if value in re.findall(r"\d+", answer) else 0.0


def string_match_all(answer: str, expected: list[str]) -> float:
    """RULER's string_match_all: the share of expected strings found in the answer, 0-100."""
    if not expected:
        raise ValueError("string_match_all needs at least one expected string")
    low = answer.lower()
    return 100.0 * sum(e.lower() in low for e in expected) / len(expected)


def string_match_part(answer: str, expected: list[str]) -> float:
    """RULER's string_match_part: 100 when any expected string is in the answer."""
    if not expected:
        raise ValueError("string_match_part needs at least one expected string")
    low = answer.lower()
    return 100.0 if any(e.lower() in low for e in expected) else 0.0


def score_answer(metric: str, answer: str, expected: list[str]) -> float:
    if metric == "exact":
        return needle_exact(answer, expected[0])
    if metric == "all":
        return string_match_all(answer, expected)
    if metric == "part":
        return string_match_part(answer, expected)
    raise ValueError(f"unknown metric {metric!r}; allowed: exact, all, part")


def token_agreement(reference: list[int], candidate: list[int]) -> tuple[float, int | None]:
    """Share (0-100) of positions where the two greedy decodes hold the same token, and the first
    position where they differ (None when identical). Positions past the shorter decode count as
    different, so stopping early is not rewarded."""
    n = max(len(reference), len(candidate))
    if n == 0:
        return 100.0, None
    same = sum(a == b for a, b in zip(reference, candidate))
    first = next((i for i, (a, b) in enumerate(zip(reference, candidate)) if a != b), None)
    if first is None and len(reference) != len(candidate):
        first = min(len(reference), len(candidate))
    return 100.0 * same / n, first


def perplexity(nll_sum: float, count: int) -> float:
    if count <= 0:
        raise ValueError("perplexity needs at least one scored token")
    return math.exp(nll_sum / count)


def distribution_agreement(reference: torch.Tensor, candidate: torch.Tensor) -> tuple[float, float]:
    """For next-token log-probabilities ``[T, vocab]`` of the same teacher-forced text: the mean
    KL(reference || candidate) in nats per token, and the share (0-100) of steps whose most likely
    token is the same. Unlike free-running agreement, one early difference does not decide every
    later step."""
    if reference.shape != candidate.shape:
        raise ValueError(f"log-probabilities differ in shape: {tuple(reference.shape)} vs {tuple(candidate.shape)}")
    kl = (reference.exp() * (reference - candidate)).sum(-1).mean()
    top1 = (reference.argmax(-1) == candidate.argmax(-1)).float().mean()
    return float(kl), 100.0 * float(top1)


def free_running_kl(reference: torch.Tensor, candidate: torch.Tensor, first_divergence: int | None) -> float:
    """Mean KL(reference || candidate) in nats over the steps of two free-running greedy decodes (next-token
    log-probabilities ``[T, vocab]``, each cache fed its own tokens) whose histories are the same: up to and
    including the first step where their tokens differ (every step when they never do)."""
    steps = min(len(reference), len(candidate))
    if first_divergence is not None:
        steps = min(steps, first_divergence + 1)
    if steps == 0:
        raise ValueError("free_running_kl needs at least one step of each decode")
    ref, cand = reference[:steps], candidate[:steps]
    return float((ref.exp() * (ref - cand)).sum(-1).mean())
