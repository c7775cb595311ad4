"""LRQK's compiled decode step, two versions A/B in one model process: `kvshrink.methods.lrqk_fused` as it is
("new") against another copy of that module ("old", e.g. `git show HEAD~1:src/kvshrink/methods/lrqk_fused.py`),
switched step by step on one cache, with `full` decoded alongside. Usage:
    git show REV:src/kvshrink/methods/lrqk_fused.py > /tmp/lrqk_fused_old.py
    PYTHONPATH=src .venv/bin/python scripts/lrqk_fused_ab.py LENGTH STEPS /tmp/lrqk_fused_old.py
(docs/results.md, "Session 29"). Prints the median of LRQK's `attend` summed over the layers, per version, and the
step medians; both versions must keep `decode_step`'s signature."""
import collections, importlib, importlib.util, pathlib, sys, tempfile, time
import numpy as np, torch
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus

L = importlib.import_module("kvshrink.methods.lrqk")
NEW = importlib.import_module("kvshrink.methods.lrqk_fused")
# compiled afresh (numba's cache of a module loaded from a path cannot be read back: it names no importable module)
other = pathlib.Path(tempfile.mkdtemp()) / "lrqk_fused_old.py"
other.write_text(pathlib.Path(sys.argv[3]).read_text().replace("cache=True", "cache=False"))
spec = importlib.util.spec_from_file_location("lrqk_fused_old", other)
OLD = importlib.util.module_from_spec(spec); spec.loader.exec_module(OLD); OLD.warm_up()
torch.set_num_threads(2)
clock = time.perf_counter
attend_s = collections.defaultdict(list); current = ["new"]; timing = [False]
attend = L.LRQKLayer.attend
def timed_attend(self, query, ctx):
    t = clock(); out = attend(self, query, ctx)
    if timing[0]:
        attend_s[current[0]][-1] += clock() - t
    return out
L.LRQKLayer.attend = timed_attend
length, steps = int(sys.argv[1]), int(sys.argv[2])
be = KVShrinkBackend(None); model, tok = be.load_model()
ids = TokenCorpus(tok).ids[:length]
lrqk = be.make_cache("lrqk:top_k=512,slot_dtype=float16", model); logits, _ = prefill(model, lrqk, ids)
full = be.make_cache("full", model); full_logits, _ = prefill(model, full, ids)
step_s = collections.defaultdict(list)
with torch.no_grad():
    for i in range(steps):
        which = ("new", "old")[i % 2]
        L.lrqk_fused = NEW if which == "new" else OLD
        current[0] = which; attend_s[which].append(0.0); timing[0] = i > 1
        t = clock(); logits = _step(model, lrqk, torch.tensor([[int(logits[0].argmax())]])); step_s[which].append(clock() - t)
        timing[0] = False
        t = clock(); full_logits = _step(model, full, torch.tensor([[int(full_logits[0].argmax())]]))
        step_s["full"].append(clock() - t)
for which in ("new", "old"):
    print(f"{which}: LRQK attend median {1000 * np.median(attend_s[which][1:]):.2f} ms/step, "
          f"step median {1000 * np.median(step_s[which][1:]):.1f} ms")
print(f"full: step median {1000 * np.median(step_s['full'][2:]):.1f} ms")
