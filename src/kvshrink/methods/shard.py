"""``shard``: asymmetric K/V compression (design/methods.md section 1).

Per layer the cache holds ``[sinks exact][middle compressed][recent window exact]`` plus a decode
stream:

* **sinks / window**: the first ``sinks`` tokens (after any left padding) and the last ``window``
  tokens, exact in ``exact_dtype`` (the model's dtype for 16-bit models, fp16 for fp32 ones, by default).
* **middle** (prompt tokens that leave the window during prefill), one block per prefill chunk:
  - K: RoPE undone exactly; centred PCA per KV head (``pca_scope="head"``, the default) or of the
    keys of all KV heads stacked per token (``pca_scope="layer"``, the source's choice); bits per
    group of ``pca_group`` components from {0, 2, 4, 6, 8} by the DP of `codecs.pca.allocate_bits`
    (4x penalty for dropping) under the layer's budget; int8 basis with per-column scales;
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
  ``stream_bits``, optional 1-bit QJL residual), for K and V.

Attention is computed from the compressed store block by block: for each block of at most
``block_tokens`` middle tokens the pre-RoPE keys are rebuilt from the coefficients (byte lookup
tables summed by ``embedding_bag``, see `codecs.pca.TableDecoder`), RoPE is re-applied as one complex product
per channel pair at the tokens' positions (the decoded channels come in pair order), scores are taken
and the values are
accumulated in the code domain (probabilities summed per codeword per channel group, one product
with the codebook, scaling and inverse rotation once per block). The full-precision K or V of the
middle segment never exists for the whole sequence. Each segment answers with a `Partial`
(log-sum-exp), merged exactly by the framework.

Why per-head PCA by default: on the embedded model (3 KV heads of 64) at 2K tokens and 2 bits per
key element it found 3/3 needles where the per-layer PCA found 2/3, its bases are 3x smaller
(ratio 6.1x vs 5.6x), and rebuilding keys costs ``T * r_h * d`` per head instead of
``T * r * H_kv * d``. Both share the layer's budget through one DP over all heads' component groups.

Salient tokens (beyond the source, ``salient``): a small share of each block's middle tokens per KV
head is also kept exact: those the prompt's last ``observe`` queries attend to most (SnapKV's
observation window), max-pooled over ``salient_pool`` neighbours. The quantization error that
matters most is the error on the tokens attention actually reads: on the embedded model, keeping 1.5%
of the middle exact lowers the KL divergence of the next-token distributions from ``full``'s at 2K,
4K and 8K and finds every needle ``full`` finds on the standard grid, where the plain recipe loses two
of three at 8K (README). Their codes stay in the block and are masked out of its softmax, so the
exact copies replace them.

Per-layer budgets (beyond the source): with ``key_alloc="global"`` the key bit budget is shared by
all layers: layers whose pre-RoPE keys are more low-rank get fewer bits. The allocation is a DP over
the component groups of all layers at once, on each layer's spectrum measured on calibration text run
once through the model when the cache is built (``calibration_tokens``); the prompt's own PCA then
spends that layer's budget by the per-layer DP.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from kvshrink.cache.attention import Partial, exact_partial, group_queries, ungroup
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.registry import option, register_method
from kvshrink.cache.store import EXACT_DTYPE_CHOICES, ExactStore, exact_storage_dtype, held_bytes, to_storage
from kvshrink.codecs import fused
from kvshrink.codecs.bitpack import pack_bits, unpack_bits
from kvshrink.codecs.hadamard import RandomRotation
from kvshrink.codecs.lloyd_max import TurboCode, TurboQuantizer
from kvshrink.codecs.pca import (
    COEFF_LEVELS, PCA_BITS, PCACode, TableDecoder, allocate_bits, encode_pca, fit_pca, group_sizes, group_variances, scaled_bases,
    SlotPlan, slot_plan, unit_levels,
)
from kvshrink.codecs.rope import apply_rope_paired, pair_order, rope_phases, undo_rope
from kvshrink.codecs.vq import assign_codes, check_codebook_size, fit_codebook, gaussian_codebook

STREAM_BITS = (2, 3, 4, 8)
V_FITS = ("gaussian", "kmeans")
KEY_ALLOCS = ("layer", "global")
PCA_SCOPES = ("layer", "head")
KEY_WEIGHTS = ("none", "query")
KERNELS = ("fast", "reference")
# Floor of a channel's relative query energy in key_weights="query" (its error weight is never zero).
_MIN_QUERY_WEIGHT = 1e-2

# Score elements per block of middle tokens (bounds the transient memory of prefill-with-past).
_SCORE_ELEMENTS = 1 << 22
# Most grouped query rows (query heads per KV head x new tokens) the fused kernel takes: decoding, not
# prefill-with-past, whose many rows the reference path blocks to bound memory.
_FAST_ROWS = 64


# ----------------------------------------------------------------------------------------------- config
@dataclass
class ShardConfig:
    """Shard's options (the one declaration: help, choices and ranges live here)."""

    sinks: int = option(4, "first tokens kept exact (attention sinks)", low=0)
    window: int = option(64, "most recent tokens kept exact", low=0)
    key_bits: float = option(2.5, "bits per key element for the compressed middle (PCA coefficients)",
                             low=0, high=8, low_open=True)
    v_group: int = option(4, "channels per value VQ group (must divide the head size)", low=1)
    v_codebook: int = option(256, "value VQ codebook entries (power of two, 2..256)", low=2, high=256)
    v_fit: str = option("gaussian", "value codebook: 'gaussian' (fixed, data-independent) or 'kmeans' (refined "
                        "per block on a sample)", choices=V_FITS)
    v_iters: int = option(4, "k-means iterations when v_fit='kmeans'", low=0)
    v_sample: int = option(8192, "group vectors sampled to refine the codebook when v_fit='kmeans' "
                           "(>= v_codebook)", low=2)
    pca_group: int = option(0, "PCA components per DP bit-allocation group (0 = H_kv*d/16)", low=0)
    rank: int = option(0, "PCA components computed per scope (0 = all)", low=0)
    pca_scope: str = option("head", "one key PCA per 'layer' (all KV heads stacked, as the source) or per 'head' "
                            "(3x cheaper to decode with 3 KV heads)", choices=PCA_SCOPES)
    k_levels: str = option("lloyd", "key coefficient levels: 'lloyd' (2**b Gaussian Lloyd-Max levels) or "
                           "'uniform' (symmetric ints, the source's int4)", choices=COEFF_LEVELS)
    drop_penalty: float = option(4.0, "error multiplier for dropping a component group in the DP", low=1)
    stream_bits: int = option(4, "TurboQuant bits for tokens leaving the window during decode", choices=STREAM_BITS)
    qjl: bool = option(False, "add a 1-bit QJL residual sketch to the decode stream")
    seed: int = option(0, "seed of the rotations and codebooks")
    exact_dtype: str = option("auto", "dtype of exact tokens (sinks, window, salient): 'auto' (the model's dtype "
                              "if 16-bit, else float16), 'model', or float16/bfloat16/float32 (float16 refuses "
                              "values beyond its range)", choices=EXACT_DTYPE_CHOICES)
    min_block: int = option(64, "fewest prompt tokens compressed by PCA/VQ at once (fewer go to the stream)", low=2)
    block_tokens: int = option(8192, "middle tokens decoded at once during attention (bounds its transient "
                               "memory)", low=1)
    key_alloc: str = option("layer", "key budget: 'layer' (each layer key_bits) or 'global' (shared by all "
                            "layers by a DP on calibrated per-layer spectra)", choices=KEY_ALLOCS)
    calibration_tokens: int = option(512, "tokens of calibration text for key_alloc='global'", low=16)
    key_weights: str = option("none", "key PCA error weights per channel: 'none' (plain key error) or 'query' "
                              "(each RoPE pair weighted by the prompt's mean query energy in it: the score "
                              "error)", choices=KEY_WEIGHTS)
    salient: float = option(0.015, "fraction of each block's middle tokens kept exact per KV head: those the "
                            "prompt's last `observe` queries attend to most (SnapKV-style)", low=0, high=0.5)
    observe: int = option(32, "last prompt queries whose attention picks the salient tokens", low=1)
    salient_pool: int = option(33, "tokens around an attended one that count as attended too (odd): a fact "
                               "spans several tokens, and the ones after an attended token are copied next", low=1)
    kernel: str = option("reference", "middle-segment decode: 'reference' (torch ops) or 'fast' (fused numba "
                         "kernel on CPU, 3-11% faster after a one-off compile; needs kvshrink[fast])",
                         choices=KERNELS)

    def __post_init__(self):
        try:
            check_codebook_size(self.v_codebook)
        except ValueError:
            self._bad(f"v_codebook must be a power of two in 2..256, got {self.v_codebook}")
        if self.v_sample < self.v_codebook:
            self._bad(f"v_sample must be >= v_codebook ({self.v_codebook}), got {self.v_sample}")
        if self.salient_pool % 2 == 0:
            self._bad(f"salient_pool must be an odd number >= 1, got {self.salient_pool}")

    @staticmethod
    def _bad(msg: str):
        raise ValueError(f"shard: {msg}")

    def validate(self, head_dim: int, num_kv_heads: int) -> None:
        """The checks that depend on the model's attention shape."""
        if head_dim % self.v_group:
            self._bad(f"v_group must divide the head size {head_dim}, got {self.v_group}")
        if self.rank > head_dim * num_kv_heads:
            self._bad(f"rank must be in 0..{head_dim * num_kv_heads} (0 = all), got {self.rank}")

    @property
    def v_bits_per_element(self) -> float:
        return math.log2(self.v_codebook) / self.v_group


