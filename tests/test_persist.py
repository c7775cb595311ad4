"""Fork, save and load of caches (cache/persist.py): one document, many questions."""

from __future__ import annotations

import copy
import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

import kvshrink
from kvshrink.cache.persist import CacheFileError, cache_from_bytes, cache_to_bytes, load_cache, read_metadata

from conftest import greedy, prompts, tiny_model

PREFIX, QUESTION, NEW = 96, 12, 6

# Options that make every method compress / evict / quantize inside the 96-token prefix of a tiny model.
METHODS = [
    ("full", {}),
    ("shard", {"sinks": 2, "window": 8, "min_block": 16, "v_codebook": 16, "salient_dtype": "int8"}),
    ("streaming", {"sinks": 2, "window": 16}),
    ("h2o", {"budget": 24}),
    ("scissorhands", {"budget": 24}),
    ("kivi", {"group": 16, "residual": 16}),
    ("turboquant", {"residual": 8}),
    ("lrqk", {"top_k": 16, "window": 8, "prefill_chunk": 32}),
]


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture(scope="module")
def tokens():
    prefix, question, other = prompts([PREFIX, QUESTION, QUESTION], seed=3)
    return prefix[None], question[None], other[None]


def prefilled(model, method, options, prefix):
    cache = kvshrink.make_cache(method, model, **options)
    with torch.no_grad():
        model(input_ids=prefix, past_key_values=cache)  # keyword: issue11 misses positional ids
    return cache


def answer(model, cache, prefix, question):
    """Greedy tokens and logits of ``question`` after a cache holding ``prefix``."""
    ids = torch.cat([prefix, question], dim=1)
    seq, logits = greedy(model, ids, torch.ones_like(ids), cache, new_tokens=NEW)
    return seq[:, ids.shape[1]:], logits


def state_bytes(cache) -> dict[str, torch.Tensor]:
    """Every tensor the cache's record holds, by its flat name (to check that a parent is untouched)."""
    from kvshrink.cache.record import flatten

    tensors: dict[str, torch.Tensor] = {}
    flatten(cache.to_record(), "", tensors)
    return tensors


# ----------------------------------------------------------------------------------------------- fork
@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
def test_fork_answers_equal_two_call_prefill_and_parent_is_unchanged(model, tokens, method, options):
    prefix, question, other = tokens
    parent = prefilled(model, method, options, prefix)
    before = state_bytes(parent)
    for make_copy in (lambda c: c.fork(), copy.deepcopy):
        for q in (question, other):
            got, got_logits = answer(model, make_copy(parent), prefix, q)
            want, want_logits = answer(model, prefilled(model, method, options, prefix), prefix, q)
            assert torch.equal(got, want)
            torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    after = state_bytes(parent)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert parent.get_seq_length() == PREFIX


def test_full_fork_answers_equal_fresh_prefill_of_prefix_and_question(model, tokens):
    prefix, question, _ = tokens
    parent = prefilled(model, "full", {}, prefix)
    got, _ = answer(model, parent.fork(), prefix, question)
    ids = torch.cat([prefix, question], dim=1)
    fresh, _ = greedy(model, ids, torch.ones_like(ids), kvshrink.make_cache("full", model), new_tokens=NEW)
    assert torch.equal(got, fresh[:, ids.shape[1]:])


def test_shard_fork_shares_compressed_blocks_and_copies_the_rest(model, tokens):
    prefix, question, _ = tokens
    parent = prefilled(model, "shard", METHODS[1][1], prefix)
    child = parent.fork()
    assert parent.layers[0].middle and child.layers[0].middle[0] is parent.layers[0].middle[0]
    assert child.layers[0].window is not parent.layers[0].window
    assert child.info is parent.info  # the model's rotary module is shared, not copied
    assert copy.deepcopy(parent).layers[0].middle[0] is not parent.layers[0].middle[0]


