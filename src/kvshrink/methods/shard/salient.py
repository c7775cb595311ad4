"""Salient middle tokens: the few each KV head keeps exact, those the prompt's last queries attend to
most (SnapKV's observation window), max-pooled over neighbouring tokens."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from kvshrink.cache.attention import Partial, exact_partial
from kvshrink.cache.record import Record, RecordReader, TensorSpec
from kvshrink.cache.store import to_storage
from kvshrink.codecs.groupwise import GroupCode, dequantize_groups, quantize_groups
from kvshrink.kernels.backend import gpu_path
from kvshrink.methods.code_records import group_code_record, read_group_code

# How salient tokens are held: in the exact dtype, or as 8-bit codes with one fp16 step and zero point per
# token vector (68 bytes per 64-channel vector instead of 128: about twice the tokens for the same bytes).
SALIENT_DTYPES = ("exact", "int8")


@dataclass
class SalientTokens:
    """Middle tokens held apart from the block's codes, chosen per KV head: block rows ``index [B, H_kv, m]``
    (int32) and their keys and values ``[B, H_kv, m, d]``, in the exact dtype or as 8-bit `GroupCode`s
    (``salient_dtype="int8"``)."""

    index: torch.Tensor
    keys: torch.Tensor | GroupCode
    values: torch.Tensor | GroupCode

    @property
    def coded(self) -> bool:
        """Whether the keys and values are held as 8-bit codes (else as tensors in the exact dtype)."""
        return isinstance(self.keys, GroupCode)

    def key_values(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H_kv, m, d]`` in ``dtype``: the stored tensors, or the 8-bit codes decoded."""
        if self.coded:
            return tuple(dequantize_groups(x, torch.float32).to(dtype) for x in (self.keys, self.values))
        return self.keys.to(dtype), self.values.to(dtype)

    def hidden(self, n: int) -> torch.Tensor:
        """``[B, H_kv, 1, n]`` bool: True at the block rows held here (the codes' copies are not attended)."""
        b, h, _ = self.index.shape
        mask = torch.zeros(b, h, n, dtype=torch.bool, device=self.index.device)
        return mask.scatter_(2, self.index.long(), True).unsqueeze(2)

    def tensors(self) -> list[torch.Tensor]:
        if self.coded:
            return [self.index, *self.keys.tensors(), *self.values.tensors()]
        return [self.index, self.keys, self.values]

    # ---- save / load (cache/record.py): exact keys and values as tensors, 8-bit codes as parts -------------
    _INDEX = TensorSpec("index", "b H m", "int32")
    _EXACT = (TensorSpec("keys", "b H m D", optional=True), TensorSpec("values", "b H m D", optional=True))

    def to_record(self) -> Record:
        if self.coded:
            return Record(tensors={"index": self.index}, parts={
                "key_codes": group_code_record(self.keys, "b H m"), "value_codes": group_code_record(self.values, "b H m")})
        return Record(tensors={"index": self.index, "keys": self.keys, "values": self.values})

    @classmethod
    def from_record(cls, reader: RecordReader, exact_dtype: torch.dtype) -> "SalientTokens":
        index = reader.tensor(cls._INDEX)
        exact = reader.tensors(*cls._EXACT)
        key_codes, value_codes = reader.part("key_codes", optional=True), reader.part("value_codes", optional=True)
        if exact["keys"] is not None and exact["values"] is not None and key_codes is None and value_codes is None:
            reader.check(exact["keys"].dtype == exact["values"].dtype == exact_dtype,
                         f"exact salient tokens must be {exact_dtype}")
            return cls(index, exact["keys"], exact["values"])
        reader.check(exact["keys"] is None and exact["values"] is None and None not in (key_codes, value_codes),
                     "salient tokens are stored as exact keys and values, or as key and value codes")
        return cls(index, read_group_code(key_codes, "b H m"), read_group_code(value_codes, "b H m"))


def salient_partials(query: torch.Tensor, held: list[SalientTokens], scaling: float,
                     dtype: torch.dtype) -> list[Partial]:
    """The attention of ``query [B, H_q, q, d]`` over every block's salient tokens ``held``, which it sees
    all of (no padding, no future), read in ``dtype``. On the GPU path 8-bit codes are read in place by one
    kernel launch for up to 8 blocks, decoded in registers (no decoded copy in memory, and none of the ~14
    torch launches per block of decoding its keys and values); otherwise one exact partial per block over
    `SalientTokens.key_values` (the CPU fast path reads 8-bit codes in place too: `step_parts.StepParts.int8`)."""
    coded = [tokens for tokens in held if tokens.coded and gpu_path(query)]
    exact = [tokens for tokens in held if not (tokens.coded and gpu_path(query))]
    parts = []
    if coded:
        from kvshrink.kernels.exact_attention import int8_attention

        parts = [Partial(out, lse) for out, lse in int8_attention(
            query, [t.keys for t in coded], [t.values for t in coded], scaling, dtype)]
    return parts + [exact_partial(query, *tokens.key_values(dtype), scaling) for tokens in exact]


# Observation queries scored at once (bounds the score block to rows x tokens, not all queries x tokens).
_OBSERVE_ROWS = 16