# ----------------------------------------------------------------------------------------------- shared
class ShardShared:
    """State shared by the layers of one cache: quantizers, codebooks, per-layer key budgets, and a
    per-step memo of RoPE tables (the middle's positions are the same in every layer)."""

    def __init__(self, cfg: ShardConfig, num_layers: int, head_dim: int):
        self.cfg = cfg
        self.rotation = RandomRotation(head_dim, cfg.seed)
        self.turbo = TurboQuantizer(head_dim, cfg.stream_bits, qjl=cfg.qjl, seed=cfg.seed + 1)
        self.v_codebook = gaussian_codebook(cfg.v_group, cfg.v_codebook, seed=cfg.seed)
        self.layer_key_bits: list[float] = [cfg.key_bits] * num_layers
        # The key coefficient levels of every width the bit allocation may pick, computed now (once per
        # process) rather than inside the first prompt's prefill.
        for bits in PCA_BITS[1:]:
            unit_levels(bits, cfg.k_levels)
        self.num_layers = num_layers
        self.fast = cfg.kernel == "fast"
        if self.fast:
            if not fused.available():
                raise ImportError(f"shard: kernel='fast' needs numba ({fused.unavailable_reason()}); install it "
                                  "with: pip install 'kvshrink[fast]' (or use kernel='reference')")
            fused.warm_up()
        self._rope_ctx: StepContext | None = None
        self._rope_memo: dict[tuple, object] = {}

    def rope(self, ctx: StepContext, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[B, n, d]`` of token indices ``start .. start+n-1``, memoised per step."""
        return self._memo(ctx, ("cos_sin", start, n), lambda: self._cos_sin(ctx, start, n))

    def phases(self, ctx: StepContext, start: int, n: int) -> torch.Tensor:
        """RoPE rotations ``[B, 1, n, d/2]`` (complex) of token indices ``start .. start+n-1``, memoised."""
        return self._memo(ctx, ("phases", start, n), lambda: rope_phases(*self.rope(ctx, start, n)).unsqueeze(1))

    def pair_rope(self, ctx: StepContext, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 ``(cos, sin)`` ``[B, n, d/2]`` of each RoPE pair (the fused kernel's layout), memoised."""
        def make():
            phases = self.phases(ctx, start, n)[:, 0]
            return phases.real.contiguous(), phases.imag.contiguous()

        return self._memo(ctx, ("pair_rope", start, n), make)

    def _cos_sin(self, ctx: StepContext, start: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        index = torch.arange(start, start + n, device=ctx.offset.device)
        cos, sin = ctx.rope(ctx.positions(index))
        return cos.float(), sin.float()

    def _memo(self, ctx: StepContext, key: tuple, make):
        if self._rope_ctx is not ctx:
            self._rope_ctx, self._rope_memo = ctx, {}
        if key not in self._rope_memo:
            self._rope_memo[key] = make()
        return self._rope_memo[key]

    def end_of_step(self) -> None:
        self._rope_ctx, self._rope_memo = None, {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_rope_ctx": None, "_rope_memo": {}}  # one step's memo is not state


# ----------------------------------------------------------------------------------------------- segments
@dataclass
class SalientTokens:
    """Middle tokens kept exact, chosen per KV head: block rows ``index [B, H_kv, m]`` (int32) and their
    keys and values ``[B, H_kv, m, d]`` in the exact dtype."""

    index: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor

    def hidden(self, n: int) -> torch.Tensor:
        """``[B, H_kv, 1, n]`` bool: True at the block rows held here (the codes' copies are not attended)."""
        b, h, _ = self.index.shape
        mask = torch.zeros(b, h, n, dtype=torch.bool, device=self.index.device)
        return mask.scatter_(2, self.index.long(), True).unsqueeze(2)

    def tensors(self) -> list[torch.Tensor]:
        return [self.index, self.keys, self.values]


# Observation queries scored at once (bounds the score block to rows x tokens, not all queries x tokens).
_OBSERVE_ROWS = 16


def observed_importance(observer: torch.Tensor, keys: torch.Tensor, scaling: float, pool: int) -> torch.Tensor:
    """``[B, H_kv, n]``: the mean attention the grouped observation queries ``[B, H_kv, R, d]`` pay to
    each of ``keys [B, H_kv, n, d]`` (softmax over these keys), max-pooled over ``pool`` neighbouring
    tokens (a fact spans several tokens, and its neighbours are what gets copied next)."""
    b, h, rows, _ = observer.shape
    n = keys.shape[2]
    probs = torch.zeros(b, h, n, dtype=torch.float32, device=keys.device)
    for r in range(0, rows, _OBSERVE_ROWS):
        scores = observer[:, :, r:r + _OBSERVE_ROWS] @ keys.transpose(-1, -2)
        probs += torch.softmax(scores.mul_(scaling), dim=-1).sum(dim=2)
    probs /= rows
    pooled = torch.nn.functional.max_pool1d(probs.reshape(b * h, 1, n), pool, stride=1, padding=pool // 2)
    return pooled.reshape(b, h, n)


def pick_salient(observer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float, fraction: float,
                 dtype: torch.dtype, pool: int) -> SalientTokens | None:
    """The ``ceil(fraction * n)`` rows per KV head of ``key/value [B, H_kv, n, d]`` most attended by the
    observation queries, sorted by row."""
    count = min(key.shape[2], math.ceil(fraction * key.shape[2] - 1e-9))  # 1e-9: 0.035 * 200 is not 7
    if count == 0:
        return None
    importance = observed_importance(observer, key, scaling, pool)
    index = importance.topk(count, dim=-1).indices.sort(dim=-1).values  # [B, H_kv, m]
    rows = index.unsqueeze(-1).expand(-1, -1, -1, key.shape[-1])
    return SalientTokens(index.to(torch.int32), to_storage(key.gather(2, rows), dtype),
                         to_storage(value.gather(2, rows), dtype))


@dataclass
class MiddleBlock:
    """One prefill chunk's compressed middle tokens ``start .. start+n-1`` (no padding among them)."""

    start: int
    n: int
    keys: list[PCACode]  # pre-RoPE keys [B, n, H_kv*d], one code per PCA scope (the layer, or each head)
    v_codes: torch.Tensor  # [B, H_kv, n, ceil(d/group * bits / 8)] uint8
    v_codebook: torch.Tensor  # [K, group] fp16
    v_scale: torch.Tensor  # [H_kv, d] fp16, per (head, rotated channel)
    salient: SalientTokens | None = None  # rows also held exact (their codes are masked in attention)

    def parts(self) -> dict[str, list[torch.Tensor]]:
        k = {kind: [t for code in self.keys for t in code.parts()[kind]] for kind in ("codes", "scales", "bases")}
        return {"k_codes": k["codes"], "k_scales": k["scales"], "k_bases": k["bases"],
                "v_codes": [self.v_codes], "v_scales": [self.v_scale], "v_codebooks": [self.v_codebook],
                "salient": [] if self.salient is None else self.salient.tensors()}


@dataclass
class TurboSegment:
    """TurboQuant codes of K and V ``[B, H_kv, n]`` (tokens after the prompt)."""

    keys: TurboCode | None = None
    values: TurboCode | None = None
    n: int = 0
    runs: list = None  # (first index, count) of each appended run; python ints, for `dequantized`

    def append(self, k: TurboCode, v: TurboCode, start: int, n: int) -> None:
        self.runs = (self.runs or []) + [(start, n)]
        if self.keys is None:
            self.keys, self.values, self.n = k, v, n
            return
        self.keys = TurboCode.cat(self.keys, k)
        self.values = TurboCode.cat(self.values, v)
        self.n += n

    def index(self, device) -> torch.Tensor:
        return torch.cat([torch.arange(s, s + n, device=device) for s, n in self.runs])

    def tensors(self) -> list[torch.Tensor]:
        return [] if self.keys is None else self.keys.tensors() + self.values.tensors()


def _stacked_codes(codes: list[PCACode]) -> torch.Tensor:
    """The packed codes of a block's PCA scopes side by side, ``[B, scopes, n, bytes]`` (narrower rows
    zero-padded: their slots never read the padding)."""
    if len(codes) == 1:
        return codes[0].codes.unsqueeze(-3)
    width = max(code.codes.shape[-1] for code in codes)
    rows = [torch.nn.functional.pad(code.codes, (0, width - code.codes.shape[-1])) for code in codes]
    return torch.stack(rows, dim=-3)


def _softmax_part(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probabilities, log-sum-exp)`` of ``scores [..., n]`` over the last dim."""
    lse = torch.logsumexp(scores, dim=-1)
    # a row whose tokens are all masked (salient rows held exact) has lse -inf and contributes nothing
    return torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0.0).unsqueeze(-1)), lse


# ----------------------------------------------------------------------------------------------- budgets
def pre_rope_key_spectra(model: torch.nn.Module, info, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the PCA variances of the pre-RoPE keys (all KV heads stacked) on ``input_ids``.

    Keys are captured at the output of ``k_proj`` (``k_norm`` where the model has one, as Qwen3),
    i.e. before RoPE, during one ordinary forward without a cache.
    """
    layers = model.model.layers
    captured: list[torch.Tensor | None] = [None] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        target = getattr(attn, "k_norm", None) or attn.k_proj

        def hook(_module, _inputs, output, i=i):
            captured[i] = output.detach().reshape(-1, info.num_kv_heads * info.head_dim).float()

        hooks.append(target.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [fit_pca(k, k.shape[1]).variances for k in captured]


def allocate_layer_budgets(spectra: list[torch.Tensor], key_bits: float, group: int,
                           drop_penalty: float = 4.0) -> list[float]:
    """Bits per key element for each layer: one DP over the component groups of all layers, with each
    layer's variances normalised by its total (relative error), under ``key_bits`` on average."""
    variances, sizes, owner = [], [], []
    for layer, spectrum in enumerate(spectra):
        rel = spectrum / spectrum.sum().clamp_min(1e-30)
        layer_sizes = group_sizes(rel.shape[0], group)
        variances += group_variances(rel, layer_sizes)
        sizes += layer_sizes
        owner += [layer] * len(layer_sizes)
    dim = spectra[0].shape[0]
    bits = allocate_bits(variances, sizes, int(round(key_bits * dim * len(spectra))), drop_penalty=drop_penalty)
    per_layer = [0.0] * len(spectra)
    for layer, b, size in zip(owner, bits, sizes):
        per_layer[layer] += b * size / dim
    return per_layer


def global_key_budgets(model: torch.nn.Module, info, cfg: ShardConfig) -> list[float]:
    """Per-layer key budgets from spectra measured on seeded random calibration tokens."""
    g = torch.Generator().manual_seed(cfg.seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, cfg.calibration_tokens), generator=g)
    spectra = pre_rope_key_spectra(model, info, ids)
    group = cfg.pca_group or max(1, info.num_kv_heads * info.head_dim // 16)
    return allocate_layer_budgets(spectra, cfg.key_bits, group, cfg.drop_penalty)


# ----------------------------------------------------------------------------------------------- layer
def _build(model: torch.nn.Module, info, multi_turn: bool = False, **options):
    from kvshrink.cache.base import KVShrinkCache
    from kvshrink.cache.integration import install

    cfg = ShardConfig(**options)
    cfg.validate(info.head_dim, info.num_kv_heads)
    shared = ShardShared(cfg, info.num_layers, info.head_dim)
    if cfg.key_alloc == "global":
        shared.layer_key_bits = global_key_budgets(model, info, cfg)
    cache = KVShrinkCache("shard", options, info, lambda spec: ShardLayer(spec, shared), multi_turn=multi_turn)
    install(model)
    return cache


@register_method(
    "shard",
    "Shard: PCA+int keys with RoPE undone, Hadamard+VQ values, exact sinks and window, TurboQuant decode stream",
    options=ShardConfig,
    build=_build,
    undoes_rope=True,
)
class ShardLayer(CacheLayer):
    split_batch_rows = True  # PCA bases, bit allocation and scales fitted per row
    def __init__(self, spec: LayerSpec, shared: ShardShared):
        super().__init__(spec)
        self.shared = shared
        self.cfg = shared.cfg
        self.h_kv, self.d = self.info.num_kv_heads, self.info.head_dim
        dtype = exact_storage_dtype(self.cfg.exact_dtype, self.info.dtype)
        self.sinks = ExactStore(dtype)
        self.window = ExactStore(dtype)
        self.middle: list[MiddleBlock] = []
        self.stream = TurboSegment()
        self.decoding = False
        self._query_energy: torch.Tensor | None = None   # key_weights="query": [H_kv, d] of the prompt
        self._observer: torch.Tensor | None = None       # salient > 0: the chunk's last queries, grouped

    def shared_on_fork(self) -> list:
        return list(self.middle)  # a compressed block is never changed once made

    # ---- attention ---------------------------------------------------------------------------------
    def past_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        if ctx.q_len > 1 and self.cfg.key_weights == "query":
            self._query_energy = self.query_pair_energy(query, ctx)
        if ctx.q_len > 1 and self.cfg.salient > 0:
            self._observer = group_queries(query[:, :, -self.cfg.observe:].float(), self.h_kv)
        exact = self.exact_partial(query, ctx)
        parts = [exact] if exact is not None else []
        for block in self.middle:
            parts.extend(self.middle_partials(block, query, ctx))
        if self.stream.n:
            parts.append(self.stream_partial(query, ctx.scaling))
        if self.layer_idx == self.info.num_layers - 1:
            self.shared.end_of_step()
        return parts

    def exact_partial(self, query: torch.Tensor, ctx: StepContext) -> Partial | None:
        """One exact attention over the sinks, the salient middle tokens and the window together (they
        are few: one kernel call and one partial to merge per layer and step)."""
        runs = [run for run in (self.sinks, self.window) if len(run)]
        salient = [block for block in self.middle if block.salient is not None]
        if not runs and not salient:
            return None
        if len(runs) == 1 and not salient:
            return runs[0].partial(query, ctx.scaling, ctx.pad_len)
        device = (runs[0].keys if runs else salient[0].salient.keys).device
        keys, values, index = [], [], []
        for run in runs:
            keys.append(run.keys), values.append(run.values)
            index.append(run.token_index())
        for block in salient:
            # rows differ per head, but the index only serves the padding mask: middle tokens are never
            # padding, so the block's first index stands for all of them
            keys.append(block.salient.keys), values.append(block.salient.values)
            index.append(torch.full((block.salient.index.shape[-1],), block.start, device=device))
        return exact_partial(query, torch.cat(keys, dim=2), torch.cat(values, dim=2), ctx.scaling,
                             key_index=torch.cat(index), pad_len=ctx.pad_len)

    def key_decoder(self, block: MiddleBlock) -> TableDecoder:
        """The decoder of ``block``'s key codes (lookup tables built once), giving each head's channels
        in RoPE `pair_order` (a free permutation of the basis) so RoPE is one complex product."""
        pairs = pair_order(self.d, device=block.v_codes.device)
        columns = torch.cat([h * self.d + pairs for h in range(self.h_kv // len(block.keys))])
        return TableDecoder(block.keys, columns=columns, table_dtype=torch.float16)

    def middle_keys(self, block: MiddleBlock, start: int, stop: int, ctx: StepContext,
                    paired: bool = False, decoder: TableDecoder | None = None) -> torch.Tensor:
        """Post-RoPE keys ``[B, H_kv, n, d]`` of block rows ``start:stop``, rebuilt from the codes;
        ``paired=True`` returns each head's channels in RoPE pair order (score them against queries
        in the same order), else in the model's order."""
        pre = (decoder or self.key_decoder(block))(start, stop)     # [B, scopes, n, H*d/scopes]
        if pre.shape[1] != self.h_kv:                                # one PCA over the layer
            b, _, n, _ = pre.shape
            pre = pre.reshape(b, n, self.h_kv, self.d).transpose(1, 2)
        keys = apply_rope_paired(pre, self.shared.phases(ctx, block.start + start, stop - start))
        return keys if paired else keys[..., torch.argsort(pair_order(self.d, device=keys.device))]

    def middle_values(self, block: MiddleBlock, probs: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        """``probs [B, H_kv, R, n] @ V[start:stop]`` ``[B, H_kv, R, d]`` from the VQ codes."""
        k_entries, group = block.v_codebook.shape
        n_groups = self.d // group
        idx = unpack_bits(block.v_codes[:, :, start:stop], int(math.log2(k_entries)), n_groups)  # [B,H,n,G]
        codebook = block.v_codebook.float()
        b, h, r, n = probs.shape
        if r * n_groups <= 2 * self.d:
            # Code domain: sum the probabilities per codeword and group, then one small product.
            flat = idx + torch.arange(n_groups, device=idx.device) * k_entries
            flat = flat.reshape(b, h, 1, n * n_groups).expand(b, h, r, n * n_groups)
            src = probs.unsqueeze(-1).expand(b, h, r, n, n_groups).reshape(b, h, r, n * n_groups)
            bins = torch.zeros(b, h, r, n_groups * k_entries, device=probs.device, dtype=probs.dtype)
            bins.scatter_add_(-1, flat, src)
            return self.values_from_bins(block, bins)
        values = codebook[idx].reshape(b, h, n, self.d)
        return self.unscale_values(block, probs @ values)

    def values_from_bins(self, block: MiddleBlock, bins: torch.Tensor) -> torch.Tensor:
        """Attention output ``[B, H_kv, R, d]`` from the probabilities summed per value group and codeword
        ``bins [B, H_kv, R, groups * entries]``: one product with the codebook."""
        k_entries = block.v_codebook.shape[0]
        b, h, r, _ = bins.shape
        rotated = bins.reshape(b, h, r, -1, k_entries) @ block.v_codebook.float()
        return self.unscale_values(block, rotated.reshape(b, h, r, self.d))

    def unscale_values(self, block: MiddleBlock, rotated: torch.Tensor) -> torch.Tensor:
        """Rotated, scaled value sums ``[B, H_kv, R, d]`` -> in the model's value space."""
        return self.shared.rotation.unrotate(rotated * block.v_scale.float()[None, :, None, :])

    def middle_partials(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        if self.use_fast_kernel(query):
            return [self.fused_middle_partial(block, query, ctx)]
        return self.reference_middle_partials(block, query, ctx)

    def use_fast_kernel(self, query: torch.Tensor) -> bool:
        rows = query.shape[1] // self.h_kv * query.shape[2]
        return self.shared.fast and query.device.type == "cpu" and rows <= _FAST_ROWS

    def fused_middle_partial(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> Partial:
        """The block's partial from `codecs.fused.code_attention`: one pass over its packed key codes
        (keys summed from lookup tables, RoPE, scores) and one over its value codes (softmax
        probabilities summed per codeword), no key or value materialised; same result as the reference
        path within float32 rounding."""
        pairs = pair_order(self.d, device=query.device)
        qg = group_queries(query.float(), self.h_kv)[..., pairs].contiguous()  # keys come in pair order
        plan = self.slot_plan(block)
        scaled, mean = scaled_bases(block.keys, plan.columns)
        cos, sin = self.shared.pair_rope(ctx, block.start, block.n)
        hidden = None if block.salient is None else block.salient.index
        k_entries, group = block.v_codebook.shape
        bins, lse = fused.code_attention(
            _stacked_codes(block.keys), plan, scaled, mean, cos, sin, qg, ctx.scaling, hidden,
            block.v_codes, int(math.log2(k_entries)), self.d // group)
        out = self.values_from_bins(block, bins)
        return Partial(ungroup(out, query.shape[1]), ungroup(lse, query.shape[1]))

    def slot_plan(self, block: MiddleBlock) -> SlotPlan:
        """The block's `SlotPlan` (key codes' run layout as integers, a few hundred bytes), built on first
        use and kept on the block outside its dataclass fields: rebuilt after a block is copied or loaded."""
        plan = getattr(block, "_slot_plan", None)
        if plan is None:
            pairs = pair_order(self.d, device=block.v_codes.device)
            plan = slot_plan(block.keys, columns=torch.cat([h * self.d + pairs for h in range(self.h_kv // len(block.keys))]))
            block._slot_plan = plan
        return plan

    def reference_middle_partials(self, block: MiddleBlock, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        qg = group_queries(query.float(), self.h_kv)  # [B, H_kv, R, d]
        qg = qg[..., pair_order(self.d, device=qg.device)]  # the keys come in RoPE pair order
        b, _, r, _ = qg.shape
        step = max(64, min(self.cfg.block_tokens, _SCORE_ELEMENTS // max(1, b * self.h_kv * r)))
        parts = []
        decoder = self.key_decoder(block)
        hidden = None if block.salient is None else block.salient.hidden(block.n)
        for start in range(0, block.n, step):
            stop = min(block.n, start + step)
            keys = self.middle_keys(block, start, stop, ctx, paired=True, decoder=decoder)
            scores = qg @ keys.transpose(-1, -2) * ctx.scaling
            if hidden is not None:
                scores.masked_fill_(hidden[..., start:stop], float("-inf"))
            probs, lse = _softmax_part(scores)
            out = self.middle_values(block, probs, start, stop)
            parts.append(Partial(ungroup(out, query.shape[1]), ungroup(lse, query.shape[1])))
        return parts

    def stream_partial(self, query: torch.Tensor, scaling: float) -> Partial:
        qg = group_queries(query.float(), self.h_kv)
        turbo = self.shared.turbo
        probs, lse = _softmax_part(turbo.inner_products(qg, self.stream.keys) * scaling)
        out = turbo.weighted_sum(probs, self.stream.values)
        return Partial(ungroup(out, query.shape[1]), ungroup(lse, query.shape[1]))

    # ---- storing ---------------------------------------------------------------------------------------
    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        q = key.shape[2]
        if q == 1:
            self.decoding = True
        first = ctx.past_len
        # With left padding the sinks are each row's first real tokens: keep every index below
        # max(pad) + sinks exact (padding included, masked in attention).
        sinks_len = self.cfg.sinks + (int(ctx.pad_len.max()) if ctx.pad_len is not None else 0)
        to_sinks = max(0, min(q, sinks_len - first))
        if to_sinks:
            self.sinks.append(key[:, :, :to_sinks], value[:, :, :to_sinks], ctx.new_index[:to_sinks])
        if to_sinks < q:
            self.window.append(key[:, :, to_sinks:], value[:, :, to_sinks:], ctx.new_index[to_sinks:])
        overflow = len(self.window) - self.cfg.window
        if overflow <= 0:
            return
        start = self.window.start
        k, v = (x.float() for x in self.window.pop_front(overflow))
        if not self.decoding and overflow >= self.cfg.min_block:
            self.middle.append(self.compress_block(k, v, start, ctx))
        else:
            self.stream.append(self.shared.turbo.encode(k), self.shared.turbo.encode(v), start, overflow)

    def key_bits_per_component(self, spectra: list[torch.Tensor]) -> list[list[int]]:
        """Bits per component of each PCA scope: one DP over the groups of all scopes of the layer
        under the layer's budget (``layer_key_bits * H_kv * d`` bits per token)."""
        dim = self.h_kv * self.d
        scope_dim = dim // len(spectra)
        group = self.cfg.pca_group or max(1, scope_dim // 16)
        sizes = [group_sizes(v.shape[0], group) for v in spectra]
        variances = [g for v, sz in zip(spectra, sizes) for g in group_variances(v, sz)]
        flat_sizes = [s for sz in sizes for s in sz]
        budget = int(round(self.shared.layer_key_bits[self.layer_idx] * dim))
        bits = iter(allocate_bits(variances, flat_sizes, budget, drop_penalty=self.cfg.drop_penalty))
        return [[b for s in sz for b in [next(bits)] * s] for sz in sizes]

    def query_pair_energy(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """``[H_kv, d]``: mean squared query of each KV head's group per RoPE pair (both channels of a
        pair alike: RoPE only rotates within pairs, so this is position-free), over real tokens."""
        qg = group_queries(query.float(), self.h_kv).pow(2)                      # [B, H_kv, G*q, d]
        q = query.shape[2]
        real = torch.ones(query.shape[0], q, device=qg.device)
        if ctx.pad_len is not None:
            real = (ctx.new_index[None, -q:] >= ctx.pad_len[:, None]).float().to(qg.device)
        real = real.repeat(1, qg.shape[2] // q)[:, None, :, None]               # rows are (group, token)
        energy = (qg * real).sum((0, 2)) / real.sum().clamp_min(1)
        half = self.d // 2
        pair = (energy[:, :half] + energy[:, half:]) / 2
        return torch.cat([pair, pair], dim=-1)

    def key_column_scale(self, width: int) -> torch.Tensor | None:
        """Per scope column, what the pre-RoPE keys are divided by before PCA: ``1/sqrt(weight)``, so
        the PCA and the bit allocation minimise the query-weighted error (fp16, as stored)."""
        energy = self._query_energy
        if self.cfg.key_weights != "query" or energy is None:
            return None
        weight = (energy / energy.mean().clamp_min(1e-30)).clamp_min(_MIN_QUERY_WEIGHT)
        return weight.rsqrt().reshape(-1, width).to(torch.float16)             # [scopes, width]

    def compress_block(self, key: torch.Tensor, value: torch.Tensor, start: int, ctx: StepContext) -> MiddleBlock:
        # One helper per path, so each path's full-size temporaries are freed before the next starts
        # (extra peak memory stays below one layer's prompt K+V; measured by a test).
        keys = self.encode_keys(key, start, ctx)
        v_codes, codebook, scale = self.encode_values(value)
        salient = None
        observer, self._observer = self._observer, None  # this chunk's; a later chunk brings its own
        if self.cfg.salient > 0 and observer is not None:
            salient = pick_salient(observer, key, value, ctx.scaling, self.cfg.salient,
                                   self.sinks.dtype, self.cfg.salient_pool)
        return MiddleBlock(start=start, n=key.shape[2], keys=keys, v_codes=v_codes, v_codebook=codebook,
                           v_scale=scale, salient=salient)

    def encode_keys(self, key: torch.Tensor, start: int, ctx: StepContext) -> list[PCACode]:
        """Post-RoPE keys ``[B, H_kv, n, d]`` -> one `PCACode` of the pre-RoPE keys per PCA scope."""
        b, h, n, d = key.shape
        cos, sin = self.shared.rope(ctx, start, n)
        scopes = h if self.cfg.pca_scope == "head" else 1
        width = h * d // scopes
        column_scale = self.key_column_scale(width)
        scales = [None] * scopes if column_scale is None else list(column_scale)

        def scope_rows(s: int) -> torch.Tensor:
            """Pre-RoPE keys of scope ``s`` ``[B, n, width]``, divided by its column scale."""
            x = undo_rope(key[:, s], cos, sin) if scopes == h else \
                undo_rope(key, cos, sin).transpose(1, 2).reshape(b, n, h * d)
            return x if scales[s] is None else x.div_(scales[s].float())

        rank = min(self.cfg.rank or width, width)
        fits = [fit_pca(scope_rows(s).reshape(b * n, width), rank, seed=self.cfg.seed) for s in range(scopes)]
        bits = self.key_bits_per_component([f.variances for f in fits])
        # RoPE is undone again rather than kept from the fits: one scope's keys are alive at a time
        return [encode_pca(scope_rows(s), fits[s], bits[s], levels=self.cfg.k_levels, column_scale=scales[s])
                for s in range(scopes)]

    def encode_values(self, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Values ``[B, H_kv, n, d]`` -> packed VQ indices, the codebook, per-(head, channel) scales.

        One head at a time (the rotation is redone rather than kept), so a layer's rotated values
        never exist at once; only ``v_fit="kmeans"`` rotates the whole layer to sample from it."""
        b, h, n, d = value.shape
        group = self.cfg.v_group
        rotate = self.shared.rotation.rotate
        scale = torch.stack([rotate(value[:, s]).pow(2).mean(dim=(0, 1)) for s in range(h)])
        scale = scale.sqrt().clamp_min(1e-6).to(torch.float16)                       # [H, d]
        codebook = self.shared.v_codebook.to(value.device)
        if self.cfg.v_fit == "kmeans":
            groups = rotate(value).div_(scale.float()[None, :, None, :]).reshape(-1, group)
            codebook = fit_codebook(groups, self.cfg.v_codebook, iters=self.cfg.v_iters, sample=self.cfg.v_sample,
                                    seed=self.cfg.seed + self.layer_idx, init=codebook)
            del groups
        codebook = codebook.to(torch.float16)
        idx = torch.empty(b, h, n, d // group, dtype=torch.int32, device=value.device)
        for s in range(h):
            rows = rotate(value[:, s]).div_(scale[s].float()).reshape(-1, group)
            idx[:, s] = assign_codes(rows, codebook.float(), out_dtype=torch.int32).reshape(b, n, d // group)
        return pack_bits(idx, int(math.log2(self.cfg.v_codebook))), codebook, scale

    def dequantized(self, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every stored token rebuilt in float32: ``(keys, values [B, H_kv, n, d], index [n])``.

        For tests and debugging only (attention never does this): exact attention over these
        tensors is what `past_partials` computes blockwise from the packed store.
        """
        keys, values, index = [], [], []
        device = ctx.offset.device
        for run in (self.sinks,):
            if len(run):
                keys.append(run.keys.float()), values.append(run.values.float())
                index.append(run.token_index())
        for block in self.middle:
            k = self.middle_keys(block, 0, block.n, ctx)
            b, h = block.v_codes.shape[:2]
            eye = torch.eye(block.n, device=device).expand(b, h, block.n, block.n)
            v = self.middle_values(block, eye, 0, block.n)
            if block.salient is not None:
                rows = block.salient.index.long().unsqueeze(-1).expand(-1, -1, -1, self.d)
                k = k.scatter(2, rows, block.salient.keys.float())
                v = v.scatter(2, rows, block.salient.values.float())
            keys.append(k), values.append(v)
            index.append(torch.arange(block.start, block.start + block.n, device=device))
        if self.stream.n:
            keys.append(self.shared.turbo.decode(self.stream.keys))
            values.append(self.shared.turbo.decode(self.stream.values))
            index.append(self.stream.index(device))
        if len(self.window):
            keys.append(self.window.keys.float()), values.append(self.window.values.float())
            index.append(self.window.token_index())
        return torch.cat(keys, 2), torch.cat(values, 2), torch.cat(index)

    # ---- accounting -------------------------------------------------------------------------------------
    def breakdown(self) -> dict[str, int]:
        out = {"sinks": held_bytes(self.sinks.tensors()), "window": held_bytes(self.window.tensors())}
        for kind in ("k_codes", "k_scales", "k_bases", "v_codes", "v_scales", "v_codebooks", "salient"):
            out[f"middle_{kind}"] = 0
        for block in self.middle:
            for kind, tensors in block.parts().items():
                out[f"middle_{kind}"] += held_bytes(tensors)
        out["stream"] = held_bytes(self.stream.tensors())
        # the fast kernel's per-block slot plans (integers, built on first decode step)
        plans = [getattr(block, "_slot_plan", None) for block in self.middle]
        out["middle_slot_plans"] = sum(plan.nbytes() for plan in plans if plan is not None)
        return out

    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def stats(self) -> dict[str, float]:
        return {"middle_tokens": float(sum(b.n for b in self.middle)), "stream_tokens": float(self.stream.n)}

    def clear(self) -> None:
        dtype = exact_storage_dtype(self.cfg.exact_dtype, self.info.dtype)
        self.sinks, self.window = ExactStore(dtype), ExactStore(dtype)
        self.middle, self.stream, self.decoding = [], TurboSegment(), False
        self._query_energy = self._observer = None
