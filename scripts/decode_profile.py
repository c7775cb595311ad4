"""Where a decode step's time goes: cProfile (process CPU time) over a few decode steps of one cache spec
after one prefill, the functions that took the most time of their own. Usage:
PYTHONPATH=src .venv/bin/python scripts/decode_profile.py THREADS LENGTH STEPS SPEC [TOP]
(docs/results.md, "Session 9"; `kvshrink eval cost` is the benchmark, this locates costs)."""
import cProfile
import io
import pstats
import sys
import time

import torch

from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus

threads, length, steps, spec = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
top = int(sys.argv[5]) if len(sys.argv) > 5 else 20
torch.set_num_threads(threads)
backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
cache = backend.make_cache(spec, model)
logits, _ = prefill(model, cache, TokenCorpus(tokenizer).ids[:length])
with torch.no_grad():
    for _ in range(2):   # first steps build what blocks keep (plans) and compile nothing else
        logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
    profile = cProfile.Profile(timer=time.process_time)
    start = time.process_time()
    profile.enable()
    for _ in range(steps):
        logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
    profile.disable()
    total = (time.process_time() - start) / steps
print(f"{spec} at {length} tokens, {threads} thread(s): {total * 1000:.1f} ms/token (CPU time, profiled)")
out = io.StringIO()
stats = pstats.Stats(profile, stream=out)
stats.sort_stats("tottime").print_stats(top)
for line in out.getvalue().splitlines():
    parts = line.split(None, 5)
    if len(parts) == 6 and parts[0].replace("/", "").isdigit() and parts[1].replace(".", "").isdigit():
        print(f"{float(parts[1]) / steps * 1000:8.1f} ms/step  {int(parts[0].split('/')[0]) // steps:6d} calls  {parts[5]}")
