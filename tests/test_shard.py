import math
import warnings

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import kvshrink
from kvshrink.cache.attention import exact_partial, merge_partials
from kvshrink.cache.rowwise import row_context
from kvshrink.cache.store import held_bytes
from kvshrink.methods.shard import ShardLayer


def tiny_llama(head_dim=16, layers=2, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=128, hidden_size=4 * head_dim, intermediate_size=96, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=2048, rope_theta=10000.0)
    return LlamaForCausalLM(cfg).eval()


def prefill(model, cache, ids, mask=None):
    with torch.no_grad():
        return model(ids, attention_mask=mask, past_key_values=cache)


def check_equivalence(cache, batch, seed=1, layers=None, ctx=None):
    """past_partials (blockwise from the packed store) == exact attention over the dequantized cache."""
    ctx = ctx or cache._ctx
    info = cache.info
    g = torch.Generator().manual_seed(seed)
    for layer in layers or cache.layers:
        q = torch.randn(batch, info.num_q_heads, 3, info.head_dim, generator=g) * 2
        got = merge_partials(layer.past_partials(q, ctx))
        keys, values, index = layer.dequantized(ctx)
        want = exact_partial(q, keys, values, ctx.scaling, key_index=index, pad_len=ctx.pad_len)
        torch.testing.assert_close(got.out, want.out, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got.lse, want.lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scope,weights,salient,held", [
    ("layer", "none", 0.0, "exact"), ("head", "none", 0.0, "exact"), ("layer", "query", 0.0, "exact"),
    ("head", "query", 0.0, "exact"), ("head", "none", 0.05, "exact"), ("layer", "none", 0.05, "exact"),
    ("head", "none", 0.05, "int8")])
def test_attention_from_packed_store_equals_dequantized_attention(scope, weights, salient, held):
    model = tiny_llama()
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_bits=2.0, block_tokens=100, pca_scope=scope,
                                key_weights=weights, salient=salient, evict=0.0, salient_dtype=held)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    prefill(model, cache, ids)
    layer = cache.layers[0]
    assert len(layer.sinks) == 4 and len(layer.window) == 16 and sum(b.n for b in layer.middle) == 280
    check_equivalence(cache, 1)
    # decode: tokens leaving the window go to the TurboQuant stream
    with torch.no_grad():
        for t in range(5):
            model(torch.tensor([[t + 1]]), past_key_values=cache)
    assert layer.stream.n == 5 and len(layer.window) == 16
    check_equivalence(cache, 1, seed=2)
    # the code-domain V path (few queries) and the dequantizing path (many) agree
    block = layer.middle[0]
    probs = torch.softmax(torch.randn(1, 2, 40, block.n), -1)
    torch.testing.assert_close(layer.middle_values(block, probs[:, :, :2], 0, block.n),
                               layer.middle_values(block, probs, 0, block.n)[:, :, :2], atol=1e-5, rtol=1e-5)


def test_batch_rows_are_compressed_apart_with_left_padding_and_non_power_of_two_heads():
    model = tiny_llama(head_dim=12)  # 12: rotation falls back to a random orthogonal matrix
    cache = kvshrink.make_cache("shard", model, sinks=2, window=8, v_group=4, v_codebook=16)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, 128, (2, 150), generator=g)
    mask = torch.ones(2, 150, dtype=torch.long)
    mask[1, :20] = 0
    out_b = prefill(model, cache, ids, mask)
    layer_bytes = lambda c: sum(layer.nbytes() for layer in c.layers)  # noqa: E731
    batch_bytes = layer_bytes(cache)    # before decoding: the fast path then adds its slot plans
    rows = cache.layers[0].rows  # each row has its own layers, fed its real tokens only
    assert [row.seen for row in rows] == [150, 130] and [len(row.sinks) for row in rows] == [2, 2]
    for i in range(2):
        check_equivalence(cache, 1, layers=[layer.rows[i] for layer in cache.layers], ctx=row_context(cache._ctx, i))
    # row 1 (padded) gives the logits of running it alone without padding: it is compressed alone
    alone = kvshrink.make_cache("shard", model, sinks=2, window=8, v_group=4, v_codebook=16)
    out_1 = prefill(model, alone, ids[1:, 20:])
    torch.testing.assert_close(out_b.logits[1, -1], out_1.logits[0, -1], atol=1e-5, rtol=1e-5)
    # and the batch holds the bytes of its rows held alone
    alone_0 = kvshrink.make_cache("shard", model, sinks=2, window=8, v_group=4, v_codebook=16)
    prefill(model, alone_0, ids[:1])
    assert batch_bytes == layer_bytes(alone) + layer_bytes(alone_0)


def test_high_precision_shard_matches_full():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(5))
    full = kvshrink.make_cache("full", model)
    shard = kvshrink.make_cache("shard", model, sinks=4, window=8, key_bits=8.0, stream_bits=8)
    out_f, out_s = prefill(model, full, ids), prefill(model, shard, ids)
    torch.testing.assert_close(out_s.logits, out_f.logits)  # prefill attention itself is exact
    with torch.no_grad():
        nxt = torch.tensor([[7]])
        lf = model(nxt, past_key_values=full).logits
        ls = model(nxt, past_key_values=shard).logits
    # 8-bit keys, 2-bit VQ values: close but not equal
    assert torch.nn.functional.cosine_similarity(lf.flatten(), ls.flatten(), dim=0) > 0.99
    assert not torch.equal(lf, ls)