def test_lrqk_disk_tier_fork_gets_its_own_file(model, tokens, tmp_path):
    prefix, question, _ = tokens
    options = {**METHODS[-1][1], "slow_tier": "disk", "disk_folder": str(tmp_path)}
    parent = prefilled(model, "lrqk", options, prefix)
    child = parent.fork()
    assert child.layers[0].slow.path != parent.layers[0].slow.path
    got, _ = answer(model, child, prefix, question)
    want, _ = answer(model, prefilled(model, "lrqk", options, prefix), prefix, question)
    assert torch.equal(got, want)
    parent.layers[0].slow._check(0, parent.layers[0].slow.length)  # the parent's file is intact
    for c in (parent, child):
        c.close()


# ----------------------------------------------------------------------------------------------- save/load
@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
def test_loaded_cache_answers_equal_the_cache_before_saving(model, tokens, tmp_path, method, options):
    prefix, question, _ = tokens
    cache = prefilled(model, method, options, prefix)
    path = tmp_path / "doc.kvs"
    cache.save(path)
    loaded = load_cache(path, model)
    assert loaded.get_seq_length() == PREFIX and loaded.method == method
    got, got_logits = answer(model, loaded, prefix, question)
    want, want_logits = answer(model, cache, prefix, question)
    assert torch.equal(got, want)
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)


@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
def test_a_cache_saved_while_decoding_continues_from_its_bytes_as_the_cache_never_saved(model, tokens, method, options):
    """`cache_to_bytes` after a few decode steps (Shard's ring and stream, LRQK's slots in use), then
    `cache_from_bytes`: the next steps' logits are exactly those of the cache that was never saved."""
    prefix, question, _ = tokens
    cache = prefilled(model, method, options, prefix)
    steps = [torch.tensor([[t]]) for t in range(5, 5 + 2 * NEW)]
    with torch.no_grad():
        for step in steps[:NEW]:
            model(input_ids=step, past_key_values=cache)
        loaded = cache_from_bytes(cache_to_bytes(cache), model)
        assert loaded.get_seq_length() == cache.get_seq_length() == PREFIX + NEW
        for step in steps[NEW:]:
            want = model(input_ids=step, past_key_values=cache).logits
            got = model(input_ids=step, past_key_values=loaded).logits
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for c in (cache, loaded):
        c.close()


def test_the_file_names_no_class_and_holds_flat_tensor_names(model, tokens, tmp_path):
    cache = prefilled(model, "shard", METHODS[1][1], tokens[0])
    data = cache_to_bytes(cache)
    meta = kvshrink.cache.persist.read_metadata_bytes(data)
    assert meta["format_version"] == 3 and meta["method"] == "shard" and meta["tokens"] == PREFIX
    assert "layers.1.middle.0.v_codes" in meta["tensors"] and "layers.0.window.keys" in meta["tensors"]
    assert b"kvshrink.methods" not in data and b"ShardLayer" not in data and b"MiddleBlock" not in data
    cache.save(tmp_path / "doc.kvs")
    assert read_metadata(tmp_path / "doc.kvs")["tensors"] == meta["tensors"]


def test_loaded_cache_and_fork_refuse_a_prompt_that_does_not_begin_with_the_saved_prefix(model, tokens, tmp_path):
    prefix, question, _ = tokens
    prefilled(model, "shard", METHODS[1][1], prefix).save(tmp_path / "doc.kvs")
    loaded = load_cache(tmp_path / "doc.kvs", model)
    assert torch.equal(loaded.token_ids, prefix)
    other = prefix.clone()
    other[0, 40] = (other[0, 40] + 1) % 128
    for cache in (loaded.fork(), loaded):
        with pytest.raises(kvshrink.CacheReuseError, match="does not begin with them"):
            answer(model, cache, other, question)


