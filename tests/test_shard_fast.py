"""Shard's fused decode kernel (kernel="fast") against the torch reference path, its oracle."""
import pytest
import numpy as np
import torch

import kvshrink
from kvshrink.cache.attention import merge_partials
from kvshrink.cache.rowwise import row_context
from kvshrink.kernels.cpu import (block_attention, encoders, exact_parts, half_words, numba_support, softmax,
                                  step_parts, stream)
from kvshrink.kernels.cpu.levels import byte_levels
from kvshrink.codecs.pca import PCACode, encode_pca, fit_pca
from kvshrink.kernels.cpu.block_attention import run_layout

from test_shard import prefill, tiny_llama

pytestmark = pytest.mark.skipif(not numba_support.available(),
                                reason=f"numba missing: {numba_support.unavailable_reason()}")


def one_part(query, fill):
    """``(out, lse)`` of the one part ``fill(parts)`` writes into a `step_parts.StepParts` of ``query`` (scaling 0.25)."""
    parts = step_parts.StepParts(query, 0.25, 1)
    fill(parts)
    return parts.merged()


def decode(model, cache, steps, mask):
    with torch.no_grad():
        for t in range(steps):
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=mask.dtype)], dim=1)
            model(torch.full((mask.shape[0], 1), t + 1), attention_mask=mask, past_key_values=cache)


def assert_fast_equals_reference(cache, batch, rows=(1, 3), layers=None, ctx=None):
    """Every layer's fused partial of every middle block == the reference path's, for decode-sized queries."""
    ctx, info = ctx or cache._ctx, cache.info
    g = torch.Generator().manual_seed(3)
    checked = 0
    for layer in layers or cache.layers:
        for block in layer.blocks():        # the unread blocks held until decoding too
            for q_len in rows:
                q = torch.randn(batch, info.num_q_heads, q_len, info.head_dim, generator=g) * 2
                assert layer.use_fast_kernel(q)
                got = layer.fused_middle_partial(block, q, ctx)
                want = merge_partials(layer.reference_middle_partials(block, q, ctx))
                torch.testing.assert_close(got.out, want.out, atol=2e-5, rtol=1e-4)  # float32 summation order
                # the reference path's byte tables are float16, the fast path's product float32: up to 5e-5 apart
                # on the evicted tokens' block (5e-7 with float32 tables in the reference)
                torch.testing.assert_close(got.lse, want.lse, atol=1e-4, rtol=1e-5)
                checked += 1
    assert checked > 0


@pytest.mark.parametrize("opts", [
    dict(key_bits=2.0, pca_scope="head"),
    dict(key_bits=2.0, pca_scope="layer"),
    dict(key_bits=0.75, pca_scope="head"),                    # most components dropped
    dict(key_bits=5.0, pca_scope="head", pca_group=3),        # 6-bit runs: codes straddle bytes
    dict(key_bits=5.0, pca_scope="layer", k_levels="uniform"),
    dict(key_bits=2.5, salient=0.05),                         # held rows masked in the kernel
    dict(key_bits=2.5, salient=0.05, pca_scope="layer"),
    dict(v_group=2, v_codebook=16),                           # 4-bit value codes
    dict(v_group=8, v_codebook=32),                           # 5-bit value codes straddle bytes
    dict(key_weights="query"),                                # per-column scale folded into the tables
    dict(evict=0.1, salient=0.05, min_block=8, keep_tokens=0),  # evicted tokens: RoPE at the kept positions
    dict(cold=0.3, salient=0.05, min_block=8),                # a hot and a cold block over the same span
    dict(cold=0.3, evict=0.1, min_block=8, keep_tokens=0, pca_scope="layer"),  # the cold split of the kept ones
    dict(v_centre=True, salient=0.05, salient_read=0.5, cold=0.3, min_block=8),  # value means added back
    dict(rope_frame=16),                                      # keys at their frames' RoPE: queries projected
    dict(rope_frame=7, pca_scope="head", salient=0.05),       # frames across the block's start and end
    dict(rope_frame=16, cold=0.3, evict=0.1, min_block=8, keep_tokens=0),  # frames of scattered tokens
])
def test_fused_block_attention_equals_reference(opts):
    model = tiny_llama()
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, block_tokens=100, kernel="fast", **opts)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    prefill(model, cache, ids)
    if opts.get("evict"):  # the kept rows' block and the evicted rows' block
        assert all(layer.middle[0].kept is not None and layer.evicted for layer in cache.layers)
        for layer in cache.layers:  # held uncoded until the next call: coded as a fork or save codes them
            layer.code_evicted()
    if opts.get("cold"):  # the hot block (1-bit value codes in the cold one: 8 channels of 256 entries)
        assert all(len(layer.middle) == 2 and layer.middle[1].v_codebook.shape == (256, 8) for layer in cache.layers)
    assert_fast_equals_reference(cache, 1)


