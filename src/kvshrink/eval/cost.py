"""The cost task: cache bytes, prefill time, decode time per token, peak memory.

Each (method spec, repeat) runs in a fresh subprocess, so one method's peak memory can never hide
another's; repeats are interleaved across methods (full, A, B, full, A, B, ...) so slow phases of a
shared machine hit every method alike; times are reported as ratios to ``full`` of the same repeat
and summarised by medians.

Run as ``python -m kvshrink.eval.cost '<json job>'``; it prints one ``KVSHRINK_COST {json}`` line per
length.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from . import memory
from .backend import KVShrinkBackend, cache_figures
from .engine import greedy_decode, model_device

MARK = "KVSHRINK_COST "


def measure(job: dict) -> None:
    import torch

    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    backend = KVShrinkBackend(job.get("model"), job.get("device"), job.get("dtype"))
    model, tokenizer = backend.load_model()
    from .tasks import TokenCorpus

    corpus = TokenCorpus(tokenizer)
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
            "length": length,
            "device": str(device),
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "actual_tokens": len(prompt),
            **cache_figures(cache),
            "prefill_s": result.prefill_s,
            "decode_ms_per_token": result.decode_ms_per_token,
            "decoded_tokens": len(result.tokens),
            "peak_rss_mb": peak,
            "peak_rss_delta_mb": (peak - before) if (reset_ok and before is not None) else None,
            "peak_rss_reset": reset_ok,
            "peak_device_mb": memory.device_peak_mb(device),
        }
        del cache
        print(MARK + json.dumps(row), flush=True)


def run_job(job: dict, timeout: float | None = None) -> list[dict]:
    """Run one measuring subprocess and return its rows (one per length)."""
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    proc = subprocess.run([sys.executable, "-m", "kvshrink.eval.cost", json.dumps(job)],
                          capture_output=True, text=True, env=env, timeout=timeout)
    rows = [json.loads(line[len(MARK):]) for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or len(rows) != len(job["lengths"]):
        tail = (proc.stderr or "")[-2000:]
        raise RuntimeError(f"cost measurement for {job['spec']!r} failed (exit {proc.returncode}):\n{tail}")
    return rows


def paired_ratio(value, reference) -> float | None:
    if value is None or reference in (None, 0):
        return None
    return value / reference


if __name__ == "__main__":
    measure(json.loads(sys.argv[1]))
