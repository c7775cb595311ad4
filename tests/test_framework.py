"""The cache framework on tiny random models: exactness, GQA, left padding, bytes, bad input."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvshrink
from kvshrink.cache.attention import Partial, exact_partial, merge_partials
from conftest import assert_batch_rows_equal_alone, greedy, left_pad, prompts, tiny_model

FAMILIES = ["llama", "qwen2", "mistral"]


@pytest.mark.parametrize("family", FAMILIES)
def test_full_equals_dynamic_cache(family):
    model = tiny_model(family)
    (ids,) = prompts([40])
    ids, mask = ids[None], torch.ones(1, 40, dtype=torch.long)
    ref_seq, ref_logits = greedy(model, ids, mask, DynamicCache())
    seq, logits = greedy(model, ids, mask, kvshrink.make_cache("full", model))
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("method,options", [("full", {}), ("streaming", {"sinks": 2, "window": 12})])
def test_left_padded_batch_equals_rows_alone(family, method, options):
    assert_batch_rows_equal_alone(tiny_model(family), method, options, [30, 21, 9], new_tokens=10,
                                  atol=2e-4, rtol=1e-4)

def test_streaming_differs_from_full_once_it_evicts():
    model = tiny_model("llama")
    (ids,) = prompts([60])
    mask = torch.ones(1, 60, dtype=torch.long)
    _, full_logits = greedy(model, ids[None], mask, kvshrink.make_cache("full", model))
    _, stream_logits = greedy(model, ids[None], mask, kvshrink.make_cache("streaming", model, sinks=2, window=8))
    _, wide_logits = greedy(model, ids[None], mask, kvshrink.make_cache("streaming", model, sinks=2, window=100))
    assert (full_logits - stream_logits).abs().max() > 1e-3
    torch.testing.assert_close(wide_logits, full_logits, atol=1e-5, rtol=1e-5)


def test_byte_accounting_by_hand():
    model = tiny_model("llama")  # 2 layers, 2 KV heads, head size 16, fp32
    rows = prompts([25, 25])
    ids, mask = left_pad(rows)
    full = kvshrink.make_cache("full", model)
    greedy(model, ids, mask, full, new_tokens=5)
    tokens = 25 + 5 - 1  # the last generated token is never fed back
    assert full.get_seq_length() == tokens
    # the cache's int64 RoPE offset per row (no padding here, so no pad lengths) and the int64 ids it holds
    bookkeeping = 2 * 8 + 2 * tokens * 8
    assert full.nbytes() == 2 * 2 * (2 * 2 * tokens * 16) * 4 + bookkeeping  # layers x (K,V) x [B,Hkv,T,d] x fp32
    assert full.fp16_nbytes() == 2 * 2 * 2 * 16 * tokens * 2 * 2
    assert full.compression_ratio() == pytest.approx(full.fp16_nbytes() / full.nbytes())
    assert full.compression_ratio() == pytest.approx(full.fp16_nbytes() / (2 * full.fp16_nbytes() + bookkeeping))
    half = kvshrink.make_cache("full", model, dtype="float16")   # the fp16 cache ratios are quoted against
    _, half_logits = greedy(model, ids, mask, half, new_tokens=5)
    assert half.nbytes() == full.fp16_nbytes() + bookkeeping
    _, full_logits = greedy(model, ids, mask, kvshrink.make_cache("full", model), new_tokens=5)
    torch.testing.assert_close(half_logits, full_logits, atol=1e-2, rtol=1e-2)
    stream = kvshrink.make_cache("streaming", model, sinks=2, window=8)
    greedy(model, ids, mask, stream, new_tokens=5)
    kept = 2 + 8
    per_layer = 2 * (2 * 2 * kept * 16) * 4 + 2 * kept * 4  # K,V fp32 + int32 token index per row
    assert stream.nbytes() == 2 * per_layer + bookkeeping
    assert sum(stream.breakdown().values()) == stream.nbytes()


def test_partials_merge_to_exact_attention():
    torch.manual_seed(0)
    q = torch.randn(2, 6, 3, 8)
    k, v = torch.randn(2, 2, 20, 8), torch.randn(2, 2, 20, 8)
    whole = exact_partial(q, k, v, 0.3)
    parts = [exact_partial(q, k[:, :, a:b], v[:, :, a:b], 0.3, key_index=torch.arange(a, b))
             for a, b in [(0, 7), (7, 15), (15, 20)]]
    merged = merge_partials(parts)
    torch.testing.assert_close(merged.out, whole.out)
    torch.testing.assert_close(merged.lse, whole.lse)
    reference = torch.softmax((q.reshape(2, 2, 3, 3, 8) @ k[:, :, None].transpose(-1, -2)) * 0.3, -1) @ v[:, :, None]
    torch.testing.assert_close(whole.out, reference.reshape(2, 6, 3, 8), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_token_alone_is_its_own_value_and_score(dtype):
    """`self_partial` (a decode step's own token, attended alone) == `exact_partial` over that one token."""
    from kvshrink.cache.attention import self_partial

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 6, 1, 8, generator=g).to(dtype)
    k, v = torch.randn(2, 2, 1, 8, generator=g).to(dtype), torch.randn(2, 2, 1, 8, generator=g).to(dtype)
    got, want = self_partial(q, k, v, 0.3), exact_partial(q, k, v, 0.3)
    torch.testing.assert_close(got.out, want.out.float())
    torch.testing.assert_close(got.lse, want.lse.float(), atol=1e-5, rtol=1e-5)


