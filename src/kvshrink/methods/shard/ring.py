"""`ExactRing`: a layer's sinks and recent window in one preallocated buffer while decoding, so a decode
step writes its token in place and attends to every exact token of the buffer with one kernel call
(no concatenation, no copy of the window per step)."""

from __future__ import annotations

import torch

from kvshrink.cache.attention import Partial, exact_partial
from kvshrink.cache.store import ExactStore, check_storage
from kvshrink.kernels.backend import gpu_path, triton_available
from kvshrink.kernels.cpu import exact_parts, numba_support, step_parts

_WORDS = (torch.float16, torch.bfloat16)   # ring dtypes the CPU fast path reads as words


class ExactRing:
    """Keys and values ``[B, H_kv, sinks + slots, d]`` (one buffer ``kv [2, ...]``: a token's key and value
    are written, and leave for the stream, in one op): the sinks in the first rows (fixed), then a ring of
    ``slots`` rows holding the window, oldest at ring position ``head``.

    Attention is a sum over a set of tokens, so the ring's order does not matter to it; only the stores
    it is unpacked to (`stores`) are in token order. Every row is a past token of the query and none is
    padding (the layer uses the ring only for one unpadded row), so no mask is needed. Once the window
    is full the whole buffer is live: the partial reads it as it is, without a copy.
    """

    def __init__(self, sinks: ExactStore, window: ExactStore, slots: int, like: torch.Tensor, next_index: int):
        self.dtype = window.dtype
        self.n_sinks, self.slots = len(sinks), slots
        b, h, _, d = like.shape
        self.kv = torch.empty((2, b, h, self.n_sinks + slots, d), dtype=self.dtype, device=like.device)
        self.keys, self.values = self.kv[0], self.kv[1]
        if self.n_sinks:
            self.keys[:, :, :self.n_sinks] = sinks.keys
            self.values[:, :, :self.n_sinks] = sinks.values
        self.sinks_start = sinks.start
        self.count = len(window)
        if self.count > slots:
            raise ValueError(f"a window of {self.count} tokens does not fit a ring of {slots} slots")
        if self.count:
            self.keys[:, :, self.n_sinks:self.n_sinks + self.count] = window.keys
            self.values[:, :, self.n_sinks:self.n_sinks + self.count] = window.values
        self.head = 0
        self.start = window.start if self.count else next_index  # token index of the oldest window token

    def put(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """Store one token ``[B, H_kv, 1, d]`` (the ring must have a free slot)."""
        at = self.n_sinks + (self.head + self.count) % self.slots
        if gpu_path(key) and triton_available() and key.stride(-1) == value.stride(-1) == 1:
            from kvshrink.kernels.shard_ring import put_token

            put_token(self.kv, at, key, value)   # one launch, the overflow check included
        else:
            both = torch.stack([key, value])
            check_storage(both, self.dtype)
            self.kv[:, :, :, at:at + 1] = both     # converted to the ring's dtype by the copy
        self.count += 1

    def pop_oldest(self) -> tuple[torch.Tensor, int]:
        """The oldest window token's key and value ``[2, B, H_kv, 1, d]`` (a view, valid until the next
        `put`) and its token index; its slot becomes free."""
        at = self.n_sinks + self.head
        index = self.start
        self.head = (self.head + 1) % self.slots
        self.count -= 1
        self.start += 1
        return self.kv[:, :, :, at:at + 1], index

    def partial(self, query: torch.Tensor, scaling: float,
                extra: list[tuple[torch.Tensor, torch.Tensor]] = (),
                new: tuple[torch.Tensor, torch.Tensor] | None = None) -> Partial | None:
        """Exact attention of ``query`` over every token held and the ``extra`` keys and values (tokens
        the query sees all of, in the ring's dtype: attended in the same call), None when there are none.
        ``new`` (the step's own key and value ``[B, H_kv, 1, d]``, unrounded; GPU path with Triton only) is
        attended in the same launch (`kernels.exact_attention.exact_attention`'s ``new``)."""
        keys, values = self._with(extra)
        if new is not None:
            if not (gpu_path(query) and triton_available()):
                raise ValueError("ExactRing.partial attends a new token in the ring's launch on the GPU path only")
            from kvshrink.kernels.exact_attention import exact_attention

            return Partial(*exact_attention(query, keys, values, scaling, new=new))
        return exact_partial(query, keys, values, scaling) if keys.shape[2] else None

    def attend_into(self, parts: step_parts.StepParts, extra: list[tuple[torch.Tensor, torch.Tensor]] = (),
                    new: tuple[torch.Tensor, torch.Tensor] | None = None, views: numba_support.NumpyViews | None = None
                    ) -> None:
        """`partial` on the CPU fast path, written into ``parts``; ``new`` (the step's own key and value, in any
        float dtype, not rounded to the ring's) attended in the same call (one partial and merge term fewer than
        attending it apart). A 16-bit ring whose live rows come first is read in place from its words (kept in
        ``views``), with no float32 copy of its tokens."""
        live = self.n_sinks + self.count
        if views is not None and not extra and self.dtype in _WORDS and self.kv.is_contiguous() and self._live_first():
            if live or new is not None:
                parts.ring(views.get("ring", self.kv, exact_parts.ring_words), live, self.dtype, new)
            return
        keys, values = self._with(extra)
        if new is not None:     # float32 throughout: the ring's rows widened exactly, the new token unrounded
            keys = torch.cat([keys.float(), new[0].float()], dim=2)
            values = torch.cat([values.float(), new[1].float()], dim=2)
        if keys.shape[2]:
            parts.exact(keys, values)

    def _with(self, extra: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """The live keys and values, then ``extra``'s (views when there is nothing to add)."""
        live = self.n_sinks + self.count
        if self._live_first():
            keys, values = self.keys[:, :, :live], self.values[:, :, :live]
        else:
            keys, values = self._in_order()  # a free slot inside the ring
        if extra:
            keys = torch.cat([keys, *(k for k, _ in extra)], dim=2)
            values = torch.cat([values, *(v for _, v in extra)], dim=2)
        return keys, values

    def _live_first(self) -> bool:
        """Whether the live rows are the buffer's first ones (the whole buffer, or a window still filling), so they
        are read in place."""
        return self.n_sinks + self.count == self.keys.shape[2] or self.head == 0

    def _window_positions(self) -> torch.Tensor:
        """Buffer rows of the window, oldest first."""
        order = (torch.arange(self.count) + self.head) % max(1, self.slots)
        return (order + self.n_sinks).to(self.keys.device)

    def window(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The window's keys and values ``[B, H_kv, count, d]``, oldest first (copies)."""
        rows = self._window_positions()
        return self.keys.index_select(2, rows), self.values.index_select(2, rows)

    def _in_order(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of the sinks then the window in token order (copies)."""
        rows = torch.cat([torch.arange(self.n_sinks, device=self.keys.device), self._window_positions()])
        return self.keys.index_select(2, rows), self.values.index_select(2, rows)

    def stores(self) -> tuple[ExactStore, ExactStore]:
        """The sinks and the window as `ExactStore`s in token order (copies: the ring can be dropped)."""
        sinks, window = ExactStore(self.dtype), ExactStore(self.dtype)
        if self.n_sinks:
            sinks.keys = self.keys[:, :, :self.n_sinks].clone()
            sinks.values = self.values[:, :, :self.n_sinks].clone()
            sinks.start = self.sinks_start
        if self.count:
            rows = self._window_positions()
            window.keys = self.keys.index_select(2, rows)
            window.values = self.values.index_select(2, rows)
        window.start = self.start
        return sinks, window

    def sinks_nbytes(self) -> int:
        return 2 * self.keys[:, :, :self.n_sinks].numel() * self.keys.element_size()

    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()
