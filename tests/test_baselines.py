"""Baselines (h2o, scissorhands, kivi, turboquant, hf-quantized) on tiny random models and constructed
inputs: eviction rules against independent reference computations, reconstruction bounds, bytes by
hand, GQA + left-padded batches, and clear refusals."""

from __future__ import annotations

import math

import pytest
import torch

import kvshrink
from conftest import assert_batch_rows_equal_alone, greedy, left_pad, prompts, tiny_model
from kvshrink.cache.base import LayerSpec, ModelInfo, StepContext
from kvshrink.methods.h2o import H2OLayer, H2OOptions
from kvshrink.methods.kivi import KiviLayer, KiviOptions
from kvshrink.methods.scissorhands import ScissorhandsLayer, ScissorhandsOptions
from kvshrink.methods.turboquant import TurboQuantLayer, TurboQuantOptions


# ---------------------------------------------------------------- helpers
def info(hq=4, hkv=2, d=8, dtype=torch.float32) -> ModelInfo:
    return ModelInfo("llama", 1, hq, hkv, d, 4096, dtype)


def step(layer, query, key, value, past_len, pad_len=None):
    """Drive one layer through one forward step, as the attention function would."""
    b = query.shape[0]
    ctx = StepContext(past_len, query.shape[2], query.shape[-1] ** -0.5, pad_len,
                      torch.zeros(b, dtype=torch.long), None, torch.float32)
    layer.update(key, value)
    return layer.attend(query, ctx)


