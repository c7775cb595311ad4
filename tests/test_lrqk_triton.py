"""LRQK's GPU decode path (Triton kernels, device-side slot bookkeeping, one host synchronisation) against
the reference path (kernel="reference"), on CPU through Triton's interpreter (``force_gpu_path``): the
same selected tokens, the same data movement and the same outputs within float32 rounding, on tiny
models; the kernels against their torch oracles; the host synchronisations of one decode step."""

from __future__ import annotations

import warnings
from collections import Counter

import pytest
import torch
from conftest import greedy, left_pad, prompts, tiny_model
from torch.utils._python_dispatch import TorchDispatchMode

pytest.importorskip("triton")

import kvshrink  # noqa: E402
from kvshrink.cache.rowwise import one_row_layers  # noqa: E402
from kvshrink.kernels.backend import force_gpu_path, triton_available  # noqa: E402
from kvshrink.methods.lrqk import tiers as lrqk_tiers  # noqa: E402
from kvshrink.methods.lrqk import LRQKLayer  # noqa: E402

if not triton_available():  # pragma: no cover - Triton imported before kvshrink without a GPU
    pytest.skip("Triton's kernels cannot run here", allow_module_level=True)

from kvshrink.kernels import lrqk_proxy  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: one intra-op thread (on a shared, busy machine, more threads cost ~30x here)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _kernels_unchecked(monkeypatch):
    """The kernels taken without their first-use check (`kvshrink.kernels.selfcheck`, tested in
    test_kernel_selfcheck.py): its probe steps would add miss transfers and host reads to the counts here."""
    monkeypatch.setattr(LRQKLayer, "kernels_verdict", True)


# ---- kernels against torch ------------------------------------------------------------------------------
@pytest.mark.parametrize("groups,rank,dtype", [(1, 16, torch.float16), (4, 32, torch.float16), (8, 12, torch.float32)])
def test_proxy_mass_equals_torch(groups, rank, dtype):
    g = torch.Generator().manual_seed(groups)
    rows, tokens, n = 3, 150, 131
    q = torch.randn(rows, groups, rank, generator=g)
    a = (torch.randn(rows, tokens, rank, generator=g) * 2).to(dtype)
    first = torch.tensor([0, 17, 140])           # the last row has no visible candidate: mass 0
    for pad in (None, first):
        got = lrqk_proxy.proxy_mass(q, a, n, 0.3, pad)
        want = lrqk_proxy.proxy_mass_torch(q, a, n, 0.3, pad)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        assert torch.equal(torch.topk(got, 8).indices.sort(1).values, torch.topk(want, 8).indices.sort(1).values)


@pytest.mark.parametrize("groups,rank,dim,copies,window,update", [
    (3, 16, 64, 1, 5, True), (1, 8, 32, 2, 0, True), (4, 12, 16, 1, 3, False), (2, 16, 64, 1, -1, True)])
def test_factor_step_kernel_equals_torch(groups, rank, dim, copies, window, update):
    """`lrqk_factor.factor_step` (one launch: resident sums, r x r updates, line searches) against the torch
    path (`_resident_sums`' products, `factor_vectors_from_sums`, two `line_search_basis_step`): slots not
    chosen and empty (-1) are left out, the window's factor rows follow its first token, ranks below the
    kernel's padded size, several factor heads per KV row; window -1: no resident token (``fit_resident``
    off)."""
    from kvshrink.codecs.lowrank import factor_vectors_from_sums, line_search_basis_step
    from kvshrink.kernels.lrqk_factor import factor_step, in_interpreter

    g = torch.Generator().manual_seed(rank + groups)
    rows, slots, tokens = 3, 40, 90
    n = rows * copies
    q, k = torch.randn(n, groups, dim, generator=g), torch.randn(n, dim, generator=g)
    b_q, b_k = torch.randn(n, rank, dim, generator=g) * 0.2, torch.randn(n, rank, dim, generator=g) * 0.2
    factors = torch.randn(n, tokens, rank, generator=g).to(torch.float16)
    token = torch.randint(0, 70, (rows, slots), generator=g)
    token[:, -3:] = -1
    chosen = torch.rand(rows, slots, generator=g) < 0.7
    slot_keys = torch.randn(rows, slots, dim, generator=g).to(torch.float16)
    n_win = max(window, 0)
    win_keys = torch.randn(rows, n_win, dim, generator=g).to(torch.float16)
    start = 80
    if window < 0:
        token, chosen, slot_keys = token[:, :0], chosen[:, :0], slot_keys[:, :0]
    # the torch path's sums, per factor head (head n reads KV row n // copies)
    kv = torch.arange(n) // copies
    use = (chosen & (token >= 0))[kv].float()
    a = torch.cat([factors.float().gather(1, token.clamp_min(0)[kv, :, None].expand(-1, -1, rank)) * use[..., None],
                   factors[:, start:start + n_win].float()], 1)
    keys = torch.cat([slot_keys.float(), win_keys.float()], 1)[kv]
    lhs, rhs = a.mT @ a, (q @ keys.mT) @ a
    want_q, want_k = factor_vectors_from_sums(q, k, b_q, b_k, lhs, rhs, lam=0.7)
    want_bq = line_search_basis_step(b_q, want_q, q) if update else b_q
    want_bk = line_search_basis_step(b_k, want_k.unsqueeze(1), k.unsqueeze(1)) if update else b_k
    got_bq, got_bk = b_q.clone(), b_k.clone()
    with force_gpu_path(), in_interpreter():
        got_q, got_k = factor_step(q, k, got_bq, got_bk, factors, token, chosen, slot_keys, win_keys, start,
                                   copies, 0.7, update)
    torch.testing.assert_close(got_q, want_q, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_bq, want_bq, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_bk, want_bk, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("groups,dim,dtype", [(1, 64, torch.float16), (4, 128, torch.bfloat16), (8, 64, torch.float32)])
def test_gathered_attention_equals_torch(groups, dim, dtype):
    g = torch.Generator().manual_seed(dim + groups)
    rows, slots, k, n_tail = 3, 40, 35, 6
    q = torch.randn(rows, groups, dim, generator=g)
    sk, sv = (torch.randn(rows, slots, dim, generator=g).to(dtype) for _ in range(2))
    index = torch.stack([torch.randperm(slots, generator=g)[:k] for _ in range(rows)])
    token = torch.randint(0, 100, (rows, k), generator=g)
    tk, tv = (torch.randn(rows, n_tail, dim, generator=g).to(dtype) for _ in range(2))
    nk, nv = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    for first, splits in ((None, None), (torch.tensor([0, 50, 104]), 1), (torch.tensor([0, 50, 104]), 3)):
        # row 2: only the new token is visible; splits: programs per row over the slots (merged partials)
        for tail in ((tk, tv), (None, None)):
            got = lrqk_proxy.gathered_attention(q, sk, sv, index, token, *tail, nk, nv, 100, dim ** -0.5, first,
                                                block_n=16, splits=splits)
            want = lrqk_proxy.gathered_attention_torch(q, sk, sv, index, token, *tail, nk, nv, 100, dim ** -0.5,
                                                       first)
            torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)


