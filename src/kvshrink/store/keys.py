"""Key names and hashes of the store.

An entry is found by ``scope`` and the hash of its token ids. The scope is a hash of what must match
for a cache to be usable: the model fingerprint and dtype, the method and its options (defaults
filled in), the cache file format version and this key layout's version. Another model, method,
option value or format version is another scope, so a lookup there misses.

Longest-prefix lookup without scanning keys: an entry of ``n`` tokens is also listed, as the member
``n``, in the index set of its boundary ``K = n // every * every`` (``every`` tokens apart), keyed by
the hash of the first ``K`` ids. A prompt of ``L`` tokens reads the index sets of its ``L // every + 1``
boundaries (one round trip) and then tries the listed lengths from longest down. All prefix hashes
come from one incremental SHA-256 pass over the ids.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Iterable

import numpy as np

LAYOUT_VERSION = 1


def scope_id(fingerprint: str, dtype: str, method: str, options: dict[str, Any], format_version: int) -> str:
    identity = {"layout": LAYOUT_VERSION, "model": fingerprint, "dtype": dtype, "method": method,
                "options": options, "format_version": format_version}
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:32]


def ids_array(ids: Any) -> np.ndarray:
    """Token ids (list, 1-D or ``[1, n]`` tensor or array) as a 1-D int64 array."""
    import torch

    if isinstance(ids, torch.Tensor):
        if ids.dim() == 2 and ids.shape[0] != 1:
            raise ValueError(f"kvshrink: the store keys one sequence of token ids, not a batch of {ids.shape[0]}")
        ids = ids.detach().reshape(-1).to("cpu", torch.int64).numpy()
    arr = np.asarray(ids, dtype=np.int64).reshape(-1)
    if arr.size == 0:
        raise ValueError("kvshrink: no token ids to look up")
    return arr


def prefix_hashes(ids: np.ndarray, lengths: Iterable[int]) -> dict[int, str]:
    """SHA-256 of ``ids[:n]`` (as `persist.token_ids_hash` computes it) for each ``n`` in ``lengths``."""
    h = hashlib.sha256()
    out, done = {}, 0
    for n in sorted(set(lengths)):
        h.update(ids[done:n].tobytes())
        done = n
        out[n] = h.copy().hexdigest()
    return out


def boundary(n: int, every: int) -> int:
    return n // every * every


class Keys:
    """The names of one scope's keys under a namespace."""

    def __init__(self, namespace: str, scope: str):
        self.base = f"{namespace}:{scope}"

    def manifest(self, ids_hash: str) -> str:
        return f"{self.base}:entry:{ids_hash}"

    def chunk(self, ids_hash: str, write_id: str, index: int) -> str:
        return f"{self.base}:chunk:{ids_hash}:{write_id}:{index}"

    def index(self, boundary_hash: str) -> str:
        return f"{self.base}:index:{boundary_hash}"

    def lock(self, ids_hash: str) -> str:
        return f"{self.base}:lock:{ids_hash}"
