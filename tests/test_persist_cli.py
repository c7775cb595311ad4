"""`kvshrink compress`, `generate --cache` and `ask` on the embedded model (one document, many questions)."""

from __future__ import annotations

import pytest
import torch

import kvshrink
from kvshrink.cli import answer_from, document_prompt, main, prefill, question_ids

from conftest import tiny_model

pytestmark = pytest.mark.model

DOCUMENT = """The Hartwell lease is made between Northgate Properties Ltd (the landlord) and Mira Okafor (the tenant).
The flat is at 14 Alder Street, Leeds. The monthly rent is 925 pounds, due on the third day of each month.
The deposit is 1,100 pounds. The lease runs for eighteen months from 1 March 2025.
Pets are allowed only with written consent; the tenant has declared one cat named Biscuit.
The landlord repairs the boiler and the roof; the tenant keeps the garden tidy.
""" * 3
QUESTIONS = ["What is the monthly rent?", "Who repairs the boiler?"]
SHARD = "window=32"  # the ~400-token document then has a compressed middle


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("doc")
    (folder / "doc.txt").write_text(DOCUMENT)
    (folder / "q.txt").write_text("\n".join(QUESTIONS) + "\n")
    assert main(["compress", "--method", "shard", "--option", SHARD, "--prompt-file", str(folder / "doc.txt"),
                 "--out", str(folder / "doc.kvs")]) == 0
    return folder


def test_compress_prints_bytes_and_ratio(files, capsys):
    main(["compress", "--method", "shard", "--option", SHARD, "--prompt-file", str(files / "doc.txt"),
          "--out", str(files / "again.kvs")])
    out = capsys.readouterr().out
    size = (files / "again.kvs").stat().st_size
    assert f"{size:,} bytes on disk" in out and "ratio" in out


def test_compress_codes_the_file_unless_told_not_to(files, capsys):
    from kvshrink.cache.persist import read_metadata

    main(["compress", "--method", "shard", "--option", SHARD, "--prompt-file", str(files / "doc.txt"),
          "--out", str(files / "plain.kvs"), "--no-entropy"])
    assert "saved as in memory" in capsys.readouterr().out
    assert not any(t["codec"] for t in read_metadata(files / "plain.kvs")["tensors"].values())
    assert any(t["codec"] for t in read_metadata(files / "doc.kvs")["tensors"].values())
    assert (files / "doc.kvs").stat().st_size < 0.97 * (files / "plain.kvs").stat().st_size


def test_ask_answers_from_forks_equal_fresh_prefills(files, capsys, real_model):
    """Each answer of `ask` (a fork of the loaded file) is the answer of a fresh Shard prefill of the
    document followed by the question, the chat template applied once around both."""
    assert main(["ask", str(files / "doc.kvs"), "--questions", str(files / "q.txt"), "--max-new-tokens", "12",
                 "--no-baseline"]) == 0
    out = capsys.readouterr().out
    model, tokenizer = real_model
    prefix, template = document_prompt(tokenizer, DOCUMENT)
    for i, question in enumerate(QUESTIONS, 1):
        cache = kvshrink.make_cache("shard", model, window=32)
        prefill(model, cache, torch.tensor([prefix]), 8192)
        want, _ = answer_from(model, tokenizer, cache, prefix, question_ids(tokenizer, template, question), 12)
        assert f"A{i}: {want}\n" in out
    assert "time to first token" in out


def test_question_goes_inside_the_user_turn_of_the_chat_template(real_model):
    _, tokenizer = real_model
    prefix, template = document_prompt(tokenizer, DOCUMENT)
    joined = tokenizer.decode(prefix + question_ids(tokenizer, template, "Who repairs the boiler?"))
    whole = tokenizer.apply_chat_template([{"role": "user", "content": DOCUMENT + "\n\nWho repairs the boiler?"}],
                                          tokenize=False, add_generation_prompt=True)
    assert joined == whole


def test_generate_from_cache_answers(files, capsys):
    assert main(["generate", "--cache", str(files / "doc.kvs"), "--prompt", "What is the monthly rent?",
                 "--max-new-tokens", "12"]) == 0
    assert "loaded in" in capsys.readouterr().out


def test_generate_from_cache_refuses_another_model(files, tmp_path, capsys):
    model = tiny_model()
    cache = kvshrink.make_cache("full", model)
    with torch.no_grad():
        model(torch.randint(3, 100, (1, 10)), past_key_values=cache)
    from kvshrink.cache.persist import save_cache

    save_cache(cache, tmp_path / "tiny.kvs", extra={"question_template": "{question}"})
    assert main(["generate", "--cache", str(tmp_path / "tiny.kvs"), "--prompt", "hi"]) == 2
    assert "made with another model" in capsys.readouterr().err


def test_ask_refuses_a_file_not_from_compress_and_a_missing_file(files, tmp_path, capsys):
    model = tiny_model()
    cache = kvshrink.make_cache("full", model)
    cache.save(tmp_path / "plain.kvs")
    assert main(["ask", str(tmp_path / "plain.kvs"), "--questions", str(files / "q.txt")]) == 2
    assert "not written by `kvshrink compress`" in capsys.readouterr().err
    assert main(["ask", str(tmp_path / "none.kvs"), "--questions", str(files / "q.txt")]) == 2
    assert "no cache file" in capsys.readouterr().err
