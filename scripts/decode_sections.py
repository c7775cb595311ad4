"""Wall time per part of Shard's decode step (the layer's methods timed in place, nested parts inside their
callers), averaged over STEPS decode steps after one prefill. Usage:
PYTHONPATH=src .venv/bin/python scripts/decode_sections.py THREADS LENGTH STEPS [SPEC]
(docs/results.md, "Session 10"; `kvshrink eval cost` is the benchmark, this locates costs). SERIAL=1: numba's
serial kernels even with several threads (docs/results.md, "Session 22")."""
import collections
import functools
import os
import sys
import time

import torch

from kvshrink.codecs import fused
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus
from kvshrink.methods.shard import layer as shard_layer, ring as shard_ring

threads, length, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if os.environ.get("SERIAL"):
    fused._threads_forced = False
spec = sys.argv[4] if len(sys.argv) > 4 else "shard"
torch.set_num_threads(threads)
spent = collections.Counter()


def timed(name, fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - start
    return wrapper


layer_cls = shard_layer.ShardLayer
for name in ("attend", "fast_ring_attend", "code_partials", "fused_middle_into", "reference_middle_partials",
             "stream_partial", "ring_commit", "key_factors"):
    setattr(layer_cls, name, timed(name, getattr(layer_cls, name)))
# the CPU fast path's parts (`fused.StepParts`); the generic path's partial and merge
shard_ring.ExactRing.attend_into = timed("exact part (sinks, window, salient)", shard_ring.ExactRing.attend_into)
shard_ring.ExactRing.partial = timed("exact partial (sinks, window, salient)", shard_ring.ExactRing.partial)
shard_ring.ExactRing.put = timed("ring.put", shard_ring.ExactRing.put)
for name in ("salient_partials", "merge_partials"):
    setattr(shard_layer, name, timed(name, getattr(shard_layer, name)))
for name in ("_block_attention", "_turbo_into", "_int8_into", "_exact_into"):
    setattr(fused, name, timed(f"fused.{name}", getattr(fused, name)))
fused.StepParts.merged = timed("fused.StepParts.merged", fused.StepParts.merged)

backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
cache = backend.make_cache(spec, model)
logits, _ = prefill(model, cache, TokenCorpus(tokenizer).ids[:length])
with torch.no_grad():
    for i in range(steps + 2):   # the first two steps build what blocks keep
        if i == 2:
            spent.clear()
            start = time.perf_counter()
        logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
total = (time.perf_counter() - start) / steps
print(f"{spec} at {length} tokens, {threads} thread(s): {total * 1000:.1f} ms/step (wall)")
for name, seconds in sorted(spent.items(), key=lambda item: -item[1]):
    print(f"{seconds / steps * 1000:8.1f} ms/step  {name}")