def test_short_prompt_stays_exact_and_bytes_add_up():
    model = tiny_llama()
    cache = kvshrink.make_cache("shard", model, sinks=4, window=64)
    ids = torch.randint(0, 128, (1, 60), generator=torch.Generator().manual_seed(0))
    prefill(model, cache, ids)
    full = kvshrink.make_cache("full", model)
    out_f = prefill(model, full, ids)
    layer = cache.layers[0]
    assert not layer.middle and layer.stream.n == 0
    # fp16 exact store of fp32 model: exactly half the full cache's bytes
    assert sum(l.nbytes() for l in cache.layers) == sum(l.nbytes() for l in full.layers) // 2
    bd = cache.breakdown()
    assert sum(bd.values()) == cache.nbytes()
    # the cache's bookkeeping: the int64 token ids it holds and one int64 row offset
    assert cache.nbytes() == sum(l.nbytes() for l in cache.layers) + 8 * 60 + 8
    assert cache.compression_ratio() == pytest.approx(cache.fp16_nbytes() / cache.nbytes())


def test_bytes_count_every_tensor():
    model = tiny_llama()
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_bits=2.0, pca_scope="layer", salient=0.015,
                                evict=0.0, salient_dtype="exact", cold=0)
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(0))
    prefill(model, cache, ids)
    layer = cache.layers[1]
    block = layer.middle[0]
    h, d, n = 2, 16, 480
    expected = (4 + 16) * h * d * 2 * 2  # fp16 sinks + window, K and V
    code = block.keys[0]
    expected += code.codes.numel()  # packed coefficients
    expected += code.rank * (2 + 2) + h * d * 2 + h * d * code.rank  # steps, basis scales, mean, int8 basis
    expected += n * h * (d // 4) + 256 * 4 * 2 + h * d * 2 * 2  # VQ indices, codebook, channel scales and means
    m = 8  # salient rows per head: ceil(0.015 * 480)
    expected += h * m * (4 + 2 * d * 2)  # int32 row index, fp16 K and V
    assert layer.nbytes() == expected
    bd = layer.breakdown()
    assert bd["middle_v_codes"] == n * h * d // 4
    # key coefficient bytes follow the budget: 2 bits per key element
    assert bd["middle_k_codes"] <= n * h * d * 2 / 8


@pytest.mark.parametrize("opts, match", [
    ({"stream_bits": 5}, "stream_bits"),
    ({"window": -1}, "window"),
    ({"v_codebook": 100}, "power of two"),
    ({"key_bits": 0}, "key_bits"),
    ({"v_group": 5}, "v_group"),
    ({"sinks": -2}, "sinks"),
    ({"salient": 0.7}, "salient"),
    ({"observe": 0}, "observe"),
    ({"salient_pool": 4}, "salient_pool"),
])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        kvshrink.make_cache("shard", tiny_llama(), **opts)


def test_model_without_rope_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)).eval()
    with pytest.raises(NotImplementedError, match="RoPE|rotary|supports"):
        kvshrink.make_cache("shard", model)


@pytest.mark.parametrize("key_bits,rank,want", [(2.0, 0, 8), (1.0, 0, 4), (2.5, 0, 10), (2.0, 12, 12)])
def test_keys_keep_one_component_per_four_bits_of_budget_unless_rank_is_given(key_bits, rank, want):
    model = tiny_llama()  # head size 16, one PCA per head
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_bits=key_bits, rank=rank, pca_scope="head")
    prefill(model, cache, torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0)))
    for layer in cache.layers:
        assert layer.key_rank(16) == want
        for code in layer.middle[0].keys:
            assert code.basis_q.shape[-1] == code.rank <= want  # the DP may drop some of them
    check_equivalence(cache, 1)


def test_global_key_budget_follows_spectra():
    from kvshrink.methods.shard.calibration import allocate_layer_budgets

    dim = 32
    steep = torch.tensor([0.5 ** i for i in range(dim)])  # very low-rank layer
    flat = torch.linspace(1.0, 0.5, dim)  # flat spectrum
    budgets = allocate_layer_budgets([steep, flat, steep], key_bits=2.0, group=4)
    assert sum(budgets) / 3 <= 2.0 + 1e-9
    assert sum(budgets) / 3 > 1.5  # the pool is spent
    assert budgets[1] > budgets[0] == budgets[2]


def test_global_allocation_builds_per_layer_budgets_on_a_model():
    model = tiny_llama(layers=3)
    cache = kvshrink.make_cache("shard", model, sinks=4, window=16, key_alloc="global", key_bits=2.0,
                                calibration_tokens=64)
    budgets = cache.layers[0].shared.layer_key_bits
    assert len(budgets) == 3 and sum(budgets) / 3 <= 2.0 + 1e-9
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    prefill(model, cache, ids)
    check_equivalence(cache, 1)
    for layer, bits in zip(cache.layers, budgets):
        k_bits = layer.breakdown()["middle_k_codes"] * 8 / (180 * 2 * 16)
        assert k_bits <= bits + 0.5  # + byte rounding of each packed run


def test_query_weighted_keys_store_a_per_channel_scale_from_the_queries():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 200), generator=torch.Generator().manual_seed(5))
    plain = kvshrink.make_cache("shard", model, sinks=4, window=16, evict=0.0, pca_scope="head")
    weighted = kvshrink.make_cache("shard", model, sinks=4, window=16, key_weights="query", evict=0.0, pca_scope="head")
    prefill(model, plain, ids)
    prefill(model, weighted, ids)
    assert all(code.column_scale is None for layer in plain.layers for b in layer.middle for code in b.keys)
    for layer in weighted.layers:
        energy = layer._query_energy                              # [H_kv, d], pairs alike
        half = energy.shape[1] // 2
        torch.testing.assert_close(energy[:, :half], energy[:, half:])
        scales = torch.stack([code.column_scale.float() for code in layer.middle[0].keys])
        # a channel's scale is 1/sqrt of its relative query energy: more query energy, finer coding
        expected = (energy / energy.mean()).clamp_min(1e-2).rsqrt()
        torch.testing.assert_close(scales, expected, rtol=2e-3, atol=1e-3)
        assert scales.std() > 0.05
    # the column scales are counted (with the key scales): [H_kv, d] fp16 per block
    extra = sum(code.column_scale.numel() * 2 for layer in weighted.layers for b in layer.middle for code in b.keys)
    assert weighted.breakdown()["middle_k_scales"] == plain.breakdown()["middle_k_scales"] + extra


