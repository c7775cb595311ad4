"""kvshrink's folder in the user's cache, and small JSON entries in it that a reader sees whole or not at all.

The folder is ``$KVSHRINK_CACHE_HOME`` when set, else ``$XDG_CACHE_HOME/kvshrink``, else ``~/.cache/kvshrink``.
What lives there can always be made again (a converted model, a calibration, a compilation marker): a write that
fails is skipped, and an entry that is missing, partial or damaged reads as absent.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from kvshrink.atomic_file import write_atomic


def cache_home() -> Path:
    configured = os.environ.get("KVSHRINK_CACHE_HOME")
    if configured:
        return Path(configured).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvshrink"


def _digest(payload: dict) -> str:
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def read_entry(path: Path) -> dict | None:
    """The payload `write_entry` stored at ``path``, or None when there is none whole (missing, cut short,
    damaged: its SHA-256 does not match)."""
    try:
        entry = json.loads(Path(path).read_text())
        payload = entry["payload"]
        return payload if entry["sha256"] == _digest(payload) else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_entry(path: Path, payload: dict) -> bool:
    """Store ``payload`` (JSON) at ``path`` with its SHA-256, replacing it whole; False when it cannot be written."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps({"payload": payload, "sha256": _digest(payload)}).encode())
        return True
    except OSError:
        return False
