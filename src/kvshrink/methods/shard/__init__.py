"""``shard``: asymmetric K/V compression (design/methods.md section 1).

Per layer the cache holds ``[sinks exact][middle compressed][recent window exact]`` plus a decode
stream:

* **sinks / window**: the first ``sinks`` tokens (after any left padding) and the last ``window``
  tokens, exact in ``exact_dtype`` (the model's dtype for 16-bit models, fp16 for fp32 ones, by default).
* **middle** (prompt tokens that leave the window during prefill), one block per prefill chunk:
  - K: RoPE undone exactly; centred PCA of the keys of all KV heads stacked per token
    (``pca_scope="layer"``, the default and the source's choice) or per KV head (``pca_scope="head"``), one
    component per 4 bits of the scope's budget by default (``rank``); bits per group of ``pca_group`` components
    from {0, 2, 4, 6, 8} by the DP of `codecs.bit_allocation.allocate_bits` (each width's measured
    Gaussian error against a dropped group's variance) under the layer's budget; int8 basis with
    per-column scales;
    bit-packed coefficients with per-component steps scaled from their spread: the ``2**b``
    Lloyd-Max levels of a Gaussian by default (``k_levels="lloyd"``: 4 levels at 2 bits where
    symmetric ints use 3) or the source's symmetric ints (``k_levels="uniform"``).
  - V: randomized Hadamard rotation of each head's value (a seeded random orthogonal matrix when the
    head size is not a power of two), per-(head, channel) RMS scaling, then vector quantization of
    groups of ``v_group`` channels with a ``v_codebook``-entry codebook: by default the k-means
    codebook of the standard Gaussian (data-independent: after rotation and scaling the groups are
    close to Gaussian, so no per-prompt k-means), or refined on a sample of the block
    (``v_fit="kmeans"``). Indices bit-packed.
* **stream** (tokens that leave the window after decoding started, or prefill leftovers too small
  for a PCA fit): TurboQuant (norm, randomized Hadamard, Lloyd-Max codebook for N(0, 1/d) at
  ``stream_bits``, optional 1-bit QJL residual), for K and V, each less a per-head centre (the exact
  window's mean when the stream starts, added back exactly in attention): keys with a large shared part
  (a key projection's bias, as Qwen2's) would otherwise spend the data-oblivious code on it.

Attention is computed from the compressed store block by block: for each block of at most
``block_tokens`` middle tokens the pre-RoPE keys are rebuilt from the coefficients (byte lookup
tables summed by ``embedding_bag``, see `codecs.table_decoder.TableDecoder`), RoPE is re-applied as one complex product
per channel pair at the tokens' positions (the decoded channels come in pair order), scores are taken
and the values are
accumulated in the code domain (probabilities summed per codeword per channel group, one product
with the codebook, scaling and inverse rotation once per block). The full-precision K or V of the
middle segment never exists for the whole sequence. Each segment answers with a `Partial`
(log-sum-exp), merged exactly by the framework.

Why one PCA per layer by default: a layer's KV heads share key directions, so at 1.5 bits per key element
the joint basis keeps more of the keys than one per head (on the embedded model at 4K, half the KL of
per-head PCAs; benchmarks/shard-ratio/README.md, "Lever by lever"). Per head, the bases are smaller and rebuilding keys costs
``T * r_h * d`` per head instead of ``T * r * H_kv * d``. Both share the layer's budget through one DP over all
heads' component groups.

Salient tokens (beyond the source, ``salient``): a small share of each block's middle tokens per KV
head is also kept exact: those the prompt's last ``observe`` queries attend to most (SnapKV's
observation window), max-pooled over ``salient_pool`` neighbours. The quantization error that
matters most is the error on the tokens attention actually reads: on the embedded model, keeping 1.5%
of the middle exact lowers the KL divergence of the next-token distributions from ``full``'s at 2K,
4K and 8K and finds every needle ``full`` finds on the standard grid, where the plain recipe loses two
of three at 8K (README). Their codes stay in the block and are masked out of its softmax, so the
held copies replace them. By default (the careful rung below) 5% are held, as 8-bit codes (``salient_dtype="int8"``: one
float16 step and zero point per token vector, 68 bytes per 64 channels against 128): on the embedded
model at 8K, 3% of the middle held so gives the same KL divergence from ``full`` as exact copies
(docs/methods/shard.md).

Eviction (beyond the source): a compression target (``ratio``, 12 by default), its guard (``evict``) and its
floor (``keep_tokens``). Each layer evicts its least-read middle tokens, in ascending order of the largest share
of the observation queries' attention any KV head gives them, until its bytes (estimated
from the options when the block is made: codes and salient rows per token, bases and maps per block) are
``ratio`` times fewer than an fp16 cache of its tokens, but never past the point where the evicted tokens
hold more than ``evict`` (0.1) of some head's observed attention (a layer whose attention is spread keeps
more), and never below ``keep_tokens`` (4,096) held tokens: a short prompt has few tokens to spare, and a
4K one keeps every token. So the target is met where the prompt allows it (12.8x at 8K on the embedded
model; docs/methods/shard.md). The evicted tokens are held as they left the exact window until the cache
knows whether the prompt ended with its question: a decode step right after the prompt drops them
(the question was in the prompt, and its last queries did not read them), never having coded them (half
of the compression's time); a step of several tokens (a question asked after
the document, another chunk), or a fork or save before it, codes them as a block of their own (their own PCA
fit, the codes the prompt's chunk would have given them) and keeps them for good, so a
document compressed before its questions keeps every fact its later questions ask for (what a document
loses when they are dropped anyway: docs/methods/shard.md). ``ratio=0`` leaves ``evict``'s share
alone to decide; ``evict=0`` keeps every token.

Cold tokens (beyond the source, ``cold``): the bits go where the observed queries read. Each
block's least-read middle tokens, in ascending order of the largest share of the observation queries'
attention any KV head gives them, while they hold at most ``cold`` of every head's share, are coded as a
block of their own over the same span (a kept-token map, as an evicted block's): their own PCA at
``cold_key_bits`` per key element and value VQ groups of ``cold_v_group`` channels (8 channels of 256 entries:
1 bit per value element), with the same decode paths (each block's codebook shape gives its group size and
code width). How many go is decided by how peaked the layer's attention is, not by a fixed count; the salient
rows stay as many as the whole block would hold, all in the hot block.

Calibration to the model (beyond the source, ``kl_budget``, on by default): how many salient rows, how much
of the attention coded cold and how long the exact window are chosen per model, as the cheapest rung of
`sensitivity.LADDER` whose KL(full || shard) on a calibration text stays within the budget. Models differ
several-fold in how far their answers move for the same coding error, so one fixed setting is too careful for
one model or too lossy for another. The measurement runs once per model and options, when the first cache is
made, and is stored for later processes; naming any of the ladder's options chooses them instead.

Per-layer budgets (beyond the source): with ``key_alloc="global"`` the key bit budget is shared by
all layers: layers whose pre-RoPE keys are more low-rank get fewer bits. The allocation is a DP over
the component groups of all layers at once, on each layer's spectrum measured on calibration text run
once through the model when the cache is built (``calibration_tokens``); the prompt's own PCA then
spends that layer's budget by the per-layer DP.
"""