def test_salient_tokens_are_the_ones_the_last_queries_attend_to_and_are_held_exact():
    from kvshrink.methods.shard.salient import observed_attention, pick_salient, pooled

    g = torch.Generator().manual_seed(0)
    b, h, n, d = 2, 2, 200, 16
    key, value = torch.randn(b, h, n, d, generator=g), torch.randn(b, h, n, d, generator=g)
    observer = torch.randn(b, h, 6, d, generator=g) * 0.1
    # row 2*i+j of the batch/head grid plants its "needle" at a different place
    needles = torch.tensor([[40, 150], [90, 10]])
    for i in range(b):
        for j in range(h):
            key[i, j, needles[i, j]] = observer[i, j].mean(0) * 60
    importance = pooled(observed_attention(observer, key, 0.25), 3)
    chosen = pick_salient(importance, key, value, fraction=0.035, dtype=torch.float16)  # 7 rows
    assert chosen.index.shape == (b, h, 7) and chosen.index.dtype == torch.int32
    for i in range(b):
        for j in range(h):
            rows = chosen.index[i, j].long()
            assert int(needles[i, j]) in rows.tolist()
            # pooled: the needle's neighbours come with it
            assert {int(needles[i, j]) - 1, int(needles[i, j]) + 1} <= set(rows.tolist())
            torch.testing.assert_close(chosen.keys[i, j].float(), key[i, j, rows].half().float())
            torch.testing.assert_close(chosen.values[i, j].float(), value[i, j, rows].half().float())


def test_half_the_salient_rows_are_spans_around_the_strongest_read_and_half_the_most_read_tokens():
    """With the unpooled attention given, half the rows come from pooled spans (the needle and its neighbours) and
    half are the most read of the other tokens, wherever they are; pooled alone, every row sits in two spans."""
    from kvshrink.methods.shard.salient import observed_attention, pick_salient, pooled

    g = torch.Generator().manual_seed(0)
    key, value = torch.randn(1, 1, 200, 16, generator=g), torch.randn(1, 1, 200, 16, generator=g)
    observer = torch.randn(1, 1, 6, 16, generator=g) * 0.1
    key[0, 0, 40] = observer[0, 0].mean(0) * 80                                   # the needle
    for row in (100, 130, 170):                                                   # tokens read less, but read
        key[0, 0, row] = observer[0, 0].mean(0) * 50
    read = observed_attention(observer, key, 0.25)
    importance = pooled(read, 5)
    mixed = set(pick_salient(importance, key, value, 0.04, torch.float16, read=read).index[0, 0].tolist())  # 8 rows
    assert 40 in mixed and len(mixed & set(range(38, 43))) >= 4 and {100, 130, 170} <= mixed
    spans = set(pick_salient(importance, key, value, 0.04, torch.float16).index[0, 0].tolist())
    assert not {100, 130, 170} <= spans


def test_salient_option_keeps_exact_tokens_per_head_and_counts_their_bytes():
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(0))
    plain = kvshrink.make_cache("shard", model, sinks=4, window=16, salient=0, evict=0.0)
    kept = kvshrink.make_cache("shard", model, sinks=4, window=16, salient=0.02, evict=0.0, salient_dtype="exact")
    prefill(model, plain, ids), prefill(model, kept, ids)
    block = kept.layers[0].middle[0]
    m = 10  # ceil(0.02 * 480)
    assert block.salient.index.shape == (1, 2, m)
    # per layer and KV head: m int32 rows + fp16 K and V of size 16; 2 layers, 2 KV heads
    assert kept.breakdown()["middle_salient"] == 2 * 2 * m * (4 + 2 * 16 * 2)
    assert kept.nbytes() - plain.nbytes() == kept.breakdown()["middle_salient"]
    # the exact copies replace their codes in attention: a query aimed at a salient key sees it exactly
    layer, ctx = kept.layers[0], kept._ctx
    keys, values, _ = layer.dequantized(ctx)
    head, row = 1, int(block.salient.index[0, 1, 0])
    torch.testing.assert_close(keys[0, head, 4 + row], block.salient.keys[0, head, 0].float())