def reference_probs(q_all, k_all):
    """Dense causal softmax ``[B, Hq, T, T]`` (keys repeated to query heads), fp64."""
    hq, hkv = q_all.shape[1], k_all.shape[1]
    k = k_all.double().repeat_interleave(hq // hkv, dim=1)
    s = q_all.double() @ k.transpose(-1, -2) * q_all.shape[-1] ** -0.5
    t = s.shape[-1]
    s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
    return torch.softmax(s, dim=-1)


def group_mean(p, hkv):
    b, hq, q, n = p.shape
    return p.reshape(b, hkv, hq // hkv, q, n).mean(dim=2)  # [B, Hkv, q, n]


def kept_tokens(layer, b, hkv):
    """Token indices each KV head keeps, as sets ``[b][h]``."""
    index = layer.store.token_index()
    index = index if index.dim() == 2 else index.unsqueeze(0).expand(b * hkv, -1)
    return [[set(index[r * hkv + h].tolist()) for h in range(hkv)] for r in range(b)]


def wide_model(family="llama"):
    """2 layers, 4 query heads, 2 KV heads, head size 32 (so KIVI's default groups of 32 fit)."""
    return tiny_model(family, hidden_size=128)


# ---------------------------------------------------------------- H2O
def test_h2o_keeps_largest_accumulated_attention_on_a_planted_example():
    torch.manual_seed(0)
    b, hq, hkv, d, t = 1, 4, 2, 8, 24
    q = torch.randn(b, hq, t + 6, d) * 0.3
    k = torch.randn(b, hkv, t + 6, d) * 0.3
    heavy = {0: [3, 9], 1: [5, 14]}  # planted heavy hitters per KV head
    for h, toks in heavy.items():
        for tok in toks:
            k[0, h, tok] = 0
            k[0, h, tok, 0] = 6.0
        q[0, h * 2:(h + 1) * 2, :, 0] = 2.0  # every query of the head looks along dim 0
    layer = H2OLayer(LayerSpec(0, info(hq, hkv, d)), H2OOptions(budget=8, recent=4))
    step(layer, q[:, :, :t], k[:, :, :t], k[:, :, :t].clone(), 0)
    for i in range(t, t + 6):  # decode steps, one eviction each
        step(layer, q[:, :, i:i + 1], k[:, :, i:i + 1], k[:, :, i:i + 1].clone(), i)
    kept = kept_tokens(layer, b, hkv)
    n = t + 6
    for h in range(hkv):
        assert set(heavy[h]) <= kept[0][h], f"head {h} lost a heavy hitter: {sorted(kept[0][h])}"
        assert set(range(n - 4, n)) <= kept[0][h]
        assert len(kept[0][h]) == 8


def test_h2o_matches_reference_accumulation_prefill_then_decode():
    """Random data: after prefill + decode, each head keeps its `recent` newest tokens plus the tokens with
    the largest attention accumulated since they entered, as an independent greedy H2O computes."""
    torch.manual_seed(1)
    b, hq, hkv, d, t, extra, budget, recent = 2, 6, 2, 8, 40, 5, 12, 3
    n = t + extra
    q = torch.randn(b, hq, n, d)
    k = torch.randn(b, hkv, n, d).half().float()  # stored in fp16: make the reference see the same keys
    v = torch.randn(b, hkv, n, d)
    layer = H2OLayer(LayerSpec(0, info(hq, hkv, d)), H2OOptions(budget=budget, recent=recent))
    step(layer, q[:, :, :t], k[:, :, :t], v[:, :, :t], 0)
    for i in range(t, n):
        step(layer, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], i)
    kept = kept_tokens(layer, b, hkv)
    # reference: greedy H2O with dense attention over the kept set
    qf, k16 = q, k.double()
    for r in range(b):
        for h in range(hkv):
            qs = qf[r, h * 3:(h + 1) * 3].double()  # [G, n, d]
            score = torch.zeros(n, dtype=torch.float64)
            alive = list(range(t))
            s = qs[:, :t] @ k16[r, h, :t].T * d**-0.5
            s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
            score[:t] += torch.softmax(s, -1).mean(0).sum(0)
            alive = _reference_evict(alive, score, budget, recent)
            for i in range(t, n):
                alive.append(i)
                s = qs[:, i] @ k16[r, h, alive].T * d**-0.5
                score[alive] += torch.softmax(s, -1).mean(0)
                alive = _reference_evict(alive, score, budget, recent)
            assert kept[r][h] == set(alive), (r, h)
            # the stored scores are the attention each kept token accumulated since it entered
            row = r * hkv + h
            index = layer.store.token_index()
            index = index[row] if index.dim() == 2 else index
            torch.testing.assert_close(layer.score[row].double(), score[index], atol=1e-5, rtol=1e-4)
    assert layer.score.shape == (b * hkv, budget)


def _reference_evict(alive, score, budget, recent):
    if len(alive) <= budget:
        return alive
    newest = alive[-recent:]
    older = alive[:-recent]
    top = sorted(older, key=lambda i: -score[i].item())[:budget - recent]
    return sorted(top + newest)


def test_h2o_budget_as_fraction_and_count():
    model = wide_model()
    (ids,) = prompts([50])
    mask = torch.ones(1, 50, dtype=torch.long)
    frac = kvshrink.make_cache("h2o", model, budget=0.3, recent=0.5)
    greedy(model, ids[None], mask, frac, new_tokens=4)
    # 53 tokens stored at the end (the 4th new token is never attended): ceil(0.3 * 53) = 16 kept per head
    assert len(frac.layers[0].store) == math.ceil(0.3 * 53)
    count = kvshrink.make_cache("h2o", model, budget=10, recent=2)
    greedy(model, ids[None], mask, count, new_tokens=4)
    assert len(count.layers[0].store) == 10


# ---------------------------------------------------------------- Scissorhands
def test_scissorhands_evicts_by_persistence_rule():
    """Independent reference: over the last `history` queries, count per token how often its group-mean
    attention beat 1/(tokens visible); evict `drop` tokens with the fewest hits outside the recent window
    (ties: older first) once the budget is exceeded."""
    torch.manual_seed(2)
    b, hq, hkv, d, t, extra = 1, 4, 2, 8, 30, 9
    budget, recent, drop, history = 16, 3, 4, 6
    n = t + extra
    q, k, v = torch.randn(b, hq, n, d), torch.randn(b, hkv, n, d).half().float(), torch.randn(b, hkv, n, d)
    options = ScissorhandsOptions(budget=budget, recent=recent, drop=drop, history=history)
    layer = ScissorhandsLayer(LayerSpec(0, info(hq, hkv, d)), options)
    step(layer, q[:, :, :t], k[:, :, :t], v[:, :, :t], 0)
    sizes = [len(layer.store)]
    for i in range(t, n):
        step(layer, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1], i)
        sizes.append(len(layer.store))
    assert sizes[0] == budget - drop and max(sizes) <= budget and min(sizes) >= budget - drop
    kept = kept_tokens(layer, b, hkv)
    k16 = k.double()
    for h in range(hkv):
        qs = q[0, h * 2:(h + 1) * 2].double()
        hits: dict[int, list[int]] = {}  # token -> steps (query indices) at which it was important
        alive = list(range(t))
        s = qs[:, :t] @ k16[0, h, :t].T * d**-0.5
        s = s.masked_fill(torch.triu(torch.ones(t, t, dtype=torch.bool), 1), float("-inf"))
        p = torch.softmax(s, -1).mean(0)
        for row in range(t):
            for j in range(row + 1):
                if p[row, j] > 1.0 / (row + 1):
                    hits.setdefault(j, []).append(row)
        alive = _reference_persist_evict(alive, hits, t - 1, budget, recent, drop, history)
        for i in range(t, n):
            alive.append(i)
            p = torch.softmax(qs[:, i] @ k16[0, h, alive].T * d**-0.5, -1).mean(0)
            for j, pj in zip(alive, p):
                if pj > 1.0 / len(alive):
                    hits.setdefault(j, []).append(i)
            alive = _reference_persist_evict(alive, hits, i, budget, recent, drop, history)
        assert kept[0][h] == set(alive), h


