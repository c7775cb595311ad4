"""What `shard:ratio=R` holds: the cache's compression after the prompt's first decode step (the evicted tokens
dropped), and per layer the middle tokens evicted and the largest share of a KV head's observed attention they held.
Prompts are the first LENGTH tokens of the essay corpus. Usage (docs/results.md, "Session 18"):

    PYTHONPATH=src .venv/bin/python scripts/ratio_held.py LENGTHS SPEC [SPEC ...]   # e.g. 2048,8000 shard:ratio=10
"""
import sys

import torch

import kvshrink
from kvshrink.cache.registry import parse_method_spec
from kvshrink.eval.data import essay_corpus
from kvshrink.methods.shard import layer as shard_layer

evicted = []
_keep = shard_layer.tokens_to_keep


def recorded(importance, mass, count=None):
    keep = _keep(importance, mass, count)
    share = importance / importance.sum(-1, keepdim=True).clamp_min(1e-30)
    evicted.append((int((~keep).sum()), keep.numel(), float(share[..., ~keep].sum(-1).amax())))
    return keep


def main() -> None:
    lengths, specs = [int(x) for x in sys.argv[1].split(",")], sys.argv[2:]
    shard_layer.tokens_to_keep = recorded
    torch.set_num_threads(2)
    model, tok = kvshrink.load_model()
    ids = tok(essay_corpus(), return_tensors="pt").input_ids
    for length in lengths:
        for spec in specs:
            name, options = parse_method_spec(spec)
            evicted.clear()
            cache = kvshrink.make_cache(name, model, **options)
            with torch.no_grad():
                logits = model(ids[:, :length], past_key_values=cache).logits
                model(logits[:, -1:].argmax(-1), past_key_values=cache)
            print(f"{length} {spec}: {cache.compression_ratio():.2f}x after the first decode step")
            for layer, (gone, n, share) in enumerate(evicted):
                print(f"  layer {layer:2d}: {gone} of {n} middle tokens evicted ({gone / n:.0%}), "
                      f"at most {share:.3f} of a head's observed attention")


if __name__ == "__main__":
    main()
