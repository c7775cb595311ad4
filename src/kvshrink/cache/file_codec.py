"""Lossless coding of the tensors in a cache file (cache/persist.py): smaller files than memory.

In memory a compressed cache keeps its codes bit-packed so that attention decodes them in one pass;
on disk nothing has to be read in place, so each tensor may be stored entropy coded. The codes are
far from uniform (the 2-bit Lloyd-Max levels of a Gaussian, VQ indices, and in the first layers the
keys and values of a repeated token repeat exactly), and the high bytes of fp16 tokens are few.

Each tensor of at least ``MIN_BYTES`` bytes is stored as the ``zlib`` (DEFLATE, level 9: LZ77 and
Huffman codes) of its bytes, the bytes of multi-byte elements first split into planes (all first
bytes, then all second bytes: the "shuffle" of Blosc/HDF5), if that is smaller than its bytes; the
stored tensor is then the coded bytes (uint8) and `encode_tensor` returns how to undo it.

Why zlib (measured on the default Shard cache of an 8K-token document; docs/persistence.md): it stores
the key codes in 2.28 bits per element instead of 2.5 and the
value codes in 1.83 instead of 2, below the order-0 entropy of the unpacked code symbols (one model
per PCA component or value group: 2.32 and 1.89), so a static symbol coder (Huffman, rANS) would
store more; LZ77 finds the exactly repeated codes of repeated tokens in the first layers. lzma is
2% smaller but decodes ~8x slower. Only the standard library: no compiled dependency.
"""

from __future__ import annotations

import zlib
from typing import Any

import numpy as np
import torch

CODECS = ("zlib",)
MIN_BYTES = 1024  # smaller tensors: the coding's own header and metadata would eat the gain
_ENTRY_BYTES = 96  # about what coding a tensor adds to the file's JSON (its entry, the header's longer line)


class FileCodecError(ValueError):
    """A stored tensor whose coded bytes do not decode to what its encoding says."""


def _decompress(data, size: int) -> bytes:
    """At most ``size + 1`` bytes decoded from ``data`` (bytes-like): a bad file cannot make it allocate
    more; raises if the coded stream does not end where the stored bytes do."""
    d = zlib.decompressobj()
    out = d.decompress(data, size + 1)
    if not (d.eof and not d.unused_data) and len(out) <= size:
        raise FileCodecError("zlib data ends early or has trailing bytes")
    return out


def split_planes(raw: np.ndarray, itemsize: int) -> np.ndarray:
    """Bytes ``[n * itemsize]`` of ``n`` elements -> byte plane 0 of every element, then plane 1, ..."""
    return raw if itemsize == 1 else np.ascontiguousarray(raw.reshape(-1, itemsize).T).reshape(-1)


def join_planes(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of `split_planes`."""
    return planes if itemsize == 1 else np.ascontiguousarray(planes.reshape(itemsize, -1).T).reshape(-1)


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """The bytes of a contiguous CPU tensor, as uint8 (any dtype, bfloat16 and bool included)."""
    return t.reshape(-1).view(torch.uint8).numpy()


def encode_tensor(t: torch.Tensor) -> tuple[torch.Tensor, dict[str, Any] | None]:
    """``(stored, encoding)``: ``t`` itself and None when coding does not make it smaller, else its coded
    bytes (uint8) and the entry `decode_tensor` needs (codec, dtype, shape)."""
    raw = tensor_bytes(t)
    if raw.size < MIN_BYTES:
        return t, None
    coded = zlib.compress(split_planes(raw, t.element_size()), 9)
    if len(coded) + _ENTRY_BYTES >= raw.size:
        return t, None
    stored = torch.frombuffer(bytearray(coded), dtype=torch.uint8)
    return stored, {"codec": "zlib", "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}


def _dtype(name: Any) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise FileCodecError(f"unknown dtype {name!r}")
    return dtype


def decode_tensor(stored: torch.Tensor, encoding: dict[str, Any]) -> torch.Tensor:
    """The tensor `encode_tensor` coded into ``stored``; `FileCodecError` if it does not decode to
    exactly the size its encoding names."""
    codec, shape = encoding.get("codec"), encoding.get("shape")
    if codec not in CODECS or not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise FileCodecError(f"unknown encoding {encoding!r}")
    dtype = _dtype(encoding.get("dtype"))
    itemsize = torch.empty((), dtype=dtype).element_size()
    size = int(np.prod(shape, dtype=np.int64)) * itemsize
    if stored.dtype != torch.uint8 or stored.dim() != 1:
        raise FileCodecError(f"coded bytes must be a 1-D uint8 tensor, got {stored.dtype} {list(stored.shape)}")
    try:
        planes = _decompress(tensor_bytes(stored), size)
    except zlib.error as err:
        raise FileCodecError(f"zlib data does not decode ({err})") from None
    if len(planes) != size:
        got = f"{len(planes)}" if len(planes) < size else f"more than {size}"
        raise FileCodecError(f"decodes to {got} bytes, its encoding says {size} ({dtype} {shape})")
    data = np.frombuffer(planes, dtype=np.uint8)
    raw = join_planes(data, itemsize) if itemsize > 1 else data.copy()  # a writable array of its own
    return torch.from_numpy(raw).view(dtype).reshape(shape)
