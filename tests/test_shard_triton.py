"""Shard's GPU path: the Triton kernels of the compressed middle (`kernels.shard_code_attention`) against
the torch reference path, their oracle, run in Triton's interpreter on CPU tensors (`force_gpu_path`),
and on a real CUDA device in bf16 (marked ``cuda``)."""
import contextlib
import copy
import functools
import math
import os

import pytest
import torch

pytest.importorskip("triton")

import kvshrink  # noqa: E402
from kvshrink.cache.attention import group_queries, merge_partials  # noqa: E402
from kvshrink.cache.rowwise import row_context  # noqa: E402
from kvshrink.kernels.cpu import block_attention, numba_support  # noqa: E402
from kvshrink.codecs.bitpack import unpack_bits  # noqa: E402
from kvshrink.codecs.groupwise import GroupCode, quantize_groups  # noqa: E402
from kvshrink.codecs.rope import pair_order  # noqa: E402
from kvshrink.codecs.table_decoder import scaled_bases  # noqa: E402
from kvshrink.kernels import backend  # noqa: E402
from kvshrink.kernels.backend import force_gpu_path  # noqa: E402
from kvshrink.kernels.counting import OpCounter  # noqa: E402
from kvshrink.methods.shard import layer as shard_layer  # noqa: E402
from kvshrink.methods.shard import reference as shard_reference  # noqa: E402
from kvshrink.methods.shard.salient import SalientTokens, salient_partials  # noqa: E402
from kvshrink.methods.shard.segments import stacked_codes  # noqa: E402

if not backend.triton_available():  # pragma: no cover - depends on the environment
    pytest.skip(f"Triton does not import: {backend.triton_unavailable_reason()}", allow_module_level=True)

from kvshrink.kernels import shard_code_attention as sca  # noqa: E402


