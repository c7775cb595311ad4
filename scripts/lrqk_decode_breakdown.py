"""Per-phase process time of one LRQK decode step (timers wrapped around the layer's private methods) and of
full's attention, prefilled once each and decoded interleaved. Usage:
    PYTHONPATH=src .venv/bin/python scripts/lrqk_decode_breakdown.py LENGTH STEPS THREADS lrqk [EXTRA_SPEC...]
(docs/pending/issue13-lrqk-results.md). The timers add a little time of their own; nested phases overlap.
SERIAL=1: numba's serial kernels even with several threads."""
import os, sys, time, collections, functools, torch
CLOCK = time.perf_counter if os.environ.get("WALL") else time.process_time  # WALL=1: wall clock
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.tasks import TokenCorpus
from kvshrink.eval.engine import prefill, _step
import importlib
L = importlib.import_module('kvshrink.methods.lrqk')
T = importlib.import_module('kvshrink.methods.lrqk_tiers')
B = importlib.import_module('kvshrink.cache.base')

torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
if os.environ.get("SERIAL"):
    importlib.import_module('kvshrink.codecs.fused')._threads_forced = False
acc = collections.defaultdict(float); cnt = collections.Counter(); on = [False]; CUR = ["?"]
def timed(obj, name, label=None):
    f = getattr(obj, name)
    @functools.wraps(f)
    def w(*a, **k):
        if not on[0]: return f(*a, **k)
        t = CLOCK(); r = f(*a, **k); acc[CUR[0] + ":" + (label or name)] += CLOCK() - t; cnt[CUR[0] + ":" + (label or name)] += 1; return r
    setattr(obj, name, w)
for n in ["_update_factor_vectors_fast", "_resident_sums", "_resident_attention", "_select_and_fill", "_update_factor_vectors", "_resident_rows", "_select", "_slot_partial", "_topk_partial", "_decode_partials", "commit", "past_partials"]:
    if hasattr(L.LRQKLayer, n): timed(L.LRQKLayer, n, "layer." + n)
timed(T.SlotTier, "select", "slots.select")
LF = importlib.import_module('kvshrink.codecs.lowrank_fused')
timed(importlib.import_module('kvshrink.methods.lrqk_fused'), "decode_step", "lrqk_fused.decode_step")
timed(L.LRQKLayer, "_compiled_decode", "layer._compiled_decode")
timed(LF, "decode_step", "numba.decode_step")
timed(L, "decode_factor_vectors"); timed(L, "line_search_basis_step")
timed(L, "exact_partial", "lrqk.exact_partial(window)")
timed(B, "merge_partials")
timed(B.CacheLayer, "attend", "attend(all)")
timed(importlib.import_module("kvshrink.cache.exact_layer").ExactLayer, "attend", "attend(exact)")
timed(L.LRQKLayer, "attend", "attend(lrqk)")
WHO = sys.argv[4] if len(sys.argv) > 4 else "lrqk"
SPECS = ["full", WHO] + sys.argv[5:]
length = int(sys.argv[1]); steps = int(sys.argv[2])
be = KVShrinkBackend(None); model, tok = be.load_model()
ids = TokenCorpus(tok).ids[:length]
caches, logits = {}, {}
for s in SPECS:
    c = be.make_cache(s, model); lg, pt = prefill(model, c, ids); caches[s], logits[s] = c, lg
times = {s: [] for s in caches}
with torch.no_grad():
    for i in range(steps):
        for s in caches:
            nxt = int(logits[s][0].argmax())
            on[0] = i > 0; CUR[0] = s
            t = CLOCK(); logits[s] = _step(model, caches[s], torch.tensor([[nxt]])); times[s].append(CLOCK() - t)
            on[0] = False
med = {s: sorted(v[1:])[len(v[1:])//2] * 1000 for s, v in times.items()}
print(f"len {length}: full {med['full']:.1f} ms, lrqk {med[WHO]:.1f} ms, speed ratio {med['full']/med[WHO]:.2f}x")
n = steps - 1
for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
    print(f"  {k:40s} {1000*v/n:7.2f} ms/step  ({cnt[k]//n} calls/step)")