# ---- the GPU path against the reference path ------------------------------------------------------------
def _model(gqa: int, head_dim: int, seed: int = 0):
    kv = 2 if gqa == 1 else 1
    return tiny_model("llama", seed=seed, num_attention_heads=gqa * kv, num_key_value_heads=kv, head_dim=head_dim,
                      num_hidden_layers=2)


def _selected(layer) -> list[list[int]]:
    """The tokens of the latest selection, per row of the layer (sorted)."""
    slots = layer.slots
    return [sorted(slots.token[r][slots.chosen[r]].tolist()) for r in range(slots.rows)]


CASES = [  # (policy, GQA ratio, head size, slot dtype, extra options): every policy with every GQA ratio,
    # both head sizes and both slot dtypes spread over them, then option variants
    ("set", 1, 64, "float16", {}),
    ("set", 4, 128, "bfloat16", {}),
    ("set", 8, 64, "bfloat16", {}),
    ("lru", 1, 128, "bfloat16", {}),
    ("lru", 4, 64, "float16", {}),
    ("lru", 8, 128, "float16", {}),
    ("attention", 1, 64, "bfloat16", {}),
    ("attention", 4, 128, "float16", {}),
    ("attention", 8, 128, "bfloat16", {}),
    ("set", 4, 64, "float16", {"factor_heads": "query"}),
    ("lru", 4, 64, "float16", {"window": 0}),
    ("attention", 1, 64, "float16", {"fit_resident": False, "extra_slots": 3}),
]


@pytest.mark.parametrize("policy,gqa,head_dim,slot_dtype,extra", CASES,
                         ids=[f"{c[0]}-gqa{c[1]}-d{c[2]}-{c[3]}" + "".join(f"-{k}" for k in c[4]) for c in CASES])
def test_gpu_path_equals_reference(policy, gqa, head_dim, slot_dtype, extra):
    _check_gpu_path_equals_reference(policy, gqa, head_dim, slot_dtype, extra)


def test_gpu_path_with_the_factor_kernel_equals_reference():
    """As above with the factor update in its Triton kernel (the interpreter runs it only when asked: about
    0.3 s a program); the kernel against the torch ops alone: `test_factor_step_kernel_equals_torch`."""
    from kvshrink.kernels.lrqk_factor import in_interpreter

    with in_interpreter():   # two decode steps: the second reads factors the kernel wrote
        _check_gpu_path_equals_reference("set", 1, 64, "float16", {}, new_tokens=3)


