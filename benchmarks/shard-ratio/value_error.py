"""How much of each KV head's values is a common part, and what coding them less it, or by a PCA with DP bits,
does to the value error: the 4K-token prefix of the held-out text (as `kl_continuation.py`), prefilled into a
full cache; per layer and KV head (sinks excluded), the error of the Hadamard rotation + 2-bit VQ (Shard's value
codes) with and without the mean removed, and of a PCA with DP bit allocation at 2 and 1.5 bits, summed in the
output projection's metric (each KV head's ``sum W_o,h^T W_o,h`` over its query heads), relative to 2-bit VQ.

    python benchmarks/shard-ratio/value_error.py MODEL OUT.jsonl      # MODEL: smol or a model path
"""
import json
import sys

import torch

import kvshrink
from kvshrink.codecs.bit_allocation import allocate_bits, group_sizes, group_variances
from kvshrink.codecs.hadamard import RandomRotation
from kvshrink.codecs.pca import encode_pca, fit_pca
from kvshrink.codecs.vq import gaussian_codebook
from kvshrink.kernels.cpu import vq_search

from kl_continuation import held_out_text

LENGTH, SINKS = 4000, 4


def vq_error(x, m, rotation, codebook):
    """Rows ``x [n, d]`` coded less ``m`` by the rotation and VQ -> the error ``[n, d]``."""
    r = rotation.rotate(x - m)
    scale = r.pow(2).mean(0).sqrt().clamp_min(1e-6)
    idx = vq_search.assign_codes((r / scale).reshape(-1, codebook.shape[1]), codebook.float(), out_dtype=torch.int64)
    return rotation.unrotate(codebook.float()[idx].reshape(r.shape) * scale) + m - x


def pca_error(x, metric_root, bits):
    """Rows ``x`` whitened by ``metric_root``, PCA-coded with DP bits at ``bits`` per element -> squared error per row."""
    xw = x @ metric_root
    fit = fit_pca(xw, xw.shape[1])
    sizes = group_sizes(xw.shape[1], max(1, xw.shape[1] // 16))
    widths = allocate_bits(group_variances(fit.variances, sizes), sizes, int(round(bits * xw.shape[1])), levels="lloyd")
    code = encode_pca(xw, fit, [b for s, b in zip(sizes, widths) for _ in range(s)], levels="lloyd")
    return float((xw - code.decode()).pow(2).sum(1).mean())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        raise SystemExit(__doc__)
    model, tok = kvshrink.load_model(None if argv[0] == "smol" else argv[0], dtype="float32")
    ids = tok(held_out_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][:, :LENGTH]
    cache = kvshrink.make_cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    rotation = RandomRotation(cfg.head_dim if getattr(cfg, "head_dim", None) else cfg.hidden_size // cfg.num_attention_heads, 0)
    d = rotation.dim
    books = {"vq2": gaussian_codebook(4, 256, seed=0, assign=vq_search.assign_codes)}
    total, shares = {}, []
    for i, layer in enumerate(model.model.layers):
        w = layer.self_attn.o_proj.weight.detach().double()
        values = cache.layers[i].store.values[0].float()
        for h in range(values.shape[0]):
            x = values[h, SINKS:]
            metric = sum(w[:, q * d:(q + 1) * d].T @ w[:, q * d:(q + 1) * d] for q in range(h * group, (h + 1) * group))
            evals, evecs = torch.linalg.eigh(metric)
            root = ((evecs * evals.clamp_min(0).sqrt()) @ evecs.T).float()
            metric = metric.float()
            mean = x.mean(0)
            shares.append(float(mean.pow(2).sum() / x.pow(2).sum(1).mean()))
            for name, m in (("vq2", torch.zeros(d)), ("vq2_centred", mean)):
                e = vq_error(x, m, rotation, books["vq2"])
                total[name] = total.get(name, 0.0) + float(((e @ metric) * e).sum(1).mean())
            for bits in (2.0, 1.5):
                total[f"pca{bits}"] = total.get(f"pca{bits}", 0.0) + pca_error(x, root, bits)
    record = {"model": argv[0], "length": LENGTH, "mean_share_min": round(min(shares), 3),
              "mean_share_median": round(sorted(shares)[len(shares) // 2], 3), "mean_share_max": round(max(shares), 3),
              **{f"{k}_vs_vq2": round(v / total["vq2"], 3) for k, v in total.items() if k != "vq2"}}
    print(json.dumps(record))
    with open(argv[1], "a") as f:
        f.write(json.dumps(record) + "\n")


if __name__ == "__main__":
    main()
