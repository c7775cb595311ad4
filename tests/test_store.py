"""kvshrink.CacheStore on both backends: a local folder and a real redis-server on 127.0.0.1.

Each promise is checked where it can break: a reader sees a whole, checksummed entry or none; a killed
writer leaves nothing visible and its chunks expire or are collected; two writers store one entry; a
restarted or full Redis gives misses, never errors or wrong caches; another model, method, options or
format version misses.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

import kvshrink
from kvshrink.cache import persist
from kvshrink.store import CacheStore, cache_store
from kvshrink.store.keys import scope_id

from conftest import tiny_model
from redis_server import RedisServer, redis_server  # noqa: F401  (fixture)

METHOD, OPTIONS = "kivi", {"group": 16, "residual": 16}
SMALL = dict(chunk_bytes=8192, index_every=64)  # several chunks per entry, several index boundaries


@pytest.fixture(scope="module")
def model():
    return tiny_model()


def ids_of(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


def filled(model, ids, method=METHOD, **options):
    cache = kvshrink.make_cache(method, model, **(options or (OPTIONS if method == METHOD else {})))
    with torch.no_grad():
        model(input_ids=ids, past_key_values=cache, use_cache=True)
    return cache


def continuation(model, cache, ids, rest, new=4):
    """Greedy tokens after ``ids + rest`` with ``cache`` holding a prefix of ``ids`` (the cache is forked)."""
    full = torch.cat([ids, rest], 1)
    with torch.no_grad():
        out = model.generate(input_ids=full, attention_mask=torch.ones_like(full), past_key_values=cache.fork(),
                             max_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    return out[0, full.shape[1]:].tolist()


@pytest.fixture(params=["folder", "redis"])
def store_url(request, tmp_path):
    if request.param == "folder":
        yield str(tmp_path / "store")
        return
    server = RedisServer(tmp_path / "redis").start()
    yield server.url
    server.stop()


def report(fault: str, url: str, *stores: CacheStore) -> None:
    """One JSON line per fault test (`pytest -s` shows it; docs/store.md quotes them)."""
    import json
    import re

    def general(reason: str) -> str:  # one line per kind of reason, not per entry
        return re.sub(r"chunk \d+/\d+", "chunk i/n", re.sub(r"\([0-9a-f]{16}\)", "(hash)", reason))

    print("\n" + json.dumps({"fault": fault, "backend": "redis" if url.startswith("redis://") else "folder",
                             "hits": sum(s.stats.hits for s in stores), "misses": sum(s.stats.misses for s in stores),
                             "computed": sum(s.stats.computed for s in stores),
                             "waited": sum(s.stats.waited for s in stores), "puts": sum(s.stats.puts for s in stores),
                             "reasons": sorted({general(r) for s in stores for r in s.stats.reasons})}))


def chunk_keys(url: str) -> list[str]:
    """Every chunk key the store holds (tests only: a store never lists keys)."""
    if url.startswith("redis://"):
        import redis

        client = redis.Redis.from_url(url)
        try:
            return sorted(k.decode() for k in client.scan_iter("*:chunk:*"))
        finally:
            client.close()
    return sorted(str(p) for p in Path(url).rglob("*") if p.is_file() and "/chunk/" in str(p))


# ---------------------------------------------------------------------------------------------- the basics
def test_put_get_round_trip_same_answer(model, store_url):
    store = CacheStore(store_url, **SMALL)
    ids, rest = ids_of(150), ids_of(6, seed=1)
    cache = filled(model, ids)
    assert store.get(model, ids, METHOD, **OPTIONS) is None
    assert store.put(cache) is True
    assert store.put(cache) is False  # already stored: written once
    got = store.get(model, ids, METHOD, **OPTIONS)
    assert got is not None and got.get_seq_length() == 150 and got is not cache
    assert continuation(model, got, ids, rest) == continuation(model, cache, ids, rest)
    assert len(chunk_keys(store_url)) > 1  # the value really was split


def test_longest_stored_prefix_then_the_rest(model, store_url):
    store = CacheStore(store_url, **SMALL)
    ids = ids_of(300)
    for n in (70, 200):
        store.put(filled(model, ids[:, :n]))
    assert store.get(model, ids, METHOD, **OPTIONS).get_seq_length() == 200
    assert store.get(model, ids[:, :199], METHOD, **OPTIONS).get_seq_length() == 70
    assert store.get(model, ids, METHOD, max_tokens=150, **OPTIONS).get_seq_length() == 70
    other = ids.clone()
    other[0, 50] = (other[0, 50] + 1) % 128 + 3  # differs inside the first entry
    assert store.get(model, other, METHOD, **OPTIONS) is None
    # cache_for continues from the 200-token prefix and stores the whole; the result answers like a fresh prefill
    cache, how = store.cache_for(model, ids, METHOD, **OPTIONS)
    assert how == "computed" and cache.get_seq_length() == 300
    reference = filled(model, ids[:, :200])
    with torch.no_grad():
        model(input_ids=ids[:, 200:], past_key_values=reference, use_cache=True)
    rest = ids_of(5, seed=2)
    assert continuation(model, cache, ids, rest) == continuation(model, reference, ids, rest)
    assert store.cache_for(model, ids, METHOD, **OPTIONS)[1] == "hit"


def test_wrong_model_method_options_or_format_version_miss(model, store_url, monkeypatch, caplog):
    store = CacheStore(store_url, **SMALL)
    ids = ids_of(120)
    store.put(filled(model, ids))
    assert store.get(tiny_model(seed=1), ids, METHOD, **OPTIONS) is None  # other weights
    assert store.get(model.to(torch.float64), ids, METHOD, **OPTIONS) is None  # other dtype
    model.to(torch.float32)
    assert store.get(model, ids, "turboquant") is None
    assert store.get(model, ids, METHOD, group=32, residual=16) is None
    with pytest.raises(ValueError, match="unknown option"):
        store.get(model, ids, METHOD, bogus=1)
    monkeypatch.setattr(persist, "FORMAT_VERSION", persist.FORMAT_VERSION + 1)
    assert store.get(model, ids, METHOD, **OPTIONS) is None  # another format version: another key
    monkeypatch.undo()
    # an entry whose file this kvshrink cannot read (found under the key of the format it was written in) is
    # refused by the file's own check: a miss with its reason
    written = persist.FORMAT_VERSION
    monkeypatch.setattr(persist, "FORMAT_VERSION", written + 1)
    monkeypatch.setattr(cache_store, "scope_id", lambda *key: scope_id(*key[:-1], written))
    with caplog.at_level(logging.WARNING, logger="kvshrink.store"):
        assert store.get(model, ids, METHOD, **OPTIONS) is None
    assert f"written by cache format {written}" in caplog.text
    monkeypatch.undo()
    assert store.get(model, ids, METHOD, **OPTIONS) is None  # the unreadable entry was dropped ...
    assert store.cache_for(model, ids, METHOD, **OPTIONS)[1] == "computed"  # ... and is stored again
    assert store.get(model, ids, METHOD, **OPTIONS) is not None
    report("other model, dtype, method, options, format version", store_url, store)


def _corrupt(url: str, key_path: str, flip: bool) -> None:
    if url.startswith("redis://"):
        import redis

        client = redis.Redis.from_url(url)
        if flip:
            value = bytearray(client.get(key_path))
            value[len(value) // 2] ^= 0xFF
            client.set(key_path, bytes(value), keepttl=True)
        else:
            client.delete(key_path)
        client.close()
    else:
        path = Path(key_path)
        if flip:
            value = bytearray(path.read_bytes())
            value[len(value) // 2] ^= 0xFF
            path.write_bytes(bytes(value))
        else:
            path.unlink()


@pytest.mark.parametrize("fault", ["corrupted", "missing"])
def test_bad_chunk_is_a_logged_miss_then_recomputed(model, store_url, fault, caplog):
    store = CacheStore(store_url, **SMALL)
    ids = ids_of(150)
    store.put(filled(model, ids))
    keys = chunk_keys(store_url)
    _corrupt(store_url, keys[len(keys) // 2], flip=fault == "corrupted")
    with caplog.at_level(logging.WARNING, logger="kvshrink.store"):
        assert store.get(model, ids, METHOD, **OPTIONS) is None
    assert ("checksum mismatch" if fault == "corrupted" else "is missing") in caplog.text
    assert store.stats.reasons and store.stats.misses == 1
    cache, how = store.cache_for(model, ids, METHOD, **OPTIONS)
    assert how == "computed"
    got = store.get(model, ids, METHOD, **OPTIONS)
    report(f"{fault} chunk", store_url, store)
    rest = ids_of(4, seed=3)
    assert continuation(model, got, ids, rest) == continuation(model, filled(model, ids), ids, rest)


# ---------------------------------------------------------------------------------------------- killed writer
def _killed_writer(url: str, cache, orphan_ttl: float) -> None:
    """A forked process writes ``cache`` and is SIGKILLed after its first chunk."""
    import select

    from kvshrink.store import cache_store

    data = persist.cache_to_bytes(cache)  # done here: the child runs no torch kernels after the fork
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the writer
        try:
            os.close(read_end)
            cache_store.cache_to_bytes = lambda *a, **k: data
            store = CacheStore(url, orphan_ttl=orphan_ttl, **SMALL)
            put = store.backend.put

            def put_then_stall(key, value, ttl=None):
                put(key, value, ttl)
                os.write(write_end, b"1")
                time.sleep(60)  # killed here, between chunks

            store.backend.put = put_then_stall
            store.put(cache)
        finally:
            os._exit(0)
    os.close(write_end)
    try:
        ready, _, _ = select.select([read_end], [], [], 60)
        assert ready and os.read(read_end, 1) == b"1", "the writer did not write its first chunk"
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        os.close(read_end)


def test_writer_killed_between_chunks_leaves_no_entry(model, store_url):
    orphan_ttl = 1.5
    ids = ids_of(150)
    _killed_writer(store_url, filled(model, ids), orphan_ttl)
    store = CacheStore(store_url, **SMALL)
    assert len(chunk_keys(store_url)) == 1  # the orphan chunk ...
    assert store.get(model, ids, METHOD, **OPTIONS) is None  # ... is never read: no manifest
    time.sleep(orphan_ttl + 0.5)
    if store_url.startswith("redis://"):
        assert chunk_keys(store_url) == []  # Redis expired it
    else:
        assert store.collect() == 1 and chunk_keys(store_url) == []  # the folder's collection removed it
    assert store.cache_for(model, ids, METHOD, **OPTIONS)[1] == "computed"
    assert store.get(model, ids, METHOD, **OPTIONS) is not None
    report("writer killed after its first chunk", store_url, store)


# ---------------------------------------------------------------------------------------------- concurrent writers
def test_concurrent_writers_store_one_entry_and_compute_once(model, store_url):
    ids = ids_of(150)
    stores = [CacheStore(store_url, **SMALL) for _ in range(4)]
    prefills = []

    def slow_prefill(m, cache, rest):
        prefills.append(rest.shape[1])
        time.sleep(0.3)  # long enough for every thread to find the lock taken
        with torch.no_grad():
            m(input_ids=rest, past_key_values=cache, use_cache=True)

    results = [None] * len(stores)
    barrier = threading.Barrier(len(stores))

    def worker(i):
        barrier.wait()
        results[i] = stores[i].cache_for(model, ids, METHOD, prefill=slow_prefill, **OPTIONS)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(stores))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    hows = sorted(how for _, how in results)
    assert prefills == [150] and hows.count("computed") == 1, hows
    assert sum(s.stats.puts for s in stores) == 1
    rest = ids_of(4, seed=4)
    answers = {tuple(continuation(model, cache, ids, rest)) for cache, _ in results}
    assert len(answers) == 1
    report("4 concurrent cache_for of one document", store_url, *stores)
    # two plain puts of the same cache at once: one manifest, the loser's chunks deleted
    other = ids_of(150, seed=9)
    cache = filled(model, other)
    wins = [None, None]
    barrier2 = threading.Barrier(2)

    def put(i):
        barrier2.wait()
        wins[i] = stores[i].put(cache)

    pair = [threading.Thread(target=put, args=(i,)) for i in range(2)]
    for t in pair:
        t.start()
    for t in pair:
        t.join(timeout=60)
    assert sorted(wins) == [False, True]
    written = CacheStore(store_url, **SMALL)
    assert written.get(model, other, METHOD, **OPTIONS) is not None


def test_dead_lock_holder_does_not_block_forever(model, store_url):
    store = CacheStore(store_url, lock_timeout=1.0, **SMALL)
    ids = ids_of(100)
    from kvshrink.store.cache_store import _scope
    from kvshrink.store.keys import prefix_hashes

    scope = _scope(persist.model_fingerprint(model), "float32", METHOD, OPTIONS, "kvshrink")
    lock = scope.keys.lock(prefix_hashes(ids[0].numpy(), [100])[100])
    assert store.backend.put_if_absent(lock, b"a worker that died", ttl=30)
    start = time.monotonic()
    cache, how = store.cache_for(model, ids, METHOD, **OPTIONS)
    assert how == "computed" and 1.0 <= time.monotonic() - start < 10
    assert any("waited" in r for r in store.stats.reasons)
    report("lock held by a dead worker", store_url, store)


# ---------------------------------------------------------------------------------------------- Redis faults
@pytest.mark.parametrize("persist_on", [True, False], ids=["persistence", "no-persistence"])
def test_redis_restart_mid_run(model, tmp_path, persist_on, caplog):
    server = RedisServer(tmp_path / "redis", persist=persist_on).start()
    try:
        store = CacheStore(server.url, **SMALL)
        ids = ids_of(150)
        assert store.cache_for(model, ids, METHOD, **OPTIONS)[1] == "computed"
        server.stop()
        with caplog.at_level(logging.WARNING, logger="kvshrink.store"):
            assert store.get(model, ids, METHOD, **OPTIONS) is None  # down: a logged miss, not an error
            assert store.put(filled(model, ids_of(80, seed=5))) is False
        assert "lookup failed" in caplog.text and "put of 80 tokens failed" in caplog.text
        server.start()
        cache, how = store.cache_for(model, ids, METHOD, **OPTIONS)
        assert how == ("hit" if persist_on else "computed")
        rest = ids_of(4, seed=6)
        assert continuation(model, cache, ids, rest) == continuation(model, filled(model, ids), ids, rest)
        report(f"redis restart, {'with' if persist_on else 'without'} persistence", server.url, store)
    finally:
        server.stop()


def test_redis_maxmemory_lru_evictions_are_misses(model, tmp_path):
    server = RedisServer(tmp_path / "redis").start()
    try:
        client = server.client()
        # room for some entries above what the empty server uses; 30 entries of ~100 KB do not fit
        client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + 1_000_000)
        client.config_set("maxmemory-policy", "allkeys-lru")
        store = CacheStore(server.url, chunk_bytes=32768, index_every=64)
        docs = [ids_of(200, seed=100 + i) for i in range(30)]
        caches = [filled(model, d, "full") for d in docs]
        for c in caches:
            store.put(c)  # never raises; a put refused for memory is logged and returns False
        assert int(client.info("stats")["evicted_keys"]) > 0
        # Redis's LRU clock ticks once a second, so which keys of entries written within one second go is
        # chance: read what survived from the server itself, then lift the limit so reading evicts nothing.
        client.config_set("maxmemory", 0)
        state = [stored_state(client, d) for d in docs]
        assert state.count("whole") < len(docs)  # at most ~10 of them fit
        fresh = ids_of(200, seed=99)
        fresh_cache = filled(model, fresh, "full")
        assert store.put(fresh_cache)
        docs, caches, state = docs + [fresh], caches + [fresh_cache], state + ["whole"]
        store.stats.reasons.clear()
        rest = ids_of(3, seed=7)
        for d, c, s in zip(docs, caches, state):
            got = store.get(model, d, "full")  # never raises
            assert (got is not None) == (s == "whole"), s
            if got is not None:  # what is read is whole and right
                assert continuation(model, got, d, rest, new=2) == continuation(model, c, d, rest, new=2)
        assert store.stats.hits == state.count("whole")
        assert store.stats.misses == len(docs) - state.count("whole")
        # a manifest whose chunks were evicted under it is a miss that says so
        assert sum("is missing" in r for r in store.stats.reasons) == state.count("chunks evicted")
        report("maxmemory + allkeys-lru, 30 entries", server.url, store)
        client.close()
    finally:
        server.stop()


def stored_state(client, ids) -> str:
    """What a Redis server holds of the entry of ``ids``: "whole", "chunks evicted" or "manifest evicted"."""
    from kvshrink.store.keys import ids_array, prefix_hashes
    from kvshrink.store.manifest import Manifest

    arr = ids_array(ids)
    names = list(client.scan_iter(match=f"*:entry:{prefix_hashes(arr, [len(arr)])[len(arr)]}"))
    if not names:
        return "manifest evicted"
    manifest = Manifest.from_bytes(client.get(names[0]))
    present = client.exists(*[c.key for c in manifest.chunks])
    return "whole" if present == len(manifest.chunks) else "chunks evicted"


def test_missing_server_says_how_to_install(monkeypatch):
    import shutil

    import redis_server as rs

    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.delenv("KVSHRINK_REQUIRE_REDIS", raising=False)
    with pytest.raises(pytest.skip.Exception, match="apt-get install -y redis-server"):
        rs.require_redis()
    monkeypatch.setenv("KVSHRINK_REQUIRE_REDIS", "1")
    with pytest.raises(pytest.fail.Exception, match="KVSHRINK_REQUIRE_REDIS=1"):
        rs.require_redis()


def test_bad_urls_and_arguments(tmp_path, model):
    with pytest.raises(ValueError, match="no store backend for s3://"):
        CacheStore("s3://bucket/prefix")
    with pytest.raises(ValueError, match="positive"):
        CacheStore(str(tmp_path), chunk_bytes=0)
    store = CacheStore(str(tmp_path))
    with pytest.raises(ValueError, match="no token ids"):
        store.get(model, [], METHOD, **OPTIONS)
    with pytest.raises(ValueError, match="batch"):
        store.get(model, torch.ones(2, 5, dtype=torch.long), METHOD, **OPTIONS)


def test_the_default_folder_is_in_kvshrinks_cache_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("KVSHRINK_STORE", raising=False)
    monkeypatch.setenv("KVSHRINK_CACHE_HOME", str(tmp_path / "home"))
    assert cache_store.open_backend(None).root == tmp_path / "home" / "store"
    monkeypatch.setenv("KVSHRINK_STORE", str(tmp_path / "elsewhere"))
    assert cache_store.open_backend(None).root == tmp_path / "elsewhere"