def _check_gpu_path_equals_reference(policy, gqa, head_dim, slot_dtype, extra, new_tokens=4):
    model = _model(gqa, head_dim)
    ids, mask = left_pad(prompts([26, 19], seed=gqa))      # a left-padded batch (rows split by the cache)
    # rank: below the prompts' lengths (d=128's default, 32, is not): a factorization fitted on fewer tokens
    # than its rank is ill-posed and its ranking follows float rounding (the CPU paths disagree there too)
    # (one iteration of the prefill fit: the same for both paths, and most of this test's time at d=128)
    opts = {"top_k": 6, "window": 3, "policy": policy, "slot_dtype": slot_dtype, "rank": 12, "iters": 1, **extra}
    ref = kvshrink.make_cache("lrqk", model, kernel="reference", **opts)
    gpu = kvshrink.make_cache("lrqk", model, kernel="fast", **opts)
    ref_seq, ref_logits = greedy(model, ids, mask, ref, new_tokens=new_tokens)
    transfers = _count_transfers()
    with force_gpu_path(), transfers:
        seq, logits = greedy(model, ids, mask, gpu, new_tokens=new_tokens)
    layers = list(zip(one_row_layers(ref.layers), one_row_layers(gpu.layers)))
    assert transfers.calls == (new_tokens - 1) * len(layers)            # the GPU path ran: one miss transfer per step and layer
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for key in ("selected_rows", "missed_rows", "bytes_moved", "fast_tier_bytes"):
        assert gpu.stats()[key] == ref.stats()[key], key
    for a, b in layers:
        assert _selected(a) == _selected(b)                # the same selection in the last step
        assert torch.equal(a.slots.token.sort(1).values, b.slots.token.sort(1).values)   # the same residents


@pytest.mark.parametrize("policy", ["lru", "set"])
def test_gpu_path_prefetch_equals_reference(policy):
    """prefetch=True on the GPU path: the next-ranked tokens ride on the miss transfer (still one per step
    and layer), are loaded in the background, and missing tokens found there are installed from them:
    the reference's answers, hits and bytes."""
    model = _model(4, 64)
    ids, mask = left_pad(prompts([26, 19]))
    opts = {"top_k": 6, "window": 3, "rank": 12, "iters": 1, "policy": policy, "prefetch": True, "extra_slots": 4}
    ref = kvshrink.make_cache("lrqk", model, kernel="reference", **opts)
    gpu = kvshrink.make_cache("lrqk", model, kernel="fast", **opts)
    ref_seq, ref_logits = greedy(model, ids, mask, ref, new_tokens=5)
    with force_gpu_path(), _count_transfers() as transfers:
        seq, logits = greedy(model, ids, mask, gpu, new_tokens=5)
    assert transfers.calls == 4 * len(list(one_row_layers(gpu.layers)))
    assert torch.equal(seq, ref_seq)
    torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
    for key in ("selected_rows", "missed_rows", "bytes_moved", "prefetch_hits", "prefetch_rows", "prefetch_bytes"):
        assert gpu.stats()[key] == ref.stats()[key], key
    assert gpu.stats()["prefetch_hits"] > 0


def test_gpu_path_disk_tier_and_copy(tmp_path):
    """The GPU path with the slow tier on disk (its fills checked against the rows' checksums) equals the
    reference; a copy taken after GPU-path steps decodes on as the original."""
    import copy

    model = _model(4, 64)
    ids, mask = left_pad(prompts([26, 19]))
    opts = {"top_k": 6, "window": 3, "rank": 12, "iters": 1, "slow_tier": "disk", "disk_folder": str(tmp_path)}
    ref = kvshrink.make_cache("lrqk", model, kernel="reference", **opts)
    gpu = kvshrink.make_cache("lrqk", model, kernel="fast", **opts)
    ref_seq, ref_logits = greedy(model, ids, mask, ref, new_tokens=4)
    with force_gpu_path():
        seq, logits = greedy(model, ids, mask, gpu, new_tokens=4)
        assert torch.equal(seq, ref_seq)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert gpu.stats()["bytes_moved"] == ref.stats()["bytes_moved"]
        twin = copy.deepcopy(gpu)
        mask2 = torch.cat([mask, torch.ones_like(seq[:, ids.shape[1]:])], 1)
        a = greedy(model, seq, mask2, gpu, new_tokens=3)
        b = greedy(model, seq, mask2, twin, new_tokens=3)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# ---- host synchronisations --------------------------------------------------------------------------------
# Ops whose result the host must read (or whose output size depends on data): a host synchronisation on CUDA.
_SYNC_OPS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::masked_select", "aten::equal",
             "aten::is_nonzero", "aten::_linalg_check_errors", "aten::unique", "aten::_unique2",
             "aten::unique_consecutive", "aten::unique_dim"}


