"""Wall time of the calls inside Shard's CPU decode step in a model step (wrappers on the layer's methods, `fused`'s
kernels and `StepParts`; nested calls inside their callers): what the kernels take and what the Python between them
takes. Usage:
    PYTHONPATH=src .venv/bin/python scripts/shard_step_calls.py LENGTH STEPS [SPEC]
(docs/results.md, "Session 29"). The wrappers add ~1 us a call of their own."""
import sys, time, collections, torch, numpy as np, importlib
from kvshrink.codecs import fused
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus
SL = importlib.import_module("kvshrink.methods.shard.layer")
SS = importlib.import_module("kvshrink.methods.shard.shared")
RG = importlib.import_module("kvshrink.methods.shard.ring")
torch.set_num_threads(2)
acc = collections.Counter(); on = [False]
def wrap(owner, name, label=None):
    f = getattr(owner, name)
    lab = label or f"{getattr(owner, '__name__', owner)}.{name}"
    def w(*a, **k):
        t = time.perf_counter(); r = f(*a, **k)
        if on[0]: acc[lab] += time.perf_counter() - t
        return r
    setattr(owner, name, w)
L = SL.ShardLayer if hasattr(SL, "ShardLayer") else [v for v in vars(SL).values() if isinstance(v, type) and hasattr(v, "fused_middle_into")][0]
for n in ("attend", "fast_ring_attend", "code_partials", "fused_middle_into", "key_factors", "block_arrays", "run_layout", "ring_commit", "decode_ring", "stream_arrays", "blocks", "exact_partial"):
    if hasattr(L, n): wrap(L, n, "layer." + n)
wrap(SS.SharedState if hasattr(SS, "SharedState") else [v for v in vars(SS).values() if isinstance(v, type) and hasattr(v, "channel_rope")][0], "channel_rope", "shared.channel_rope")
for n in ("_decode_scopes_parallel", "_decode_scopes", "_block_scores_parallel", "_block_scores", "_softmax_rows",
          "_block_values_parallel", "_block_values", "scratch"):
    wrap(fused, n, "fused." + n)
bmm = torch.bmm
def timed_bmm(*a, **k):                      # `fused` reaches torch.bmm through its module name: a stand-in module
    t = time.perf_counter(); r = bmm(*a, **k)
    if on[0]: acc["torch.bmm (the basis product)"] += time.perf_counter() - t
    return r
fused.torch = type(torch)("torch_with_timed_bmm")
fused.torch.__dict__.update({k: getattr(torch, k) for k in dir(torch) if not k.startswith("__")}, bmm=timed_bmm)
for n in ("set_bit_positions", "scaled_bases", "_block_attention", "_row_quads", "_turbo_into", "_int8_into", "_exact_into", "group_queries"):
    if hasattr(fused, n): wrap(fused, n, "fused." + n)
for n in ("code", "merged", "ring", "turbo", "int8", "__init__"):
    wrap(fused.StepParts, n, "StepParts." + n)
for n in ("attend_into",):
    wrap(RG.ExactRing, n, "ring." + n)
wrap(SL, "group_queries", "group_queries"); wrap(SL, "ungroup", "ungroup")
length, steps = int(sys.argv[1]), int(sys.argv[2])
be = KVShrinkBackend(None); model, tok = be.load_model()
c = be.make_cache(sys.argv[3] if len(sys.argv) > 3 else "shard", model)
lg, _ = prefill(model, c, TokenCorpus(tok).ids[:length])
ts = []
with torch.no_grad():
    for i in range(steps):
        on[0] = i > 0
        t = time.perf_counter(); lg = _step(model, c, torch.tensor([[int(lg[0].argmax())]])); ts.append(time.perf_counter() - t)
n = steps - 1
print(f"step median {1000*np.median(ts[1:]):.1f} ms")
for k, v in acc.most_common():
    print(f"  {k:32s} {1000*v/n:6.2f} ms/step {1e6*v/n/30:7.1f} us/layer")