def _reference_persist_evict(alive, hits, now, budget, recent, drop, history):
    if len(alive) <= budget:
        return alive
    count = {j: sum(1 for s in hits.get(j, []) if now - s < history) for j in alive}
    older = alive[:-recent]
    # most persistent first; ties: newer first
    ranked = sorted(older, key=lambda j: (-count[j], -j))
    return sorted(ranked[:budget - drop - recent] + alive[-recent:])


def test_scissorhands_drops_a_one_off_heavy_hitter_that_h2o_keeps():
    """Token 2 is attended hugely by early queries only; tokens 5 and 6 modestly by every recent query.
    H2O (accumulated) keeps token 2; Scissorhands (persistence over the last queries) keeps 5 and 6."""
    b, hq, hkv, d, t = 1, 2, 1, 8, 30
    k = torch.zeros(b, hkv, t, d)
    k[0, 0, :, 7] = 0.1
    k[0, 0, 2, 0] = 12.0
    k[0, 0, 5, 1] = 3.0
    k[0, 0, 6, 1] = 3.0
    q = torch.zeros(b, hq, t, d)
    q[0, :, 3:12, 0] = 3.0  # early queries stare at token 2
    q[0, :, 12:, 1] = 3.0  # later queries look at tokens 5 and 6
    v = torch.randn(b, hkv, t, d)
    h2o = H2OLayer(LayerSpec(0, info(hq, hkv, d)), H2OOptions(budget=6, recent=3))
    sc = ScissorhandsLayer(LayerSpec(0, info(hq, hkv, d)), ScissorhandsOptions(budget=6, recent=3, drop=1, history=8))
    step(h2o, q, k, v, 0)
    step(sc, q, k, v, 0)
    assert 2 in kept_tokens(h2o, 1, 1)[0][0]
    kept_sc = kept_tokens(sc, 1, 1)[0][0]
    assert {5, 6} <= kept_sc and 2 not in kept_sc


@pytest.mark.parametrize("method,options", [
    ("h2o", {"budget": 24, "recent": 8}),
    ("scissorhands", {"budget": 24, "recent": 4, "drop": 3, "history": 8}),
])
def test_eviction_scores_the_same_in_small_blocks_of_query_rows(monkeypatch, method, options):
    """A large step's probabilities are observed block by block of query rows (bounded memory): blocks of
    one or a few rows keep the same tokens and answer the same as the whole step at once, through a
    left-padded prefill, a prefill with past and decoding."""
    import kvshrink.cache.eviction as eviction

    model = tiny_model()
    ids, mask = left_pad(prompts([40, 56, 25], seed=5))

    def run():
        cache = kvshrink.make_cache(method, model, **options)
        with torch.no_grad():
            logits = [model(input_ids=ids[:, :32], attention_mask=mask[:, :32], past_key_values=cache).logits,
                      model(input_ids=ids[:, 32:], attention_mask=mask, past_key_values=cache).logits]
            seen = mask
            for _ in range(6):
                seen = torch.cat([seen, torch.ones(3, 1, dtype=torch.long)], dim=1)
                nxt = logits[-1][:, -1:].argmax(-1)
                logits.append(model(input_ids=nxt, attention_mask=seen, past_key_values=cache).logits)
        return logits, kept_tokens(cache.layers[1], 3, 2)

    whole, kept = run()
    for elements in (1 << 11, 1 << 8):  # a few query rows per block, then one
        monkeypatch.setattr(eviction, "_SCORE_BLOCK_ELEMENTS", elements)
        blocked, kept_blocked = run()
        assert kept_blocked == kept
        for a, b in zip(blocked, whole):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- eviction with GQA + left padding
