"""A store of compressed prefix caches shared by processes and machines (`CacheStore`).

Backends: a local folder (default) and Redis (``redis://host:port/db``); both implement
`StoreBackend`, the small protocol another store (an fsspec object store) would implement too.
"""

from kvshrink.store.backend import BackendError, StoreBackend
from kvshrink.store.cache_store import CacheStore, StoreStats, open_backend, prefill_into

__all__ = ["BackendError", "CacheStore", "StoreBackend", "StoreStats", "open_backend", "prefill_into"]
