"""The cost task: cache bytes, prefill time, decode time per token, peak memory.

Each (method spec, repeat) runs in a fresh subprocess, so one method's peak memory can never hide
another's; repeats are interleaved across methods (full, A, B, full, A, B, ...) so slow phases of a
shared machine hit every method alike; times are reported as ratios to ``full`` of the same repeat
and summarised by medians.

With ``interleave`` (``kvshrink eval cost --interleave``) each repeat is one subprocess holding every
method's cache: they are prefilled one after another, then decoded one step of each in turn, so a
machine whose speed drifts by tens of percent from minute to minute still gives steady ratios (the
methods share every slow second). Peak memory is not measured then (one process holds every cache).

Run as ``python -m kvshrink.eval.cost '<json job>'``; it prints one ``KVSHRINK_COST {json}`` line per
length (per method and length with ``interleave``).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from . import memory
from .backend import KVShrinkBackend, cache_figures
from .engine import _step, _sync, greedy_decode, model_device, prefill

MARK = "KVSHRINK_COST "


def _setup(job: dict):
    import torch

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    backend = KVShrinkBackend(job.get("model"), job.get("device"), job.get("dtype"))
    model, tokenizer = backend.load_model()
    from .tasks import TokenCorpus

    return backend, model, TokenCorpus(tokenizer)


def _row(model, cache, length: int, prompt: list[int], prefill_s: float, decode_ms: float | None, decoded: int
         ) -> dict:
    return {
        "length": length,
        "device": str(model_device(model)),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "actual_tokens": len(prompt),
        **cache_figures(cache),
        "prefill_s": prefill_s,
        "decode_ms_per_token": decode_ms,
        "decoded_tokens": decoded,
    }


def measure(job: dict) -> None:
    import torch

    backend, model, corpus = _setup(job)
    device = model_device(model)
    for length in job["lengths"]:
        prompt = corpus.ids[:length]
        cache = backend.make_cache(job["spec"], model)
        torch.manual_seed(int(job.get("seed", 0)))
        before = memory.current_rss_mb()
        reset_ok = memory.reset_peak_rss()
        memory.reset_device_peak(device)
        result = greedy_decode(model, cache, prompt, int(job["new_tokens"]))
        peak = memory.peak_rss_mb()
        row = {
            **_row(model, cache, length, prompt, result.prefill_s, result.decode_ms_per_token, len(result.tokens)),
            "peak_rss_mb": peak,
            "peak_rss_delta_mb": (peak - before) if (reset_ok and before is not None) else None,
            "peak_rss_reset": reset_ok,
            "peak_device_mb": memory.device_peak_mb(device),
        }
        del cache
        print(MARK + json.dumps(row), flush=True)


def prefill_order(specs: list[str], repeat: int) -> list[str]:
    """The order an interleaved job prefills ``specs`` in: rotated by ``repeat``, so that over repeats each method
    is prefilled first (a cold start) and last (beside the most memory) in turn."""
    turn = repeat % len(specs)
    return specs[turn:] + specs[:turn]


def measure_interleaved(job: dict) -> None:
    """Every spec of ``job["specs"]`` at each length in one process: the caches prefilled one after another (from
    the ``job["repeat"]``-th spec on, so repeats share out the first and last places), then greedy-decoded one step
    of each in turn (``new_tokens`` tokens each, as `greedy_decode` counts them);
    a method's decode time is the sum of its own steps. One row per spec and length, no peak memory."""
    import torch

    backend, model, corpus = _setup(job)
    device = model_device(model)
    steps = int(job["new_tokens"]) - 1          # forwards after the prefill, as greedy_decode makes them
    order = prefill_order(job["specs"], int(job.get("repeat", 0)))
    for length in job["lengths"]:
        prompt = corpus.ids[:length]
        runs = {}
        for spec in order:
            torch.manual_seed(int(job.get("seed", 0)))
            cache = backend.make_cache(spec, model)
            logits, prefill_s = prefill(model, cache, prompt)
            runs[spec] = {"cache": cache, "logits": logits, "prefill_s": prefill_s, "decode_s": 0.0}
        with torch.no_grad():
            for _ in range(steps):
                for run in runs.values():
                    ids = torch.tensor([[int(run["logits"][0].argmax())]], device=device)
                    _sync(device)
                    start = time.perf_counter()
                    run["logits"] = _step(model, run["cache"], ids)
                    _sync(device)
                    run["decode_s"] += time.perf_counter() - start
        for spec in job["specs"]:                # in the job's order: full's row first, the others' reference
            run = runs[spec]
            decode_ms = 1000 * run["decode_s"] / steps if steps > 0 else None
            row = {"spec": spec, **_row(model, run["cache"], length, prompt, run["prefill_s"], decode_ms, steps + 1),
                   "peak_rss_mb": None, "peak_rss_delta_mb": None, "peak_rss_reset": False, "peak_device_mb": None,
                   "interleaved": True}
            print(MARK + json.dumps(row), flush=True)
        del runs


def run_job(job: dict, timeout: float | None = None) -> list[dict]:
    """Run one measuring subprocess and return its rows (one per length)."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "kvshrink.eval.cost", json.dumps(job)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    rows = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    specs = job["specs"] if "specs" in job else [job["spec"]]
    if proc.returncode != 0 or len(rows) != len(job["lengths"]) * len(specs):
        tail = (proc.stderr or "")[-2000:]
        raise RuntimeError(f"cost measurement for {', '.join(map(repr, specs))} failed (exit {proc.returncode}):"
                           f"\n{tail}")
    return rows


def paired_ratio(value, reference) -> float | None:
    if value is None or reference in (None, 0):
        return None
    return value / reference


if __name__ == "__main__":
    _job = json.loads(sys.argv[1])
    (measure_interleaved if "specs" in _job else measure)(_job)
