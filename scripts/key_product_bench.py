"""Shard's key rebuild (the scaled bases times a block's decoded coefficients, ``[S, W, r] @ [S, r, n]``) by
torch's BLAS against numba loops over L1-sized tiles of 64 tokens (what a one-call fused block kernel would run),
on the shapes of a real 2K prompt's first middle block. Usage:
    PYTHONPATH=src .venv/bin/python scripts/key_product_bench.py [LENGTH]
(docs/results.md, "Session 30": the BLAS product was 2-2.5x faster, so the fast path keeps it.)"""
import sys, time
import numpy as np, torch
from numba import njit
from kvshrink.codecs.fused import _FASTMATH as F
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import prefill
from kvshrink.eval.tasks import TokenCorpus

T = 64


@njit(fastmath=F)
def tiles_plain(basis_t, levels_t, keys):
    # per tile and scope: keys[c, :] += basis[c, k] * levels_t[k, :] over the rank (the loop over tokens vectorises)
    n_scopes, width, rank = basis_t.shape
    for t0 in range(0, levels_t.shape[2], T):
        for s in range(n_scopes):
            for c in range(width):
                row = keys[c]
                row[:] = 0.0
                for k in range(rank):
                    bk, lk = basis_t[s, c, k], levels_t[s, k, t0:t0 + T]
                    for i in range(T):
                        row[i] += bk * lk[i]


@njit(fastmath=F)
def tiles_4x4(basis_t, levels_t, keys):
    # the same, four channels and four ranks at a time (fewer loads and stores per multiply-add)
    n_scopes, width, rank = basis_t.shape
    for t0 in range(0, levels_t.shape[2], T):
        for s in range(n_scopes):
            b = basis_t[s]
            for c in range(0, width, 4):
                r0, r1, r2, r3 = keys[c], keys[c + 1], keys[c + 2], keys[c + 3]
                r0[:] = 0.0; r1[:] = 0.0; r2[:] = 0.0; r3[:] = 0.0
                for k in range(0, rank - rank % 4, 4):
                    l0, l1 = levels_t[s, k, t0:t0 + T], levels_t[s, k + 1, t0:t0 + T]
                    l2, l3 = levels_t[s, k + 2, t0:t0 + T], levels_t[s, k + 3, t0:t0 + T]
                    for i in range(T):
                        x0, x1, x2, x3 = l0[i], l1[i], l2[i], l3[i]
                        r0[i] += b[c, k] * x0 + b[c, k + 1] * x1 + b[c, k + 2] * x2 + b[c, k + 3] * x3
                        r1[i] += b[c + 1, k] * x0 + b[c + 1, k + 1] * x1 + b[c + 1, k + 2] * x2 + b[c + 1, k + 3] * x3
                        r2[i] += b[c + 2, k] * x0 + b[c + 2, k + 1] * x1 + b[c + 2, k + 2] * x2 + b[c + 2, k + 3] * x3
                        r3[i] += b[c + 3, k] * x0 + b[c + 3, k + 1] * x1 + b[c + 3, k + 2] * x2 + b[c + 3, k + 3] * x3


def median_us(f, repeats=100):
    f()
    times = []
    for _ in range(repeats):
        t = time.perf_counter(); f(); times.append(time.perf_counter() - t)
    return 1e6 * float(np.median(times))


length = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
cache = backend.make_cache("shard", model)
prefill(model, cache, TokenCorpus(tokenizer).ids[:length])
layer = cache.layers[0]
block = layer.middle[0]
basis_t = layer.key_factors(block).scaled_bases_t(block.keys).contiguous()   # [S, W, r]
n_scopes, width, rank = basis_t.shape
n = block.n // T * T
levels = torch.randn(n_scopes, rank, n)
keys = torch.empty(n_scopes, width, n)
print(f"layer 0, first block: {n_scopes} scopes, W={width}, rank {rank}, {n} tokens "
      f"({n_scopes * width * rank * n / 1e6:.1f} M multiply-adds)")
for threads in (1, 2):
    torch.set_num_threads(threads)
    print(f"torch.bmm, {threads} thread(s): {median_us(lambda: torch.bmm(basis_t, levels, out=keys)):7.1f} us")
tile = np.empty((width, T), np.float32)
for kernel in (tiles_plain, tiles_4x4):
    print(f"numba {kernel.__name__}, 1 thread: {median_us(lambda: kernel(basis_t.numpy(), levels.numpy(), tile)):7.1f} us")