def test_int8_salient_tokens_take_68_bytes_per_vector_and_stay_within_half_a_step():
    """salient_dtype="int8": each salient K and V vector is 16 one-byte codes plus an fp16 step and zero
    point (36 bytes against 32 in fp16 at head size 16; 68 against 128 at 64), within half a step of the
    model's value, and the attention reads those decoded vectors in place of the block's codes."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 500), generator=torch.Generator().manual_seed(0))
    exact = kvshrink.make_cache("shard", model, sinks=4, window=16, salient=0.02, evict=0.0, salient_dtype="exact")
    coded = kvshrink.make_cache("shard", model, sinks=4, window=16, salient=0.02, evict=0.0, salient_dtype="int8")
    prefill(model, exact, ids), prefill(model, coded, ids)
    m = 10  # ceil(0.02 * 480) rows per KV head; 2 layers, 2 KV heads
    assert coded.breakdown()["middle_salient"] == 2 * 2 * m * (4 + 2 * (16 + 4))
    for a, b in zip(exact.layers, coded.layers):
        held, want = b.middle[0].salient, a.middle[0].salient
        assert torch.equal(held.index, want.index)  # the same tokens are chosen
        for code, ref in zip((held.keys, held.values), (want.keys, want.values)):
            step = code.scale.float()  # [B, H_kv, m, 1]: one step per vector
            decoded = held.key_values(torch.float32)[0 if code is held.keys else 1]
            assert ((decoded - ref.float()).abs() <= step / 2 + 1e-3 * ref.float().abs()).all()
    layer, ctx = coded.layers[0], coded._ctx
    keys, _, _ = layer.dequantized(ctx)
    block = layer.middle[0]
    row = int(block.salient.index[0, 1, 0])
    torch.testing.assert_close(keys[0, 1, 4 + row], block.salient.key_values(torch.float32)[0][0, 1, 0])


def _peak_live_bytes(fn) -> int:
    """Peak of the bytes allocated and not yet freed while ``fn`` runs (CPU allocator events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    live = peak = 0
    for event in sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("options, bound", [({"pca_scope": "head"}, 1.0), ({"pca_scope": "head", "evict": 0.02}, 1.0),
                                            ({}, 1.5), ({"evict": 0.02}, 1.5)])
def test_compression_needs_less_extra_memory_than_one_layers_prompt_kv(options, bound):
    # SmolLM2's attention shape (3 KV heads of 64), one layer, an 8K prompt: the RoPE tables of the
    # step are rebuilt inside the measured call (the last layer clears them), so they count too.
    # One PCA per head codes one head's keys at a time. One PCA per layer (the default) fits and codes the
    # layer's pre-RoPE keys side by side, in float32: half the layer's prompt K/V alone, before the RoPE
    # tables, the coefficients and the step search's candidates.
    from kvshrink.methods.shard import ShardLayer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=384, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=6, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192)
    model = LlamaForCausalLM(cfg).eval()
    cache = kvshrink.make_cache("shard", model, **options)
    measured = []
    original = ShardLayer.compress_block

    def measure(self, key, value, start, ctx):
        out = []
        measured.append((_peak_live_bytes(lambda: out.append(original(self, key, value, start, ctx))),
                         (key.numel() + value.numel()) * 4))
        return out[0]

    ShardLayer.compress_block = measure
    try:
        prefill(model, cache, torch.randint(0, 128, (1, 8000), generator=torch.Generator().manual_seed(0)))
    finally:
        ShardLayer.compress_block = original
    (peak, layer_kv), = measured
    assert cache.layers[0].middle and 0 < peak <= bound * layer_kv, (peak, layer_kv)


ROPE_SCALINGS = {
    "default": {},
    "linear": {"rope_scaling": {"rope_type": "linear", "factor": 2.0}},
    "llama3": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 128}},
    "yarn": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}},
}


@pytest.mark.parametrize("frame", [1, 16])
@pytest.mark.parametrize("rope", list(ROPE_SCALINGS))
def test_store_rebuilds_the_models_post_rope_keys_and_values(rope, frame):
    """At 8 bits the keys and values rebuilt from the store are the ones the model computed (RoPE undone
    and redone exactly: with YaRN, redoing it through the model's rotary module scaled keys by 1.3), whether
    RoPE is undone to position 0 or to each key's frame."""
    from conftest import tiny_model

    model = tiny_model("llama", **ROPE_SCALINGS[rope])
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    full = kvshrink.make_cache("full", model)
    shard = kvshrink.make_cache("shard", model, sinks=4, window=8, key_bits=8.0, salient=0.0, evict=0.0, v_group=1,
                                rope_frame=frame)
    prefill(model, full, ids)
    prefill(model, shard, ids)
    assert sum(b.n for b in shard.layers[0].middle) == 188
    for layer, reference in zip(shard.layers, full.layers):
        keys, values, index = layer.dequantized(shard._ctx)
        order = (index[0] if index.dim() == 2 else index).argsort()
        for got, want in [(keys[:, :, order], reference.store.keys), (values[:, :, order], reference.store.values)]:
            assert ((got.float() - want).norm() / want.norm()).item() < 0.02


def test_centred_values_are_coded_less_their_mean_and_rebuilt_with_it():
    """With ``v_centre``, values sharing a large common part (Qwen2's value bias) are coded less each head's mean,
    stored with the block: at 2 bits the rebuilt values then miss by under half their spread about the mean (a
    codebook centred on zero missed by ten times it in the second layer, whose common part is 36 times its
    spread)."""
    from conftest import tiny_model

    model = tiny_model("qwen2")
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.v_proj.weight.mul_(30.0)
            layer.self_attn.v_proj.bias.fill_(6.0)
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    full = kvshrink.make_cache("full", model)
    shard = kvshrink.make_cache("shard", model, sinks=4, window=8, salient=0.0, evict=0.0, v_centre=True)
    prefill(model, full, ids)
    prefill(model, shard, ids)
    for layer, reference in zip(shard.layers, full.layers):
        block = layer.middle[0]
        want = reference.store.values[:, :, 4:4 + block.n].float()
        mean = want.mean(2)[0]
        assert torch.allclose(block.v_mean.float(), mean, rtol=1e-3, atol=1e-2)
        _, values, index = layer.dequantized(shard._ctx)
        got = values[:, :, (index[0] if index.dim() == 2 else index).argsort()][:, :, 4:4 + block.n]
        spread = (want - mean[None, :, None]).norm()
        assert ((got - want).norm() / spread).item() < 0.5


