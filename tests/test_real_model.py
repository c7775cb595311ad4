"""The framework on the embedded SmolLM2-135M-Instruct: exactness against DynamicCache, and the CLI."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

import kvshrink
from kvshrink.cli import chat_input_ids, main

pytestmark = pytest.mark.model

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")


def needle_prompt(repeats: int, value: str = "4817293", depth: float = 0.5) -> str:
    sentences = [FILLER] * repeats
    sentences.insert(int(repeats * depth), f"The special magic number for Lisbon is: {value}. ")
    return ("".join(sentences) + "\n\nWhat is the special magic number for Lisbon? "
            "Answer with the number only.")


def test_full_matches_dynamic_cache_on_the_real_model(real_model):
    model, tok = real_model
    enc = chat_input_ids(tok, needle_prompt(60))
    assert enc["input_ids"].shape[1] > 1024

    def run(cache):
        with torch.no_grad():
            return model.generate(**enc, past_key_values=cache, max_new_tokens=32, min_new_tokens=32,
                                  do_sample=False, output_logits=True, return_dict_in_generate=True,
                                  pad_token_id=tok.pad_token_id)

    ref, got = run(DynamicCache()), run(kvshrink.make_cache("full", model))
    assert torch.equal(ref.sequences, got.sequences)
    diff = max((a - b).abs().max().item() for a, b in zip(ref.logits, got.logits))
    assert diff < 1e-4, f"logits differ by {diff}"


def test_cli_generate_answers_a_needle_prompt(tmp_path, capsys):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text(needle_prompt(12, value="7305518"))
    assert main(["generate", "--method", "full", "--prompt-file", str(prompt), "--max-new-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "7305518" in out
    assert "ratio" in out and "tokens" in out


def test_cli_rejects_unknown_option_before_loading(capsys):
    assert main(["generate", "--method", "streaming", "--option", "windoww=3", "--prompt", "hi"]) == 2
    assert "valid options" in capsys.readouterr().err
