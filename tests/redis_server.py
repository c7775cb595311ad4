"""A real redis-server for the store tests: started on a free 127.0.0.1 port with its own data folder.

Without ``redis-server`` (or the ``redis`` client) the tests that need it skip, saying how to install
it; with ``KVSHRINK_REQUIRE_REDIS=1`` (CI) they fail instead, so CI cannot pass without running them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

INSTALL = ("redis-server is not installed: `apt-get install -y redis-server` (Debian/Ubuntu) or "
           "`brew install redis`, and `pip install 'kvshrink[redis]'` for the client")


def require_redis() -> str:
    """The redis-server executable, or skip (fail under KVSHRINK_REQUIRE_REDIS=1) saying how to install it."""
    exe = shutil.which("redis-server")
    try:
        import redis  # noqa: F401
        client = True
    except ImportError:
        client = False
    if exe and client:
        return exe
    message = INSTALL if not exe else "the redis client is missing: pip install 'kvshrink[redis]'"
    if os.environ.get("KVSHRINK_REQUIRE_REDIS") == "1":
        pytest.fail(f"KVSHRINK_REQUIRE_REDIS=1 but {message}")
    pytest.skip(message)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One redis-server process; ``persist`` turns on the append-only file (fsync on every write)."""

    def __init__(self, folder: Path, persist: bool = False, maxmemory: str | None = None):
        self.exe = require_redis()
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.persist, self.maxmemory = persist, maxmemory
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        args = [self.exe, "--bind", "127.0.0.1", "--port", str(self.port), "--dir", str(self.folder),
                "--daemonize", "no", "--protected-mode", "yes", "--save", "",
                "--logfile", str(self.folder / "redis.log"),
                "--appendonly", "yes" if self.persist else "no", "--appendfsync", "always"]
        if self.maxmemory:
            args += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import redis

        client = redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1)
        deadline = time.monotonic() + 15
        while True:
            try:
                client.ping()
                break
            except redis.exceptions.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.folder / "redis.log").read_text() if (self.folder / "redis.log").exists() else ""
                    self.stop()
                    raise RuntimeError(f"redis-server did not start on port {self.port}: {log[-2000:]}")
                time.sleep(0.05)
        client.close()

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def stop(self) -> None:
        """SIGTERM (redis flushes its append-only file and exits), then wait."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture
def redis_server(tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()
