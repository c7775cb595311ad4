"""How well the prompt's last queries predict which middle tokens later queries read.

Shard picks its cold tokens (the least read, coded at fewer bits: the ``cold`` option) and its salient rows
by the attention of the prompt's last ``OBSERVE`` queries. A document compressed before its questions is then
read by queries that come after. On the held-out text of ``kl_continuation.py`` (a LENGTH-token prefix and
its next 64 tokens, in one forward pass), for each layer and each share ``c`` of ``COLD_SHARES``:

- ``frac``: the share of the middle's tokens that ``cold=c`` makes cold (the least read by the observing
  queries, pooled over 33 tokens as Shard does, while they hold at most ``c`` of every KV head's attention);
- ``cont``: the largest share of a KV head's middle attention that the next 64 tokens' queries pay to them;
- ``proxy``: the same measured inside the prompt, which a cache could do by itself: cold tokens picked by
  the first half of the observing queries, read by the second half.

and for each share ``s`` of ``SALIENT_SHARES``, the least (over KV heads) of the middle attention that the
``s`` most read tokens hold: for the observing queries themselves (``self``), for the next 64 tokens
(``cont``), and picked by the first half and read by the second (``proxy``).

    python benchmarks/shard-ratio/read_prediction.py MODEL LENGTH OUT.jsonl

MODEL as in ``kl_continuation.py``. One JSON line per layer is written to OUT.jsonl; the mean and the largest
over layers are printed.
"""
import json
import statistics
import sys

import torch

import kvshrink
from kvshrink.methods.shard.salient import pooled, tokens_to_keep

from kl_continuation import CONTINUATION, held_out_text

SINKS, WINDOW, OBSERVE, POOL = 4, 32, 64, 33
COLD_SHARES = (0.025, 0.05, 0.1, 0.2)
SALIENT_SHARES = (0.01, 0.05)


def middle_reads(model, ids: torch.Tensor, length: int) -> dict[int, dict[str, torch.Tensor]]:
    """Per layer, ``[B, H_kv, middle]`` mean attention over the middle tokens (softmax over them alone, as
    Shard's observation) of: the observing queries' first and second halves, all of them, and the
    continuation's queries. Captured by an attention function that then runs SDPA as usual."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    reads = {}

    def capture(module, query, key, value, attention_mask, scaling=None, **kwargs):
        b, hq, _, d = query.shape
        h = key.shape[1]
        rows = query[:, :, length - OBSERVE:].reshape(b, h, hq // h, -1, d)
        probs = torch.einsum("bhgtd,bhnd->bhgtn", rows, key[:, :, SINKS:length - WINDOW]).mul_(
            scaling or d ** -0.5).softmax(-1)
        half = OBSERVE // 2
        reads[module.layer_idx] = {"first": probs[:, :, :, :half].mean((2, 3)),
                                   "second": probs[:, :, :, half:OBSERVE].mean((2, 3)),
                                   "observed": probs[:, :, :, :OBSERVE].mean((2, 3)),
                                   "later": probs[:, :, :, OBSERVE:].mean((2, 3))}
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)

    AttentionInterface.register("read_prediction", capture)
    previous = model.config._attn_implementation
    model.set_attn_implementation("read_prediction")
    try:
        with torch.no_grad():
            model(ids, logits_to_keep=1)
    finally:
        model.set_attn_implementation(previous)
    return reads


def share_on(read: torch.Tensor, tokens: torch.Tensor) -> float:
    """The largest share of a head's attention ``read [B, H_kv, n]`` that the ``tokens [n]`` (bool) hold."""
    return float((read[..., tokens].sum(-1) / read.sum(-1)).max())


def held_by_top(picked_by: torch.Tensor, read: torch.Tensor, share: float) -> float:
    """The least (over heads) of ``read``'s attention that the ``share`` most read tokens by ``picked_by`` hold."""
    top = picked_by.topk(max(1, int(share * picked_by.shape[-1])), -1).indices
    return float((read.gather(-1, top).sum(-1) / read.sum(-1)).min())


def layer_record(layer: int, r: dict[str, torch.Tensor]) -> dict:
    record = {"layer": layer}
    for c in COLD_SHARES:
        cold = ~tokens_to_keep(pooled(r["observed"], POOL), c)
        cold_first = ~tokens_to_keep(pooled(r["first"], POOL), c)
        record[f"cold={c}"] = {"frac": round(float(cold.float().mean()), 4), "cont": round(share_on(r["later"], cold), 4),
                               "proxy": round(share_on(r["second"], cold_first), 4)}
    for s in SALIENT_SHARES:
        record[f"salient={s}"] = {"self": round(held_by_top(r["observed"], r["observed"], s), 4),
                                  "cont": round(held_by_top(r["observed"], r["later"], s), 4),
                                  "proxy": round(held_by_top(r["first"], r["second"], s), 4)}
    return record


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        raise SystemExit(__doc__)
    model_path, length, out = argv[0], int(argv[1]), argv[2]
    if length <= OBSERVE + SINKS + WINDOW:
        raise SystemExit(f"LENGTH must exceed {OBSERVE + SINKS + WINDOW} tokens, got {length}")
    model, tok = kvshrink.load_model(None if model_path == "smol" else model_path, dtype="float32")
    ids = tok(held_out_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][:, :length + CONTINUATION]
    records = [dict(model=model_path, length=length, **layer_record(i, r))
               for i, r in sorted(middle_reads(model, ids, length).items())]
    with open(out, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    for key in [k for k in records[0] if "=" in k]:
        for field in records[0][key]:
            values = [r[key][field] for r in records]
            print(f"{key:14s} {field:6s} mean {statistics.mean(values):.3f} largest {max(values):.3f}")


if __name__ == "__main__":
    main()
