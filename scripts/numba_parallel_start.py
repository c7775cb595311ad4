"""What a numba parallel loop costs to start on each threading layer numba can load here (a two-iteration prange
over 1,000 numbers, microseconds per call). Usage: .venv/bin/python scripts/numba_parallel_start.py LAYER
with LAYER omp, tbb or workqueue, one per process (docs/results.md, "Session 20": why `codecs.fused` runs its
parallel kernels on OpenMP or TBB only)."""
import sys
import time

import numba
import numpy as np
import torch  # noqa: F401  (loaded first, as in kvshrink: its own OpenMP runtime is in the process)
from numba import njit, prange

numba.config.THREADING_LAYER = sys.argv[1]


@njit(parallel=True)
def halves(x):
    out = np.zeros(2)
    for t in prange(2):
        acc = 0.0
        for i in range(t, x.shape[0], 2):
            acc += x[i]
        out[t] = acc
    return out


x = np.ones(1000)
try:
    halves(x)
except Exception as exc:  # a layer this machine cannot load
    print(f"{sys.argv[1]}: not available ({type(exc).__name__})")
    sys.exit(0)
start = time.perf_counter()
for _ in range(2000):
    halves(x)
print(f"{numba.threading_layer()}: {(time.perf_counter() - start) / 2000 * 1e6:.1f} us per call")