@pytest.mark.parametrize("method,options", [
    ("h2o", {"budget": 0.4, "recent": 0.25}),
    ("h2o", {"budget": 9, "recent": 3}),
    ("scissorhands", {"budget": 0.5, "recent": 4, "drop": 3, "history": 8}),
    ("turboquant", {"key_bits": 3, "value_bits": 2}),
])
def test_left_padded_batch_rows_evict_and_quantize_as_alone(method, options):
    assert_batch_rows_equal_alone(wide_model("qwen2"), method, options, [30, 21, 12], new_tokens=8,
                                  atol=5e-4, rtol=1e-3, seed=3)

def test_eviction_really_changes_the_output_and_a_large_budget_does_not():
    model = wide_model()
    (ids,) = prompts([60], seed=4)
    mask = torch.ones(1, 60, dtype=torch.long)
    _, full = greedy(model, ids[None], mask, kvshrink.make_cache("full", model))
    for method in ("h2o", "scissorhands"):
        _, tight = greedy(model, ids[None], mask, kvshrink.make_cache(method, model, budget=8, recent=2))
        _, loose = greedy(model, ids[None], mask, kvshrink.make_cache(method, model, budget=1000))
        assert (tight - full).abs().max() > 1e-2
        torch.testing.assert_close(loose, full, atol=2e-3, rtol=1e-3)  # fp16 storage only


# ---------------------------------------------------------------- KIVI
def test_kivi_reconstruction_within_half_a_step_and_residual_exact():
    torch.manual_seed(5)
    b, hq, hkv, d = 2, 4, 2, 64
    layer = KiviLayer(LayerSpec(0, info(hq, hkv, d)), KiviOptions(bits=2, group=32, residual=128))
    k = torch.randn(b, hkv, 300, d) * torch.linspace(0.2, 8, d)  # outlier channels, as in real keys
    v = torch.randn(b, hkv, 300, d)
    step(layer, torch.randn(b, hq, 300, d), k, v, 0)
    # (300 - 128) // 32 * 32 = 160 tokens quantized, 140 exact
    assert layer.quantized == 160 and len(layer.tail) == 140
    kq, vq = layer._dequantize(0, 160)
    key_step = layer.key_codes.scale.float().repeat_interleave(32, dim=-1).transpose(-1, -2)  # per channel
    val_step = layer.value_codes.scale.float().repeat_interleave(32, dim=-1)  # per token
    assert bool(((kq - k[:, :, :160]).abs() <= key_step / 2 + 1e-2).all())
    assert bool(((vq - v[:, :, :160]).abs() <= val_step / 2 + 1e-2).all())
    # per-channel key steps are much smaller on the small channels than one per-token step would be
    assert key_step[..., 0].mean() < 0.2 * key_step[..., -1].mean()
    torch.testing.assert_close(layer.tail.keys.float(), k[:, :, 160:], atol=1e-2, rtol=1e-3)