def test_salient_tokens_of_an_evicting_block_hold_the_models_keys_and_values_of_their_tokens():
    """With eviction, block rows are not token offsets: each salient row must carry the K/V of the token
    the row stands for (the row's token in `dequantized`'s index)."""
    from conftest import tiny_model

    model = tiny_model("llama")
    ids = torch.randint(3, 128, (1, 200), generator=torch.Generator().manual_seed(0))
    full = kvshrink.make_cache("full", model)
    shard = kvshrink.make_cache("shard", model, keep_tokens=0, sinks=4, window=8, evict=0.2, salient=0.1,
                                salient_dtype="exact", min_block=8)
    prefill(model, full, ids)
    prefill(model, shard, ids)
    checked = 0
    for layer, reference in zip(shard.layers, full.layers):
        block, = layer.middle
        assert block.n < block.span  # tokens were evicted, so rows and token offsets differ
        tokens = block.token_index(block.salient.index.device)             # [n] token of each block row
        rows = block.salient.index.long()                                  # [B, H_kv, m]
        picked = tokens[rows].unsqueeze(-1).expand(-1, -1, -1, reference.store.keys.shape[-1])
        for held, want in [(block.salient.keys, reference.store.keys), (block.salient.values, reference.store.values)]:
            torch.testing.assert_close(held.float(), want.gather(2, picked).float(), atol=2e-3, rtol=2e-3)
        checked += rows.numel()
    assert checked > 0


@pytest.mark.parametrize("scaling,named", [
    ({"rope_type": "dynamic", "factor": 2.0}, "rope_type 'dynamic'"),
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 128}, "rope_type 'longrope'"),
])
def test_rope_types_shard_cannot_undo_exactly_are_refused(scaling, named):
    from conftest import tiny_model

    model = tiny_model("llama", rope_scaling=scaling)  # max_position_embeddings 512: longrope would switch at 128
    with pytest.raises(NotImplementedError, match=f"shard.*{named}"):
        kvshrink.make_cache("shard", model)
    kvshrink.make_cache("full", model)  # a method that keeps keys as they are takes any RoPE


def test_eviction_drops_only_tokens_holding_at_most_the_given_attention_share():
    from kvshrink.methods.shard.salient import tokens_to_keep

    g = torch.Generator().manual_seed(0)
    importance = torch.rand(1, 2, 100, generator=g) * 0.01
    importance[0, 0, 10:20] = 1.0      # head 0 reads tokens 10..19
    importance[0, 1, 50] = 2.0         # head 1 reads token 50
    keep = tokens_to_keep(importance, 0.05)
    share = importance / importance.sum(-1, keepdim=True)
    dropped = ~keep
    assert keep[10:20].all() and keep[50]
    assert dropped.sum() > 30                                           # most of the unread tokens go
    assert (share[..., dropped].sum(-1) <= 0.05 + 1e-6).all()           # within every head's budget
    # one more token (the next in the order) would break some head's budget
    assert tokens_to_keep(importance, 0.0).all()
    flat = torch.ones(1, 2, 100)                                        # attention spread evenly
    assert (~tokens_to_keep(flat, 0.05)).sum() == 5


def test_a_count_keeps_the_tokens_the_most_attended_by_their_most_reading_head():
    from kvshrink.methods.shard.salient import tokens_to_keep

    importance = torch.full((1, 2, 10), 0.01)
    importance[0, 0, [1, 4]] = torch.tensor([0.5, 0.3])                 # head 0 reads 1, then 4
    importance[0, 1, 7] = 0.9                                           # head 1 reads 7
    assert tokens_to_keep(importance, 1.0, count=3).nonzero().flatten().tolist() == [1, 4, 7]
    assert tokens_to_keep(importance, 1.0, count=2).nonzero().flatten().tolist() == [1, 7]   # the largest shares
    assert tokens_to_keep(importance, 1.0, count=12).all()
    for count in (0, 1):                                                # two stay at least
        assert tokens_to_keep(importance, 1.0, count=count).nonzero().flatten().tolist() == [1, 7]
    assert tokens_to_keep(importance, 1.0).sum() == 2                   # no target, no guard: all but two go


def test_the_guard_stops_a_count_before_the_evicted_tokens_hold_more_than_its_share():
    from kvshrink.methods.shard.salient import tokens_to_keep

    importance = torch.full((1, 2, 10), 0.01)
    importance[0, 0, [1, 4]] = torch.tensor([0.5, 0.3])
    importance[0, 1, 7] = 0.9
    # head 0's share of each unread token is 0.01 / 0.87: seven of them hold 8%, so 0.05 lets four go
    guarded = tokens_to_keep(importance, 0.05, count=3)
    assert (~guarded).sum() == 4 and guarded[[1, 4, 7]].all()
    share = importance / importance.sum(-1, keepdim=True)
    assert (share[..., ~guarded].sum(-1) <= 0.05).all()
    assert tokens_to_keep(importance, 0.0, count=3).all()              # evict=0 keeps every token
    assert (~tokens_to_keep(importance, 0.5, count=3)).sum() == 7       # a loose guard: the count decides


