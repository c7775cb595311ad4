"""LRQK's fast decode path (kernel="fast") against the reference path (kernel="reference"), which is
today's plain torch implementation: the same tokens and logits within float32 rounding, the same data
movement, on tiny random GQA models with a left-padded batch."""

from __future__ import annotations

import pytest
import torch
from conftest import greedy, left_pad, prompts, tiny_model

import kvshrink
from kvshrink.cache.rowwise import one_row_layers
from kvshrink.kernels.cpu import lrqk_factor, lrqk_proxy, numba_support
from kvshrink.codecs.lowrank import decode_factor_vectors, line_search_basis_step
from kvshrink.methods.lrqk.tiers import SlotTier, SlowTier

OPTION_SETS = [
    {},
    {"factor_heads": "query"},
    {"window": 0},
    {"policy": "lru", "prefetch": True},
    {"policy": "attention"},
    {"fit_resident": False},
    {"update_bases": False},
    {"slot_dtype": "model", "factor_dtype": "float32"},
]


@pytest.fixture(scope="module")
def models():
    return {"llama": tiny_model("llama"), "qwen2": tiny_model("qwen2", seed=1, num_attention_heads=6, hidden_size=96)}


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("options", OPTION_SETS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "defaults")
def test_fast_decode_equals_reference(models, family, options):
    model = models[family]
    ids, mask = left_pad(prompts([90, 70, 81]))
    opts = {"top_k": 8, "window": 4, **options}
    caches = {k: kvshrink.make_cache("lrqk", model, kernel=k, **opts) for k in ("reference", "fast")}
    ref_seq, ref_logits = greedy(model, ids, mask, caches["reference"], new_tokens=10)
    seq, logits = greedy(model, ids, mask, caches["fast"], new_tokens=10)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    ref_stats, stats = caches["reference"].stats(), caches["fast"].stats()
    for key in ("selected_rows", "missed_rows", "bytes_moved", "fast_tier_bytes"):
        assert stats[key] == ref_stats[key], key
    # the same state after decoding (a batch: each row has its own layers)
    for a, b in zip(one_row_layers(caches["reference"].layers), one_row_layers(caches["fast"].layers)):
        # the bases' line-search steps amplify float rounding (the reference's own sums, in another
        # order, drift as much): compared as a whole, not element by element
        for ref, got in ((a.b_q, b.b_q), (a.b_k, b.b_k)):
            assert float((ref - got).norm() / ref.norm()) < 1e-3
        torch.testing.assert_close(a.a_k[:, :, : a.a_len].float(), b.a_k[:, :, : b.a_len].float(), rtol=1e-3, atol=1e-3)
        assert torch.equal(a.slots.token.sort(1).values, b.slots.token.sort(1).values)


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
@pytest.mark.parametrize("compiled", ["compiled", "small-tiles", "per-phase"])
@pytest.mark.parametrize("lengths", [[90, 70, 81], [40]], ids=["padded-batch", "one-row"])
def test_default_layout_decodes_in_one_compiled_call_per_layer(models, monkeypatch, compiled, lengths):
    """The default layout on a float32 model decodes each layer in one `cpu_step` call (every decode step
    once the prompt has candidates), or with it switched off through the per-phase kernels: the reference's
    tokens, logits, data movement and state either way. ``small-tiles``: the call widens its float16 rows 40 words
    at a time (slots, window and values in tiles of 2 rows of 16, factors in tiles of fewer rows than there are),
    so every tiled loop runs several tiles and a partial last one."""
    from kvshrink.methods.lrqk import cpu_step
    from kvshrink.methods.lrqk import LRQKLayer

    if compiled == "small-tiles":
        monkeypatch.setattr(cpu_step, "TILE_WORDS", 40)
    compiled = compiled != "per-phase"

    calls = []
    step = cpu_step.decode_step
    model = models["llama"]
    d = model.config.hidden_size // model.config.num_attention_heads
    # (the warm-ups' calls, on a head size of 2, are not decode steps)
    monkeypatch.setattr(cpu_step, "decode_step", lambda *a, **k: calls.append(a[0].shape[2] == d) or step(*a, **k))
    if not compiled:
        monkeypatch.setattr(LRQKLayer, "_compiled_decode", lambda self, *a: None)
    ids, mask = left_pad(prompts(lengths))
    caches = {k: kvshrink.make_cache("lrqk", model, kernel=k, top_k=8, window=4) for k in ("reference", "fast")}
    ref_seq, ref_logits = greedy(model, ids, mask, caches["reference"], new_tokens=10)
    seq, logits = greedy(model, ids, mask, caches["fast"], new_tokens=10)
    # greedy's 10 tokens: a prefill and 9 decode steps, each layer of each batch row in one call
    assert sum(calls) == (9 * model.config.num_hidden_layers * len(lengths) if compiled else 0)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for key in ("selected_rows", "missed_rows", "bytes_moved", "fast_tier_bytes"):
        assert caches["fast"].stats()[key] == caches["reference"].stats()[key], key
    for a, b in zip(one_row_layers(caches["reference"].layers), one_row_layers(caches["fast"].layers)):
        for ref, got in ((a.b_q, b.b_q), (a.b_k, b.b_k)):
            assert float((ref - got).norm() / ref.norm()) < 1e-3
        torch.testing.assert_close(a.a_k[:, :, : a.a_len].float(), b.a_k[:, :, : b.a_len].float(), rtol=1e-3, atol=1e-3)
        assert torch.equal(a.slots.token, b.slots.token)
        assert torch.equal(a.slots.chosen, b.slots.chosen)
        assert torch.equal(a.slots.keys, b.slots.keys) and torch.equal(a.slots.values, b.slots.values)
        assert torch.equal(a.win_k, b.win_k)


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
def test_fused_factor_step_equals_torch():
    g = torch.Generator().manual_seed(0)
    n, heads, d, r, s = 3, 3, 16, 4, 20
    q, k = torch.randn(n, heads, d, generator=g), torch.randn(n, d, generator=g)
    b_q, b_k = torch.randn(n, r, d, generator=g), torch.randn(n, r, d, generator=g)
    a, keys = torch.randn(n, s, r, generator=g), torch.randn(n, s, d, generator=g)
    weight = (torch.rand(n, s, generator=g) > 0.3).float()
    q_hat, k_hat = decode_factor_vectors(q, k, b_q, b_k, resident_factors=a, resident_keys=keys,
                                         resident_weight=weight)
    new_b_q = line_search_basis_step(b_q, q_hat, q)
    new_b_k = line_search_basis_step(b_k, k_hat.unsqueeze(1), k.unsqueeze(1))
    aw = a * weight.unsqueeze(-1)
    given = b_q.clone(), b_k.clone()
    fq, fk, fused_bq, fused_bk = lrqk_factor.decode_step(q, k, b_q, b_k, aw.transpose(-1, -2) @ aw,
                                                           (q @ keys.transpose(-1, -2)) @ aw, 1.0, True)
    assert torch.equal(b_q, given[0]) and torch.equal(b_k, given[1])      # the inputs are not changed
    torch.testing.assert_close(fq, q_hat, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(fk, k_hat, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(fused_bq, new_b_q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fused_bk, new_b_k, rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
@pytest.mark.parametrize("copies", [1, 2])
@pytest.mark.parametrize("window", [0, 5])
def test_resident_sums_made_in_the_kernel_equal_the_gathered_ones(copies, window):
    """``resident_decode_step`` reads the resident rows in place (chosen slots, empty slots skipped, the
    window's factor rows at the end of the factors): the same step as ``decode_step`` given the sums
    of the gathered rows."""
    g = torch.Generator().manual_seed(1)
    kv_rows, heads, d, r, slots, tokens = 2, 3, 16, 4, 6, 30
    n = kv_rows * copies
    q, k = torch.randn(n, heads, d, generator=g), torch.randn(n, d, generator=g)
    b_q, b_k = torch.randn(n, r, d, generator=g), torch.randn(n, r, d, generator=g)
    factors = torch.randn(n, tokens, r, generator=g).half()
    token = torch.randint(0, tokens - window, (kv_rows, slots), generator=g)
    token[0, 2] = -1                                               # an empty slot
    chosen = torch.rand(kv_rows, slots, generator=g) > 0.3
    slot_keys = torch.randn(kv_rows, slots, d, generator=g).half()
    win_keys = torch.randn(kv_rows, window, d, generator=g).half()
    lhs, rhs = [], []
    for i in range(n):
        h = i // copies
        take = chosen[h] & (token[h] >= 0)
        a = torch.cat([factors[i, token[h][take]], factors[i, tokens - window:]]).float()
        keys = torch.cat([slot_keys[h][take], win_keys[h]]).float()
        lhs.append(a.T @ a)
        rhs.append((q[i] @ keys.T) @ a)
    want = lrqk_factor.decode_step(q, k, b_q, b_k, torch.stack(lhs), torch.stack(rhs), 1.0, True)
    given = factors.clone(), slot_keys.clone()
    runs = []
    for _ in numba_support.each_kernel_variant():   # the serial kernel, then the heads shared among threads
        runs.append(lrqk_factor.resident_decode_step(q, k, b_q.clone(), b_k.clone(), factors, token, chosen,
                                                       slot_keys, win_keys, tokens - window, copies, 1.0, True))
    assert torch.equal(factors, given[0]) and torch.equal(slot_keys, given[1])
    for a, b in zip(runs[0], want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
def test_eviction_order_is_a_stable_sort():
    """The fill's eviction order (one pass when the finite priorities are equal, as under ``set``) is
    ``argsort(kind="mergesort")`` for equal, mixed and infinite priorities."""
    import numpy as np

    from kvshrink.methods.lrqk.tiers import _eviction_order

    rng = np.random.default_rng(0)
    cases = [np.zeros(7), np.array([np.inf, 0, -np.inf, 0, np.inf, -np.inf, 0]), np.full(5, np.inf),
             np.array([2.0, -np.inf, 2.0, np.inf]), np.array([1.0, 0.0, -np.inf, 1.0, np.inf, 0.5]),
             np.array([0.0, np.nan, -np.inf])]
    cases += [rng.choice([-np.inf, 0.0, 3.0, np.inf], size=40) for _ in range(20)]
    cases += [np.where(rng.random(40) < 0.5, 0.0, rng.choice([-np.inf, np.inf], size=40)) for _ in range(20)]
    for priority in cases:
        assert np.array_equal(_eviction_order(priority), np.argsort(priority, kind="mergesort")), priority


def _random_selections(g, rows, k, steps=12):
    for _ in range(steps):
        pool = torch.randint(0, 12, (rows, 3 * k), generator=g)      # a small pool: many hits
        yield torch.stack([row.unique()[torch.randperm(row.unique().numel(), generator=g)[:k]] for row in pool])


def _filled_slow_tier(g, rows, d, tokens=40):
    slow = SlowTier(rows, d, torch.float32)
    keys, values = torch.randn(1, rows, tokens, d, generator=g), torch.randn(1, rows, tokens, d, generator=g)
    slow.append(keys, values)
    return slow, keys, values


@pytest.mark.parametrize("fast", [False, True])
def test_slot_fill_matches_a_set_model(fast):
    """Random selections: after each step the slots hold exactly the selection (rows from the slow
    tier), and the misses are the selected tokens that were not resident."""
    g = torch.Generator().manual_seed(3)
    rows, d, k = 3, 4, 6
    slow, keys, values = _filled_slow_tier(g, rows, d)
    tier = SlotTier(rows, k, d, torch.float32, torch.device("cpu"), "set")
    held = [set() for _ in range(rows)]
    for sel in _random_selections(g, rows, k):
        report = tier.select(sel, slow, fast=fast)
        want = [set(r.tolist()) for r in sel]
        assert report.missed == sum(len(w - h) for w, h in zip(want, held))
        for r in range(rows):
            assert set(tier.token[r][tier.chosen[r]].tolist()) == want[r]
            for slot, t in enumerate(tier.token[r].tolist()):
                if t >= 0:
                    assert torch.equal(tier.keys[r, slot], keys[0, r, t])
                    assert torch.equal(tier.values[r, slot], values[0, r, t])
        held = want


@pytest.mark.parametrize("planted", [65510.0, -7e4, float("-inf"), float("nan"), [float("nan"), 1e6], 65504.0])
def test_planned_fill_checks_the_float16_range_as_torch(planted):
    """Narrowing the filled rows to float16 slots: the compiled gather's range check refuses what the
    torch fill refuses (beyond 65504, inf) and lets through what it lets through (a NaN, even beside an
    overflowing value: ``amax`` of rows holding a NaN is NaN), with the same rows in the slots."""
    rows, d, k = 2, 4, 3
    outcomes = []
    for fast in (False, True):
        slow, _, _ = _filled_slow_tier(torch.Generator().manual_seed(7), rows, d, tokens=10)
        values = planted if isinstance(planted, list) else [planted]
        for i, v in enumerate(values):
            slow.data[4, 1, i, 0] = v                                 # token 4, row 1: K (then V)
        tier = SlotTier(rows, k, d, torch.float16, torch.device("cpu"), "set")
        try:
            tier.select(torch.tensor([[0, 1, 2], [3, 4, 5]]), slow, fast=fast)
            outcomes.append(("ok", tier.keys.clone(), tier.values.clone()))
        except ValueError as err:
            outcomes.append((str(err), None, None))
    assert outcomes[0][0] == outcomes[1][0]
    if outcomes[0][0] == "ok":
        torch.testing.assert_close(outcomes[0][1], outcomes[1][1], equal_nan=True, rtol=0, atol=0)
        torch.testing.assert_close(outcomes[0][2], outcomes[1][2], equal_nan=True, rtol=0, atol=0)


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
def test_compiled_float16_conversion_rounds_as_torch():
    """The fill's float32 -> float16 conversion (``_copy_rows``, on the words) gives torch's bits for every
    float16 value, the float32 values just beside each one and the midpoints between neighbours (ties to
    even), subnormals, zeros, the overflow boundary (65504, 65519.99, 65520), infinities, and random
    values over the whole exponent range; a NaN stays a NaN."""
    import numpy as np

    from kvshrink.methods.lrqk import tiers as lrqk_tiers

    halves = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16)
    halves = halves[~torch.isnan(halves)].float()
    f32 = halves.view(torch.int32)
    beside = torch.cat([f32 - 1, f32 + 1]).view(torch.float32)
    finite = halves[torch.isfinite(halves)].sort().values
    midpoints = ((finite[1:].double() + finite[:-1].double()) / 2).float()
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (200_000,), generator=g, dtype=torch.int64)
    random = words.to(torch.int32).view(torch.float32)
    special = torch.tensor([0.0, -0.0, 65504.0, 65519.99, 65520.0, -65520.0, 2.0**-25, 2.0**-25 * 1.0001,
                            2.0**-24 * 1.5, 2.0**-14, 2.0**-14 * (1 - 2**-12), float("inf"), float("-inf")])
    x = torch.cat([halves, beside, midpoints, random, special])
    x = x[~torch.isnan(x)]
    n = x.numel()
    bits = x.view(torch.int32).numpy().view(np.uint32).reshape(n, 1, 1, 1).repeat(2, axis=2)
    keys, values = np.zeros((n, 1), np.uint16), np.zeros((n, 1), np.uint16)
    order = np.arange(n, dtype=np.int64)
    lrqk_tiers._copy_rows(bits, np.zeros(n, np.int64), order, order, keys, values, True)
    want = x.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(keys[:, 0], want) and np.array_equal(values[:, 0], want)
    nan = np.array([0x7FC00000, 0xFF800001, 0x7F800001], np.uint32).reshape(3, 1, 1, 1).repeat(2, axis=2)
    out = np.zeros((3, 1), np.uint16)
    lrqk_tiers._copy_rows(nan, np.zeros(3, np.int64), np.arange(3), np.arange(3), out, out.copy(), True)
    assert torch.isnan(torch.from_numpy(out.view(np.int16)).view(torch.float16)).all()


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
@pytest.mark.parametrize("policy", ["set", "lru", "attention"])
def test_planned_slot_fill_places_rows_as_torch(policy):
    """The compiled fill planner puts every row in the same slot as the torch bookkeeping, for every
    eviction policy (extra slots, so victims are chosen by the policy's order)."""
    g = torch.Generator().manual_seed(5)
    rows, d, k = 2, 4, 5
    slow, _, _ = _filled_slow_tier(g, rows, d)
    tiers = [SlotTier(rows, k + 3, d, torch.float32, torch.device("cpu"), policy) for _ in range(2)]
    for sel in _random_selections(g, rows, k, steps=15):
        mass = torch.rand(sel.shape, generator=g)
        reports = [tier.select(sel, slow, mass=mass, fast=fast) for tier, fast in zip(tiers, (False, True))]
        assert reports[0] == reports[1]
        for name in ("token", "score", "chosen", "keys", "values"):
            assert torch.equal(getattr(tiers[0], name), getattr(tiers[1], name)), name


def test_fast_path_without_numba_equals_reference(models, monkeypatch):
    """Without kvshrink[fast] the fast path runs its kernels' work in torch: still the same answers."""
    monkeypatch.setattr(numba_support, "available", lambda: False)
    model = models["llama"]
    ids, mask = left_pad(prompts([60, 47]))
    caches = {k: kvshrink.make_cache("lrqk", model, kernel=k, top_k=8, window=4) for k in ("reference", "fast")}
    ref_seq, ref_logits = greedy(model, ids, mask, caches["reference"], new_tokens=8)
    seq, logits = greedy(model, ids, mask, caches["fast"], new_tokens=8)
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    assert caches["fast"].stats()["missed_rows"] == caches["reference"].stats()["missed_rows"]


def test_unpadded_row_attends_without_a_mask_once_the_slots_hold_only_the_selection(models, monkeypatch):
    """One unpadded row whose candidates grow past top_k while decoding: the first steps need the mask
    (fewer candidates than slots), the later ones skip it (every slot holds the selection); the answers
    stay the reference's throughout."""
    from kvshrink.methods.lrqk import LRQKLayer

    masked = []
    build = LRQKLayer._visible_keys
    monkeypatch.setattr(LRQKLayer, "_visible_keys", lambda self, *a: masked.append(1) or build(self, *a))
    monkeypatch.setattr(LRQKLayer, "_compiled_decode", lambda self, *a: None)   # the per-phase path's mask
    model = models["qwen2"]
    ids, mask = left_pad(prompts([10]))
    caches = {k: kvshrink.make_cache("lrqk", model, kernel=k, top_k=8, window=4) for k in ("reference", "fast")}
    ref_seq, ref_logits = greedy(model, ids, mask, caches["reference"], new_tokens=8)
    masked.clear()
    seq, logits = greedy(model, ids, mask, caches["fast"], new_tokens=8)
    layers = model.config.num_hidden_layers
    assert 0 < len(masked) < 7 * layers      # 7 decode steps: some with the mask, some without
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for key in ("selected_rows", "missed_rows", "bytes_moved", "fast_tier_bytes"):
        assert caches["fast"].stats()[key] == caches["reference"].stats()[key], key


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
@pytest.mark.parametrize("padded", [False, True])
def test_proxy_selection_in_one_pass_equals_softmax_sum_and_topk(padded):
    """`lrqk_proxy.proxy_top_k` (the CPU fast path's selection) against the torch ops it replaces: scaled
    logits, padding hidden, softmax per query row, mass summed per KV row, `top_k_in_token_order`. The same
    tokens in the same (token) order, ties included (the latest taken: never padding before a real token), and
    masses within float32 rounding, with both kernel variants; a KV row whose candidates are all padding gets no
    mass."""
    from kvshrink.methods.lrqk.layer import top_k_in_token_order

    g = torch.Generator().manual_seed(3)
    kv_rows, per_row, n, k, scaling = 4, 6, 300, 37, 0.125
    logits = torch.randn(kv_rows * per_row, n, generator=g) * 20
    first = torch.tensor([0, 5, 299, 300]) if padded else None
    hidden = logits.clone()
    if padded:
        hidden[(torch.arange(n)[None, :] < first.repeat_interleave(per_row)[:, None])] = float("-inf")
    mass = torch.softmax(hidden * scaling, dim=-1).nan_to_num(0.0).view(kv_rows, per_row, n).sum(1)
    want_mass, want = top_k_in_token_order(mass, k, "lru")
    runs = []
    for _ in numba_support.each_kernel_variant():
        runs.append(lrqk_proxy.proxy_top_k(logits.clone(), scaling, first, kv_rows, k))
    for selected, top_mass, all_mass in runs:
        torch.testing.assert_close(all_mass, mass, rtol=1e-5, atol=1e-7)
        assert torch.equal(selected, want)
        if padded:   # one visible candidate: it and the latest of the tied (zero-mass) others
            assert selected[2].tolist() == list(range(n - k, n))
        assert bool((selected.diff(dim=1) > 0).all())
        torch.testing.assert_close(top_mass, all_mass.gather(1, selected), rtol=0, atol=0)
    if padded:   # no candidate visible: no mass, and the last k tokens (ties, the latest)
        assert float(runs[0][2][3].abs().sum()) == 0 and torch.equal(runs[0][0][3], torch.arange(n - k, n))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
def test_proxy_selection_ranks_ties_by_token_and_nan_first():
    """Ties with the k-th value are taken latest first, by both paths; a NaN logit gives its candidate no mass (the
    softmax's exp is 0 for it; torch's softmax would make the whole row NaN); k equal to the candidates takes them
    all."""
    from kvshrink.methods.lrqk.layer import top_k_in_token_order

    logits = torch.zeros(1, 6)     # equal logits: every candidate has the same mass
    selected, _, _ = lrqk_proxy.proxy_top_k(logits.clone(), 1.0, None, 1, 3)
    assert selected.tolist() == [[3, 4, 5]]
    assert top_k_in_token_order(torch.ones(1, 6), 3, "lru")[1].tolist() == [[3, 4, 5]]
    mass = torch.tensor([[0.5, 0.0, 0.2, 0.0, 0.0, 0.2, 0.1]])   # the k-th value (0.0) tied three times
    for policy in ("lru", "set"):
        assert top_k_in_token_order(mass, 5, policy)[1].tolist() == [[0, 2, 4, 5, 6]]
    selected, _, _ = lrqk_proxy.proxy_top_k(torch.tensor([[0.0, -200, 0.0, -200, -200, -1.0, -2.0]]), 1.0, None, 1, 5)
    assert selected.tolist() == [[0, 2, 4, 5, 6]]     # exp(-200) is 0 in float32: tied at zero
    logits = torch.tensor([[0.0, 1.0, float("nan"), 2.0, 0.5]])
    selected, _, mass = lrqk_proxy.proxy_top_k(logits.clone(), 1.0, None, 1, 2)
    assert float(mass[0, 2]) == 0 and selected.tolist() == [[1, 3]]
    selected, _, _ = lrqk_proxy.proxy_top_k(torch.randn(2, 4), 1.0, None, 1, 4)
    assert selected.tolist() == [[0, 1, 2, 3]]


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
@pytest.mark.parametrize("planted", [None, 65504.0, 65510.0, -7e4, float("inf"), float("nan"), "factor"])
def test_a_decode_token_enters_the_float16_window_as_torch_stores_it(planted):
    """`shift_in_narrowed` (the CPU fast path's commit) against the torch path's: the window one token down with
    the new one last, rounded as `.to(float16)`, the key factors likewise into their column; a value beyond
    float16's range (or a factor) refused as `to_storage` refuses it, with nothing written; a NaN let through as
    it lets it through."""
    from kvshrink.cache.store import to_storage
    from kvshrink.methods.lrqk.tiers import half_words, shift_in_narrowed

    g = torch.Generator().manual_seed(5)
    b, h, w, d, f, cap, r = 1, 3, 5, 8, 3, 6, 4
    win_k, win_v = (torch.randn(b, h, w, d, generator=g).half() for _ in range(2))
    a_k = torch.randn(b, f, cap, r, generator=g).half()
    key, value = torch.randn(b, h, 1, d, generator=g) * 300, torch.randn(b, h, 1, d, generator=g)
    factors = torch.randn(b * f, r, generator=g, dtype=torch.float64) * 70
    if planted == "factor":
        factors[2, 1] = 7e4
    elif planted is not None:
        key[0, 1, 0, 3] = planted
    try:
        want = [torch.cat([x[:, :, 1:], to_storage(new, torch.float16)], 2) for x, new in ((win_k, key), (win_v, value))]
        want.append(a_k.clone())
        want[2][:, :, 4] = to_storage(factors, torch.float16).view(b, f, r)
    except ValueError as err:
        want = err
    given = win_k.clone(), win_v.clone(), a_k.clone()
    words = half_words(win_k), half_words(win_v), half_words(a_k)
    args = key.view(h, d).numpy(), value.view(h, d).numpy(), factors.numpy(), words, 4
    if isinstance(want, ValueError):
        with pytest.raises(ValueError, match="beyond float16"):
            shift_in_narrowed(*args)
        assert torch.equal(win_k, given[0]) and torch.equal(win_v, given[1]) and torch.equal(a_k, given[2])
    else:
        shift_in_narrowed(*args)
        for got, ref in zip((win_k, win_v, a_k), want):
            torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("kernel,factor_dtype", [("reference", "float32"), ("fast", "float32"),
                                                 ("reference", "float16"), ("fast", "float16")])
def test_a_decode_key_beyond_float16_is_refused_by_the_window(kernel, factor_dtype):
    """A float32 model whose decode keys leave float16's range (a layer's key projection scaled up after the
    prompt) with the float16 window of slot_dtype='auto' (float32 factors: the window alone narrows this step's
    token; float16 ones: the default layout, decoded in one compiled call): a clear error on every path, not an
    inf in the window, and nothing of the token stored."""
    import copy

    model = copy.deepcopy(tiny_model("llama"))
    ids, mask = left_pad(prompts([40]))
    cache = kvshrink.make_cache("lrqk", model, kernel=kernel, top_k=8, window=4, factor_dtype=factor_dtype)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        layer = list(one_row_layers(cache.layers))[1]
        before = layer.slow.length, layer.a_len, layer.win_k.clone(), layer.a_k.clone()
        model.model.layers[1].self_attn.k_proj.weight.mul_(1e7)
        with pytest.raises(ValueError, match="beyond float16"):
            model(input_ids=out.logits[:, -1:].argmax(-1), attention_mask=torch.cat([mask, mask[:, :1]], 1),
                  past_key_values=cache, use_cache=True)
    assert (layer.slow.length, layer.a_len) == before[:2]
    assert torch.equal(layer.win_k, before[2]) and torch.equal(layer.a_k, before[3])


@pytest.mark.skipif(not numba_support.available(), reason="numba not installed (kvshrink[fast])")
@pytest.mark.parametrize("beyond", ["token", "fill"])
def test_compiled_step_reports_an_overflow_a_nan_would_hide(beyond):
    """`cpu_step.decode_step` with one KV row filled from NaN rows (let through, as `to_storage` lets them) and a
    value beyond float16's range in the other row's filled rows or in the new token: the overflow is reported (its
    NaN word, larger, does not hide it) and nothing of the token is stored."""
    import numpy as np

    from kvshrink.methods.lrqk import cpu_step

    rows, d, cap, window = 2, 2, 2, 1
    slow = np.ones((4, rows, 2, d), np.float32)            # 3 tokens and room for the new one
    slow[:3, 0, 0] = np.nan                                 # row 0: NaN keys in every token it can fill
    key, value = np.ones((rows, d), np.float32), np.ones((rows, d), np.float32)
    if beyond == "token":
        key[1, 0] = 7e4
    else:
        slow[:2, 1, 1, 0] = 7e4                             # row 1: a value beyond float16 in its candidates
    slow_words = slow.view(np.uint32)
    one = np.float16(1.0).view(np.uint16)
    factors = np.full((rows, 4, 1), one, np.uint16)
    windows = (np.full((rows, window, d), one, np.uint16), np.full((rows, window, d), one, np.uint16))
    before = factors.copy(), windows[0].copy(), slow_words[3].copy()
    bases = np.eye(1, d, dtype=np.float32)[None].repeat(rows, 0)
    *_, missed, word = cpu_step.decode_step(
        np.ones((rows, 1, d), np.float32), key, value, bases.copy(), bases.copy(), factors, 3,
        np.full((rows, cap), -1, np.int64), np.zeros((rows, cap), np.float32), np.zeros((rows, cap), np.bool_),
        (np.zeros((rows, cap, d), np.uint16), np.zeros((rows, cap, d), np.uint16)), windows, slow_words, 2, 2,
        np.zeros(rows, np.int64), 3, 1.0, 1.0, True, True)
    assert missed == 4                                       # two rows filled in each KV row
    assert np.float32(7e4).view(np.uint32) == word
    assert np.array_equal(factors, before[0]) and np.array_equal(windows[0], before[1])
    assert np.array_equal(slow_words[3], before[2])
