"""Save a kvshrink cache and load it back: one file (``cache.save(path)``, ``kvshrink.load_cache``) or bytes
(``cache_to_bytes``, ``cache_from_bytes``: what a store of caches keeps). The format: docs/persistence.md.

The bytes are a safetensors file: the cache's tensors under flat names (``layers.3.middle.0.v_codes``) and
one JSON metadata entry: format and kvshrink versions, method and options, the model's fingerprint
(`kvshrink.identity`), dtype, token count, a hash of the prefix token ids, each tensor's dtype, shape,
device and coding, and the record tree (each object's metadata and parts, `cache.record`). Nothing in it
names a class: loading makes a cache with ``make_cache(method, model, **options)`` and each layer reads
its own record by its method's schema, refusing a missing, extra or misshapen tensor by name.

A SHA-256 over the JSON and every stored tensor's bytes detects a truncated or corrupted file. By default
each tensor is stored entropy coded when that makes it smaller (`cache.file_codec`); the checksum covers
the stored bytes, so a corrupted file is refused before anything is decoded, and each decoded tensor must
have exactly the dtype and shape its entry names. Files of another format version are refused by name.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import torch

from kvshrink.atomic_file import write_atomic
from kvshrink.cache.base import CacheAccounting, KVShrinkCache
from kvshrink.cache.file_codec import FileCodecError, decode_tensor, encode_tensor, tensor_bytes
from kvshrink.cache.record import RecordError, RecordReader, dtype_name, dtype_of, flatten, unread_tensors
from kvshrink.identity import model_fingerprint

FORMAT = "kvshrink-cache"
FORMAT_VERSION = 3
_META_KEY = "kvshrink"
_CHECK_KEY = "sha256"


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: missing, corrupted, another format, or another model."""


def token_ids_hash(ids: torch.Tensor | None) -> str | None:
    """SHA-256 of token ids (int64), or None when unknown."""
    if ids is None:
        return None
    return hashlib.sha256(ids.detach().to(torch.int64).cpu().contiguous().numpy().tobytes()).hexdigest()


def _checksum(meta_json: str, tensors: dict[str, torch.Tensor]) -> str:
    """SHA-256 of the metadata and of every stored tensor's bytes (coded ones as stored)."""
    h = hashlib.sha256(meta_json.encode())
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensor_bytes(tensors[name]))
    return h.hexdigest()


def _version() -> str:
    import kvshrink

    return kvshrink.__version__


# ----------------------------------------------------------------------------------------------- save
def cache_to_bytes(cache, model=None, extra=None, entropy=True) -> bytes:
    """``cache`` as the bytes of a cache file.

    ``model`` (optional) records the model's fingerprint; without it the fingerprint recorded when the
    cache was made is used. ``extra`` is stored as is (JSON) in the metadata (e.g. the CLI's prompt format).
    ``entropy`` stores each tensor losslessly coded when that makes it smaller (`cache.file_codec`); with
    ``entropy=False`` the tensors are stored as in memory (faster to write and read, larger).
    """
    from safetensors.torch import save

    if not isinstance(cache, KVShrinkCache):
        raise NotImplementedError(f"kvshrink: saving a '{getattr(cache, 'method', type(cache).__name__)}' cache "
                                  "is not supported (only caches built from kvshrink layers can be saved)")
    if any(layer._pending is not None for layer in cache.layers):
        raise RuntimeError("kvshrink: cannot save a cache in the middle of a forward step")
    fingerprint = model_fingerprint(model) if model is not None else getattr(cache, "model_fingerprint", None)
    if fingerprint is None:
        raise ValueError("kvshrink: this cache does not know its model; pass model= to save_cache")
    held: dict[str, torch.Tensor] = {}
    tree = flatten(cache.to_record(), "", held)
    stored, table = {}, {}
    for name, t in held.items():
        if t.is_complex():
            raise TypeError(f"kvshrink: cannot save the complex tensor {name} (not supported by safetensors)")
        # a copy: safetensors refuses tensors sharing storage, and the file holds exactly the elements used
        data = t.detach().to("cpu", copy=True).contiguous()
        stored[name], encoding = encode_tensor(data) if entropy else (data, None)
        table[name] = {"dtype": dtype_name(data.dtype), "shape": list(data.shape),
                       "device": "cpu" if t.device.type == "cpu" else "model",
                       "codec": None if encoding is None else encoding["codec"]}
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kvshrink_version": _version(),
        "method": cache.method, "options": cache.options, "model": fingerprint,
        "dtype": dtype_name(cache.info.dtype), "tokens": cache.get_seq_length(),
        "prefix_ids_sha256": token_ids_hash(cache.token_ids), "nbytes": cache.nbytes(),
        "tensors": table, "cache": tree, "extra": extra or {},
    }
    meta_json = json.dumps(meta, sort_keys=True)
    return save(stored, metadata={_META_KEY: meta_json, _CHECK_KEY: _checksum(meta_json, stored)})


