"""Ratio, byte shares, KL(full || method) and top-1 agreement on a teacher-forced continuation.

A prefix of ``LENGTH`` tokens of a text no evaluation suite uses (the license texts Debian ships in
/usr/share/common-licenses: GPL-3, GFDL-1.3, MPL-2.0, Apache-2.0, LGPL-2.1, GPL-2, joined by blank lines) is
prefilled in one call, so the cache keeps every token it is asked to (``evict=0``); the ratio and the byte
shares are read then. The next 64 tokens are then teacher-forced in one call, and the 64 next-token
distributions (the prefix's last one and 63 of the continuation's) are compared with ``full``'s.

    python benchmarks/shard-ratio/kl_continuation.py MODEL LENGTH OUT.jsonl SPEC [SPEC ...]

MODEL: ``smol`` (the embedded SmolLM2-135M-Instruct) or a model path; ``DTYPE`` (environment): float32 (default)
or bfloat16; ``TEXT=calibration`` (environment): Shard's calibration text instead, its 256-token continuation
after LENGTH tokens (2048 is what ``kl_budget`` measures: a setting's KL there is what the calibration would
see); ``KL_BUDGET`` (environment): when set, each Shard spec's options go through
``calibrate_shard`` with that budget first (the record names the options it chose). One JSON line per spec is
appended to OUT.jsonl. ``full``'s distributions are kept next to OUT and reused by later runs of the same model,
length and dtype.
"""
import json
import os
import sys
import time

import torch

import kvshrink
from kvshrink.cache import parse_method_spec
from kvshrink.methods.shard.sensitivity import (CONTINUATION_TOKENS, calibrate_shard, calibration_text,
                                                continuation_logprobs, kl_per_token)

LICENSES = ["GPL-3", "GFDL-1.3", "MPL-2.0", "Apache-2.0", "LGPL-2.1", "GPL-2"]
CONTINUATION = 64


def held_out_text() -> str:
    return "\n\n".join(open(f"/usr/share/common-licenses/{name}").read() for name in LICENSES)


def measure(model, prefix, continuation, cache):
    """``[CONTINUATION, vocab]`` log-probabilities, and the cache's ratio and byte breakdown after the prefix
    (read between the prefill and the teacher-forced continuation)."""
    seen = {}

    def after_prefill(_module, _args, _kwargs, _output):
        if not seen and hasattr(cache, "breakdown"):
            seen["ratio"] = cache.compression_ratio()
            seen["parts"] = {k: v for k, v in cache.breakdown().items() if v}

    hook = model.register_forward_hook(after_prefill, with_kwargs=True)
    try:
        logprobs = continuation_logprobs(model, prefix, continuation, cache)
    finally:
        hook.remove()
    return logprobs, seen.get("ratio"), seen.get("parts")


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 4:
        raise SystemExit(__doc__)
    model_path, length, out, specs = argv[0], int(argv[1]), argv[2], argv[3:]
    dtype = os.environ.get("DTYPE", "float32")
    text = os.environ.get("TEXT", "licenses")
    if text not in ("licenses", "calibration"):
        raise SystemExit(f"TEXT must be licenses or calibration, got {text!r}")
    model, tok = kvshrink.load_model(None if model_path == "smol" else model_path, dtype=dtype)
    source, steps = (held_out_text(), CONTINUATION) if text == "licenses" else (calibration_text(), CONTINUATION_TOKENS)
    ids = tok(source, add_special_tokens=False, return_tensors="pt")["input_ids"]
    if ids.shape[1] < length + steps:
        raise SystemExit(f"the text has {ids.shape[1]} tokens; {length + steps} are needed")
    prefix, continuation = ids[:, :length], ids[:, length:length + steps]
    name = os.path.basename(model_path).split("-instruct")[0] + ("-calibration" if text == "calibration" else "")
    ref_path = os.path.join(os.path.dirname(os.path.abspath(out)), f"ref-{name}-{length}-{dtype}.pt")
    if os.path.exists(ref_path):
        ref = torch.load(ref_path)
    else:
        from transformers import DynamicCache
        ref = continuation_logprobs(model, prefix, continuation, DynamicCache())
        torch.save(ref, ref_path)
    budget = float(os.environ.get("KL_BUDGET", 0))
    for spec in specs:
        start = time.time()
        method, options = parse_method_spec(spec)
        calibration = None
        if budget:
            if method != "shard":
                raise SystemExit(f"KL_BUDGET calibrates Shard's options; {spec!r} is not a shard spec")
            calibration = calibrate_shard(model, tok, budget, **options)
            options = calibration.options
        logprobs, ratio, parts = measure(model, prefix, continuation, kvshrink.make_cache(method, model, **options))
        kl = kl_per_token(ref, logprobs)
        top1 = float((ref.argmax(-1) == logprobs.argmax(-1)).float().mean() * 100)
        total = sum(parts.values())
        record = dict(model=model_path, dtype=dtype, text=text, length=length, spec=spec, ratio=round(ratio, 3),
                      kl=round(kl, 5), top1=top1, seconds=round(time.time() - start, 1),
                      share={k: round(v / total, 3) for k, v in parts.items()})
        if calibration is not None:
            record.update(kl_budget=budget, calibrated=calibration.spec,
                          calibration_kl=[round(kl, 5) for _, kl in calibration.tried])
        print(json.dumps(record), flush=True)
        with open(out, "a") as f:
            f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
