"""Every method on every supported family, RoPE type and dtype (tiny random models): prefill plus 8
decode steps run; ``full`` equals DynamicCache; a near-lossless setting of each lossy method matches
``full``'s logits on the decode steps (teacher-forced on full's tokens) within a stated bound; a
left-padded batch decodes each row as that row alone."""

from __future__ import annotations

import functools

import pytest
import torch
from transformers import DynamicCache

import kvshrink
from conftest import left_pad, prompts, tiny_model

PROMPT, STEPS = 96, 8
ROPE_SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 128},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
}
MODELS = ["llama", "llama-llama3", "llama-yarn", "llama-linear", "qwen2", "qwen3", "mistral"]

# Near-lossless settings: everything kept (eviction and selection methods), the most bits each
# quantizer offers, compression forced on the prompt (small residuals / windows). Bound: the largest
# decode-step logit difference to full, relative to the largest |logit| of full.
NEAR_LOSSLESS = {
    "streaming": ({"sinks": 4, "window": 200}, 1e-5),  # measured (fp32 model): 0
    "h2o": ({"budget": 200, "recent": 8}, 2e-4),  # kept tokens in fp16 (fp32 model); measured <= 7.8e-5
    "scissorhands": ({"budget": 200, "recent": 8}, 2e-4),
    "lrqk": ({"top_k": 200, "window": 8, "rank": 4}, 2e-4),  # slots in fp16 (fp32 model); measured <= 7.8e-5
    "kivi": ({"bits": 4, "group": 16, "residual": 16}, 0.04),  # measured <= 2.1e-2
    "turboquant": ({"key_bits": 8, "value_bits": 8}, 4e-3),  # measured <= 2.1e-3
    "shard": ({"sinks": 4, "window": 8, "key_bits": 8.0, "stream_bits": 8, "v_group": 1, "salient": 0.0, "evict": 0.0},
              4e-3),  # <= 2.5e-3
    "hf-quantized": ({"backend": "quanto", "bits": 4, "group": 16, "residual": 16}, 0.04),  # <= 2.2e-2
}
# fp16/bf16 storage of keys and values alone moves logits by up to this much more
HALF_SLACK = 0.02


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tiny models run fastest on one thread; several threads on a shared 2-core runner thrash."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.lru_cache(maxsize=None)
def build(name: str, dtype: torch.dtype = torch.float32):
    family, _, rope = name.partition("-")
    overrides = {"rope_scaling": ROPE_SCALINGS[rope]} if rope else {}
    return tiny_model(family, **overrides).to(dtype)


def decode_logits(model, ids: torch.Tensor, cache, steps: torch.Tensor) -> torch.Tensor:
    """Logits ``[B, 1 + steps, vocab]`` (float32) of the prompt's last token and of each forced step token."""
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache).logits[:, -1]
        out.append(logits)
        for t in range(steps.shape[1]):
            out.append(model(input_ids=steps[:, t:t + 1], past_key_values=cache).logits[:, -1])
    return torch.stack(out, 1).float()


@functools.lru_cache(maxsize=None)
def full_run(model):
    (ids,) = prompts([PROMPT], seed=4)
    ids = ids[None]
    with torch.no_grad():
        seq = model.generate(input_ids=ids, past_key_values=DynamicCache(), max_new_tokens=STEPS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
    steps = seq[:, PROMPT:]
    return ids, steps, decode_logits(model, ids, kvshrink.make_cache("full", model), steps)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("name", MODELS)
def test_full_equals_dynamic_cache_on_decode_steps(name):
    model = build(name)
    ids, steps, logits = full_run(model)
    torch.testing.assert_close(logits, decode_logits(model, ids, DynamicCache(), steps), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", list(NEAR_LOSSLESS))
@pytest.mark.parametrize("name", MODELS)
def test_near_lossless_setting_matches_full_on_decode_steps(name, method):
    options, bound = NEAR_LOSSLESS[method]
    model = build(name)
    ids, steps, want = full_run(model)
    cache = kvshrink.make_cache(method, model, **options)
    got = decode_logits(model, ids, cache, steps)
    assert cache.get_seq_length() == PROMPT + STEPS
    assert torch.isfinite(got).all()
    assert relative_error(got, want) < bound, relative_error(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method", ["full", *NEAR_LOSSLESS])
def test_every_method_runs_in_half_precision_within_the_same_bound(method, dtype):
    options, bound = NEAR_LOSSLESS.get(method, ({}, 0.0))
    if method == "hf-quantized":
        options = {**options, "backend": "hqq"}  # quanto's CPU kernels take float32 only
    model = build("llama", dtype)
    ids, steps, want = full_run(model)
    got = decode_logits(model, ids, kvshrink.make_cache(method, model, **options), steps)
    assert torch.isfinite(got).all()
    assert relative_error(got, want) <= bound + HALF_SLACK, relative_error(got, want)


def assert_rows_decode_as_alone(method: str, options: dict, lengths: list[int]) -> None:
    """Greedy tokens of each row of a left-padded batch == the same row decoded alone."""
    model = build("llama")
    rows = prompts(lengths, seed=6)
    ids, mask = left_pad(rows)
    with torch.no_grad():
        batch = model.generate(input_ids=ids, attention_mask=mask, past_key_values=kvshrink.make_cache(
            method, model, **options), max_new_tokens=STEPS, do_sample=False, pad_token_id=0, eos_token_id=None)
        for i, row in enumerate(rows):
            alone = model.generate(input_ids=row[None], past_key_values=kvshrink.make_cache(method, model, **options),
                                   max_new_tokens=STEPS, do_sample=False, pad_token_id=0, eos_token_id=None)
            assert torch.equal(batch[i, -STEPS:], alone[0, -STEPS:]), f"row {i} differs"


@pytest.mark.parametrize("method", list(NEAR_LOSSLESS))
def test_left_padded_batch_decodes_each_row_as_alone(method):
    assert_rows_decode_as_alone(method, NEAR_LOSSLESS[method][0], [PROMPT, PROMPT - 30, PROMPT - 61])


# Settings that really compress these prompts. Shard and LRQK fit their codes / factors to the tokens they
# see (PCA bases, bit allocation, value scales; LRQK's factorization): in a batch each row gets its own
# layers (cache/rowwise.py), so each row must decode exactly as alone.
COMPRESSING = [
    ("streaming", {"sinks": 2, "window": 16}),
    ("h2o", {"budget": 24, "recent": 8}),
    ("scissorhands", {"budget": 24, "recent": 8}),
    ("kivi", {"bits": 2, "group": 16, "residual": 16}),
    ("turboquant", {"key_bits": 3, "value_bits": 3}),
    ("shard", {}),
    ("lrqk", {"top_k": 16, "window": 8}),
]


@pytest.mark.parametrize("method,options", COMPRESSING)
def test_left_padded_batch_decodes_each_row_as_alone_while_compressing(method, options):
    assert_rows_decode_as_alone(method, options, [220, 180, 140])