@pytest.mark.parametrize("frame", [1, 16])
def test_fused_path_with_batch_padding_stream_and_several_blocks(frame):
    """Row 1's left padding shifts its positions, so with frames each row's tokens fall in frames of their own."""
    model = tiny_llama(head_dim=24)     # 24: rotation is a random orthogonal matrix, not Hadamard
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_bits=2.5, min_block=32, kernel="fast",
                                rope_frame=frame)
    ids = torch.randint(0, 128, (2, 260), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 260, dtype=torch.long)
    mask[1, :37] = 0                    # left padding in row 1
    with torch.no_grad():               # two prefill chunks: two middle blocks per layer
        model(ids[:, :150], attention_mask=mask[:, :150], past_key_values=cache)
        model(ids[:, 150:], attention_mask=mask, past_key_values=cache)
    rows = cache.layers[0].rows  # a batch: each row has its own layers
    assert [len(row.middle) for row in rows] == [2, 2]
    decode(model, cache, 3, mask)
    assert [row.stream.n for row in rows] == [3, 3]
    for i in range(2):
        assert_fast_equals_reference(cache, 1, layers=[layer.rows[i] for layer in cache.layers],
                                     ctx=row_context(cache._ctx, i))
    # the run layouts the fast path keeps per block are counted with the cache's bytes
    layouts = sum(block.derived.runs.nbytes() for row in rows for block in row.middle)
    assert cache.layers[0].breakdown()["middle_run_layouts"] == layouts > 0
    factors = sum(block.derived.key_factors.nbytes() for row in rows for block in row.middle)
    assert cache.layers[0].breakdown()["middle_key_factors"] == factors > 0


def test_fast_and_reference_caches_decode_the_same_tokens():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernel in ("fast", "reference"):
        cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_bits=2.0, kernel=kernel)
        with torch.no_grad():
            out = [prefill(model, cache, ids).logits[:, -1]]
            for t in range(6):
                out.append(model(out[-1].argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1])
        logits[kernel] = torch.stack(out)
    torch.testing.assert_close(logits["fast"], logits["reference"], atol=1e-4, rtol=1e-4)


def test_the_coefficient_decoder_reads_every_run_layout():
    """The fast path's coefficients (a byte-table lookup per byte of 2-, 4- and 8-bit runs, as 8-byte words
    where a run starts at an even component, four 6-bit codes per three bytes, a run's last codes one at a
    time, zeros past a scope's rank) == the codes' own levels, and the keys built from them == the codes'
    decode: runs at even and odd components, 6-bit runs of whole and partial groups of four, both level
    kinds, scopes of other ranks."""
    from kvshrink.codecs.table_decoder import scaled_bases

    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 50, 12, generator=g) * torch.linspace(3, 0.1, 12)
    fit = fit_pca(x.reshape(-1, 12), 12)
    layouts = {"odd": ([8, 6, 6, 4, 4, 4, 2, 2, 2, 0, 0, 0], [6, 4, 4, 2, 2, 2, 2, 0, 0, 0, 0, 0],
                       [8, 4, 4, 4, 2, 2, 2, 2, 2, 0, 0, 0]),
               "even": ([4, 4, 2, 2, 2, 2, 2, 2, 2, 2, 0, 0], [6, 6, 6, 6, 6, 4, 4, 4, 4, 2, 2, 2],
                        [8, 8, 6, 6, 6, 6, 4, 4, 4, 2, 2, 2])}
    for levels in ("lloyd", "uniform"):
        for bits_sets in layouts.values():
            codes = [encode_pca(x, fit, b, levels=levels) for b in bits_sets]
            plan = run_layout(codes)
            rank = max(c.rank for c in codes)
            lut = byte_levels(levels, (2, 4, 6, 8))
            scaled, mean = scaled_bases(codes)
            for decode in (block_attention._decode_scopes, block_attention._decode_scopes_parallel):     # every scope and row at once
                coef = torch.full((len(codes), 2, 45, rank + block_attention._SPARE + rank % 2), float("nan"))
                out = coef.numpy()
                decode(tuple(code.codes.numpy() for code in codes), plan.runs, plan.run_counts, lut,
                       lut.view(np.int64), 5, out, out.view(np.int64))
                coef = coef[..., :rank]  # the spare columns are never read
                for s, code in enumerate(codes):
                    want = torch.cat([code.run_levels(run, 5, 50, torch.float32) for run in code.runs], dim=-1)
                    torch.testing.assert_close(coef[s, :, :, :code.rank], want, rtol=0, atol=0)
                    assert not coef[s, :, :, code.rank:].any()
                    keys = mean[s] + coef[s] @ scaled[s]
                    torch.testing.assert_close(keys, code.decode()[:, 5:], atol=1e-5, rtol=1e-5)


