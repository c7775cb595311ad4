"""Joint low-rank factorization of queries and keys (LRQK).

Prefill objective, per factor head, for queries ``Q`` (``M x d``) and keys ``K`` (``T x d``)::

    ½‖QKᵀ − A_Q A_Kᵀ‖² + (λ/2)‖Q − A_Q B_Q‖² + (λ/2)‖K − A_K B_K‖²

minimised by alternating exact updates (each block is the exact minimiser given the others, so the
objective never increases)::

    B_Q = (A_QᵀA_Q)⁻¹A_QᵀQ,   B_K = (A_KᵀA_K)⁻¹A_KᵀK
    A_Q ← Q(KᵀA_K + λB_Qᵀ)(A_KᵀA_K + λB_QB_Qᵀ)⁻¹
    A_K ← K(QᵀA_Q + λB_Kᵀ)(A_QᵀA_Q + λB_KB_Kᵀ)⁻¹

Every update multiplies ``Q`` (or ``K``) on the left by a ``d x r`` matrix, so when the factors start
as random projections ``A_Q = Q·M_Q``, ``A_K = K·M_K`` they stay of that form, and every quantity the
updates need is a function of the ``d x d`` Gram matrices ``QᵀQ`` and ``KᵀK`` alone. We therefore run
the exact algorithm on the Grams: its cost does not depend on the prompt length, ``QKᵀ`` (``M x T``) is
never formed, and a chunked prefill only has to accumulate the Grams chunk by chunk. The key factors
of all tokens are then ``A_K = K·M_K`` (one pass over the keys).

With GQA the queries of the ``G`` query heads sharing a KV head are stacked (``M = G·T``), so the key
factors are stored once per KV head.

Decode (per new token, per factor head): closed-form alternating updates of the factor vectors
``q̂`` (one per query head of the group) and ``k̂`` so that ``q̂B_Q ≈ q``, ``k̂B_K ≈ k``, ``q̂·k̂ ≈ q·k``
and ``A_K[Ω]q̂ ≈ K[Ω]q`` over the resident tokens ``Ω``; then one exact-line-search gradient step on
each basis. Small solves run in float64: they are ``r x r`` and ``d x d``, so precision is free.

All functions take leading batch dimensions ``[N, ...]`` (N = batch x factor heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = [
    "LowRankFit",
    "gram",
    "fit_lowrank_qk",
    "lowrank_objective",
    "key_factors",
    "decode_factor_vectors",
    "factor_vectors_from_sums",
    "line_search_basis_step",
    "default_rank",
]

_SOLVE_DTYPE = torch.float64


def default_rank(head_dim: int) -> int:
    """The paper's rank: 32 for head size 128, scaled linearly (16 for 64), at least 4."""
    return max(4, head_dim // 4)


def gram(x: Tensor, weight: Tensor | None = None) -> Tensor:
    """``xᵀ diag(weight) x`` over the row dimension: ``x`` ``[N, M, d]`` -> ``[N, d, d]`` (float64).

    ``weight`` ``[N, M]`` (0/1) drops rows such as left padding.
    """
    x64 = x.to(_SOLVE_DTYPE)
    if weight is not None:
        x64 = x64 * weight.to(_SOLVE_DTYPE).unsqueeze(-1)
        return x64.transpose(-1, -2) @ x.to(_SOLVE_DTYPE)
    return x64.transpose(-1, -2) @ x64


def _ridge_solve(lhs: Tensor, rhs: Tensor, rel_eps: float = 1e-9, check_errors: bool = True) -> Tensor:
    """Solve ``lhs · X = rhs`` for symmetric PSD ``lhs`` with a tiny relative ridge.

    The ridge keeps rank-deficient systems (prompts shorter than the rank, zero heads) solvable
    without changing well-conditioned ones measurably. ``check_errors=False`` (the GPU path): no
    check for a singular system, which reads the solver's status on the host (a synchronisation);
    the same solution otherwise.
    """
    n = lhs.shape[-1]
    scale = lhs.diagonal(dim1=-2, dim2=-1).abs().mean(-1, keepdim=True).clamp_min(1e-30)
    eye = torch.eye(n, dtype=lhs.dtype, device=lhs.device)
    if not check_errors:
        return torch.linalg.solve_ex(lhs + rel_eps * scale.unsqueeze(-1) * eye, rhs)[0]
    return torch.linalg.solve(lhs + rel_eps * scale.unsqueeze(-1) * eye, rhs)


def _right_solve(rhs: Tensor, lhs: Tensor) -> Tensor:
    """``rhs · lhs⁻¹`` for symmetric ``lhs``."""
    return _ridge_solve(lhs, rhs.transpose(-1, -2)).transpose(-1, -2)


@dataclass
class LowRankFit:
    """Result of the prefill factorization, per factor head (leading dim N).

    ``query_map``/``key_map`` (``[N, d, r]``): ``A_Q = Q·query_map``, ``A_K = K·key_map``.
    ``b_q``/``b_k`` (``[N, r, d]``): the bases. ``objective``: value after init and each iteration.
    """

    query_map: Tensor
    key_map: Tensor
    b_q: Tensor
    b_k: Tensor
    objective: list[float] = field(default_factory=list)


def _basis(gram_x: Tensor, x_map: Tensor) -> Tensor:
    """``B = (AᵀA)⁻¹AᵀX`` with ``A = X·x_map``, from the Gram ``XᵀX``."""
    ata = x_map.transpose(-1, -2) @ gram_x @ x_map
    atx = x_map.transpose(-1, -2) @ gram_x
    return _ridge_solve(ata, atx)


def _update_map(gram_self: Tensor, gram_other: Tensor, other_map: Tensor, basis_self: Tensor,
                lam: float) -> Tensor:
    """Map of the exact update ``A ← X(YᵀA_Y + λBᵀ)(A_YᵀA_Y + λBBᵀ)⁻¹`` (A = X·map).

    ``gram_self`` is unused by the update itself (the map is independent of X) but kept in the
    signature so the two sides read symmetrically.
    """
    del gram_self
    numerator = gram_other @ other_map + lam * basis_self.transpose(-1, -2)
    denominator = (other_map.transpose(-1, -2) @ gram_other @ other_map
                   + lam * basis_self @ basis_self.transpose(-1, -2))
    return _right_solve(numerator, denominator)


def lowrank_objective(gram_q: Tensor, gram_k: Tensor, query_map: Tensor, key_map: Tensor,
                      b_q: Tensor, b_k: Tensor, lam: float) -> Tensor:
    """The penalised objective per factor head ``[N]``, evaluated exactly from the Grams."""
    gq_mq = gram_q @ query_map                                    # QᵀA_Q   [N,d,r]
    gk_mk = gram_k @ key_map                                      # KᵀA_K   [N,d,r]
    ata_q = query_map.transpose(-1, -2) @ gq_mq                   # A_QᵀA_Q [N,r,r]
    ata_k = key_map.transpose(-1, -2) @ gk_mk
    qk_sq = (gram_q * gram_k).sum((-1, -2))                       # ‖QKᵀ‖² = tr(G_Q G_K)
    cross = (gq_mq * gk_mk).sum((-1, -2))                         # ⟨QKᵀ, A_QA_Kᵀ⟩
    approx_sq = (ata_q * ata_k).sum((-1, -2))                     # ‖A_QA_Kᵀ‖²
    fit_term = qk_sq - 2 * cross + approx_sq

    def reconstruction(g: Tensor, m: Tensor, b: Tensor) -> Tensor:
        # ‖X − XMB‖² = tr((I − MB)ᵀ G (I − MB))
        resid = torch.eye(g.shape[-1], dtype=g.dtype, device=g.device) - m @ b
        return (resid * (g @ resid)).sum((-1, -2))

    penalty = reconstruction(gram_q, query_map, b_q) + reconstruction(gram_k, key_map, b_k)
    return 0.5 * fit_term + 0.5 * lam * penalty


def fit_lowrank_qk(gram_q: Tensor, gram_k: Tensor, rank: int, *, iters: int = 2, tol: float = 1e-2,
                   lam: float = 1.0, generator: torch.Generator | None = None) -> LowRankFit:
    """Alternating exact minimisation of the LRQK objective from the Grams ``QᵀQ``, ``KᵀK``.

    ``gram_q``/``gram_k``: ``[N, d, d]``. Runs ``iters`` iterations, stopping early once the relative
    change of the summed objective is below ``tol``. Raises ``ValueError`` for a rank above ``d``.
    """
    d = gram_q.shape[-1]
    if not 1 <= rank <= d:
        raise ValueError(f"LRQK rank must be in [1, head size={d}], got {rank}")
    if iters < 1:
        raise ValueError(f"LRQK iters must be >= 1, got {iters}")
    gram_q = gram_q.to(_SOLVE_DTYPE)
    gram_k = gram_k.to(_SOLVE_DTYPE)
    n = gram_q.shape[:-2]
    # Random init A = X·R (R on the CPU generator so fits are reproducible on any device).
    init = torch.randn((2, *n, d, rank), generator=generator, dtype=_SOLVE_DTYPE) / d ** 0.5
    query_map = init[0].to(gram_q.device)
    key_map = init[1].to(gram_q.device)
    b_q = _basis(gram_q, query_map)
    b_k = _basis(gram_k, key_map)
    history = [float(lowrank_objective(gram_q, gram_k, query_map, key_map, b_q, b_k, lam).sum())]
    for _ in range(iters):
        query_map = _update_map(gram_q, gram_k, key_map, b_q, lam)
        key_map = _update_map(gram_k, gram_q, query_map, b_k, lam)
        b_q = _basis(gram_q, query_map)
        b_k = _basis(gram_k, key_map)
        history.append(float(lowrank_objective(gram_q, gram_k, query_map, key_map, b_q, b_k,
                                                lam).sum()))
        if abs(history[-2] - history[-1]) <= tol * max(abs(history[-2]), 1e-30):
            break
    return LowRankFit(query_map, key_map, b_q, b_k, history)


def key_factors(keys: Tensor, key_map: Tensor) -> Tensor:
    """``A_K = K·key_map``: keys ``[N, T, d]`` -> factors ``[N, T, r]`` in the keys' dtype."""
    return (keys.to(key_map.dtype) @ key_map).to(keys.dtype)


def decode_factor_vectors(query: Tensor, key: Tensor, b_q: Tensor, b_k: Tensor, *,
                          resident_factors: Tensor | None = None,
                          resident_keys: Tensor | None = None,
                          resident_weight: Tensor | None = None,
                          lam: float = 1.0, iters: int = 2) -> tuple[Tensor, Tensor]:
    """Closed-form alternating updates of ``q̂`` (per query head) and ``k̂`` for one new token.

    ``query`` ``[N, G, d]`` (the G query heads sharing the factor head), ``key`` ``[N, d]``,
    bases ``[N, r, d]``; optional resident tokens Ω: ``resident_factors`` ``[N, S, r]`` (their A_K
    rows), ``resident_keys`` ``[N, S, d]``, ``resident_weight`` ``[N, S]`` (0 for empty slots).
    Minimises, alternately over q̂ and k̂::

        ½Σ_g (q̂_g·k̂ − q_g·k)² + (λ/2)Σ_g‖q̂_gB_Q − q_g‖² + (λ/2)‖k̂B_K − k‖²
        + ½Σ_g Σ_{j∈Ω} (q̂_g·A_K[j] − q_g·K[j])²

    Returns ``(q_hat [N, G, r], k_hat [N, r])`` in float64.
    """
    lhs = rhs = None
    if resident_factors is not None and resident_factors.shape[-2] > 0:
        # Sums over the S resident tokens run in float32 (the model's precision; float64 here
        # cost more than the rest of the step); only the r x r systems need float64.
        a = resident_factors.float()
        if resident_weight is not None:
            a = a * resident_weight.float().unsqueeze(-1)
        lhs = a.transpose(-1, -2) @ a
        exact_scores = query.float() @ resident_keys.float().transpose(-1, -2)   # [N,G,S]
        rhs = exact_scores @ a                                                    # Σ_j (q·K_j) A_j (weighted)
    return factor_vectors_from_sums(query, key, b_q, b_k, lhs, rhs, lam=lam, iters=iters)


def factor_vectors_from_sums(query: Tensor, key: Tensor, b_q: Tensor, b_k: Tensor,
                             resident_lhs: Tensor | None, resident_rhs: Tensor | None, *,
                             lam: float = 1.0, iters: int = 2, check_errors: bool = True) -> tuple[Tensor, Tensor]:
    """:func:`decode_factor_vectors` given the resident tokens' sums ``resident_lhs`` = ``AᵀA``
    ``[N, r, r]`` and ``resident_rhs`` = ``(q·Kᵀ)A`` ``[N, G, r]`` (None: no resident token).
    ``check_errors=False``: the solves without their host synchronisation (``_ridge_solve``)."""
    q = query.to(_SOLVE_DTYPE)
    k = key.to(_SOLVE_DTYPE)
    bq = b_q.to(_SOLVE_DTYPE)
    bk = b_k.to(_SOLVE_DTYPE)
    bq_gram = bq @ bq.transpose(-1, -2)                            # [N,r,r]
    bk_gram = bk @ bk.transpose(-1, -2)
    qk = (q @ k.unsqueeze(-1)).squeeze(-1)                         # [N,G] exact q·k
    rhs_q_base = lam * (q @ bq.transpose(-1, -2))                  # [N,G,r] λ B_Q q
    lhs_q_base = lam * bq_gram
    if resident_lhs is not None:
        lhs_q_base = lhs_q_base + resident_lhs.to(_SOLVE_DTYPE)
        rhs_q_base = rhs_q_base + resident_rhs.to(_SOLVE_DTYPE)
    # Least-squares start k̂ = k B_K⁺ (the first update of q̂ needs only k̂).
    bk_k = (bk @ k.unsqueeze(-1)).squeeze(-1)                       # [N,r]
    k_hat = _ridge_solve(bk_gram, bk_k.unsqueeze(-1), check_errors=check_errors).squeeze(-1)
    for _ in range(iters):
        kk = k_hat.unsqueeze(-1) @ k_hat.unsqueeze(-2)             # [N,r,r]
        rhs_q = rhs_q_base + qk.unsqueeze(-1) * k_hat.unsqueeze(-2)
        q_hat = _ridge_solve(lhs_q_base + kk, rhs_q.transpose(-1, -2), check_errors=check_errors).transpose(-1, -2)
        lhs_k = q_hat.transpose(-1, -2) @ q_hat + lam * bk_gram    # Σ_g q̂_g q̂_gᵀ + λB_KB_Kᵀ
        rhs_k = (qk.unsqueeze(-1) * q_hat).sum(-2) + lam * bk_k
        k_hat = _ridge_solve(lhs_k, rhs_k.unsqueeze(-1), check_errors=check_errors).squeeze(-1)
    return q_hat, k_hat


def line_search_basis_step(basis: Tensor, factors: Tensor, targets: Tensor) -> Tensor:
    """One gradient step with exact line search on ``½‖factors·B − targets‖²``.

    ``basis`` ``[N, r, d]``, ``factors`` ``[N, G, r]``, ``targets`` ``[N, G, d]``. The objective is
    quadratic in B, so the optimal step along the gradient is ``⟨AG, AB−X⟩ / ‖AG‖²``.
    """
    b = basis.to(_SOLVE_DTYPE)
    a = factors.to(_SOLVE_DTYPE)
    resid = a @ b - targets.to(_SOLVE_DTYPE)                       # [N,G,d]
    grad = a.transpose(-1, -2) @ resid                             # [N,r,d]
    a_grad = a @ grad
    denom = (a_grad * a_grad).sum((-1, -2))
    step = (a_grad * resid).sum((-1, -2)) / denom.clamp_min(1e-30)
    step = torch.where(denom > 0, step, torch.zeros_like(step))
    return (b - step[..., None, None] * grad).to(basis.dtype)
