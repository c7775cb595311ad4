"""The manifest of a stored entry: what its chunks are and how to check them.

The value (a cache file's bytes, `persist.cache_to_bytes`) is cut into chunks of at most
``chunk_bytes``; the manifest lists each chunk's key, size and SHA-256, and the SHA-256 of the
whole value. It is JSON with a SHA-256 of its own body, written last, with ``put_if_absent``:
until it exists no reader knows the chunks, and once it exists it never changes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field

MANIFEST_FORMAT = "kvshrink-store-entry"
MANIFEST_VERSION = 1


class EntryError(ValueError):
    """A stored entry that cannot be used (its reason is logged and the lookup misses)."""


@dataclass
class Chunk:
    key: str
    size: int
    sha256: str


@dataclass
class Manifest:
    scope: str
    tokens: int
    ids_sha256: str
    size: int
    sha256: str
    chunks: list[Chunk]
    created: float
    summary: dict = field(default_factory=dict)  # method, options, bytes: for people reading the store

    def to_bytes(self) -> bytes:
        body = json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, **asdict(self)}, sort_keys=True)
        return json.dumps({"body": body, "sha256": hashlib.sha256(body.encode()).hexdigest()}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> "Manifest":
        try:
            outer = json.loads(data)
            body = outer["body"]
            if hashlib.sha256(body.encode()).hexdigest() != outer["sha256"]:
                raise EntryError("manifest checksum mismatch")
            fields = json.loads(body)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise EntryError(f"manifest unreadable ({err})") from None
        if fields.pop("format", None) != MANIFEST_FORMAT or fields.pop("version", None) != MANIFEST_VERSION:
            raise EntryError("manifest of another format or version")
        try:
            fields["chunks"] = [Chunk(**c) for c in fields["chunks"]]
            return cls(**fields)
        except (TypeError, KeyError) as err:
            raise EntryError(f"manifest fields wrong ({err})") from None


def split(data: bytes, chunk_bytes: int) -> list[bytes]:
    if chunk_bytes <= 0:
        raise ValueError(f"kvshrink: chunk_bytes must be positive, not {chunk_bytes}")
    view = memoryview(data)
    return [bytes(view[i:i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)] or [b""]


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def joined(manifest: Manifest, values: list[bytes | None]) -> bytes:
    """The value of an entry from its chunks' values, each checked; `EntryError` names the first bad one."""
    parts = []
    for i, (chunk, value) in enumerate(zip(manifest.chunks, values)):
        where = f"chunk {i + 1}/{len(manifest.chunks)}"
        if value is None:
            raise EntryError(f"{where} is missing (evicted, expired or deleted)")
        if len(value) != chunk.size or sha256(value) != chunk.sha256:
            raise EntryError(f"{where} is corrupted (checksum mismatch)")
        parts.append(value)
    data = b"".join(parts)
    if len(data) != manifest.size or sha256(data) != manifest.sha256:
        raise EntryError("the joined chunks do not match the manifest's checksum")
    return data
