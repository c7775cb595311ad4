"""Cold-start time of a method: load the embedded model, make a cache, generate 8 new tokens.

Run with an empty numba cache, so every kernel compiles:
    NUMBA_CACHE_DIR=$(mktemp -d) PYTHONPATH=src python benchmarks/cold_start/measure.py lrqk
results.jsonl holds the runs (machine load average at start and end: the machine was shared)."""
import sys, time
t0 = time.perf_counter()
import torch, kvshrink
model, tok = kvshrink.load_model()
t1 = time.perf_counter()
cache = kvshrink.make_cache(sys.argv[1], model)
t2 = time.perf_counter()
ids = tok("The quick brown fox jumps over the lazy dog. " * 8, return_tensors="pt")
with torch.no_grad():
    model.generate(**ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
t3 = time.perf_counter()
print(f"{sys.argv[1]}: import+load {t1-t0:.1f} s, make_cache {t2-t1:.1f} s, generate(8) {t3-t2:.1f} s, total {t3-t0:.1f} s")
