"""A GGUF file converted once into a folder: later loads give the same model and tokenizer, and a damaged,
partial or foreign folder is never used (a damaged one is replaced whole by the next conversion)."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

from kvshrink import gguf_conversion
from kvshrink.gguf_conversion import (
    MANIFEST, conversion_key, conversion_root, file_sha256, verified, write_conversion)
from kvshrink.identity import model_fingerprint
from kvshrink.models import embedded_model_path, load_model

from conftest import tiny_model

pytestmark = pytest.mark.model


def _same_weights(a, b) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k].to(sa[k].dtype)) for k in sa)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """The embedded model loaded from its GGUF file into an empty conversion folder (which that load writes)."""
    root = tmp_path_factory.mktemp("converted")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSHRINK_MODEL_CACHE", str(root))
        model, tokenizer = load_model()
    sha = file_sha256(embedded_model_path())
    return root, root / conversion_key(sha), sha, model, tokenizer


def test_a_converted_gguf_loads_the_same_model_and_tokenizer(converted, monkeypatch):
    root, folder, sha, from_gguf, gguf_tokenizer = converted
    assert verified(folder, sha) and not any(p.name.startswith(".") for p in root.iterdir())
    monkeypatch.setenv("KVSHRINK_MODEL_CACHE", str(root))
    model, tokenizer = load_model()
    assert getattr(model.config, "quantization_config", None) is None   # read from the folder: a GGUF load adds one
    assert _same_weights(from_gguf, model) and model_fingerprint(model) == model_fingerprint(from_gguf)
    assert model.config._name_or_path == from_gguf.config._name_or_path
    ids = gguf_tokenizer("def f(x):\n    return x ** 2  # ünïcode ✓", return_tensors="pt").input_ids
    assert torch.equal(tokenizer("def f(x):\n    return x ** 2  # ünïcode ✓", return_tensors="pt").input_ids, ids)
    chat = [{"role": "user", "content": "Which city?"}]
    assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        gguf_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert tokenizer.pad_token_id == gguf_tokenizer.pad_token_id is not None
    assert model.generation_config.eos_token_id == from_gguf.generation_config.eos_token_id
    with torch.no_grad():
        assert torch.equal(model(ids).logits, from_gguf(ids).logits)
    half, _ = load_model(dtype="bfloat16")   # a 16-bit load casts the float32 weights, as a GGUF load does
    assert next(half.parameters()).dtype == torch.bfloat16
    assert all(torch.equal(p.to(torch.bfloat16), q) for p, q in zip(from_gguf.parameters(), half.parameters()))


def test_a_folder_this_transformers_cannot_read_falls_back_to_the_gguf_file(converted, tmp_path, monkeypatch):
    """A whole, verified folder that transformers refuses (here: a model type it does not know) is not the end
    of the load: the GGUF file itself is read, with a warning naming the folder."""
    _, folder, sha, from_gguf, _ = converted
    unreadable = tmp_path / folder.name
    shutil.copytree(folder, unreadable)
    config = json.loads((unreadable / "config.json").read_text())
    (unreadable / "config.json").write_text(json.dumps({**config, "model_type": "no-such-architecture"}))
    manifest = json.loads((unreadable / MANIFEST).read_text())
    manifest["files"]["config.json"] = file_sha256(unreadable / "config.json")
    (unreadable / MANIFEST).write_text(json.dumps(manifest))
    assert verified(unreadable, sha)
    monkeypatch.setenv("KVSHRINK_MODEL_CACHE", str(tmp_path))
    with pytest.warns(UserWarning, match=f"converted folder {unreadable} did not load"):
        model, _ = load_model()
    assert _same_weights(from_gguf, model)


def test_verified_refuses_partial_foreign_and_damaged_folders(converted, tmp_path):
    _, folder, sha, _, _ = converted
    manifest = json.loads((folder / MANIFEST).read_text())
    assert set(manifest["files"]) >= {"model.safetensors", "config.json", "tokenizer.json"}
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert not verified(folder, "0" * 64)                       # another GGUF file's content
    assert not verified(tmp_path, sha)                          # no manifest: a writer that never finished
    partial = tmp_path / "partial"
    partial.mkdir()
    (partial / MANIFEST).write_text(json.dumps(manifest))       # a manifest whose files are missing
    assert not verified(partial, sha)
    (partial / MANIFEST).write_text(json.dumps({**manifest, "format": 0}))
    assert not verified(partial, sha)
    (partial / MANIFEST).write_text("{not json")
    assert not verified(partial, sha)


def test_where_conversions_live(monkeypatch, tmp_path):
    monkeypatch.setenv("KVSHRINK_MODEL_CACHE", "off")
    assert conversion_root() is None
    monkeypatch.setenv("KVSHRINK_MODEL_CACHE", str(tmp_path / "x"))
    assert conversion_root() == tmp_path / "x"
    monkeypatch.delenv("KVSHRINK_MODEL_CACHE")
    monkeypatch.setenv("KVSHRINK_CACHE_HOME", str(tmp_path / "home"))
    assert conversion_root() == tmp_path / "home" / "converted"
    monkeypatch.delenv("KVSHRINK_CACHE_HOME")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert conversion_root() == tmp_path / "kvshrink" / "converted"


def test_writers_leave_one_whole_folder_and_remove_abandoned_ones(real_model, tmp_path):
    _, tokenizer = real_model
    model = tiny_model("llama")
    abandoned = tmp_path / ".key.killed-writer"
    abandoned.mkdir(parents=True)
    (abandoned / "model.safetensors").write_bytes(b"half")
    old = time.time() - gguf_conversion.ABANDONED_S - 60
    os.utime(abandoned, (old, old))
    recent = tmp_path / ".key.writing-now"
    recent.mkdir()
    first = write_conversion(tmp_path, "key", "a" * 64, model, tokenizer)
    assert first == tmp_path / "key" and verified(first, "a" * 64)
    assert not abandoned.exists() and recent.exists()           # a writer still at work keeps its folder
    second = write_conversion(tmp_path, "key", "a" * 64, tiny_model("llama", seed=1), tokenizer)
    assert second == first and verified(first, "a" * 64)        # the first whole copy stays
    assert sorted(p.name for p in tmp_path.iterdir()) == [".key.writing-now", "key"]
    kept = (first / "model.safetensors").read_bytes()
    weights = first / "model.safetensors"
    weights.write_bytes(kept[:-1] + bytes([kept[-1] ^ 1]))      # damaged: the next writer replaces it whole
    assert not verified(first, "a" * 64)
    assert write_conversion(tmp_path, "key", "a" * 64, tiny_model("llama", seed=1), tokenizer) == first
    assert verified(first, "a" * 64) and weights.read_bytes() != kept
    assert sorted(p.name for p in tmp_path.iterdir()) == [".key.writing-now", "key"]
