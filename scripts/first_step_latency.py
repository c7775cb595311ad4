"""What a fresh machine's first decode steps cost in numba compilation: make_cache (its warm-up), a prefill, then
decode steps timed one by one, on the embedded model, in a numba cache folder that starts empty. Usage:
    PYTHONPATH=src .venv/bin/python scripts/first_step_latency.py SPEC PROMPT_TOKENS STEPS
(run it with NUMBA_CACHE_DIR pointing at an empty folder; docs/results.md, "Session 26")."""
import sys
import time

import torch

from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus

spec, length, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
torch.set_num_threads(2)
backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
start = time.perf_counter()
cache = backend.make_cache(spec, model)
print(f"make_cache: {time.perf_counter() - start:.1f} s")
start = time.perf_counter()
logits, _ = prefill(model, cache, TokenCorpus(tokenizer).ids[:length])
print(f"prefill of {length} tokens: {time.perf_counter() - start:.1f} s")
seconds = []
with torch.no_grad():
    for _ in range(steps):
        start = time.perf_counter()
        logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
        seconds.append(time.perf_counter() - start)
print("decode steps (s):", " ".join(f"{s:.2f}" for s in seconds))
print(f"slowest step {max(seconds):.2f} s, median {sorted(seconds)[len(seconds) // 2] * 1e3:.0f} ms")
