"""Aten ops and host synchronisations per decode step of cache specs on the embedded model (torch.profiler),
after a median decode time of each, timed interleaved (wall clock, 1 thread). Usage:
    PYTHONPATH=src .venv/bin/python scripts/decode_ops.py LENGTH STEPS SPEC...
(docs/pending/issue13-lrqk-results.md). "top-level" ops exclude ops called by other aten ops."""
import sys, time, collections, torch
from torch.profiler import profile, ProfilerActivity
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.tasks import TokenCorpus
from kvshrink.eval.engine import prefill, _step

torch.set_num_threads(1)
length = int(sys.argv[1]); steps = int(sys.argv[2]); specs = sys.argv[3:] or ["full", "lrqk"]
be = KVShrinkBackend(None)
model, tok = be.load_model()
ids = TokenCorpus(tok).ids[:length]
caches, logits = {}, {}
for s in specs:
    c = be.make_cache(s, model)
    lg, pt = prefill(model, c, ids)
    caches[s], logits[s] = c, lg
    print(f"{s:30s} prefill {pt:.2f}s bytes {c.nbytes()/2**20:.1f} MiB", flush=True)
times = {s: [] for s in specs}
with torch.no_grad():
    for i in range(steps):
        for s in specs:
            nxt = int(logits[s][0].argmax())
            t = time.perf_counter()
            logits[s] = _step(model, caches[s], torch.tensor([[nxt]]))
            times[s].append(time.perf_counter() - t)
    base = None
    for s in specs:
        ts = sorted(times[s][1:]); med = ts[len(ts)//2] * 1000
        base = base or med
        print(f"{s:30s} decode median {med:7.1f} ms/token  speed full/this {base/med:.2f}x", flush=True)
    for s in specs:
        nxt = int(logits[s][0].argmax())
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            logits[s] = _step(model, caches[s], torch.tensor([[nxt]]))
        ev = prof.key_averages()
        nops = sum(e.count for e in ev if e.key.startswith("aten::"))
        syncs = sum(e.count for e in ev if e.key in ("aten::_local_scalar_dense",))
        print(f"== {s}: aten ops {nops} ({nops/30:.0f}/layer), _local_scalar_dense {syncs} ({syncs/30:.1f}/layer)")
        top = [e for e in prof.events() if e.name.startswith("aten::") and not (e.cpu_parent is not None and e.cpu_parent.name.startswith("aten::"))]
        nz = sum(1 for e in prof.events() if e.name == "aten::nonzero")
        print(f"   top-level aten ops {len(top)} ({len(top)/30:.0f}/layer), nonzero {nz} ({nz/30:.1f}/layer)")
