"""Save a kvshrink cache to one file and load it back (``cache.save(path)``, ``kvshrink.load_cache``).

The file is a safetensors file: every tensor the cache holds, plus one JSON metadata entry with the
format version, the kvshrink version, method and options, a fingerprint of the model (its config
and a hash of some of its weights), dtype, token count, a hash of the prefix token ids, and the
cache's object structure. A SHA-256 over that JSON and every tensor's bytes detects a truncated or
corrupted file.

The structure is written by a generic walk, not per method: a layer is its ``__getstate__`` (see
``CacheLayer``), recursively; tensors, dtypes, lists, tuples, dicts, plain values and objects of
kvshrink classes are stored, anything else is refused naming where it sits. Loading only ever
instantiates kvshrink classes (``cls.__new__`` + ``__setstate__``): no pickle, no code from the file.

By default each tensor is stored entropy coded when that makes it smaller (`cache.file_codec`: the
metadata's ``encodings`` names the codec, dtype and shape of each such tensor); the checksum covers
the stored bytes, so a corrupted file is refused before anything is decoded, and each decoded tensor
must have exactly the size its entry names. Version 1 files (no coding) are still read.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from kvshrink.cache.base import CacheAccounting, KVShrinkCache, ModelInfo
from kvshrink.cache.file_codec import FileCodecError, decode_tensor, encode_tensor, tensor_bytes

FORMAT = "kvshrink-cache"
FORMAT_VERSION = 2  # 2: tensors may be entropy coded (``encodings``)
READABLE_VERSIONS = (1, 2)
_META_KEY = "kvshrink"
_CHECK_KEY = "sha256"
# Config entries that do not change what the model computes (paths, versions, generation defaults).
_CONFIG_IGNORED = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                   "_commit_hash", "use_cache", "_attn_implementation_autoset", "_attn_implementation"}
_WEIGHT_SAMPLE = 1 << 16  # elements hashed from each of a few parameters


class CacheFileError(ValueError):
    """A cache file that cannot be loaded: missing, corrupted, another format, or another model."""


# ----------------------------------------------------------------------------------------------- fingerprints
def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's config and of a sample of its first, middle and last parameters."""
    h = hashlib.sha256()
    config = {k: v for k, v in model.config.to_dict().items() if k not in _CONFIG_IGNORED}
    h.update(json.dumps(config, sort_keys=True, default=str).encode())
    params = [p for _, p in model.named_parameters()]
    for p in (params[0], params[len(params) // 2], params[-1]):
        sample = p.detach().reshape(-1)[:_WEIGHT_SAMPLE].float().cpu().contiguous()
        h.update(sample.numpy().tobytes())
    return h.hexdigest()


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


# ----------------------------------------------------------------------------------------------- encode
class _Encoder:
    """Turns an object graph into JSON-able data, collecting tensors (shared objects stored once)."""

    def __init__(self):
        self.tensors: dict[str, torch.Tensor] = {}
        self._tensor_names: dict[int, str] = {}
        self._object_ids: dict[int, int] = {}
        self._keep_alive: list[Any] = []  # ids stay unique while the walk runs
        self.devices: dict[str, str] = {}  # tensor name -> device type it came from ("cpu" stays there)

    def encode(self, obj: Any, path: str) -> Any:
        if obj is None or isinstance(obj, (bool, int, float, str)):
            return obj
        if isinstance(obj, torch.Tensor):
            return {"tensor": self._tensor(obj)}
        if isinstance(obj, torch.dtype):
            return {"dtype": str(obj).removeprefix("torch.")}
        if isinstance(obj, torch.device):
            return {"device": obj.type}
        if isinstance(obj, ModelInfo):
            return {"model_info": True}
        if isinstance(obj, (list, tuple)):
            kind = "list" if isinstance(obj, list) else "tuple"
            return {kind: [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, dict):
            return {"dict": [[self.encode(k, f"{path}.key"), self.encode(v, f"{path}[{k!r}]")] for k, v in obj.items()]}
        if type(obj).__module__.startswith("kvshrink."):
            return self._object(obj, path)
        raise TypeError(f"kvshrink: cannot save {type(obj).__module__}.{type(obj).__qualname__} held at {path}")

    def _tensor(self, t: torch.Tensor) -> str:
        name = self._tensor_names.get(id(t))
        if name is None:
            name = f"t{len(self.tensors)}"
            self._tensor_names[id(t)] = name
            self._keep_alive.append(t)
            data = t.detach()
            if data.is_complex():
                raise TypeError("kvshrink: cannot save a complex tensor (not supported by safetensors)")
            # clone: safetensors refuses tensors sharing storage; the file holds exactly the elements used
            self.tensors[name] = data.to("cpu", copy=True).contiguous()
            self.devices[name] = t.device.type
        return name

    def _object(self, obj: Any, path: str) -> dict:
        known = self._object_ids.get(id(obj))
        if known is not None:
            return {"ref": known}
        ident = len(self._object_ids)
        self._object_ids[id(obj)] = ident
        self._keep_alive.append(obj)
        state = obj.__getstate__() if hasattr(obj, "__getstate__") else obj.__dict__
        cls = type(obj)
        return {"obj": f"{cls.__module__}:{cls.__qualname__}", "id": ident,
                "state": self.encode(state if state is not None else {}, path)}


# ----------------------------------------------------------------------------------------------- decode
class _Decoder:
    def __init__(self, tensors: dict[str, torch.Tensor], devices: dict[str, str], info: ModelInfo,
                 device: torch.device):
        self.tensors = tensors
        self.devices = devices
        self.info = info
        self.device = device
        self._objects: dict[int, Any] = {}

    def decode(self, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if "tensor" in data:
            name = data["tensor"]
            t = self.tensors[name]
            return t if self.devices.get(name) == "cpu" else t.to(self.device)
        if "dtype" in data:
            return getattr(torch, data["dtype"])
        if "device" in data:
            return torch.device("cpu") if data["device"] == "cpu" else self.device
        if "model_info" in data:
            return self.info
        if "list" in data:
            return [self.decode(v) for v in data["list"]]
        if "tuple" in data:
            return tuple(self.decode(v) for v in data["tuple"])
        if "dict" in data:
            return {self.decode(k): self.decode(v) for k, v in data["dict"]}
        if "ref" in data:
            return self._objects[data["ref"]]
        if "obj" in data:
            return self._object(data)
        raise CacheFileError(f"kvshrink: unknown entry {sorted(data)} in the cache structure")

    def _object(self, data: dict) -> Any:
        cls = _kvshrink_class(data["obj"])
        obj = cls.__new__(cls)
        self._objects[data["id"]] = obj  # before the state: the state may refer back to it
        state = self.decode(data["state"])
        if hasattr(obj, "__setstate__"):
            obj.__setstate__(state)
        else:
            obj.__dict__.update(state)
        return obj


def _kvshrink_class(name: str) -> type:
    module, _, qualname = name.partition(":")
    if not (module == "kvshrink" or module.startswith("kvshrink.")):
        raise CacheFileError(f"kvshrink: the cache file names a class outside kvshrink ({name}); refused")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            raise CacheFileError(f"kvshrink: the cache file names {name}, which this kvshrink version lacks")
    if not isinstance(obj, type):
        raise CacheFileError(f"kvshrink: {name} in the cache file is not a class")
    return obj


# ----------------------------------------------------------------------------------------------- save
def _version() -> str:
    import kvshrink

    return kvshrink.__version__


def save_cache(cache: CacheAccounting, path: str | os.PathLike, model: torch.nn.Module | None = None,
               extra: dict[str, Any] | None = None, entropy: bool = True) -> None:
    """Write ``cache`` to ``path`` atomically (a temporary file in the same folder, then renamed).

    ``model`` (optional) records the model's fingerprint; without it the fingerprint recorded when the
    cache was made is used. ``extra`` is stored as is (JSON) in the metadata (e.g. the CLI's prompt format).
    ``entropy`` stores each tensor losslessly coded when that makes it smaller (`cache.file_codec`); with
    ``entropy=False`` the file holds the tensors as in memory (faster to write and read, larger).
    """
    _write_atomic(Path(path), cache_to_bytes(cache, model=model, extra=extra, entropy=entropy))


def cache_to_bytes(cache: CacheAccounting, model: torch.nn.Module | None = None,
                   extra: dict[str, Any] | None = None, entropy: bool = True) -> bytes:
    """The bytes ``save_cache`` writes (a safetensors file), for stores other than a local file."""
    from safetensors.torch import save

    if not isinstance(cache, KVShrinkCache):
        raise NotImplementedError(f"kvshrink: saving a '{getattr(cache, 'method', type(cache).__name__)}' cache "
                                  "is not supported (only caches built from kvshrink layers can be saved)")
    if any(layer._pending is not None for layer in cache.layers):
        raise RuntimeError("kvshrink: cannot save a cache in the middle of a forward step")
    encoder = _Encoder()
    structure = encoder.encode(cache.__getstate__(), "cache")
    stored, encodings = _encoded(encoder.tensors) if entropy else (encoder.tensors, {})
    fingerprint = model_fingerprint(model) if model is not None else getattr(cache, "model_fingerprint", None)
    if fingerprint is None:
        raise ValueError("kvshrink: this cache does not know its model; pass model= to save_cache")
    meta = {
        "format": FORMAT, "format_version": FORMAT_VERSION, "kvshrink_version": _version(),
        "method": cache.method, "options": cache.options, "multi_turn": cache.multi_turn,
        "model": fingerprint, "dtype": str(cache.info.dtype).removeprefix("torch."),
        "tokens": cache.get_seq_length(), "prefix_ids_sha256": token_ids_hash(cache.token_ids),
        "nbytes": cache.nbytes(), "tensor_devices": encoder.devices, "structure": structure,
        "encodings": encodings, "extra": extra or {},
    }
    meta_json = json.dumps(meta, sort_keys=True)
    return save(stored, metadata={_META_KEY: meta_json, _CHECK_KEY: _checksum(meta_json, stored)})


def _encoded(tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """``(tensors as stored, encoding of each coded one)``: see `cache.file_codec`."""
    stored, encodings = {}, {}
    for name, t in tensors.items():
        stored[name], encoding = encode_tensor(t)
        if encoding is not None:
            encodings[name] = encoding
    return stored, encodings


def _write_atomic(path: Path, data: bytes) -> None:
    folder = path.parent if str(path.parent) else Path(".")
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)  # atomic: readers see the old file or the new one, never a partial one
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ----------------------------------------------------------------------------------------------- load
def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    """The checked metadata of a cache file (no tensors are moved to the model)."""
    return _read(path)[0]


def read_metadata_bytes(data: bytes, source: str = "<bytes>") -> dict[str, Any]:
    """The checked metadata of cache bytes (`cache_to_bytes`)."""
    return _read_bytes(data, source)[0]


def _read(path: str | os.PathLike) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"kvshrink: no cache file {str(path)!r}")
    try:
        data = path.read_bytes()
    except OSError as err:
        raise CacheFileError(f"kvshrink: {path} cannot be read ({err})") from None
    return _read_bytes(data, str(path))


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (8-byte little-endian length, then JSON)."""
    if len(data) < 8:
        raise ValueError("shorter than a safetensors header")
    size = int.from_bytes(data[:8], "little")
    if size > len(data) - 8:
        raise ValueError("header longer than the data")
    return json.loads(data[8:8 + size]).get("__metadata__") or {}


def _read_bytes(data: bytes, path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load

    try:
        metadata = _safetensors_metadata(data)
        tensors = load(data)
    except (SafetensorError, OSError, ValueError, RuntimeError, AttributeError) as err:
        raise CacheFileError(f"kvshrink: {path} is truncated or corrupted (not a readable cache file: {err})") from None
    if _META_KEY not in metadata or _CHECK_KEY not in metadata:
        raise CacheFileError(f"kvshrink: {path} is a safetensors file but not a kvshrink cache")
    if _checksum(metadata[_META_KEY], tensors) != metadata[_CHECK_KEY]:
        raise CacheFileError(f"kvshrink: {path} is corrupted (checksum mismatch); refusing to load it")
    meta = json.loads(metadata[_META_KEY])
    if meta.get("format") != FORMAT:
        raise CacheFileError(f"kvshrink: {path} is not a kvshrink cache file")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise CacheFileError(
            f"kvshrink: {path} has cache format version {meta.get('format_version')} (written by kvshrink "
            f"{meta.get('kvshrink_version')}); this kvshrink ({_version()}) reads versions "
            f"{', '.join(map(str, READABLE_VERSIONS))}")
    return meta, tensors


def _decoded(meta: dict[str, Any], stored: dict[str, torch.Tensor], path) -> dict[str, torch.Tensor]:
    """The tensors of a checked file, coded ones decoded (each to exactly the size its entry names)."""
    tensors = dict(stored)
    for name, encoding in meta.get("encodings", {}).items():
        if name not in stored:
            raise CacheFileError(f"kvshrink: {path} lists an encoding for tensor {name!r}, which it lacks")
        try:
            tensors[name] = decode_tensor(stored[name], encoding)
        except FileCodecError as err:
            raise CacheFileError(f"kvshrink: {path} is corrupted: tensor {name!r} {err}; refusing to load it") from None
    return tensors


def check_model(meta: dict[str, Any], model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Refuse a model other than the one the cache was made with (config, weights, dtype)."""
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if meta["dtype"] != dtype:
        raise CacheFileError(f"kvshrink: {path} was made with the model in {meta['dtype']}, this model is in {dtype}")
    if meta["model"] != model_fingerprint(model):
        name = getattr(model.config, "_name_or_path", "") or type(model).__name__
        raise CacheFileError(f"kvshrink: {path} was made with another model (config or weights differ from "
                             f"{name!r}); load it with the model that made it")


def load_cache(path: str | os.PathLike, model: torch.nn.Module) -> KVShrinkCache:
    """The cache saved at ``path``, rebuilt for ``model`` (which must be the model that made it).

    Raises FileNotFoundError for a missing file and ``CacheFileError`` (a ValueError) for a corrupted or
    truncated file, another format version, or another model.
    """
    meta, stored = _read(path)
    return _rebuilt(meta, stored, model, path)


def cache_from_bytes(data: bytes, model: torch.nn.Module, source: str = "<bytes>") -> KVShrinkCache:
    """The cache held in ``data`` (`cache_to_bytes`), rebuilt for ``model``; refused like `load_cache`
    (``CacheFileError``), ``source`` naming the data in the message."""
    meta, stored = _read_bytes(data, source)
    return _rebuilt(meta, stored, model, source)


def _rebuilt(meta: dict[str, Any], stored: dict[str, torch.Tensor], model: torch.nn.Module, path) -> KVShrinkCache:
    from kvshrink.cache.registry import make_cache

    check_model(meta, model, path)
    tensors = _decoded(meta, stored, path)
    cache = make_cache(meta["method"], model, multi_turn=meta["multi_turn"], **meta["options"])
    device = next(model.parameters()).device
    state = _Decoder(tensors, meta["tensor_devices"], cache.info, device).decode(meta["structure"])
    cache.__dict__.update(state)
    cache.model_fingerprint = meta["model"]
    for layer in cache.layers:
        layer.after_load()
    return cache
