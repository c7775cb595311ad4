"""Shard's compressed segments: `MiddleBlock` (one prefill chunk's PCA key codes and VQ value
codes), `EvictedTokens` (a prompt's evicted tokens until the next call) and `TurboSegment` (the
TurboQuant decode stream)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from kvshrink.cache.base import StepContext
from kvshrink.cache.record import Record, RecordReader, Schema, TensorSpec
from kvshrink.codecs.bitpack import unpack_bits
from kvshrink.codecs.lloyd_max import TurboCode
from kvshrink.codecs.pca import PCACode, stack_fields
from kvshrink.kernels.cpu import exact_parts
from kvshrink.methods.code_records import pca_code_record, read_pca_code, read_turbo_code, turbo_code_record
from kvshrink.methods.shard.salient import SalientTokens


@dataclass
class BlockDerived:
    """What the decode paths derive from a block's fields and keep on it: each part built on first use,
    never saved (a copied or loaded block starts with an empty one), counted in the layer's `breakdown`."""

    runs: Any = None          # `kernels.cpu.block_attention.RunLayout`: the CPU kernel's run layout
    key_factors: Any = None   # the fused CPU kernel's small per-scope float32 factors (see `BasisFactors`)
    table_bound: float | None = None  # the reference decoder's table bound (a float of the codes alone)
    rows: torch.Tensor | None = None  # `MiddleBlock.rows` on the block's device (found with a sync, once)
    gpu: Any = None           # `kernels.shard_code_attention.BlockInputs` (the GPU path's kernel inputs)
    arrays: Any = None        # `ShardLayer.block_arrays`: numpy views of the codes (the CPU fast path's; no bytes)

    def runs_nbytes(self) -> int:
        return 0 if self.runs is None else self.runs.nbytes()

    def key_factors_nbytes(self) -> int:
        return 0 if self.key_factors is None else self.key_factors.nbytes()

    def device_nbytes(self) -> int:
        """Bytes of the GPU path's parts (the kept rows and the kernels' inputs)."""
        rows = 0 if self.rows is None else self.rows.numel() * self.rows.element_size()
        return rows + (0 if self.gpu is None else self.gpu.nbytes())


@dataclass
class BasisFactors:
    """A block's PCA scopes' small factors in float32, stacked once (a few hundred bytes a scope): each basis
    column's step times its scale ``[S, 1, r]`` (zero past a scope's rank), the per-channel scale ``[S, W, 1]``
    (or None) and the mean ``[S, W]`` (times that scale). A step's scaled bases are then one conversion and
    one or two products of the int8 bases, not a dozen small ops (`scaled_bases_t`)."""

    factor: torch.Tensor
    column: torch.Tensor | None
    mean: torch.Tensor

    @classmethod
    def of(cls, codes: list[PCACode]) -> "BasisFactors":
        rank = max(1, max(code.rank for code in codes))
        factor = stack_fields(codes, "basis_scale", rank).float() * stack_fields(codes, "coeff_step", rank).float()
        factor = factor.unsqueeze(1)
        mean = torch.stack([code.mean.float() for code in codes])
        column = None
        if codes[0].column_scale is not None:
            column = torch.stack([code.column_scale.float() for code in codes])
            mean = mean * column
            column = column.unsqueeze(-1)
        return cls(factor, column, mean)

    def scaled_bases_t(self, codes: list[PCACode]) -> torch.Tensor:
        """float32 ``[S, W, r]``: each scope's int8 basis times its factors (zero columns past its rank)."""
        rank = self.factor.shape[-1]
        bases = torch.stack([code.basis_q if code.rank == rank else
                             torch.nn.functional.pad(code.basis_q, (0, rank - code.rank)) for code in codes])
        scaled = bases.float().mul_(self.factor)
        return scaled if self.column is None else scaled.mul_(self.column)

    def nbytes(self) -> int:
        parts = [self.factor, self.mean] + ([] if self.column is None else [self.column])
        return sum(t.numel() * t.element_size() for t in parts)


class BlockArrays(NamedTuple):
    """Numpy views of a block's codes as the CPU fast path's kernels read them: the PCA scopes' key codes, the
    value codes, the int32 rows held apart (or None), the 8-bit salient keys' and values' `exact_parts.int8_arrays`
    (or None) and the scopes' int8 bases. Views share the block's memory: they hold no bytes of their own (`of`
    refuses non-contiguous key and value codes, which would be copied; the held rows are stored int32 and the
    salient codes contiguous; non-contiguous bases are left to the torch ops)."""

    scopes: list
    v_codes: np.ndarray
    hidden: np.ndarray | None
    salient: tuple | None
    bases: tuple | None      # the scopes' int8 bases (None unless all are contiguous: `block_attention.scaled_bases`)

    @classmethod
    def of(cls, block: "MiddleBlock") -> "BlockArrays":
        def view(t: torch.Tensor) -> np.ndarray:
            if not t.is_contiguous():
                raise ValueError(f"a block's codes must be contiguous to be read in place, got strides {t.stride()}")
            return t.detach().numpy()

        held = block.salient
        coded = held is not None and held.coded
        bases = [code.basis_q for code in block.keys]
        return cls([view(code.codes) for code in block.keys], view(block.v_codes),
                   None if held is None else view(held.index),
                   (exact_parts.int8_arrays(held.keys), exact_parts.int8_arrays(held.values)) if coded else None,
                   tuple(view(b) for b in bases) if all(b.is_contiguous() and b.numel() for b in bases) else None)


