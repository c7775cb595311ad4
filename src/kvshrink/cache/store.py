"""Exact token storage with per-row token indices, and byte accounting.

Every method keeps some tokens exactly (the whole cache for ``full``, sinks and windows for Shard,
the kept set of eviction methods). ``ExactStore`` is that one piece of code.
"""

from __future__ import annotations

from typing import Iterable

import torch

from kvshrink.cache.attention import Partial, exact_partial
from kvshrink.cache.record import Record, RecordReader, Schema, TensorSpec, dtype_name
from kvshrink.kernels.backend import gpu_path
from kvshrink.kernels.deferred import FP16_MAX, FP16_OVERFLOW, defer_peak, peak_magnitude, storage_overflow_check

# Storage dtypes a method option may name (one spelling for every method).
STORAGE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# What an option for exactly kept tokens may say: "auto" (the model's dtype when it is 16-bit, else
# float16, the precision of the fp16 cache ratios are quoted against), "model", or a dtype by name.
EXACT_DTYPE_CHOICES = ("auto", "model", *STORAGE_DTYPES)


def exact_storage_dtype(option: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype an ``EXACT_DTYPE_CHOICES`` option stores exact tokens in, for a model of ``model_dtype``."""
    if option == "model" or (option == "auto" and model_dtype.itemsize == 2):
        return model_dtype
    return torch.float16 if option == "auto" else STORAGE_DTYPES[option]


def to_storage(x: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``x`` in ``dtype`` (unchanged for None); ValueError rather than a silent inf when narrowing to
    float16 would overflow (bf16 and fp32 models can hold values beyond float16's 65504).

    On the GPU path the check must not wait for the device: the largest magnitude narrowed is kept on
    the device (`defer_peak`) and checked by `raise_deferred` at the next point that synchronises anyway
    (the next prefill, every ``DEFERRED_CHECK_EVERY`` decode steps, ``cache.nbytes()``)."""
    if dtype is None or x.dtype == dtype:
        return x
    check_storage(x, dtype)
    return x.to(dtype)


def check_storage(x: torch.Tensor, dtype: torch.dtype) -> None:
    """`to_storage`'s overflow check alone, for a caller that converts while copying into its buffer."""
    if storage_overflow_check(x, dtype):
        if gpu_path(x):
            defer_peak(peak_magnitude(x), FP16_MAX, FP16_OVERFLOW)
        else:
            check_fp16_peak(float(x.detach().abs().amax()))


def check_fp16_peak(peak: float) -> None:
    """ValueError when values whose largest magnitude is ``peak`` are narrowed to float16 beyond its range
    (a NaN peak, as ``amax`` gives for values holding a NaN, passes: only overflow is refused)."""
    if peak > FP16_MAX:
        raise ValueError(f"kvshrink: a key or value of {peak:.4g} is beyond float16's range (+-65504); " + FP16_OVERFLOW)


def first_index(index: torch.Tensor) -> int:
    """``int(index[0])`` of a 1-D token index, read without waiting for the device when the index is a
    step's ``StepContext.new_index`` (which carries its first value on the host)."""
    first = getattr(index, "kvshrink_first", None)
    return int(index[0]) if first is None else first


def _int32(index: torch.Tensor) -> torch.Tensor:
    """``index`` as int32; a step's ``new_index`` converts once per step, shared by the layers."""
    if index.dtype == torch.int32:
        return index
    if getattr(index, "kvshrink_first", None) is None:
        return index.to(torch.int32)
    converted = getattr(index, "kvshrink_int32", None)
    if converted is None:
        converted = index.kvshrink_int32 = index.to(torch.int32)
    return converted


# Tokens dequantized at once when a method attends over a quantized segment (bounds transient memory).
DEQUANT_BLOCK = 1024


def held_bytes(tensors: Iterable[torch.Tensor | None]) -> int:
    """Bytes of the storages behind ``tensors``, each storage counted once.

    A view keeps its whole storage alive, so a sliced tensor is charged for what it really holds.
    """
    seen: set[tuple[int, str]] = set()
    total = 0
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        key = (storage.data_ptr(), str(t.device))
        if key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def fp16_kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, tokens: int, batch: int = 1) -> int:
    """Bytes an fp16 DynamicCache holds for ``tokens`` tokens of ``batch`` rows."""
    return 2 * num_layers * num_kv_heads * head_dim * tokens * batch * 2


