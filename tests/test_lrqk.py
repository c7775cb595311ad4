"""LRQK method: exactness when top-k covers everything, tier accounting, disk tier, bad input."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import kvshrink
from kvshrink.methods.lrqk_prefill import chunked_prefill
from kvshrink.methods.lrqk_report import step_report
from kvshrink.methods.lrqk_tiers import DiskSlowTier, SlotTier, SlowTier, SlowTierChanged


@pytest.fixture(scope="module")
def tiny_llama():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def tiny_qwen():
    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=97, hidden_size=96, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512)
    return Qwen2ForCausalLM(cfg).eval()


def _batch(seed: int = 0, length: int = 40, pad: int = 5):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, length), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def _generate(model, method, ids, mask, new=10, **opts):
    cache = kvshrink.make_cache(method, model, **opts)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new,
                             do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out, cache


@pytest.mark.parametrize("model_name", ["tiny_llama", "tiny_qwen"])
@pytest.mark.parametrize("factor_heads", ["kv", "query"])
def test_topk_covering_every_token_equals_full(request, model_name, factor_heads):
    model = request.getfixturevalue(model_name)
    ids, mask = _batch()
    ref, _ = _generate(model, "full", ids, mask)
    out, cache = _generate(model, "lrqk", ids, mask, top_k=64, window=4, factor_heads=factor_heads,
                           slot_dtype="model")  # rows as the model holds them: exactly full
    assert torch.equal(ref.sequences, out.sequences)
    for a, b in zip(ref.logits, out.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    s = cache.stats()
    assert s["selected_rows"] > 0 and s["slow_tier_bytes"] > 0
    cache.close()


def test_small_topk_runs_and_accounts_bytes(tiny_llama):
    ids, mask = _batch(seed=3, length=60)
    out, cache = _generate(tiny_llama, "lrqk", ids, mask, new=8, top_k=8, window=4)
    s = cache.stats()
    row_bytes = 2 * 16 * 4                         # K and V rows, head size 16, fp32
    assert s["bytes_moved"] == s["missed_rows"] * row_bytes
    assert 0 < s["miss_rate"] <= 1
    steps = step_report(cache)
    assert len(steps) == 7 and steps[0]["miss_rate"] == 1.0      # first decode step: cold slots
    assert sum(st["rows_moved"] for st in steps) == s["missed_rows"]
    bd = cache.breakdown()
    assert sum(bd.values()) == cache.nbytes()
    assert bd["grams"] == 0                                        # dropped once decoding started
    assert s["slow_tier_bytes"] >= 2 * 2 * 2 * 67 * 16 * 4         # every token of both layers
    cache.close()


def test_key_factors_are_stored_per_kv_head(tiny_qwen):
    ids, mask = _batch(length=300, pad=0)
    mask[:] = 1
    _, kv_cache = _generate(tiny_qwen, "lrqk", ids, mask, new=2, top_k=16, factor_dtype="float32")
    _, q_cache = _generate(tiny_qwen, "lrqk", ids, mask, new=2, top_k=16, factor_heads="query",
                           factor_dtype="float32")
    layer = kv_cache.layers[0].rows[0]  # a batch: each row has its own layers
    assert layer.a_k.shape[:2] == (1, 2) and layer.a_k.shape[-1] == 4     # [1, H_kv, T, r=d/4]
    assert q_cache.layers[0].rows[0].a_k.shape[:2] == (1, 6)
    assert kv_cache.breakdown()["key_factors"] * 3 == q_cache.breakdown()["key_factors"]


def test_chunked_prefill_matches_full_and_keeps_decoding(tiny_llama):
    ids, mask = _batch(seed=5, length=50)
    positions = (mask.cumsum(-1) - 1).clamp_min(0)
    ref = kvshrink.make_cache("full", tiny_llama)
    with torch.no_grad():
        ref_logits = tiny_llama(input_ids=ids, attention_mask=mask, position_ids=positions,
                                past_key_values=ref).logits[:, -1]
    cache = kvshrink.make_cache("lrqk", tiny_llama, top_k=8, window=4, prefill_chunk=16)
    logits = chunked_prefill(tiny_llama, ids, cache, 16, attention_mask=mask)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert cache.get_seq_length() == 50
    one = kvshrink.make_cache("lrqk", tiny_llama, top_k=8, window=4)
    with torch.no_grad():
        tiny_llama(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=one)
    # The factorization depends on the prompt only through its Grams: chunking gives the same factors.
    for row in range(2):
        torch.testing.assert_close(cache.layers[1].rows[row].b_k, one.layers[1].rows[row].b_k, rtol=1e-3, atol=1e-4)
    full_ids = torch.cat([ids, ids[:, :1]], 1)
    full_mask = torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    with torch.no_grad():
        out = tiny_llama.generate(full_ids, attention_mask=full_mask, past_key_values=cache,
                                  max_new_tokens=4, do_sample=False)
    assert out.shape[1] == 55
    cache.close()


def _slow_tier(kind, tmp_path, rows=3, d=4):
    return DiskSlowTier(rows, d, torch.float32, tmp_path) if kind == "disk" else SlowTier(rows, d, torch.float32)


def _fill(slow, tokens, rows=3, d=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(1, rows, tokens, d, generator=g)
    v = torch.randn(1, rows, tokens, d, generator=g)
    slow.append(k, v)
    return k, v


def test_hit_miss_accounting_on_constructed_sets(tmp_path):
    slow = _slow_tier("cpu", tmp_path, rows=2)
    _fill(slow, 20, rows=2)
    tier = SlotTier(2, 3, 4, torch.float32, torch.device("cpu"), "set")
    steps = [
        ([[0, 1, 2], [5, 6, 7]], 6),      # cold: everything missing
        ([[0, 1, 3], [5, 6, 7]], 1),      # one change in row 0
        ([[4, 3, 0], [8, 9, 10]], 4),     # row 0: 4 new; row 1: all new
        ([[4, 3, 0], [8, 9, 10]], 0),
        ([[1, 2, 4], [10, 5, 11]], 4),
    ]
    for sets, expected_misses in steps:
        report = tier.select(torch.tensor(sets), slow)
        assert report.missed == expected_misses
        assert report.selected == 6
        assert report.bytes_moved == expected_misses * 2 * 4 * 4
        for r, want in enumerate(sets):
            assert set(tier.token[r].tolist()) == set(want)
            for t in want:  # the resident rows are the true K/V rows
                slot = tier.token[r].tolist().index(t)
                torch.testing.assert_close(tier.keys[r, slot], slow.data[t, r, 0])


def test_lru_and_attention_policies_keep_extra_rows(tmp_path):
    slow = _slow_tier("cpu", tmp_path, rows=1)
    _fill(slow, 20, rows=1)
    seq = [[0, 1], [2, 3], [0, 1], [4, 0], [2, 3]]
    misses = {}
    for policy in ("set", "lru", "attention"):
        tier = SlotTier(1, 2 if policy == "set" else 4, 4, torch.float32, torch.device("cpu"), policy)
        total = 0
        for sel in seq:
            mass = torch.tensor([[0.9, 0.1]])
            total += tier.select(torch.tensor([sel]), slow, mass=mass).missed
        misses[policy] = total
    assert misses["set"] == 2 + 2 + 2 + 1 + 2
    # lru, 4 slots: 2 + 2 + 0 + 1 (4 evicts token 2, least recent) + 1 (2 comes back, evicting 1)
    assert misses["lru"] == 6
    # attention: 4 evicts 3 (lowest mass), then 3 comes back evicting 1
    assert misses["attention"] == 6


@pytest.mark.parametrize("kind", ["cpu", "disk"])
def test_slow_tier_round_trips_rows_bit_exactly(kind, tmp_path):
    slow = _slow_tier(kind, tmp_path)
    k1, v1 = _fill(slow, 300, seed=1)
    k2, v2 = _fill(slow, 5, seed=2)                  # forces a growth of the file / buffer
    keys = torch.cat([k1, k2], 2)[0]
    values = torch.cat([v1, v2], 2)[0]
    rows = torch.tensor([0, 2, 1, 2])
    toks = torch.tensor([0, 299, 302, 150])
    got = slow.gather(rows, toks)
    assert torch.equal(got[:, 0], keys[rows, toks]) and torch.equal(got[:, 1], values[rows, toks])
    k, v = slow.read_range(10, 305)
    assert torch.equal(k, keys[:, 10:305]) and torch.equal(v, values[:, 10:305])
    slow.close()


def test_disk_tier_cleans_up_and_detects_changes(tmp_path):
    slow = _slow_tier("disk", tmp_path)
    _fill(slow, 10)
    folder, path = slow.folder, slow.path
    assert os.path.isfile(path)
    with open(path, "r+b") as fh:                     # someone else writes into the file
        fh.seek(4 * 4 * 2 * 3 * 5)
        fh.write(b"\x00\x01\x02\x03")
    with pytest.raises(SlowTierChanged):
        slow.gather(torch.tensor([0, 1, 2]), torch.tensor([5, 5, 5]))
    slow.close()
    assert not os.path.exists(folder)
    other = _slow_tier("disk", tmp_path)
    _fill(other, 4)
    os.replace(other.path + "", other.path + ".moved")
    with open(other.path, "wb") as fh:
        fh.write(b"\x00" * 16)
    with pytest.raises(SlowTierChanged):
        other.read_range(0, 4)
    folder = other.folder
    del other                                         # garbage collection removes the folder too
    import gc
    gc.collect()
    assert not os.path.exists(folder)


def test_disk_tier_gives_the_same_answers_as_cpu(tiny_llama, tmp_path):
    ids, mask = _batch(seed=7, length=80)
    cpu, c1 = _generate(tiny_llama, "lrqk", ids, mask, new=8, top_k=8, window=4)
    disk, c2 = _generate(tiny_llama, "lrqk", ids, mask, new=8, top_k=8, window=4, slow_tier="disk",
                         disk_folder=str(tmp_path))
    assert torch.equal(cpu.sequences, disk.sequences)
    assert c1.stats()["missed_rows"] == c2.stats()["missed_rows"]
    assert any(p.name.startswith("kvshrink-lrqk-") for p in tmp_path.iterdir())
    c2.close()
    assert not any(p.name.startswith("kvshrink-lrqk-") for p in tmp_path.iterdir())


def test_policies_and_prefetch_do_not_change_answers(tiny_llama):
    ids, mask = _batch(seed=9, length=70)
    base, c0 = _generate(tiny_llama, "lrqk", ids, mask, new=8, top_k=8, window=4)
    for opts in ({"policy": "lru"}, {"policy": "attention"}, {"prefetch": True}):
        out, cache = _generate(tiny_llama, "lrqk", ids, mask, new=8, top_k=8, window=4, **opts)
        assert torch.equal(base.sequences, out.sequences), opts
        assert cache.stats()["missed_rows"] <= c0.stats()["missed_rows"], opts
        cache.close()


@pytest.mark.parametrize("opts, match", [
    ({"rank": 17}, "rank"),
    ({"rank": 0}, "rank"),
    ({"top_k": 0}, "top_k"),
    ({"slow_tier": "disk"}, "disk_folder"),
    ({"slow_tier": "tape"}, "slow_tier"),
    ({"policy": "fifo"}, "policy"),
])
def test_bad_options_are_refused(tiny_llama, opts, match):
    with pytest.raises(ValueError, match=match):
        kvshrink.make_cache("lrqk", tiny_llama, **opts)


def test_unwritable_disk_folder_is_refused(tiny_llama, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ValueError, match="writable"):
        kvshrink.make_cache("lrqk", tiny_llama, slow_tier="disk", disk_folder=str(blocker / "sub"))


def test_exact_selection_reaches_the_oracle_mass(tiny_llama):
    ids, mask = _batch(seed=11, length=80)
    _, exact = _generate(tiny_llama, "lrqk", ids, mask, new=4, top_k=8, window=4, selection="exact",
                         measure_recall=True)
    _, proxy = _generate(tiny_llama, "lrqk", ids, mask, new=4, top_k=8, window=4, measure_recall=True)
    e, p = exact.stats(), proxy.stats()
    assert e["topk_mass_recall_rate"] == pytest.approx(e["topk_mass_oracle_rate"], abs=1e-5)
    assert p["topk_mass_recall_rate"] <= p["topk_mass_oracle_rate"] + 1e-5


def test_proxy_top_k_recovers_planted_needle_keys():
    """Keys planted along the direction the decode queries look at carry most of the attention: the
    low-rank proxy's top-k must find them (a random top-k of 4 among ~60 tokens would cover ~7%)."""
    from kvshrink.cache.base import LayerSpec, ModelInfo, StepContext
    from kvshrink.methods.lrqk import LRQKLayer, LRQKOptions

    g = torch.Generator().manual_seed(0)
    b, hq, hkv, d, t, steps = 1, 4, 2, 16, 64, 6
    needles = {0: [7, 23, 41], 1: [12, 30, 50]}
    layer = LRQKLayer(LayerSpec(0, ModelInfo("llama", 1, hq, hkv, d, 4096, torch.float32)),
                      LRQKOptions(rank=4, top_k=4, window=4, measure_recall=True))
    u = torch.zeros(d)
    u[3] = 1.0
    k = torch.randn(b, hkv, t + steps, d, generator=g) * 0.5
    for h, rows in needles.items():
        k[0, h, rows] += 4.0 * u
    q = torch.randn(b, hq, t + steps, d, generator=g) * 0.5 + 3.0 * u  # every query looks along u
    v = torch.randn(b, hkv, t + steps, d, generator=g)

    def run(past, n):
        ctx = StepContext(past, n, d ** -0.5, None, torch.zeros(b, dtype=torch.long), None, torch.float32)
        layer.update(k[:, :, past:past + n], v[:, :, past:past + n])
        layer.attend(q[:, :, past:past + n], ctx)

    run(0, t)
    for i in range(t, t + steps):
        run(i, 1)
    stats = layer.stats()
    assert stats["topk_mass_oracle_rate"] > 0.5  # the needles do dominate the attention
    assert stats["topk_mass_recall_rate"] > 0.9 * stats["topk_mass_oracle_rate"], stats
