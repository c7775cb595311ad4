"""The local-folder backend: one file per key, written to a temporary name and renamed into place.

A file holds a 12-byte header (``KVS1`` and the expiry time as a big-endian double, 0 for none) and
the value. Expired files read as absent; `collect` deletes them, and temporary files left by a
killed writer. ``put_if_absent`` is a hard link of a finished temporary file: it fails if the name
exists, so two writers cannot both win. Sets are folders with one empty file per member.
"""

from __future__ import annotations

import os
import re
import struct
import time
import uuid
from pathlib import Path

from kvshrink.store.backend import BackendError

_MAGIC = b"KVS1"
_HEADER = struct.Struct(">4sd")
_TMP_PREFIX = ".tmp-"
_TMP_GRACE = 3600.0  # a temporary file older than this belongs to a writer that died
_KEY = re.compile(r"^[A-Za-z0-9._-]+(:[A-Za-z0-9._-]+)*$")


def _deadline(ttl: float | None) -> float:
    if ttl is not None and ttl <= 0:
        raise ValueError(f"kvshrink: ttl must be positive seconds or None, not {ttl!r}")
    return 0.0 if ttl is None else time.time() + ttl


def _expired(deadline: float) -> bool:
    return deadline != 0.0 and deadline <= time.time()


class FolderBackend:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser()
        self.url = str(self.root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise BackendError(f"kvshrink: cannot create the store folder {self.root}: {err}") from None

    # ------------------------------------------------------------------------------------------ paths
    def _path(self, key: str) -> Path:
        if not _KEY.match(key) or ".." in key:
            raise ValueError(f"kvshrink: bad store key {key!r}")
        return self.root.joinpath(*key.split(":"))

    def _write_tmp(self, folder: Path, data: bytes, ttl: float | None) -> Path:
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f"{_TMP_PREFIX}{uuid.uuid4().hex}"
        with open(tmp, "wb") as fh:
            fh.write(_HEADER.pack(_MAGIC, _deadline(ttl)))
            fh.write(data)
        return tmp

    @staticmethod
    def _read(path: Path) -> bytes | None:
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            return None
        if len(raw) < _HEADER.size:
            return None
        magic, deadline = _HEADER.unpack_from(raw)
        if magic != _MAGIC or _expired(deadline):
            return None
        return raw[_HEADER.size:]

    # ------------------------------------------------------------------------------------------ protocol
    def get(self, key: str) -> bytes | None:
        try:
            return self._read(self._path(key))
        except OSError as err:
            raise BackendError(f"kvshrink: cannot read {key} in {self.root}: {err}") from None

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put(self, key: str, data: bytes, ttl: float | None = None) -> None:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path.parent, data, ttl)
            os.replace(tmp, path)
        except OSError as err:
            raise BackendError(f"kvshrink: cannot write {key} in {self.root}: {err}") from None

    def put_if_absent(self, key: str, data: bytes, ttl: float | None = None) -> bool:
        path = self._path(key)
        try:
            tmp = self._write_tmp(path.parent, data, ttl)
            try:
                for _ in range(2):
                    try:
                        os.link(tmp, path)
                        return True
                    except FileExistsError:
                        if self._read(path) is not None:
                            return False
                        path.unlink(missing_ok=True)  # expired: free the name, then try once more
                return False
            finally:
                tmp.unlink(missing_ok=True)
        except OSError as err:
            raise BackendError(f"kvshrink: cannot write {key} in {self.root}: {err}") from None

    def delete(self, keys: list[str]) -> None:
        for key in keys:
            path = self._path(key)
            try:
                if path.is_dir():
                    for member in path.iterdir():
                        member.unlink(missing_ok=True)
                    path.rmdir()
                else:
                    path.unlink(missing_ok=True)
            except OSError as err:
                raise BackendError(f"kvshrink: cannot delete {key} in {self.root}: {err}") from None

    def set_ttl(self, key: str, ttl: float | None) -> None:
        try:
            with open(self._path(key), "r+b") as fh:  # the header only; the value stays in place
                fh.write(_HEADER.pack(_MAGIC, _deadline(ttl)))
        except FileNotFoundError:
            return
        except OSError as err:
            raise BackendError(f"kvshrink: cannot set the expiry of {key} in {self.root}: {err}") from None

    def add_member(self, key: str, member: str, ttl: float | None = None) -> None:
        self.put(f"{key}:{member}", b"", ttl)

    def members_many(self, keys: list[str]) -> list[set[str]]:
        out = []
        for key in keys:
            folder = self._path(key)
            try:
                names = [p for p in folder.iterdir() if not p.name.startswith(_TMP_PREFIX)]
            except (FileNotFoundError, NotADirectoryError):
                out.append(set())
                continue
            except OSError as err:
                raise BackendError(f"kvshrink: cannot list {key} in {self.root}: {err}") from None
            out.append({p.name for p in names if self._read(p) is not None})
        return out

    def collect(self) -> int:
        removed = 0
        now = time.time()
        for folder, _, files in os.walk(self.root):
            for name in files:
                path = Path(folder) / name
                try:
                    if name.startswith(_TMP_PREFIX):
                        stale = path.stat().st_mtime < now - _TMP_GRACE
                    else:
                        with open(path, "rb") as fh:
                            head = fh.read(_HEADER.size)
                        stale = len(head) == _HEADER.size and _expired(_HEADER.unpack(head)[1])
                    if stale:
                        path.unlink()
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed

    def close(self) -> None:
        pass
