"""``kvshrink demo``: a needle-in-a-haystack prompt answered through the full cache and compressed ones."""

from __future__ import annotations

import time

import torch

from kvshrink.kernels.cpu import first_use


def _checked(specs: list[str]) -> list[str]:
    """``specs`` unchanged once every method and option is known (ValueError naming the bad one), so a
    typo fails before the model loads instead of silently running another method."""
    from kvshrink.cache.registry import get_method, parse_method_spec, resolve_options

    for spec in specs:
        name, options = parse_method_spec(spec)
        resolve_options(get_method(name), options)
    return specs


def run_demo(length: int = 3000, methods: list[str] | None = None, depth: float = 50.0, seed: int = 0,
             device: str | None = None, dtype: str = "float32") -> int:
    from kvshrink import load_model, make_cache, parse_method_spec
    from kvshrink.eval.tasks import Builder

    specs = _checked(methods or ["full", "shard"])
    print(f"kvshrink demo: a {length}-token needle-in-a-haystack prompt (Paul Graham essays), "
          f"needle at {depth:.0f}% depth, answered greedily with: {', '.join(specs)}")
    model, tokenizer = load_model(dtype=dtype, device=device)
    sample = Builder(tokenizer, seed=seed).niah(length, depth)
    ids = torch.tensor([sample.input_ids], device=model.device)
    print(f"prompt: {ids.shape[1]} tokens; the needle's value is {sample.expected[0]}\n")
    rows = []
    for spec in specs:
        name, options = parse_method_spec(spec)
        cache = make_cache(name, model, **options)
        torch_path = first_use.compiling_in_background()   # this cache's kernels compile beside it: slower
        start = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=sample.max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
        seconds = time.perf_counter() - start
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip()
        found = sample.expected[0] in answer
        rows.append((spec, found, cache.nbytes(), cache.compression_ratio(), seconds, torch_path))
        print(f"[{spec}] {answer!r}")
        print(f"    {'correct' if found else 'WRONG'}; {cache.summary()}; {seconds:.1f} s\n")
    print(f"{'method':24s} {'needle':7s} {'cache MiB':>10s} {'vs fp16':>8s} {'time s':>7s}")
    for spec, found, nbytes, ratio, seconds, torch_path in rows:
        note = "  (torch path: the CPU kernels were compiling, first use on this machine)" if torch_path else ""
        print(f"{spec:24s} {'found' if found else 'missed':7s} {nbytes / 2**20:10.2f} {ratio:7.2f}x "
              f"{seconds:7.1f}{note}")
    return 0
