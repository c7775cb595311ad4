"""How much each layer's codes cost in KL: Shard's default cache with ONE layer's values (or keys) coarsened,
KL(full || that cache) over the essay perplexity text, minus the default's KL, for every layer. Usage:
PYTHONPATH=src .venv/bin/python scripts/layer_sensitivity.py LENGTH TOKENS values:CODEBOOK | keys:BITS
(e.g. ``2048 64 values:16``: 1-bit values, 4 channels per 16-entry codebook; ``2048 64 keys:1``: 1-bit keys).
A measurement for issue 14's per-layer allocation (docs/results.md, "Session 15"); not a cache option."""
import dataclasses
import sys
import time

import torch

from kvshrink.codecs.vq import gaussian_codebook
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import score_continuation
from kvshrink.eval.scoring import distribution_agreement
from kvshrink.eval.tasks import Builder
from kvshrink.methods.shard.layer import ShardLayer

length, tokens, (side, setting) = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3].split(":")
if side not in ("values", "keys"):
    sys.exit("the third argument is values:CODEBOOK or keys:BITS")
torch.set_num_threads(2)
backend = KVShrinkBackend(None)
model, tokenizer = backend.load_model()
sample = Builder(tokenizer).ppl(length)
prefix, target = sample.input_ids, sample.target_ids[:tokens]
coarse: set[int] = set()
encode_values = ShardLayer.encode_values


def coarse_values(self, value, rows=None):
    """The layer's values with a `setting`-entry codebook when it is the one coarsened."""
    if side != "values" or self.layer_idx not in coarse:
        return encode_values(self, value, rows)
    cfg, codebook = self.cfg, self.shared.v_codebook
    self.cfg = dataclasses.replace(cfg, v_codebook=int(setting))
    self.shared.v_codebook = gaussian_codebook(cfg.v_group, int(setting), seed=cfg.seed)
    try:
        return encode_values(self, value, rows)
    finally:
        self.cfg, self.shared.v_codebook = cfg, codebook


ShardLayer.encode_values = coarse_values


def logprobs(spec: str, layer: int | None = None):
    coarse.clear()
    if layer is not None:
        coarse.add(layer)
    cache = backend.make_cache(spec, model)
    if side == "keys" and layer is not None:
        cache.layers[layer].shared.layer_key_bits[layer] = float(setting)
    return score_continuation(model, cache, prefix, target, keep_logprobs=True).logprobs, cache.nbytes()


start = time.time()
reference, _ = logprobs("full")
default, default_bytes = logprobs("shard")
default_kl, default_top1 = distribution_agreement(reference, default)
print(f"shard at {length} tokens, {tokens} scored: KL {default_kl:.4f}, top-1 {default_top1:.1f}%, {default_bytes} bytes")
for layer in range(len(model.model.layers)):
    lp, nbytes = logprobs("shard", layer)
    kl, top1 = distribution_agreement(reference, lp)
    print(f"layer {layer:2d} {side} {setting}: KL {kl - default_kl:+.4f} top-1 {top1:.1f}% bytes {nbytes - default_bytes:+d}",
          flush=True)
print(f"{time.time() - start:.0f} s")