class _SyncCounter(TorchDispatchMode):
    """Counts data-dependent ops (and boolean-mask indexing, which runs ``nonzero``) in its block."""

    def __init__(self):
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        if name in _SYNC_OPS:
            self.ops[name] += 1
        elif name in ("aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                self.ops[name + "(bool)"] += 1
        elif name == "aten::repeat_interleave" and isinstance(args[0], torch.Tensor) and args[0].dtype != torch.bool \
                and len(args) == 1 and kwargs.get("output_size") is None:
            self.ops[name + "(Tensor)"] += 1
        return func(*args, **kwargs)


class _count_transfers:
    """Counts the GPU path's miss transfers (``lrqk_tiers._miss_plan_to_host``): on CPU they are no copy, so
    no op shows them."""

    def __enter__(self):
        self.calls = 0
        self._orig = lrqk_tiers._miss_plan_to_host

        def counted(plan):
            self.calls += 1
            return self._orig(plan)
        lrqk_tiers._miss_plan_to_host = counted
        return self

    def __exit__(self, *exc):
        lrqk_tiers._miss_plan_to_host = self._orig


def _decode_step_syncs(monkeypatch, gpu: bool, model=None, device="cpu", **opts):
    """Host synchronisations inside LRQK's layers (attend, which commits) in one decode step:
    ``(data-dependent ops, miss transfers, layer calls, CUDA sync warnings)`` (the last on CUDA only,
    from ``torch.cuda.set_sync_debug_mode``)."""
    model = model if model is not None else _model(4, 64)
    ids, mask = left_pad(prompts([30, 22]))
    ids, mask = ids.to(device), mask.to(device)
    cache = kvshrink.make_cache("lrqk", model, top_k=6, window=3, **opts)
    counter, calls, syncs = _SyncCounter(), [0], []
    attend = LRQKLayer.attend

    def counted_attend(self, query, ctx):
        calls[0] += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if query.is_cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with counter:
                    return attend(self, query, ctx)
            finally:
                if query.is_cuda:
                    torch.cuda.set_sync_debug_mode("default")
                syncs.extend(str(w.message) for w in caught if "synchroniz" in str(w.message))
    with torch.no_grad(), force_gpu_path(gpu):
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for step in range(2):
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            if step == 1:      # the second decode step: slots already filled, the usual case
                monkeypatch.setattr(LRQKLayer, "attend", counted_attend)
                try:
                    with _count_transfers() as transfers:
                        out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
                finally:
                    monkeypatch.setattr(LRQKLayer, "attend", attend)
            else:
                out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)
    return counter.ops, transfers.calls, calls[0], syncs


def test_gpu_path_one_host_sync_per_layer(monkeypatch):
    ops, transfers, layers, _ = _decode_step_syncs(monkeypatch, gpu=True)
    assert layers == 4                                      # 2 rows x 2 layers
    assert sum(ops.values()) == 0, ops                      # no data-dependent op
    assert transfers <= layers                              # the miss transfer: at most one per layer
    # the same count with the float16 range checks of bf16 rows narrowed to float16 slots (deferred)
    ops, transfers, layers, _ = _decode_step_syncs(monkeypatch, gpu=True, slot_dtype="float16", policy="lru")
    assert sum(ops.values()) == 0 and transfers <= layers, ops
    # and with prefetch (the next-ranked tokens ride on the miss transfer)
    ops, transfers, layers, _ = _decode_step_syncs(monkeypatch, gpu=True, policy="lru", prefetch=True)
    assert sum(ops.values()) == 0 and transfers <= layers, ops
    # the counter sees the CPU paths' synchronisations (numba path: its range checks; torch: also nonzero...)
    ops, transfers, layers, _ = _decode_step_syncs(monkeypatch, gpu=False, kernel="reference")
    assert transfers == 0 and sum(ops.values()) >= 2 * layers, ops


def test_gpu_path_overflow_is_reported():
    """A float16 slot that would hold inf is refused (one step late: the check rides on the miss transfer)."""
    model = _model(4, 64)
    ids, mask = left_pad(prompts([30]))
    cache = kvshrink.make_cache("lrqk", model, top_k=6, window=3, slot_dtype="float16")
    with torch.no_grad(), force_gpu_path():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
        for layer in one_row_layers(cache.layers):
            layer.slow.data[: layer.slow.length] = 1e6       # every stored row beyond float16's range
        with pytest.raises(ValueError, match="it became inf"):
            for _ in range(3):
                nxt = out.logits[:, -1:].argmax(-1)
                mask = torch.cat([mask, torch.ones_like(nxt)], 1)
                out = model(input_ids=nxt, attention_mask=mask, past_key_values=cache, use_cache=True)


# ---- on a CUDA device -----------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", ["set", "attention"])
def test_gpu_path_on_cuda_bf16(policy, monkeypatch):
    """The GPU path on a CUDA device in bfloat16 against the reference path there: the same first
    selection (up to a near tie), outputs within bfloat16 rounding, and no host synchronisation inside
    LRQK's layers but the miss transfer (CUDA's sync debug mode)."""
    model = _model(4, 128).to("cuda", torch.bfloat16)
    ids, mask = left_pad(prompts([300, 260]))
    ids, mask = ids.cuda(), mask.cuda()
    opts = {"top_k": 32, "window": 16, "policy": policy}
    ref = kvshrink.make_cache("lrqk", model, kernel="reference", **opts)
    gpu = kvshrink.make_cache("lrqk", model, kernel="fast", **opts)
    _, ref_logits = greedy(model, ids, mask, ref, new_tokens=2)     # the prefill, then one decode step
    with _count_transfers() as transfers:
        _, logits = greedy(model, ids, mask, gpu, new_tokens=2)
    assert transfers.calls == len(list(one_row_layers(gpu.layers)))   # the GPU path ran
    torch.testing.assert_close(logits.float(), ref_logits.float(), rtol=5e-2, atol=5e-2)
    for a, b in zip(one_row_layers(ref.layers), one_row_layers(gpu.layers)):
        for want, got in zip(_selected(a), _selected(b)):
            assert len(set(want) ^ set(got)) <= 2                # bf16 rounding may swap a near tie
    ops, transfers, layers, syncs = _decode_step_syncs(monkeypatch, gpu=True, model=model, device="cuda",
                                                       policy=policy)
    assert sum(ops.values()) == 0, ops
    assert transfers == layers and len(syncs) <= layers, syncs