from __future__ import annotations

import torch

from kvshrink.cache.registry import register_method
from kvshrink.methods.shard.calibration import global_key_budgets
from kvshrink.methods.shard.config import ShardConfig
from kvshrink.methods.shard.layer import ShardLayer
from kvshrink.methods.shard.sensitivity import calibrated_options, settle_named_options
from kvshrink.methods.shard.shared import ShardShared


def _build(model: torch.nn.Module, info, **options):
    from kvshrink.cache.base import KVShrinkCache
    from kvshrink.cache.integration import install

    cfg = ShardConfig(**options)
    cfg.validate(info.head_dim, info.num_kv_heads)
    shared = ShardShared(cfg, info.num_layers, info.head_dim, info.num_kv_heads)
    if cfg.key_alloc == "global":
        shared.layer_key_bits = global_key_budgets(model, info, cfg)
    cache = KVShrinkCache("shard", options, info, lambda spec: ShardLayer(spec, shared))
    install(model)
    return cache


register_method(
    "shard",
    "Shard: PCA+int keys with RoPE undone, Hadamard+VQ values, exact sinks and window, TurboQuant decode stream",
    options=ShardConfig,
    build=_build,
    undoes_rope=True,
    settle_named=settle_named_options,
    choose=calibrated_options,
)(ShardLayer)
