"""The GPU path checks each Triton kernel against the torch path on first use, and takes the torch path for a
kernel that disagrees (warning once): the exact-attention and merge kernels one by one, Shard's and LRQK's
kernels as one decode step each. Run on CPU in Triton's interpreter, with a mismatch planted."""

from __future__ import annotations

import warnings

import pytest
import torch

from kvshrink.cache.attention import exact_partial, merge_partials
from kvshrink.kernels import exact_attention as kernels
from kvshrink.kernels import selfcheck
from kvshrink.kernels.backend import force_gpu_path


@pytest.fixture
def fresh_verdicts():
    selfcheck.forget()
    yield
    selfcheck.forget()


def _planted(monkeypatch, name: str, error: float) -> list[int]:
    """Replace kernel ``name`` with one whose output is off by ``error``; returns its call log."""
    real, calls = getattr(kernels, name), []

    def off(*args, **kwargs):
        calls.append(1)
        out, lse = real(*args, **kwargs)
        return out + error, lse

    monkeypatch.setattr(kernels, name, off)
    return calls


def _inputs(seed=1):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(1, 4, 1, 32, generator=gen), torch.randn(1, 2, 19, 32, generator=gen),
            torch.randn(1, 2, 19, 32, generator=gen))


def test_a_disagreeing_kernel_warns_once_and_the_torch_path_answers(monkeypatch, fresh_verdicts):
    calls = _planted(monkeypatch, "exact_attention", 0.5)
    q, k, v = _inputs()
    want = exact_partial(q, k, v, 0.2)                       # CPU path
    with force_gpu_path():
        with pytest.warns(RuntimeWarning, match="exact_attention .*torch path is used"):
            first = exact_partial(q, k, v, 0.2)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            second = exact_partial(q, k, v, 0.2)
    assert len(calls) == 1                                   # the check only; never trusted afterwards
    for got in (first, second):
        torch.testing.assert_close(got.out, want.out)
        torch.testing.assert_close(got.lse, want.lse)


def test_an_agreeing_kernel_is_trusted_silently(monkeypatch, fresh_verdicts):
    calls = _planted(monkeypatch, "exact_attention", 0.0)
    q, k, v = _inputs()
    with force_gpu_path(), warnings.catch_warnings():
        warnings.simplefilter("error")
        got = exact_partial(q, k, v, 0.2)
        exact_partial(q, k, v, 0.2)
    assert len(calls) == 3                                   # the check, then both calls
    want = exact_partial(q, k, v, 0.2)
    torch.testing.assert_close(got.out, want.out, atol=1e-5, rtol=1e-5)


def test_the_verdict_is_per_signature(monkeypatch, fresh_verdicts):
    """Another head size is another compiled variant: checked on its own."""
    _planted(monkeypatch, "exact_attention", 0.5)
    q, k, v = _inputs()
    with force_gpu_path():
        with pytest.warns(RuntimeWarning):
            exact_partial(q, k, v, 0.2)
        with pytest.warns(RuntimeWarning, match="64"):
            exact_partial(q[..., :16].repeat(1, 1, 1, 4), k[..., :16].repeat(1, 1, 1, 4),
                          v[..., :16].repeat(1, 1, 1, 4), 0.2)


def test_a_disagreeing_merge_kernel_falls_back(monkeypatch, fresh_verdicts):
    _planted(monkeypatch, "merge_attention", 0.25)
    q, k, v = _inputs()
    parts = [exact_partial(q, k[:, :, :9], v[:, :, :9], 0.2), exact_partial(q, k[:, :, 9:], v[:, :, 9:], 0.2)]
    want = merge_partials(parts)
    with force_gpu_path(), pytest.warns(RuntimeWarning, match="merge_attention"):
        got = merge_partials(parts)
    torch.testing.assert_close(got.out, want.out)


def test_a_model_decodes_right_through_a_broken_kernel(monkeypatch, fresh_verdicts, tiny):
    """``full`` on the GPU path with its attention kernel broken still generates what DynamicCache does."""
    import kvshrink
    from transformers import DynamicCache

    from conftest import greedy

    model = tiny()
    ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    want_seq, want_logits = greedy(model, ids, mask, DynamicCache(), new_tokens=4)
    _planted(monkeypatch, "exact_attention", 0.5)
    with force_gpu_path(), pytest.warns(RuntimeWarning, match="exact_attention"):
        seq, logits = greedy(model, ids, mask, kvshrink.make_cache("full", model), new_tokens=4)
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)


# ---- Shard's and LRQK's kernels: one check of the whole step per method ----------------------------------------
METHOD_STEPS = {  # method: (kernel module, kernel planted, options of a tiny cache whose decode reads that kernel)
    "shard": ("kvshrink.kernels.shard_code_attention", "block_attention",
              dict(sinks=2, window=8, min_block=16, v_group=4, v_codebook=16)),
    "lrqk": ("kvshrink.kernels.lrqk_proxy", "gathered_attention", dict(top_k=6, window=3, rank=8, iters=1)),
}


def _plant_in(monkeypatch, module: str, name: str, error: float) -> list[int]:
    """Kernel ``module.name`` off by ``error`` in its output (its first result); returns its call log."""
    import importlib

    kernels_module = importlib.import_module(module)
    real, calls = getattr(kernels_module, name), []

    def off(*args, **kwargs):
        calls.append(1)
        out, *rest = real(*args, **kwargs)
        return (out + error, *rest)

    monkeypatch.setattr(kernels_module, name, off)
    return calls


def _decode(model, method: str, options: dict, forced: bool):
    from conftest import greedy

    import kvshrink

    ids = torch.randint(3, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with force_gpu_path(forced):
        return greedy(model, ids, torch.ones_like(ids), kvshrink.make_cache(method, model, **options), new_tokens=3)


@pytest.mark.parametrize("method", METHOD_STEPS)
def test_a_method_step_whose_kernel_disagrees_warns_once_and_decodes_as_the_torch_path(method, monkeypatch,
                                                                                       fresh_verdicts, tiny):
    module, name, options = METHOD_STEPS[method]
    model = tiny(head_dim=32)
    want_seq, want_logits = _decode(model, method, options, forced=False)
    calls = _plant_in(monkeypatch, module, name, 0.5)
    with pytest.warns(RuntimeWarning, match=f"{method}_step .*torch path is used") as caught:
        seq, logits = _decode(model, method, options, forced=True)
    assert sum(f"{method}_step" in str(w.message) for w in caught) == 1         # once, not per layer or step
    assert calls                                                               # the check ran the kernel
    calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        again_seq, again_logits = _decode(model, method, options, forced=True)
    assert not calls                                                           # never trusted afterwards
    for got_seq, got_logits in ((seq, logits), (again_seq, again_logits)):
        assert torch.equal(got_seq, want_seq)
        torch.testing.assert_close(got_logits, want_logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("method", METHOD_STEPS)
def test_a_method_step_whose_kernels_agree_is_trusted_silently(method, monkeypatch, fresh_verdicts, tiny):
    module, name, options = METHOD_STEPS[method]
    model = tiny(head_dim=32)
    want_seq, want_logits = _decode(model, method, options, forced=False)
    calls = _plant_in(monkeypatch, module, name, 0.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _decode(model, method, options, forced=True)                           # the check, then the kernels
        calls.clear()
        seq, logits = _decode(model, method, options, forced=True)
    assert calls                                                               # the decode took the kernels
    assert torch.equal(seq, want_seq)
    torch.testing.assert_close(logits, want_logits, atol=1e-4, rtol=1e-4)