@pytest.mark.parametrize("target", [8.0, 10.0])
def test_a_ratio_target_is_what_the_cache_holds_after_the_first_decode_step(target):
    """``ratio`` evicts each layer's least-read middle tokens until the bytes meet it: after the prompt's first
    decode step (the evicted tokens dropped) the cache is ``target`` times smaller than an fp16 cache, less
    only the decode stream's first slots; a continued prompt keeps every token; ``evict`` guards the count.
    Without a cold block (``cold=0``): the estimate charges every kept token the hot block's bytes."""
    model = tiny_llama(head_dim=32)
    ids = torch.randint(0, 128, (1, 1200), generator=torch.Generator().manual_seed(0))
    every = kvshrink.make_cache("shard", model, evict=0, ratio=target, min_block=16, cold=0)  # evict=0: none go
    prefill(model, every, ids)
    cache = kvshrink.make_cache("shard", model, keep_tokens=0, ratio=target, evict=1, min_block=16, cold=0)   # no guard
    prefill(model, cache, ids)
    doc = cache.fork()
    with torch.no_grad():
        model(torch.tensor([[5]]), past_key_values=cache)
    assert target * 0.97 <= cache.compression_ratio() <= target * 1.01
    assert every.compression_ratio() < target * 0.7                     # the target took eviction
    window = every.options["window"]
    assert every.stats()["middle_tokens"] == len(every.layers) * (1200 - 4 - window)   # summed over the layers
    with torch.no_grad():
        model(torch.tensor([[5, 6, 7]]), past_key_values=doc)            # a question after the document
    assert doc.stats()["middle_tokens"] == every.stats()["middle_tokens"]
    guarded = kvshrink.make_cache("shard", model, keep_tokens=0, ratio=target, evict=0.02, min_block=16, cold=0)
    prefill(model, guarded, ids)
    with torch.no_grad():
        model(torch.tensor([[5]]), past_key_values=guarded)
    kept = [guarded.stats()["middle_tokens"], cache.stats()["middle_tokens"], every.stats()["middle_tokens"]]
    assert kept[1] < kept[0] < kept[2]                                   # a tight guard: fewer go