@functools.lru_cache(maxsize=None)
def model_with(head_dim=64, q_heads=4, kv_heads=2, layers=1, seed=0, dtype=torch.float32):
    """A random one-layer Llama (kept for the module: tests only read it)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=q_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      max_position_embeddings=2048, rope_theta=10000.0)
    return LlamaForCausalLM(cfg).eval().to(dtype)


# Small value codebooks unless a case says otherwise: the default 256 x 4 Gaussian codebook takes ~20 s
# of k-means to make on first use (once per process), far more than the kernels' checks.
SMALL = dict(v_group=4, v_codebook=16)


def shard_cache(model, tokens=120, batch=1, mask=None, **opts):
    """A Shard cache after one prefill of ``tokens``: sinks 4, window 16, the rest one middle block."""
    opts = {"sinks": 4, "window": 16, "exact_dtype": "model", **SMALL, **opts}
    cache = kvshrink.make_cache("shard", model, **opts)
    ids = torch.randint(0, 128, (batch, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids.to(model.device), attention_mask=mask, past_key_values=cache)
    return cache


def row_layers(cache, batch):
    """``(layer, ctx)`` of every row of every layer (a batch splits into rows, each with its own layers)."""
    if batch == 1:
        return [(layer, cache._ctx) for layer in cache.layers]
    return [(layer.rows[i], row_context(cache._ctx, i)) for layer in cache.layers for i in range(batch)]


def assert_triton_equals_reference(cache, batch=1, q_lens=(1,), atol=2e-5, rtol=1e-4):
    g = torch.Generator().manual_seed(3)
    info, checked = cache.info, 0
    for layer, ctx in row_layers(cache, batch):
        for block in layer.blocks():
            for q_len in q_lens:
                q = torch.randn(1, info.num_q_heads, q_len, info.head_dim, generator=g) * 2
                with force_gpu_path():
                    assert layer.use_triton_kernel(q)
                    got = merge_partials(layer.middle_partials(block, q, ctx))
                want = merge_partials(layer.reference_middle_partials(block, q, ctx))
                torch.testing.assert_close(got.out, want.out, atol=atol, rtol=rtol)
                torch.testing.assert_close(got.lse, want.lse, atol=atol, rtol=rtol)
                checked += 1
    assert checked > 0
    return checked


# Every code path of the kernels: key widths (byte-aligned 2/4/8 bits and straddling 3/5/6), components
# dropped, one PCA per layer or per head, held (salient) rows, evicted rows, value groups 1/2/4 and code
# widths 3/4/5 (straddling too; 8 bits in `test_kernel_with_8_bit_value_codes`), per-column key scales,
# GQA ratios 1/2/4/8, head sizes 64 and 128.
CASES = [
    (dict(key_bits=2.0), dict()),
    (dict(key_bits=3.0, pca_scope="layer"), dict()),
    (dict(key_bits=4.0), dict(head_dim=128, q_heads=8, kv_heads=2)),                  # GQA 4, d 128
    (dict(key_bits=5.0, pca_group=3), dict()),                                          # 6-bit runs straddle
    (dict(key_bits=0.75, pca_scope="layer"), dict(q_heads=2, kv_heads=2)),             # GQA 1, dropped comps
    (dict(key_bits=2.5, salient=0.05), dict(q_heads=8, kv_heads=1)),                   # GQA 8, held rows
    (dict(key_bits=2.5, salient=0.05, pca_scope="layer"), dict(head_dim=128)),
    (dict(key_bits=2.5, evict=0.1, salient=0.05, min_block=8, keep_tokens=0), dict()),  # evicted rows
    (dict(v_group=1, v_codebook=8), dict()),                                           # 3-bit value codes
    (dict(v_group=2, v_codebook=32), dict(head_dim=128)),                              # 5-bit value codes
    (dict(key_weights="query", v_group=2, v_codebook=16), dict()),    # (k_levels="uniform": 30 s to set up)
    (dict(cold=0.3, salient=0.05, min_block=8), dict(head_dim=128)),                   # hot and cold blocks
    (dict(v_centre=True, salient=0.05, salient_read=0.5), dict()),                     # value means added back
    (dict(rope_frame=16, evict=0.1, salient=0.05, min_block=8, keep_tokens=0), dict()),  # keys at their frames
]


@pytest.mark.parametrize("opts,shape", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_triton_block_attention_equals_reference(opts, shape):
    cache = shard_cache(model_with(**shape), **opts)
    if opts.get("evict"):  # the kept rows' block and the evicted rows' block
        assert all(layer.middle[0].kept is not None and layer.evicted for layer in cache.layers)
        for layer in cache.layers:  # held uncoded until the next call: coded as a fork or save codes them
            layer.code_evicted()
    if opts.get("salient"):  # (a cold block holds none: its tokens are the least read)
        assert all(layer.middle[0].salient is not None for layer in cache.layers)
    if opts.get("cold"):
        assert all(len(layer.middle) == 2 and layer.middle[1].v_codebook.shape[1] == 8 for layer in cache.layers)
    assert_triton_equals_reference(cache)


def test_triton_path_with_padding_batch_rows_stream_and_several_blocks():
    """A left-padded batch of 2 (rows decode as alone), two prefill chunks (two blocks per layer), decode
    steps (the TurboQuant stream), and query rows past one row tile (5 tokens x 4 heads)."""
    model = model_with(head_dim=64, q_heads=8, kv_heads=2)
    mask = torch.ones(2, 150, dtype=torch.long)
    mask[1, :23] = 0
    ids = torch.randint(0, 128, (2, 150), generator=torch.Generator().manual_seed(0))
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, min_block=32, exact_dtype="model", **SMALL)
    with torch.no_grad():
        model(ids[:, :80], attention_mask=mask[:, :80], past_key_values=cache)
        model(ids[:, 80:], attention_mask=mask, past_key_values=cache)
    with force_gpu_path(), torch.no_grad():
        for t in range(3):
            mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
            model(torch.full((2, 1), t + 1), attention_mask=mask, past_key_values=cache)
    rows = cache.layers[0].rows
    assert [len(row.middle) for row in rows] == [2, 2] and [row.stream.n for row in rows] == [3, 3]
    assert assert_triton_equals_reference(cache, batch=2, q_lens=(1, 5)) == 8
    # the device plans the GPU path built are counted with the cache's bytes
    plans = sum(block.derived.device_nbytes() for row in rows for block in row.middle)
    assert rows[0].breakdown()["middle_device_plans"] + rows[1].breakdown()["middle_device_plans"] == plans > 0


def test_query_rows_in_slices_when_the_scores_would_be_large(monkeypatch):
    """Prefill-with-past sized queries: the rows go through the kernels in slices (bounded scores)."""
    cache = shard_cache(model_with(), salient=0.05)
    monkeypatch.setattr(shard_reference, "SCORE_ELEMENTS", 2 * 100 * 7)   # 7 rows of 2 heads x 100 tokens
    assert assert_triton_equals_reference(cache, q_lens=(20,)) == 1


def test_a_forced_gpu_path_decodes_the_same_tokens_as_the_cpu_path():
    model = model_with(layers=2)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    logits = {}
    for forced in (False, True):
        cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_bits=2.0, salient=0.03, **SMALL)
        with force_gpu_path(forced), torch.no_grad():
            out = [model(ids, past_key_values=cache).logits[:, -1]]
            for _ in range(3):
                out.append(model(out[-1].argmax(-1, keepdim=True), past_key_values=cache).logits[:, -1])
        logits[forced] = torch.stack(out)
    torch.testing.assert_close(logits[True], logits[False], atol=1e-4, rtol=1e-4)


# ---- kernel level: `sca.code_attention` against `block_attention.code_attention` and a plain torch oracle ---------

def torch_code_attention(codes, plan, scaled, mean, cos, sin, query, scaling, hidden, v_codes, v_bits,
                         n_groups):
    """`block_attention.code_attention` in plain torch: keys decoded from the codes by each component's bits (the
    `ComponentPlan`), RoPE in pair order, softmax with held rows masked, probabilities binned per codeword."""
    cplan = sca.component_plan(plan, scaled.shape[1], codes.device)
    batch, heads, rows, d = query.shape
    n_scopes, n = codes.shape[1], codes.shape[2]
    c = codes.long()
    keys = []
    for s in range(n_scopes):
        coeff = torch.zeros(batch, n, scaled.shape[1])
        for k in range(scaled.shape[1]):
            bits = int(cplan.bits[s, k])
            if bits:
                at, shift = divmod(int(cplan.bit[s, k]), 8)
                word = c[:, s, :, at] | (c[:, s, :, min(at + 1, c.shape[-1] - 1)] << 8)
                coeff[..., k] = cplan.levels[int(cplan.level[s, k]) + ((word >> shift) & ((1 << bits) - 1))]
        keys.append((mean[s].float() + coeff @ scaled[s].float()).reshape(batch, n, -1, d))   # [B, n, hps, d]
    keys = torch.cat(keys, dim=2).transpose(1, 2)                                                # [B, H, n, d]
    re, im = keys[..., 0::2], keys[..., 1::2]
    c_, s_ = cos.float()[:, None], sin.float()[:, None]
    rot = torch.stack([re * c_ - im * s_, re * s_ + im * c_], dim=-1).reshape(keys.shape)
    scores = query.float() @ rot.transpose(-1, -2) * scaling
    if hidden is not None:
        scores.scatter_(3, hidden.long().unsqueeze(2).expand(-1, -1, rows, -1), float("-inf"))
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse.masked_fill(torch.isinf(lse), 0).unsqueeze(-1))
    idx = unpack_bits(v_codes, v_bits, n_groups) + torch.arange(n_groups) * (1 << v_bits)    # [B, H, n, G]
    bins = torch.zeros(batch, heads, rows, n_groups << v_bits)
    src = probs.unsqueeze(-1).expand(-1, -1, -1, -1, n_groups).reshape(batch, heads, rows, -1)
    bins.scatter_add_(3, idx.reshape(batch, heads, 1, -1).expand(-1, -1, rows, -1), src)
    return bins, lse


def kernel_inputs(batch=2, q_len=3, with_layout=False, **opts):
    """The arguments of ``code_attention`` for the first block of a cache, with ``batch`` rows (the
    block's codes repeated with rows of other codes' values mixed in) and several query rows."""
    model = model_with(**opts.pop("shape", {}))
    cache = shard_cache(model, **opts)
    layer, ctx = cache.layers[0], cache._ctx
    block = layer.middle[0]
    d = layer.d
    g = torch.Generator().manual_seed(5)
    plan = layer.slot_plan(block)
    scaled, mean = scaled_bases(block.keys, plan.columns)
    cos, sin = layer.shared.pair_rope(ctx, block.start, block.covers, block.rows())
    codes = stacked_codes(block.keys)
    v_codes = block.v_codes
    if batch > 1:   # other rows: the same layout, shuffled tokens (other codes, other RoPE)
        perm = [torch.randperm(block.n, generator=g) for _ in range(batch - 1)]
        codes = torch.cat([codes] + [codes[:, :, p] for p in perm])
        v_codes = torch.cat([v_codes] + [v_codes[:, :, p] for p in perm])
        cos, sin = torch.cat([cos] * batch), torch.cat([sin.flip(1)] + [sin] * (batch - 1))
    q = torch.randn(batch, cache.info.num_q_heads, q_len, d, generator=g) * 2
    qg = group_queries(q, layer.h_kv)[..., pair_order(d)].contiguous()
    hidden = None
    if block.salient is not None:
        hidden = block.salient.index.expand(batch, -1, -1).contiguous()
    k_entries, group = block.v_codebook.shape
    args = [codes, plan, scaled, mean, cos, sin, qg, ctx.scaling, hidden, v_codes, int(math.log2(k_entries)),
            d // group]
    return (args, layer.run_layout(block)) if with_layout else args


KERNEL_CASES = [dict(key_bits=2.0), dict(key_bits=5.0, pca_group=3, salient=0.05),
                dict(key_bits=3.0, pca_scope="layer", v_group=2, v_codebook=32, shape=dict(q_heads=8, kv_heads=2))]


@pytest.mark.parametrize("dim,bits", [(64, 2), (64, 3), (48, 4), (128, 8)])
def test_stream_encode_kernel_equals_turbo_encode(dim, bits):
    """`turbo_encode_into` writes `TurboQuantizer.encode`'s codes and norms of the vectors less their row's
    centre (or of the vectors themselves, with none), bit for bit, into tokens ``at ..`` of a buffer, reading
    keys and values where they lie (a strided slot of a ring buffer)."""
    from kvshrink.codecs.lloyd_max import TurboQuantizer

    g = torch.Generator().manual_seed(4)
    turbo = TurboQuantizer(dim, bits, seed=1)
    ring = torch.randn(2, 2, 3, 9, dim, generator=g).to(torch.float16)
    x = ring[:, :, :, 5:7]                                   # two tokens of the ring, not contiguous
    centre = torch.randn(2, 2, 3, dim, generator=g) * 3
    for given in (None, centre):
        want = turbo.encode(x.float() - (0.0 if given is None else given.unsqueeze(-2)))
        codes = torch.zeros(2, 2, 3, 10, want.codes.shape[-1], dtype=torch.uint8)
        norm = torch.zeros(2, 2, 3, 10, dtype=torch.float16)
        with force_gpu_path():
            sca.turbo_encode_into(turbo, x, codes, norm, 3, given)
        assert torch.equal(codes[..., 3:5, :], want.codes) and torch.equal(norm[..., 3:5], want.norm)
        assert not codes[..., :3, :].any() and not codes[..., 5:, :].any()


def test_the_stream_buffer_grows_and_compacts():
    """The stream is a buffer written in place (GPU path and CPU fast path): past its capacity it grows by an
    eighth of what it holds (the codes held copied once), its free slots are counted as held bytes, and a
    concatenation makes it compact again."""
    from kvshrink.codecs.lloyd_max import TurboQuantizer
    from kvshrink.cache.store import held_bytes
    from kvshrink.methods.shard import segments

    turbo = TurboQuantizer(16, 4, seed=1)
    x = torch.randn(2, 1, 2, 70, 16, generator=torch.Generator().manual_seed(4))
    stream = segments.TurboSegment()
    with force_gpu_path():
        for t in range(x.shape[3]):
            buffer = stream.room(1, (1, 2), 8, x.device)
            sca.turbo_encode_into(turbo, x[:, :, :, t:t + 1], buffer.codes, buffer.norm, stream.n)
            stream.filled(100 + t, 1)
    want = turbo.encode(x)
    # grown by an eighth of what it held (at least 8): 9, 18, 27, ..., 63, then 64 + 8 slots
    assert stream.n == 70 and stream.runs == [(100, 70)] and stream.buffer.codes.shape[-2] == 72  # one run
    assert torch.equal(stream.keys.codes, want.codes[0]) and torch.equal(stream.values.norm, want.norm[1])
    assert held_bytes(stream.tensors()) == stream.buffer.nbytes()
    stream.append(*(turbo.encode(x[i, :, :, :1]) for i in (0, 1)), 170, 1)
    assert stream.buffer is None and stream.keys.codes.is_contiguous() and stream.n == 71


@pytest.mark.parametrize("opts", KERNEL_CASES, ids=["2bit", "6bit-runs-held", "layer-scope-5bit-values"])
def test_kernel_equals_torch_oracle_and_numba(opts):
    args, layout = kernel_inputs(with_layout=True, **opts)
    bins, lse = sca.code_attention(*args)
    want_bins, want_lse = torch_code_attention(*args)
    torch.testing.assert_close(bins, want_bins, atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    assert bins.sum(-1).div(args[-1]).sub(1).abs().max() < 1e-5   # each group's probabilities sum to one
    if numba_support.available():   # the CPU kernel reads the runs' layout and RoPE channel-major
        cpu_args = [args[0], layout] + args[2:4] + [args[4].transpose(1, 2), args[5].transpose(1, 2)] + args[6:]
        numba_bins, numba_lse = block_attention.code_attention(*cpu_args)
        torch.testing.assert_close(bins, numba_bins, atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(lse, numba_lse, atol=1e-5, rtol=1e-5)


def test_kernel_with_8_bit_value_codes():
    """256 codewords per group (the default codebook's width; random codes: no codebook is needed)."""
    args = kernel_inputs(batch=2, key_bits=2.0)
    batch, heads, n = args[9].shape[:3]
    args[9] = torch.randint(0, 256, (batch, heads, n, 16), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    args[10], args[11] = 8, 16
    for tiles in (None, sca.GPU_TILES):
        bins, lse = sca.code_attention(*args, tiles=tiles)
        want_bins, want_lse = torch_code_attention(*args)
        torch.testing.assert_close(bins, want_bins, atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_kernel_with_the_gpu_tiles_equals_the_interpreter_tiles():
    """The tiles a GPU takes (32 tokens, 32 components, groups of one-hots side by side): several token
    tiles per head, several component chunks and value-group tiles, with rows past one row tile."""
    args = kernel_inputs(batch=2, q_len=5, key_bits=3.0, salient=0.05, v_group=2, v_codebook=16,
                         shape=dict(q_heads=8, kv_heads=2))
    assert args[0].shape[2] > 2 * sca.GPU_TILES.n and args[2].shape[1] > sca.GPU_TILES.k
    assert args[6].shape[2] > sca.GPU_TILES.r and args[-1] * 16 > sca.GPU_TILES.bin_columns
    bins, lse = sca.code_attention(*args, tiles=sca.GPU_TILES)
    want_bins, want_lse = torch_code_attention(*args)
    torch.testing.assert_close(bins, want_bins, atol=2e-6, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_kernel_takes_16_bit_inputs_and_accumulates_in_float32():
    args = kernel_inputs(batch=1, key_bits=2.0)
    for dtype in (torch.float16, torch.bfloat16):
        low = list(args)
        for i in (2, 3, 4, 5, 6):   # scaled, mean, cos, sin, query
            low[i] = args[i].to(dtype)
        exact = [x.float() if isinstance(x, torch.Tensor) and x.dtype == dtype else x for x in low]
        bins, lse = sca.code_attention(*low)
        want_bins, want_lse = torch_code_attention(*exact)
        assert bins.dtype == lse.dtype == torch.float32
        torch.testing.assert_close(bins, want_bins, atol=2e-6, rtol=1e-4)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)


def test_a_row_whose_tokens_are_all_held_contributes_nothing():
    args = kernel_inputs(batch=1, key_bits=2.0)
    n = args[0].shape[2]
    heads = args[6].shape[1]
    args[8] = torch.arange(n, dtype=torch.int32).expand(1, heads, n).contiguous()   # every row held
    bins, lse = sca.code_attention(*args)
    assert torch.isneginf(lse).all() and bins.abs().sum() == 0



@pytest.mark.parametrize("frame", [1, 16])
@pytest.mark.parametrize("half,start,n", [(32, 0, 70), (12, 5000, 9), (64, 131000, 130)])
def test_pair_rope_kernel_equals_the_steps_rope_tables(half, start, n, frame):
    """`pair_rope` (one launch) == `StepContext.rope`'s first half at the same positions: rows with their
    own left padding (positions clamped at 0), a head size whose half is not a power of two, long contexts;
    positions rounded down to their frames (`rope_frame`)."""
    from kvshrink.cache.base import StepContext

    freqs = 1.0 / (10000 ** (torch.arange(half, dtype=torch.float32) / half))
    offset = torch.tensor([0, 3, 40])
    ctx = StepContext(start, 1, 1.0, None, offset, type("Rotary", (), {"inv_freq": freqs})(), torch.float32)
    positions = ctx.positions(torch.arange(start, start + n))
    cos, sin = ctx.rope(positions - positions % frame)
    got_cos, got_sin = sca.pair_rope(freqs, offset, start, n, frame)
    # the same angles; cos/sin of an angle near 1e5 radians differ by a few float32 ulps between libraries
    tol = 2e-6 * max(1.0, (start + n) / 1000)
    torch.testing.assert_close(got_cos, cos[..., :half], atol=tol, rtol=0)
    torch.testing.assert_close(got_sin, sin[..., :half], atol=tol, rtol=0)
    if start == 0 and frame == 1:   # row 1's three padding tokens and its first token all sit at position 0
        assert (got_cos[1, :4] == 1).all() and (got_sin[1, :4] == 0).all() and got_sin[1, 4, 0] != 0

# ---- the decode stream (TurboQuant codes) ------------------------------------------------------------------

@pytest.mark.parametrize("dim,bits,qjl,rows", [(64, 4, False, 3), (64, 3, True, 20), (24, 2, False, 4),
                                               (128, 8, True, 8), (128, 4, False, 32)])
@pytest.mark.parametrize("rotate_in_kernel", [True, False], ids=["decode-rows", "many-rows"])
def test_stream_kernels_equal_the_torch_stream(dim, bits, qjl, rows, rotate_in_kernel, monkeypatch):
    """`turbo_attention` == `TurboQuantizer.inner_products` / softmax / `weighted_sum` (the CPU path's
    stream partial): straddling 3-bit codes, the QJL sketch, a non-Hadamard rotation (24), row tiles,
    queries rotated in the kernel (decode) or before it (many rows); the vectors' centres added back (every
    score's ``q . key centre``, the value centre to the output) as the layer's torch stream adds them."""
    from kvshrink.codecs.lloyd_max import TurboQuantizer

    if not rotate_in_kernel:
        monkeypatch.setattr(sca, "_ROTATE_IN_KERNEL_ROWS", 0)

    g = torch.Generator().manual_seed(dim + bits)
    turbo = TurboQuantizer(dim, bits, qjl=qjl, seed=1)
    keys, values = (turbo.encode(torch.randn(2, 2, 45, dim, generator=g)) for _ in range(2))
    q = torch.randn(2, 2, rows, dim, generator=g)
    centre = torch.randn(2, 2, 2, dim, generator=g)
    probs, want_lse = shard_reference._softmax_part(turbo.inner_products(q, keys) * 0.125)
    want = turbo.weighted_sum(probs, values)
    for tiles in (None, sca.GPU_TILES):
        out, lse = sca.turbo_attention(turbo, q, keys, values, 0.125, tiles=tiles)
        torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    out, lse = sca.turbo_attention(turbo, q, keys, values, 0.125, centre)
    torch.testing.assert_close(out, want + centre[1].unsqueeze(-2), atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(lse, want_lse + (q * centre[0].unsqueeze(-2)).sum(-1) * 0.125, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("opts", [dict(stream_bits=4), dict(stream_bits=3, qjl=True)])
def test_the_layers_stream_partial_on_the_gpu_path(opts):
    model = model_with(q_heads=8, kv_heads=2)
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, exact_dtype="model", **SMALL, **opts)
    ids = torch.randint(0, 128, (1, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, past_key_values=cache)
        for t in range(5):
            model(torch.tensor([[t + 1]]), past_key_values=cache)
    layer = cache.layers[0]
    assert layer.stream.n == 5
    q = torch.randn(1, 8, 2, 64, generator=torch.Generator().manual_seed(1))
    want = layer.stream_partial(q, cache._ctx.scaling)
    with force_gpu_path():
        got = layer.stream_partial(q, cache._ctx.scaling)
    torch.testing.assert_close(got.out, want.out, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)


# ---- int8 salient tokens: `int8_attention` against the CPU path's `salient_partials` ------------------------
def salient_blocks(counts, batch=2, kv_heads=2, head_dim=64, seed=0):
    """`SalientTokens` of one block per count: 8-bit codes of random keys and values (count 0: an empty set)."""
    g = torch.Generator().manual_seed(seed)

    def code(m):
        x = (torch.randn(batch, kv_heads, max(m, 1), head_dim, generator=g) * 2).half()
        whole = quantize_groups(x, 8, head_dim)
        return GroupCode(whole.codes[:, :, :m], whole.scale[:, :, :m], whole.zero[:, :, :m], 8, head_dim)

    return [SalientTokens(torch.zeros(batch, kv_heads, m, dtype=torch.int32), code(m), code(m)) for m in counts]


def merged_salient(query, blocks, dtype, forced):
    with force_gpu_path(forced):
        return merge_partials(salient_partials(query, blocks, 0.125, dtype))


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("q_dtype,kv_dtype,atol", [(torch.float32, torch.float32, 1e-5),
                                                   (torch.float32, torch.float16, 1e-5),
                                                   (torch.bfloat16, torch.bfloat16, 1e-5),
                                                   (torch.float16, torch.float16, 1e-3)])
def test_int8_kernel_equals_the_cpu_salient_partials(head_dim, q_dtype, kv_dtype, atol):
    """One launch attends every block's 8-bit salient rows (GQA 4, 3 queries, several blocks, one longer than
    a key tile, one empty: it contributes nothing) as the CPU path does over the decoded rows in the exact dtype: to
    the CPU's own rounding (16-bit queries: its flash kernel computes in them), and tightly against that
    attention in float64 (fp16: the kernel multiplies fp16 tiles, as the exact kernel does)."""
    blocks = salient_blocks((3, 70, 0, 17), head_dim=head_dim)
    query = (torch.randn(2, 8, 3, head_dim, generator=torch.Generator().manual_seed(1)) * 2).to(q_dtype)
    with OpCounter() as counter, force_gpu_path():
        parts = salient_partials(query, blocks, 0.125, kv_dtype)
    assert counter.launches == 1 and counter.kernels == {"int8_attention": 1} and counter.syncs == 0, counter.launch_ops
    got = merge_partials(parts)
    blocks = [block for block in blocks if block.index.shape[-1]]  # the CPU's flash kernel fails on no keys
    cpu = merged_salient(query, blocks, kv_dtype, forced=False)
    loose = 1e-4 if q_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.out, cpu.out, atol=loose, rtol=loose)
    torch.testing.assert_close(got.lse, cpu.lse, atol=loose, rtol=loose)
    exact = merged_salient(query.double(), [SalientTokens(b.index, *b.key_values(kv_dtype)) for b in blocks],
                           torch.float64, forced=False)
    torch.testing.assert_close(got.out, exact.out.float(), atol=atol, rtol=atol)
    torch.testing.assert_close(got.lse, exact.lse.float(), atol=atol, rtol=atol)


def test_int8_kernel_takes_eight_blocks_a_launch_and_leaves_exact_rows_to_the_exact_kernel():
    blocks = salient_blocks((5,) * 9 + (4,), seed=2)
    held = SalientTokens(blocks[-1].index, *blocks[-1].key_values(torch.float32))  # salient_dtype="exact"
    query = torch.randn(2, 4, 1, 64, generator=torch.Generator().manual_seed(3))
    with OpCounter() as counter, force_gpu_path():
        parts = salient_partials(query, blocks[:-1] + [held], 0.125, torch.float32)
    assert counter.launches == 3 and counter.kernels == {"int8_attention": 2, "exact_attention": 1}, counter.launch_ops
    assert counter.syncs == 0
    got = merge_partials(parts)
    want = merged_salient(query, blocks, torch.float32, forced=False)
    torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.lse, want.lse, atol=1e-5, rtol=1e-5)


# ---- no host synchronisation in a decode step on the GPU path -----------------------------------------

class HostSync(AssertionError):
    pass


@contextlib.contextmanager
def no_host_sync(monkeypatch):
    """Fail on what reads a tensor's values back to the host (item, tolist, bool/int/float of a tensor,
    nonzero, boolean masks) while ``active[0]``; the exact attention (`cache.attention`, another part's),
    the Triton launch and the stores' read of the host index they are given are let through."""
    active = [False]

    def guard(name, original):
        def check(self, *args, **kwargs):
            if active[0]:
                raise HostSync(f"Tensor.{name} in a decode step")
            return original(self, *args, **kwargs)
        return check

    for name in ("item", "tolist", "__bool__", "__float__", "nonzero", "masked_select", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, guard(name, getattr(torch.Tensor, name)))
    original_int = torch.Tensor.__int__

    def check_int(self):
        if active[0] and os.sep + "store.py" not in _caller_file():
            raise HostSync("int(tensor) in a decode step")
        return original_int(self)
    monkeypatch.setattr(torch.Tensor, "__int__", check_int)
    original_getitem = torch.Tensor.__getitem__

    def check_getitem(self, index):
        if active[0] and isinstance(index, torch.Tensor) and index.dtype == torch.bool:
            raise HostSync("boolean-mask indexing in a decode step")
        return original_getitem(self, index)
    monkeypatch.setattr(torch.Tensor, "__getitem__", check_getitem)

    def paused(fn):
        def run(*args, **kwargs):
            before, active[0] = active[0], False
            try:
                return fn(*args, **kwargs)
            finally:
                active[0] = before
        return run

    monkeypatch.setattr(shard_layer, "exact_partial", paused(shard_layer.exact_partial))
    for kernel in ("_scores_kernel", "_bins_kernel", "_stream_attention_kernel"):
        launcher = getattr(sca, kernel)
        monkeypatch.setattr(sca, kernel, type("Launch", (), {"__getitem__": lambda self, grid, k=launcher:
                                                              paused(k[grid])})())
    yield active


def _caller_file() -> str:
    import inspect

    return inspect.stack()[2].filename


def test_a_decode_step_on_the_gpu_path_reads_nothing_back(monkeypatch):
    model = model_with(layers=2)
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, salient=0.05, evict=0.05, min_block=2,
                               keep_tokens=0, exact_dtype="model", **SMALL)
    ids = torch.randint(0, 128, (1, 120), generator=torch.Generator().manual_seed(0))
    originals = {name: getattr(shard_layer.ShardLayer, name) for name in ("past_partials", "commit")}
    with force_gpu_path(), torch.no_grad():
        model(ids, past_key_values=cache)
        model(torch.tensor([[3]]), past_key_values=cache)          # first step: plans built on first use
        with no_host_sync(monkeypatch) as active:
            def watched(name):
                def run(self, *args, **kwargs):
                    active[0] = True
                    try:
                        return originals[name](self, *args, **kwargs)
                    finally:
                        active[0] = False
                return run
            for name in originals:
                monkeypatch.setattr(shard_layer.ShardLayer, name, watched(name))
            for t in range(3):                                      # stream tokens, window overflow
                model(torch.tensor([[4 + t]]), past_key_values=cache)
    layer = cache.layers[0]
    assert layer.stream.n == 4 and any(block.kept is not None for block in layer.middle)
    # and the guard does catch a sync
    with no_host_sync(monkeypatch) as active, pytest.raises(HostSync):
        active[0] = True
        bool(torch.ones(1))


# ---- compiled for a GPU (no GPU needed) --------------------------------------------------------------------

_COMPILE = r"""
import math
import os
os.environ["TRITON_INTERPRET"] = "0"          # compile, not interpret (no GPU here: ahead of time)
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from kvshrink.kernels import shard_code_attention as sca

t, target = sca.GPU_TILES, GPUTarget("cuda", 90, 32)
ptrs = dict(codes_ptr="*u8", bit_ptr="*i32", bits_ptr="*i32", level_ptr="*i32", levels_ptr="*fp32",
            basis_ptr="*i8", row_a_ptr="*fp16", row_b_ptr="*fp16", col_scale_ptr="*fp16", mean_ptr="*fp16",
            held_ptr="*u8", cos_ptr="*fp32", sin_ptr="*fp32", q_ptr="*bf16", out_ptr="*fp32", scaling="fp32")
sig = {name: ptrs.get(name, "constexpr" if name.isupper() else "i32") for name in sca._scores_kernel.arg_names}
for paired, extra in ((False, True), (True, False)):    # the stored int8 basis with its factors; pre-scaled
    consts = dict(HEAD_DIM=128, HALF=64, PAIR_STEP=2 if paired else 1, COL_SCALE=extra, HELD=extra,
                  BLOCK_N=t.n, BLOCK_K=t.k, BLOCK_R=t.r)
    k = compile(ASTSource(sca._scores_kernel, dict(sig, basis_ptr="*fp32" if paired else "*i8"), consts),
                target=target)
    assert "cubin" in k.asm, list(k.asm)
sig = dict(scores_ptr="*fp32", lse_ptr="*fp32", vcodes_ptr="*u8", bins_ptr="*fp32", n="i32", v_bytes="i32",
           rows="i32", n_groups="i32", V_BITS="constexpr", ENTRIES="constexpr", ENTRIES_P="constexpr",
           GROUPS="constexpr", BLOCK_N="constexpr", BLOCK_R="constexpr")
for bits, groups in ((8, 1), (5, 8)):
    k = compile(ASTSource(sca._bins_kernel, sig, dict(V_BITS=bits, ENTRIES=1 << bits, ENTRIES_P=max(16, 1 << bits),
                                                       GROUPS=groups, BLOCK_N=t.n, BLOCK_R=t.r)), target=target)
    assert "cubin" in k.asm, list(k.asm)
codes = dict(codes_ptr="*u8", norm_ptr="*fp16", signs_ptr="*u8", qjl_ptr="*fp16")
sig = {f"{kv}_{name}": kind for kv in "kv" for name, kind in codes.items()}
sig.update(centroids_ptr="*fp32", q_ptr="*bf16", qs_ptr="*fp32", rot_ptr="*fp32", sketch_ptr="*fp32",
           k_centre_ptr="*fp32", v_centre_ptr="*fp32", out_ptr="*fp32", lse_ptr="*fp32", scaling="fp32",
           qjl_scale="fp32")
sig = {name: sig.get(name, "constexpr" if name.isupper() else "i32") for name in sca._stream_attention_kernel.arg_names}
for rotate in (True, False):
    k = compile(ASTSource(sca._stream_attention_kernel, sig, dict(BITS=3, QJL=True, ROTATE=rotate, DP=128,
                                                                  BLOCK_N=t.n, BLOCK_R=t.r)), target=target)
    assert "cubin" in k.asm, list(k.asm)
k = compile(ASTSource(sca._pair_rope_kernel, dict(freq_ptr="*fp32", offset_ptr="*i64", cos_ptr="*fp32",
                                                   sin_ptr="*fp32", start="i32", n="i32", half="i32", frame="i32",
                                                   HALF="constexpr", BLOCK_N="constexpr"),
                      dict(HALF=64, BLOCK_N=64)), target=target)
assert "cubin" in k.asm, list(k.asm)
from kvshrink.kernels import shard_ring
sig = {name: "constexpr" if name.isupper() else "i32" for name in shard_ring._put_kernel.arg_names}
sig.update(key_ptr="*fp32", value_ptr="*fp32", kv_ptr="*fp16", peak_ptr="*i32")
k = compile(ASTSource(shard_ring._put_kernel, sig, dict(CHECK=True, DP=128, BLOCK_M=16)), target=target)
assert "cubin" in k.asm, list(k.asm)
sig = {name: "constexpr" if name.isupper() else "i32" for name in sca._values_kernel.arg_names}
sig.update(bins_ptr="*fp32", codebook_ptr="*fp32", scale_ptr="*fp32", rot_ptr="*fp32", out_ptr="*fp32")
k = compile(ASTSource(sca._values_kernel, sig, dict(ENTRIES=256, GROUP=4, DP=128, BLOCK_J=128, BLOCK_R=t.r)),
            target=target)
assert "cubin" in k.asm, list(k.asm)
sig = {name: "constexpr" if name.isupper() else "i32" for name in sca._turbo_encode_kernel.arg_names}
sig.update(x_ptr="*bf16", centre_ptr="*fp32", rotation_ptr="*fp32", bounds_ptr="*fp32", codes_ptr="*u8",
           norm_ptr="*fp16")
for bits in (3, 4):
    group = 8 // math.gcd(8, bits)
    consts = dict(BITS=bits, N_BOUNDS=(1 << bits) - 1, GROUP=group, GROUP_BYTES=group * bits // 8, DP=128, BLOCK_M=16)
    k = compile(ASTSource(sca._turbo_encode_kernel, sig, consts), target=target)
    assert "cubin" in k.asm, list(k.asm)
print("compiled")
"""


def test_kernels_compile_for_an_h100_class_gpu():
    """The kernels through Triton's whole GPU pipeline (TTIR, TTGIR, LLVM, PTX, ptxas) for sm_90 with the
    GPU tiles, in a subprocess (Triton decorates kernels for the interpreter or the compiler at import):
    what the interpreter cannot check (layouts, dot shapes, register/shared-memory limits)."""
    import subprocess
    import sys

    nvidia = os.path.join(os.path.dirname(sys.modules["triton"].__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(nvidia):
        pytest.skip("Triton's NVIDIA backend (ptxas) is not installed")
    src = os.path.dirname(os.path.dirname(os.path.dirname(sca.__file__)))     # the kvshrink imported here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]


# ---- a real GPU ------------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("opts", [dict(key_bits=2.5, salient=0.05),
                                  dict(key_bits=3.0, pca_scope="layer", evict=0.1, keep_tokens=0, qjl=True,
                                       stream_bits=3)])
def test_triton_equals_reference_on_cuda_in_bf16(opts):
    """On a real GPU in bf16: every block's Triton partial == the reference path's, the stream's == the
    torch stream's, and neither synchronises with the host (CUDA's sync debug mode raises)."""
    opts = {"v_group": 4, "v_codebook": 256, **opts}     # the default codebook
    model = model_with(head_dim=128, q_heads=8, kv_heads=2, layers=2, dtype=torch.bfloat16)
    model = copy.deepcopy(model).cuda()
    cache = shard_cache(model, tokens=600, **opts)
    with torch.no_grad():
        for t in range(20):                              # the window overflows: a stream of TurboQuant codes
            model(torch.tensor([[t + 1]], device="cuda"), past_key_values=cache)
    g = torch.Generator(device="cuda").manual_seed(3)
    ctx = cache._ctx
    for layer in cache.layers:
        assert layer.stream.n > 0 and layer.middle
        q = (torch.randn(1, 8, 1, 128, generator=g, device="cuda") * 2).to(torch.bfloat16)
        assert layer.use_triton_kernel(q)
        for block in layer.middle:
            layer.middle_partials(block, q, ctx)         # first use: the block's plans to the device
        layer.stream_partial(q, ctx.scaling)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")          # the kernels' path: no host synchronisation
        try:
            got = [merge_partials(layer.middle_partials(block, q, ctx)) for block in layer.middle]
            stream = layer.stream_partial(q, ctx.scaling)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for block, part in zip(layer.middle, got):
            want = merge_partials(layer.reference_middle_partials(block, q, ctx))
            torch.testing.assert_close(part.out, want.out, atol=1e-4, rtol=1e-3)
            torch.testing.assert_close(part.lse, want.lse, atol=1e-4, rtol=1e-4)
        turbo, qg = layer.shared.turbo, group_queries(q.float(), layer.h_kv)
        probs, lse = shard_reference._softmax_part(turbo.inner_products(qg, layer.stream.keys) * ctx.scaling)
        out = turbo.weighted_sum(probs, layer.stream.values)
        torch.testing.assert_close(stream.out, out.reshape(stream.out.shape), atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(stream.lse, lse.reshape(stream.lse.shape), atol=1e-4, rtol=1e-4)
