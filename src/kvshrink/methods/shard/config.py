"""Shard's options: `ShardConfig`, the one declaration (help, choices, ranges) of every option."""

from __future__ import annotations

import math
from dataclasses import dataclass

from kvshrink.cache.registry import option
from kvshrink.cache.store import EXACT_DTYPE_CHOICES
from kvshrink.codecs.scalar_levels import COEFF_LEVELS
from kvshrink.codecs.vq import check_codebook_size
from kvshrink.methods.shard.salient import SALIENT_DTYPES

STREAM_BITS = (2, 3, 4, 8)
V_FITS = ("gaussian", "kmeans")
KEY_ALLOCS = ("layer", "global")
PCA_SCOPES = ("layer", "head")
KEY_WEIGHTS = ("none", "query")
KERNELS = ("fast", "reference")
DEFAULT_KL_BUDGET = 0.012  # nats per token; `kl_budget`'s default and `calibrate_shard`'s


@dataclass
class ShardConfig:
    """Shard's options (the one declaration: help, choices and ranges live here)."""

    sinks: int = option(4, "first tokens kept exact (attention sinks)", low=0)
    window: int = option(32, "most recent tokens kept exact", low=0)
    key_bits: float = option(1.5, "bits per key element for the compressed middle (PCA coefficients)",
                             low=0, high=8, low_open=True)
    v_group: int = option(4, "channels per value VQ group (must divide the head size)", low=1)
    v_codebook: int = option(256, "value VQ codebook entries (power of two, 2..256)", low=2, high=256)
    v_centre: bool = option(True, "code each KV head's values less their mean over the block (stored in fp16, "
                            "added back by attention): values share a common part of 2-54% of their energy, which "
                            "a codebook centred on zero spends its levels on")
    v_fit: str = option("gaussian", "value codebook: 'gaussian' (fixed, data-independent) or 'kmeans' (refined "
                        "per block on a sample)", choices=V_FITS)
    v_iters: int = option(4, "k-means iterations when v_fit='kmeans'", low=0)
    v_sample: int = option(8192, "group vectors sampled to refine the codebook when v_fit='kmeans' "
                           "(>= v_codebook)", low=2)
    pca_group: int = option(0, "PCA components per DP bit-allocation group (0 = H_kv*d/16)", low=0)
    rank: int = option(0, "PCA components computed per scope (0 = one per 4 bits of the scope's key budget: "
                       "key_bits * width / 4)", low=0)
    pca_scope: str = option("layer", "one key PCA per 'layer' (all KV heads stacked, as the source: the heads "
                            "share components, so the same bits keep more of the keys) or per 'head' (cheaper "
                            "to decode)", choices=PCA_SCOPES)
    rope_frame: int = option(1, "positions per RoPE frame of the middle's keys: a key is coded with RoPE undone to "
                             "the first position of its frame, not to position 0 (1: undone fully, the source's "
                             "pre-RoPE keys). A decode step on the CPU fast path then turns the queries once per "
                             "frame and projects them on the PCA bases, and scores each token by one product with "
                             "its coefficients, instead of rebuilding every key", low=1)
    k_levels: str = option("lloyd", "key coefficient levels: 'lloyd' (2**b Gaussian Lloyd-Max levels) or "
                           "'uniform' (symmetric ints, the source's int4)", choices=COEFF_LEVELS)
    drop_penalty: float = option(1.0, "error multiplier for dropping a component group in the DP (1: the "
                                 "squared error it adds, weighed against each width's measured quantization "
                                 "error)", low=1)
    stream_bits: int = option(4, "TurboQuant bits for tokens leaving the window during decode", choices=STREAM_BITS)
    qjl: bool = option(False, "add a 1-bit QJL residual sketch to the decode stream")
    seed: int = option(0, "seed of the rotations and codebooks")
    exact_dtype: str = option("auto", "dtype of exact tokens (sinks, window; salient ones when salient_dtype='exact'): 'auto' (the model's dtype "
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
    salient: float = option(0.05, "fraction of each block's middle tokens held apart from its codes per KV "
                            "head (exact or 8-bit, see salient_dtype): those the prompt's last `observe` queries "
                            "attend to most (SnapKV-style; see `salient_read`)", low=0, high=0.5)
    ratio: float = option(12.0, "compression target (an fp16 cache's bytes over the bytes held) for a prompt that "
                          "ends with its question: each layer evicts its least-attended middle tokens (by the "
                          "last `observe` queries, pooled like `salient`) until its bytes meet it, but never more "
                          "than `evict` allows. Reached once the evicted tokens are dropped (the first decode step "
                          "after the prompt; a prompt continued, forked or saved keeps them), where the guard "
                          "and `keep_tokens` allow (12.8x at 8K on the embedded model, 7.4x, every token kept, "
                          "at 4K; 0 = no target: `evict` alone decides)", low=0)
    evict: float = option(0.1, "the guard of `ratio`: the largest share of any KV head's observed attention the "
                          "evicted middle tokens of a block may hold together (with ratio=0, each block's least-"
                          "attended tokens go up to this share; 0 = keep every token, whatever `ratio` says; 1 = "
                          "no guard)", low=0, high=1)
    keep_tokens: int = option(4096, "fewest tokens a layer holds once it evicts: a prompt no longer than this keeps "
                              "every token, a longer one evicts at most the tokens beyond it (a short prompt has "
                              "few to spare: on the embedded model's 4K essay, evicting a quarter of it for 10x "
                              "lost the needle its question asked for; 0 = no floor)", low=0)
    salient_dtype: str = option("int8", "how salient tokens are held: 'exact' (in exact_dtype) or 'int8' (8-bit "
                                "codes, one float16 step and zero point per token vector: about half the bytes)",
                                choices=SALIENT_DTYPES)
    cold: float = option(0.05, "share of each KV head's observed attention (by the prompt's last `observe` queries, "
                         "pooled like `salient`) the middle's least-read tokens may hold together and be coded "
                         "cheaper, in a block of their own: keys at `cold_key_bits`, values in VQ groups of "
                         "`cold_v_group` channels (how many is decided by how peaked the layer's attention is; "
                         "0 = every middle token coded alike)", low=0, high=1)
    cold_key_bits: float = option(1.0, "bits per key element of the cold tokens (see `cold`; scaled with the layer's "
                                  "budget when key_alloc='global')", low=0, high=8, low_open=True)
    cold_v_group: int = option(0, "channels per value VQ group of the cold tokens (see `cold`; `v_codebook` "
                               "entries: 8 channels with 256 entries is 1 bit per value element; 0 = the largest "
                               "divisor of the head size up to 8)", low=0)
    observe: int = option(64, "last prompt queries whose attention picks the salient and the evicted tokens", low=1)
    observe_tail: int = option(0, "the last of the `observe` queries that also judge on their own: a token counts as "
                               "read as much as the more of the two observations reads it (the question at the "
                               "prompt's end weighs fully while the wider tail protects what copies later read; "
                               "0 = the `observe` queries alone)", low=0)
    salient_read: float = option(0.25, "share of the salient rows picked as the most read of the tokens themselves "
                                 "rather than in spans around the strongest reads (`salient_pool`): spans serve a "
                                 "question at the prompt's end (the fact and the tokens copied after it), the most "
                                 "read tokens a document compressed before its questions", low=0, high=1)
    salient_pool: int = option(33, "tokens around an attended one that count as attended too (odd) when choosing "
                               "the evicted, the cold and the salient tokens (but `salient_read` of them): a fact "
                               "spans several tokens, and the ones after an attended token are copied next", low=1)
    kl_budget: float = option(DEFAULT_KL_BUDGET, "KL(full || shard) in nats per token the cache may cost on a "
                              "calibration text (`calibrate_shard`): `window`, `salient`, `cold`, `cold_key_bits`, "
                              "`observe` and `observe_tail` are chosen per model, the cheapest setting of a short "
                              "ladder within it, measured once per model and options when the first cache is made "
                              "and stored for later processes. Naming any of those options turns it off (their "
                              "defaults are the ladder's careful setting), as does 0; naming both is refused. "
                              "The calibration tokenizes its text with the tokenizer `load_model` attaches, or one "
                              "saved beside the model; without one, the careful setting is used, with a warning",
                              low=0)
    kernel: str = option("fast", "compressed-segment decode on CPU: 'fast' (numba kernels: the middle around "
                         "one batched product per slice of tokens, its values and the stream in one pass each, "
                         "when kvshrink[fast] is installed; else the torch ops) or 'reference' (torch ops, the "
                         "tests' oracle); the same answers up to float rounding. On "
                         "CUDA tensors Triton kernels decode the middle and the stream whatever this says (when "
                         "Triton is installed: kvshrink[gpu]; else the torch ops)", choices=KERNELS)

    def __post_init__(self):
        try:
            check_codebook_size(self.v_codebook)
        except ValueError:
            self._bad(f"v_codebook must be a power of two in 2..256, got {self.v_codebook}")
        if self.v_sample < self.v_codebook:
            self._bad(f"v_sample must be >= v_codebook ({self.v_codebook}), got {self.v_sample}")
        if 0 < self.ratio <= 1:
            self._bad(f"ratio must be 0 (off) or above 1 (a target compression), got {self.ratio}")
        if self.salient_pool % 2 == 0:
            self._bad(f"salient_pool must be an odd number >= 1, got {self.salient_pool}")
        if self.observe_tail >= self.observe:
            self._bad(f"observe_tail must be fewer than observe ({self.observe}) queries, got {self.observe_tail}")

    @staticmethod
    def _bad(msg: str):
        raise ValueError(f"shard: {msg}")

    def validate(self, head_dim: int, num_kv_heads: int) -> None:
        """The checks that depend on the model's attention shape."""
        if head_dim % self.v_group:
            self._bad(f"v_group must divide the head size {head_dim}, got {self.v_group}")
        if self.cold > 0 and self.cold_v_group and head_dim % self.cold_v_group:
            self._bad(f"cold_v_group must divide the head size {head_dim}, got {self.cold_v_group}")
        if self.rank > head_dim * num_kv_heads:
            self._bad(f"rank must be in 0..{head_dim * num_kv_heads} (0 = all), got {self.rank}")

    def cold_group(self, head_dim: int) -> int:
        """Channels per value VQ group of the cold tokens: `cold_v_group`, or for 0 the largest divisor of the head
        size up to 8 (8 on every head size a multiple of 8)."""
        return self.cold_v_group or max(g for g in range(1, 9) if head_dim % g == 0)

    def pca_scopes(self, num_kv_heads: int) -> int:
        """Key PCAs per layer: one per KV head, or one for all of them."""
        return num_kv_heads if self.pca_scope == "head" else 1

    @property
    def observations(self) -> tuple[int, ...]:
        """How many of the prompt's last queries each observation holds (`observe`, then `observe_tail`)."""
        return (self.observe, self.observe_tail) if self.observe_tail else (self.observe,)

    @property
    def evicts(self) -> bool:
        """Whether the prompt's least-attended middle tokens may be evicted (`evict` > 0; `ratio` sets how many)."""
        return self.evict > 0

    @property
    def v_bits_per_element(self) -> float:
        return math.log2(self.v_codebook) / self.v_group