def test_exact_partial_masks_padding_and_future():
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8), torch.randn(1, 1, 4, 8)
    idx = torch.arange(4)
    part = exact_partial(q, k, v, 1.0, key_index=idx, query_index=idx, pad_len=torch.tensor([1]))
    # query 2 sees keys 1 and 2 only (key 0 is padding, key 3 is in the future)
    s = (q[0, 0, 2] @ k[0, 0, 1:3].T)
    expected = torch.softmax(s, -1) @ v[0, 0, 1:3]
    torch.testing.assert_close(part.out[0, 0, 2], expected)
    assert torch.isfinite(part.out).all()


def test_cache_reuse_for_a_new_prompt_is_refused_until_reset():
    model = tiny_model("llama")
    a, b = prompts([20, 15])
    cache = kvshrink.make_cache("full", model)
    greedy(model, a[None], torch.ones(1, 20, dtype=torch.long), cache)
    with pytest.raises(kvshrink.CacheReuseError, match="holds 27 tokens .*does not begin with them.*reset"):
        greedy(model, b[None], torch.ones(1, 15, dtype=torch.long), cache)
    cache.reset()
    seq, _ = greedy(model, b[None], torch.ones(1, 15, dtype=torch.long), cache)
    ref, _ = greedy(model, b[None], torch.ones(1, 15, dtype=torch.long), DynamicCache())
    assert torch.equal(seq, ref)


def test_prefill_only_cache_refuses_an_unrelated_prompt():
    """model(a, cache) then generate(b, cache): b does not begin with a, so it must not be taken as a's tail."""
    model = tiny_model("llama")
    a, b = prompts([12, 20])
    cache = kvshrink.make_cache("full", model)
    with torch.no_grad():
        model(a[None, :5], past_key_values=cache)  # positional ids are seen too
        model(input_ids=a[None, 5:], past_key_values=cache)
    assert torch.equal(cache.token_ids, a[None])
    with pytest.raises(kvshrink.CacheReuseError, match=r"holds 12 tokens \(ids \[.*\]\); the new input has 20"):
        greedy(model, b[None], torch.ones(1, 20, dtype=torch.long), cache)
    with pytest.raises(kvshrink.CacheReuseError, match="no new token"):
        greedy(model, a[None], torch.ones(1, 12, dtype=torch.long), cache)


# an evicting method is not chunk-invariant (what it evicts depends on how the prompt arrived): a window
# wider than the test keeps streaming exact, so both runs must agree
@pytest.mark.parametrize("method,options", [("full", {}), ("streaming", {"sinks": 2, "window": 64})])
def test_prefix_reuse_equals_one_generate(method, options):
    """transformers' prefix-reuse pattern: prefill a shared prefix once, then generate(prefix + question)."""
    model = tiny_model("llama")
    prefix, question = prompts([14, 6])
    full_input = torch.cat([prefix, question])[None]
    cache = kvshrink.make_cache(method, model, **options)
    with torch.no_grad():
        model(input_ids=prefix[None], past_key_values=cache)
    seq, logits = greedy(model, full_input, torch.ones_like(full_input), cache)
    ref, ref_logits = greedy(model, full_input, torch.ones_like(full_input), kvshrink.make_cache(method, model, **options))
    assert torch.equal(seq, ref)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(cache.token_ids, seq[:, :-1])
    assert cache.token_ids.shape[1] == cache.get_seq_length()