def test_a_ratio_out_of_reach_evicts_as_far_as_the_guard_allows_without_a_warning():
    """A short prompt cannot meet a 10x target (its exact sinks and window take more): the default is used on
    every prompt, so this is no error; the guard alone decides, as with no target."""
    model = tiny_llama(head_dim=32)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    caches = [kvshrink.make_cache("shard", model, keep_tokens=0, ratio=r, evict=0.2, min_block=8) for r in (50.0, 0.0)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for cache in caches:
            prefill(model, cache, ids)
            with torch.no_grad():
                model(torch.tensor([[5]]), past_key_values=cache)
    far, share_rule = (c.stats()["middle_tokens"] for c in caches)
    assert far == share_rule < len(caches[0].layers) * (300 - 4 - 64)


@pytest.mark.parametrize("ratio", [20.0, 0.0])
def test_a_layer_that_evicts_still_holds_keep_tokens(ratio):
    """``keep_tokens`` is the floor of eviction: a prompt no longer than it keeps every token, a longer one
    evicts at most the tokens beyond it, whether a far target (``ratio``) or no guard (``evict=1``) asks
    for more."""
    model = tiny_llama(head_dim=32)
    ids = torch.randint(0, 128, (1, 1200), generator=torch.Generator().manual_seed(0))
    def middle_after_a_question(**options) -> int:
        cache = kvshrink.make_cache("shard", model, ratio=ratio, evict=1, min_block=16, cold=0, **options)
        prefill(model, cache, ids)
        with torch.no_grad():
            model(torch.tensor([[5]]), past_key_values=cache)    # the prompt ended with its question
        return cache.stats()["middle_tokens"] // len(cache.layers)
    window = kvshrink.make_cache("shard", model).options["window"]
    every = 1200 - 4 - window                                      # the middle when nothing goes
    assert middle_after_a_question(keep_tokens=0) < 400            # no floor: most of the middle goes
    assert middle_after_a_question(keep_tokens=800) == 800 - 4 - window
    assert middle_after_a_question(keep_tokens=1200) == every      # the prompt is no longer than the floor
    assert middle_after_a_question(keep_tokens=5000) == every


def test_a_ratio_of_one_or_less_is_refused():
    model = tiny_llama()
    for bad in (0.5, 1.0, -2.0):
        with pytest.raises(ValueError, match="ratio"):
            kvshrink.make_cache("shard", model, ratio=bad)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_evicted_blocks_attend_exactly_over_the_tokens_they_keep(scope):
    model = tiny_llama()
    kept = kvshrink.make_cache("shard", model, keep_tokens=0, sinks=4, window=16, block_tokens=100, pca_scope=scope,
                               evict=0.1, min_block=8, cold=0)
    every = kvshrink.make_cache("shard", model, sinks=4, window=16, block_tokens=100, pca_scope=scope, evict=0.0,
                                cold=0)
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    prefill(model, kept, ids)
    prefill(model, every, ids)
    block, = kept.layers[0].middle
    evicted, = kept.layers[0].evicted
    assert block.span == 280 and 0 < block.n < 280 and block.token_index("cpu").shape == (block.n,)
    # until the prompt's first decode step the evicted tokens are held too, uncoded
    assert evicted.span == 280 and evicted.rows.numel() == 280 - block.n and not kept.layers[0].unread
    tokens = torch.cat([block.token_index("cpu"), evicted.rows + evicted.start])
    assert torch.equal(tokens.sort().values, torch.arange(4, 284))
    check_equivalence(kept, 1)
    with torch.no_grad():
        for t in range(3):
            model(torch.tensor([[t + 1]]), past_key_values=kept)
            model(torch.tensor([[t + 1]]), past_key_values=every)
    # the first decode step dropped them: the store holds only the kept rows (and their 1-bit map, counted)
    assert all(not layer.unread and len(layer.middle) == 1 for layer in kept.layers)
    assert kept.breakdown()["middle_kept"] == sum(math.ceil(280 / 8) for _ in kept.layers)
    assert kept.nbytes() < every.nbytes()
    # attention from the packed store == exact attention over the rebuilt kept tokens at their positions
    check_equivalence(kept, 1, seed=2)


def test_evicted_tokens_stay_when_the_prompt_is_continued_forked_or_saved(tmp_path):
    """A document prefilled alone did not end with its question: a fork or a saved copy asked a question
    later (a step of several tokens) keeps every token; the cache decoding right after its prompt drops the
    evicted ones, and the fork's continuation never touches the parent."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    doc = kvshrink.make_cache("shard", model, keep_tokens=0, sinks=4, window=16, evict=0.1, min_block=8, cold=0)
    prefill(model, doc, ids)
    # held uncoded after the prompt (counted), coded as a block of their own by the save
    assert all(len(layer.middle) == 1 and len(layer.evicted) == 1 and not layer.unread for layer in doc.layers)
    uncoded, before = doc.breakdown()["evicted"], doc.nbytes()
    assert uncoded == sum(held_bytes(layer.evicted[0].tensors()) for layer in doc.layers) > 0
    doc.save(tmp_path / "doc.kvs")
    held = [(len(layer.middle), len(layer.unread)) for layer in doc.layers]
    assert all(m == 1 and u == 1 and not layer.evicted for (m, u), layer in zip(held, doc.layers))
    assert doc.breakdown()["evicted"] == 0 and doc.nbytes() < before
    loaded = kvshrink.load_cache(tmp_path / "doc.kvs", model)
    for cache in (doc.fork(), loaded):
        question = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            model(question, past_key_values=cache)
            model(torch.tensor([[7]]), past_key_values=cache)
        assert all(not layer.unread and len(layer.middle) == 2 for layer in cache.layers)
        assert cache.stats()["middle_tokens"] == 280 * len(cache.layers)
    assert [(len(layer.middle), len(layer.unread)) for layer in doc.layers] == held  # the parent is untouched
    before = doc.nbytes()
    with torch.no_grad():
        model(torch.tensor([[7]]), past_key_values=doc)
    assert all(not layer.unread and len(layer.middle) == 1 for layer in doc.layers) and doc.nbytes() < before
    assert doc.stats()["middle_tokens"] < 280 * len(doc.layers)
    # fewer evicted tokens than min_block are not worth a block of their own: every token stays
    few = kvshrink.make_cache("shard", model, keep_tokens=0, sinks=4, window=16, evict=0.1, min_block=200, cold=0)
    prefill(model, few, ids)
    assert all(not layer.unread and not layer.evicted and layer.middle[0].kept is None for layer in few.layers)
    # a prompt continued straight away (no fork, no save) codes them and keeps them; so does a fork
    for way in ("continued", "forked"):
        cache = kvshrink.make_cache("shard", model, keep_tokens=0, sinks=4, window=16, evict=0.1, min_block=8, cold=0)
        prefill(model, cache, ids)
        if way == "forked":
            cache.fork()
            assert all(len(layer.unread) == 1 and not layer.evicted for layer in cache.layers)
        with torch.no_grad():
            model(torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1)), past_key_values=cache)
        assert all(len(layer.middle) == 2 and not layer.unread and not layer.evicted for layer in cache.layers)
        assert cache.stats()["middle_tokens"] == 280 * len(cache.layers)


@pytest.mark.parametrize("scope", ["head", "layer"])
def test_evicted_tokens_coded_later_get_the_codes_of_the_prompt_s_chunk(scope):
    """Held uncoded until the next call, the evicted tokens are then coded from the stored 16-bit rows at their
    positions: the block the prompt's own chunk gives, code for code (a continued prompt's answers unchanged)."""
    model = tiny_llama()
    cache = kvshrink.make_cache("shard", model, keep_tokens=0, sinks=4, window=16, pca_scope=scope, evict=0.1,
                                min_block=8)
    chunks = []
    original = ShardLayer.compress_block

    def keep_chunk(self, key, value, start, ctx):
        chunks.append((self, key.clone(), value.clone(), start, ctx))
        return original(self, key, value, start, ctx)

    ShardLayer.compress_block = keep_chunk
    try:
        prefill(model, cache, torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0)))
    finally:
        ShardLayer.compress_block = original
    for layer, key, value, start, ctx in chunks:
        evicted, = layer.evicted
        keep = torch.ones(key.shape[2], dtype=torch.bool)
        keep[evicted.rows] = False
        direct = layer.encode_block(key, value, start, ctx, ~keep, None)
        later = layer.encode_evicted(evicted)
        assert (later.start, later.n, later.span) == (direct.start, direct.n, direct.span)
        for kind, tensors in direct.parts().items():
            assert all(torch.equal(a, b) for a, b in zip(tensors, later.parts()[kind], strict=True)), kind


def test_eviction_keeps_the_needle_the_last_queries_read_and_its_neighbours():
    from kvshrink.methods.shard.salient import observed_attention, pooled, tokens_to_keep

    g = torch.Generator().manual_seed(0)
    key = torch.randn(1, 2, 300, 16, generator=g)
    observer = torch.randn(1, 2, 6, 16, generator=g) * 0.1
    key[0, 0, 120] = observer[0, 0].mean(0) * 60                        # head 0's needle
    key[0, 1, 200] = observer[0, 1].mean(0) * 60                        # head 1's needle
    keep = tokens_to_keep(pooled(observed_attention(observer, key, 0.25), 5), 0.3)
    assert (~keep).sum() > 60                                           # much of the haystack goes
    assert keep[118:123].all() and keep[198:203].all()                  # each needle and its pooled neighbours stay


def test_cold_tokens_are_the_least_read_ones_coded_cheaper_and_survive_a_save(tmp_path, monkeypatch):
    """``cold``: each block's least-read tokens, holding at most ``cold`` of every head's observed attention,
    go to a block of their own coded at ``cold_key_bits`` keys and ``cold_v_group``-channel value groups; the
    salient rows stay as many, in the hot block; attention over the two blocks is attention over what they hold."""
    from kvshrink.methods.shard import encoding

    seen = []
    original = encoding.pooled
    monkeypatch.setattr(encoding, "pooled", lambda *a: seen.append(original(*a)) or seen[-1])
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    opts = dict(sinks=4, window=16, key_bits=3.0, salient=0.05, evict=0.0, min_block=8)
    whole = kvshrink.make_cache("shard", model, cold=0, **opts)
    prefill(model, whole, ids)
    assert all(len(layer.middle) == 1 for layer in whole.layers)
    seen.clear()
    cache = kvshrink.make_cache("shard", model, cold=0.3, cold_key_bits=1.0, cold_v_group=8, **opts)
    prefill(model, cache, ids)
    for layer, importance in zip(cache.layers, seen, strict=True):
        hot, cold = layer.middle
        hot_rows, cold_rows = hot.rows(), cold.rows()
        assert hot.span == cold.span == 280 and hot.n + cold.n == 280 and cold.n >= 8
        assert not set(hot_rows.tolist()) & set(cold_rows.tolist())
        share = importance / importance.sum(-1, keepdim=True)
        assert float(share[..., cold_rows].sum(-1).max()) <= 0.3                     # the guard, every head
        assert int(share.amax(dim=(0, 1)).argmax()) in hot_rows.tolist()             # the most read token is hot
        assert cold.salient is None and hot.salient.index.shape[-1] == math.ceil(0.05 * 280)
        assert cold.v_codebook.shape == (256, 8) and hot.v_codebook.shape == (256, 4)
        per_token = [held_bytes(b.parts()["k_codes"]) / b.n for b in (hot, cold)]
        assert per_token[1] < per_token[0] / 2
    check_equivalence(cache, 1)
    codes = [sum(c.breakdown()[f"middle_{k}"] for k in ("k_codes", "v_codes")) for c in (whole, cache)]
    assert codes[1] < codes[0]   # (on 280 tokens the second block's bases and codebook outweigh the saving)
    # saved and loaded, the two blocks decode the same tokens
    cache.save(tmp_path / "cold.kvs")
    loaded = kvshrink.load_cache(tmp_path / "cold.kvs", model)
    with torch.no_grad():
        want = model(torch.tensor([[7]]), past_key_values=cache).logits
        got = model(torch.tensor([[7]]), past_key_values=loaded).logits
    torch.testing.assert_close(got, want)


def test_the_cold_block_is_judged_by_the_last_observe_queries(monkeypatch):
    """``observe``: the prompt's last ``observe`` queries (every query head of a KV head) decide which tokens go
    cold; other observers pick other tokens. ``observe_tail``: the last of them judge on their own too, and a
    token counts as read as much as the more of the two observations reads it."""
    from kvshrink.methods.shard import salient

    reads = []
    original = salient.observed_attention
    monkeypatch.setattr(salient, "observed_attention",
                        lambda obs, *a: reads.append((obs.shape[2], original(obs, *a))) or reads[-1][1])
    model = tiny_llama()
    group = model.config.num_attention_heads // model.config.num_key_value_heads
    ids = torch.randint(0, 128, (1, 300), generator=torch.Generator().manual_seed(0))
    opts = dict(sinks=4, window=16, key_bits=3.0, salient=0.05, evict=0.0, min_block=8, cold=0.3)
    cold_rows = {}
    for observe, tail in ((8, 0), (256, 0), (256, 8)):
        reads.clear()
        cache = kvshrink.make_cache("shard", model, observe=observe, observe_tail=tail, **opts)
        prefill(model, cache, ids)
        rows = [observe * group] + ([tail * group] if tail else [])
        assert [n for n, _ in reads] == rows * len(cache.layers)
        cold_rows[observe, tail] = [set(layer.middle[1].rows().tolist()) for layer in cache.layers]
    assert cold_rows[8, 0] != cold_rows[256, 0]
    assert cold_rows[256, 8] != cold_rows[256, 0]


def test_a_token_the_tail_reads_counts_as_read_though_the_wide_observation_dilutes_it():
    from kvshrink.methods.shard.salient import most_read, observed_attention

    g = torch.Generator().manual_seed(0)
    key = torch.randn(1, 1, 100, 16, generator=g)
    wide = torch.randn(1, 1, 256, 16, generator=g) * 0.1
    wide[0, 0, -8:] = key[0, 0, 40] * 3                                    # the last 8 queries read token 40
    tail = wide[:, :, -8:]
    both, alone = most_read([wide, tail], key, 0.25), observed_attention(wide, key, 0.25)
    torch.testing.assert_close(both, torch.maximum(alone, observed_attention(tail, key, 0.25)))
    assert float(both[0, 0, 40]) > 5 * float(alone[0, 0, 40]) and int(both[0, 0].argmax()) == 40


def test_observe_tail_must_be_fewer_than_observe():
    with pytest.raises(ValueError, match="observe_tail must be fewer than observe"):
        kvshrink.make_cache("shard", tiny_llama(), observe=64, observe_tail=64)


def test_cold_v_group_must_divide_the_head_size():
    with pytest.raises(ValueError, match="cold_v_group must divide the head size 16"):
        kvshrink.make_cache("shard", tiny_llama(), cold=0.1, cold_v_group=3)
    kvshrink.make_cache("shard", tiny_llama(), cold=0.0, cold_v_group=3)   # unused when cold is off


def test_the_cold_value_groups_default_to_the_largest_divisor_of_the_head_size_up_to_8():
    from kvshrink.methods.shard.config import ShardConfig

    assert [ShardConfig().cold_group(d) for d in (128, 64, 12, 7)] == [8, 8, 6, 7]
    assert ShardConfig(cold_v_group=4).cold_group(128) == 4
