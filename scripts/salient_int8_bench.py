"""The CPU fast path's 8-bit salient attention (`fused._int8_attention`) alone: 3 KV heads x 3 query rows over N
token vectors per head (64 channels, one float16 step and zero point per vector), microseconds per call (1 thread).
Usage:
    PYTHONPATH=src .venv/bin/python scripts/salient_int8_bench.py [N]
(docs/results.md, "Session 24")."""
import sys
import time

import numpy as np
import torch

from kvshrink.codecs import fused
from kvshrink.codecs.groupwise import quantize_groups

torch.set_num_threads(1)
n = int(sys.argv[1]) if len(sys.argv) > 1 else 400
g = torch.Generator().manual_seed(0)
keys, values = (fused.int8_arrays(quantize_groups(torch.randn(1, 3, n, 64, generator=g).half(), 8, 64))
                for _ in range(2))
query = np.random.default_rng(0).random((1, 3, 3, 64), np.float32)
out, lse = np.empty((1, 3, 3, 64), np.float32), np.empty((1, 3, 3), np.float32)
split = np.float32(2.0 ** 13 + 1)        # rounded to float16's mantissa, as a float16 ring's tokens


def call():
    fused._int8_attention(query, *keys, *values, fused._HALF_POW2, split, np.float32(0.125), out, lse)


for _ in range(20):
    call()
start = time.perf_counter()
for _ in range(500):
    call()
print(f"8-bit salient attention, 3 heads x {n} tokens: {(time.perf_counter() - start) / 500 * 1e6:.1f} us")
