"""Bytes on disk, bits per element and save/load time of a cache file with and without entropy coding.

    python scripts/file_codec_bench.py FILE.kvs [--out-dir DIR] [--repeats 3]

Loads FILE.kvs (written by `kvshrink compress`, either way) with the embedded model, saves it with
``entropy=False`` and ``entropy=True`` into DIR, and for each prints: bytes on disk, ratio to the fp16
K/V bytes, bits per element of Shard's key codes and value codes (stored bits / coded K or V elements),
save seconds and load seconds (best of --repeats; `load_cache`, which checks and decodes). One torch thread.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from entropy_survey import labelled_tensors  # noqa: E402


def code_bits_per_element(path: Path) -> dict[str, float]:
    """Stored bits per coded element of Shard's key codes (`PCACode.codes`) and value codes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as fh:
        meta = json.loads(fh.metadata()["kvshrink"])
        stored = {name: fh.get_slice(name).get_shape() for name in fh.keys()}
        dtypes = {name: fh.get_slice(name).get_dtype() for name in fh.keys()}
    labels: dict = {}
    labelled_tensors(meta["structure"], labels)
    encodings = meta.get("encodings", {})
    bits = {"key codes": [0, 0], "value codes": [0, 0]}
    for name, (cls, field, fields) in labels.items():
        shape = encodings.get(name, {}).get("shape", stored[name])
        stored_bytes = _numel(stored[name]) * (1 if name in encodings else _itemsize(dtypes[name]))
        if cls == "PCACode" and field == "codes":
            dim = _shape_of(fields["mean"], encodings, stored)[-1]
            kind, elements = "key codes", _numel(shape[:-1]) * dim
        elif cls == "MiddleBlock" and field == "v_codes":
            dim = _shape_of(fields["v_scale"], encodings, stored)[-1]
            kind, elements = "value codes", _numel(shape[:-1]) * dim
        else:
            continue
        bits[kind][0] += stored_bytes * 8
        bits[kind][1] += elements
    return {k: b / n for k, (b, n) in bits.items() if n}


def _shape_of(ref: dict, encodings: dict, stored: dict) -> list[int]:
    name = ref["tensor"]
    return encodings.get(name, {}).get("shape", stored[name])


def _numel(shape) -> int:
    out = 1
    for s in shape:
        out *= s
    return out


def _itemsize(dtype: str) -> int:
    return {"U8": 1, "I8": 1, "BOOL": 1, "F16": 2, "BF16": 2, "I16": 2, "F32": 4, "I32": 4, "F64": 8, "I64": 8}[dtype]


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    import kvshrink
    from kvshrink.cache.persist import load_cache, read_metadata, save_cache

    model, _ = kvshrink.load_model()
    meta = read_metadata(args.path)
    kvshrink.make_cache(meta["method"], model, **meta["options"])  # one-time set-up, outside the timings
    cache = load_cache(args.path, model)
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="kvs-bench-"))
    print(f"{args.path}: {cache.summary()}; in memory {cache.nbytes():,} bytes")
    for entropy in (False, True):
        out = out_dir / f"{Path(args.path).stem}.{'entropy' if entropy else 'plain'}.kvs"
        save_s = best_time(lambda: save_cache(cache, out, extra=meta["extra"], entropy=entropy), args.repeats)
        load_s = best_time(lambda: load_cache(out, model), args.repeats)
        size = out.stat().st_size
        bpe = ", ".join(f"{k} {v:.3f} bits/element" for k, v in code_bits_per_element(out).items())
        print(f"entropy={entropy}: {size:,} bytes on disk, ratio {cache.fp16_nbytes() / size:.3f}x to fp16; {bpe}; "
              f"save {save_s:.2f} s, load {load_s:.2f} s (best of {args.repeats}) -> {out}", flush=True)


if __name__ == "__main__":
    main()
