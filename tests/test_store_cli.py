"""`kvshrink compress --store`, `ask --store` and `generate --store` on the embedded model, through a
store folder (the default backend): one prefill, then every command answers from the stored entry."""

from __future__ import annotations

import pytest

from kvshrink.cli import main

pytestmark = pytest.mark.model

DOCUMENT = """The Hartwell lease is made between Northgate Properties Ltd (the landlord) and Mira Okafor (the tenant).
The flat is at 14 Alder Street, Leeds. The monthly rent is 925 pounds, due on the third day of each month.
The deposit is 1,100 pounds. Pets are allowed only with written consent; the tenant has one cat named Biscuit.
""" * 3
QUESTION = "What is the monthly rent?"
KIVI = ["--method", "kivi", "--option", "residual=32"]


def test_compress_ask_generate_through_a_store(tmp_path, capsys):
    doc, questions, store = tmp_path / "doc.txt", tmp_path / "q.txt", str(tmp_path / "store")
    doc.write_text(DOCUMENT)
    questions.write_text(QUESTION + "\n")
    assert main(["compress", *KIVI, "--prompt-file", str(doc), "--store", store, "--out", str(tmp_path / "d.kvs")]) == 0
    out = capsys.readouterr().out
    assert "computed" in out and "bytes stored (chunks + manifest)" in out
    file_bytes = (tmp_path / "d.kvs").stat().st_size
    stored = int(out.split(" bytes stored")[0].rsplit(", ", 1)[1].replace(",", ""))
    assert file_bytes < stored < file_bytes + 4096  # the file's bytes plus a small manifest

    assert main(["compress", *KIVI, "--prompt-file", str(doc), "--store", store]) == 0
    assert "hit" in capsys.readouterr().out  # stored once: the second compress prefills nothing

    assert main(["ask", "--store", store, "--document", str(doc), *KIVI, "--questions", str(questions),
                 "--max-new-tokens", "8"]) == 0
    captured = capsys.readouterr()
    assert "hit in" in captured.err and "same answer: True" in captured.out
    from_ask = captured.out.split("A1: ")[1].splitlines()[0]

    assert main(["generate", "--store", store, "--document", str(doc), *KIVI, "--prompt", QUESTION,
                 "--max-new-tokens", "8", "--quiet-summary"]) == 0
    captured = capsys.readouterr()
    assert "hit in" in captured.err and captured.out.strip() == from_ask

    # a plain prompt: the longest stored prefix (none here: another template), then a prefill of the rest
    assert main(["generate", "--store", store, *KIVI, "--prompt", QUESTION, "--max-new-tokens", "4"]) == 0
    assert "0 of" in capsys.readouterr().err


def test_store_arguments_are_checked(tmp_path, capsys):
    assert main(["compress", "--prompt-file", str(tmp_path / "x.txt")]) == 2
    assert "--out FILE, --store URL" in capsys.readouterr().err
    (tmp_path / "q.txt").write_text("Why?\n")
    assert main(["ask", "--store", str(tmp_path / "s"), "--questions", str(tmp_path / "q.txt")]) == 2
    assert "--store needs --document" in capsys.readouterr().err
    assert main(["ask", "--questions", str(tmp_path / "q.txt")]) == 2
    assert "give the cache FILE or --store" in capsys.readouterr().err
    assert main(["generate", "--prompt", "hi", "--document", str(tmp_path / "q.txt")]) == 2
    assert "--document goes with --store" in capsys.readouterr().err
