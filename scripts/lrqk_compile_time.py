"""Seconds LRQK's numba kernels take to compile on this machine: each warm-up timed with an empty numba cache (a fresh
temporary folder, removed after). Usage: PYTHONPATH=src .venv/bin/python scripts/lrqk_compile_time.py
(docs/results.md, "Session 27"); make_cache("lrqk") runs these warm-ups once per machine."""
import os, shutil, tempfile, time

folder = tempfile.mkdtemp(prefix="numba-cache-")
os.environ["NUMBA_CACHE_DIR"] = folder          # before numba is imported
import importlib

try:
    for module, name in (("kvshrink.codecs.lowrank_fused", "warm_up"), ("kvshrink.methods.lrqk_tiers", "warm_up_fill_planner"),
                         ("kvshrink.methods.lrqk_fused", "warm_up")):
        t = time.time()
        getattr(importlib.import_module(module), name)()
        print(f"{module}.{name}: {time.time() - t:.1f} s")
finally:
    shutil.rmtree(folder, ignore_errors=True)
