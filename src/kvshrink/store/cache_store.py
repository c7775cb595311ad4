"""`CacheStore`: compressed prefix caches shared by processes and machines.

``store.put(cache)`` writes a cache under its key (model, method + options, format version, token
ids); ``store.get(model, ids, method, **options)`` returns the cache of the longest stored prefix of
``ids``, or None; ``store.cache_for(...)`` returns a cache holding all of ``ids``, computing and
storing what is missing, at most once across workers (a lock with a timeout).

Writing an entry: chunks first (each with an orphan expiry, so a writer killed half-way leaves
nothing that lasts), then the manifest with ``put_if_absent`` (the one atomic step that makes the
entry visible; a second writer of the same entry loses it and deletes its chunks), then the chunks'
expiry becomes the entry's. Reading: manifest, chunks in one round trip, every checksum, then the
cache file's own checks (model fingerprint, format version). Anything wrong is a miss with its
reason logged on the ``kvshrink.store`` logger and kept in ``store.stats``; a broken entry's
manifest is deleted so the next writer replaces it.
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from kvshrink.cache.persist import CacheFileError, cache_from_bytes, cache_to_bytes, read_metadata_bytes
from kvshrink.identity import model_fingerprint
from kvshrink.store.backend import BackendError, StoreBackend
from kvshrink.store.keys import Keys, boundary, ids_array, prefix_hashes, scope_id
from kvshrink.store.manifest import Chunk, EntryError, Manifest, joined, sha256, split
from kvshrink.user_cache import cache_home

log = logging.getLogger("kvshrink.store")

DEFAULT_CHUNK_BYTES = 32 << 20
DEFAULT_INDEX_EVERY = 256  # tokens between index boundaries: L // 256 + 1 set reads per lookup
DEFAULT_ORPHAN_TTL = 3600.0  # seconds a chunk lives before its manifest makes it part of an entry
DEFAULT_LOCK_TIMEOUT = 600.0  # longest a worker waits for another worker's prefill


def open_backend(url: str | os.PathLike | None) -> StoreBackend:
    """The backend a URL names: ``redis://``/``rediss://``/``unix://`` -> Redis; a path or ``file://`` ->
    a folder; None -> ``$KVSHRINK_STORE``, else ``store`` in kvshrink's cache folder (`user_cache.cache_home`:
    ``~/.cache/kvshrink/store`` unless ``KVSHRINK_CACHE_HOME`` or ``XDG_CACHE_HOME`` moves it)."""
    from kvshrink.store.folder import FolderBackend

    if url is None:
        url = os.environ.get("KVSHRINK_STORE") or cache_home() / "store"
    url = os.fspath(url)
    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme in ("redis", "rediss", "unix"):
        from kvshrink.store.redis_backend import RedisBackend

        return RedisBackend(url)
    if scheme in ("", "file"):
        return FolderBackend(url.removeprefix("file://"))
    raise ValueError(f"kvshrink: no store backend for {scheme}:// URLs (supported: a folder path, file://, "
                     "redis://host:port/db); another backend implements kvshrink.store.StoreBackend")


@dataclass
class StoreStats:
    hits: int = 0  # lookups that returned a cache (whole or a prefix)
    misses: int = 0  # lookups that returned nothing
    puts: int = 0  # entries this process made visible
    computed: int = 0  # prefills `cache_for` ran (tokens not found in the store)
    waited: int = 0  # `cache_for` calls answered by another worker's entry after waiting
    bytes_written: int = 0  # bytes of the entries this process made visible (chunks and manifests)
    reasons: list[str] = field(default_factory=list)  # why a stored entry could not be used


@dataclass
class _Scope:
    keys: Keys
    scope: str
    method: str
    options: dict[str, Any]


def _scope(fingerprint: str, dtype: str, method: str, options: dict[str, Any], namespace: str) -> _Scope:
    """The scope of caches holding ``options`` (a cache's own, as `cache_options` gives them)."""
    from kvshrink.cache.persist import FORMAT_VERSION
    from kvshrink.cache.registry import get_method, resolve_options

    resolved = resolve_options(get_method(method), options)
    scope = scope_id(fingerprint, dtype, method, resolved, FORMAT_VERSION)
    return _Scope(Keys(namespace, scope), scope, method, resolved)


def _asked_scope(model: torch.nn.Module, method: str, options: dict[str, Any], namespace: str) -> _Scope:
    """The scope of the cache ``make_cache(method, model, **options)`` would make: what it holds, as chosen for
    the model (Shard's calibration), so a lookup finds what `put` stored from such a cache."""
    from kvshrink.cache.registry import cache_options

    chosen = cache_options(method, model, **options)
    return _scope(model_fingerprint(model), _model_dtype(model), method, chosen, namespace)


def _model_dtype(model: torch.nn.Module) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def prefill_into(model: torch.nn.Module, cache, ids: torch.Tensor, chunk: int = 8192) -> None:
    """Run ``ids [1, n]`` into ``cache`` ``chunk`` tokens at a time (no logits kept but the last)."""
    with torch.no_grad():
        for start in range(0, ids.shape[1], chunk):
            model(input_ids=ids[:, start:start + chunk], past_key_values=cache, use_cache=True, logits_to_keep=1)


class CacheStore:
    """Compressed prefix caches in a folder (default) or a Redis server, shared by every process using it.

    ``ttl``: seconds an entry lives (None: until deleted or evicted). ``chunk_bytes``: the largest value
    written in one piece. ``index_every``: tokens between the boundaries the prefix index is kept at.
    ``lock_timeout``: how long a worker waits for another's prefill of the same ids before doing it itself.
    """

    def __init__(self, url: str | os.PathLike | None = None, *, ttl: float | None = None,
                 chunk_bytes: int = DEFAULT_CHUNK_BYTES, index_every: int = DEFAULT_INDEX_EVERY,
                 orphan_ttl: float = DEFAULT_ORPHAN_TTL, lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
                 namespace: str = "kvshrink", entropy: bool = True, backend: StoreBackend | None = None):
        if chunk_bytes <= 0 or index_every <= 0 or orphan_ttl <= 0 or lock_timeout <= 0:
            raise ValueError("kvshrink: chunk_bytes, index_every, orphan_ttl and lock_timeout must be positive")
        if ttl is not None and ttl <= 0:
            raise ValueError(f"kvshrink: ttl must be positive seconds or None, not {ttl!r}")
        self.backend = backend if backend is not None else open_backend(url)
        self.url = self.backend.url
        self.ttl, self.chunk_bytes, self.index_every = ttl, chunk_bytes, index_every
        self.orphan_ttl, self.lock_timeout = orphan_ttl, lock_timeout
        self.namespace, self.entropy = namespace, entropy
        self.stats = StoreStats()

    def __repr__(self) -> str:
        return f"CacheStore({self.url!r})"

    def close(self) -> None:
        self.backend.close()

    def _miss(self, reason: str) -> None:
        log.warning("kvshrink store %s: %s", self.url, reason)
        self.stats.reasons.append(reason)

    # ------------------------------------------------------------------------------------------ get
    def get(self, model: torch.nn.Module, ids: Any, method: str, *, max_tokens: int | None = None,
            **options: Any):
        """The cache of the longest stored prefix of ``ids`` (at most ``max_tokens`` of them), or None.

        The cache holds ``cache.get_seq_length()`` tokens; run the rest of ``ids`` into it. A stored
        entry that is incomplete, corrupted or made by another model is skipped with its reason logged.
        """
        arr = ids_array(ids)
        limit = len(arr) if max_tokens is None else min(len(arr), max_tokens)
        if limit <= 0:
            self.stats.misses += 1
            return None
        scope = _asked_scope(model, method, options, self.namespace)
        try:
            for n, ids_hash in self._candidates(scope, arr, limit):
                cache = self._load(scope, arr, n, ids_hash, model)
                if cache is not None:
                    self.stats.hits += 1
                    return cache
        except BackendError as err:
            self._miss(f"lookup failed: {err}")
        self.stats.misses += 1
        return None

    def _candidates(self, scope: _Scope, arr: np.ndarray, limit: int) -> list[tuple[int, str]]:
        """``(length, ids hash)`` of the entries that may hold a prefix of ``arr[:limit]``, longest first."""
        bounds = list(range(boundary(limit, self.index_every), -1, -self.index_every))
        at = prefix_hashes(arr, [b for b in bounds if b > 0])
        at[0] = prefix_hashes(arr, [0])[0]
        listed = self.backend.members_many([scope.keys.index(at[b]) for b in bounds])
        lengths = {limit}  # the whole prompt is tried even if its index set was evicted
        for b, members in zip(bounds, listed):
            for m in members:
                if m.isdigit() and b <= int(m) <= limit and boundary(int(m), self.index_every) == b:
                    lengths.add(int(m))
        hashes = prefix_hashes(arr, lengths)
        return [(n, hashes[n]) for n in sorted(lengths, reverse=True)]

    def _load(self, scope: _Scope, arr: np.ndarray, n: int, ids_hash: str, model: torch.nn.Module):
        key = scope.keys.manifest(ids_hash)
        raw = self.backend.get(key)
        if raw is None:
            return None
        try:
            manifest = Manifest.from_bytes(raw)
            if (manifest.scope, manifest.tokens, manifest.ids_sha256) != (scope.scope, n, ids_hash):
                raise EntryError("manifest names another entry")
            data = joined(manifest, self.backend.get_many([c.key for c in manifest.chunks]))
            cache = cache_from_bytes(data, model, source=f"store entry {ids_hash[:16]}")
            held = cache.token_ids
            if held is None or held.shape[-1] != n or not np.array_equal(held.reshape(-1).cpu().numpy(), arr[:n]):
                raise EntryError("the cache holds other token ids than its key")
            if cache.method != scope.method:
                raise EntryError(f"the entry holds a {cache.method} cache, not {scope.method}")
        except BackendError:
            raise  # the server, not the entry: `get` logs it and misses, the entry stays
        except (EntryError, CacheFileError) as err:
            self._miss(f"entry of {n} tokens ({ids_hash[:16]}) skipped: {err}")
            self.backend.delete([key])  # the next writer replaces it
            return None
        except (KeyError, TypeError, ValueError, RuntimeError) as err:  # checksummed yet not a cache of this kvshrink
            self._miss(f"entry of {n} tokens ({ids_hash[:16]}) skipped: cannot be rebuilt "
                       f"({type(err).__name__}: {err})")
            self.backend.delete([key])  # the next writer replaces it
            return None
        return cache

    # ------------------------------------------------------------------------------------------ put
    def put(self, cache, model: torch.nn.Module | None = None, extra: dict[str, Any] | None = None) -> bool:
        """Store ``cache`` (it must know its token ids); True when this call made the entry visible, False
        when it was already stored or the backend failed (logged)."""
        ids = getattr(cache, "token_ids", None)
        if ids is None:
            raise ValueError("kvshrink: the store keys a cache by its token ids, and this cache does not know them "
                             "(a cache filled through inputs_embeds or after cropping)")
        arr = ids_array(ids)
        data = cache_to_bytes(cache, model=model, extra=extra, entropy=self.entropy)
        meta = read_metadata_bytes(data)
        scope = _scope(meta["model"], meta["dtype"], meta["method"], meta["options"], self.namespace)
        n = len(arr)
        ids_hash = prefix_hashes(arr, [n])[n]
        try:
            return self._write(scope, arr, ids_hash, data, meta)
        except BackendError as err:
            self._miss(f"put of {n} tokens failed: {err}")
            return False

    def _write(self, scope: _Scope, arr: np.ndarray, ids_hash: str, data: bytes, meta: dict) -> bool:
        keys, n = scope.keys, len(arr)
        if self.backend.get(keys.manifest(ids_hash)) is not None:
            return False
        write_id = uuid.uuid4().hex[:16]
        chunks = []
        for i, part in enumerate(split(data, self.chunk_bytes)):
            key = keys.chunk(ids_hash, write_id, i)
            self.backend.put(key, part, ttl=self.orphan_ttl)
            chunks.append(Chunk(key, len(part), sha256(part)))
        manifest = Manifest(scope=scope.scope, tokens=n, ids_sha256=ids_hash, size=len(data), sha256=sha256(data),
                            chunks=chunks, created=time.time(),
                            summary={"method": meta["method"], "options": meta["options"], "bytes": len(data)})
        manifest_bytes = manifest.to_bytes()
        if not self.backend.put_if_absent(keys.manifest(ids_hash), manifest_bytes, ttl=self.ttl):
            self.backend.delete([c.key for c in chunks])  # another writer's identical entry won
            return False
        # Dying here leaves chunks on their orphan expiry: the entry then misses ("chunk missing") and is replaced.
        for c in chunks:
            self.backend.set_ttl(c.key, self.ttl)
        bound = boundary(n, self.index_every)
        self.backend.add_member(keys.index(prefix_hashes(arr, [bound])[bound]), str(n), ttl=self.ttl)
        self.stats.puts += 1
        self.stats.bytes_written += len(data) + len(manifest_bytes)
        return True

    # ------------------------------------------------------------------------------------------ get or compute
    def cache_for(self, model: torch.nn.Module, ids: Any, method: str, *,
                  prefill: Callable[[torch.nn.Module, Any, torch.Tensor], None] | None = None,
                  extra: dict[str, Any] | None = None, **options: Any):
        """A cache holding all of ``ids``: ``(cache, how)`` with ``how`` one of ``"hit"`` (stored),
        ``"waited"`` (stored by another worker while this one waited) or ``"computed"`` (prefilled here,
        from the longest stored prefix, then stored). Workers asking for the same ids at once prefill
        them once: the first takes a lock (expiring after ``lock_timeout``), the others wait for its entry.
        """
        from kvshrink.cache.registry import make_cache

        arr = ids_array(ids)
        n = len(arr)
        cache = self.get(model, arr, method, **options)
        if cache is not None and cache.get_seq_length() == n:
            return cache, "hit"
        scope = _asked_scope(model, method, options, self.namespace)
        ids_hash = prefix_hashes(arr, [n])[n]
        lock_key, token = scope.keys.lock(ids_hash), uuid.uuid4().hex.encode()
        while True:
            state = self._acquire(lock_key, token)
            if state != "timeout":
                stored = self.get(model, arr, method, **options)  # another worker may have stored it
                if stored is not None and stored.get_seq_length() == n:
                    if state == "locked":
                        self._release(lock_key, token)
                        return stored, "hit"
                    self.stats.waited += 1
                    return stored, "waited"
                if stored is not None:
                    cache = stored
            if state != "released":
                break  # locked, or waited too long: compute here
        try:
            if cache is None:
                cache = make_cache(method, model, **options)
            done = cache.get_seq_length()
            rest = torch.tensor(arr[done:], device=next(model.parameters()).device).unsqueeze(0)
            (prefill or prefill_into)(model, cache, rest)
            self.stats.computed += 1
            self.put(cache, model=model, extra=extra)
            return cache, "computed"
        finally:
            if state == "locked":
                self._release(lock_key, token)

    def _acquire(self, lock_key: str, token: bytes) -> str:
        """Take the lock: ``"locked"``; ``"released"`` once another holder's lock went away (its entry
        should be stored now); ``"timeout"`` after ``lock_timeout`` or when the backend fails."""
        deadline = time.monotonic() + self.lock_timeout
        pause = 0.02
        try:
            if self.backend.put_if_absent(lock_key, token, ttl=self.lock_timeout):
                return "locked"
            while time.monotonic() < deadline:
                time.sleep(pause)
                pause = min(pause * 2, 0.25)
                if self.backend.get(lock_key) is None:
                    return "released"
            self._miss(f"waited {self.lock_timeout:.0f} s for another worker's prefill; computing here")
        except BackendError as err:
            self._miss(f"lock failed: {err}; computing without it")
        return "timeout"

    def _release(self, lock_key: str, token: bytes) -> None:
        try:
            if self.backend.get(lock_key) == token:  # an expired lock may belong to someone else now
                self.backend.delete([lock_key])
        except BackendError as err:
            log.warning("kvshrink store %s: lock release failed (%s); it expires by itself", self.url, err)

    def entry_info(self, model: torch.nn.Module, ids: Any, method: str, **options: Any) -> dict | None:
        """What the store holds for exactly ``ids``: tokens, value and manifest bytes, chunk count (no chunk is read)."""
        arr = ids_array(ids)
        scope = _asked_scope(model, method, options, self.namespace)
        raw = self.backend.get(scope.keys.manifest(prefix_hashes(arr, [len(arr)])[len(arr)]))
        if raw is None:
            return None
        manifest = Manifest.from_bytes(raw)
        return {"tokens": manifest.tokens, "value_bytes": manifest.size, "manifest_bytes": len(raw),
                "chunks": len(manifest.chunks), "stored_bytes": manifest.size + len(raw)}

    def collect(self) -> int:
        """Delete expired values (orphan chunks of killed writers) where the backend does not expire them itself."""
        return self.backend.collect()