@dataclass
class MiddleBlock:
    """One prefill chunk's compressed middle tokens: ``start .. start+n-1``, or, when some were evicted,
    the ``n`` tokens of ``start .. start+span-1`` that ``kept`` marks (no padding among them)."""

    start: int
    n: int
    keys: list[PCACode]  # pre-RoPE keys [B, n, H_kv*d], one code per PCA scope (the layer, or each head)
    v_codes: torch.Tensor  # [B, H_kv, n, ceil(d/group * bits / 8)] uint8
    v_codebook: torch.Tensor  # [K, group] fp16
    v_scale: torch.Tensor  # [H_kv, d] fp16, per (head, rotated channel)
    v_mean: torch.Tensor | None = None  # [H_kv, d] fp16: the values were coded less it (None: not centred)
    salient: SalientTokens | None = None  # rows also held exact (their codes are masked in attention)
    kept: torch.Tensor | None = None  # [ceil(span/8)] uint8: 1 bit per covered token, set if stored
    span: int = 0  # tokens covered, stored or evicted (n when nothing was evicted)

    @property
    def covers(self) -> int:
        """Tokens the block covers: ``start .. start+covers-1``."""
        return self.span or self.n

    def rows(self) -> torch.Tensor | None:
        """Offsets from ``start`` of the stored tokens ``[n]`` (None: all of ``start .. start+n-1``)."""
        if self.kept is None:
            return None
        return unpack_bits(self.kept, 1, self.span).nonzero().squeeze(-1)

    def token_index(self, device) -> torch.Tensor:
        """Token indices ``[n]`` of the stored rows."""
        rows = self.rows()
        if rows is None:
            return torch.arange(self.start, self.start + self.n, device=device)
        return rows.to(device) + self.start

    @property
    def derived(self) -> BlockDerived:
        """The decode paths' derived state (see `BlockDerived`), made empty on first access."""
        state = self.__dict__.get("_derived")
        if state is None:
            state = self.__dict__["_derived"] = BlockDerived()
        return state

    def __getstate__(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k != "_derived"}

    # ---- save / load (cache/record.py). A new stored field: a dataclass field above and one line here. -------
    RECORD = Schema(tensors=(TensorSpec("v_codes", "b H n *", "uint8"), TensorSpec("v_codebook", "k *", "float16"),
                             TensorSpec("v_scale", "H D", "float16"), TensorSpec("v_mean", "H D", "float16", optional=True),
                             TensorSpec("kept", "*", "uint8", optional=True)),
                    meta=("start", "n", "span"))
    _KEY_LEAD = "b"   # each PCA scope's codes: [B, n, bytes]

    def to_record(self) -> Record:
        return self.RECORD.write(self, keys=[pca_code_record(code, self._KEY_LEAD) for code in self.keys],
                                 salient=None if self.salient is None else self.salient.to_record())

    @classmethod
    def from_record(cls, reader: RecordReader, exact_dtype: torch.dtype) -> "MiddleBlock":
        fields = cls.RECORD.read(reader)
        keys = [read_pca_code(scope, cls._KEY_LEAD) for scope in reader.parts("keys")]
        reader.check(bool(keys) and all(code.n == fields["n"] for code in keys), "its key codes must code its n tokens")
        salient = reader.part("salient", optional=True)
        block = cls(**fields, keys=keys, salient=None if salient is None else SalientTokens.from_record(salient, exact_dtype))
        reader.check((block.kept is None) == (block.span == 0), "a block's kept-token map and span go together")
        return block

    def parts(self) -> dict[str, list[torch.Tensor]]:
        k = {kind: [t for code in self.keys for t in code.parts()[kind]] for kind in ("codes", "scales", "bases")}
        return {"k_codes": k["codes"], "k_scales": k["scales"], "k_bases": k["bases"],
                "v_codes": [self.v_codes], "v_scales": [self.v_scale] + ([] if self.v_mean is None else [self.v_mean]),
                "v_codebooks": [self.v_codebook],
                "salient": [] if self.salient is None else self.salient.tensors(),
                "kept": [] if self.kept is None else [self.kept]}


