"""`calibrate_shard`: the cheapest ladder rung within a KL budget, measured on the calibration text."""

from __future__ import annotations

import re

import pytest
import torch

import kvshrink
from kvshrink.methods.shard.config import ShardConfig
from kvshrink.methods.shard.sensitivity import (
    LADDER, LADDER_OPTIONS, PREFIX_TOKENS, calibrate_shard, calibration_text, continuation_logprobs, kl_per_token)
from conftest import tiny_model


@pytest.fixture(scope="module")
def tokenizer(real_model):
    return real_model[1]


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random model over the embedded tokenizer's vocabulary, long enough for the calibration text."""
    return tiny_model(vocab_size=len(tokenizer), max_position_embeddings=4096)


def test_ladder_names_shard_options_cheapest_first(model, tokenizer):
    assert LADDER_OPTIONS <= set(ShardConfig.__dataclass_fields__)
    assert all(set(rung) == LADDER_OPTIONS for rung in LADDER)  # every rung sets every option the ladder owns
    ids = tokenizer(calibration_text(), add_special_tokens=False, return_tensors="pt")["input_ids"][:, :PREFIX_TOKENS]
    ratios = []
    for rung in LADDER:
        cache = kvshrink.make_cache("shard", model, evict=0, **rung)
        with torch.no_grad():
            model(ids, past_key_values=cache, use_cache=True)
        ratios.append(cache.compression_ratio())
    assert ratios == sorted(ratios, reverse=True)


def test_a_loose_budget_takes_the_cheapest_rung_after_one_try(model, tokenizer):
    calibration = calibrate_shard(model, tokenizer, kl_budget=1e9, pca_scope="layer")
    assert calibration.options == {"pca_scope": "layer", **LADDER[0]}
    assert [rung for rung, _ in calibration.tried] == [LADDER[0]]


@pytest.fixture(scope="module")
def every_rung(model, tokenizer):
    """A calibration whose budget no rung meets: every rung tried, the last one chosen."""
    return calibrate_shard(model, tokenizer, kl_budget=1e-12, key_bits="1.5")


def test_a_budget_nothing_meets_falls_back_to_the_last_rung(every_rung):
    assert [rung for rung, _ in every_rung.tried] == list(LADDER)
    assert every_rung.options == {"key_bits": "1.5", **LADDER[-1]}
    assert all(kl > 1e-12 for _, kl in every_rung.tried)


def test_the_budget_splits_at_the_cheapest_rungs_kl(model, tokenizer, every_rung):
    cheapest_kl = every_rung.tried[0][1]
    within = calibrate_shard(model, tokenizer, kl_budget=cheapest_kl * 1.001, key_bits="1.5")
    beyond = calibrate_shard(model, tokenizer, kl_budget=cheapest_kl * 0.999, key_bits="1.5")
    assert within.options == {"key_bits": "1.5", **LADDER[0]} and len(within.tried) == 1
    # beyond it, the next rungs in order until one is within (the last when none is)
    taken = next((i for i, (_, kl) in enumerate(every_rung.tried) if kl <= cheapest_kl * 0.999), len(LADDER) - 1)
    assert [rung for rung, _ in beyond.tried] == list(LADDER[:taken + 1])
    assert [kl for _, kl in beyond.tried] == pytest.approx([kl for _, kl in every_rung.tried[:taken + 1]], rel=1e-6)
    assert beyond.options == {"key_bits": "1.5", **LADDER[taken]}
    assert within.tried[0][1] == pytest.approx(cheapest_kl, rel=1e-6)  # the same measurement each time


def test_the_reported_kl_is_the_chosen_caches(model, tokenizer, every_rung):
    ids = tokenizer(calibration_text(), add_special_tokens=False, return_tensors="pt")["input_ids"]
    prefix, continuation = ids[:, :PREFIX_TOKENS], ids[:, PREFIX_TOKENS:PREFIX_TOKENS + 256]
    from transformers import DynamicCache

    reference = continuation_logprobs(model, prefix, continuation, DynamicCache())
    cache = kvshrink.make_cache("shard", model, **every_rung.options, evict=0)
    measured = kl_per_token(reference, continuation_logprobs(model, prefix, continuation, cache))
    assert measured == pytest.approx(every_rung.tried[-1][1], rel=1e-5)
    assert kl_per_token(reference, reference) == 0.0


def test_the_callers_options_are_kept_and_not_mutated(model, tokenizer):
    options = {"evict": "0.2", "v_centre": "true"}
    calibration = calibrate_shard(model, tokenizer, kl_budget=1e9, **options)
    assert options == {"evict": "0.2", "v_centre": "true"}
    assert calibration.options["evict"] == "0.2"
    assert calibration.spec.startswith("shard:evict=0.2,v_centre=true,window=")
    method, parsed = kvshrink.parse_method_spec(calibration.spec)
    kvshrink.make_cache(method, model, **parsed)  # the spec is a valid method spec


