"""The GPU path checks each Triton kernel against the torch path on first use, and takes the torch path for a
kernel that disagrees (warning once). Run on CPU in Triton's interpreter, with a mismatch planted."""

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
