"""Shard's decode step on one cache, steps alternating between the step as it is and one with two of session 24's
changes switched off in place: the ring read from a float32 copy (not its float16 words) and the key bases scaled
by torch ops (not `fused.scaled_bases`). Medians per mode; interleaving makes the difference visible on a machine
whose speed drifts. Usage:
    PYTHONPATH=src .venv/bin/python scripts/shard_step_switches.py THREADS LENGTH ROUNDS
(docs/results.md, "Session 24"; `kvshrink eval cost` is the benchmark, this isolates two changes)."""
import statistics
import sys
import time

import torch

from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus
from kvshrink.methods.shard import layer as shard_layer, ring as shard_ring

threads, length, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(threads)
as_is = shard_ring.ExactRing.attend_into, shard_layer.ShardLayer.block_arrays


def copied_ring(self, parts, extra=(), new=None, views=None):
    return as_is[0](self, parts, extra, new, None)


def torch_bases(self, block):
    return as_is[1](self, block)._replace(bases=None)


backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
cache = backend.make_cache("shard", model)
logits, _ = prefill(model, cache, TokenCorpus(tokenizer).ids[:length])
times = {"as is": [], "switched off": []}
with torch.no_grad():
    for i in range(rounds + 2):          # the first two steps build what blocks keep
        for mode, (attend_into, block_arrays) in (("as is", as_is), ("switched off", (copied_ring, torch_bases))):
            shard_ring.ExactRing.attend_into, shard_layer.ShardLayer.block_arrays = attend_into, block_arrays
            start = time.perf_counter()
            logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
            if i >= 2:
                times[mode].append(time.perf_counter() - start)
for mode, seconds in times.items():
    print(f"shard at {length} tokens, {mode}: {statistics.median(seconds) * 1e3:.2f} ms/step (median of {rounds})")