class ExactStore:
    """Keys and values ``[B, H_kv, n, d]`` kept exactly, with each token's index.

    ``index`` is None while the store holds the contiguous tokens ``start..start+n-1`` of every row
    (no bookkeeping needed; ``start`` moves when :meth:`pop_front` hands the oldest tokens on, as a
    recent-token tail does); once rows diverge (eviction) it becomes an int32 ``[B, n]`` tensor.
    ``dtype`` overrides the storage dtype (e.g. fp16 sinks in an fp32 model).
    """

    def __init__(self, dtype: torch.dtype | None = None):
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None
        self.index: torch.Tensor | None = None
        self.start = 0

    def __len__(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def token_index(self) -> torch.Tensor:
        """``[B, n]`` (or ``[n]`` while contiguous) indices of the stored tokens."""
        if self.index is not None:
            return self.index.long()
        return torch.arange(self.start, self.start + len(self), device=self.keys.device)

    def append(self, key: torch.Tensor, value: torch.Tensor, index: torch.Tensor) -> None:
        """Add tokens ``[B, H_kv, q, d]`` whose indices are ``index`` (``[q]`` or ``[B, q]``)."""
        key, value = to_storage(key, self.dtype), to_storage(value, self.dtype)
        if self.keys is None and self.index is None and index.dim() == 1:
            self.start = first_index(index)  # an empty store starts where its first tokens do (e.g. a window)
        contiguous = index.dim() == 1 and self.index is None and first_index(index) == self.start + len(self)
        if not contiguous:
            self._materialise_index(key.shape[0])
            idx = _int32(index)
            idx = idx if idx.dim() == 2 else idx.unsqueeze(0).expand(key.shape[0], -1)
            self.index = idx if self.index is None else torch.cat([self.index, idx], 1)
        if self.keys is None:
            self.keys, self.values = key.contiguous(), value.contiguous()
        else:
            self.keys = torch.cat([self.keys, key], dim=2)
            self.values = torch.cat([self.values, value], dim=2)

    def _materialise_index(self, batch: int) -> None:
        if self.index is None and self.keys is not None:
            index = self.token_index().to(torch.int32)
            self.index = index.expand(batch, len(self)).contiguous()

    def pop_front(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Remove and return the ``n`` oldest tokens' keys and values (contiguous stores only)."""
        if self.index is not None:
            raise NotImplementedError("pop_front needs a store whose rows hold the same tokens")
        k, v = self.keys[:, :, :n], self.values[:, :, :n]
        # clone, not contiguous(): a slice that is already contiguous would keep the old storage alive
        rest = len(self) - n
        self.keys = self.keys[:, :, n:].clone() if rest else None
        self.values = self.values[:, :, n:].clone() if rest else None
        self.start += n
        return k, v

    def keep(self, positions: torch.Tensor) -> None:
        """Keep, per row, the stored tokens at ``positions`` (``[B, m]`` positions in the store)."""
        self._materialise_index(self.keys.shape[0])
        b, hkv, _, d = self.keys.shape
        gather = positions.long()[:, None, :, None].expand(b, hkv, positions.shape[1], d)
        self.keys = torch.gather(self.keys, 2, gather)
        self.values = torch.gather(self.values, 2, gather)
        self.index = torch.gather(self.index, 1, positions.long())

    def take(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Copies of the keys, values and indices at ``positions`` (``[B, m]``), store unchanged."""
        b, hkv, _, d = self.keys.shape
        gather = positions.long()[:, None, :, None].expand(b, hkv, positions.shape[1], d)
        index = self.token_index()
        index = index if index.dim() == 2 else index.unsqueeze(0).expand(b, -1)
        return (torch.gather(self.keys, 2, gather), torch.gather(self.values, 2, gather),
                torch.gather(index, 1, positions.long()))

    def partial(self, query: torch.Tensor, scaling: float, pad_len: torch.Tensor | None,
                return_probs: bool = False):
        """Exact attention of ``query`` over every stored token (all are in the query's past)."""
        if self.index is None and not return_probs and gpu_path(query):  # indices start.. known: no arange
            return exact_partial(query, self.keys, self.values, scaling, pad_len=pad_len, key_start=self.start)
        return exact_partial(query, self.keys, self.values, scaling, key_index=self.token_index(),
                             pad_len=pad_len, return_probs=return_probs)

    def keep_ranges(self, ranges: list[tuple[int, int]]) -> None:
        """Keep the store positions ``a..b-1`` of each ``(a, b)`` in ``ranges`` (the same in every row):
        slices and one concatenation, no gather and no index arithmetic (streaming's sinks and window)."""
        self._materialise_index(self.keys.shape[0])
        self.keys = torch.cat([self.keys[:, :, a:b] for a, b in ranges], dim=2)
        self.values = torch.cat([self.values[:, :, a:b] for a, b in ranges], dim=2)
        self.index = torch.cat([self.index[:, a:b] for a, b in ranges], dim=1)

    def select_batch(self, indices: torch.Tensor) -> None:
        if self.keys is None:
            return
        self.keys = self.keys.index_select(0, indices)
        self.values = self.values.index_select(0, indices)
        if self.index is not None:
            self.index = self.index.index_select(0, indices)

    def crop_to(self, tokens: int) -> None:
        """Drop stored tokens whose index is ``>= tokens`` (contiguous stores only)."""
        if self.keys is None:
            return
        if self.index is not None:
            raise NotImplementedError("cannot crop a store whose rows hold different tokens")
        keep = max(0, tokens - self.start)
        self.keys = self.keys[:, :, :keep].contiguous()
        self.values = self.values[:, :, :keep].contiguous()

    def tensors(self) -> list[torch.Tensor | None]:
        return [self.keys, self.values, self.index]

    def nbytes(self) -> int:
        return held_bytes(self.tensors())

    # ---- save / load (cache/record.py) ------------------------------------------------------------
    RECORD = Schema(tensors=(TensorSpec("keys", "b h n D", optional=True), TensorSpec("values", "b h n D", optional=True),
                             TensorSpec("index", "b n", "int32", optional=True)),
                    meta=("start",))

    def to_record(self) -> Record:
        return self.RECORD.write(self)

    def load_record(self, reader: RecordReader, model_dtype: torch.dtype) -> None:
        """Restore a stored store into this empty one (of the dtype the method's options give it)."""
        fields = self.RECORD.read(reader)
        keys, values, index = fields["keys"], fields["values"], fields["index"]
        reader.check((keys is None) == (values is None), "keys and values are stored together")
        reader.check(keys is not None or index is None, "an empty store holds no token indices")
        want = self.dtype or model_dtype
        reader.check(keys is None or keys.dtype == values.dtype == want,
                     f"holds {dtype_name(keys.dtype) if keys is not None else ''} tokens; this store keeps "
                     f"{dtype_name(want)}")
        self.keys, self.values, self.index, self.start = keys, values, index, fields["start"]


def partial_or_none(store: ExactStore, query: torch.Tensor, scaling: float,
                    pad_len: torch.Tensor | None) -> list[Partial]:
    """``[store.partial(...)]`` or ``[]`` for an empty store."""
    return [store.partial(query, scaling, pad_len)] if len(store) else []
