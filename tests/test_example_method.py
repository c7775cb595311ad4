"""examples/int8_method.py, the worked example of docs/architecture.md, is a working method."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import kvshrink
from conftest import assert_batch_rows_equal_alone, greedy, prompts, tiny_model

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "int8_method.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("int8_method", EXAMPLE)
    if "int8-example" not in kvshrink.methods():
        module = importlib.util.module_from_spec(spec)
        sys.modules["int8_method"] = module  # dataclasses resolve the module's annotations through it
        spec.loader.exec_module(module)  # registers the method
    return sys.modules["int8_method"]


def test_example_method_is_close_to_full_and_counts_its_bytes(example):
    model = tiny_model("llama")
    (ids,) = prompts([40])
    mask = torch.ones(1, 40, dtype=torch.long)
    _, full_logits = greedy(model, ids[None], mask, kvshrink.make_cache("full", model))
    cache = kvshrink.make_cache("int8-example", model)
    _, logits = greedy(model, ids[None], mask, cache)
    err = (logits - full_logits).abs().max().item()
    assert 0 < err < 0.05, err  # lossy, but int8 with per-vector scales is nearly exact
    # per token, layer and KV head: 16 int8 codes + one fp16 scale for the key and for the value
    tokens = cache.get_seq_length()
    layer_bytes = sum(layer.nbytes() for layer in cache.layers)
    assert layer_bytes == 2 * 2 * 2 * tokens * (16 + 2)
    assert cache.fp16_nbytes() / layer_bytes == pytest.approx(32 / 18)
    assert cache.nbytes() > layer_bytes  # the cache's own bookkeeping (token ids, row offsets) counts too
    assert sum(cache.breakdown().values()) == cache.nbytes()


def test_example_method_left_padded_batch(example):
    assert_batch_rows_equal_alone(tiny_model("qwen2"), "int8-example", {}, [25, 12], new_tokens=6,
                                  atol=1e-4, rtol=1e-4)


def test_example_method_option_is_validated(example):
    with pytest.raises(ValueError, match="scale_dtype"):
        kvshrink.make_cache("int8-example", tiny_model("llama"), scale_dtype="int4")
