"""Tests for the LRQK factorization codec (pure tensor code)."""

import torch
import pytest

from kvshrink.codecs.lowrank import (
    decode_factor_vectors,
    fit_lowrank_qk,
    gram,
    key_factors,
    line_search_basis_step,
    lowrank_objective,
)


def _correlated(n: int, t: int, d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, d, d, generator=g) * torch.linspace(3, 0.05, d)
    return torch.randn(n, t, d, generator=g) @ mix


def _explicit_objective(q, k, a_q, a_k, b_q, b_k, lam):
    fit = (q @ k.transpose(-1, -2) - a_q @ a_k.transpose(-1, -2)).pow(2).sum((-1, -2))
    pen = (q - a_q @ b_q).pow(2).sum((-1, -2)) + (k - a_k @ b_k).pow(2).sum((-1, -2))
    return 0.5 * fit + 0.5 * lam * pen


def test_objective_from_grams_matches_explicit_matrices():
    q = _correlated(2, 40, 8, 0).double()
    k = _correlated(2, 30, 8, 1).double()
    fit = fit_lowrank_qk(gram(q), gram(k), 3, iters=3, tol=0, generator=torch.Generator().manual_seed(0))
    a_q = q @ fit.query_map
    a_k = k @ fit.key_map
    explicit = _explicit_objective(q, k, a_q, a_k, fit.b_q, fit.b_k, 1.0)
    via_grams = lowrank_objective(gram(q), gram(k), fit.query_map, fit.key_map, fit.b_q, fit.b_k, 1.0)
    torch.testing.assert_close(via_grams, explicit, rtol=1e-8, atol=1e-6)


def test_objective_decreases_over_iterations():
    q = _correlated(3, 200, 16, 2)
    k = _correlated(3, 200, 16, 3)
    fit = fit_lowrank_qk(gram(q), gram(k), 4, iters=8, tol=0, generator=torch.Generator().manual_seed(1))
    hist = fit.objective
    assert len(hist) == 9
    assert all(b <= a * (1 + 1e-9) for a, b in zip(hist, hist[1:])), hist
    assert hist[-1] < 0.5 * hist[0]


def test_exact_updates_are_stationary_in_each_block():
    # After an A_K update, perturbing A_K's map must not lower the objective (exact minimiser).
    q = _correlated(1, 100, 8, 4).double()
    k = _correlated(1, 90, 8, 5).double()
    fit = fit_lowrank_qk(gram(q), gram(k), 3, iters=2, tol=0, generator=torch.Generator().manual_seed(2))
    base = lowrank_objective(gram(q), gram(k), fit.query_map, fit.key_map, fit.b_q, fit.b_k, 1.0)
    for s in range(5):
        noise = 1e-3 * torch.randn(fit.b_k.shape, generator=torch.Generator().manual_seed(s), dtype=torch.float64)
        moved = lowrank_objective(gram(q), gram(k), fit.query_map, fit.key_map, fit.b_q, fit.b_k + noise, 1.0)
        assert moved >= base - 1e-9


def test_gram_weight_drops_rows():
    x = torch.randn(2, 10, 4)
    w = torch.ones(2, 10)
    w[:, :3] = 0
    torch.testing.assert_close(gram(x, w), gram(x[:, 3:]))


def test_rank_above_head_size_is_refused():
    g = gram(torch.randn(1, 5, 4))
    with pytest.raises(ValueError, match="rank"):
        fit_lowrank_qk(g, g, 5)


def test_full_rank_factors_score_exactly():
    q = _correlated(2, 50, 6, 6).double()
    k = _correlated(2, 50, 6, 7).double()
    fit = fit_lowrank_qk(gram(q), gram(k), 6, iters=3, tol=0, generator=torch.Generator().manual_seed(3))
    a_k = key_factors(k, fit.key_map)
    # With r = d the bases are invertible; q̂ = q B_Q⁻¹-ish scoring reproduces q·k closely.
    q_hat, _ = decode_factor_vectors(q[:, :1], k[:, 0], fit.b_q, fit.b_k, lam=1.0)
    proxy = (a_k @ q_hat.transpose(-1, -2)).squeeze(-1)
    exact = (k @ q[:, 0].unsqueeze(-1)).squeeze(-1)
    corr = torch.corrcoef(torch.stack([proxy[0], exact[0]]))[0, 1]
    assert corr > 0.99


def test_decode_vectors_fit_the_new_token():
    q = _correlated(2, 300, 16, 8)
    k = _correlated(2, 300, 16, 9)
    fit = fit_lowrank_qk(gram(q), gram(k), 8, generator=torch.Generator().manual_seed(4))
    a_k = key_factors(k, fit.key_map)
    new_q = q[:, -3:]                      # three query heads sharing one key head
    new_k = k[:, -1]
    q_hat, k_hat = decode_factor_vectors(new_q, new_k, fit.b_q, fit.b_k,
                                         resident_factors=a_k[:, :50], resident_keys=k[:, :50],
                                         resident_weight=torch.ones(2, 50))
    assert q_hat.shape == (2, 3, 8) and k_hat.shape == (2, 8)
    rel_q = (q_hat @ fit.b_q - new_q.double()).norm() / new_q.norm()
    rel_k = (k_hat.unsqueeze(1) @ fit.b_k - new_k.double().unsqueeze(1)).norm() / new_k.norm()
    assert rel_q < 0.5 and rel_k < 0.5
    # Proxy ranking of resident tokens agrees with the exact ranking.
    proxy = (a_k[:, :50].double() @ q_hat[:, 0].unsqueeze(-1)).squeeze(-1)
    exact = (k[:, :50] @ new_q[:, 0].unsqueeze(-1)).squeeze(-1).double()
    for n in range(2):
        assert torch.corrcoef(torch.stack([proxy[n], exact[n]]))[0, 1] > 0.8


def test_line_search_step_never_increases_the_fit():
    g = torch.Generator().manual_seed(5)
    b = torch.randn(4, 6, 10, generator=g)
    a = torch.randn(4, 3, 6, generator=g)
    x = torch.randn(4, 3, 10, generator=g)
    before = (a @ b - x).pow(2).sum((-1, -2))
    after = (a @ line_search_basis_step(b, a, x) - x).pow(2).sum((-1, -2))
    assert (after <= before + 1e-5).all() and (after < before).any()