def save_cache(cache: CacheAccounting, path: str | os.PathLike, model: torch.nn.Module | None = None,
               extra: dict[str, Any] | None = None, entropy: bool = True) -> None:
    """Write ``cache`` to ``path`` atomically (a temporary file in the same folder, then renamed); the
    arguments are `cache_to_bytes`'."""
    write_atomic(Path(path), cache_to_bytes(cache, model=model, extra=extra, entropy=entropy))


# ----------------------------------------------------------------------------------------------- read
def _header_metadata(data: bytes, source: str) -> dict[str, str]:
    """The ``__metadata__`` of safetensors bytes (the library reads it from files only)."""
    try:
        (size,) = struct.unpack("<Q", data[:8])
        if not 8 < 8 + size <= len(data):
            raise ValueError("header size out of range")
        metadata = json.loads(data[8:8 + size]).get("__metadata__") or {}
    except (struct.error, ValueError, AttributeError, UnicodeDecodeError) as err:
        raise CacheFileError(f"kvshrink: {source} is truncated or corrupted (not a readable cache file: {err})") from None
    return metadata if isinstance(metadata, dict) else {}


def _read(data: bytes, source: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The checked metadata and the stored tensors (as stored: coded ones still coded)."""
    from safetensors import SafetensorError
    from safetensors.torch import load

    metadata = _header_metadata(data, source)
    try:
        tensors = load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError) as err:
        raise CacheFileError(f"kvshrink: {source} is truncated or corrupted (not a readable cache file: {err})") from None
    if _META_KEY not in metadata or _CHECK_KEY not in metadata:
        raise CacheFileError(f"kvshrink: {source} is a safetensors file but not a kvshrink cache")
    if _checksum(metadata[_META_KEY], tensors) != metadata[_CHECK_KEY]:
        raise CacheFileError(f"kvshrink: {source} is corrupted (checksum mismatch); refusing to load it")
    meta = json.loads(metadata[_META_KEY])
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CacheFileError(f"kvshrink: {source} is not a kvshrink cache file")
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise CacheFileError(
            f"kvshrink: {source} was written by cache format {version} (kvshrink {meta.get('kvshrink_version')}); "
            f"this kvshrink ({_version()}) reads format {FORMAT_VERSION}. Compress the document again with this "
            "version.")
    return meta, tensors


def read_metadata_bytes(data: bytes) -> dict[str, Any]:
    """The checked metadata of a cache file's bytes (no tensor is decoded)."""
    return _read(data, "<bytes>")[0]


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checked metadata of a cache file (no tensor is decoded)."""
    return _read(_file_bytes(path), str(path))[0]


def _file_bytes(path: str | os.PathLike) -> bytes:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"kvshrink: no cache file {str(path)!r}")
    return path.read_bytes()


def _decoded(meta: dict[str, Any], stored: dict[str, torch.Tensor], source: str,
             device: torch.device) -> dict[str, torch.Tensor]:
    """The tensors of a checked file, coded ones decoded, each exactly the dtype and shape its entry names,
    on the model's device unless it was held on the CPU."""
    table = meta.get("tensors")
    if not isinstance(table, dict) or set(table) != set(stored):
        listed = set(table) if isinstance(table, dict) else set()
        raise CacheFileError(f"kvshrink: {source} is corrupted: its tensor table does not list its tensors "
                             f"(unlisted: {sorted(set(stored) - listed)[:5]}, absent: {sorted(listed - set(stored))[:5]})")
    tensors = {}
    for name, entry in table.items():
        try:
            t = stored[name] if entry.get("codec") is None else decode_tensor(stored[name], entry)
            if t.dtype != dtype_of(entry.get("dtype")) or list(t.shape) != entry.get("shape"):
                raise FileCodecError(f"is {dtype_name(t.dtype)} {list(t.shape)}, its entry says "
                                     f"{entry.get('dtype')} {entry.get('shape')}")
        except (FileCodecError, RecordError, AttributeError) as err:
            raise CacheFileError(f"kvshrink: {source} is corrupted: tensor {name!r} {err}; refusing to load it") from None
        tensors[name] = t if entry.get("device") == "cpu" else t.to(device)
    return tensors


def check_model(meta: dict[str, Any], model: torch.nn.Module, source: str | os.PathLike) -> None:
    """Refuse a model other than the one the cache was made with (config, weights, dtype)."""
    dtype = dtype_name(next(model.parameters()).dtype)
    if meta["dtype"] != dtype:
        raise CacheFileError(f"kvshrink: {source} was made with the model in {meta['dtype']}, this model is in {dtype}")
    if meta["model"] != model_fingerprint(model):
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise CacheFileError(f"kvshrink: {source} was made with another model (config or weights differ from "
                             f"{name!r}); load it with the model that made it")


def cache_from_bytes(data: bytes, model, source: str = "<bytes>") -> KVShrinkCache:
    """The cache whose bytes `cache_to_bytes` wrote, rebuilt for ``model`` (the model that made it).

    Raises ``CacheFileError`` (a ValueError) for corrupted or truncated bytes, another format version,
    another model, or a record that does not match this kvshrink's schema of the method; ``source`` names
    the bytes in messages."""
    from kvshrink.cache.registry import make_cache

    meta, stored = _read(data, source)
    check_model(meta, model, source)
    tensors = _decoded(meta, stored, source, next(model.parameters()).device)
    cache = make_cache(meta["method"], model, **meta["options"])
    read: set[str] = set()
    try:
        reader = RecordReader(meta.get("cache"), "", tensors, {}, read)
        cache.load_record(reader)
        reader.check_all_read()
        extra = unread_tensors(tensors, read)
        if extra:
            raise RecordError(f"tensors {extra[:5]} are not part of this kvshrink's schema")
        reader.check(cache.get_seq_length() == meta["tokens"], f"it holds {cache.get_seq_length()} tokens, its "
                     f"metadata says {meta['tokens']}")
    except (RecordError, KeyError, TypeError) as err:
        cache.close()
        raise CacheFileError(f"kvshrink: {source} does not match this kvshrink's '{meta['method']}' cache schema: "
                             f"{err}") from None
    cache.model_fingerprint = meta["model"]
    return cache


def load_cache(path: str | os.PathLike, model: torch.nn.Module) -> KVShrinkCache:
    """The cache saved at ``path``, rebuilt for ``model`` (which must be the model that made it).

    Raises FileNotFoundError for a missing file and ``CacheFileError`` (a ValueError) for a corrupted or
    truncated file, another format version, another model, or a record that does not match the method's
    schema.
    """
    return cache_from_bytes(_file_bytes(path), model, source=str(path))