def test_kivi_attention_from_packed_form_equals_attention_over_dequantized():
    torch.manual_seed(6)
    b, hq, hkv, d, t = 1, 4, 2, 32, 200
    layer = KiviLayer(LayerSpec(0, info(hq, hkv, d)), KiviOptions(bits=4, group=32, residual=16))
    k, v = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    step(layer, torch.randn(b, hq, t, d), k, v, 0)
    assert layer.quantized == 160
    kq, vq = layer._dequantize(0, layer.quantized)
    new_k, new_v, query = torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hq, 1, d)
    keys = torch.cat([kq, layer.tail.keys.float(), new_k], 2).repeat_interleave(2, 1)
    values = torch.cat([vq, layer.tail.values.float(), new_v], 2).repeat_interleave(2, 1)
    out = step(layer, query, new_k, new_v, t)
    p = torch.softmax(query @ keys.transpose(-1, -2) * d**-0.5, -1)
    torch.testing.assert_close(out, (p @ values).transpose(1, 2), atol=1e-4, rtol=1e-4)
    # and it is close to exact attention over the original tokens (4 bits)
    exact_k = torch.cat([k, new_k], 2).repeat_interleave(2, 1)
    exact_v = torch.cat([v, new_v], 2).repeat_interleave(2, 1)
    p = torch.softmax(query @ exact_k.transpose(-1, -2) * d**-0.5, -1)
    assert (out - (p @ exact_v).transpose(1, 2)).abs().max() < 0.05


def test_kivi_left_padding_never_widens_a_quantization_range():
    """Row 1 is left-padded with garbage keys (1e3): they must not enter the range of the groups they share
    with real tokens, and the row's attention must be close to exact attention over its real tokens."""
    torch.manual_seed(10)
    b, hq, hkv, d, t, pad = 2, 4, 2, 32, 200, 40
    layer = KiviLayer(LayerSpec(0, info(hq, hkv, d)), KiviOptions(bits=4, group=32, residual=16))
    k, v = torch.randn(b, hkv, t, d), torch.randn(b, hkv, t, d)
    k[1, :, :pad], v[1, :, :pad] = 1e3, -1e3
    pad_len = torch.tensor([0, pad])
    step(layer, torch.randn(b, hq, t, d), k, v, 0, pad_len=pad_len)
    kq, vq = layer._dequantize(0, layer.quantized)
    q_end = layer.quantized
    assert (kq[1, :, pad:] - k[1, :, pad:q_end]).abs().max() < 0.3
    assert (vq[1, :, pad:] - v[1, :, pad:q_end]).abs().max() < 0.3
    query, nk, nv = torch.randn(b, hq, 1, d), torch.randn(b, hkv, 1, d), torch.randn(b, hkv, 1, d)
    out = step(layer, query, nk, nv, t, pad_len=pad_len)
    keys = torch.cat([k[1:, :, pad:], nk[1:]], 2).repeat_interleave(2, 1)
    values = torch.cat([v[1:, :, pad:], nv[1:]], 2).repeat_interleave(2, 1)
    p = torch.softmax(query[1:] @ keys.transpose(-1, -2) * d**-0.5, -1)
    assert (out[1:] - (p @ values).transpose(1, 2)).abs().max() < 0.05


