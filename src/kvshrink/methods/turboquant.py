"""``turboquant`` (Zandieh et al., arXiv:2504.19874): the data-oblivious quantizer for all of K and V.

Every key and value vector (per token and KV head) is stored as its fp16 norm plus ``key_bits`` /
``value_bits``-bit Lloyd-Max codes of its randomized-Hadamard-rotated unit vector
(``codecs.lloyd_max.TurboQuantizer``; ``qjl`` adds the 1-bit QJL residual sketch to the keys, where
inner products are what matters). By default nothing stays exact: that is the pure baseline. A small
exact ``residual`` of recent tokens can be kept for comparison with KIVI.

Attention never rebuilds the keys: queries are rotated once and scored against the codebook values in
the rotated domain; the probability-weighted sum of the value codes is un-rotated once per block.
Blocks of ``DEQUANT_BLOCK`` tokens are decoded at a time, one partial each, merged by log-sum-exp.
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
from kvshrink.codecs.lloyd_max import TURBO_BITS, TurboCode, TurboQuantizer
from kvshrink.methods.code_records import read_turbo_code, turbo_code_record


@dataclass
class TurboQuantOptions:
    key_bits: int = option(4, "bits per key coordinate", choices=TURBO_BITS)
    value_bits: int = option(4, "bits per value coordinate", choices=TURBO_BITS)
    qjl: bool = option(False, "add the 1-bit QJL residual sketch to the keys (+1 bit per key coordinate)")
    residual: int = option(0, "most recent tokens kept exactly (fp16); 0 = quantize every token", low=0)


@register_method(
    "turboquant",
    "TurboQuant: norm + randomized Hadamard + Lloyd-Max codes (optional QJL) for every key and value",
    options=TurboQuantOptions,
)
class TurboQuantLayer(ExactResidualLayer):
    def __init__(self, spec: LayerSpec, options: TurboQuantOptions):
        super().__init__(spec, options.residual)
        d = self.info.head_dim
        # Each layer and each of K/V gets its own rotation (seeded, so it is rebuilt, not stored).
        self.key_q = TurboQuantizer(d, options.key_bits, qjl=options.qjl, seed=2 * self.layer_idx)
        self.value_q = TurboQuantizer(d, options.value_bits, qjl=False, seed=2 * self.layer_idx + 1)
        self.clear()

    def clear_codes(self) -> None:
        self.keys: TurboCode | None = None
        self.values: TurboCode | None = None

    def code_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        parts = []
        if self.quantized:
            rotated_q = self.key_q.rotation.rotate(query.float())
            for start in range(0, self.quantized, DEQUANT_BLOCK):
                stop = min(self.quantized, start + DEQUANT_BLOCK)
                key = self.key_q.decode_rotated(self.keys.tokens(start, stop))
                value = self.value_q.decode_rotated(self.values.tokens(start, stop))
                index = torch.arange(start, stop, device=key.device)
                part = exact_partial(rotated_q, key, value, ctx.scaling, key_index=index, pad_len=ctx.pad_len)
                parts.append(Partial(self.value_q.rotation.unrotate(part.out), part.lse))
        return parts

    def quantize(self, key: torch.Tensor, value: torch.Tensor) -> None:
        self.keys = TurboCode.cat(self.keys, self.key_q.encode(key))
        self.values = TurboCode.cat(self.values, self.value_q.encode(value))

    def codes_record(self):
        return {"keys": turbo_code_record(self.keys, "b H n"), "values": turbo_code_record(self.values, "b H n")}

    def load_codes(self, reader: RecordReader) -> None:
        self.keys = read_turbo_code(reader.part("keys", optional=True), "b H n")
        self.values = read_turbo_code(reader.part("values", optional=True), "b H n")
        held = [0 if c is None else c.norm.shape[-1] for c in (self.keys, self.values)]
        reader.check(held == [self.quantized] * 2, f"its codes do not hold the {self.quantized} quantized tokens")
        reader.check(self.keys is None or (self.keys.qjl_norm is not None) == self.key_q.qjl,
                     "its key codes' QJL sketch does not match the qjl option")

    def _codes(self) -> list[torch.Tensor]:
        return [t for c in (self.keys, self.values) if c is not None for t in c.tensors()]

    def quantizer_bytes(self) -> int:
        """The state needed to decode: rotation (and sketch) seeds and the two codebooks (fp32)."""
        seeds = self.key_q.rotation.nbytes() + self.value_q.rotation.nbytes() + (8 if self.key_q.qjl else 0)
        return seeds + 4 * ((1 << self.key_q.bits) + (1 << self.value_q.bits))

    def nbytes(self) -> int:
        return held_bytes(self._codes()) + self.tail.nbytes() + self.quantizer_bytes()

    def breakdown(self) -> dict[str, int]:
        norms = [t for c in (self.keys, self.values) if c is not None for t in (c.norm, c.qjl_norm) if t is not None]
        codes = [t for c in (self.keys, self.values) if c is not None for t in (c.codes, c.qjl_signs) if t is not None]
        return {"codes": held_bytes(codes), "norms": held_bytes(norms), "exact": self.tail.nbytes(),
                "quantizer": self.quantizer_bytes()}
