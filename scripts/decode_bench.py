"""Micro-benchmark: decode ms/token (process CPU time) of several cache specs, each prefilled once, timed
interleaved. Usage: PYTHONPATH=src .venv/bin/python scripts/decode_bench.py THREADS LENGTH STEPS SPEC...
(docs/results.md, "Shard's fused decode kernel"; the eval's `kvshrink eval cost` is the wall-clock benchmark)."""
import sys, time, torch
import kvshrink
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.tasks import TokenCorpus
from kvshrink.eval.engine import prefill, _step

threads = int(sys.argv[1]); length = int(sys.argv[2]); steps = int(sys.argv[3]); specs = sys.argv[4:]
torch.set_num_threads(threads)
be = KVShrinkBackend(None)
model, tok = be.load_model()
ids = TokenCorpus(tok).ids[:length]
caches, logits = {}, {}
for s in specs:
    c = be.make_cache(s, model)
    t = time.process_time(); lg, _ = prefill(model, c, ids); pt = time.process_time() - t
    caches[s], logits[s] = c, lg
    print(f"{s:40s} prefill {pt:.2f}s  bytes {c.nbytes()/2**20:.1f} MiB", flush=True)
times = {s: [] for s in specs}
with torch.no_grad():
    for i in range(steps):
        for s in specs:
            nxt = int(logits[s][0].argmax())
            t = time.process_time()
            logits[s] = _step(model, caches[s], torch.tensor([[nxt]]))
            times[s].append(time.process_time() - t)
base = None
for s in specs:
    ts = sorted(times[s][2:]); med = ts[len(ts)//2] * 1000
    base = base or med
    print(f"{s:40s} decode median CPU {med:7.1f} ms/token  speed/first {base/med:.2f}x", flush=True)
