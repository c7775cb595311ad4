"""What a place that holds bytes must do to back a `CacheStore`: the backend protocol.

Keys are ASCII strings of ``[A-Za-z0-9._:-]``; values are bytes. Every operation is one round trip
that either happens whole or not at all, so an object store (fsspec ``s3://``, ``gs://``: one object
per key, conditional create for ``put_if_absent``, a lifecycle rule or `collect` for expiry) can
implement it too. A backend raises `BackendError` (and only that) when the place cannot be reached.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


class BackendError(RuntimeError):
    """The backing store failed (unreachable, out of memory, refused a write)."""


@runtime_checkable
class StoreBackend(Protocol):
    url: str

    def get(self, key: str) -> bytes | None:
        """The value, or None when absent or expired."""

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        """`get` of each key, in one round trip where the backend allows."""

    def put(self, key: str, data: bytes, ttl: float | None = None) -> None:
        """Store ``data`` whole (a reader sees the old value or the new one); ``ttl`` seconds, None: no expiry."""

    def put_if_absent(self, key: str, data: bytes, ttl: float | None = None) -> bool:
        """Store ``data`` only if ``key`` holds nothing (atomically); True when stored."""

    def delete(self, keys: list[str]) -> None:
        """Remove the keys (absent ones are ignored)."""

    def set_ttl(self, key: str, ttl: float | None) -> None:
        """Expire ``key`` after ``ttl`` seconds from now, or never (None)."""

    def add_member(self, key: str, member: str, ttl: float | None = None) -> None:
        """Add ``member`` to the set at ``key`` (created if absent); the set's expiry becomes ``ttl``."""

    def members_many(self, keys: list[str]) -> list[set[str]]:
        """The members of each set (empty when absent), in one round trip where the backend allows."""

    def collect(self) -> int:
        """Remove what has expired, for backends without native expiry; the number of values removed."""

    def close(self) -> None:
        """Release connections."""
