"""Shard's decode stream on keys with a large shared part (a key projection's bias in its slowly turning RoPE
channels, as Qwen2's): free-running greedy decoding through the stream stays with an uncompressed cache."""

import pytest
import torch
from transformers import DynamicCache

import kvshrink

from conftest import prompts, tiny_model

PROMPT, NEW = 48, 48
# Small enough that nearly every token goes through the stream: the prompt's leftovers (fewer than min_block)
# and then one token a decode step.
OPTIONS = dict(sinks=2, window=8)


def biased_key_model(bias: float = 30.0):
    """A tiny Qwen2 whose keys carry a large bias in the slowest RoPE pair of each KV head (channels 7 and 15
    of 16: nearly constant after RoPE over the text), with sharp attention (queries scaled up) and confident
    next-token choices (the output layer scaled up), so attention errors show in the answers."""
    model = tiny_model("qwen2", seed=0)
    head = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:
            attention = layer.self_attn
            attention.q_proj.weight.mul_(8)
            attention.k_proj.bias.zero_()
            for h in range(model.config.num_key_value_heads):
                attention.k_proj.bias[h * head + head // 2 - 1] = bias
                attention.k_proj.bias[h * head + head - 1] = -bias / 2
        model.lm_head.weight.mul_(10)
    return model


def generate(model, ids, cache):
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=NEW, do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    return out.sequences[0, ids.shape[1]:], torch.stack(out.logits, dim=1)[0].log_softmax(-1)


@pytest.mark.parametrize("kernel", ["fast", "reference"])
def test_free_running_greedy_through_the_stream_follows_full_on_biased_keys(kernel):
    """48 greedy tokens decoded by ``generate`` through Shard (4-bit stream, window 8): the tokens are full's and
    every step's next-token distribution is within a small KL of full's. A data-oblivious code of the whole key
    spends its levels on the bias and scatters its error, a share of the key's norm, over every score."""
    model = biased_key_model()
    ids = prompts([PROMPT], seed=3)[0][None]
    want, want_logprobs = generate(model, ids, DynamicCache())
    cache = kvshrink.make_cache("shard", model, kernel=kernel, **OPTIONS)
    got, logprobs = generate(model, ids, cache)
    assert cache.layers[0].stream.n >= NEW - 1      # every decoded token but the last went through the stream
    differ = (got != want).nonzero()
    steps = NEW if len(differ) == 0 else int(differ[0]) + 1     # the steps whose histories are alike
    kl = (want_logprobs[:steps].exp() * (want_logprobs[:steps] - logprobs[:steps])).sum(-1)
    assert len(differ) == 0, f"first different token at step {steps - 1}, KL per step {kl.tolist()}"
    assert kl.mean() < 3e-3 and kl.max() < 1e-2, kl.tolist()


def test_the_stream_centre_is_the_windows_mean_and_counted():
    """The stream's centre is the mean of the exact window's keys and values when the first token enters it (the
    prompt's leftovers here), fixed after, and its bytes are the stream's."""
    from kvshrink.cache.store import held_bytes

    model = biased_key_model()
    ids = prompts([PROMPT], seed=3)[0][None]
    cache = kvshrink.make_cache("shard", model, **OPTIONS)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    layer = cache.layers[0]
    head = model.config.hidden_size // model.config.num_attention_heads
    centre = layer.stream.centre
    assert centre.shape == (2, 1, 2, head) and centre.dtype == torch.float32
    assert centre[0, 0, 0, head // 2 - 1] > 10     # the bias, kept out of the codes
    held = centre.clone()
    with torch.no_grad():
        for token in (5, 6, 7):
            model(torch.tensor([[token]]), past_key_values=cache)
    assert torch.equal(layer.stream.centre, held)
    assert layer.breakdown()["stream"] == held_bytes(layer.stream.tensors()) >= centre.numel() * 4