def test_kernel_option_is_validated():
    model = tiny_llama()
    with pytest.raises(ValueError, match="kernel"):
        kvshrink.make_cache("shard", model, kernel="gpu")
    q = torch.zeros(1, 4, 1, 16)
    assert kvshrink.make_cache("shard", model).layers[0].use_fast_kernel(q)  # fast by default
    assert not kvshrink.make_cache("shard", model, kernel="reference").layers[0].use_fast_kernel(q)


def _numba_kernels() -> list[str]:
    """The public functions of the CPU kernel modules that run numba code (their checks, the dispatchers that take
    the torch ops without numba, and containers excepted), as ``(module, name)``."""
    import importlib
    import pkgutil
    import types

    import kvshrink.kernels.cpu

    plain = {"available", "installed", "unavailable_reason", "hold_kernels", "turbo_supported", "assign_codes",
             "quantize_unit", "prepare", "wait_for_kernels", "compiling_in_background", "finish_background"}
    modules = [importlib.import_module(f"kvshrink.kernels.cpu.{m.name}")
               for m in pkgutil.iter_modules(kvshrink.kernels.cpu.__path__)]
    return [(module, name) for module in modules for name, obj in vars(module).items()
            if isinstance(obj, types.FunctionType) and not name.startswith("_") and name not in plain
            and obj.__module__ == module.__name__]


def test_without_numba_a_default_cache_decodes_with_the_torch_ops_as_the_numba_path_does(monkeypatch):
    """Without numba (``numba_support.available()`` false) a default Shard cache prefills and decodes (middle blocks,
    ring, stream) with the torch ops alone: every numba entry point is made to raise, and the greedy tokens
    and logits are those of the numba path up to float32 summation order."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    options = dict(sinks=4, window=16)

    def run(cache):
        logits, token = [], ids
        with torch.no_grad():
            out = model(ids, past_key_values=cache)
            for _ in range(24):                       # past the window: tokens leave the ring for the stream
                logits.append(out.logits[:, -1])
                token = out.logits[:, -1:].argmax(-1)
                out = model(token, past_key_values=cache)
        assert cache.layers[0].middle and cache.layers[0].stream.n
        return torch.cat(logits)

    want = run(kvshrink.make_cache("shard", model, **options))
    monkeypatch.setattr(numba_support, "numba", None)
    for module, name in _numba_kernels():
        def refuse(*args, _name=f"{module.__name__}.{name}", **kwargs):
            raise AssertionError(f"{_name} ran without numba")
        monkeypatch.setattr(module, name, refuse)
    cache = kvshrink.make_cache("shard", model, **options)
    assert not cache.layers[0].use_fast_kernel(torch.zeros(1, 4, 1, 16))
    got = run(cache)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("frame", [1, 16])
def test_a_fast_kernel_cache_saves_and_loads_after_decoding(tmp_path, frame):
    """The slot plans the fast path builds on its first decode step are derived state: left out of the
    file (they hold numpy arrays) and rebuilt on first use after loading; the keys' frames are an option, saved
    with the others."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, kernel="fast", rope_frame=frame)
    prefill(model, cache, ids)
    with torch.no_grad():
        model(torch.tensor([[5]]), past_key_values=cache)
    cache.save(tmp_path / "fast.kvs")
    loaded = kvshrink.load_cache(tmp_path / "fast.kvs", model)
    with torch.no_grad():
        want = model(torch.tensor([[6]]), past_key_values=cache).logits
        got = model(torch.tensor([[6]]), past_key_values=loaded).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert loaded.nbytes() == cache.nbytes()
    assert loaded.layers[0].cfg.rope_frame == frame


