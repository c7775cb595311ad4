"""``lrqk``: low-rank query/key scoring, exact top-k attention, and a two-tier cache.

Per layer (see docs/design methods.md §2 and ``codecs/lowrank.py`` for the math):

- **prefill** attention is exact. The Grams ``QᵀQ`` (queries of a KV head's group stacked) and ``KᵀK``
  are accumulated chunk by chunk and the joint factorization is fitted from them after each prefill
  chunk; the key factors ``A_K`` of every token (``[B, F, T, r]``, F = KV heads by default) are the
  only per-token data in fast memory besides the slots and the window.
- **decode**: the new token's ``q̂`` (per query head) and ``k̂`` come from closed-form updates
  against the resident tokens, the bases take one exact-line-search step, proxy scores ``A_K q̂``
  rank every token older than the window, and the per-KV-head top-k (by estimated attention mass
  summed over the group) is made resident in the slots (``tiers.SlotTier``), moving only the
  missing rows from the slow tier. Attention is exact over the selected slots, the window and the
  current token.
- **slow tier**: every token's full K/V (``cpu`` or ``disk``), never counted in ``nbytes()``.

``kernel="fast"`` (the default) answers a decode step with fewer, larger operations: on CPU with
``kvshrink[fast]``, the default layout's whole step (factor update, selection, slot fill, attention) in one
numba call per layer (``cpu_step``); elsewhere one attention call over slots, window and the new token,
with the per-token factor update and the slot bookkeeping in numba kernels when numba is installed.
``kernel="reference"`` is the plain torch path, the oracle of ``tests/test_lrqk_fast.py``. All give the
same answers up to float rounding.

On the GPU path (``kernels.backend.gpu_path``: CUDA tensors, or forced on CPU with Triton's interpreter)
the fast decode step runs ``kernels/lrqk_proxy.py``'s Triton kernels (proxy scores to per-KV-head mass,
written once, then ``torch.topk`` on the device; an attention that reads the selected slots by index, the
window and the new token) and ``SlotTier.select_device`` (the slot bookkeeping in tensor ops); its one
host synchronisation per layer is the miss transfer (which rows to fetch from the slow tier), which also
carries the deferred float16 range checks. The slow tier's rows move through pinned buffers with
non-blocking copies; with ``prefetch=True`` the next-ranked tokens ride on the same transfer.
Oracle: ``tests/test_lrqk_triton.py``. On each device the kernels are trusted once a fresh layer of the same
options has decoded the same through them as through the torch path (``kvshrink.kernels.selfcheck``, one
check of the whole step); until then, or where they disagree, the step keeps the torch path.

When ``top_k`` covers every token older than the window the selection is all of them, so the output
equals ``full`` (up to float rounding of the log-sum-exp merge).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kvshrink.cache.attention import Partial, exact_partial
from kvshrink.cache.base import CacheLayer, LayerSpec, StepContext
from kvshrink.cache.probe import step_trusted
from kvshrink.cache.record import Record, RecordReader, Schema, TensorSpec
from kvshrink.cache.registry import option, register_method
from kvshrink.cache.store import (
    EXACT_DTYPE_CHOICES,
    STORAGE_DTYPES,
    exact_storage_dtype,
    held_bytes,
    storage_overflow_check,
    to_storage,
)
from kvshrink.kernels.backend import gpu_path, triton_available
from kvshrink.kernels.cpu import first_use, lrqk_factor, lrqk_proxy, numba_support, warm_up
from kvshrink.codecs.lowrank import (
    decode_factor_vectors,
    default_rank,
    factor_vectors_from_sums,
    fit_lowrank_qk,
    gram,
    key_factors,
    line_search_basis_step,
)
from kvshrink.methods.lrqk import cpu_step
from kvshrink.methods.lrqk.report import (
    layer_stats,
    new_counters,
    record_fill,
    record_mass_recall,
    record_prefetch,
)
from kvshrink.methods.lrqk.tiers import (
    POLICIES,
    SLOW_TIERS,
    FillReport,
    SlotTier,
    SlowTier,
    check_narrowed,
    half_words,
    make_slow_tier,
    shift_in_narrowed,
    state_tensors,
    warm_up_fill_planner,
)

__all__ = ["LRQKLayer", "LRQKOptions"]

FACTOR_HEADS = ("kv", "query")
KERNELS = ("fast", "reference")
# Growth step of the key-factor buffer (tokens): the unused tail is held, so it is counted.
_FACTOR_BLOCK = 256
# Index given to slots that are resident but not selected: later than any query, so masked.
_NEVER = 1 << 62


@dataclass
class LRQKOptions:
    """LRQK's options (the one declaration: help, choices and ranges live here)."""

    rank: int | None = option(None, "rank r of the query/key factors (default head_size/4: 16 for 64, 32 for 128)",
                              low=1)
    top_k: int = option(256, "tokens older than the window attended per KV head (exactly)", low=1)
    window: int = option(64, "most recent tokens always attended (kept in fast memory)", low=0)
    iters: int = option(2, "alternating iterations of the prefill factorization", low=1)
    tol: float = option(1e-2, "stop the prefill iterations once the objective changes by less (relative)", low=0)
    lam: float = option(1.0, "weight of the Q/K reconstruction penalties", low=0, low_open=True)
    fast_device: str = option("auto", "device of the fast tier: auto (the model's device), cpu, cuda, cuda:N")
    slow_tier: str = option("cpu", "where every token's full K/V lives", choices=SLOW_TIERS)
    disk_folder: str | None = option(None, "folder for slow_tier=disk (a private subfolder is made and removed)")
    policy: str = option("set", "slot replacement: set (paper), lru, attention", choices=POLICIES)
    extra_slots: int | None = option(None, "slots beyond top_k for lru/attention/prefetch (default top_k/4)", low=0)
    prefetch: bool = option(False, "load the next-ranked rows in the background for the next step")
    prefill_chunk: int | None = option(None, "block of past tokens read at once by chunked-prefill attention",
                                       low=1)
    factor_heads: str = option("kv", "key factors per KV head (kv) or per query head (query)", choices=FACTOR_HEADS)
    factor_dtype: str = option("float16", "dtype of the stored key factors", choices=tuple(STORAGE_DTYPES))
    slot_dtype: str = option("auto", "dtype of the K/V rows in fast memory (slots, window): auto (the model's "
                             "dtype if 16-bit, else float16, as an fp16 cache holds them), model, or "
                             "float16/bfloat16/float32 (the slow tier keeps the model's dtype)",
                             choices=EXACT_DTYPE_CHOICES)
    selection: str = option("proxy", "proxy (LRQK) or exact (diagnostic: exact scores read from the slow tier, "
                            "the selection LRQK approximates)", choices=("proxy", "exact"))
    fit_resident: bool = option(True, "decode: fit q̂ to reproduce the exact scores of the resident tokens (paper)")
    update_bases: bool = option(True, "take the line-search step on the bases at each decode step")
    seed: int = option(0, "seed of the random initialisation of the factorization")
    measure_recall: bool = option(False, "diagnostic: record the exact attention mass the top-k captures "
                                  "(reads every key from the slow tier each step; slow)")
    kernel: str = option("fast", "decode path: fast (with kvshrink[fast] on CPU, the whole step of the default "
                         "layout in one numba call per layer, else one attention call over slots, window and new token "
                         "with the factor update and the slot bookkeeping in numba kernels) or reference (plain torch "
                         "ops, the tests' oracle); the same answers up to float rounding", choices=KERNELS)

    def __post_init__(self):
        if self.slow_tier == "disk" and self.disk_folder is None:
            raise ValueError("lrqk: slow_tier='disk' needs disk_folder=<a writable folder>")