@pytest.mark.parametrize("kwargs, message", [
    (dict(kl_budget=0), "kl_budget must be a KL above 0"),
    (dict(kl_budget=0.01, cold=0.2), "calibrate_shard chooses .*; do not pass cold$"),
    (dict(kl_budget=0.01, colour=1), "unknown option"),
    (dict(kl_budget=0.01, key_bits="many"), "key_bits"),
])
def test_bad_input_fails_before_any_forward(model, tokenizer, kwargs, message):
    calls = []
    hook = model.register_forward_pre_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(ValueError, match=message):
            calibrate_shard(model, tokenizer, **kwargs)
    finally:
        hook.remove()
    assert not calls


def test_the_cli_prints_the_chosen_spec(model, tokenizer, every_rung, monkeypatch, capsys):
    from kvshrink.cli import main

    monkeypatch.setattr(kvshrink, "load_model", lambda *args, **kwargs: (model, tokenizer))
    assert main(["calibrate", "--kl-budget", "1e-12", "--option", "key_bits=1.5"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == "shard:key_bits=1.5," + ",".join(f"{k}={v}" for k, v in LADDER[-1].items())
    assert err.count("beyond the budget") == len(LADDER)
    assert f"KL {every_rung.tried[0][1]:.5f} nats" in err


@pytest.mark.parametrize("argv, message", [
    (["--kl-budget", "-1"], "kl_budget must be a KL above 0"),
    (["--option", "kl_budget=0.02"], "its own argument"),
    (["--option", "window=8"], "do not pass window$"),
])
def test_the_cli_refuses_bad_input_before_loading_a_model(monkeypatch, capsys, argv, message):
    from kvshrink.cli import main

    monkeypatch.setattr(kvshrink, "load_model", lambda *args, **kwargs: pytest.fail("loaded a model"))
    assert main(["calibrate", *argv]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.fixture()
def model_with_tokenizer(tokenizer):
    """A fresh tiny model (nothing remembered for it yet) carrying the tokenizer, as `load_model` leaves one."""
    model = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=4096)
    model.kvshrink_tokenizer = tokenizer
    return model


def _forwards_to_make(model, **options) -> int:
    forwards = []
    hook = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        kvshrink.make_cache("shard", model, **options)
    finally:
        hook.remove()
    return len(forwards)


def test_the_chosen_rung_is_stored_for_the_next_process(model_with_tokenizer, tokenizer, tmp_path, monkeypatch):
    """Another process (here: another object of the same model) reads the stored rung and measures nothing; a
    damaged entry, another budget or another model measures again."""
    monkeypatch.setenv("KVSHRINK_CACHE_HOME", str(tmp_path))
    measure = 2 * (1 + len(LADDER))
    assert _forwards_to_make(model_with_tokenizer, kl_budget=1e-12) == measure
    (entry,) = (tmp_path / "calibrations").iterdir()

    def same_model():
        twin = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=4096)
        twin.kvshrink_tokenizer = tokenizer
        return twin

    assert _forwards_to_make(same_model(), kl_budget=1e-12) == 0
    assert _forwards_to_make(same_model(), kl_budget=1e-12, key_bits=2) == measure  # other options
    assert _forwards_to_make(same_model(), kl_budget=1e-12, evict=0.5, ratio=12) == 0  # ones rungs are measured without
    assert _forwards_to_make(same_model(), kl_budget=2e-12) == measure               # another budget
    other = tiny_model(seed=1, vocab_size=len(tokenizer), max_position_embeddings=4096)
    other.kvshrink_tokenizer = tokenizer
    assert _forwards_to_make(other, kl_budget=1e-12) == measure
    entry.write_text(entry.read_text().replace('"window": 32', '"window": 33'))   # damaged: checksum fails
    assert _forwards_to_make(same_model(), kl_budget=1e-12) == measure
    assert _forwards_to_make(same_model(), kl_budget=1e-12) == 0                     # and stored again


def test_kl_budget_chooses_the_rung_once_per_model_and_records_it(model_with_tokenizer, tokenizer, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("KVSHRINK_CACHE_HOME", str(tmp_path))
    model = model_with_tokenizer
    forwards = []
    hook = model.register_forward_pre_hook(lambda *args: forwards.append(1))
    try:
        cache = kvshrink.make_cache("shard", model, kl_budget=1e-12, key_bits=1.5)
        measured = len(forwards)
        again = kvshrink.make_cache("shard", model, kl_budget=1e-12, key_bits=1.5)
    finally:
        hook.remove()
    assert measured == 2 * (1 + len(LADDER))  # full and each rung: a prefill and a teacher-forced continuation
    assert len(forwards) == measured          # remembered: no forward the second time
    for made in (cache, again):
        assert {k: made.options[k] for k in LADDER_OPTIONS} == LADDER[-1] and made.options["kl_budget"] == 0
        assert made.options["key_bits"] == 1.5
    ids = tokenizer("def f(x):\n    return x" * 40, return_tensors="pt")["input_ids"][:, :300]
    with torch.no_grad():
        model(ids, past_key_values=cache, use_cache=True)
    cache.save(tmp_path / "doc.kvs")
    loaded = kvshrink.load_cache(tmp_path / "doc.kvs", model)  # the saved options are the chosen ones
    assert loaded.options == cache.options


def test_the_ladder_options_default_to_the_careful_rung():
    """Naming one ladder option keeps the others at the fallback rung's values, not at cheaper ones."""
    defaults = ShardConfig()
    assert {name: getattr(defaults, name) for name in LADDER_OPTIONS} == LADDER[-1]
    assert defaults.kl_budget > 0  # the default cache calibrates


@pytest.mark.parametrize("named", [dict(window=8), dict(window=64, cold=0.0)])  # defaults named are choices too
def test_kl_budget_named_with_a_ladder_option_is_refused(model_with_tokenizer, named):
    with pytest.raises(ValueError, match=f"shard: kl_budget chooses .*; do not pass {', '.join(sorted(named))}$"):
        kvshrink.make_cache("shard", model_with_tokenizer, kl_budget=0.01, **named)
    kvshrink.make_cache("shard", model_with_tokenizer, kl_budget=0, **named)  # without the budget they are fine


@pytest.mark.parametrize("named", [dict(window=8), dict(cold=0.0, observe=128)])
def test_a_ladder_option_named_alone_turns_the_default_budget_off(model_with_tokenizer, named):
    forwards = _forwards_to_make(model_with_tokenizer, **named)
    cache = kvshrink.make_cache("shard", model_with_tokenizer, **named)
    assert forwards == 0 and cache.options["kl_budget"] == 0
    assert {k: cache.options[k] for k in LADDER_OPTIONS} == {**LADDER[-1], **named}


def test_without_a_tokenizer_the_careful_rung_is_used_with_a_warning(tokenizer):
    bare = tiny_model(vocab_size=len(tokenizer), max_position_embeddings=4096)
    for options in (dict(), dict(kl_budget=0.05)):
        with pytest.warns(UserWarning, match="has no tokenizer .* using the careful setting window=32"):
            forwards = _forwards_to_make(bare, **options)
        made = kvshrink.make_cache("shard", bare, **options)  # remembered for the model: no second warning
        assert forwards == 0
        assert {k: made.options[k] for k in LADDER_OPTIONS} == LADDER[-1] and made.options["kl_budget"] == 0


def test_a_tokenizer_saved_beside_the_model_serves_the_calibration(model_with_tokenizer, tokenizer, tmp_path,
                                                                   monkeypatch):
    """A model loaded with transformers from a folder holding its tokenizer calibrates as `load_model`'s does."""
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("KVSHRINK_CACHE_HOME", str(tmp_path / "home"))
    model_with_tokenizer.save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    assert not hasattr(loaded, "kvshrink_tokenizer")
    assert _forwards_to_make(loaded, kl_budget=1e-12) == 2 * (1 + len(LADDER))
    assert not hasattr(loaded, "kvshrink_tokenizer")  # the caller's model is left as it was


def test_load_model_attaches_its_tokenizer(real_model):
    model, tokenizer = real_model
    assert model.kvshrink_tokenizer is tokenizer


def test_a_store_finds_a_calibrated_cache_by_the_options_it_was_asked_with(model_with_tokenizer, tokenizer, tmp_path,
                                                                           monkeypatch):
    """The cache records the rung its calibration chose (budget spent); a lookup with the options the caller
    gave (the budget, no rung) is scoped by what such a cache holds, so it finds the entry `put` stored."""
    from kvshrink import CacheStore

    monkeypatch.setenv("KVSHRINK_CACHE_HOME", str(tmp_path / "home"))
    store = CacheStore(tmp_path / "store")
    ids = tokenizer(calibration_text()[:3000], return_tensors="pt")["input_ids"][:, :300]
    cache, how = store.cache_for(model_with_tokenizer, ids, "shard", kl_budget=1e-12, min_block=32)
    assert how == "computed" and cache.options["kl_budget"] == 0
    again, how = store.cache_for(model_with_tokenizer, ids, "shard", kl_budget=1e-12, min_block=32)
    assert how == "hit" and again.options == cache.options
