"""``scissorhands`` (Liu et al. 2023): keep the tokens whose importance *persists*.

Persistence of importance: a token that mattered in recent steps keeps mattering. Over a history
window of the last ``history`` queries, a token counts as important for a query when the attention
it receives (mean over the query heads of its KV head) exceeds the uniform share ``1 / (tokens the
query sees)``. The cache grows to ``budget`` tokens per KV head; when it would exceed the budget,
the ``drop`` tokens outside the ``recent`` window with the fewest important hits are evicted at once
(ties: the older token goes first), so the cache holds between ``budget - drop`` and ``budget``.

The history is exact and small: one int64 per stored token and KV head, bit ``i`` set when the
query ``i`` steps back found the token important (so ``history <= 62``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshrink.cache.base import LayerSpec, StepContext
from kvshrink.cache.registry import option, register_method
from kvshrink.cache.eviction import (
    EvictionOptions, ScoredEvictionLayer, check_count_option, resolve_counts, select_per_row,
)

MAX_HISTORY = 62


def persistence_counts(history_bits: torch.Tensor, history: int) -> torch.Tensor:
    """Number of set bits among the low ``history`` bits of each int64."""
    shifts = torch.arange(history, device=history_bits.device)
    return ((history_bits.unsqueeze(-1) >> shifts) & 1).sum(dim=-1)


@dataclass
class ScissorhandsOptions(EvictionOptions):
    history: int = option(32, "history window: the last queries whose attention counts (one bit per query)",
                          low=1, high=MAX_HISTORY)
    drop: float = option(0.1, "tokens evicted at once when the budget is exceeded: a count (>= 1) or a fraction "
                              "(0 < f < 1) of the budget", low=0, low_open=True)

    def __post_init__(self):
        super().__post_init__()
        check_count_option(self.drop, "drop")


@register_method(
    "scissorhands",
    "Scissorhands: keep tokens whose attention stayed above average over a history window (persistence of "
    "importance), fixed budget per KV head, evict the least persistent in batches",
    options=ScissorhandsOptions,
)
class ScissorhandsLayer(ScoredEvictionLayer):
    score_dtype = torch.int64

    def __init__(self, spec: LayerSpec, options: ScissorhandsOptions):
        super().__init__(spec)
        self.budget, self.recent, self.drop = options.budget, options.recent, options.drop
        self.history = options.history

    def begin_step(self, rows: int, q: int, device: torch.device) -> None:
        if self.score is not None:  # every stored token's history moves q queries back
            self.score = torch.zeros_like(self.score) if q >= self.history else \
                (self.score << q) & ((1 << self.history) - 1)
        super().begin_step(rows, q, device)

    def wants_probs(self, start: int, stop: int, q_len: int) -> bool:
        return stop > q_len - self.history

    def observe(self, probs, rows, visible, start, q_len) -> None:
        qb, n = probs.shape[1], probs.shape[2]
        back = q_len - 1 - (start + torch.arange(qb, device=probs.device))  # steps back from the newest query
        in_window = (back < self.history) & (back >= 0)
        important = (probs > (1.0 / visible).unsqueeze(-1)) & (rows > 0).unsqueeze(-1) & in_window[None, :, None]
        bits = (important.long() << back.clamp(min=0)[None, :, None]).sum(dim=1)  # distinct bits: sum == or
        self.score[:, :n] |= bits

    def choose(self, ctx: StepContext):
        padding = self.padding_tokens(ctx)
        budget = resolve_counts(self.budget, self.real_seen(ctx))
        stored = (~padding).sum(dim=1)
        over = stored > budget  # a row drops a batch of tokens only once it exceeds its budget
        keep = torch.where(over, (budget - resolve_counts(self.drop, budget)).clamp(min=1), stored)
        recent = resolve_counts(self.recent, budget)
        counts = persistence_counts(self.score, self.history).float()
        # Equal counts: the newer token ranks higher (a bonus < 1 never outweighs one more hit).
        n = counts.shape[1]
        ranked = counts + torch.arange(n, device=counts.device) / (2.0 * n)
        return select_per_row(ranked, keep, recent, padding)
