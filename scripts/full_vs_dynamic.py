"""Decode time per token of kvshrink's `full` against transformers' own `DynamicCache` (what `model.generate`
uses when given no cache), on the embedded model, prefilled once each and decoded interleaved (one step of
each in turn, so slow phases of a shared machine hit both): the check that the reference every speed ratio is
taken against is as fast as the cache a user would otherwise have. Usage:
    PYTHONPATH=src .venv/bin/python scripts/full_vs_dynamic.py THREADS STEPS LENGTH [LENGTH ...]"""
import statistics
import sys
import time

import torch
from transformers import DynamicCache

from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus

threads, steps, lengths = int(sys.argv[1]), int(sys.argv[2]), [int(x) for x in sys.argv[3:]]
torch.set_num_threads(threads)
backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
corpus = TokenCorpus(tokenizer)
with torch.no_grad():
    for length in lengths:
        ids = corpus.ids[:length]
        caches = {"DynamicCache": DynamicCache(config=model.config), "full": backend.make_cache("full", model)}
        logits = {name: prefill(model, cache, ids)[0] for name, cache in caches.items()}
        times = {name: [] for name in caches}
        for i in range(steps + 2):     # the first two steps are not timed
            for name, cache in caches.items():
                token = torch.tensor([[int(logits[name][0].argmax())]])
                start = time.perf_counter()
                logits[name] = _step(model, cache, token)
                if i >= 2:
                    times[name].append(time.perf_counter() - start)
        dynamic, full = (statistics.median(times[name]) * 1000 for name in ("DynamicCache", "full"))
        print(f"{length} tokens, {threads} thread(s), median of {steps} steps: DynamicCache {dynamic:.1f} ms/token, "
              f"full {full:.1f} ms/token (full's speed {dynamic / full:.2f}x DynamicCache's)")