@pytest.mark.parametrize("copies", [1, 2])
def test_proxy_ranking_sums_copies_and_ranks_ties_as_the_cpu_paths(copies):
    """The kernel's mass summed over each KV row's factor rows equals the torch oracle's sum, its keys equal
    `token_order_keys` of that mass, and a top-k of the keys is `top_k_in_token_order`'s rule: of masses tied
    with the k-th (here zeros: scores far below the row's best underflow), the latest tokens, never left
    padding before a real token."""
    from kvshrink.methods.lrqk.layer import token_order_keys, top_k_by_keys, top_k_in_token_order

    g = torch.Generator().manual_seed(copies)
    kv_rows, groups, rank, n, k = 3, 2, 16, 131, 40
    q = torch.randn(kv_rows * copies, groups, rank, generator=g)
    a = torch.randn(kv_rows * copies, n, rank, generator=g)
    a[:, :100] *= 0.01                           # the first 100 tokens: tiny scores ...
    a[:, 100:] *= 30                             # ... against ones large enough that theirs underflow to 0
    first = torch.tensor([0, 17, 130]).repeat_interleave(copies)
    for pad in (None, first):
        mass, keys = lrqk_proxy.proxy_ranking(q, a, n, 1.0, pad, copies=copies)
        want = lrqk_proxy.proxy_mass_torch(q, a, n, 1.0, pad).view(kv_rows, copies, n).sum(1)
        torch.testing.assert_close(mass, want, rtol=1e-4, atol=1e-6)   # scores of ~100: exp's float32 rounding
        assert torch.equal(keys, token_order_keys(mass))
        zeros = (mass == 0).sum(1)
        assert bool((zeros > n - k).any()), "no tie at the k-th mass: the test would not test the rule"
        for policy in ("lru", "attention", "set"):
            got, want = top_k_by_keys(keys, k, policy), top_k_in_token_order(mass, k, policy)[1]
            assert torch.equal(got if policy != "set" else got.sort(1).values, want)
        if pad is not None:                      # one visible token: it, then the latest of the zeros
            assert top_k_by_keys(keys, k, "lru")[2].tolist() == list(range(n - k, n))


def test_token_order_keys_rank_as_the_tie_rule():
    """`token_order_keys`: a larger mass ranks above, equal masses by the later token, NaN tied with inf (the
    torch rule's ranking) above every finite mass."""
    from kvshrink.methods.lrqk.layer import token_order_keys, top_k_by_keys, top_k_in_token_order

    mass = torch.tensor([[0.5, 0.0, 0.2, 0.0, 0.0, 0.2, 0.1, float("nan"), 3.0]])
    order = torch.argsort(token_order_keys(mass), dim=1, descending=True)
    assert order.tolist() == [[7, 8, 0, 5, 2, 6, 4, 3, 1]]
    for k in range(1, 10):
        for policy in ("lru", "attention"):
            assert torch.equal(top_k_by_keys(token_order_keys(mass), k, policy),
                               top_k_in_token_order(mass, k, policy)[1])

@pytest.mark.parametrize("policy", ["set", "lru", "attention"])
@pytest.mark.parametrize("prefetch,ahead,overflow", [(False, False, None), (True, True, True), (True, False, False)])
def test_slot_plan_kernel_equals_the_tensor_ops(policy, prefetch, ahead, overflow):
    """`kernels.lrqk_slots.slot_plan` (one launch) against `SlotTier._plan_torch` (the tensor ops it replaces) on
    random slot states: empty slots, tied policy values, hits and misses, tokens found in last step's prefetched
    rows, the overflow flag and the tokens to prefetch riding on the plan; the slots' tokens, values and chosen
    flags updated alike."""
    import copy

    from kvshrink.kernels.counting import OpCounter
    from kvshrink.kernels.lrqk_slots import slot_plan
    from kvshrink.methods.lrqk.tiers import SlotTier

    g = torch.Generator().manual_seed(len(policy) + 3 * prefetch + 5 * ahead)
    span = 40
    slow = type("Slow", (), {"length": span, "rows": 0})()
    seen = Counter()
    for trial in range(6):
        rows, cap = 1 + trial % 3, 4 + 7 * trial
        k = max(1, cap - trial)
        slow.rows = rows
        tier = SlotTier(rows, cap, 8, torch.float16, torch.device("cpu"), policy)
        for r in range(rows):
            full = int(torch.randint(0, cap + 1, (1,), generator=g))
            tier.token[r, torch.randperm(cap, generator=g)[:full]] = torch.randperm(span, generator=g)[:full]
        tier.score = torch.randint(0, 3, (rows, cap), generator=g).float()
        tier.chosen = torch.rand(rows, cap, generator=g) > 0.5
        tier.step = 3 + trial
        selected = torch.stack([torch.randperm(span, generator=g)[:k] for _ in range(rows)])
        mass = torch.rand(rows, k, generator=g)
        pf = torch.stack([torch.randperm(span, generator=g)[:5] for _ in range(rows)]) if prefetch else None
        ahead_tokens = torch.randint(0, span, (rows, 3), generator=g) if ahead else None
        flag = None if overflow is None else torch.tensor(overflow)
        oracle = copy.deepcopy(tier)
        want = oracle._plan_torch(selected, slow, mass, flag, (pf, None) if prefetch else None, ahead_tokens)
        with force_gpu_path(), OpCounter() as counter:
            slot, plan, dest, rank, offset = slot_plan(selected, tier.token, tier.score, tier.chosen, policy,
                                                       tier.step, rows, mass, flag, pf, ahead_tokens)
        assert counter.launches == 1 and counter.syncs == 0, (counter.launch_ops, counter.kernels)
        n = rows * k
        m = int(want[1][n])
        assert torch.equal(slot, want[0]) and int(plan[n]) == m
        assert torch.equal(plan[:m], want[1][:m]) and torch.equal(dest[:m], want[2][:m])
        assert torch.equal(plan[n + 1:], want[1][n + 1:])       # the overflow flag (-1: none), then `ahead`
        misses = rank >= 0                                      # each miss's place in the plan: where its slot is
        assert int(misses.sum()) == m and torch.equal(offset, misses.sum(1).cumsum(0) - misses.sum(1))
        row_of = torch.arange(rows)[:, None].expand(-1, k)
        assert torch.equal(dest[(offset[:, None] + rank)[misses]], (row_of * cap + slot)[misses])
        assert torch.equal(tier.token, oracle.token) and torch.equal(tier.score, oracle.score)
        assert torch.equal(tier.chosen, oracle.chosen)
        seen["missed"] += m
        seen["resident"] += n - m
        seen["prefetched"] += int((plan[:m] < 0).sum())
    assert seen["missed"] and seen["resident"] and (seen["prefetched"] > 0) == prefetch, seen


