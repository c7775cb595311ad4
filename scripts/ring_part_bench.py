"""Microbenchmark of Shard's ring part of a decode step (`fused.StepParts.ring`: LIVE float16 rows read in place
from the ring's words and the step's float32 token, 9 query heads over 3 KV heads of 64, SmolLM2's shape): best of
five means over 1,000 calls, in us per layer. Usage:
    PYTHONPATH=src .venv/bin/python scripts/ring_part_bench.py LIVE [LABEL]
(docs/results.md, "Session 25": run once with PYTHONPATH pointing at a worktree of an older commit to compare)."""
import sys
import time

import torch

from kvshrink.cache.attention import group_queries
from kvshrink.codecs import fused

torch.set_num_threads(2)
live = int(sys.argv[1])
label = sys.argv[2] if len(sys.argv) > 2 else ""
g = torch.Generator().manual_seed(0)
kv = (torch.randn(2, 1, 3, max(live, 80), 64, generator=g) * 0.5).half()
words = fused.ring_words(kv)
query = group_queries(torch.randn(1, 9, 1, 64, generator=g), 3)
token = torch.randn(2, 1, 3, 1, 64, generator=g)
means = []
for _ in range(5):
    start = time.perf_counter()
    for _ in range(1000):
        parts = fused.StepParts(query, 0.125, 1)
        parts.ring(words, live, torch.float16, (token[0], token[1]))
    means.append((time.perf_counter() - start) / 1000 * 1e6)
print(f"{label} ring part, {live} live rows: {min(means):.1f} us per layer (best of 5)".strip())
