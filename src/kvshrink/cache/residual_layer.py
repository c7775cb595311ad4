"""``ExactResidualLayer``: quantize each token once, when it leaves an exact residual of the most recent
ones (kivi, turboquant)."""

from __future__ import annotations

import torch

from kvshrink.cache.attention import Partial
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.record import Record, RecordReader
from kvshrink.cache.store import ExactStore, exact_storage_dtype, partial_or_none


class ExactResidualLayer(CacheLayer):
    """The newest tokens wait exactly in ``tail``; once it holds more than ``residual``, the oldest
    beyond it (a multiple of `flush_multiple`) go to `quantize`. Subclasses implement `quantize`,
    `code_partials` (attention over the quantized tokens), `clear_codes`, and the byte accounting."""

    commit_needs_attention = False  # quantizing needs only the keys and values

    def __init__(self, spec: LayerSpec, residual: int):
        super().__init__(spec)
        self.residual = residual
        self.tail = ExactStore(exact_storage_dtype("auto", self.info.dtype))

    def quantize(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Append the codes of ``key/value [B, H_kv, n, d]``, the oldest tokens of the tail."""
        raise NotImplementedError

    def code_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        """Attention of ``query`` over the quantized tokens (``[]`` when there are none)."""
        raise NotImplementedError

    def clear_codes(self) -> None:
        raise NotImplementedError

    def flush_multiple(self) -> int:
        """Tokens leave the tail in multiples of this many."""
        return 1

    def past_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        return self.code_partials(query, ctx) + partial_or_none(self.tail, query, ctx.scaling, ctx.pad_len)

    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        self.tail.append(key, value, ctx.new_index)
        unit = self.flush_multiple()
        flush = (len(self.tail) - self.residual) // unit * unit
        if flush > 0:
            self.quantize(*self.tail.pop_front(flush))
            self.quantized += flush

    def stats(self) -> dict[str, float]:
        return {"quantized_tokens": float(self.quantized), "exact_tokens": float(len(self.tail))}

    def clear(self) -> None:
        self.tail.reset()
        self.clear_codes()
        self.quantized = 0

    # ---- save / load: the tail here, the codes by the subclass (cache/record.py) --------------------
    def codes_record(self) -> dict[str, Record | None]:
        """The parts holding the quantized tokens' codes."""
        raise NotImplementedError

    def load_codes(self, reader: RecordReader) -> None:
        raise NotImplementedError

    def to_record(self) -> Record:
        return Record(meta={"seen": self.seen, "quantized": self.quantized},
                      parts={"tail": self.tail.to_record(), **self.codes_record()})

    def load_record(self, reader: RecordReader) -> None:
        self.seen, self.quantized = reader.meta("seen"), reader.meta("quantized")
        self.tail.load_record(reader.part("tail"), self.info.dtype)
        self.load_codes(reader)
