"""A shared prefill (eval/fanout.py) leaves every cache exactly as a prefill of its own would."""

from __future__ import annotations

import pytest
import torch

import kvshrink
from kvshrink.eval.fanout import prefill_together
from conftest import tiny_model


def decode(model, cache, first_logits, steps=6):
    tokens, logits = [], [first_logits]
    nxt = first_logits.argmax(-1, keepdim=True)
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(nxt))
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return tokens, torch.stack(logits)


def alone(model, name, ids):
    cache = kvshrink.make_cache(name, model)
    with torch.no_grad():
        first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
    return cache, first


METHODS = sorted(kvshrink.methods())


def test_shared_prefill_matches_each_method_alone():
    model = tiny_model("llama", max_position_embeddings=1024, hidden_size=256)  # head size 64
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(3))
    caches = [kvshrink.make_cache(name, model) for name in METHODS]
    first = prefill_together(model, caches, ids)
    for name, cache in zip(METHODS, caches):
        ref_cache, ref_first = alone(model, name, ids)
        torch.testing.assert_close(first, ref_first, atol=1e-5, rtol=1e-5)
        assert cache.get_seq_length() == ref_cache.get_seq_length() == 300
        assert cache.nbytes() == ref_cache.nbytes(), name
        tokens, logits = decode(model, cache, first)
        ref_tokens, ref_logits = decode(model, ref_cache, ref_first)
        assert tokens == ref_tokens, name
        torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4, msg=name)


def test_shared_prefill_refuses_used_caches():
    model = tiny_model("llama")
    cache = kvshrink.make_cache("full", model)
    with torch.no_grad():
        model(input_ids=torch.tensor([[5, 6, 7]]), past_key_values=cache)
    with pytest.raises(ValueError, match="fresh"):
        prefill_together(model, [cache], torch.tensor([[5, 6]]))


@pytest.mark.parametrize("name", METHODS)
def test_prompt_prefilled_under_inference_mode_continues_outside_it(name):
    """Caches made under torch.inference_mode keep working under no_grad, as the user's next call is."""
    model = tiny_model("llama", max_position_embeddings=1024, hidden_size=256)  # head size 64
    ids = torch.randint(3, 128, (1, 300), generator=torch.Generator().manual_seed(4))
    cache = kvshrink.make_cache(name, model)
    with torch.inference_mode():
        first = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
    ref_cache, ref_first = alone(model, name, ids)
    tokens, _ = decode(model, cache, first.clone())
    assert tokens == decode(model, ref_cache, ref_first)[0]