@register_method(
    "lrqk",
    "LRQK: low-rank Q/K proxy scores pick the top-k tokens; exact attention over them; two-tier KV",
    options=LRQKOptions,
)
class LRQKLayer(CacheLayer):
    split_batch_rows = True  # the low-rank factors are fitted per row
    def __init__(self, spec: LayerSpec, options: LRQKOptions):
        super().__init__(spec)
        o = self.options = options
        if o.rank is not None and o.rank > self.info.head_dim:
            raise ValueError(f"lrqk: rank must be in [1, head size {self.info.head_dim}], got {o.rank}")
        if o.slow_tier == "disk":
            _check_writable(o.disk_folder)
        self.rank = o.rank or default_rank(self.info.head_dim)
        self.top_k, self.window, self.iters, self.tol, self.lam = o.top_k, o.window, o.iters, o.tol, o.lam
        self.fast_device_option = o.fast_device
        self.slow_kind, self.disk_folder = o.slow_tier, o.disk_folder
        self.policy, self.prefetch_on = o.policy, o.prefetch
        # lru/attention keep `extra` rows beyond the selection in slots; prefetch stages `extra` rows
        # outside the slots, so `set` keeps exactly top_k slots with or without prefetch.
        self.extra = o.extra_slots if o.extra_slots is not None else o.top_k // 4
        self.slot_extra = self.extra if o.policy != "set" else 0
        self.block = o.prefill_chunk or 1024
        self.per_query_head = o.factor_heads == "query"
        self.factor_dtype = STORAGE_DTYPES[o.factor_dtype]
        self.slot_dtype_option = o.slot_dtype
        self.update_bases = o.update_bases
        self.fit_resident = o.fit_resident
        self.exact_selection = o.selection == "exact"
        self.seed = o.seed + 1000 * self.layer_idx
        self.measure_recall = o.measure_recall
        self.fast = o.kernel == "fast"
        # the numba kernels, loaded now rather than in the first timed decode step; while they compile in the
        # background on a machine's first use, this cache's CPU steps are the torch ops for its whole life
        self.compiled = self.fast and first_use.prepare("lrqk", f"{__name__}:warm_up_kernels")
        self._pool: ThreadPoolExecutor | None = None
        self.clear()

    # ---- shapes --------------------------------------------------------------------------------------
    @property
    def copies(self) -> int:
        """Factor heads per KV head: 1 (per KV head) or G (per query head)."""
        return self.info.groups if self.per_query_head else 1

    def _factor_queries(self, query: torch.Tensor) -> torch.Tensor:
        """``[B, H_q, q, d]`` -> ``[B, F, (G/c)·q, d]``: the queries each factor head models."""
        b, hq, q, d = query.shape
        f = self.info.num_kv_heads * self.copies
        return query.reshape(b, f, (hq // f) * q, d)

    def _factor_keys(self, key: torch.Tensor) -> torch.Tensor:
        """``[B, H_kv, n, d]`` -> ``[B, F, n, d]`` (a repeat only for per-query-head factors)."""
        return key.repeat_interleave(self.copies, dim=1) if self.copies > 1 else key

    # ---- state ---------------------------------------------------------------------------------------
    def clear(self) -> None:
        self._drain_prefetch()
        if getattr(self, "slow", None) is not None:
            self.slow.close()
        self.slow: SlowTier | None = None
        self.slots: SlotTier | None = None
        self.win_k = self.win_v = None
        self.a_k: torch.Tensor | None = None         # [B, F, capacity, r] key factors
        self.a_len = 0
        self.b_q = self.b_k = None                   # [B·F, r, d] bases (float32)
        self.gram_q = self.gram_k = None              # [B·F, d, d] float64, dropped after prefill
        self.fit_objective: list[float] = []
        self._query: torch.Tensor | None = None
        self._k_hat: torch.Tensor | None = None
        self._step_factors: torch.Tensor | None = None   # a decode step's float32 key factors (fast CPU path)
        self._prefetched = None
        self._overflow: torch.Tensor | None = None    # GPU path: deferred float16 range checks
        self._views = numba_support.NumpyViews()              # the compiled commit's numpy words of win_k, win_v, a_k
        self.counters = new_counters()
        self.step_log: list[tuple[int, int, int]] = []   # (selected, missed, bytes) per decode step

    def __getstate__(self) -> dict:
        """Without the prefetch thread or a background load in flight (they only save copies: a copy
        answers the same without them)."""
        self._drain_prefetch()
        return {k: v for k, v in {**self.__dict__, "_pool": None, "_prefetched": None}.items()
                if k not in ("_views", "_compiled", "_zeros")}

    # ---- save / load (cache/record.py): what the prompt and the steps made; the options' fields are made --------
    RECORD = Schema(tensors=(TensorSpec("win_k", "b H w D", optional=True), TensorSpec("win_v", "b H w D", optional=True),
                             TensorSpec("a_k", "b f c r", optional=True),
                             TensorSpec("b_q", "bf r D", "float32", optional=True),
                             TensorSpec("b_k", "bf r D", "float32", optional=True),
                             TensorSpec("gram_q", "bf D D", "float64", optional=True),
                             TensorSpec("gram_k", "bf D D", "float64", optional=True)),
                    meta=("seen", "a_len", "fit_objective", "counters", "step_log"), parts=("slow", "slots"))

    def to_record(self) -> Record:
        self._drain_prefetch()
        record = self.RECORD.write(self, slow=None if self.slow is None else self.slow.to_record(),
                                   slots=None if self.slots is None else self.slots.to_record())
        record.meta["step_log"] = [list(step) for step in self.step_log]
        return record

    def load_record(self, reader: RecordReader) -> None:
        fields = self.RECORD.read(reader)
        reader.check(fields["a_k"] is None or fields["a_k"].dtype == self.factor_dtype,
                     f"its key factors must be {self.factor_dtype} (the factor_dtype option)")
        reader.check(fields["b_k"] is None or fields["b_k"].shape[1] == self.rank, f"its bases must have rank {self.rank}")
        for key, value in fields.items():
            setattr(self, key, value)
        self.step_log = [tuple(step) for step in self.step_log]
        slow, slots = reader.part("slow", optional=True), reader.part("slots", optional=True)
        reader.check((slow is None) == (slots is None) == (self.win_k is None), "its tiers and window are stored together")
        if slow is not None:
            rows = slow.meta("rows")
            reader.check(rows % self.info.num_kv_heads == 0, f"{rows} tier rows are not whole batch rows")
            like = torch.empty(rows // self.info.num_kv_heads, self.info.num_kv_heads, 0, self.info.head_dim,
                               dtype=self.info.dtype, device=self.win_k.device)
            self._ensure_tiers(like)
            self.slow.load_record(slow)
            self.slots.load_record(slots)

    def close(self) -> None:
        """Release both tiers (deletes the disk tier's folder)."""
        self.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _fast_device(self, query: torch.Tensor) -> torch.device:
        opt = self.fast_device_option
        return query.device if opt == "auto" else torch.device(opt)

    def _ensure_tiers(self, key: torch.Tensor) -> None:
        if self.slow is not None:
            return
        b, hkv, _, d = key.shape
        self.slow = make_slow_tier(self.slow_kind, b * hkv, d, key.dtype, self.disk_folder)
        device = self._fast_device(key)
        dtype = exact_storage_dtype(self.slot_dtype_option, key.dtype)
        self.slots = SlotTier(b * hkv, self.top_k + self.slot_extra, d, dtype, device, self.policy)

    # ---- attention -----------------------------------------------------------------------------------
    def attend(self, query: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """The fast decode step answers in one attention call over the selected slots, the window and
        the new token (nothing to merge); every other step goes through the framework's partials."""
        if not (self.fast and ctx.q_len == 1 and ctx.past_len > 0 and self.b_k is not None):
            return super().attend(query, ctx)
        key, value = self._pending
        self._query = query
        candidates = ctx.past_len - min(self.window, ctx.past_len)
        out = self._compiled_decode(query, key, value, ctx, candidates)     # the token stored in the same call
        if out is None:
            self._update_factor_vectors(query)
            if self._on_gpu_path(query):
                out = self._gpu_decode(query, key, value, ctx, candidates)
            else:
                if candidates > 0:
                    self._select_and_fill(query, ctx, candidates)
                out = self._resident_attention(query, key, value, ctx, candidates)
            self._pending = None
            self.commit(key, value, ctx)
        return out.to(query.dtype).transpose(1, 2).contiguous()

    # ---- the CPU path in one call ------------------------------------------------------------------
    def _compiled_layout(self) -> tuple | None:
        """What ``cpu_step`` reads and updates in place (numpy views of the layer's tensors, no copy), or None where
        the layer is not in the layout it runs on: numba; float16 slots, a full float16 window and float16 factors
        per KV head on the CPU; a float32 slow tier; the paper's selection (the ``set`` policy, no prefetch, no
        diagnostics). Kept while those tensors stay the same objects (the compiled step changes them in place; a
        grown buffer, a new basis or the per-phase path's new flags make it again)."""
        held = self.__dict__.get("_compiled")
        if held is None or any(a is not b for a, b in zip(held[0], self._layout_tensors())):
            layout = self._make_compiled_layout()          # (may replace the bases by kernel copies first)
            held = self.__dict__["_compiled"] = (self._layout_tensors(), layout)
        return held[1]

    def _layout_tensors(self) -> tuple:
        s = self.slots
        return s.keys, s.values, s.token, s.score, s.chosen, self.win_k, self.win_v, self.a_k, self.b_q, self.b_k

    def _make_compiled_layout(self) -> tuple | None:
        s = self.slots
        if not (self.compiled and self.policy == "set" and not self.prefetch_on
                and not self.exact_selection and not self.measure_recall and self.copies == 1 and self.window
                and self.win_k is not None and self.win_k.shape[2] == self.window and self.b_k is not None
                and self.slow.dtype == torch.float32):
            return None
        if not all(t.dtype == torch.float16 and t.device.type == "cpu" and t.is_contiguous()
                   for t in (s.keys, s.values, self.win_k, self.win_v, self.a_k)):
            return None
        self.b_q, self.b_k = (b if lrqk_factor._is_kernel_basis(b) else lrqk_factor._basis_copy(b)
                              for b in (self.b_q, self.b_k))
        return (self.b_q.numpy(), self.b_k.numpy(), half_words(self.a_k), s.token.numpy(), s.score.numpy(),
                s.chosen.numpy(), (half_words(s.keys), half_words(s.values)),
                (half_words(self.win_k), half_words(self.win_v)))

    def _compiled_decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: StepContext,
                         candidates: int) -> torch.Tensor | None:
        """The fast CPU decode step of a float32 model in one compiled call (``cpu_step``): factor update,
        selection, slot fill, attention and the new token stored (``commit``'s work); ``[B, H_q, 1, d]``, or None
        (nothing done) where it does not run (``_compiled_layout``)."""
        if not (candidates > 0 and query.dtype == key.dtype == torch.float32 and query.device.type == "cpu"
                and not gpu_path(query) and self.a_k is not None and self.a_len < self.a_k.shape[2]):
            return None
        layout = self._compiled_layout()
        slow_words = self.slow.held_words(room=1) if layout is not None else None
        if slow_words is None:
            return None
        b_q, b_k, factor_words, token, score, chosen, slot_words, window_words = layout
        b, hq, _, d = query.shape
        rows, r, k = self.slots.rows, self.rank, min(self.top_k, candidates)
        first = ctx.pad_len.repeat_interleave(self.info.num_kv_heads).long().numpy() if ctx.pad_len is not None \
            else self._no_padding(rows)
        out, q_hat, k_hat, missed, beyond = cpu_step.decode_step(
            numba_support._numpy(query.reshape(rows, -1, d)), numba_support._numpy(key).reshape(rows, d),
            numba_support._numpy(value).reshape(rows, d), b_q, b_k, factor_words, self.a_len, token, score, chosen,
            slot_words, window_words, slow_words, candidates, k, first, ctx.past_len, ctx.scaling, self.lam,
            self.update_bases, self.fit_resident)
        self.slots.step += 1
        m = int(missed)
        record_fill(self.counters, self.step_log, FillReport(selected=rows * k, missed=m,
                                                             bytes_moved=2 * m * d * slow_words.itemsize))
        self._pending = self._query = self._k_hat = self._step_factors = None
        check_narrowed(beyond)       # (nothing stored of the token then)
        self.a_len += 1
        self.slow.rows_written(1)
        self.gram_q = self.gram_k = None      # as _append_factors: prefill is over
        self._q_hat = torch.from_numpy(q_hat).reshape(b, rows // b, -1, r)
        return torch.from_numpy(out).reshape(b, hq, 1, d)

    def _no_padding(self, rows: int) -> np.ndarray:
        """``first`` of a batch without left padding (zeros, made once: read-only to the compiled step)."""
        zeros = self.__dict__.get("_zeros")
        if zeros is None or zeros.shape[0] != rows:
            zeros = self.__dict__["_zeros"] = np.zeros(rows, np.int64)
        return zeros

    # ---- the GPU path ----------------------------------------------------------------------------
    # set on the self-check's probe layers only: True runs the kernels unchecked, False takes the torch path
    kernels_verdict: bool | None = None

    def _on_gpu_path(self, query: torch.Tensor) -> bool:
        """The fast decode step on the GPU path (CUDA tensors, or forced): Triton kernels, the slot
        bookkeeping in tensor ops, one host synchronisation (the miss transfer). A fast tier on another
        device than the model's (``fast_device``), or kernels that disagree with the torch path on this
        device (`kernels_trusted`), keep the torch path."""
        if not (self.fast and gpu_path(query)):
            return False
        return (self.slots is None or self.slots.keys.device == query.device) and self.kernels_trusted(query.device)

    def kernels_trusted(self, device: torch.device) -> bool:
        """Whether an LRQK step through the Triton kernels agrees with the torch path on ``device``: a fresh layer
        of these options through a prompt of more tokens than the slots and window hold, then three decode steps
        (selection, misses fetched, the factors and bases updated), both ways (`cache.probe`)."""
        return step_trusted(self, "lrqk_step", device, self.options, lambda: type(self)(self.spec, self.options),
                            self.top_k + self.extra + self.window + 8)

    def _gpu_decode(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: StepContext,
                    candidates: int) -> torch.Tensor:
        """Proxy mass in Triton, top-k on the device, the slot plan and miss transfer (``SlotTier.select_device``),
        then one Triton attention storing the missing rows into their slots as it reads the selected slots by
        index, the window and the new token. With
        ``prefetch``, the next-ranked tokens ride on the same host transfer and are loaded in the
        background for the next step."""
        from kvshrink.kernels import lrqk_proxy

        b, hq, _, d = query.shape
        hkv = self.info.num_kv_heads
        rows, device = b * hkv, self.slots.keys.device
        if self._overflow is None:
            self._overflow = torch.zeros((), dtype=torch.bool, device=device)
        slot = selected = pending = overflow = None
        if candidates > 0:
            if self.exact_selection:      # diagnostic: reads every key from the slow tier (synchronises)
                selected, top_mass, mass = self._select(ctx, candidates)
            else:
                f, cap = self.a_k.shape[1], self.a_k.shape[2]
                first = ctx.pad_len.to(device).repeat_interleave(f) if ctx.pad_len is not None else None
                mass, keys = lrqk_proxy.proxy_ranking(self._q_hat.reshape(b * f, -1, self.rank),
                                                      self.a_k.view(b * f, cap, self.rank), candidates, ctx.scaling,
                                                      first, copies=self.copies)
                selected = top_k_by_keys(keys, min(self.top_k, candidates), self.policy)
                top_mass = mass.gather(-1, selected) if self.policy == "attention" else None
            prefetched, ahead = self._take_prefetch(), None
            extra = min(self.extra, candidates - selected.shape[1])
            if self.prefetch_on and extra > 0:     # the best-ranked tokens outside this step's top-k
                ahead = torch.topk(mass.scatter(1, selected, float("-inf")), extra, dim=-1).indices
            report, slot, overflow, ahead_host, pending = self.slots.select_device(
                selected, self.slow, top_mass, self._overflow, prefetched=prefetched, ahead=ahead)
            record_fill(self.counters, self.step_log, report)
            if ahead_host is not None:
                self._start_prefetch_host(ahead, ahead_host)
            if self.measure_recall:
                self._measure_recall(query, ctx, candidates, selected)
        n_win = self.win_k.shape[2] if self.win_k is not None else 0
        first = ctx.pad_len.to(device).repeat_interleave(hkv) if ctx.pad_len is not None else None
        tail_k = self.win_k.reshape(rows, n_win, d) if n_win else None
        tail_v = self.win_v.reshape(rows, n_win, d) if n_win else None
        out, _ = lrqk_proxy.gathered_attention(
            query.reshape(rows, hq // hkv, d).to(device), self.slots.keys, self.slots.values, slot,
            selected.to(device) if selected is not None else None, tail_k, tail_v,
            key.reshape(rows, d).to(device), value.reshape(rows, d).to(device), ctx.past_len - n_win,
            ctx.scaling, first, fill=pending, out_dtype=query.dtype)
        if overflow:     # (after the attention, which stores this step's misses: the slots stay as planned)
            raise ValueError(
                "kvshrink: a key, value or key factor is beyond float16's range (+-65504); stored as float16 "
                "it became inf. Store exact tokens (slot_dtype) and factors (factor_dtype) in the model's "
                "dtype for this model.")
        return out.reshape(b, hq, 1, d).to(query.device)

    def past_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        self._query = query
        if ctx.past_len == 0:
            return []
        if ctx.q_len > 1 or self.b_k is None:
            return self._streamed_partials(query, ctx)
        return self._decode_partials(query, ctx)

    def _streamed_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        """Exact attention over the past read from the slow tier block by block (chunked prefill):
        the fast tier holds one block at a time, never the whole prompt."""
        parts = []
        b, hkv = query.shape[0], self.info.num_kv_heads
        for start in range(0, ctx.past_len, self.block):
            stop = min(ctx.past_len, start + self.block)
            k, v = self.slow.read_range(start, stop)
            k = k.reshape(b, hkv, stop - start, -1).to(query.device, non_blocking=True)
            v = v.reshape(b, hkv, stop - start, -1).to(query.device, non_blocking=True)
            index = torch.arange(start, stop, device=query.device)
            parts.append(exact_partial(query, k, v, ctx.scaling, key_index=index, pad_len=ctx.pad_len))
        return parts

    def _decode_partials(self, query: torch.Tensor, ctx: StepContext) -> list[Partial]:
        past = ctx.past_len
        win = min(self.window, past)
        candidates = past - win
        parts = []
        self._update_factor_vectors(query)
        if candidates > 0:
            parts.append(self._topk_partial(query, ctx, candidates))
        if win:
            index = torch.arange(past - win, past, device=query.device)
            parts.append(exact_partial(query, self.win_k, self.win_v, ctx.scaling, key_index=index,
                                       pad_len=ctx.pad_len))
        return parts

    def _update_factor_vectors(self, query: torch.Tensor) -> None:
        """q̂/k̂ of the new token against the resident tokens, then the bases' line-search step."""
        if self.fast:
            return self._update_factor_vectors_fast(query)
        b = query.shape[0]
        f = self.a_k.shape[1]
        key = self._pending[0]                                        # [B, H_kv, 1, d]
        q = self._factor_queries(query).reshape(b * f, -1, query.shape[-1])
        k = self._factor_keys(key).reshape(b * f, -1)
        res_a, res_k, res_w = self._resident_rows(b, f) if self.fit_resident else (None, None, None)
        q_hat, k_hat = decode_factor_vectors(q, k, self.b_q, self.b_k, resident_factors=res_a,
                                             resident_keys=res_k, resident_weight=res_w, lam=self.lam)
        if self.update_bases:
            self.b_q = line_search_basis_step(self.b_q, q_hat, q)
            self.b_k = line_search_basis_step(self.b_k, k_hat.unsqueeze(1), k.unsqueeze(1))
        self._q_hat = q_hat.reshape(b, f, -1, self.rank)             # [B, F, G/c, r]
        self._k_hat = k_hat.reshape(b, f, self.rank)

    def _update_factor_vectors_fast(self, query: torch.Tensor) -> None:
        """``_update_factor_vectors`` in one compiled call where it can run: a Triton kernel on the GPU path,
        numba with CPU bases (the resident sums made in the call when ``fit_resident``); else the torch ops
        on the resident tokens' sums."""
        b, _, _, d = query.shape
        f = self.a_k.shape[1]
        q = self._factor_queries(query).reshape(b * f, -1, d)
        k = self._factor_keys(self._pending[0]).reshape(b * f, d)
        gpu = self._on_gpu_path(query)
        compiled = self.compiled and self.b_q.device.type == "cpu" and not gpu
        self._step_factors = None
        if gpu and self._factor_kernel_runs():      # (reads a 16-bit model's query and key as float32 itself)
            from kvshrink.kernels.lrqk_factor import factor_step

            self.b_q, self.b_k = (_kernel_basis(x) for x in (self.b_q, self.b_k))
            q_hat, k_hat = factor_step(q, k, self.b_q, self.b_k, self.a_k.view(b * f, -1, self.rank),
                                       *self._residents(d), self.copies, self.lam, self.update_bases)
        else:
            q_hat, k_hat = self._factor_vectors_elsewhere(q.float(), k.float(), gpu, compiled)
        self._q_hat = q_hat.reshape(b, f, -1, self.rank)
        self._k_hat = k_hat.reshape(b, f, self.rank)

    def _factor_vectors_elsewhere(self, q: torch.Tensor, k: torch.Tensor, gpu: bool,
                                  compiled: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """``(q̂, k̂)`` of `_update_factor_vectors_fast` without the Triton kernel: numba, else the torch ops
        (the bases updated as they go)."""
        b, f, d = self.a_k.shape[0], self.a_k.shape[1], q.shape[-1]
        if compiled and self.fit_resident and self.slots.keys.device.type == "cpu":
            # read again by this step's proxy scores; a scratch buffer, not a fresh allocation each layer and step
            self._step_factors = numba_support.scratch("lrqk factors", tuple(self.a_k.shape)).copy_(self.a_k)
            q_hat, k_hat, self.b_q, self.b_k = lrqk_factor.resident_decode_step(
                q, k, self.b_q, self.b_k, self._step_factors.view(b * f, -1, self.rank), *self._residents(d),
                self.copies, self.lam, self.update_bases)
        else:
            lhs, rhs = self._resident_sums(q, b, f) if self.fit_resident else (None, None)
            if compiled:
                if lhs is None:
                    lhs, rhs = q.new_zeros(b * f, self.rank, self.rank), q.new_zeros(b * f, q.shape[1], self.rank)
                # in place: the layer owns its bases (copies of a cache are deep copies)
                q_hat, k_hat, self.b_q, self.b_k = lrqk_factor.decode_step(
                    q, k, self.b_q, self.b_k, lhs, rhs, self.lam, self.update_bases, in_place=True)
            else:
                q_hat, k_hat = factor_vectors_from_sums(q, k, self.b_q, self.b_k, lhs, rhs, lam=self.lam,
                                                        check_errors=not gpu)
                if self.update_bases:
                    self.b_q = line_search_basis_step(self.b_q, q_hat, q)
                    self.b_k = line_search_basis_step(self.b_k, k_hat.unsqueeze(1), k.unsqueeze(1))
        return q_hat, k_hat

    def _factor_kernel_runs(self) -> bool:
        """Whether the GPU path's factor update is the Triton kernel (`kernels.lrqk_factor`; rank <= 64)."""
        if not (triton_available() and self.rank <= 64):
            return False
        from kvshrink.kernels import lrqk_factor

        return lrqk_factor.runs()

    def _residents(self, d: int) -> tuple:
        """What the compiled factor updates read of the resident tokens: slot tokens, chosen flags and keys,
        the window's keys and the factor row of its first token (no slot and no window token without
        ``fit_resident``)."""
        slots = self.slots
        n_win = self.win_k.shape[2] if self.win_k is not None and self.fit_resident else 0
        win_k = self.win_k.reshape(-1, n_win, d) if n_win else slots.keys.new_zeros(slots.rows, 0, d)
        if not self.fit_resident:
            return (slots.token[:, :0], slots.chosen[:, :0], slots.keys[:, :0], win_k, self.a_len)
        return slots.token, slots.chosen, slots.keys, win_k, self.a_len - n_win

    def _resident_sums(self, q: torch.Tensor, b: int, f: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``AᵀA`` ``[B·F, r, r]`` and ``(q·Kᵀ)A`` ``[B·F, G/c, r]`` over the tokens of Ω (last step's
        selection in the slots, and the window), float32: what ``decode_factor_vectors`` sums."""
        slots, r = self.slots, self.rank
        tok = self._factor_keys(slots.token.reshape(b, -1, slots.capacity, 1)).reshape(b * f, -1)
        chosen = self._factor_keys(slots.chosen.reshape(b, -1, slots.capacity, 1)).reshape(b * f, -1, 1)
        flat = tok.clamp_min(0) + self.a_k.shape[2] * torch.arange(b * f, device=tok.device)[:, None]
        factors = [self.a_k.view(-1, r).index_select(0, flat.reshape(-1)).reshape(b * f, -1, r) * chosen]
        keys = [self._factor_keys(slots.keys.reshape(b, -1, slots.capacity, slots.keys.shape[-1]))]
        n_win = self.win_k.shape[2] if self.win_k is not None else 0
        if n_win:
            factors.append(self.a_k[:, :, self.a_len - n_win: self.a_len].reshape(b * f, n_win, r))
            keys.append(self._factor_keys(self.win_k))
        a = torch.cat(factors, 1).float()
        keys = torch.cat([k.reshape(b * f, k.shape[2], -1) for k in keys], 1).float()
        # torch.bmm, not @: the same kernel without matmul's expand/reshape ops around it
        return torch.bmm(a.mT, a), torch.bmm(torch.bmm(q, keys.mT), a)

    def _resident_rows(self, b: int, f: int):
        """A_K rows, keys and weights of the tokens in fast memory (slots + window), per factor head."""
        slots = self.slots
        tok = slots.token.reshape(b, -1, slots.capacity)             # [B, H_kv, S]
        keys = slots.keys.reshape(b, -1, slots.capacity, slots.keys.shape[-1])
        if self.win_k is not None and self.win_k.shape[2]:
            n_win = self.win_k.shape[2]
            win_tok = torch.arange(self.a_len - n_win, self.a_len, device=tok.device)
            tok = torch.cat([tok, win_tok.expand(tok.shape[0], tok.shape[1], n_win)], dim=2)
            keys = torch.cat([keys, self.win_k.to(keys.device)], dim=2)
        tok = self._factor_keys(tok.unsqueeze(-1)).squeeze(-1)      # [B, F, S']
        keys = self._factor_keys(keys)
        # Ω = what the paper's fast memory holds: last step's selection and the window. Extra slots
        # kept by lru/attention are left out so the policy changes data movement, never answers.
        attended = tok >= 0
        last = slots.chosen.reshape(b, -1, slots.capacity)        # last step's selection
        attended[:, :, : slots.capacity] &= last.repeat_interleave(self.copies, dim=1) if self.copies > 1 else last
        weight = attended.float()
        capacity = self.a_k.shape[2]
        flat = tok.clamp_min(0).to(self.a_k.device) + capacity * torch.arange(b * f, device=self.a_k.device).reshape(b, f, 1)
        a = self.a_k.reshape(-1, self.rank).index_select(0, flat.reshape(-1))   # one flat row gather
        return (a.reshape(b * f, -1, self.rank), keys.reshape(b * f, -1, keys.shape[-1]),
                weight.reshape(b * f, -1))

    def _select(self, ctx: StepContext, candidates: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per-KV-head top-k of the tokens ``0..candidates-1`` by estimated attention mass.

        Returns the selected tokens and their mass (``[B·H_kv, k]``) and every candidate's mass
        (``[B·H_kv, n]``, the proxy softmax summed over the query heads of the group)."""
        b, f = self.a_k.shape[:2]
        hkv = self.info.num_kv_heads
        # Logits laid out [B, F, queries, n] so the softmax and the group sum run over contiguous memory.
        if self.exact_selection:
            keys, _ = self.slow.read_range(0, candidates)            # [B·H_kv, n, d]
            keys = self._factor_keys(keys.reshape(b, hkv, candidates, -1)).float()
            q = self._factor_queries(self._query).float()            # [B, F, G/c, d]
            logits = q @ keys.to(q.device).transpose(-1, -2)
        else:
            factors = getattr(self, "_step_factors", None)
            a = (self.a_k if factors is None else factors)[:, :, :candidates].float()   # [B, F, n, r]
            logits = self._q_hat.float() @ a.transpose(-1, -2)                        # [B, F, G/c, n]
        k = min(self.top_k, candidates)
        if self.compiled and logits.device.type == "cpu":
            first = ctx.pad_len.repeat_interleave(hkv) if ctx.pad_len is not None else None
            return lrqk_proxy.proxy_top_k(logits.reshape(b * hkv * logits.shape[2] * f // hkv, candidates),
                                             ctx.scaling, first, b * hkv, k)
        logits = logits * ctx.scaling
        if ctx.pad_len is not None:
            pad = torch.arange(candidates, device=logits.device)[None, :] < ctx.pad_len.to(logits.device)[:, None]
            logits = logits.masked_fill(pad[:, None, None, :], float("-inf"))
        mass = torch.softmax(logits, dim=-1)                       # per query head, over candidates
        if ctx.pad_len is not None:      # a row whose candidates are all padding: NaN -> no mass
            mass = mass.nan_to_num(0.0)
        mass = mass.reshape(b, hkv, -1, candidates).sum(dim=2)     # [B, H_kv, n]
        top_mass, top_idx = top_k_in_token_order(mass, k, self.policy)
        return top_idx.reshape(b * hkv, k), top_mass.reshape(b * hkv, k), mass.reshape(b * hkv, candidates)

    def _topk_partial(self, query: torch.Tensor, ctx: StepContext, candidates: int) -> Partial:
        selected = self._select_and_fill(query, ctx, candidates)
        return self._slot_partial(query, ctx, selected)

    def _select_and_fill(self, query: torch.Tensor, ctx: StepContext, candidates: int) -> torch.Tensor:
        """Select this step's top-k and make it resident in the slots; returns the selection."""
        selected, mass, all_mass = self._select(ctx, candidates)
        prefetched = self._take_prefetch()
        report = self.slots.select(selected, self.slow, mass, prefetched=prefetched, fast=self.fast)
        record_fill(self.counters, self.step_log, report)
        if self.prefetch_on:
            self._start_prefetch(all_mass, selected)
        if self.measure_recall:
            self._measure_recall(query, ctx, candidates, selected)
        return selected

    def _measure_recall(self, query: torch.Tensor, ctx: StepContext, candidates: int,
                        selected: torch.Tensor) -> None:
        keys, _ = self.slow.read_range(0, candidates)                # [B·H_kv, n, d]
        record_mass_recall(self.counters, query, keys, ctx.scaling, ctx.pad_len, selected)

    def _slot_partial(self, query: torch.Tensor, ctx: StepContext, selected: torch.Tensor) -> Partial:
        """Exact attention over the slots holding the selection; each KV head folded into the batch
        because every head holds different tokens."""
        b, hq, q, d = query.shape
        hkv, slots = self.info.num_kv_heads, self.slots
        folded_q = query.reshape(b * hkv, hq // hkv, q, d).to(slots.keys.device)
        key_index = slots.selected_index(_NEVER)                    # [B·H_kv, S]
        pad = ctx.pad_len.repeat_interleave(hkv) if ctx.pad_len is not None else None
        part = exact_partial(folded_q, slots.keys.unsqueeze(1), slots.values.unsqueeze(1), ctx.scaling,
                             key_index=key_index, query_index=ctx.new_index.to(slots.keys.device),
                             pad_len=pad)
        return Partial(part.out.reshape(b, hq, q, d).to(query.device), part.lse.reshape(b, hq, q).to(query.device))

    def _resident_attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ctx: StepContext,
                            candidates: int) -> torch.Tensor:
        """Exact attention ``[B, H_q, 1, d]`` of the new token over this step's selection in the slots
        (when there are ``candidates``), the window and itself, in one call: each KV head folded into the
        batch (each holds other tokens), its window and new token beside its slots."""
        b, hq, q, d = query.shape
        hkv = self.info.num_kv_heads
        rows, device = b * hkv, self.slots.keys.device
        slots = candidates > 0
        n_win = self.win_k.shape[2] if self.win_k is not None else 0
        keys = self._resident_rows_in("lrqk keys", query.dtype, self.slots.keys if slots else None, self.win_k, key)
        values = self._resident_rows_in("lrqk values", query.dtype, self.slots.values if slots else None, self.win_v,
                                        value)
        visible = None if self._every_key_visible(ctx, candidates) else self._visible_keys(ctx, slots, n_win)
        folded_q = query.reshape(rows, hq // hkv, q, d).to(device)
        out = F.scaled_dot_product_attention(folded_q, keys.unsqueeze(1), values.unsqueeze(1), attn_mask=visible,
                                             scale=ctx.scaling, enable_gqa=True)
        return out.reshape(b, hq, q, d).to(query.device)

    def _resident_rows_in(self, name: str, dtype: torch.dtype, slot_rows: torch.Tensor | None,
                          window: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
        """``[rows, S + W + 1, d]`` in ``dtype``: the slots' rows (if given), the window's and the new token's,
        each copied once into place (a ``cat`` of the stored dtype and the new token's converts twice and
        takes a slow mixed-dtype path)."""
        rows, d = self.slots.rows, new.shape[-1]
        parts = ([slot_rows] if slot_rows is not None else []) + \
            ([window.reshape(rows, -1, d)] if window is not None and window.shape[2] else [])
        parts.append(new.reshape(rows, 1, d))
        shape = (rows, sum(p.shape[1] for p in parts), d)
        device = self.slots.keys.device
        out = numba_support.scratch(name, shape) if dtype == torch.float32 and device.type == "cpu" else \
            torch.empty(shape, dtype=dtype, device=device)
        start = 0
        for part in parts:
            out[:, start: start + part.shape[1]].copy_(part)
            start += part.shape[1]
        return out

    def _every_key_visible(self, ctx: StepContext, candidates: int) -> bool:
        """Whether the attention needs no mask: no left padding, and either no slots are read or every slot
        holds this step's selection (``top_k`` distinct tokens filling exactly ``top_k`` slots, the default
        ``set`` policy once the prompt has ``top_k`` candidates). Saves building the mask and SDPA's masked
        path every layer."""
        if ctx.pad_len is not None:
            return False
        return candidates == 0 or min(self.top_k, candidates) == self.slots.capacity

    def _visible_keys(self, ctx: StepContext, slots: bool, n_win: int) -> torch.Tensor:
        """Boolean ``[rows, 1, 1, S + n_win + 1]`` mask of ``_resident_attention``'s keys: slots outside the
        selection get index -1 and are hidden like left padding."""
        rows, device, past = self.slots.rows, self.slots.keys.device, ctx.past_len
        index = [self.slots.selected_index(-1)] if slots else []
        index.append(torch.arange(past - n_win, past + 1, device=device).expand(rows, n_win + 1))
        first = ctx.pad_len.to(device).repeat_interleave(self.info.num_kv_heads)[:, None] \
            if ctx.pad_len is not None else 0
        return (torch.cat(index, 1) >= first)[:, None, None, :]

    # ---- prefetch -----------------------------------------------------------------------------------
    def _start_prefetch(self, mass: torch.Tensor, selected: torch.Tensor) -> None:
        """Load, in the background, the best-ranked tokens just outside this step's top-k (they are
        the likeliest to enter the next step's set); the copy overlaps the rest of the forward."""
        extra = min(self.extra, mass.shape[1] - selected.shape[1])
        if extra <= 0:
            return
        outside = mass.scatter(1, selected, float("-inf"))
        nxt = torch.topk(outside, extra, dim=-1).indices              # [B·H_kv, extra]
        rows = torch.arange(nxt.shape[0], device=nxt.device)[:, None].expand_as(nxt)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lrqk-prefetch")
        slow = self.slow
        self._prefetched = (nxt, self._pool.submit(lambda: slow.gather(rows.reshape(-1), nxt.reshape(-1))))

    def _start_prefetch_host(self, tokens: torch.Tensor, host_tokens: torch.Tensor) -> None:
        """The GPU path's prefetch: ``host_tokens`` (``[rows, e]``, on the host already) loaded on the
        background thread; ``tokens`` (the same, on the device) match them against the next selection."""
        rows = torch.arange(host_tokens.shape[0])[:, None].expand_as(host_tokens)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lrqk-prefetch")
        slow = self.slow
        self._prefetched = (tokens, self._pool.submit(lambda: slow.gather(rows.reshape(-1), host_tokens.reshape(-1))))

    def _take_prefetch(self):
        if self._prefetched is None:
            return None
        tokens, future = self._prefetched
        self._prefetched = None
        rows = future.result()
        record_prefetch(self.counters, tokens, rows)
        return tokens, rows

    def _drain_prefetch(self) -> None:
        """Wait for a background load whose rows are being discarded (its errors do not matter)."""
        pending = getattr(self, "_prefetched", None)
        self._prefetched = None
        if pending is not None:
            pending[1].exception()

    # ---- storing -------------------------------------------------------------------------------------
    def commit(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> None:
        self._ensure_tiers(key)
        gpu = ctx.q_len == 1 and self._query is not None and self._on_gpu_path(self._query)
        if not gpu and self._commit_compiled(key, value, ctx):
            pass
        else:
            self._commit_torch(key, value, ctx, gpu)
        self._query = None
        self._k_hat = None
        self._step_factors = None   # a_k has changed

    def _commit_compiled(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext) -> bool:
        """A CPU decode step's token stored in one compiled pass where it can (a full float16 window, float16
        factors with room for one more, float32 K/V: the defaults on a float32 model): the window shifted and
        the key factors written, checked for float16's range first; then the slow tier's row. False, having
        stored nothing, elsewhere."""
        if not (self.compiled and ctx.q_len == 1 and self.b_k is not None and self._k_hat is not None
                and self.window and self.win_k is not None and self.win_k.shape[2] == self.window
                and self.a_len < self.a_k.shape[2] and key.dtype == value.dtype == torch.float32
                and key.device.type == "cpu"):
            return False
        tensors = (self.win_k, self.win_v, self.a_k)
        if not all(t.dtype == torch.float16 and t.device.type == "cpu" and t.is_contiguous() for t in tensors):
            return False
        views = self.__dict__.setdefault("_views", numba_support.NumpyViews())   # (a copy has none: see __getstate__)
        words = tuple(views.get(name, t, half_words) for name, t in zip(("win_k", "win_v", "a_k"), tensors))
        rows, d, r = self.slots.rows, key.shape[-1], self.rank
        k_hat = self._k_hat if self._k_hat.dtype == torch.float64 else self._k_hat.double()
        shift_in_narrowed(numba_support._numpy(key).reshape(rows, d), numba_support._numpy(value).reshape(rows, d),
                          numba_support._numpy(k_hat).reshape(-1, r), words, self.a_len)
        self.a_len += 1
        if self.counters["decode_steps"] > 0:
            self.gram_q = self.gram_k = None      # as _append_factors: prefill is over
        self.slow.append(key, value)
        return True

    def _commit_torch(self, key: torch.Tensor, value: torch.Tensor, ctx: StepContext, gpu: bool) -> None:
        deferred = gpu and ctx.q_len == 1 and self.b_k is not None and getattr(self, "_overflow", None) is not None
        if deferred and self._commit_kernel_runs(key):
            from kvshrink.kernels.lrqk_slots import commit_token

            b, h, _, d = key.shape
            stage = torch.empty(1, b * h, 2, d, dtype=key.dtype, device=key.device)
            commit_token(key, value, self._k_hat, self.win_k, self.win_v, self.a_k, self.a_len, self._overflow,
                         stage=stage)
            self.slow.append_rows(stage, non_blocking=True)
            self.a_len += 1
            if self.counters["decode_steps"] > 0:
                self.gram_q = self.gram_k = None  # as _append_factors: prefill is over
            return
        if deferred:     # range checked with the next miss transfer
            self._defer_range_check(key, value)
        refit = ctx.q_len > 1 or self.b_k is None
        factors = None
        if not refit:    # narrowed (and checked) first: a value beyond float16's range stores nothing of the token
            factors = self._k_hat.to(self.factor_dtype) if deferred else to_storage(self._k_hat, self.factor_dtype)
        self._update_window(key, value, checked=deferred)
        self.slow.append(key, value, non_blocking=gpu)
        if refit:
            self._accumulate_grams(self._query, key, ctx)
            self._refit()
        else:
            self._append_factors(factors.unsqueeze(2))

    def _commit_kernel_runs(self, key: torch.Tensor) -> bool:
        """Whether the GPU path's decode step commits in one Triton launch (`kernels.lrqk_slots.commit_token`): a
        full window and factor buffer with room, contiguous, on the key's device, and the slots' ``plan_kernel``
        on (the tests switch it off for the tensor ops, their oracle)."""
        win, a = self.win_k, self.a_k
        return (self.slots.plan_kernel and triton_available() and self._k_hat is not None and self.window > 0
                and win is not None and win.shape[2] == self.window and a is not None and self.a_len < a.shape[2]
                and win.is_contiguous() and self.win_v.is_contiguous() and a.is_contiguous()
                and win.device == key.device == a.device and key.shape[2] == 1)

    def _defer_range_check(self, key: torch.Tensor, value: torch.Tensor) -> None:
        """The GPU path's decode step: whether the new token's key or value (for a float16 window) or its key
        factors (float16 factors) are beyond float16's range, or-ed into ``_overflow`` with one reduction (four
        launches, no host synchronisation), raised at the next miss transfer."""
        narrowed = [x for x in (key, value) if self.window and storage_overflow_check(x, self.slots.keys.dtype)]
        if storage_overflow_check(self._k_hat, self.factor_dtype):
            narrowed.append(self._k_hat)
        if narrowed:
            peak = torch.linalg.vector_norm(torch.cat([x.reshape(-1).float() for x in narrowed]), ord=float("inf"))
            self._overflow.logical_or_(peak > torch.finfo(torch.float16).max)

    def _update_window(self, key: torch.Tensor, value: torch.Tensor, checked: bool = False) -> None:
        """The window takes the newest tokens in the slots' dtype (checked for float16's range as every stored
        row is, unless ``checked`` already)."""
        if self.window == 0:
            return
        device, dtype = self.slots.keys.device, self.slots.keys.dtype
        k, v = (x[:, :, -self.window:].to(device) for x in (key, value))
        k, v = (k.to(dtype), v.to(dtype)) if checked else (to_storage(k, dtype), to_storage(v, dtype))
        if self.win_k is not None:
            # only the rows that stay are concatenated: the result is the new window, with no second copy
            stay = max(0, min(self.win_k.shape[2], self.window - k.shape[2]))
            k = torch.cat([self.win_k[:, :, self.win_k.shape[2] - stay:], k], dim=2)
            v = torch.cat([self.win_v[:, :, self.win_v.shape[2] - stay:], v], dim=2)
        self.win_k = k[:, :, -self.window:].contiguous()
        self.win_v = v[:, :, -self.window:].contiguous()

    def _accumulate_grams(self, query: torch.Tensor, key: torch.Tensor, ctx: StepContext) -> None:
        b, _, q, d = key.shape
        weight = torch.ones(b, q, device=key.device)
        if ctx.pad_len is not None:
            weight = (ctx.new_index.to(key.device)[None, :] >= ctx.pad_len.to(key.device)[:, None]).float()
        fq = self._factor_queries(query)                             # [B, F, (G/c)·q, d]
        f = fq.shape[1]
        q_weight = weight[:, None, None, :].expand(b, f, fq.shape[2] // q, q).reshape(b * f, -1)
        k_weight = weight[:, None, :].expand(b, f, q).reshape(b * f, q)
        g_q = gram(fq.reshape(b * f, -1, d), q_weight)
        g_k = gram(self._factor_keys(key).reshape(b * f, q, d), k_weight)
        self.gram_q = g_q if self.gram_q is None else self.gram_q + g_q
        self.gram_k = g_k if self.gram_k is None else self.gram_k + g_k

    def _refit(self) -> None:
        """Fit the factorization on the Grams so far and recompute every token's key factors."""
        gen = torch.Generator().manual_seed(self.seed)
        fit = fit_lowrank_qk(self.gram_q, self.gram_k, self.rank, iters=self.iters, tol=self.tol,
                             lam=self.lam, generator=gen)
        self.fit_objective = fit.objective
        self.b_q, self.b_k = fit.b_q.float(), fit.b_k.float()
        key_map = fit.key_map.float()
        self.a_len = 0
        b = self.win_k.shape[0] if self.win_k is not None else self.slow.rows // self.info.num_kv_heads
        hkv = self.info.num_kv_heads
        f = hkv * self.copies
        for start in range(0, self.slow.length, self.block):
            stop = min(self.slow.length, start + self.block)
            k, _ = self.slow.read_range(start, stop)
            k = self._factor_keys(k.reshape(b, hkv, stop - start, -1).to(self.slots.keys.device).float())
            factors = key_factors(k.reshape(b * f, stop - start, -1), key_map).reshape(b, f, stop - start, -1)
            self._append_factors(to_storage(factors, self.factor_dtype))

    def _append_factors(self, factors: torch.Tensor) -> None:
        """Append ``[B, F, n, r]`` key factors, growing the buffer in blocks."""
        b, f, n, r = factors.shape
        need = self.a_len + n
        if self.a_k is None or need > self.a_k.shape[2]:
            capacity = -(-need // _FACTOR_BLOCK) * _FACTOR_BLOCK
            with state_tensors():
                grown = torch.zeros(b, f, capacity, r, dtype=self.factor_dtype, device=factors.device)
                if self.a_k is not None and self.a_len:
                    grown[:, :, : self.a_len] = self.a_k[:, :, : self.a_len]
            self.a_k = grown
        self.a_k[:, :, self.a_len: need] = factors
        self.a_len = need
        if self.a_len > 0 and self.counters["decode_steps"] > 0:
            self.gram_q = self.gram_k = None                          # prefill is over

    # ---- accounting ----------------------------------------------------------------------------------
    def breakdown(self) -> dict[str, int]:
        """Fast-tier bytes by part (sums to ``nbytes()``); the slow tier is in ``stats()``."""
        return {
            "key_factors": held_bytes([self.a_k]),
            "bases": held_bytes([self.b_q, self.b_k]),
            "grams": held_bytes([self.gram_q, self.gram_k]),
            "slots": self.slots.nbytes() if self.slots is not None else 0,
            "window": held_bytes([self.win_k, self.win_v]),
        }

    def nbytes(self) -> int:
        return sum(self.breakdown().values())

    def slow_tier_bytes(self) -> int:
        return self.slow.nbytes() if self.slow is not None else 0

    def stats(self) -> dict[str, float]:
        return layer_stats(self.counters, self.step_log, self.nbytes(), self.slow_tier_bytes())


def top_k_in_token_order(mass: torch.Tensor, k: int, policy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` largest of ``mass`` along the last dim (NaN ranked above everything, as ``torch.topk`` ranks it)
    and their indices, in token order under the ``lru`` and ``attention`` policies: which slot a missing token
    takes follows this order, and their later evictions follow the slots, so every path orders it the same way.

    Of the values tied with the k-th, every path takes the latest tokens (``torch.topk`` leaves it to the
    device's kernel, and two CPUs were seen to differ; `lrqk_proxy.proxy_top_k` follows the same rule): the
    reference and the fast paths select the same tokens, and a real token whose proxy mass underflowed to zero is
    never passed over for left padding. The GPU path's proxy kernel writes `token_order_keys` instead: one
    ``torch.topk`` of them (`top_k_by_keys`) is the rule there, where these torch ops would cost ~14 launches a
    layer."""
    ranked = mass.nan_to_num(nan=float("inf"))
    kth = torch.topk(ranked, k, dim=-1).values[..., -1:]
    above, tied = ranked > kth, ranked == kth
    from_end = tied.flip(-1).cumsum(-1).flip(-1)          # tied values at this index or later
    take = above | (tied & (from_end <= k - above.sum(-1, keepdim=True)))
    selected = torch.sort(take.to(torch.uint8), dim=-1, descending=True, stable=True).indices[..., :k]
    return mass.gather(-1, selected), selected


def top_k_by_keys(keys: torch.Tensor, k: int, policy: str) -> torch.Tensor:
    """`top_k_in_token_order`'s selection from `token_order_keys` (its masses not gathered: the GPU path reads them
    only under the ``attention`` policy). Under ``set`` not even sorted: every slot not selected is free."""
    selected = torch.topk(keys, k, dim=-1, sorted=False).indices
    return selected if policy == "set" else selected.sort(dim=-1).values


def token_order_keys(mass: torch.Tensor) -> torch.Tensor:
    """Ranking keys of a non-negative float32 ``mass [..., n]`` (int64): its bits (NaN as inf) above the token
    index, so the larger key is the larger mass, or among equal ones the later token (the oracle of the GPU
    proxy kernel's keys; `top_k_in_token_order`'s rule as one ``torch.topk``)."""
    bits = mass.float().nan_to_num(nan=float("inf")).view(torch.int32).to(torch.int64)
    return (bits << 32) | torch.arange(mass.shape[-1], device=mass.device)


def _kernel_basis(basis: torch.Tensor) -> torch.Tensor:
    """``basis`` as the factor-step kernel updates it in place: contiguous float32 (a copy only if not)."""
    if basis.dtype == torch.float32 and basis.is_contiguous():
        return basis
    return basis.float().contiguous()


def _check_writable(folder: str) -> None:
    folder = os.fspath(folder)
    probe = folder
    while probe and not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe or ".") or not os.access(probe or ".", os.W_OK | os.X_OK):
        raise ValueError(f"lrqk: disk_folder {folder!r} is not a writable folder")


def warm_up_kernels() -> None:
    """Compile (or load from numba's cache) every numba kernel of LRQK's CPU step, on tiny inputs."""
    warm_up.lrqk()
    warm_up_fill_planner()
    cpu_step.warm_up()