@dataclass
class EvictedTokens:
    """A prompt's evicted middle tokens, ``start + rows`` of the ``span`` its block covers, held as they left
    the exact window (post-RoPE, its dtype) until the next call shows whether they are needed: a decode step
    drops them, anything else (a continued prompt, a fork, a save) codes them as a block of their own."""

    start: int
    span: int
    rows: torch.Tensor   # [n] int64 offsets from start, ascending
    key: torch.Tensor    # [B, H_kv, n, d]
    value: torch.Tensor  # [B, H_kv, n, d]
    ctx: StepContext     # the prompt's step: the tokens' RoPE positions, to code them later

    def tensors(self) -> list[torch.Tensor]:
        return [self.key, self.value, self.rows]


# The stream buffer's free slots are held, and counted, bytes: it grows by an eighth of the tokens it holds
# (at least _STREAM_MIN_GROW), so they stay a small share of the stream and a regrowth's copy is rare.
_STREAM_MIN_GROW = 8


def _stream_growth(held: int) -> int:
    return max(_STREAM_MIN_GROW, held // 8)


@dataclass
class TurboSegment:
    """TurboQuant codes of K and V ``[B, H_kv, n]`` (tokens after the prompt), each coded less its ``centre``.

    The centre (``[2, B, H_kv, d]`` float32: the keys', the values') is the mean of the exact window's tokens when
    the first token enters (`ShardLayer.centre_stream`). Keys carry a large shared part (a key projection's bias,
    outlier channels); a data-oblivious code of the whole key spends its levels on that part and its error, a
    share of the key's norm, swamps the small part that tells tokens apart. Less the centre, the code spends
    them on what differs; attention adds the centre back exactly (``q . centre`` to every score, so to the
    partial's lse alone; the value centre to the output). None: zero.

    On the GPU path they are views of one ``buffer`` (``[2, B, H_kv, capacity, ...]``, keys then values)
    that the encode kernel writes in place, so a decode step appends without a concatenation."""

    # no class default (a factory instead): after `filled` they are missing and `__getattr__` makes them
    keys: TurboCode | None = field(default_factory=lambda: None)
    values: TurboCode | None = field(default_factory=lambda: None)
    n: int = 0
    runs: list = None  # (first index, count) of each appended run; python ints, for `dequantized`
    buffer: TurboCode | None = None
    centre: torch.Tensor | None = None

    def add_run(self, start: int, count: int) -> None:
        """Record tokens ``start .. start+count-1`` as appended: one run with the last when they follow it (a
        decode step's token each step: the list stays one run long, not one entry per generated token)."""
        runs = list(self.runs or [])
        if runs and runs[-1][0] + runs[-1][1] == start:
            runs[-1] = (runs[-1][0], runs[-1][1] + count)
        else:
            runs.append((start, count))
        self.runs = runs

    def append(self, k: TurboCode, v: TurboCode, start: int, n: int) -> None:
        self.add_run(start, n)
        self.buffer = None  # the codes are concatenated: compact again
        if self.keys is None:
            self.keys, self.values, self.n = k, v, n
            return
        self.keys = TurboCode.cat(self.keys, k)
        self.values = TurboCode.cat(self.values, v)
        self.n += n

    def room(self, count: int, rows: tuple[int, ...], n_bytes: int, device) -> TurboCode:
        """The buffer (codes ``[2, *rows, capacity, n_bytes]``, norms ``[2, *rows, capacity]``) with room for
        ``count`` more tokens after the ``n`` held: made, or grown when full by `_stream_growth` free slots beyond
        them (the tokens held copied in once). Write them there, then call `filled`."""
        if self.buffer is not None and self.n + count <= self.buffer.codes.shape[-2]:
            return self.buffer
        return self._buffer_of(self.n + count + _stream_growth(self.n + count), rows, n_bytes, device)

    def _buffer_of(self, capacity: int, rows: tuple[int, ...], n_bytes: int, device) -> TurboCode:
        """A buffer of ``capacity`` tokens holding the ``n`` held, made the stream's."""
        buffer = TurboCode(norm=torch.empty(2, *rows, capacity, dtype=torch.float16, device=device),
                           codes=torch.empty(2, *rows, capacity, n_bytes, dtype=torch.uint8, device=device))
        for i, held in enumerate((self.keys, self.values)):
            if self.n:
                buffer.norm[i, ..., :self.n] = held.norm
                buffer.codes[i, ..., :self.n, :] = held.codes
        self.buffer = buffer
        return buffer

    def filled(self, start: int, count: int) -> None:
        """``count`` tokens from index ``start`` were written into the buffer after the ``n`` held."""
        self.add_run(start, count)
        self.n += count
        # the views of the first ``n`` tokens are made again when next read (`__getattr__`), not at every decode
        # step: the CPU fast path reads the buffer itself (~30 us a layer and step in a model step)
        self.__dict__.pop("keys", None)
        self.__dict__.pop("values", None)

    def __getattr__(self, name: str):
        # only for attributes not set: ``keys`` and ``values`` after `filled`, views of the buffer's first ``n``
        if name in ("keys", "values") and self.__dict__.get("buffer") is not None:
            self.keys, self.values = (self.buffer.select(i).tokens(0, self.n) for i in (0, 1))
            return self.__dict__[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def index(self, device) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.runs])

    # ---- save / load (cache/record.py): the codes held, and the buffer's capacity (its free slots are held
    # bytes: a loaded stream holds as many as the saved one) ---------------------------------------------------
    CENTRE = TensorSpec("centre", "2 * H D", "float32", optional=True)
    RECORD = Schema(tensors=(CENTRE,), meta=("n", "runs", "capacity"), parts=("keys", "values"))

    def to_record(self) -> Record:
        capacity = None if self.buffer is None else self.buffer.codes.shape[-2]
        return Record(meta={"n": self.n, "runs": [list(run) for run in self.runs or []], "capacity": capacity},
                      tensors={"centre": self.centre},
                      parts={"keys": turbo_code_record(self.keys, "b H n"),
                             "values": turbo_code_record(self.values, "b H n")})

    @classmethod
    def from_record(cls, reader: RecordReader) -> "TurboSegment":
        n, runs = reader.meta("n"), reader.meta("runs")
        reader.check(isinstance(runs, list) and all(isinstance(r, list) and len(r) == 2 for r in runs)
                     and sum(count for _, count in runs) == n, f"its runs must cover its {n} tokens")
        keys = read_turbo_code(reader.part("keys", optional=True), "b H n")
        values = read_turbo_code(reader.part("values", optional=True), "b H n")
        reader.check((keys is None) == (values is None) == (n == 0), "keys and values are stored for its tokens")
        reader.check(keys is None or keys.norm.shape[-1] == values.norm.shape[-1] == n,
                     f"its codes must hold its {n} tokens")
        segment = cls(keys=keys, values=values, n=n, runs=[tuple(run) for run in runs] or None,
                      centre=reader.tensor(cls.CENTRE))
        capacity = reader.meta("capacity")
        if capacity is not None:
            reader.check(isinstance(capacity, int) and capacity >= n and keys is not None and keys.qjl_norm is None,
                         f"a buffer of {capacity} tokens cannot hold its {n} tokens")
            segment._buffer_of(capacity, tuple(keys.norm.shape[:-1]), keys.codes.shape[-1], keys.norm.device)
            del segment.keys, segment.values  # views of the buffer from now on, as after a decode step (`filled`)
        return segment

    def tensors(self) -> list[torch.Tensor]:
        centre = [] if self.centre is None else [self.centre]
        return centre + ([] if self.keys is None else self.keys.tensors() + self.values.tensors())

    def centre_of(self, kind: int) -> torch.Tensor | None:
        """The keys' (``kind`` 0) or the values' (1) centre ``[B, H_kv, 1, d]``, broadcasting over tokens."""
        return None if self.centre is None else self.centre[kind].unsqueeze(-2)