def pooled(read: torch.Tensor, pool: int) -> torch.Tensor:
    """``read [B, H_kv, n]`` max-pooled over ``pool`` neighbouring tokens (a fact spans several tokens, and its
    neighbours are what gets copied next)."""
    b, h, n = read.shape
    return torch.nn.functional.max_pool1d(read.reshape(b * h, 1, n), pool, stride=1, padding=pool // 2).reshape(b, h, n)


def observed_attention(observer: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, H_kv, n]``: the mean attention the grouped observation queries ``[B, H_kv, R, d]`` pay to
    each of ``keys [B, H_kv, n, d]`` (softmax over these keys)."""
    b, h, rows, _ = observer.shape
    n = keys.shape[2]
    probs = torch.zeros(b, h, n, dtype=torch.float32, device=keys.device)
    for r in range(0, rows, _OBSERVE_ROWS):
        scores = observer[:, :, r:r + _OBSERVE_ROWS] @ keys.transpose(-1, -2)
        probs += torch.softmax(scores.mul_(scaling), dim=-1).sum(dim=2)
    return probs / rows


def most_read(observers: list[torch.Tensor], keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[B, H_kv, n]``: the most any of the observations (`observed_attention`) reads each token."""
    reads = [observed_attention(observer, keys, scaling) for observer in observers]
    return functools.reduce(torch.maximum, reads)


def pick_salient(importance: torch.Tensor, key: torch.Tensor, value: torch.Tensor, fraction: float,
                 dtype: torch.dtype, kept: torch.Tensor | None = None, held: str = "exact",
                 read: torch.Tensor | None = None, read_share: float = 0.5) -> SalientTokens | None:
    """The ``ceil(fraction * n)`` block rows per KV head of highest ``importance [B, H_kv, n]`` (see
    `pooled` `observed_attention`), sorted by row, with their keys and values from ``key/value [B, H_kv, span, d]``:
    block row ``i`` is token ``kept[i]`` of the span when some were evicted, else token ``i``. ``held``
    (`SALIENT_DTYPES`): stored in ``dtype``, or as 8-bit codes per token vector.

    Given ``read [B, H_kv, n]`` (the attention the tokens themselves get, `observed_attention`, when
    ``importance`` pools it over neighbours), ``read_share`` of the rows are the most read tokens, the others
    the highest by ``importance`` (the spans around the strongest reads: a fact the question asks for is copied
    from the tokens after it). The most read tokens are the ones later queries keep reading: a document
    compressed before its questions has no other sign of them (on the embedded model's 4K held-out text, rows
    by ``read`` alone gave KL 0.0070 against 0.0114 by 33-token pools)."""
    n = importance.shape[-1]
    count = min(n, math.ceil(fraction * n - 1e-9))  # 1e-9: 0.035 * 200 is not 7
    if count == 0:
        return None
    index = top_rows(importance, count, read, read_share).sort(dim=-1).values  # [B, H_kv, m]
    tokens = index if kept is None else kept[index]
    rows = tokens.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1])
    def store(x: torch.Tensor) -> torch.Tensor | GroupCode:
        if held == "exact":
            return to_storage(x, dtype)
        # the step and zero point are float16: refuse beyond its range, as an fp16 store does
        return quantize_groups(to_storage(x, torch.float16), 8, x.shape[-1])

    return SalientTokens(index.to(torch.int32), store(key.gather(2, rows)), store(value.gather(2, rows)))


def top_rows(importance: torch.Tensor, count: int, read: torch.Tensor | None, read_share: float) -> torch.Tensor:
    """``[B, H_kv, count]`` rows: the ``count`` highest by ``importance``, or with ``read``, ``read_share`` of them
    (rounded down) the highest by ``read`` and the others the highest by ``importance`` before them."""
    if read is None:
        return importance.topk(count, dim=-1).indices
    spans = importance.topk(count - int(read_share * count), dim=-1).indices
    rest = read.scatter(-1, spans, float("-inf")).topk(count - spans.shape[-1], dim=-1).indices
    return torch.cat([spans, rest], dim=-1)


def tokens_to_keep(importance: torch.Tensor, mass: float, count: int | None = None) -> torch.Tensor:
    """``[n]`` bool: the tokens a block stores. The least important tokens go, in ascending order of the
    most importance any KV head gives them (``importance [B, H_kv, n]``), while they hold at most ``mass``
    of every head's observed attention (how many go is decided by how peaked the prompt's attention is in
    this layer, not by a fixed count); given ``count``, no more than all but the ``count`` most important
    (a byte budget's count, see ``ShardConfig.ratio``: ``mass`` is then its guard); two at least."""
    share = importance / importance.sum(dim=-1, keepdim=True).clamp_min(1e-30)
    share = share.reshape(-1, share.shape[-1])                                  # [B*H_kv, n]
    order = share.amax(dim=0).argsort()
    worst = share[:, order].cumsum(dim=-1).amax(dim=0)                          # dropped share, worst head
    dropped = int((worst <= mass).sum()) if mass < 1 else share.shape[-1]      # 1: no guard (float sums)
    if count is not None:
        dropped = min(dropped, share.shape[-1] - min(max(count, 0), share.shape[-1]))
    dropped = min(dropped, max(0, share.shape[-1] - 2))     # a block keeps two tokens at least
    keep = torch.ones(share.shape[-1], dtype=torch.bool, device=share.device)
    keep[order[:dropped]] = False
    return keep