def test_the_value_pass_equals_the_torch_ops():
    """The fast path's value pass (`block_attention._head_values`: codewords weighted by a head's bins, scaled, rotated back, in
    one pass) == the layer's torch ops (`values_from_bins`), for 2-, 4- and 8-bit value codes."""
    model = tiny_llama()
    cache = kvshrink.make_cache("shard", model, sinks=2, window=4)
    prefill(model, cache, torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0)))
    layer = cache.layers[0]
    block = layer.middle[0]
    g = torch.Generator().manual_seed(1)
    for entries in (4, 16, 256):
        codebook = torch.randn(entries, block.v_codebook.shape[1], generator=g).half()
        groups = layer.d // codebook.shape[1]
        bins = torch.rand(2, layer.h_kv, 3, groups * entries, generator=g)
        bins[bins < 0.3] = 0.0   # empty codewords, as most are for short blocks
        probe = type(block)(**{**block.__dict__, "v_codebook": codebook})
        want = layer.values_from_bins(probe, bins)
        got = np.empty(want.shape, np.float32)
        codebook_t = codebook.float().T.contiguous().numpy()
        rotation = layer.shared.rotation.matrix(bins.device).float().numpy()
        for b in range(bins.shape[0]):
            for h in range(layer.h_kv):
                rows_last = np.zeros((bins.shape[-1], 4), np.float32)   # as the kernel holds them: rows last, 4
                rows_last[:, :3] = bins[b, h].T.numpy()
                block_attention._head_values(rows_last, 3, codebook_t, block.v_scale[h].float().numpy(), rotation,
                                   np.empty((3, bins.shape[-1]), np.float32), np.empty(layer.d, np.float32),
                                   got[b, h])
        torch.testing.assert_close(torch.from_numpy(got), want, atol=1e-5, rtol=1e-5)


def test_the_threaded_kernels_give_the_serial_kernels_results_exactly():
    """With two torch threads the coefficient decode, the scores and the value pass run their parallel variants
    (numba's OpenMP or TBB pool, as many threads as torch): the same numbers as the serial kernels on one."""
    if numba_threads() < 2:
        pytest.skip("numba has one thread here")
    model = tiny_llama()
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_bits=2.5, salient=0.05, evict=0.1,
                                min_block=8, kernel="fast")
    prefill(model, cache, torch.randint(0, 128, (1, 2000), generator=torch.Generator().manual_seed(0)))
    query = torch.randn(1, model.config.num_attention_heads, 1, 16, generator=torch.Generator().manual_seed(1))
    before = torch.get_num_threads()
    runs = {}
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            assert numba_support._use_threads() == (threads == 2 and numba_support._threads_usable)
            runs[threads] = [cache.layers[i].fused_middle_partial(cache.layers[i].middle[0], query, cache._ctx)
                             for i in range(len(cache.layers))]
    finally:
        torch.set_num_threads(before)
    if not numba_support._threads_usable:
        pytest.skip("numba's threading layer here is its work queue: the serial kernels run")
    for one, two in zip(runs[1], runs[2]):
        assert torch.equal(one.out, two.out) and torch.equal(one.lse, two.lse)


def test_the_one_pass_merge_equals_merge_partials():
    """`step_parts.StepParts.merged` == the framework's `merge_partials` (the decode step's merge on the CPU fast path),
    with rows a part does not see (lse -inf) and a row no part sees (zeros, -inf); more parts than it holds: an
    error."""
    from kvshrink.cache.attention import Partial

    g = torch.Generator().manual_seed(0)
    parts = [Partial(torch.randn(2, 9, 1, 16, generator=g), torch.randn(2, 9, 1, generator=g) * 5) for _ in range(4)]
    parts[1].lse[0, 3] = float("-inf")
    for part in parts:
        part.lse[1, 7] = float("-inf")
    want = merge_partials(parts)
    held = step_parts.StepParts(torch.zeros(2, 9, 1, 16), 1.0, 4)
    for part in parts:
        held.add(part.out, part.lse)
    out, lse = held.merged()
    torch.testing.assert_close(out, want.out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want.lse, atol=1e-6, rtol=1e-6)
    assert torch.equal(out[1, 7], torch.zeros(1, 16)) and lse[1, 7] == float("-inf")
    with pytest.raises(RuntimeError, match="capacity"):
        held.add(parts[0].out, parts[0].lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [16, 4])
