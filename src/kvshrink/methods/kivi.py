"""``kivi`` (Liu et al. 2024, "KIVI: a tuning-free asymmetric 2bit quantization for KV cache").

Keys are quantized per channel (one zero point and step per channel over each group of ``group``
tokens), values per token (one per ``group`` channels of a token), both asymmetric at ``bits`` bits and
bit-packed (``codecs/groupwise.py``). The most recent tokens wait in an exact fp16 residual: once it
holds more than ``residual`` tokens, the oldest whole groups of ``group`` tokens beyond it are
quantized, so it holds ``residual`` to ``residual + group - 1`` tokens.

Attention reads the packed form block by block (``block`` tokens dequantized at a time, one partial
per block, merged by log-sum-exp), never the whole history at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvshrink.cache.attention import Partial, exact_partial
from kvshrink.cache.base import LayerSpec, StepContext
from kvshrink.cache.record import RecordReader
from kvshrink.cache.registry import option, register_method
from kvshrink.cache.residual_layer import ExactResidualLayer
from kvshrink.cache.store import DEQUANT_BLOCK, held_bytes
from kvshrink.codecs.groupwise import GroupCode, dequantize_groups, quantize_groups
from kvshrink.methods.code_records import group_code_record, read_group_code

def fill_padding(x: torch.Tensor, ctx: StepContext) -> torch.Tensor:
    """A copy of ``x [B, H, q, d]`` (this step's tokens) whose left-padding tokens repeat the row's first
    real token, so padding never widens a quantization range shared with real tokens."""
    if ctx.pad_len is None:
        return x
    b, h, q, d = x.shape
    is_pad = ctx.new_index[None, :] < ctx.pad_len[:, None]  # [B, q]
    first_real = (ctx.pad_len - ctx.past_len).clamp(0, q - 1)
    source = x.gather(2, first_real[:, None, None, None].expand(b, h, 1, d))
    return torch.where(is_pad[:, None, :, None], source, x)


def _cat_codes(a: GroupCode | None, b: GroupCode, dim: int) -> GroupCode:
    """Concatenate codes along token dim ``dim`` of the scale tensors (codes have one more dim)."""
    if a is None:
        return b
    dim_codes = dim if dim >= 0 else dim - 1
    return GroupCode(torch.cat([a.codes, b.codes], dim=dim_codes), torch.cat([a.scale, b.scale], dim=dim),
                     torch.cat([a.zero, b.zero], dim=dim), b.bits, b.group_size)


def _slice_codes(c: GroupCode, dim: int, start: int, stop: int) -> GroupCode:
    dim_codes = dim if dim >= 0 else dim - 1
    return GroupCode(c.codes.narrow(dim_codes, start, stop - start), c.scale.narrow(dim, start, stop - start),
                     c.zero.narrow(dim, start, stop - start), c.bits, c.group_size)


@dataclass
class KiviOptions:
    bits: int = option(2, "bits per key and value element", choices=(2, 4))
    group: int = option(32, "group size: tokens per key group (per channel), channels per value group (per token)",
                        low=1)
    residual: int = option(128, "most recent tokens kept exactly (fp16) until whole groups beyond them form", low=0)


@register_method(
    "kivi",
    "KIVI: asymmetric 2/4-bit quantization, keys per channel and values per token in groups, exact recent residual",
    options=KiviOptions,
)
class KiviLayer(ExactResidualLayer):
    def __init__(self, spec: LayerSpec, options: KiviOptions):
        super().__init__(spec, options.residual)
        group = options.group
        if self.info.head_dim % group:
            raise NotImplementedError(
                f"kivi groups values per token in groups of {group} channels; head size {self.info.head_dim} is "
                "not a multiple of it (choose a group that divides the head size)"
            )
        self.bits, self.group = options.bits, group
        self.clear()

    def clear_codes(self) -> None:
        self.key_codes: GroupCode | None = None  # scale [B, H, d, groups]: per channel, per token group
        self.value_codes: GroupCode | None = None  # scale [B, H, tokens, d // group]: per token

    def flush_multiple(self) -> int:
        return self.group  # keys are quantized per channel over whole groups of tokens

    def code_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        parts = []
        step = max(self.group, DEQUANT_BLOCK // self.group * self.group)
        for start in range(0, self.quantized, step):
            stop = min(self.quantized, start + step)
            key, value = self._dequantize(start, stop)
            index = torch.arange(start, stop, device=key.device)
            parts.append(exact_partial(query, key, value, ctx.scaling, key_index=index, pad_len=ctx.pad_len))
        return parts

    def _dequantize(self, start: int, stop: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group
        keys = dequantize_groups(_slice_codes(self.key_codes, -1, start // g, stop // g)).transpose(-1, -2)
        values = dequantize_groups(_slice_codes(self.value_codes, 2, start, stop))
        return keys, values

    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        super().commit(fill_padding(key, ctx), fill_padding(value, ctx), ctx)

    def quantize(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.key_codes = _cat_codes(self.key_codes, quantize_groups(key.transpose(-1, -2), self.bits, self.group), -1)
        self.value_codes = _cat_codes(self.value_codes, quantize_groups(value, self.bits, self.group), 2)

    # keys: scale [B, H, d, token groups]; values: scale [B, H, tokens, d // group]
    _KEY_LEAD, _VALUE_LEAD = "b H D", "b H n"

    def codes_record(self):
        return {"key_codes": None if self.key_codes is None else group_code_record(self.key_codes, self._KEY_LEAD),
                "value_codes": None if self.value_codes is None else group_code_record(self.value_codes, self._VALUE_LEAD)}

    def load_codes(self, reader: RecordReader) -> None:
        keys, values = reader.part("key_codes", optional=True), reader.part("value_codes", optional=True)
        reader.check((keys is None) == (values is None) == (self.quantized == 0),
                     "key and value codes are stored together, for the quantized tokens")
        if keys is not None:
            self.key_codes, self.value_codes = read_group_code(keys, self._KEY_LEAD), read_group_code(values, self._VALUE_LEAD)
            reader.check(self.value_codes.codes.shape[2] == self.quantized == self.key_codes.scale.shape[-1] * self.group,
                         f"its codes do not hold the {self.quantized} quantized tokens")

    def _code_tensors(self) -> list[torch.Tensor]:
        return [t for c in (self.key_codes, self.value_codes) if c is not None for t in c.tensors()]

    def nbytes(self) -> int:
        return held_bytes(self._code_tensors()) + self.tail.nbytes()

    def breakdown(self) -> dict[str, int]:
        codes = [c.codes for c in (self.key_codes, self.value_codes) if c is not None]
        scales = [t for c in (self.key_codes, self.value_codes) if c is not None for t in (c.scale, c.zero)]
        return {"codes": held_bytes(codes), "scales": held_bytes(scales), "exact": self.tail.nbytes()}
