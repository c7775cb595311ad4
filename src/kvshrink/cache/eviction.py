"""Eviction by attention statistics: the part H2O, Scissorhands and any method like them share.

``ScoredEvictionLayer`` is a per-KV-head exact store whose eviction is driven by the attention
probabilities the framework hands it (``CacheLayer.observe_attention``). Each KV head chooses its own
tokens, so the store keeps its rows as ``B * H_kv`` one-head rows (``ExactStore`` with batch
``B*H_kv``); the ``G`` query heads of a KV head are that row's query heads, so keys are never repeated
to query heads. A method implements ``observe`` (update per-token statistics from one block of
probabilities) and ``choose`` (what to keep).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshrink.cache.attention import Partial
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.record import Record, RecordReader, TensorSpec, dtype_name
from kvshrink.cache.registry import option
from kvshrink.cache.store import ExactStore, exact_storage_dtype, held_bytes

# Probability elements computed at once while scoring (bounds prefill memory: never T x T x heads).
_SCORE_BLOCK_ELEMENTS = 1 << 23


def resolve_counts(value: float, totals: torch.Tensor) -> torch.Tensor:
    """A count option that may be a fraction, per row: ``value >= 1`` is a count, ``0 < value < 1`` a share
    of ``totals`` (rounded up, at least 1); ``value == 0`` is zero."""
    if value == 0:
        return torch.zeros_like(totals, dtype=torch.long)
    if value >= 1:
        return torch.full_like(totals, int(value), dtype=torch.long)
    return torch.ceil(value * totals.double()).long().clamp(min=1)


def check_count_option(value: float, name: str, allow_zero: bool = False) -> None:
    low_ok = value >= 0 if allow_zero else value > 0
    if not low_ok or (value >= 1 and not float(value).is_integer()):
        allowed = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"{name} must be {allowed}: a whole count (>= 1) or a fraction in (0, 1); got {value}")


@dataclass
class EvictionOptions:
    """The options every scored eviction method takes (counts or fractions, see :func:`resolve_counts`);
    a method's options dataclass extends it (and may redeclare a field's default and help)."""

    budget: float = option(0.2, "most tokens kept per KV head: a count (>= 1) or a fraction (0 < f < 1) of the "
                                "tokens seen so far", low=0, low_open=True)
    recent: float = option(0.25, "most recent tokens never evicted: a count (>= 1) or a fraction (0 <= f < 1) "
                                 "of the budget", low=0)

    def __post_init__(self):
        check_count_option(self.budget, "budget")
        check_count_option(self.recent, "recent", allow_zero=True)


class ScoredEvictionLayer(CacheLayer):
    """An exact per-KV-head store evicting by statistics of the attention it computes.

    Subclasses keep per-token statistics aligned with the store (``self.score``, ``[B*H_kv, n]``) and
    implement ``observe`` (update them from one block of attention probabilities) and ``choose``
    (store positions to keep, or None).
    """

    score_dtype = torch.float32

    def __init__(self, spec: LayerSpec):
        super().__init__(spec)
        self.store = ExactStore(dtype=exact_storage_dtype("auto", self.info.dtype))
        self.score: torch.Tensor | None = None
        self.evicted = 0

    # ---- what a scored method implements --------------------------------------------------------
    def observe(self, probs: torch.Tensor, rows: torch.Tensor, visible: torch.Tensor, start: int, q_len: int) -> None:
        """Update ``self.score`` from ``probs [B*H_kv, qb, n]`` (query rows ``start..``, group-mean,
        normalised over every visible token; columns = stored tokens then this step's tokens up to
        the block's last row). ``rows [B*H_kv, qb]`` is 1 for real query rows, 0 for padding;
        ``visible [B*H_kv, qb]`` counts the real tokens each query row sees."""
        raise NotImplementedError

    def choose(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(positions [B*H_kv, m], filler [B*H_kv, m])`` to keep (see :func:`select_per_row`), or None."""
        raise NotImplementedError

    # ---- attention with probabilities (the framework's hooks, see CacheLayer) -------------------------
    observes_attention = True

    def probs_block_rows(self, query: torch.Tensor, ctx: StepContext) -> int:
        b, hq = query.shape[:2]
        return max(1, _SCORE_BLOCK_ELEMENTS // max(1, b * hq * (len(self.store) + ctx.q_len)))

    def past_partials(self, query: torch.Tensor, ctx: StepContext, return_probs: bool = False) -> list:
        """The store's partial, computed on one-head rows: query heads ``j*G..j*G+G-1`` of a batch row
        against the tokens its KV head ``j`` keeps."""
        if not len(self.store):
            return []
        b, hq, q, d = query.shape
        rows_q = query.reshape(b * self.info.num_kv_heads, hq // self.info.num_kv_heads, q, d)
        got = self.store.partial(rows_q, ctx.scaling, self._row_pad(ctx), return_probs=return_probs)
        part, probs = got if return_probs else (got, None)
        part = Partial(part.out.reshape(b, hq, q, d), part.lse.reshape(b, hq, q))
        return [(part, probs.reshape(b, hq, q, -1))] if return_probs else [part]

    def observe_attention(self, probs: torch.Tensor, start: int, stop: int, ctx: StepContext) -> None:
        b, hq, qb, n = probs.shape
        hkv = self.info.num_kv_heads
        if self.score is None or self.score.shape[1] == len(self.store):  # the step's first observed block
            self.begin_step(b * hkv, ctx.q_len, probs.device)
        group_mean = probs.reshape(b * hkv, hq // hkv, qb, n).mean(dim=1)  # [B*Hkv, qb, n_old + stop]
        pad, new_index = self._row_pad(ctx), ctx.new_index
        qidx = new_index[start:stop]
        rows = torch.ones(group_mean.shape[0], stop - start, device=qidx.device)
        n_real_old = self._real_stored(pad)
        visible_new = (qidx - new_index[0] + 1).to(rows.dtype)[None, :].expand_as(rows)
        if pad is not None:
            rows = (qidx[None, :] >= pad[:, None]).to(rows.dtype)
            first_real_new = (pad[:, None] - new_index[0]).clamp(min=0)
            visible_new = (qidx[None, :] - new_index[0] + 1 - first_real_new).clamp(min=1).to(rows.dtype)
        self.observe(group_mean * rows.unsqueeze(-1), rows, n_real_old[:, None] + visible_new, start, ctx.q_len)

    def _row_pad(self, ctx: StepContext) -> torch.Tensor | None:
        """``[B*H_kv]`` left padding of each one-head row (None without padding)."""
        return None if ctx.pad_len is None else ctx.pad_len.repeat_interleave(self.info.num_kv_heads)

    def _real_stored(self, pad: torch.Tensor | None) -> torch.Tensor:
        n = len(self.store)
        rows = self.score.shape[0]
        if n == 0:
            return torch.zeros(rows, device=self.score.device)
        if pad is None:
            return torch.full((rows,), float(n), device=self.score.device)
        index = self.store.token_index()
        index = index if index.dim() == 2 else index.unsqueeze(0)
        return (index >= pad[:, None]).sum(dim=1).float()

    def begin_step(self, rows: int, q: int, device: torch.device) -> None:
        """Make room in ``self.score`` for this step's ``q`` tokens (zero statistics)."""
        fresh = torch.zeros(rows, q, dtype=self.score_dtype, device=device)
        self.score = fresh if self.score is None else torch.cat([self.score, fresh], dim=1)

    # ---- storage ---------------------------------------------------------------------------------------------
    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        b, hkv, q, d = key.shape
        self.store.append(key.reshape(b * hkv, 1, q, d), value.reshape(b * hkv, 1, q, d), ctx.new_index)
        choice = self.choose(ctx)
        if choice is None:
            return
        keep, filler = choice
        self.evicted += len(self.store) - keep.shape[1]
        self.store.keep(keep)
        self.score = torch.gather(self.score, 1, keep.long())
        if bool(filler.any()):
            if ctx.pad_len is None:  # rows without padding share every budget, so never need fillers
                raise RuntimeError("kvshrink: eviction needed filler slots in a batch without padding")
            # index -1 reads as left padding: the slot is masked in attention and never chosen again
            self.store.index = self.store.index.masked_fill(filler, -1)

    def padding_tokens(self, ctx: StepContext) -> torch.Tensor:
        """``[B*H_kv, n]`` True where a stored token is left padding."""
        index = self.store.token_index()
        index = index if index.dim() == 2 else index.unsqueeze(0).expand(self.score.shape[0], -1)
        if ctx.pad_len is None:
            return torch.zeros_like(index, dtype=torch.bool)
        return index < self._row_pad(ctx)[:, None]

    def real_seen(self, ctx: StepContext) -> torch.Tensor:
        """``[B*H_kv]`` real (non-padding) tokens each row has seen: what a fraction budget is a share of."""
        rows = self.score.shape[0]
        seen = torch.full((rows,), self.seen, dtype=torch.long, device=self.score.device)
        if ctx.pad_len is None:
            return seen
        return seen - self._row_pad(ctx).to(seen.device)

    def nbytes(self) -> int:
        return self.store.nbytes() + held_bytes([self.score])

    def breakdown(self) -> dict[str, int]:
        return {"exact": self.store.nbytes(), "bookkeeping": held_bytes([self.score])}

    def stats(self) -> dict[str, float]:
        return {"kept_tokens": float(len(self.store)), "evicted_tokens": float(self.evicted)}

    def clear(self) -> None:
        self.store.reset()
        self.score = None
        self.evicted = 0

    def to_record(self) -> Record:
        return Record(meta={"seen": self.seen, "evicted": self.evicted}, tensors={"score": self.score},
                      parts={"store": self.store.to_record()})

    def load_record(self, reader: RecordReader) -> None:
        self.seen, self.evicted = reader.meta("seen"), reader.meta("evicted")
        self.store.load_record(reader.part("store"), self.info.dtype)
        # one statistic per stored token of each one-head row
        n = len(self.store)
        self.score = reader.tensor(TensorSpec("score", f"* {n}", dtype_name(self.score_dtype), optional=True))


def select_per_row(score: torch.Tensor, keep: torch.Tensor, recent: torch.Tensor,
                   padding: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Store positions ``[rows, m]`` (ascending) to keep and which of them are fillers, or None when
    nothing is evicted.

    Row ``r`` chooses its last ``recent[r]`` real tokens plus the ``keep[r] - recent[r]`` earlier real
    tokens with the highest ``score`` (as it would alone). Rows share one width ``m`` (the largest
    choice); a row that chose fewer is topped up with fillers: its padding tokens, and only if it has
    too few of those, its newest unchosen tokens. The caller masks fillers out for good, so each row
    attends over exactly the tokens it would keep alone.
    """
    rows, n = score.shape
    real = ~padding
    pos = torch.arange(n, device=score.device)
    # rank of each real token counted from the newest (0 = newest)
    from_newest = real.flip(1).long().cumsum(1).flip(1) - 1
    recent = torch.minimum(recent, keep)
    is_recent = real & (from_newest < recent[:, None])
    candidate = real & ~is_recent
    ranked = score.float().masked_fill(~candidate, float("-inf"))
    order = torch.argsort(ranked, dim=1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, pos.expand(rows, n))
    chosen = is_recent | (candidate & (rank < (keep - recent)[:, None]))
    m = int(chosen.sum(1).max())
    if m >= n and bool((chosen | padding).all()):
        return None
    m = min(m, n)  # at m == n nothing is dropped, but a row's unchosen real tokens still become fillers
    priority = chosen.float() * 4 + padding.float() * 2 + pos / (2.0 * n)
    top = torch.topk(priority, m, dim=1, sorted=False).indices
    top = torch.sort(top, dim=1).values
    return top, ~torch.gather(chosen, 1, top)
