"""The Redis backend (``redis://host:port/db``), through the standard ``redis`` client
(``pip install 'kvshrink[redis]'``). Expiry is Redis's own (``PX``, ``PERSIST``); ``put_if_absent`` is
``SET NX``; several keys are read in one round trip (``MGET``, a pipeline of ``SMEMBERS``)."""

from __future__ import annotations

from kvshrink.store.backend import BackendError

_TIMEOUT_S = 10.0


def _ms(ttl: float | None) -> int | None:
    if ttl is None:
        return None
    if ttl <= 0:
        raise ValueError(f"kvshrink: ttl must be positive seconds or None, not {ttl!r}")
    return max(1, int(ttl * 1000))


class RedisBackend:
    def __init__(self, url: str):
        try:
            import redis
        except ImportError:
            raise ImportError("kvshrink: a redis:// store needs the redis client: pip install 'kvshrink[redis]'") from None
        self._errors = (redis.exceptions.RedisError, OSError)
        self.url = url
        self._client = redis.Redis.from_url(url, socket_timeout=_TIMEOUT_S, socket_connect_timeout=_TIMEOUT_S)

    def _call(self, what: str, fn):
        try:
            return fn()
        except self._errors as err:
            raise BackendError(f"kvshrink: redis {self.url}: {what} failed ({type(err).__name__}: {err})") from None

    def get(self, key: str) -> bytes | None:
        return self._call(f"GET {key}", lambda: self._client.get(key))

    def get_many(self, keys: list[str]) -> list[bytes | None]:
        if not keys:
            return []
        return self._call(f"MGET of {len(keys)} keys", lambda: self._client.mget(keys))

    def put(self, key: str, data: bytes, ttl: float | None = None) -> None:
        self._call(f"SET {key}", lambda: self._client.set(key, data, px=_ms(ttl)))

    def put_if_absent(self, key: str, data: bytes, ttl: float | None = None) -> bool:
        return bool(self._call(f"SET NX {key}", lambda: self._client.set(key, data, px=_ms(ttl), nx=True)))

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._call(f"DEL of {len(keys)} keys", lambda: self._client.delete(*keys))

    def set_ttl(self, key: str, ttl: float | None) -> None:
        ms = _ms(ttl)
        self._call(f"expiry of {key}",
                   lambda: self._client.persist(key) if ms is None else self._client.pexpire(key, ms))

    def add_member(self, key: str, member: str, ttl: float | None = None) -> None:
        def run():
            pipe = self._client.pipeline(transaction=True)
            pipe.sadd(key, member)
            ms = _ms(ttl)
            pipe.persist(key) if ms is None else pipe.pexpire(key, ms)
            pipe.execute()

        self._call(f"SADD {key}", run)

    def members_many(self, keys: list[str]) -> list[set[str]]:
        def run():
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.smembers(key)
            return pipe.execute()

        if not keys:
            return []
        return [{m.decode() for m in found} for found in self._call(f"SMEMBERS of {len(keys)} keys", run)]

    def collect(self) -> int:
        return 0  # Redis expires keys itself

    def close(self) -> None:
        self._client.close()
