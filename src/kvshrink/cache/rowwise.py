"""One store per batch row, for methods whose compression is fitted to the tokens it sees.

Shard fits PCA bases, bit allocations and value scales to the keys and values it compresses; LRQK fits
its low-rank factors to them. Fitted over a whole batch, a row's codes would depend on the other rows
(and on where the left padding ends), so a row would decode differently than alone. A method says so
with ``CacheLayer.split_batch_rows = True``; for a batch of ``B > 1`` rows the cache then gives each row
its own copy of the layers (``RowSplitLayer``), fed with that row's real tokens only, at the positions
and indices it would have alone: each row is compressed and decoded exactly as if it were alone.
"""

from __future__ import annotations

import torch

from kvshrink.cache.base import CacheLayer, StepContext, _sum_dicts
from kvshrink.cache.record import Record, RecordReader


def row_context(ctx: StepContext, row: int) -> StepContext | None:
    """The context row ``row`` would have alone (its left padding dropped), or None when every token of
    this step is padding for it. Built once per step and row, shared by the row's layers."""
    rows = ctx.__dict__.setdefault("_row_contexts", {})
    if row not in rows:
        pad = 0 if ctx.pad_len is None else int(ctx.pad_len[row])
        skip = min(ctx.q_len, max(0, pad - ctx.past_len))
        past = max(0, ctx.past_len - pad)
        rows[row] = None if skip == ctx.q_len else StepContext(
            past, ctx.q_len - skip, ctx.scaling, None, torch.zeros(1, dtype=torch.long, device=ctx.offset.device),
            ctx._rotary, ctx._dtype)
    return rows[row]


def one_row_layers(layers: list[CacheLayer]) -> list[CacheLayer]:
    """The method's own layers behind ``layers``: each row's layers for a split batch, else ``layers``."""
    return [row for layer in layers for row in getattr(layer, "rows", [layer])]


class RowSplitLayer(CacheLayer):
    """A layer of a ``B``-row batch made of ``B`` one-row layers of the same method."""

    def __init__(self, rows: list[CacheLayer]):
        super().__init__(rows[0].spec)
        self.rows = rows
        self.method_name = rows[0].method_name
        self.commit_needs_attention = rows[0].commit_needs_attention

    def attend(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        key, value = self._pending
        self._pending = None
        b, _, q, _ = query.shape
        out = query.new_zeros(b, q, query.shape[1], query.shape[3])  # padding queries: nobody reads them
        for i, layer in enumerate(self.rows):
            row_ctx = row_context(ctx, i)
            if row_ctx is None:
                continue
            skip = q - row_ctx.q_len
            layer.update(key[i:i + 1, :, skip:], value[i:i + 1, :, skip:])
            out[i:i + 1, skip:] = layer.attend(query[i:i + 1, :, skip:], row_ctx)
        return out

    def absorb_pending(self, ctx: StepContext) -> None:
        key, value = self._pending
        self._pending = None
        for i, layer in enumerate(self.rows):
            row_ctx = row_context(ctx, i)
            if row_ctx is not None:
                skip = key.shape[2] - row_ctx.q_len
                layer.update(key[i:i + 1, :, skip:], value[i:i + 1, :, skip:])
                layer.absorb_pending(row_ctx)

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.rows)

    def breakdown(self) -> dict[str, int]:
        return _sum_dicts([layer.breakdown() for layer in self.rows])

    def stats(self) -> dict[str, float]:
        total = _sum_dicts([layer.stats() for layer in self.rows])
        return {k: v / len(self.rows) if k.endswith("_rate") else v for k, v in total.items()}

    def clear(self) -> None:
        for layer in self.rows:
            layer.reset()

    def close(self) -> None:
        for layer in self.rows:
            layer.close()

    def shared_on_fork(self) -> list:
        return [obj for layer in self.rows for obj in layer.shared_on_fork()]

    def to_record(self) -> Record:
        return Record(meta={"seen": self.seen}, parts={"rows": [layer.to_record() for layer in self.rows]})

    def load_record(self, reader: RecordReader) -> None:
        self.seen = reader.meta("seen")
        rows = reader.parts("rows")
        reader.check(len(rows) == len(self.rows), f"holds {len(rows)} rows, the cache's batch has {len(self.rows)}")
        for layer, row in zip(self.rows, rows):
            layer.load_record(row)