def stack_scopes(codes: list[PCACode]) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed codes ``[B, S, n, bytes]`` and int8 bases ``[S, D, r_max]`` of a block's PCA scopes as one
    tensor each (what the GPU kernel reads); each scope's own ``codes`` and ``basis_q`` become views of
    them (narrower rows and lower ranks zero-padded), so the block holds those bytes once, not twice."""
    if len(codes) == 1:
        return codes[0].codes.unsqueeze(-3), codes[0].basis_q.unsqueeze(0)
    stacked = stacked_codes(codes)
    rank = max(code.rank for code in codes)
    bases = torch.stack([torch.nn.functional.pad(code.basis_q, (0, rank - code.rank)) for code in codes])
    for s, code in enumerate(codes):
        code.codes = stacked[..., s, :, :code.codes.shape[-1]]
        code.basis_q = bases[s, :, :code.rank]
    return stacked, bases


def stacked_codes(codes: list[PCACode]) -> torch.Tensor:
    """The packed codes of a block's PCA scopes side by side, ``[B, scopes, n, bytes]`` (narrower rows
    zero-padded: their slots never read the padding)."""
    if len(codes) == 1:
        return codes[0].codes.unsqueeze(-3)
    width = max(code.codes.shape[-1] for code in codes)
    rows = [torch.nn.functional.pad(code.codes, (0, width - code.codes.shape[-1])) for code in codes]
    return torch.stack(rows, dim=-3)