@pytest.mark.parametrize("slot_dtype,fill_dtype", [(torch.float16, torch.float32), (torch.bfloat16, torch.float32),
                                                  (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16)])
@pytest.mark.parametrize("special", [None, "big", "nan"])
@pytest.mark.parametrize("splits", [1, 3])
def test_attention_stores_the_fill_as_the_tensor_ops(slot_dtype, fill_dtype, special, splits):
    """`gathered_attention` with a `SlotFill` (one launch) against `deferred_to_storage` and two ``index_copy_``
    into the slots, then the oracle attention over them: the missing rows (ties halfway between two 16-bit values,
    subnormals; NaN and inf where named) rounded into their slots as ``.to`` rounds them and attended as stored, the
    held slots read as they are; a value beyond float16's range, narrowing to float16, raising the overflow flag."""
    from kvshrink.kernels.counting import OpCounter
    from kvshrink.methods.lrqk.tiers import deferred_to_storage

    if special == "nan" and slot_dtype == torch.float16:
        pytest.skip("a NaN hides an overflow from the tensor ops' maximum: not mixed")
    g = torch.Generator().manual_seed(7 + splits)
    rows, cap, k, d, groups = 3, 10, 6, 24, 2
    q = torch.randn(rows, groups, d, generator=g)
    sk, sv = (torch.randn(rows, cap, d, generator=g).to(slot_dtype) for _ in range(2))
    index = torch.stack([torch.randperm(cap, generator=g)[:k] for _ in range(rows)])
    token = torch.randint(0, 100, (rows, k), generator=g)
    missing = torch.rand(rows, k, generator=g) < 0.5
    missing[:, 0] = True
    rank = torch.where(missing, missing.long().cumsum(1) - 1, -1)
    counts = missing.sum(1)
    offset = counts.cumsum(0) - counts
    dest = torch.cat([r * cap + index[r][missing[r]] for r in range(rows)])
    m = dest.numel()
    fill = torch.randn(m, 2, d, generator=g)
    fill[0, 0, :4] = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -11, 3e-8])
    odd = int(offset[1])          # row 1's first miss holds the special values
    if special == "big":
        fill[odd, 1, 0] = 70000.0
    if special == "nan":
        fill[odd, 1, :2] = torch.tensor([float("nan"), float("inf")])
    fill = fill.to(fill_dtype)
    want_k, want_v = sk.clone(), sv.clone()
    want_flag = torch.zeros((), dtype=torch.bool)
    stored = deferred_to_storage(fill, slot_dtype, want_flag)
    want_k.view(-1, d).index_copy_(0, dest, stored[:, 0])
    want_v.view(-1, d).index_copy_(0, dest, stored[:, 1])
    tk, tv = (torch.randn(rows, 3, d, generator=g).to(slot_dtype) for _ in range(2))
    nk, nv = torch.randn(rows, d, generator=g), torch.randn(rows, d, generator=g)
    want = lrqk_proxy.gathered_attention_torch(q, want_k, want_v, index, token, tk, tv, nk, nv, 100, d ** -0.5)
    flag = torch.zeros((), dtype=torch.bool)
    with force_gpu_path(), OpCounter() as counter:
        got = lrqk_proxy.gathered_attention(q, sk, sv, index, token, tk, tv, nk, nv, 100, d ** -0.5, block_n=16,
                                            splits=splits, fill=lrqk_proxy.SlotFill(fill, rank, offset, flag))
    assert counter.launches == 1, (counter.launch_ops, counter.kernels)
    torch.testing.assert_close(sk, want_k, rtol=0, atol=0, equal_nan=True)     # the same roundings
    torch.testing.assert_close(sv, want_v, rtol=0, atol=0, equal_nan=True)
    assert bool(flag) == bool(want_flag) == (special == "big" and slot_dtype == torch.float16)
    compared = [0, 2] if special else [0, 1, 2]     # (row 1 attends an inf or NaN value there)
    torch.testing.assert_close(got[0][compared], want[0][compared], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got[1][compared], want[1][compared], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model_dtype,slot_dtype,factor_dtype", [
    (torch.float32, torch.float16, torch.float16), (torch.float32, torch.bfloat16, torch.bfloat16),
    (torch.bfloat16, torch.bfloat16, torch.float16), (torch.float32, torch.float32, torch.float32)])
