"""Where a prefill's time goes: one prompt of LENGTH essay tokens prefilled with SPEC (after one warm-up prefill),
under cProfile, the kvshrink functions by cumulative time; `full`'s prefill time printed alongside. Usage:
PYTHONPATH=src .venv/bin/python scripts/prefill_profile.py THREADS LENGTH SPEC [TOP]
(docs/results.md, "Session 19"; `kvshrink eval cost` is the benchmark, this locates costs)."""
import cProfile
import pstats
import sys
import time

import torch

import kvshrink
from kvshrink.cache.registry import parse_method_spec
from kvshrink.eval.data import essay_corpus

threads, length, spec = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
top = int(sys.argv[4]) if len(sys.argv) > 4 else 25
torch.set_num_threads(threads)
model, tok = kvshrink.load_model()
ids = tok(essay_corpus(), return_tensors="pt").input_ids[:, :length]


def prefill(name: str, options: dict, profile: cProfile.Profile | None = None) -> float:
    cache = kvshrink.make_cache(name, model, **options)
    start = time.perf_counter()
    if profile is not None:
        profile.enable()
    with torch.no_grad():
        model(ids, past_key_values=cache, logits_to_keep=1)
    if profile is not None:
        profile.disable()
    return time.perf_counter() - start


prefill("full", {})
print(f"full prefill of {ids.shape[1]} tokens: {prefill('full', {}):.2f} s")
name, options = parse_method_spec(spec)
prefill(name, options)
profile = cProfile.Profile()
print(f"{spec} prefill (profiled): {prefill(name, options, profile):.2f} s")
pstats.Stats(profile).sort_stats("cumulative").print_stats("kvshrink", top)
