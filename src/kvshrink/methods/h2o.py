"""``h2o`` (Heavy-Hitter Oracle, Zhang et al. 2023): keep the tokens with the largest accumulated
attention ("heavy hitters") plus the most recent tokens, under a token budget; evict the rest.

Each KV head chooses its own tokens, as in the original H2O (the shared machinery:
``kvshrink.cache.eviction.ScoredEvictionLayer``).
"""

from __future__ import annotations

from dataclasses import dataclass

from kvshrink.cache.base import LayerSpec, StepContext
from kvshrink.cache.eviction import EvictionOptions, ScoredEvictionLayer, resolve_counts, select_per_row
from kvshrink.cache.registry import option, register_method


@dataclass
class H2OOptions(EvictionOptions):
    recent: float = option(0.5, "of the budget, the most recent tokens always kept: a count (>= 1), or a "
                                "fraction (0 <= f < 1) of the budget (the rest are heavy hitters)", low=0)


@register_method(
    "h2o",
    "H2O: keep heavy hitters (largest accumulated attention, per KV head) plus recent tokens under a token budget",
    options=H2OOptions,
)
class H2OLayer(ScoredEvictionLayer):
    def __init__(self, spec: LayerSpec, options: H2OOptions):
        super().__init__(spec)
        self.budget, self.recent = options.budget, options.recent

    def observe(self, probs, rows, visible, start, q_len) -> None:
        n = probs.shape[-1]
        self.score[:, :n] += probs.sum(dim=1)

    def choose(self, ctx: StepContext):
        keep = resolve_counts(self.budget, self.real_seen(ctx))
        return select_per_row(self.score, keep, resolve_counts(self.recent, keep), self.padding_tokens(ctx))