@pytest.mark.parametrize("big", [None, "key", "factor"])
def test_commit_kernel_equals_the_tensor_ops(model_dtype, slot_dtype, factor_dtype, big):
    """`kernels.lrqk_slots.commit_token` (one launch) against what `LRQKLayer._commit_torch` does on the GPU path:
    the window shifted by one with the new token last and the key factors appended, rounded as ``.to`` rounds, the
    token staged as the slow tier holds it;
    a key or factor beyond float16's range, narrowing to float16, raising the overflow flag."""
    from kvshrink.kernels.counting import OpCounter
    from kvshrink.kernels.lrqk_slots import commit_token

    g = torch.Generator().manual_seed(11)
    b, h, w, d, f, cap, r, a_len = 2, 3, 5, 24, 6, 9, 12, 4
    key, value = (torch.randn(b, h, 1, d, generator=g).mul(50).to(model_dtype) for _ in range(2))
    k_hat = torch.randn(b, f, r, generator=g, dtype=torch.float64) * 30
    k_hat[0, 0, :2] = torch.tensor([1 + 2 ** -11 + 2 ** -40, 1 + 3 * 2 ** -9])   # ties for float16 and bfloat16
    if big == "key":
        key[1, 2, 0, 3] = 70000.0
    if big == "factor":
        k_hat[1, 4, 5] = -80000.0
    win_k, win_v = (torch.randn(b, h, w, d, generator=g).to(slot_dtype) for _ in range(2))
    a_k = torch.randn(b, f, cap, r, generator=g).to(factor_dtype)
    want_k = torch.cat([win_k[:, :, 1:], key.to(slot_dtype)], 2)
    want_v = torch.cat([win_v[:, :, 1:], value.to(slot_dtype)], 2)
    want_a = a_k.clone()
    want_a[:, :, a_len] = k_hat.to(factor_dtype)
    overflow = torch.zeros((), dtype=torch.bool)
    stage = torch.full((1, b * h, 2, d), float("nan"), dtype=model_dtype)
    with force_gpu_path(), OpCounter() as counter:
        commit_token(key, value, k_hat, win_k, win_v, a_k, a_len, overflow, stage=stage)
    assert counter.launches == 1, (counter.launch_ops, counter.kernels)
    assert torch.equal(win_k, want_k) and torch.equal(win_v, want_v) and torch.equal(a_k, want_a)
    assert torch.equal(stage, torch.stack([key, value], 2).reshape(1, b * h, 2, d))   # as SlowTier.append lays it
    narrowed = (big == "key" and slot_dtype == torch.float16 and model_dtype != torch.float16) or \
        (big == "factor" and factor_dtype == torch.float16)
    assert bool(overflow) == narrowed