def test_the_one_pass_int8_attention_equals_exact_attention_over_the_decoded_codes(dtype, group):
    """`StepParts.int8` (8-bit salient tokens read in place, decoded and rounded to the exact dtype in the
    kernel) == exact attention over `dequantize_groups(code).to(dtype)`, what the torch path attends."""
    from kvshrink.cache.attention import exact_partial, group_queries, ungroup
    from kvshrink.codecs.groupwise import dequantize_groups, quantize_groups

    g = torch.Generator().manual_seed(0)
    keys = quantize_groups(torch.randn(2, 3, 37, 16, generator=g) * 3, 8, group)
    values = quantize_groups(torch.randn(2, 3, 37, 16, generator=g), 8, group)
    query = torch.randn(2, 9, 1, 16, generator=g)
    want = exact_partial(query, dequantize_groups(keys).to(dtype), dequantize_groups(values).to(dtype), 0.25)
    out, lse = one_part(group_queries(query, 3),
                        lambda parts: parts.int8(exact_parts.int8_arrays(keys), exact_parts.int8_arrays(values), dtype))
    torch.testing.assert_close(ungroup(out, 9), want.out.float(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ungroup(lse, 9), want.lse.float(), atol=2e-6, rtol=1e-6)
    if dtype != torch.float32:  # the rounding to the exact dtype is what makes them equal
        unrounded = exact_partial(query, dequantize_groups(keys), dequantize_groups(values), 0.25)
        assert not torch.allclose(ungroup(out, 9), unrounded.out, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_the_one_pass_exact_attention_equals_exact_partial(dtype):
    """`StepParts.exact` (the decode ring's exact tokens on the CPU fast path) == `exact_partial`."""
    from kvshrink.cache.attention import exact_partial, group_queries, ungroup

    g = torch.Generator().manual_seed(0)
    keys = (torch.randn(2, 3, 70, 16, generator=g) * 3).to(dtype)
    values = torch.randn(2, 3, 70, 16, generator=g).to(dtype)
    query = torch.randn(2, 9, 1, 16, generator=g)
    want = exact_partial(query, keys, values, 0.25)
    out, lse = one_part(group_queries(query, 3), lambda parts: parts.exact(keys[:, :, :50], values[:, :, :50]))
    part = exact_partial(query, keys[:, :, :50], values[:, :, :50], 0.25)  # a sliced (strided) ring
    torch.testing.assert_close(ungroup(out, 9), part.out.float(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ungroup(lse, 9), part.lse.float(), atol=2e-6, rtol=1e-6)
    out, lse = one_part(group_queries(query, 3), lambda parts: parts.exact(keys, values))
    torch.testing.assert_close(ungroup(out, 9), want.out.float(), atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ungroup(lse, 9), want.lse.float(), atol=2e-6, rtol=1e-6)


@pytest.mark.parametrize("column", [False, True])
def test_the_scaled_bases_in_one_call_equal_basis_factors_bit_for_bit(column):
    """`block_attention.scaled_bases` (the step's scaled key bases from the int8 bases in one numba call) == `BasisFactors
    .scaled_bases_t`'s torch ops bit for bit, for scopes of different ranks (zero past each), with and without
    per-channel scales."""
    from kvshrink.methods.shard.segments import BasisFactors

    g = torch.Generator().manual_seed(4)
    codes = []
    for rank in (5, 8, 3):
        codes.append(PCACode(mean=torch.randn(16, generator=g).half(),
                             basis_q=torch.randint(-127, 128, (16, rank), generator=g).to(torch.int8),
                             basis_scale=torch.rand(rank, generator=g).half(),
                             coeff_step=torch.rand(rank, generator=g).half(),
                             codes=torch.zeros(1, 2, 1, dtype=torch.uint8),
                             column_scale=(torch.rand(16, generator=g) + 0.5).half() if column else None))
    factors = BasisFactors.of(codes)
    got = block_attention.scaled_bases(tuple(code.basis_q.numpy() for code in codes), factors.factor, factors.column)
    want = factors.scaled_bases_t(codes)
    assert got.shape == want.shape == (3, 16, 8)
    assert torch.equal(got, want)


@pytest.mark.parametrize("way", ["native", "bits"])
def test_every_float16_word_decodes_as_torch_converts_it(way):
    """Both ways the kernels read float16 words (the CPU's conversion instruction, ``half_words.NATIVE_HALF``, and the bit
    formula kept for CPUs without one) == torch's float16 to float32 conversion for all 65,536 words (zeros,
    subnormals, normals, infinities, NaNs): one at a time (`_half_float_*`: the stream's norms) and as rows
    (`_widen_half_rows_*`: the ring, LRQK's slots, window and factors; rows of 64 and of 16 words)."""
    if way == "native" and not half_words.NATIVE_HALF:
        pytest.skip("this CPU has no float16 conversion instruction")
    one, rows = (half_words._half_float_native, half_words._widen_half_rows_native) if way == "native" else \
        (half_words._half_float_bits, half_words._widen_half_rows_bits)
    words = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16)
    want = words.view(torch.float16).float().numpy()
    uint16 = words.numpy().view(np.uint16)
    got = np.array([one(w, half_words._HALF_POW2) for w in uint16], np.float32)
    np.testing.assert_array_equal(got, want)
    for d in (64, 16):
        bits = np.zeros(((1 << 16) // d, d), np.uint32)
        rows(uint16.reshape(-1, d), bits.shape[0] - 1, half_words._HALF_POW2, bits)
        np.testing.assert_array_equal(bits[:-1].view(np.float32), want.reshape(-1, d)[:-1])
        assert not bits[-1].any()                                   # only the first n rows


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("live,new", [(70, True), (70, False), (41, True), (0, True)])
def test_the_ring_read_from_its_words_equals_exact_partial(dtype, live, new):
    """`StepParts.ring` (a 16-bit ring's first ``live`` rows read in place from its words, the step's float32 token
    attended in the same call) == `exact_partial` over the ring's rows widened to float32 and the new token."""
    from kvshrink.cache.attention import exact_partial, group_queries, ungroup

    g = torch.Generator().manual_seed(live)
    kv = torch.randn(2, 2, 3, 70, 16, generator=g)
    kv[:, :, :, ::7] *= torch.logspace(-7, 0, 16)          # every 7th token's rows with subnormals, one with a zero
    kv[0, 1, 2, 14, 3] = 0.0
    kv = kv.to(dtype)
    token = torch.randn(2, 2, 3, 1, 16, generator=g)
    query = torch.randn(2, 9, 1, 16, generator=g)
    keys, values = kv[0, :, :, :live].float(), kv[1, :, :, :live].float()
    if new:
        keys, values = torch.cat([keys, token[0]], dim=2), torch.cat([values, token[1]], dim=2)
    want = exact_partial(query, keys, values, 0.25)
    parts = step_parts.StepParts(group_queries(query, 3), 0.25, 1)
    parts.ring(exact_parts.ring_words(kv), live, dtype, (token[0], token[1]) if new else None)
    out, lse = parts.merged()
    torch.testing.assert_close(ungroup(out, 9), want.out, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(ungroup(lse, 9), want.lse, atol=2e-6, rtol=1e-6)


def test_the_stream_read_in_its_buffer_equals_the_compact_codes():
    """`StepParts.turbo` over `turbo_arrays` views of a stream buffer's first ``n`` tokens (strided: capacity past
    ``n``) == `turbo_attention` over the same codes made compact; a norm beyond float16's range (inf) scores as
    the torch ops score it."""
    from kvshrink.codecs.lloyd_max import TurboCode, TurboQuantizer
    from kvshrink.methods.shard.reference import _softmax_part

    g = torch.Generator().manual_seed(5)
    turbo = TurboQuantizer(16, 4, seed=3)
    keys, values = (turbo.encode(torch.randn(2, 3, 7, 16, generator=g)) for _ in range(2))
    buffer = TurboCode(norm=torch.zeros(2, 2, 3, 12, dtype=torch.float16),
                       codes=torch.zeros(2, 2, 3, 12, 8, dtype=torch.uint8))
    for i, code in enumerate((keys, values)):
        buffer.norm[i, :, :, :7], buffer.codes[i, :, :, :7] = code.norm, code.codes
    codes, norm = stream.turbo_arrays(buffer)
    query = torch.randn(2, 3, 4, 16, generator=g)
    parts = step_parts.StepParts(query, 0.25, 1)
    parts.turbo(turbo, (codes[0, ..., :7, :], norm[0, ..., :7]), (codes[1, ..., :7, :], norm[1, ..., :7]))
    out, lse = parts.merged()
    want_out, want_lse = stream.turbo_attention(turbo, query, keys, values, 0.25)
    torch.testing.assert_close(out, want_out, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(lse, want_lse, atol=1e-6, rtol=1e-6)
    values.norm[0, 0, 2] = float("inf")
    out, _ = stream.turbo_attention(turbo, query, keys, values, 0.25)
    probs, _ = _softmax_part(turbo.inner_products(query, keys) * 0.25)
    torch.testing.assert_close(out, turbo.weighted_sum(probs, values), atol=1e-5, rtol=1e-5, equal_nan=True)
    assert not torch.isfinite(out[0, 0]).all()


def numba_threads() -> int:
    import numba

    return numba.config.NUMBA_NUM_THREADS


@pytest.mark.parametrize("n", [0, 1, 15, 17, 1000])
def test_the_one_pass_softmax_equals_torch_s(n):
    """`softmax._softmax_rows` (exp as a vectorised polynomial) == torch's softmax and log-sum-exp within float32
    rounding, with masked tokens (-inf: exactly zero), a row masked whole (zeros, -inf), and scores spread past
    exp's range (the smallest probabilities underflow to zero, as in torch)."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randn(6, n, generator=g) * torch.tensor([1.0, 8.0, 40.0, 200.0, 3.0, 1.0])[:, None]
    scores[4, ::3] = float("-inf")
    scores[5] = float("-inf")
    probs, lse = scores.numpy().copy(), np.empty(6, np.float32)
    softmax._softmax_rows(probs, lse)
    want_lse = torch.logsumexp(scores, dim=-1)
    want = torch.exp(scores - want_lse.clamp_min(torch.finfo(torch.float32).min)[:, None])
    torch.testing.assert_close(torch.from_numpy(probs), want, atol=1e-7, rtol=1e-5)
    torch.testing.assert_close(torch.from_numpy(lse), want_lse, atol=1e-5, rtol=1e-6)
    assert (torch.from_numpy(probs)[scores == float("-inf")] == 0).all()
    live = (scores > float("-inf")).any(-1)
    assert torch.from_numpy(probs)[live].sum(-1).sub(1).abs().le(1e-5).all()


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_one_pass_stream_attention_equals_the_torch_ops(bits):
    """`stream.turbo_attention` (scores, softmax and weighted sum straight from TurboQuant codes) == the torch
    ops Shard's stream partial uses otherwise (`inner_products`, softmax, `weighted_sum`)."""
    from kvshrink.codecs.lloyd_max import TurboQuantizer
    from kvshrink.methods.shard.reference import _softmax_part

    g = torch.Generator().manual_seed(bits)
    turbo = TurboQuantizer(16, bits, seed=3)
    assert stream.turbo_supported(turbo) and not stream.turbo_supported(TurboQuantizer(16, bits, qjl=True))
    keys, values = (turbo.encode(torch.randn(2, 3, 7, 16, generator=g)) for _ in range(2))
    query = torch.randn(2, 3, 4, 16, generator=g)
    out, lse = stream.turbo_attention(turbo, query, keys, values, 0.25)
    probs, want_lse = _softmax_part(turbo.inner_products(query, keys) * 0.25)
    want = turbo.weighted_sum(probs, values)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    # vectors coded less their centres: every score gains q . key centre (the lse alone), the output the value one
    centre = torch.randn(2, 2, 3, 16, generator=g) * 4
    out, lse = stream.turbo_attention(turbo, query, keys, values, 0.25, centre)
    torch.testing.assert_close(out, want + centre[1].unsqueeze(-2), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, want_lse + (query * centre[0].unsqueeze(-2)).sum(-1) * 0.25, atol=1e-4,
                               rtol=1e-5)


@pytest.mark.parametrize("dim,bits", [(64, 2), (64, 1), (48, 4), (128, 8)])
def test_the_one_pass_stream_encode_equals_turbo_encode(dim, bits):
    """`encoders.turbo_encode_into` (the CPU fast path's stream encode) writes `TurboQuantizer.encode`'s codes and
    norms, bit for bit, into tokens ``at ..`` of a buffer, from keys and values where they lie (a strided slot
    of a float16 ring buffer), touching nothing else; norms cover float16's subnormal and overflow ends."""
    from kvshrink.codecs.lloyd_max import TurboQuantizer

    turbo = TurboQuantizer(dim, bits, seed=1)
    ring = torch.randn(2, 2, 3, 9, dim, generator=torch.Generator().manual_seed(4))
    ring[0, 0, 0, 5] *= 1e-7                       # a norm below float16's smallest normal
    ring[1, 1, 2, 6] *= 1e4                        # a norm beyond float16's largest: inf, as torch rounds it
    ring[0, 1, 1, 6] = 0.0                         # a zero vector
    x = ring[:, :, :, 5:7]                         # two tokens of the ring, not contiguous
    centre = torch.randn(2, 2, 3, dim, generator=torch.Generator().manual_seed(5)) * 3
    centre[0, 0, 0] = 0.0                          # the tiny norm and the zero vector kept for their row
    centre[0, 1, 1] = 0.0
    for given in (None, centre):
        want = turbo.encode(x.float() - (0.0 if given is None else given.unsqueeze(-2)))
        codes = torch.zeros(2, 2, 3, 10, want.codes.shape[-1], dtype=torch.uint8)
        norm = torch.zeros(2, 2, 3, 10, dtype=torch.float16)
        encoders.turbo_encode_into(turbo, x, codes, norm, 3, given)
        assert torch.equal(codes[..., 3:5, :], want.codes)
        assert torch.equal(norm[..., 3:5].view(torch.int16), want.norm.view(torch.int16))
        assert not codes[..., :3, :].any() and not codes[..., 5:, :].any() and not norm[..., 5:].any()


@pytest.mark.parametrize("planted", [None, 65504.0, 65520.0, -1e5, float("inf"), float("nan"), "nan in the ring"])
def test_the_one_pass_ring_step_equals_pop_encode_and_put(planted):
    """`encoders.ring_step` (a full ring's decode commit on the CPU fast path) against what it replaces: the slot's
    token coded by `turbo_encode_into` into the stream, then the new token stored in the slot as `.to(float16)`
    rounds it. The same codes, norms and ring, bit for bit; a new value beyond float16's range refused with
    nothing changed (its magnitude returned); a NaN let through as `to_storage` lets it through."""
    from kvshrink.cache.store import to_storage
    from kvshrink.codecs.lloyd_max import TurboQuantizer

    turbo = TurboQuantizer(64, 2, seed=1)
    g = torch.Generator().manual_seed(8)
    kv = (torch.randn(2, 1, 3, 6, 64, generator=g) * 3).half()
    key, value = torch.randn(1, 3, 1, 64, generator=g) * 100, torch.randn(1, 3, 1, 64, generator=g)
    if planted == "nan in the ring":
        kv[1, 0, 2, 4, 7] = float("nan")
    elif planted is not None:
        key[0, 1, 0, 9] = planted
    codes, norm = torch.zeros(2, 1, 3, 5, 16, dtype=torch.uint8), torch.zeros(2, 1, 3, 5, dtype=torch.float16)
    centre = torch.randn(2, 1, 3, 64, generator=g)
    want_kv, want_codes, want_norm = kv.clone(), codes.clone(), norm.clone()
    try:
        new = torch.stack([to_storage(key, torch.float16), to_storage(value, torch.float16)])
        encoders.turbo_encode_into(turbo, want_kv[:, :, :, 4:5], want_codes, want_norm, 2, centre)
        want_kv[:, :, :, 4:5] = new
        refused = False
    except ValueError:
        refused = True
    given = kv.clone()
    peak = encoders.ring_step(turbo, exact_parts.ring_words(kv), 4, key, value, *stream.stream_words(codes, norm), 2, centre)
    assert (peak is not None) == refused
    if refused:
        assert peak == abs(planted) and torch.equal(kv.view(torch.int16), given.view(torch.int16))
        assert not codes.any() and not norm.any()
    else:
        assert torch.equal(kv.view(torch.int16), want_kv.view(torch.int16))
        assert torch.equal(codes, want_codes) and torch.equal(norm.view(torch.int16), want_norm.view(torch.int16))


_COLD_DECODE_SCRIPT = r"""
import importlib, pkgutil, sys, torch, kvshrink
import kvshrink.kernels.cpu
from numba.core.registry import CPUDispatcher
from transformers import LlamaConfig, LlamaForCausalLM

spec, options = sys.argv[1], eval(sys.argv[2])
torch.set_num_threads(2)                 # the parallel kernels too, as a user's process runs them
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=128, hidden_size=80, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=5, num_key_value_heads=5, head_dim=16, max_position_embeddings=2048)
model = LlamaForCausalLM(cfg).eval()
cache = kvshrink.make_cache(spec, model, **options)
with torch.no_grad():
    out = model(torch.randint(0, 128, (1, 300)), past_key_values=cache)


def signatures():
    modules = [importlib.import_module(f"kvshrink.kernels.cpu.{m.name}")
               for m in pkgutil.iter_modules(kvshrink.kernels.cpu.__path__)]
    return {(module.__name__, name): len(f.signatures) for module in modules
            for name, f in vars(module).items() if isinstance(f, CPUDispatcher)}


before = signatures()
assert any(before.values())
with torch.no_grad():
    for _ in range(20):
        out = model(out.logits[:, -1:].argmax(-1), past_key_values=cache)
print({key: (before[key], n) for key, n in signatures().items() if n != before[key]})
"""


@pytest.mark.parametrize("spec,options", [("shard", {"sinks": 4, "window": 16}),
                                          ("shard", {"sinks": 4, "window": 16, "rope_frame": 16}),
                                          ("lrqk", {"top_k": 32, "window": 16})])
def test_decoding_compiles_no_kernel(spec, options):
    """`make_cache` warms the numba kernels decoding will run (in a fresh process: compiled kernels are the
    process's), for this model's number of PCA scopes (one per KV head: five here) and the stream's views of its
    buffer (reached once the ring is full): 20 decode steps add no signature to any kernel (each one compiled
    costs seconds on a fresh machine; numba's cache on disk makes the test quick)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _COLD_DECODE_SCRIPT, spec, repr(options)], capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == "{}", done.stdout
