"""How compressible is a saved cache file? Per kind of tensor: bytes, stdlib codecs, empirical entropy.

    python scripts/entropy_survey.py FILE.kvs          # a file written by `kvshrink compress` / cache.save
    python scripts/entropy_survey.py --prefill 2048 OUT.kvs   # first prefill a default Shard cache and save it
    python scripts/entropy_survey.py FILE.kvs --per-layer     # Shard's codes: zlib and entropy per layer
    python scripts/entropy_survey.py FILE.kvs --layouts       # codes and exact tokens: byte layouts x codecs

For each kind of tensor (labelled by where it sits in the cache: Shard's key codes, value codes, bases,
salient and exact tokens...) it prints its bytes and the size zlib -9, lzma -6/-9 and bz2 -9 give on
its stored bytes, and three order-0 empirical entropies (bits, as bytes): of the bytes; of the bytes
with one model per byte column (last dim); and, for Shard's bit-packed codes, of the unpacked symbols
with one model per PCA component (keys) or per value group (values). One torch thread.
"""
from __future__ import annotations

import argparse
import bz2
import json
import lzma
import math
import sys
import zlib
from collections import defaultdict

import numpy as np
import torch


def entropy_bits(symbols: np.ndarray, alphabet: int) -> float:
    """Order-0 empirical entropy of ``symbols`` (1-D ints) times their count, in bits."""
    if symbols.size == 0:
        return 0.0
    counts = np.bincount(symbols.ravel(), minlength=alphabet).astype(np.float64)
    p = counts[counts > 0] / symbols.size
    return float(-(counts[counts > 0] * np.log2(p)).sum())


def column_entropy_bits(rows: np.ndarray, alphabet: int) -> float:
    """Sum over columns of ``rows [N, C]`` of each column's order-0 entropy (one model per column)."""
    return sum(entropy_bits(rows[:, c], alphabet) for c in range(rows.shape[1]))


def unpack_rows(packed: np.ndarray, bits: int, n: int) -> np.ndarray:
    from kvshrink.codecs.bitpack import unpack_bits

    return unpack_bits(torch.from_numpy(packed), bits, n).numpy()


def labelled_tensors(structure, out: dict, cls: str = "", field: str = "") -> None:
    """``out[tensor name] = (class that holds it, field, the holder's state)``, walking the saved structure."""
    if isinstance(structure, list):
        for v in structure:
            labelled_tensors(v, out, cls, field)
        return
    if not isinstance(structure, dict):
        return
    if "tensor" in structure:
        out.setdefault(structure["tensor"], (cls, field, None))
        return
    if "obj" in structure:
        state = structure["state"]
        name = structure["obj"].rsplit(":", 1)[1]
        if "dict" in state:
            fields = {k: v for k, v in state["dict"]}
            for k, v in state["dict"]:
                labelled_tensors(v, out, name, k)
                if isinstance(v, dict) and "tensor" in v:
                    out[v["tensor"]] = (name, k, fields)
        return
    for key in ("list", "tuple"):
        if key in structure:
            labelled_tensors(structure[key], out, cls, field)
    if "dict" in structure:
        for k, v in structure["dict"]:
            labelled_tensors(v, out, cls, k if isinstance(k, str) else field)


def plain(data):
    """A saved structure value without its type tags (lists of runs, ints)."""
    if isinstance(data, dict):
        for key in ("list", "tuple"):
            if key in data:
                return [plain(v) for v in data[key]]
    return data


