"""Decode benchmark at Llama-3.1-8B's shape with RANDOM weights (no download): speed and bytes only.

For each context length (default 8K and 32K tokens) and method (a stock DynamicCache with SDPA, then
kvshrink's full, shard and lrqk with top_k 2048): prefill time, decode ms/token (median over --steps
steps after --warmup, torch.cuda.synchronize around each step) and ``cache.nbytes()``; printed as a
table and written as JSON (--json). Random weights produce meaningless text: nothing here measures
quality. Usage (from the repository, kvshrink need not be installed):

    PYTHONPATH=src python scripts/gpu_bench.py [--lengths 8192,32768] [--json gpu_bench.json]
    PYTHONPATH=src python scripts/gpu_bench.py --tiny      # CPU, tiny shapes, seconds (a test runs it)

``KVSHRINK_BENCH_TINY=1`` is the same as ``--tiny``. Each method runs in a try block: an error (e.g. a
method without a GPU path yet, out of memory) is recorded in its row and the bench goes on; rows past
``--budget-s`` seconds are skipped so a GPU session's time is bounded.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

MINIMUM = {"torch": (2, 11), "transformers": (5, 17), "triton": (3, 6)}
NOTE = ("NOTE: random weights (a LlamaConfig built on the device, nothing downloaded): the text is "
        "meaningless, so this measures speed and bytes only, not quality.")


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def versions() -> dict[str, str | None]:
    import torch
    import transformers

    found: dict[str, str | None] = {"python": platform.python_version(), "torch": torch.__version__,
                                    "transformers": transformers.__version__, "triton": None,
                                    "cuda": torch.version.cuda,
                                    "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    try:
        import triton

        found["triton"] = triton.__version__
    except Exception as exc:  # noqa: BLE001 - reported, not fatal
        found["triton"] = None
        found["triton_error"] = f"{type(exc).__name__}: {exc}"
    return found


def check_versions(found: dict) -> list[str]:
    warnings = []
    for name, low in MINIMUM.items():
        v = found.get(name)
        if v is None:
            warnings.append(f"{name} is missing (need >= {'.'.join(map(str, low))})")
        elif _version_tuple(v) < low:
            warnings.append(f"{name} {v} is older than {'.'.join(map(str, low))}")
    return warnings


def build_model(shape: dict, device: str, dtype):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**shape, torch_dtype=dtype, attn_implementation="sdpa",
                         pad_token_id=0, bos_token_id=1, eos_token_id=2)
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(before)
    return model.eval()


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_one(model, method: str, options: dict, length: int, steps: int, warmup: int, device: str, seed: int) -> dict:
    import torch
    from transformers import DynamicCache

    import kvshrink

    row = {"method": method, "options": options, "tokens": length, "prefill_s": None, "decode_ms_per_token": None,
           "decode_ms_all": [], "nbytes": None, "fp16_nbytes": None, "error": None}
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (1, length), generator=g).to(device)
    cache = None
    try:
        cache = DynamicCache(config=model.config) if method == "dynamic" else kvshrink.make_cache(method, model, **options)
        with torch.no_grad():
            _sync(device)
            t = time.perf_counter()
            out = model(input_ids=ids, past_key_values=cache, logits_to_keep=1)
            nxt = out.logits[:, -1:].argmax(-1)
            _sync(device)
            row["prefill_s"] = time.perf_counter() - t
            times = []
            for i in range(warmup + steps):
                _sync(device)
                t = time.perf_counter()
                out = model(input_ids=nxt, past_key_values=cache, logits_to_keep=1)
                nxt = out.logits[:, -1:].argmax(-1)
                _sync(device)
                if i >= warmup:
                    times.append((time.perf_counter() - t) * 1000)
        row["decode_ms_all"] = [round(x, 3) for x in times]
        row["decode_ms_per_token"] = statistics.median(times)
        try:  # aten ops, launches and host syncs of one more decode step (kvshrink.kernels.counting)
            from kvshrink.kernels.counting import count_decode_step

            count = count_decode_step(model, cache, nxt, cuda_sync_debug=device.startswith("cuda"), logits_to_keep=1)
            row["counts"] = {**count.row(), "cuda_sync_warnings": count.cuda_sync_warnings,
                             "layer_sync_ops": count.layer_sync_ops, "step_sync_ops": count.step_sync_ops}
        except Exception as exc:  # noqa: BLE001
            row["counts"] = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        if method == "dynamic":
            row["nbytes"] = sum(t.numel() * t.element_size() for layer in cache.layers
                                for t in (layer.keys, layer.values) if t is not None)
        else:
            row["nbytes"] = cache.nbytes()
            row["fp16_nbytes"] = cache.fp16_nbytes()
    except Exception as exc:  # noqa: BLE001 - recorded in the row, the bench goes on
        row["error"] = f"{type(exc).__name__}: {str(exc)[:500]}"
        row["traceback"] = traceback.format_exc()[-2000:]
    finally:
        if cache is not None and hasattr(cache, "close"):
            try:
                cache.close()
            except Exception:  # noqa: BLE001
                pass
        del cache
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny shapes (seconds): checks the script runs")
    parser.add_argument("--lengths", default=None, help="context lengths, comma-separated (default 8192,32768)")
    parser.add_argument("--methods", default="dynamic,full,shard,lrqk", help="dynamic (stock), full, shard, lrqk, ...")
    parser.add_argument("--top-k", type=int, default=None, help="lrqk's top_k (default 2048; tiny 16)")
    parser.add_argument("--steps", type=int, default=None, help="decode steps timed (default 32; tiny 3)")
    parser.add_argument("--warmup", type=int, default=None, help="decode steps before timing (default 4; tiny 1)")
    parser.add_argument("--vocab", type=int, default=32000, help="vocabulary size (Llama-3.1: 128256)")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="skip rows started after this many seconds")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--force-gpu-path", action="store_true",
                        help="take kvshrink's GPU path on CPU too (Triton kernels interpreted: slow; counts as on a GPU)")
    args = parser.parse_args(argv)
    tiny = args.tiny or os.environ.get("KVSHRINK_BENCH_TINY", "") not in ("", "0")

    import torch

    start = time.perf_counter()
    found = versions()
    print("versions: " + ", ".join(f"{k} {v}" for k, v in found.items()), flush=True)
    warnings = check_versions(found)
    for w in warnings:
        print(f"WARNING: {w}", flush=True)
    print(NOTE, flush=True)

    if tiny:
        shape = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=4096)
        lengths = [int(x) for x in (args.lengths or "96,160").split(",")]
        device = args.device or "cpu"
        torch.set_num_threads(1)  # tiny shapes: threads only add overhead
        steps, warmup, top_k = args.steps or 3, args.warmup if args.warmup is not None else 1, args.top_k or 16
        method_options = {"lrqk": {"top_k": top_k, "window": 16}}
    else:
        lengths = [int(x) for x in (args.lengths or "8192,32768").split(",")]
        shape = dict(num_hidden_layers=args.layers, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=args.vocab,
                     max_position_embeddings=max(lengths) + 1024)
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        steps, warmup = args.steps or 32, args.warmup if args.warmup is not None else 4
        method_options = {"lrqk": {"top_k": args.top_k or 2048}}
    dtype = getattr(torch, args.dtype)
    if device.startswith("cuda") and not torch.cuda.is_available():
        print("ERROR: no CUDA device (use --tiny to check the script on CPU)", flush=True)
        return 2
    print(f"model: Llama shape {shape}, {args.dtype}, device {device}; lengths {lengths}; "
          f"{steps} timed decode steps after {warmup}", flush=True)

    t = time.perf_counter()
    torch.manual_seed(0)
    model = build_model(shape, device, dtype)
    _sync(device)
    print(f"built the random model in {time.perf_counter() - t:.1f}s "
          f"({sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters)", flush=True)

    methods = [m for m in args.methods.split(",") if m]
    results = []
    forced = None
    if args.force_gpu_path:
        from kvshrink.kernels.backend import force_gpu_path

        forced = force_gpu_path()  # held for the rest of this run (a dropped context manager would exit)
        forced.__enter__()
    for length in lengths:
        for method in methods:
            options = method_options.get(method, {})
            if time.perf_counter() - start > args.budget_s:
                row = {"method": method, "options": options, "tokens": length, "prefill_s": None,
                       "decode_ms_per_token": None, "nbytes": None, "fp16_nbytes": None,
                       "error": f"skipped: past the time budget of {args.budget_s:.0f}s"}
            else:
                row = run_one(model, method, options, length, steps, warmup, device, seed=length)
            results.append(row)
            _print_row(row)
            _write(args.json, found, warnings, device, args.dtype, shape, lengths, steps, warmup, tiny, start, results)

    print("\n" + NOTE)
    print(f"{'tokens':>7} {'method':<10} {'prefill s':>9} {'decode ms/tok':>13} {'MiB held':>10} {'fp16 MiB':>9} "
          f"{'launches/layer':>15} {'syncs/layer':>12} {'syncs/step':>10}  error")
    for r in results:
        print(_format(r))
    if args.json:
        _write(args.json, found, warnings, device, args.dtype, shape, lengths, steps, warmup, tiny, start, results)
        print(f"wrote {args.json}")
    if forced is not None:
        forced.__exit__(None, None, None)
    return 0


def _write(path, found, warnings, device, dtype, shape, lengths, steps, warmup, tiny, start, results) -> None:
    """The JSON report, rewritten after every row (a run cut short by a timeout keeps what it measured)."""
    if not path:
        return
    from kvshrink.kernels.backend import gpu_path_forced

    report = {"versions": found, "version_warnings": warnings, "gpu_path_forced": gpu_path_forced(), "note": NOTE, "device": device, "dtype": dtype,
              "shape": shape, "lengths": lengths, "steps": steps, "warmup": warmup, "tiny": tiny,
              "elapsed_s": time.perf_counter() - start, "results": results}
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _format(r: dict) -> str:
    def num(x, fmt):
        return format(x, fmt) if x is not None else "-"

    mib = lambda b: b / 2**20 if b is not None else None  # noqa: E731
    c = r.get("counts") or {}
    return (f"{r['tokens']:>7} {r['method']:<10} {num(r['prefill_s'], '9.2f')} {num(r['decode_ms_per_token'], '13.2f')} "
            f"{num(mib(r['nbytes']), '10.3f')} {num(mib(r.get('fp16_nbytes')), '9.3f')} "
            f"{num(c.get('launches/layer'), '15.1f')} {num(c.get('syncs/layer'), '12.2f')} {num(c.get('syncs/step'), '10d')}"
            f"  {r['error'] or ''}")


def _print_row(r: dict) -> None:
    print(_format(r), flush=True)


if __name__ == "__main__":
    sys.exit(main())
