"""Lossless coding of cache-file tensors (cache/file_codec.py)."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvshrink.cache.file_codec import MIN_BYTES, FileCodecError, decode_tensor, encode_tensor, join_planes, split_planes
from kvshrink.codecs.bitpack import pack_bits


def skewed_codes(n: int, bits: int, seed: int = 0) -> torch.Tensor:
    """Bit-packed codes of ``bits`` bits drawn from a peaked distribution (like Lloyd-Max levels)."""
    g = torch.Generator().manual_seed(seed)
    weights = torch.exp(-torch.arange(1 << bits, dtype=torch.float64) ** 2 / 2)
    return pack_bits(torch.multinomial(weights, n * 64, replacement=True, generator=g).reshape(n, 64), bits)


def roundtrip(t: torch.Tensor) -> torch.Tensor:
    stored, encoding = encode_tensor(t.contiguous())
    return stored if encoding is None else decode_tensor(stored, encoding)


@pytest.mark.parametrize("make", [
    lambda: skewed_codes(500, 2),
    lambda: skewed_codes(300, 4, seed=1),
    lambda: skewed_codes(200, 8, seed=2),
    lambda: torch.randint(0, 256, (64, 64), dtype=torch.uint8),      # uniform: stays as is
    lambda: torch.zeros(4096, dtype=torch.uint8),                     # a single symbol
    lambda: torch.full((3, 1000), 7, dtype=torch.uint8),
    lambda: torch.empty(0, 16, dtype=torch.uint8),                    # empty
    lambda: torch.tensor(3.5),                                        # 0-dim
    lambda: torch.randn(3, 70, 64).half(),
    lambda: torch.randn(3, 70, 64).bfloat16(),
    lambda: torch.randn(40, 64),
    lambda: torch.arange(5000),
    lambda: torch.rand(2000) > 0.9,
    lambda: torch.randint(-127, 128, (64, 40), dtype=torch.int8),
], ids=["2bit", "4bit", "8bit", "uniform", "zeros", "one-symbol", "empty", "scalar", "fp16", "bf16", "fp32",
        "int64", "bool", "int8"])
def test_every_tensor_comes_back_exactly(make):
    t = make()
    got = roundtrip(t)
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))  # bitwise


def test_skewed_codes_are_stored_smaller_and_uniform_ones_as_they_are():
    skewed = skewed_codes(1000, 2)
    stored, encoding = encode_tensor(skewed)
    assert encoding is not None and stored.numel() < 0.95 * skewed.numel()
    uniform = torch.randint(0, 256, (1000, 16), dtype=torch.uint8)
    stored, encoding = encode_tensor(uniform)
    assert encoding is None and stored is uniform
    small = torch.zeros(MIN_BYTES - 1, dtype=torch.uint8)
    assert encode_tensor(small)[1] is None


def test_byte_planes_split_and_join():
    raw = torch.arange(12, dtype=torch.uint8).numpy()
    planes = split_planes(raw, 2)
    assert planes.tolist() == [0, 2, 4, 6, 8, 10, 1, 3, 5, 7, 9, 11]
    assert join_planes(planes, 2).tolist() == raw.tolist()


@pytest.fixture
def coded():
    t = torch.randn(50, 64).half()
    stored, encoding = encode_tensor(t)
    assert encoding is not None
    return t, stored, encoding


def test_a_corrupted_payload_is_refused(coded):
    _, stored, encoding = coded
    bad = stored.clone()
    bad[len(bad) // 2] ^= 0x55
    with pytest.raises(FileCodecError):
        decode_tensor(bad, encoding)


def test_truncated_or_extended_payloads_are_refused(coded):
    _, stored, encoding = coded
    with pytest.raises(FileCodecError, match="ends early"):
        decode_tensor(stored[:-5].clone(), encoding)
    with pytest.raises(FileCodecError, match="trailing bytes"):
        decode_tensor(torch.cat([stored, torch.zeros(3, dtype=torch.uint8)]), encoding)


def test_a_payload_of_another_size_is_refused(coded):
    t, stored, encoding = coded
    with pytest.raises(FileCodecError, match="decodes to more than 6272 bytes, its encoding says 6272"):
        decode_tensor(stored, {**encoding, "shape": [49, 64]})
    for size, message in ((t.numel() * 2 + 2, "more than 6400"), (t.numel() * 2 - 2, "6398")):
        other = torch.frombuffer(bytearray(zlib.compress(bytes(size), 9)), dtype=torch.uint8)
        with pytest.raises(FileCodecError, match=f"decodes to {message} bytes, its encoding says 6400"):
            decode_tensor(other, encoding)


@pytest.mark.parametrize("change,message", [
    ({"codec": "rot13"}, "unknown encoding"),
    ({"shape": [-1, 64]}, "unknown encoding"),
    ({"dtype": "Tensor"}, "unknown dtype"),
    ({"dtype": "float128"}, "unknown dtype"),
])
def test_a_malformed_encoding_entry_is_refused(coded, change, message):
    _, stored, encoding = coded
    with pytest.raises(FileCodecError, match=message):
        decode_tensor(stored, {**encoding, **change})