@pytest.mark.parametrize("method,options", METHODS[:3], ids=[m for m, _ in METHODS[:3]])
def test_file_size_is_close_to_nbytes(model, tokens, tmp_path, method, options):
    cache = prefilled(model, method, options, torch.cat([tokens[0]] * 4, dim=1))
    path = tmp_path / "doc.kvs"
    cache.save(path, entropy=False)
    size = path.stat().st_size
    # the JSON structure is a few KiB whatever the length; at this tiny size allow it on top of 3%
    assert cache.nbytes() * 0.97 <= size <= cache.nbytes() * 1.03 + 64 * 1024, (size, cache.nbytes())


@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
def test_entropy_coded_file_is_smaller_and_loads_the_same_tensors(model, tokens, tmp_path, method, options):
    cache = prefilled(model, method, options, tokens[0])
    cache.save(tmp_path / "plain.kvs", entropy=False)
    cache.save(tmp_path / "coded.kvs")
    table = read_metadata(tmp_path / "coded.kvs")["tensors"]
    encodings = [n for n, t in table.items() if t["codec"]]
    sizes = [(tmp_path / name).stat().st_size for name in ("coded.kvs", "plain.kvs")]
    assert sizes[0] < sizes[1] if encodings else sizes[0] == sizes[1]  # a tensor is coded only if that pays
    # at this tiny size kivi's and Shard's tensors are each under file_codec.MIN_BYTES or too random to gain
    assert encodings or method in ("kivi", "shard")
    want = state_bytes(cache)
    for name in ("plain.kvs", "coded.kvs"):
        got = state_bytes(load_cache(tmp_path / name, model))
        assert got.keys() == want.keys()
        for key in want:
            assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), (name, key)


def test_hf_quantized_fork_and_save_are_refused_naming_it(model, tokens, tmp_path):
    pytest.importorskip("optimum.quanto")
    parent = prefilled(model, "hf-quantized", {"backend": "quanto", "group": 16, "residual": 16}, tokens[0])
    for attempt in (parent.fork, lambda: copy.deepcopy(parent)):
        with pytest.raises(NotImplementedError, match="'hf-quantized' cache cannot be copied, forked"):
            attempt()
    with pytest.raises(NotImplementedError, match="saving a 'hf-quantized' cache is not supported"):
        parent.save(tmp_path / "q.kvs")


# ----------------------------------------------------------------------------------------------- refusals
@pytest.fixture
def saved(model, tokens, tmp_path):
    """A Shard cache file whose largest tensors are entropy coded (a longer prefix than the others)."""
    cache = prefilled(model, "shard", METHODS[1][1], torch.cat([tokens[0]] * 4, dim=1))
    path = tmp_path / "doc.kvs"
    cache.save(path)
    return path


def test_missing_file_is_refused(model, tmp_path):
    with pytest.raises(FileNotFoundError, match="no cache file"):
        load_cache(tmp_path / "nothing.kvs", model)


def test_another_model_is_refused(saved):
    with pytest.raises(CacheFileError, match="made with another model"):
        load_cache(saved, tiny_model(seed=1))


def test_another_dtype_is_refused(saved):
    with pytest.raises(CacheFileError, match="made with the model in float32, this model is in bfloat16"):
        load_cache(saved, tiny_model().to(torch.bfloat16))


def _rewrite(path, change_meta=None, change_tensors=None, resign=True):
    """Rewrite a saved file's metadata and tensors; ``resign``: with a valid checksum (a well-formed file)."""
    import json

    from safetensors.torch import load_file, safe_open, save_file

    from kvshrink.cache.persist import _checksum

    with safe_open(str(path), framework="pt") as fh:
        metadata = fh.metadata()
    tensors = load_file(str(path))
    meta = json.loads(metadata["kvshrink"])
    if change_meta is not None:
        change_meta(meta)
    if change_tensors is not None:
        change_tensors(tensors, meta)
    metadata["kvshrink"] = json.dumps(meta, sort_keys=True)
    if resign:
        metadata["sha256"] = _checksum(metadata["kvshrink"], tensors)
    save_file(tensors, str(path), metadata=metadata)


