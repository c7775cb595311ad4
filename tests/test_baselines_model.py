"""Every baseline answers a short needle prompt on the embedded SmolLM2-135M-Instruct at a mild setting,
and really compresses while doing so."""

from __future__ import annotations

import pytest
import torch

import kvshrink
from kvshrink.cli import chat_input_ids
from test_real_model import needle_prompt

pytestmark = pytest.mark.model

# Mild settings. H2O ranks by attention accumulated over the prompt, which a needle in the middle of
# repetitive filler never gathers: measured on this prompt, it loses the needle even at budget=0.95 when
# the needle lies outside its recent window (recent=0.5), so its mild setting keeps the needle recent.
MILD = [
    ("h2o", {"budget": 0.9, "recent": 0.6}),
    ("scissorhands", {"budget": 0.8}),
    ("kivi", {"bits": 4}),
    ("turboquant", {"key_bits": 4, "value_bits": 4}),
    ("hf-quantized", {"backend": "quanto", "bits": 4}),  # hqq: same cache, bytes tested in test_baselines.py
]


def kivi_format_ratio(tokens: int, bits: int = 4, group: int = 32, residual: int = 128) -> float:
    """fp16 bytes / KIVI bytes per (layer, head, channel): whole groups of ``group`` tokens beyond the
    residual hold ``bits``-bit codes plus an fp16 step and zero per group (keys per channel, values per
    ``group`` channels: the same bytes), the rest fp16."""
    quantized = max(0, tokens - residual) // group * group
    held = quantized * (bits / 8 + 4 / group) + (tokens - quantized) * 2
    return tokens * 2 / held


def turboquant_format_ratio(bits: int = 4, head_dim: int = 64) -> float:
    """fp16 bytes / TurboQuant bytes per token and head: ``bits``-bit codes plus an fp16 norm, K and V."""
    return 2 * head_dim * 2 / (2 * (head_dim * bits / 8 + 2))


# What each format must reach (every byte counted: the bound would catch unpacked codes or fp32 metadata)
FORMAT_RATIO = {
    "kivi": kivi_format_ratio,
    "turboquant": lambda tokens: turboquant_format_ratio(),
}


@pytest.fixture(scope="module")
def needle_input(real_model):
    _, tok = real_model
    return chat_input_ids(tok, needle_prompt(20, value="4817293"))


@pytest.mark.parametrize("method,options", MILD, ids=[f"{m}-{'-'.join(map(str, o.values()))}" for m, o in MILD])
def test_baseline_answers_the_needle(real_model, needle_input, method, options):
    model, tok = real_model
    cache = kvshrink.make_cache(method, model, **options)
    with torch.no_grad():
        out = model.generate(**needle_input, past_key_values=cache, max_new_tokens=18, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    answer = tok.decode(out[0, needle_input["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "4817293" in answer, f"{method} {options}: {answer!r}"
    assert cache.compression_ratio() > 1.05, cache.summary()
    if method in FORMAT_RATIO:
        expected = FORMAT_RATIO[method](cache.get_seq_length())
        assert cache.compression_ratio() == pytest.approx(expected, rel=0.03), (cache.summary(), expected)
    assert sum(cache.breakdown().values()) == cache.nbytes()