def test_a_decoded_cache_continues_a_conversation_exactly():
    model = tiny_model("llama")
    (a,) = prompts([20])
    cache = kvshrink.make_cache("full", model)  # no option needed: a continuation is recognised by its token ids
    first, _ = greedy(model, a[None], torch.ones(1, 20, dtype=torch.long), cache)
    follow = torch.cat([first, torch.tensor([[5, 6, 7]])], dim=1)
    seq, _ = greedy(model, follow, torch.ones_like(follow), cache)
    ref, _ = greedy(model, follow, torch.ones_like(follow), DynamicCache())
    assert torch.equal(seq, ref)


def test_left_padded_cache_holds_the_ids_it_was_given():
    model = tiny_model("llama")
    ids, mask = left_pad(prompts([9, 5]))
    cache = kvshrink.make_cache("full", model)
    seq, _ = greedy(model, ids, mask, cache, new_tokens=3)
    assert torch.equal(cache.token_ids, seq[:, :-1])  # padding included, as given
    other = seq.clone()
    other[1, 6] += 1
    with pytest.raises(kvshrink.CacheReuseError):
        greedy(model, other, torch.cat([mask, torch.ones(2, 3, dtype=torch.long)], 1), cache)


def test_token_ids_are_unknown_after_inputs_embeds():
    """From embeddings the cache cannot know the ids: token_ids is None and reuse is not checked."""
    model = tiny_model("llama")
    (a,) = prompts([10])
    cache = kvshrink.make_cache("full", model)
    with torch.no_grad():
        model(inputs_embeds=model.get_input_embeddings()(a[None]), past_key_values=cache)
    assert cache.token_ids is None
    cache.reset()
    assert cache.token_ids.shape == (1, 0)


def test_use_cache_false_with_a_kvshrink_cache_is_refused():
    model = tiny_model("llama")
    (a,) = prompts([10])
    with pytest.raises(ValueError, match="use_cache=False with a kvshrink cache"):
        model(input_ids=a[None], past_key_values=kvshrink.make_cache("full", model), use_cache=False)
    with pytest.raises(ValueError, match="use_cache=False with a kvshrink cache"):
        model.generate(input_ids=a[None], past_key_values=kvshrink.make_cache("full", model), use_cache=False,
                       max_new_tokens=2, pad_token_id=0)


def test_full_supports_num_return_sequences():
    model = tiny_model("llama")
    (a,) = prompts([12])
    torch.manual_seed(0)
    out = model.generate(input_ids=a[None], past_key_values=kvshrink.make_cache("full", model), max_new_tokens=4,
                         do_sample=False, num_beams=2, num_return_sequences=2, pad_token_id=0)
    torch.manual_seed(0)
    ref = model.generate(input_ids=a[None], past_key_values=DynamicCache(), max_new_tokens=4, do_sample=False,
                         num_beams=2, num_return_sequences=2, pad_token_id=0)
    assert torch.equal(out, ref)


def test_calls_without_a_kvshrink_cache_use_the_models_own_attention():
    model = tiny_model("llama", attn_implementation="eager")
    (a,) = prompts([16])
    with torch.no_grad():
        ref = model(input_ids=a[None], output_attentions=True)
    cache = kvshrink.make_cache("full", model)
    assert model.config._attn_implementation == "eager"
    greedy(model, a[None], torch.ones(1, 16, dtype=torch.long), cache)
    assert model.config._attn_implementation == "eager"
    with torch.no_grad():
        after = model(input_ids=a[None], past_key_values=DynamicCache(), output_attentions=True)
    assert after.attentions is not None and after.attentions[0] is not None  # eager returns weights, SDPA does not
    assert torch.equal(after.logits, ref.logits)
    with pytest.raises(ValueError):  # a failing kvshrink call still hands the model back its own attention
        model(input_ids=a[None], past_key_values=kvshrink.make_cache("full", model), use_cache=False)
    assert model.config._attn_implementation == "eager"


def test_model_keeps_working_with_ordinary_caches_after_make_cache():
    model = tiny_model("llama")
    (a,) = prompts([16])
    ref, _ = greedy(model, a[None], torch.ones(1, 16, dtype=torch.long), DynamicCache())
    kvshrink.make_cache("full", model)
    after, _ = greedy(model, a[None], torch.ones(1, 16, dtype=torch.long), DynamicCache())
    assert torch.equal(ref, after)


def test_demo_command_keeps_multi_option_specs_whole(monkeypatch):
    import kvshrink.demo
    from kvshrink.cli import main

    seen = {}
    monkeypatch.setattr(kvshrink.demo, "run_demo", lambda length, methods, **kw: seen.update(methods=methods) or 0)
    assert main(["demo", "--methods", "full,lrqk:top_k=512,slot_dtype=float16,shard"]) == 0
    assert seen["methods"] == ["full", "lrqk:top_k=512,slot_dtype=float16", "shard"]