@pytest.mark.parametrize("version", [2, 99])
def test_another_format_version_is_refused_naming_both(saved, version):
    _rewrite(saved, lambda m: m.update(format_version=version))  # a well-formed file of another version
    with pytest.raises(CacheFileError, match=f"written by cache format {version} .*this kvshrink .* reads format 3"):
        load_cache(saved, tiny_model())


def test_edited_metadata_is_refused_by_the_checksum(saved):
    _rewrite(saved, lambda m: m.update(tokens=1), resign=False)
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        load_cache(saved, tiny_model())


def test_truncated_file_is_refused(saved):
    data = saved.read_bytes()
    saved.write_bytes(data[: len(data) - 100])
    with pytest.raises(CacheFileError, match="truncated or corrupted"):
        load_cache(saved, tiny_model())
    with pytest.raises(CacheFileError, match="<bytes> is truncated or corrupted"):
        cache_from_bytes(data[:5], tiny_model())


def test_flipped_tensor_byte_is_refused(saved):
    data = bytearray(saved.read_bytes())
    data[-10] ^= 0x40  # in the last tensor's bytes
    saved.write_bytes(bytes(data))
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        load_cache(saved, tiny_model())


def _coded_tensor(path) -> str:
    """The name of the largest entropy-coded tensor in a cache file."""
    table = read_metadata(path)["tensors"]
    return max((name for name, t in table.items() if t["codec"]), key=lambda name: math.prod(table[name]["shape"]))


