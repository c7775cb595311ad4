"""Every public entry point refuses bad input with a message naming what is wrong (the message is asserted).

Entry points: make_cache, parse_method_spec, a model run through a kvshrink cache (forward / generate),
and the CLI commands generate, eval and demo (checked before any model is loaded).
"""

from __future__ import annotations

import pytest
import torch

import kvshrink
from kvshrink.cli import main
from conftest import greedy, prompts, tiny_model


# ---------------------------------------------------------------- make_cache / parse_method_spec
def test_unknown_method_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown kvshrink method 'nope'; available: .*full.*shard.*streaming"):
        kvshrink.make_cache("nope", tiny_model())
    with pytest.raises(ValueError, match="unknown kvshrink method 'nope'; available: .*full"):
        kvshrink.parse_method_spec("nope:window=3")


@pytest.mark.parametrize("method,option", [("streaming", "windw"), ("shard", "keybits"), ("lrqk", "topk"),
                                           ("kivi", "bit"), ("h2o", "budgt")])
def test_unknown_option_lists_the_valid_ones(method, option):
    valid = next(iter(kvshrink.methods()[method].options))
    with pytest.raises(ValueError, match=f"unknown option.*'{option}'.*'{method}'; valid options: .*{valid}"):
        kvshrink.make_cache(method, tiny_model(), **{option: 1})


@pytest.mark.parametrize("method,options,message", [
    ("streaming", {"window": 0}, r"option 'window' must be >= 1, got 0"),
    ("shard", {"key_bits": 9.0}, r"option 'key_bits' must be in \(0, 8\], got 9.0"),
    ("shard", {"salient": 0.7}, r"option 'salient' must be in \[0, 0.5\], got 0.7"),
    ("kivi", {"bits": 3}, r"'bits' must be one of \[2, 4\], got 3"),
    ("turboquant", {"key_bits": 5}, r"'key_bits' must be one of \[1, 2, 3, 4, 8\], got 5"),
    ("h2o", {"budget": 0}, r"option 'budget' must be > 0, got 0.0"),
    ("h2o", {"budget": 2.5}, r"budget must be > 0: a whole count \(>= 1\) or a fraction in \(0, 1\); got 2.5"),
    ("lrqk", {"top_k": 0}, r"option 'top_k' must be >= 1, got 0"),
    ("full", {"dtype": "int8"}, r"'dtype' must be one of \['model', 'float16', 'bfloat16', 'float32'\]"),
    ("streaming", {"window": "many"}, r"option 'window' expects int, got 'many'"),
    ("scissorhands", {"history": 80}, r"option 'history' must be in \[1, 62\], got 80"),
    ("hf-quantized", {"backend": "fp8"}, r"option 'backend' must be one of \['quanto', 'hqq'\], got 'fp8'"),
])
def test_option_out_of_range_states_the_range(method, options, message):
    with pytest.raises(ValueError, match=message):
        kvshrink.make_cache(method, tiny_model(), **options)


def test_an_option_the_model_cannot_take_names_the_conflict():
    with pytest.raises(NotImplementedError, match="groups of 48 channels; head size 16 is not a multiple of it"):
        kvshrink.make_cache("kivi", tiny_model(), group=48)


def test_bad_method_specs():
    with pytest.raises(ValueError, match="empty method spec"):
        kvshrink.parse_method_spec("  ")
    with pytest.raises(ValueError, match="bad option 'window' in method spec 'streaming:window': expected key=value"):
        kvshrink.parse_method_spec("streaming:window")