def symbol_entropy(label: tuple, t: torch.Tensor, tensors: dict, meta: dict) -> float | None:
    """Bits of the unpacked symbols of Shard's packed codes, one model per component/group; else None."""
    cls, field, fields = label
    if t.dtype != torch.uint8 or fields is None:
        return None
    arr = t.numpy()
    if cls == "PCACode" and field == "codes":
        rows = arr.reshape(-1, arr.shape[-1])
        total = 0.0
        for bits, a, b, byte_a, byte_b in plain(fields["runs"]):
            total += column_entropy_bits(unpack_rows(np.ascontiguousarray(rows[:, byte_a:byte_b]), bits, b - a), 1 << bits)
        return total
    if cls == "MiddleBlock" and field == "v_codes":
        entries = tensors[fields["v_codebook"]["tensor"]].shape[0]
        group = tensors[fields["v_codebook"]["tensor"]].shape[1]
        head_dim = tensors[fields["v_scale"]["tensor"]].shape[-1]
        bits = int(math.log2(entries))
        rows = arr.reshape(-1, arr.shape[-1])
        return column_entropy_bits(unpack_rows(rows, bits, head_dim // group), entries)
    return None


def tensor_names(structure) -> list[str]:
    """Every tensor name under a saved structure."""
    if isinstance(structure, dict):
        if "tensor" in structure:
            return [structure["tensor"]]
        return [n for v in structure.values() for n in tensor_names(v)]
    if isinstance(structure, list):
        return [n for v in structure for n in tensor_names(v)]
    return []


def layer_of_tensors(meta: dict) -> dict[str, int]:
    """Tensor name -> index of the cache layer holding it."""
    for key, value in meta["structure"]["dict"]:
        if key == "layers":
            return {n: i for i, layer in enumerate(value["list"]) for n in tensor_names(layer)}
    return {}


def read_file(path: str) -> tuple[dict, dict, dict]:
    """``(metadata, tensors, labels)`` of a cache file saved without entropy coding."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    with safe_open(path, framework="pt") as fh:
        meta = json.loads(fh.metadata()["kvshrink"])
    if meta.get("encodings"):
        sys.exit(f"{path} is entropy coded: survey a file saved with entropy=False (kvshrink compress --no-entropy)")
    labels: dict = {}
    labelled_tensors(meta["structure"], labels)
    return meta, load_file(path), labels


def per_layer(path: str) -> None:
    """Key and value codes per layer: zlib -9 and the per-component symbol entropy, as fractions of their bytes."""
    meta, tensors, labels = read_file(path)
    layer_of = layer_of_tensors(meta)
    acc: dict = defaultdict(lambda: [0, 0, 0.0])
    for name, t in tensors.items():
        label = labels.get(name, ("", "", None))
        bits = symbol_entropy(label, t, tensors, meta)
        if bits is None:
            continue
        a = acc[(layer_of[name], label[1])]
        a[0] += t.numel()
        a[1] += len(zlib.compress(t.numpy().tobytes(), 9))
        a[2] += bits / 8
    for (layer, field), (raw, z, h) in sorted(acc.items()):
        print(f"layer {layer:2d} {field:8s} bytes {raw:10,d} zlib9 {z / raw:.3f} H(symbols) {h / raw:.3f}")


def _lzma_raw(data: bytes, lc: int = 3) -> int:
    return len(lzma.compress(data, format=lzma.FORMAT_RAW, filters=[{"id": lzma.FILTER_LZMA2, "preset": 6, "lc": lc}]))


def layouts(path: str) -> None:
    """Sizes, as fractions of the bytes, of Shard's key codes, value codes and fp16 exact tokens under
    byte layouts (row-major as stored, column-major, unpacked symbols, byte planes) and codecs."""
    meta, tensors, labels = read_file(path)
    res: dict = defaultdict(lambda: defaultdict(int))
    for name, t in tensors.items():
        cls, field, fields = labels.get(name, ("?", "?", None))
        if cls == "PCACode" and field == "codes":
            kind, rows = "key codes", t.numpy().reshape(-1, t.shape[-1])
            sym = np.concatenate([unpack_rows(np.ascontiguousarray(rows[:, a2:b2]), bits, b - a)
                                  for bits, a, b, a2, b2 in plain(fields["runs"])], axis=1).astype(np.uint8)
        elif cls == "MiddleBlock" and field == "v_codes":
            kind, rows = "value codes", t.numpy().reshape(-1, t.shape[-1])
            sym = None
        elif t.dtype == torch.float16 and cls in ("ExactStore", "SalientTokens"):
            kind, rows = "fp16 tokens", t.numpy().reshape(-1, t.shape[-1]).view(np.uint8)
            sym = None
        else:
            continue
        r = res[kind]
        layouts = {"as stored": rows.tobytes(), "column-major": np.ascontiguousarray(rows.T).tobytes()}
        if sym is not None:
            layouts["symbols, column-major"] = np.ascontiguousarray(sym.T).tobytes()
        if kind == "fp16 tokens":
            layouts["byte planes"] = np.concatenate([rows[:, 0::2].ravel(), rows[:, 1::2].ravel()]).tobytes()
            layouts["byte planes, column-major"] = np.concatenate([rows[:, 0::2].T.ravel(), rows[:, 1::2].T.ravel()]).tobytes()
        r["bytes"] += rows.nbytes
        for layout, data in layouts.items():
            r[f"zlib9 {layout}"] += len(zlib.compress(data, 9))
            r[f"lzma6 {layout}"] += _lzma_raw(data)
    for kind, r in res.items():
        print(kind, f"{r['bytes']:,} bytes")
        for k, v in r.items():
            if k != "bytes":
                print(f"  {k:36s} {v:12,d} {v / r['bytes']:.4f}")


def survey(path: str) -> None:
    meta, tensors, labels = read_file(path)
    kinds = defaultdict(lambda: defaultdict(float))
    for name, t in tensors.items():
        cls, field, _ = labels.get(name, ("?", "?", None))
        raw = t.reshape(-1).view(torch.uint8).numpy()
        k = kinds[f"{cls}.{field} {str(t.dtype).removeprefix('torch.')}"]
        k["tensors"] += 1
        k["bytes"] += raw.size
        data = raw.tobytes()
        k["zlib9"] += len(zlib.compress(data, 9))
        k["lzma6"] += len(lzma.compress(data, preset=6))
        k["lzma9"] += len(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
        k["bz2"] += len(bz2.compress(data, 9))
        k["H(bytes)"] += entropy_bits(raw, 256) / 8
        cols = t.reshape(-1, t.shape[-1]).view(torch.uint8).numpy() if t.dim() else raw[None]
        k["H(byte col)"] += column_entropy_bits(cols, 256) / 8
        sym = symbol_entropy(labels.get(name, ("", "", None)), t, tensors, meta)
        k["H(symbols)"] += (sym if sym is not None else entropy_bits(raw, 256)) / 8
    columns = ["tensors", "bytes", "zlib9", "lzma6", "lzma9", "bz2", "H(bytes)", "H(byte col)", "H(symbols)"]
    total = defaultdict(float)
    print(f"{path}: {meta['method']} {meta['tokens']} tokens, file {sum(t.numel() * t.element_size() for t in tensors.values()):,} tensor bytes")
    print(f"| kind | " + " | ".join(columns) + " |")
    print("|" + " --- |" * (len(columns) + 1))
    for kind in sorted(kinds, key=lambda k: -kinds[k]["bytes"]):
        row = kinds[kind]
        for c in columns:
            total[c] += row[c]
        print(f"| {kind} | " + " | ".join(f"{row[c]:,.0f}" for c in columns) + " |")
    print("| total | " + " | ".join(f"{total[c]:,.0f}" for c in columns) + " |")


def prefill_and_save(tokens: int, out: str) -> None:
    import kvshrink
    from kvshrink.cli import document_prompt

    model, tokenizer = kvshrink.load_model()
    prefix, _ = document_prompt(tokenizer, open("examples/document/essays-8k.txt").read())
    cache = kvshrink.make_cache("shard", model)
    with torch.no_grad():
        model(input_ids=torch.tensor([prefix[:tokens]]), past_key_values=cache)
    cache.save(out, entropy=False)
    print(f"saved {cache.summary()} to {out}", file=sys.stderr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path")
    parser.add_argument("--prefill", type=int, default=0, help="first prefill this many document tokens and save")
    parser.add_argument("--per-layer", action="store_true", help="Shard's codes per layer instead")
    parser.add_argument("--layouts", action="store_true", help="byte layouts x codecs instead")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.prefill:
        prefill_and_save(args.prefill, args.path)
    if args.per_layer:
        per_layer(args.path)
    elif args.layouts:
        layouts(args.path)
    else:
        survey(args.path)


if __name__ == "__main__":
    main()
