"""Shard's decode steps on the ring (sinks + window in one buffer, `methods/shard/ring.py`) give the same
logits, stream and bytes as the generic path on the two stores."""
import pytest
import torch

import kvshrink
from kvshrink.cache.store import held_bytes
from kvshrink.methods.shard.layer import ShardLayer
from test_shard import tiny_llama


def _decode(model, cache, ids, steps: int) -> torch.Tensor:
    """Prefill, then ``steps`` decode steps of fixed tokens: logits ``[steps + 1, vocab]`` float32."""
    logits = []
    with torch.no_grad():
        logits.append(model(ids, past_key_values=cache).logits[0, -1].float())
        for t in range(steps):
            logits.append(model(torch.tensor([[3 + t]]), past_key_values=cache).logits[0, -1].float())
    return torch.stack(logits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opts", [dict(window=8), dict(window=0), dict(window=5, sinks=0), dict(window=8, salient=0.05),
                                  dict(window=8, salient=0.05, kernel="fast")])
def test_ring_decode_equals_the_generic_path(monkeypatch, dtype, opts):
    model = tiny_llama().to(dtype)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(0))
    opts = dict(dict(sinks=4, min_block=16), **opts)
    ring_cache = kvshrink.make_cache("shard", model, **opts)
    got = _decode(model, ring_cache, ids, 12)
    assert all(layer._ring is not None for layer in ring_cache.layers)
    ring_bytes = ring_cache.nbytes()
    monkeypatch.setattr(ShardLayer, "ring_step", lambda self, ctx: False)
    generic = kvshrink.make_cache("shard", model, **opts)
    want = _decode(model, generic, ids, 12)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    # the same tokens in the same places; the ring's free slot (16-bit models) and the stream buffer's free
    # slots are its only extra bytes
    for a, b in zip(ring_cache.layers, generic.layers):
        assert a.stream.n == b.stream.n == 12
        assert a.stream.runs == b.stream.runs
        # fp32: the same tokens up to a rounding of the merge order (salient rows: a partial of their own),
        # which may flip a stored fp16 ulp or a stream code; bf16: rounding of earlier steps too
        exact = dtype == torch.float32
        for x, y in zip(a.stream.tensors(), b.stream.tensors()):
            assert x.shape == y.shape
            if exact:  # a flip in a tensor of a few dozen values is more than 2% of it
                assert int((x != y).sum()) <= max(1, 0.02 * x.numel())
        assert a._ring is not None
        slot = a._ring.nbytes() // a._ring.keys.shape[2]
        # the ring's stream is a buffer written in place (numba or Triton): its free slots are held bytes
        buffer = a.stream.buffer
        free = 0 if buffer is None else buffer.nbytes() * (buffer.codes.shape[-2] - a.stream.n) // buffer.codes.shape[-2]
        assert held_bytes(a.stream.tensors()) - held_bytes(b.stream.tensors()) == free
        extra = a.nbytes() - b.nbytes()
        assert extra == free + (0 if dtype == torch.float32 else slot), (extra, free, slot)
        # unpacked (as saving and copying do), the stores hold the same tokens in token order
        for store_a, store_b in ((a.sinks, b.sinks), (a.window, b.window)):
            assert len(store_a) == len(store_b) and store_a.start == store_b.start
            if len(store_a) and exact:
                torch.testing.assert_close(store_a.keys, store_b.keys, atol=1e-3, rtol=1e-3)
                torch.testing.assert_close(store_a.values, store_b.values, atol=1e-3, rtol=1e-3)
        assert a._ring is None and a.nbytes() == b.nbytes() + free
    assert ring_bytes >= generic.nbytes()


def test_ring_survives_fork_save_and_a_new_turn(tmp_path):
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(1))
    cache = kvshrink.make_cache("shard", model, sinks=4, window=8, min_block=16)
    _decode(model, cache, ids, 3)
    child = cache.fork()
    path = tmp_path / "c.kvs"
    cache.save(path)
    loaded = kvshrink.load_cache(path, model)
    with torch.no_grad():
        a = model(torch.tensor([[7]]), past_key_values=cache).logits[0, -1]
        b = model(torch.tensor([[7]]), past_key_values=child).logits[0, -1]
        c = model(torch.tensor([[7]]), past_key_values=loaded).logits[0, -1]
        # a new turn (several tokens) after decoding takes the generic path, then decoding resumes on the ring
        model(torch.tensor([[1, 2, 3, 4, 5]]), past_key_values=cache)
        model(torch.tensor([[6]]), past_key_values=cache)
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    torch.testing.assert_close(a, c, atol=1e-6, rtol=1e-6)
    layer = cache.layers[0]
    assert layer._ring is not None and layer.stream.n == 3 + 1 + 5 + 1 and len(layer.window) == 8


@pytest.mark.parametrize("src,store", [(torch.float32, torch.float16), (torch.bfloat16, torch.bfloat16)])
def test_the_gpu_paths_put_kernel_stores_a_token_and_defers_its_overflow_check(src, store):
    """`kernels.shard_ring.put_token` (one launch) == the torch put: the key and value in their slot in the
    ring's dtype; a value beyond float16's range, or a NaN, is raised by the next deferred check."""
    pytest.importorskip("triton")
    from kvshrink.kernels import deferred as stores
    from kvshrink.kernels.backend import force_gpu_path
    from kvshrink.kernels.counting import OpCounter
    from kvshrink.kernels.shard_ring import put_token

    g = torch.Generator().manual_seed(1)
    stores.raise_deferred()
    kv = torch.zeros(2, 2, 3, 7, 24, dtype=store)
    key = torch.randn(2, 1, 3, 24, generator=g).to(src).transpose(1, 2)    # strided, as the model's
    value = torch.randn(2, 3, 1, 24, generator=g).to(src)
    with force_gpu_path():
        stores.deferred_peak_slot(kv.device)     # made once after each check (a fill), then raised in place
        with OpCounter() as counter:
            put_token(kv, 5, key, value)
        assert counter.launches == 1 and counter.syncs == 0, (counter.launch_ops, counter.kernels)
        stores.raise_deferred()
        assert torch.equal(kv[0, :, :, 5:6], key.to(store)) and torch.equal(kv[1, :, :, 5:6], value.to(store))
        assert not kv[:, :, :, :5].any() and not kv[:, :, :, 6:].any()
        if store != torch.float16:
            return
        for bad in (7e4, float("nan")):
            put_token(kv, 2, key, value.clone().fill_(bad))
            with pytest.raises(ValueError, match="float16"):
                stores.raise_deferred()