def test_unsupported_models_are_refused_naming_why():
    from transformers import GPT2Config, GPT2LMHeadModel, T5Config, T5ForConditionalGeneration

    with pytest.raises(NotImplementedError, match="needs rotary position embeddings \\(RoPE\\); model type 'gpt2'"):
        kvshrink.make_cache("full", GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)))
    with pytest.raises(NotImplementedError, match="sliding-window attention .*sliding_window=16"):
        kvshrink.make_cache("full", tiny_model("mistral", sliding_window=16))
    qwen = tiny_model("qwen2", use_sliding_window=True, sliding_window=16, max_window_layers=1)
    with pytest.raises(NotImplementedError, match="sliding-window attention \\(model type 'qwen2', sliding_window=16"):
        kvshrink.make_cache("full", qwen)
    llama = tiny_model("llama")
    llama.config.layer_types = ["full_attention", "linear_attention"]
    with pytest.raises(NotImplementedError, match=r"full-attention layers only; model 'llama' has \['linear_attention'\]"):
        kvshrink.make_cache("full", llama)
    t5 = T5ForConditionalGeneration(T5Config(d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=64, d_kv=16))
    with pytest.raises(NotImplementedError, match="decoder-only models; t5 is an encoder-decoder"):
        kvshrink.make_cache("full", t5)
    dynamic = tiny_model("llama", rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(NotImplementedError, match="'shard' .* rope_type 'dynamic'"):
        kvshrink.make_cache("shard", dynamic)


# ---------------------------------------------------------------- running a model through a cache
def test_prompt_longer_than_the_models_positions():
    model = tiny_model("llama", max_position_embeddings=32)
    (a,) = prompts([40])
    with pytest.raises(ValueError, match="40 tokens .* the model's 32 positions"):
        greedy(model, a[None], torch.ones(1, 40, dtype=torch.long), kvshrink.make_cache("full", model))
    (b,) = prompts([30])  # fits, but decoding would run past the last position
    with pytest.raises(ValueError, match="33 tokens .* the model's 32 positions"):
        greedy(model, b[None], torch.ones(1, 30, dtype=torch.long), kvshrink.make_cache("full", model), new_tokens=5)


def test_empty_prompt():
    model = tiny_model("llama")
    with pytest.raises(ValueError, match="empty input"):
        model(input_ids=torch.zeros(1, 0, dtype=torch.long), past_key_values=kvshrink.make_cache("full", model))


def test_nan_in_inputs():
    model = tiny_model("llama")
    (a,) = prompts([10])
    embeds = model.get_input_embeddings()(a[None]).detach()
    embeds[0, 3, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN in the key states of layer 0"):
        model(inputs_embeds=embeds, past_key_values=kvshrink.make_cache("full", model))


@pytest.mark.parametrize("holes", [False, True])
def test_right_padding_or_holes_in_the_mask(holes):
    model = tiny_model("llama")
    ids = torch.randint(3, 128, (2, 10))
    mask = torch.ones(2, 10, dtype=torch.long)
    if holes:
        mask[1, 4] = 0
    else:
        mask[1, -3:] = 0
    with pytest.raises(NotImplementedError, match="left padding only .* holes or right padding"):
        model(input_ids=ids, attention_mask=mask, past_key_values=kvshrink.make_cache("full", model))


@pytest.mark.parametrize("method,options", [("streaming", {}), ("shard", {}), ("lrqk", {}), ("kivi", {"group": 16}),
                                            ("turboquant", {}), ("h2o", {}), ("scissorhands", {})])
def test_beam_search_and_assisted_decoding_with_a_compressing_method(method, options):
    model = tiny_model("llama")
    (a,) = prompts([12])
    with pytest.raises(NotImplementedError, match=f"'{method}' does not support .*beam search"):
        model.generate(input_ids=a[None], past_key_values=kvshrink.make_cache(method, model, **options),
                       max_new_tokens=3, do_sample=False, num_beams=2, pad_token_id=0)
    with pytest.raises(NotImplementedError, match=f"'{method}' does not support crop \\(assisted"):
        model.generate(input_ids=a[None], past_key_values=kvshrink.make_cache(method, model, **options),
                       max_new_tokens=6, do_sample=False, assistant_model=tiny_model("llama", seed=1), pad_token_id=0)


def test_cache_reuse_with_an_unrelated_prompt():
    model = tiny_model("llama")
    a, b = prompts([12, 12])
    cache = kvshrink.make_cache("streaming", model)
    with torch.no_grad():
        model(input_ids=a[None], past_key_values=cache)
    with pytest.raises(kvshrink.CacheReuseError, match="holds 12 tokens .* does not begin with them"):
        greedy(model, b[None], torch.ones(1, 12, dtype=torch.long), cache)


def test_unwritable_or_vanished_disk_tier_folder(tmp_path):
    import shutil

    from kvshrink.methods.lrqk.tiers import SlowTierChanged

    model = tiny_model("llama")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(ValueError, match="lrqk: disk_folder '.*a-file/sub' is not a writable folder"):
        greedy(model, prompts([20])[0][None], torch.ones(1, 20, dtype=torch.long),
               kvshrink.make_cache("lrqk", model, slow_tier="disk", disk_folder=str(blocker / "sub"), top_k=4, window=4))
    cache = kvshrink.make_cache("lrqk", model, slow_tier="disk", disk_folder=str(tmp_path), top_k=4, window=4)
    (a,) = prompts([30])
    with torch.no_grad():
        model(input_ids=a[None], past_key_values=cache)
        for sub in tmp_path.iterdir():
            if sub.is_dir():
                shutil.rmtree(sub)
        with pytest.raises(SlowTierChanged, match="disappeared"):
            for t in range(4):
                model(input_ids=torch.tensor([[5 + t]]), past_key_values=cache)


# ---------------------------------------------------------------- half precision
def test_float16_storage_of_a_bf16_model_refuses_values_beyond_its_range():
    model = tiny_model("llama").to(torch.bfloat16)
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(1e6)  # values of ~1e5: fine in bf16, inf in fp16
    (a,) = prompts([20])
    mask = torch.ones(1, 20, dtype=torch.long)
    with pytest.raises(ValueError, match="beyond float16's range .* 'model'"):
        greedy(model, a[None], mask, kvshrink.make_cache("full", model, dtype="float16"))
    for method, options in [("shard", {"exact_dtype": "float16"}),
                            ("lrqk", {"slot_dtype": "float16", "top_k": 4, "window": 4})]:
        with pytest.raises(ValueError, match="beyond float16's range"):
            greedy(model, a[None], mask, kvshrink.make_cache(method, model, **options))
    fp32 = model.float()  # an fp32 model's kept tokens go to float16 by default: refused, not inf
    for method, options in [("h2o", {"budget": 8}), ("kivi", {"group": 16, "residual": 16})]:
        with pytest.raises(ValueError, match="beyond float16's range"):
            greedy(fp32, a[None], mask, kvshrink.make_cache(method, fp32, **options))
    model = fp32.to(torch.bfloat16)
    ref, ref_logits = greedy(model, a[None], mask, kvshrink.make_cache("full", model))
    for method, options in [("shard", {}), ("streaming", {}), ("h2o", {}), ("kivi", {"group": 16}), ("lrqk", {})]:
        seq, logits = greedy(model, a[None], mask, kvshrink.make_cache(method, model, **options))  # bf16 kept bf16
        assert torch.isfinite(logits).all(), method


def test_lrqk_disk_tier_takes_a_bf16_model(tmp_path):
    model = tiny_model("llama").to(torch.bfloat16)
    (a,) = prompts([40])
    mask = torch.ones(1, 40, dtype=torch.long)
    cpu, _ = greedy(model, a[None], mask, kvshrink.make_cache("lrqk", model, top_k=8, window=4))
    disk, _ = greedy(model, a[None], mask, kvshrink.make_cache("lrqk", model, top_k=8, window=4, slow_tier="disk",
                                                             disk_folder=str(tmp_path)))
    assert torch.equal(cpu, disk)


# ---------------------------------------------------------------- CLI (fails before loading a model)
@pytest.mark.parametrize("argv,message", [
    (["generate", "--method", "nope", "--prompt", "hi"], "unknown kvshrink method 'nope'; available:"),
    (["generate", "--method", "streaming", "--option", "windoww=3", "--prompt", "hi"], "valid options: .*window"),
    (["generate", "--method", "full", "--prompt", ""], "empty prompt"),
    (["demo", "--methods", "full,nope"], "unknown kvshrink method 'nope'"),
    (["demo", "--methods", "shard:keybits=9"], r"valid options: .*key_bits"),
    (["eval", "--suite", "quick", "--methods", "full,nope", "--out", "{tmp}"], "unknown kvshrink method 'nope'"),
    (["eval", "--suite", "quick", "--methods", "streaming:windw=3", "--out", "{tmp}"], "valid options: .*window"),
])
def test_cli_refuses_bad_input_before_loading_the_model(argv, message, tmp_path, capsys, monkeypatch):
    import kvshrink.models

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the input was checked")

    monkeypatch.setattr(kvshrink.models, "load_model", no_model)
    monkeypatch.setattr(kvshrink, "load_model", no_model)
    argv = [a.replace("{tmp}", str(tmp_path / "out")) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvshrink: error: ")
    import re
    assert re.search(message, err), err
