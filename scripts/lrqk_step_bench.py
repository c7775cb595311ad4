"""LRQK's compiled decode step (`lrqk_fused.decode_step`) timed out of a model step: one layer's state after a
prompt of LENGTH tokens (and two decode steps), the call repeated on it, serial and on numba's threads. Usage:
    PYTHONPATH=src .venv/bin/python scripts/lrqk_step_bench.py LENGTH [LAYER] [SPEC]
(docs/results.md, "Session 27"). The repeated call fills nothing after the first (the selection stays resident)
and shifts the window each time; the inputs are the layer's own."""
import copy, importlib, sys, time
import numpy as np, torch
from kvshrink.codecs import fused
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus

L = importlib.import_module("kvshrink.methods.lrqk")
F = importlib.import_module("kvshrink.methods.lrqk_fused")
length, layer_idx = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 10
spec = sys.argv[3] if len(sys.argv) > 3 else "lrqk:top_k=512,slot_dtype=float16"
torch.set_num_threads(2)
be = KVShrinkBackend(None); model, tok = be.load_model()
cache = be.make_cache(spec, model)
logits, _ = prefill(model, cache, TokenCorpus(tok).ids[:length])
seen = {}
attend = L.LRQKLayer.attend
def grab(self, query, ctx):
    if self.layer_idx == layer_idx:
        seen.update(layer=copy.deepcopy(self), query=query.clone(), ctx=ctx)
    return attend(self, query, ctx)
L.LRQKLayer.attend = grab
with torch.no_grad():
    for _ in range(3):
        logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
L.LRQKLayer.attend = attend
layer, query, ctx = seen["layer"], seen["query"], seen["ctx"]
key, value = layer._pending
candidates = ctx.past_len - min(layer.window, ctx.past_len)
for threads in (False, True):
    fused._threads_forced = threads
    run = copy.deepcopy(layer)
    times = []
    for _ in range(200):
        t = time.perf_counter()
        run._compiled_decode(query, key, value, ctx, candidates)
        times.append(time.perf_counter() - t)
        run.a_len -= 1; run.slow.length -= 1                 # the same prompt each time
    print(f"{'parallel' if threads else 'serial':8s} {np.median(times[1:]) * 1e6:7.1f} us per call (layer {layer_idx}, "
          f"{length} tokens, {layer.slots.rows} KV rows)")
