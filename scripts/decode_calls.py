"""Calls from kvshrink's Python code into C (torch and numpy methods, numba kernels, builtins) per layer in one decode
step, by function or by line (sys.setprofile's c_call events; 1 thread). On this CPU a decode step's small calls
cost far more inside a model step than alone (caches cold after the layer's matmuls), so their count is a cost.
Usage:
    PYTHONPATH=src .venv/bin/python scripts/decode_calls.py LENGTH SPEC [lines]"""
import sys, collections, torch
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.tasks import TokenCorpus
from kvshrink.eval.engine import prefill, _step

torch.set_num_threads(1)
length, spec = int(sys.argv[1]), sys.argv[2]
by_line = len(sys.argv) > 3 and sys.argv[3] == "lines"
be = KVShrinkBackend(None)
model, tok = be.load_model()
cache = be.make_cache(spec, model)
logits, _ = prefill(model, cache, TokenCorpus(tok).ids[:length])
counts = collections.Counter()


def watch(frame, event, arg):
    if event == "c_call" and "kvshrink" in frame.f_code.co_filename:
        where = frame.f_code.co_filename.split("kvshrink/")[-1]
        key = f"{where}:{frame.f_lineno} {getattr(arg, '__name__', arg)}" if by_line else f"{where}:{frame.f_code.co_name}"
        counts[key] += 1


with torch.no_grad():
    for _ in range(3):
        logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
    sys.setprofile(watch)
    logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
    sys.setprofile(None)
layers = len(cache.layers)
print(f"{spec} at {length} tokens: {sum(counts.values()) / layers:.1f} calls into C per layer and decode step")
for key, n in counts.most_common(40):
    print(f"  {n / layers:6.1f}  {key}")