def test_corrupted_coded_payload_is_refused_by_the_checksum(saved):
    name = _coded_tensor(saved)

    def flip(tensors, meta):
        tensors[name][len(tensors[name]) // 2] ^= 0x21

    _rewrite(saved, change_tensors=flip, resign=False)
    with pytest.raises(CacheFileError, match="checksum mismatch"):
        load_cache(saved, tiny_model())


@pytest.mark.parametrize("damage", ["flip", "truncate", "shape"])
def test_coded_payload_that_does_not_decode_to_its_entry_is_refused_even_with_a_valid_checksum(saved, damage):
    """A file re-signed after its coded bytes or their entry changed: decoding itself refuses it."""
    name = _coded_tensor(saved)

    def change(tensors, meta):
        if damage == "shape":
            meta["tensors"][name]["shape"][-1] += 1
        elif damage == "flip":
            tensors[name][len(tensors[name]) // 2] ^= 0x21
        else:
            tensors[name] = tensors[name][:-4].clone()

    _rewrite(saved, change_tensors=change)
    with pytest.raises(CacheFileError, match=f"is corrupted: tensor '{name}'"):
        load_cache(saved, tiny_model())


# ---------------------------------------------------------------------------------------- the schema
def _largest(meta) -> str:
    return max(meta["tensors"], key=lambda name: math.prod(meta["tensors"][name]["shape"]))


def _missing(tensors, meta):
    """The largest tensor removed (and from the table), its record still naming it."""
    name = _largest(meta)
    del tensors[name], meta["tensors"][name]


def _extra(tensors, meta):
    """One tensor more, listed by its record (as a newer kvshrink with another field would write it)."""
    name = _largest(meta)
    record = meta["cache"]
    for part in name.split(".")[:-1]:
        record = record["parts"][part] if not part.isdigit() else record[int(part)]
    record["tensors"].append("bogus")
    bogus = name.rsplit(".", 1)[0] + ".bogus"
    tensors[bogus] = torch.zeros(3)
    meta["tensors"][bogus] = {"codec": None, "device": "cpu", "dtype": "float32", "shape": [3]}


def _reshaped(tensors, meta):
    """The largest tensor with one more leading dim."""
    name = _largest(meta)
    tensors[name] = tensors[name][None].clone()
    meta["tensors"][name]["shape"].insert(0, 1)


def _misshapen(tensors, meta):
    """A tensor one element wider in a dim its schema fixes (a window's keys: the head size)."""
    name = next(n for n in meta["tensors"] if n.endswith(("store.keys", "window.keys", "tail.keys", "win_k")))
    tensors[name] = torch.cat([tensors[name], tensors[name][..., :1]], dim=-1)
    meta["tensors"][name]["shape"][-1] += 1


def _extra_metadata(tensors, meta):
    meta["cache"]["parts"]["layers"][0]["meta"]["bogus"] = 1


def _missing_metadata(tensors, meta):
    del meta["cache"]["parts"]["layers"][0]["meta"]["seen"]


@pytest.mark.parametrize("damage,message", [
    (_missing, r"tensor layers\.\S+ is missing"),
    (_extra, r"layers\.\S+: tensors \['bogus'\] are not part of this kvshrink's schema"),
    (_reshaped, r"tensor layers\.\S+ has shape \[1, .*its schema says"),
    (_misshapen, r"tensor layers\.\S+ has shape \[.*, 17\], its schema says \[.*D\] with D=16"),
    (_extra_metadata, r"layers\.0: metadata \['bogus'\] is not part of this kvshrink's schema"),
    (_missing_metadata, r"layers\.0: metadata 'seen' is missing"),
], ids=["missing", "extra", "reshaped", "misshapen", "extra-metadata", "missing-metadata"])
@pytest.mark.parametrize("method,options", METHODS, ids=[m for m, _ in METHODS])
def test_a_file_that_does_not_match_the_methods_schema_is_refused_naming_the_tensor(model, tokens, tmp_path, method,
                                                                                   options, damage, message):
    """A well-formed, correctly signed file whose tensors or metadata are not what the method's schema says
    (a file of another kvshrink, or edited): refused, naming the tensor or field, before any step runs."""
    path = tmp_path / "doc.kvs"
    prefilled(model, method, options, tokens[0]).save(path, entropy=False)
    _rewrite(path, change_tensors=damage)
    with pytest.raises(CacheFileError, match=f"does not match this kvshrink's '{method}' cache schema: {message}"):
        load_cache(path, model)


def test_writer_killed_mid_write_keeps_the_old_file_under_the_final_name(model, tokens, tmp_path):
    """kill -9 while a save is on its way to disk: the final name still holds the previous, loadable file."""
    final = tmp_path / "doc.kvs"
    prefilled(model, "full", {}, tokens[0]).save(final)
    old = final.read_bytes()
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        from conftest import tiny_model
        import kvshrink
        model = tiny_model()
        cache = kvshrink.make_cache("full", model)
        with torch.no_grad():
            model(torch.randint(3, 100, (1, 40)), past_key_values=cache)
        def stall(fd):  # the bytes are written, the file is not yet in place: be killed here
            print("writing", flush=True)
            time.sleep(60)
        os.fsync = stall
        cache.save({str(final)!r})
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.readline().strip() == b"writing"
        assert any(p.name.endswith(".tmp") and p.stat().st_size > 0 for p in tmp_path.iterdir())
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert final.read_bytes() == old
    assert load_cache(final, model).get_seq_length() == PREFIX


@pytest.mark.parametrize("method,options", [m for m in METHODS if m[0] in ("shard", "lrqk")], ids=["shard", "lrqk"])
def test_a_batch_whose_rows_are_compressed_apart_saves_loads_and_resets(model, method, options, tmp_path):
    """Shard and LRQK give each row of a batch its own layers (cache/rowwise.py): that structure is
    saved and loaded like any other, and ``reset`` returns to one set of layers for the next prompt."""
    from conftest import left_pad

    ids, mask = left_pad(prompts([PREFIX, PREFIX - 20], seed=5))
    cache = kvshrink.make_cache(method, model, **options)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    cache.save(tmp_path / "batch.kvs")
    loaded = load_cache(tmp_path / "batch.kvs", model)
    assert loaded.nbytes() == cache.nbytes()
    step = torch.tensor([[5], [6]])
    mask = torch.cat([mask, torch.ones_like(step)], dim=1)
    with torch.no_grad():
        want = model(input_ids=step, attention_mask=mask, past_key_values=cache).logits
        got = model(input_ids=step, attention_mask=mask, past_key_values=loaded).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    cache.reset()
    assert not hasattr(cache.layers[0], "rows")
    prefix, question, _ = prompts([PREFIX, QUESTION, QUESTION], seed=3)
    alone = prefilled(model, method, options, prefix[None])
    with torch.no_grad():
        model(input_ids=prefix[None], past_key_values=cache)
    assert cache.nbytes() == alone.nbytes()
    for c in (cache, loaded, alone):
        c.close()


# ----------------------------------------------------------------------------------------------- model identity
def test_the_fingerprint_changes_with_any_one_weight_tensor_and_nothing_else(model):
    """Every weight tensor of every layer is covered: a small perturbation of any one tensor, or a change of
    its first element (always in the sample), gives another fingerprint; a copy of the model, and running
    it, give the same one."""
    from kvshrink.identity import model_fingerprint

    copy_ = copy.deepcopy(model)
    base = model_fingerprint(copy_)
    with torch.no_grad():
        copy_(torch.randint(3, 100, (1, 8)))
    assert model_fingerprint(copy_) == base
    names = [name for name, _ in copy_.named_parameters()]
    assert any(".layers.1.mlp." in name for name in names)
    for name, p in copy_.named_parameters():
        with torch.no_grad():
            held = p.clone()
            p.add_(torch.randn_like(p) * 1e-3)
            assert model_fingerprint(copy_) != base, name
            p.copy_(held)
            p.view(-1)[0] += 1e-3
            assert model_fingerprint(copy_) != base, name
            p.copy_(held)
    assert model_fingerprint(copy_) == base


def test_a_saved_cache_is_refused_by_the_model_with_one_layers_mlp_weights_perturbed(model, tokens, tmp_path):
    path = tmp_path / "doc.kvs"
    prefilled(model, "full", {}, tokens[0]).save(path)
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[1].mlp.down_proj.weight.add_(torch.randn_like(tuned.model.layers[1].mlp.down_proj.weight)
                                                        * 1e-4)
    with pytest.raises(CacheFileError, match="made with another model"):
        load_cache(path, tuned)
    assert load_cache(path, model).get_seq_length() == PREFIX


def test_a_shard_cache_saved_while_decoding_keeps_its_stream_and_centre(model, tokens, tmp_path):
    """Tokens that left the window while decoding are held in Shard's stream, coded less a centre: a cache saved
    then loads with the same codes and centre and decodes on as the cache it was saved from."""
    prefix, question, _ = tokens
    options = dict(METHODS[1][1])
    cache = prefilled(model, "shard", options, prefix)
    with torch.no_grad():
        for token in question[0]:           # one decode step a token: each pushes one token into the stream
            model(input_ids=token.view(1, 1), past_key_values=cache)
    stream = cache.layers[0].stream
    assert stream.n == QUESTION and stream.centre is not None and stream.centre.shape[0] == 2
    cache.save(tmp_path / "decoding.kvs")
    loaded = load_cache(tmp_path / "decoding.kvs", model)
    # (the blocks' decode-time derived parts are not saved: the stream's bytes are compared)
    assert loaded.layers[0].breakdown()["stream"] == cache.layers[0].breakdown()["stream"]
    torch.testing.assert_close(loaded.layers[0].stream.centre, stream.centre, rtol=0, atol=0)
    with torch.no_grad():
        for token in (7, 9, 11):
            step = torch.tensor([[token]])
            want = model(input_ids=step, past_key_values=cache).logits
            got = model(input_ids=step, past_key_values=loaded).logits
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    for c in (cache, loaded):
        c.close()
