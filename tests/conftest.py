"""Shared fixtures: the embedded model (loaded once per session) and tiny random models."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# The tests check the numba kernels: they compile before a cache's first step, not in a background process
# while the torch path serves (test_first_use tests that).
os.environ["KVSHRINK_COMPILE"] = "wait"


def _session_cache_home() -> None:
    """What kvshrink keeps between processes (calibrations, markers) goes to a folder of this session's own, so
    no test finds what an earlier session stored; converted GGUF models, checksummed and keyed by the file's
    content, stay where the user keeps them (converting the embedded model takes 25-50 s)."""
    from kvshrink.gguf_conversion import conversion_root

    converted = conversion_root()
    os.environ.setdefault("KVSHRINK_MODEL_CACHE", "off" if converted is None else str(converted))
    home = tempfile.mkdtemp(prefix="kvshrink-test-cache-")
    os.environ["KVSHRINK_CACHE_HOME"] = home
    atexit.register(shutil.rmtree, home, True)


_session_cache_home()

# Test files that run the GPU path's Triton kernels in Triton's interpreter on CPU: marked `interpreter`
# (`make test-compat` leaves them out: they test kvshrink's kernels, not the transformers integration).
INTERPRETER_TEST_FILES = {"test_gpu_path.py", "test_lrqk_triton.py", "test_shard_triton.py", "test_kernel_selfcheck.py"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in INTERPRETER_TEST_FILES:
            item.add_marker(pytest.mark.interpreter)


_LOADED: dict = {}


def load_model_once(name_or_path=None, dtype=torch.float32, device=None):
    """``kvshrink.load_model``, each model, dtype and device loaded once per test session (a load from the
    converted GGUF folder still takes seconds). A cache leaves the model's weights and outputs as they were, so
    the tests and the CLI commands they run share it."""
    from kvshrink.models import load_model, model_dtype

    key = (None if name_or_path is None else str(name_or_path), model_dtype(dtype),
           None if device is None else str(device))
    if key not in _LOADED:
        _LOADED[key] = load_model(name_or_path, dtype=dtype, device=device)
    return _LOADED[key]


@pytest.fixture(scope="session", autouse=True)
def _one_load_per_model():
    import kvshrink

    with pytest.MonkeyPatch.context() as patch:   # session-wide: module fixtures load models too
        patch.setattr(kvshrink, "load_model", load_model_once)
        yield


@pytest.fixture(scope="session")
def real_model():
    """The embedded SmolLM2-135M-Instruct and its tokenizer (fp32, CPU)."""
    return load_model_once()


def tiny_model(family: str = "llama", seed: int = 0, **overrides):
    """A randomly initialised 2-layer decoder with GQA (4 query heads, 2 KV heads, head size 16)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    torch.manual_seed(seed)
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=0, eos_token_id=1, bos_token_id=2)
    common.update(overrides)
    if family == "llama":
        config = LlamaConfig(**common)
    elif family == "qwen2":
        config = Qwen2Config(**common)
    elif family == "qwen3":  # qk-norm
        common.setdefault("head_dim", 16)
        config = Qwen3Config(**common)
    elif family == "mistral":
        common.setdefault("sliding_window", None)
        config = MistralConfig(**common)
    else:
        raise ValueError(family)
    model = AutoModelForCausalLM.from_config(config)
    model.eval()
    return model


@pytest.fixture
def tiny():
    return tiny_model


def greedy(model, ids, mask, cache, new_tokens=8):
    """Greedy ``generate`` through ``cache``: ``(sequences, logits [B, new_tokens, vocab])``."""
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                             do_sample=False, output_logits=True, return_dict_in_generate=True,
                             pad_token_id=0, eos_token_id=None)
    return out.sequences, torch.stack(out.logits, dim=1)


def left_pad(rows: list[torch.Tensor]):
    """Left-padded ``(input_ids, attention_mask)`` of token rows of different lengths."""
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = r
        mask[i, width - len(r):] = 1
    return ids, mask


def prompts(lengths, seed=1):
    """Random token rows (ids 3..127) of the given lengths."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g) for n in lengths]


def assert_batch_rows_equal_alone(model, method: str, options: dict, lengths, new_tokens: int,
                                  atol: float, rtol: float, seed: int = 1) -> None:
    """A left-padded batch decodes each row exactly as that row decodes alone (tokens and logits)."""
    import kvshrink

    rows = prompts(lengths, seed=seed)
    ids, mask = left_pad(rows)
    seq, logits = greedy(model, ids, mask, kvshrink.make_cache(method, model, **options), new_tokens=new_tokens)
    for i, row in enumerate(rows):
        alone_seq, alone_logits = greedy(model, row[None], torch.ones(1, len(row), dtype=torch.long),
                                         kvshrink.make_cache(method, model, **options), new_tokens=new_tokens)
        assert torch.equal(seq[i, -new_tokens:], alone_seq[0, -new_tokens:]), f"row {i} differs"
        torch.testing.assert_close(logits[i], alone_logits[0], atol=atol, rtol=rtol)