_COMPILE_SCRIPT = r"""
import importlib.util, os, sys, types
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
# kvshrink.kernels alone: the kvshrink package would import transformers (seconds; nothing used here)
spec = importlib.util.find_spec("kvshrink")
root = os.path.dirname(spec.origin)
for name, path in (("kvshrink", root), ("kvshrink.kernels", os.path.join(root, "kernels"))):
    pkg = types.ModuleType(name)
    pkg.__path__ = [path]
    sys.modules[name] = pkg
from kvshrink.kernels import lrqk_proxy as k
from kvshrink.kernels import lrqk_factor
from kvshrink.kernels import lrqk_slots
P, I = "*fp32", "i32"
proxy = {"q_ptr": "*fp64", "a_ptr": "*fp16", "pad_ptr": "*i64", "n": I, "G": I, "R": I, "a_row_stride": I,
         "a_tok_stride": I, "scale": "fp32", "HAS_PAD": "constexpr", "BLOCK_G": "constexpr",
         "BLOCK_R": "constexpr", "BLOCK_N": "constexpr"}
kernels = [
    (k._proxy_stats, {**proxy, "m_ptr": P, "l_ptr": P, "lse_ptr": P, "arrived_ptr": "*i32", "n_blocks": I,
                      "BLOCK_B": "constexpr"}, {"BLOCK_R": 32, "BLOCK_N": 64, "BLOCK_B": 32}),
    (k._proxy_mass_kernel, {**proxy, "lse_ptr": P, "mass_ptr": P, "key_ptr": "*i64", "COPIES": "constexpr"},
     {"BLOCK_R": 32, "BLOCK_N": 64, "COPIES": 2}),
    *[(k._gathered_attention_kernel,
       {**{n: "*bf16" for n in ("q_ptr", "tk_ptr", "tv_ptr", "nk_ptr", "nv_ptr")}, "sk_ptr": slots, "sv_ptr": slots,
        "sidx_ptr": "*i64", "stok_ptr": "*i64", "pad_ptr": "*i64", "fill_ptr": fill, "rank_ptr": "*i64",
        "foff_ptr": "*i64", "ovf_ptr": "*i8", "out_ptr": P, "lse_ptr": P, "acc_ptr": P, "ml_ptr": P,
        "arrived_ptr": "*i32", **{n: I for n in ("G", "D", "S", "n_sel", "n_tail", "tail_start", "split_len",
                                                 "n_splits")},
        "scale": "fp32", **{n: "constexpr" for n in ("HAS_PAD", "HAS_FILL", "CHECK", "BF16", "SPLIT", "BLOCK_G",
                                                     "BLOCK_D", "BLOCK_N")}},
       {"BLOCK_D": 128, "BLOCK_N": 32, "SPLIT": True, "HAS_FILL": True, "CHECK": slots == "*fp16",
        "BF16": slots == "*i16"})
      for slots, fill in (("*i16", P), ("*fp16", P), ("*bf16", "*bf16"))],
    (lrqk_factor._factor_step_kernel,
     {**{n: P for n in ("bq_ptr", "bk_ptr")}, "q_ptr": "*bf16", "k_ptr": "*bf16", "a_ptr": "*fp16", "tok_ptr": "*i64",
      "chosen_ptr": "*u8", "sk_ptr": "*bf16", "wk_ptr": "*bf16", "qh_ptr": "*fp64", "kh_ptr": "*fp64",
      **{n: I for n in ("G", "D", "R", "S", "W", "win_start", "copies", "a_head_stride", "a_row_stride")},
      "lam": "fp32", **{n: "constexpr" for n in ("ITERS", "UPDATE", "GP", "DP", "RP", "BLOCK_T")}},
     {"ITERS": 2, "UPDATE": True, "GP": 16, "DP": 128, "RP": 32, "BLOCK_T": 32}),
    (lrqk_slots._slot_plan_rows,
     {"SEL": "*i64", "TOK": "*i64", "SCORE": P, "CHOSEN": "*i8", "MASS": P, "PF": "*i64", "PRIO": P,
      "ORDER": "*i32", "SLOT": "*i64", "SRC": "*i64", "DST": "*i64", "COUNT": "*i64", "RANK": "*i64", "OFFSET": "*i64", "OVF": "*i1",
      "AHEAD": "*i64", "PLAN": "*i64", "DEST": "*i64", "ARRIVED": "*i32",
      **{n: I for n in ("rows", "k", "cap", "e", "slow_rows", "n_ahead")}, "step": "fp32",
      **{n: "constexpr" for n in ("POLICY", "HAS_MASS", "HAS_PF", "HAS_OVF", "BLOCK_K", "BLOCK_C", "TILE",
                                  "BLOCK_A")}},
     {"POLICY": 2, "HAS_MASS": True, "HAS_PF": True, "HAS_OVF": True, "BLOCK_K": 2048, "BLOCK_C": 4096,
      "TILE": 16, "BLOCK_A": 256}),
    (lrqk_slots._commit_rows,
     {"KEY": P, "VALUE": P, "KHAT": "*fp64", "WK": "*i16", "WV": "*i16", "AK": "*fp16", "OVF": "*i8", "STAGE": P,
      **{n: I for n in ("win_rows", "heads", "W", "d", "r", "a_cap", "a_len", "key_b", "key_h", "value_b",
                        "value_h")},
      **{n: "constexpr" for n in ("CHECK_KV", "CHECK_A", "WIN_BF16", "A_BF16", "HAS_STAGE", "BLOCK_W", "BLOCK_D",
                                  "BLOCK_R")}},
     {"CHECK_KV": False, "CHECK_A": True, "WIN_BF16": True, "A_BF16": False, "HAS_STAGE": True, "BLOCK_W": 64,
      "BLOCK_D": 128, "BLOCK_R": 32}),
]
for fn, sig, consts in kernels:
    sig = {n: sig[n] for n in fn.arg_names}         # in the kernel's parameter order
    shared = {n: v for n, v in (("HAS_PAD", True), ("BLOCK_G", 16)) if n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={**shared, **consts})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    assert "ld.global" in ptx
    if fn in (k._proxy_stats, k._gathered_attention_kernel, lrqk_slots._slot_plan_rows):
        # kernels.tickets: the arrival an acquire-release atomic at device scope, the partials read from L2
        assert "atom.global.gpu.acq_rel.add" in ptx and "ld.global.cg" in ptx, fn.__name__
print("compiled")
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CUDA tests run the kernels themselves")
@pytest.mark.slow
def test_kernels_compile_for_a_gpu(tmp_path):
    """The kernels compile to PTX for sm_90 (the interpreter does not check what the compiler does), in a
    process with Triton's compiler (``TRITON_INTERPRET=0``; nothing is launched)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_INTERPRET": "0", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    if "ptxas" in done.stderr and "not found" in done.stderr:   # pragma: no cover - a Triton without ptxas
        pytest.skip("Triton's ptxas is missing")
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