@pytest.mark.parametrize("bits,residual", [(2, 128), (4, 16)])
def test_kivi_bytes_by_hand(bits, residual):
    model = wide_model()  # 2 layers, 2 KV heads, head size 32, fp32
    (ids,) = prompts([200], seed=7)
    cache = kvshrink.make_cache("kivi", model, bits=bits, residual=residual)
    greedy(model, ids[None], torch.ones(1, 200, dtype=torch.long), cache, new_tokens=5)
    tokens = 204
    quantized = (tokens - residual) // 32 * 32
    exact = tokens - quantized
    L, H, d = 2, 2, 32
    key = H * d * (quantized // 32) * (32 * bits // 8 + 4)  # per channel and group: codes + fp16 step, zero
    val = H * quantized * (d // 32) * (32 * bits // 8 + 4)  # per token and group of 32 channels
    tail = 2 * H * exact * d * 2  # fp16 K and V
    assert cache.nbytes() == L * (key + val + tail) + 8 + tokens * 8  # + the cache's int64 offset and token ids
    assert sum(cache.breakdown().values()) == cache.nbytes()


# ---------------------------------------------------------------- TurboQuant
@pytest.mark.parametrize("bits", [2, 3, 4, 8])
def test_turboquant_reconstruction_within_paper_bound(bits):
    """TurboQuant's MSE bound: E|x - x^|^2 / |x|^2 <= sqrt(3) pi / 2 * 4^-bits (Zandieh et al., Thm 1)."""
    torch.manual_seed(bits)
    b, hq, hkv, d, t = 1, 4, 2, 64, 256
    layer = TurboQuantLayer(LayerSpec(0, info(hq, hkv, d)), TurboQuantOptions(key_bits=bits, value_bits=bits))
    k = torch.randn(b, hkv, t, d) * torch.linspace(0.1, 5, d)  # anisotropic, with outlier channels
    v = torch.randn(b, hkv, t, d) + 2.0
    step(layer, torch.randn(b, hq, t, d), k, v, 0)
    bound = math.sqrt(3) * math.pi / 2 * 4.0**-bits
    for x, qz, code in ((k, layer.key_q, layer.keys), (v, layer.value_q, layer.values)):
        y = qz.decode(code)
        rel = ((y - x).pow(2).sum(-1) / x.pow(2).sum(-1)).mean().item()
        assert rel <= bound, (bits, rel, bound)


def test_turboquant_bytes_by_hand_and_options():
    model = wide_model()
    (ids,) = prompts([100], seed=8)
    mask = torch.ones(1, 100, dtype=torch.long)
    L, H, d, tokens = 2, 2, 32, 103
    for kb, vb, qjl, residual in [(8, 4, False, 0), (3, 3, True, 0), (2, 2, False, 16)]:
        cache = kvshrink.make_cache("turboquant", model, key_bits=kb, value_bits=vb, qjl=qjl, residual=residual)
        greedy(model, ids[None], mask, cache, new_tokens=4)
        q = tokens - residual
        per_layer = H * q * (d * kb // 8 + d * vb // 8 + 2 + 2)  # codes + fp16 norm of K and of V
        if qjl:
            per_layer += H * q * (d // 8 + 2)  # 1-bit signs + fp16 residual norm, keys only
        per_layer += 2 * H * residual * d * 2  # exact fp16 tail
        per_layer += 8 + 8 + (8 if qjl else 0) + 4 * (2**kb + 2**vb)  # seeds + fp32 codebooks
        assert cache.nbytes() == L * per_layer + 8 + tokens * 8, (kb, vb, qjl, residual)  # + offset, token ids


# ---------------------------------------------------------------- transformers' QuantizedCache
@pytest.mark.parametrize("backend", ["quanto", "hqq"])
def test_hf_quantized_bytes_by_hand_and_output_close(backend):
    model = wide_model()
    (ids,) = prompts([60], seed=9)
    mask = torch.ones(1, 60, dtype=torch.long)
    _, full = greedy(model, ids[None], mask, kvshrink.make_cache("full", model))
    cache = kvshrink.make_cache("hf-quantized", model, backend=backend, bits=4, group=32, residual=16)
    _, got = greedy(model, ids[None], mask, cache)
    assert (got - full).abs().max() < 0.1
    # transformers quantizes the prompt, keeps up to `residual` later tokens exact, then re-quantizes all
    exact = cache.stats()["exact_tokens"]
    quant = cache.get_seq_length() - exact
    L, H, d = 2, 2, 32
    numel = H * d * quant
    payload = numel * 4 // 8 + (numel // 32) * 2 * 4  # 4-bit codes + fp32 scale and zero per group of 32
    residual = 2 * H * d * exact * 4  # fp32 K and V
    assert cache.nbytes() == L * (2 * payload + residual)
    assert cache.fp16_nbytes() == 2 * L * H * d * 67 * 2
    assert cache.compression_ratio() == pytest.approx(cache.fp16_nbytes() / cache.nbytes())
    assert sum(cache.breakdown().values()) == cache.nbytes()
    assert "hf-quantized" in cache.summary()


def test_hf_quantized_refuses_clearly_without_its_backend(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "hqq" else real(name, *a))
    with pytest.raises(ImportError, match=r"backend 'hqq' needs the 'hqq' package.*kvshrink\[baselines\]"):
        kvshrink.make_cache("hf-quantized", wide_model(), backend="hqq")


def test_plots_name_the_eval_extra_when_matplotlib_is_missing(monkeypatch):
    import importlib.util

    from kvshrink.eval.report import plot_niah

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else real(name, *a))
    rows = [{"task": "niah", "spec": "full", "length": 2048, "depth": 50, "score": 1.0}]
    with pytest.raises(ImportError, match=r"kvshrink\[eval\]"):
        plot_niah(rows, "/nonexistent")


