"""How much of a decode step is attention: each cache spec's step timed as it is and with kvshrink's attention
replaced by zeros (the model's matmuls alone; nothing committed to the cache), interleaved step by step in one
process, medians. With MIDDLE=1 only Shard's compressed middle blocks are replaced (their part's probability mass
set to zero): what the blocks cost in place. Usage:
    PYTHONPATH=src .venv/bin/python scripts/attention_share.py THREADS LENGTH ROUNDS SPEC...
(docs/results.md, "Session 23"; `kvshrink eval cost` is the benchmark, this locates costs)."""
import os
import statistics
import sys
import time

import numpy as np
import torch
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from kvshrink.cache import integration
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus
from kvshrink.methods.shard import layer as shard_layer

threads, length, rounds, specs = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
middle_only = bool(os.environ.get("MIDDLE"))
torch.set_num_threads(threads)
attention, middle = integration.kvshrink_attention, shard_layer.ShardLayer.fused_middle_into


def no_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    if query.shape[2] == 1 and isinstance(key, integration.LayerHandle):
        key.layer._pending = None
        return torch.zeros(query.shape[0], 1, query.shape[1], query.shape[3]), None
    return attention(module, query, key, value, attention_mask, dropout, scaling, **kwargs)


def no_middle(self, block, ctx, parts):
    out, lse = parts._next()
    out[...], lse[...] = 0.0, -np.inf


def stub(on: bool) -> None:
    if middle_only:
        shard_layer.ShardLayer.fused_middle_into = no_middle if on else middle
    else:
        ALL_ATTENTION_FUNCTIONS["kvshrink"] = no_attention if on else attention


backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
ids = TokenCorpus(tokenizer).ids[:length]
runs = {}
with torch.no_grad():
    for spec in specs:
        cache = backend.make_cache(spec, model)
        logits, _ = prefill(model, cache, ids)
        runs[spec] = [cache, logits, [], []]
    for i in range(rounds + 2):   # the first two steps build what blocks keep
        for stubbed in (False, True):
            stub(stubbed)
            for spec, run in runs.items():
                start = time.perf_counter()
                logits = _step(model, run[0], torch.tensor([[int(run[1][0].argmax())]]))
                if i >= 2:
                    run[3 if stubbed else 2].append(time.perf_counter() - start)
                if not stubbed:
                    run[1] = logits
    stub(False)
part = "the middle blocks" if middle_only else "attention"
for spec, run in runs.items():
    whole, without = statistics.median(run[2]) * 1e3, statistics.median(run[3]) * 1e3
    print(f"{spec} at {length} tokens: {whole:.1f} ms/step, {without:.1f} without {part}: {part} {whole - without:.1f}")
