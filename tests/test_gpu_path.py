"""The GPU code path of the framework, run on CPU (``force_gpu_path``: Triton kernels in the interpreter).

- the exact-attention kernel against the torch reference (dtypes, GQA, padding, causality, key splits);
- host synchronisations and launches of one decode step per layer (``kvshrink.kernels.counting``):
  ``full`` and ``streaming`` never wait for the device and launch at most 3x a stock ``DynamicCache``
  layer with SDPA. Other methods add a row to ``DECODE_ROWS`` (``max_syncs`` per layer, optional
  ``max_launch_ratio``);
- ``full`` on the GPU path equals a ``DynamicCache`` (fp32 with a left-padded batch, bf16 end to end);
- checks a decode step defers (fp16 overflow, NaN) are still raised;
- ``scripts/gpu_bench.py --tiny`` runs end to end and writes its JSON;
- ``@pytest.mark.cuda``: the kernel and ``full`` on a real device (scripts/gpu_check.sh runs them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache

import kvshrink
from kvshrink.cache.attention import _matmul_partial, visibility_mask
from kvshrink.kernels.backend import force_gpu_path, triton_available
from kvshrink.kernels.counting import count_decode_step

from conftest import left_pad, prompts, tiny_model

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not triton_available(), reason="Triton is not installed (the gpu extra)")


def _reference(q, k, v, scaling, key_index=None, query_index=None, pad_len=None):
    mask = visibility_mask(key_index, k.shape[2], query_index, pad_len, q.device)
    part = _matmul_partial(q, k, v, scaling, mask, False)
    return part.out, part.lse


def _check_kernel(device: str, dtype: torch.dtype, shape, masks: str, splits, tol: float, lse_tol: float = 1e-4):
    from kvshrink.kernels.exact_attention import exact_attention

    b, hq, hkv, q, n, d = shape
    g = torch.Generator().manual_seed(sum(shape))
    query, key, value = (torch.randn(b, h, m, d, generator=g).to(device=device, dtype=dtype)
                         for h, m in ((hq, q), (hkv, n), (hkv, n)))
    query = query.transpose(1, 2).contiguous().transpose(1, 2)  # strided like the model's queries
    pad_len = torch.tensor([3, n + 2, 0][:b], device=device)  # row 1 is all padding: sees nothing
    kwargs = {"none": {}, "pad": {"pad_len": pad_len},
              "causal": {"key_index": torch.arange(n, device=device), "query_index": torch.arange(n - q, n, device=device),
                         "pad_len": pad_len},
              "index": {"key_index": torch.arange(5, 5 + n, device=device).expand(b, n).int(), "pad_len": pad_len + 5},
              "start": {"key_start": 5, "pad_len": pad_len + 5}}[masks]
    out, lse = exact_attention(query, key, value, 0.3, num_splits=splits, **kwargs)
    ref_kwargs = dict(kwargs)
    if "key_start" in ref_kwargs:
        ref_kwargs["key_index"] = torch.arange(5, 5 + n, device=device)
        del ref_kwargs["key_start"]
    ref_out, ref_lse = _reference(query.float(), key.float(), value.float(), 0.3, **ref_kwargs)
    seen = torch.isfinite(ref_lse)
    assert torch.equal(seen, torch.isfinite(lse)), "rows that see no key must get lse=-inf"
    assert out.dtype == torch.float32 and torch.all(out[~seen] == 0)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    # scores are accumulated in fp32 from the stored values in any dtype: the lse matches the fp32 reference closely
    torch.testing.assert_close(lse[seen], ref_lse[seen], atol=lse_tol, rtol=lse_tol)


@pytest.mark.parametrize("dtype,shape,masks,splits", [
    (torch.float32, (2, 4, 2, 1, 70, 16), "pad", None),
    (torch.float32, (2, 4, 2, 1, 70, 16), "start", 2),
    (torch.float32, (2, 8, 2, 3, 130, 24), "causal", 3),
    (torch.bfloat16, (1, 4, 2, 1, 70, 16), "none", 2),
    (torch.bfloat16, (2, 4, 2, 2, 40, 16), "index", None),
    (torch.float16, (2, 4, 4, 5, 5, 16), "causal", None),
])
def test_exact_kernel_matches_reference(dtype, shape, masks, splits):
    _check_kernel("cpu", dtype, shape, masks, splits, tol=1e-5 if dtype == torch.float32 else 2e-2)


def test_exact_kernel_writes_the_callers_buffer():
    from kvshrink.kernels.exact_attention import exact_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g), torch.randn(1, 2, 30, 16, generator=g)
    buf = torch.empty(1, 1, 4, 16).transpose(1, 2)  # [B, q, H_q, d] seen as [B, H_q, q, d]
    out, lse = exact_attention(q, k, v, 0.25, out=buf)
    ref_out, ref_lse = _reference(q, k, v, 0.25)
    assert out is buf
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("store,splits,n", [(torch.float16, None, 30), (torch.bfloat16, 3, 200),
                                             (torch.float16, None, 0)])
def test_exact_kernel_attends_a_new_token_in_its_own_dtype(store, splits, n):
    """``new``: an fp32 key and value beside a 16-bit store, seen by every row, attended unrounded in the same
    launch (the last split's): the reference over the store widened and the new token concatenated."""
    from kvshrink.kernels.counting import OpCounter
    from kvshrink.kernels.exact_attention import exact_attention

    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 1, 16, generator=g)
    k, v = (torch.randn(2, 2, n, 16, generator=g).to(store) for _ in range(2))
    new_k, new_v = torch.randn(2, 2, 1, 16, generator=g) * 3, torch.randn(2, 2, 1, 16, generator=g)
    with OpCounter() as counter:
        out, lse = exact_attention(q, k, v, 0.25, num_splits=splits, new=(new_k, new_v))
    assert counter.launches == (2 if splits else 1), counter.launch_ops
    ref_out, ref_lse = _reference(q, torch.cat([k.float(), new_k], 2), torch.cat([v.float(), new_v], 2), 0.25)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="new key and value"):
        exact_attention(q, k, v, 0.25, new=(new_k[:, :1], new_v[:, :1]))


def test_exact_kernel_launches_once_or_twice_with_split_keys():
    """One launch; with the key axis split, one more for the combine, whatever the number of splits."""
    from kvshrink.kernels.counting import OpCounter
    from kvshrink.kernels.exact_attention import exact_attention

    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(1, 4, 1, 16, generator=g), torch.randn(1, 2, 200, 16, generator=g), torch.randn(1, 2, 200, 16, generator=g)
    for splits, launches in ((1, 1), (3, 2)):
        with OpCounter() as counter:
            exact_attention(q, k, v, 0.25, pad_len=torch.tensor([7]), num_splits=splits)
        assert counter.launches == launches and counter.syncs == 0, (counter.launch_ops, counter.kernels)


@pytest.mark.parametrize("parts", [2, 5, 11])
def test_merge_kernel_equals_merge_partials(parts):
    """One launch merges up to 8 partials (more in rounds), as the torch merge does, rows that no part
    saw (lse -inf everywhere: out 0) and parts that saw nothing of a row included."""
    from kvshrink.cache.attention import Partial, merge_partials
    from kvshrink.kernels.counting import OpCounter
    from kvshrink.kernels.exact_attention import merge_attention

    g = torch.Generator().manual_seed(2)
    outs = [torch.randn(2, 4, 3, 24, generator=g) for _ in range(parts)]
    lses = [torch.randn(2, 4, 3, generator=g) * 3 for _ in range(parts)]
    lses[0][0, 1] = float("-inf")
    for lse in lses:
        lse[1, 2, 0] = float("-inf")
    want = merge_partials([Partial(o, x) for o, x in zip(outs, lses)])
    with OpCounter() as counter:
        out, lse = merge_attention(outs, lses)
    assert counter.launches == -(-(parts - 1) // 7) and counter.syncs == 0, (counter.launch_ops, counter.kernels)
    torch.testing.assert_close(out, want.out, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(lse, want.lse, atol=1e-6, rtol=1e-5)
    assert not out[1, 2, 0].any() and lse[1, 2, 0] == float("-inf")


_COMPILE = """
import sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvshrink.kernels._exact_attention_triton import _exact_attention_kernel as k
names = k.arg_names
const = dict(HAS_KIDX=True, HAS_PAD=True, HAS_QIDX=True, HAS_NEW=True, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128,
             COMPUTE_FP32=False)
ptr = dict(Q="*bf16", K="*bf16", V="*bf16", O="*bf16", L="*fp32", KIDX="*i32", PAD="*i64", QIDX="*i64", NK="*fp32",
           NV="*fp32")
sig = {n: "constexpr" if n in const else ptr.get(n, "fp32" if n == "scaling" else "i32") for n in names}
src = ASTSource(fn=k, signature=sig, constexprs={(names.index(n),): v for n, v in const.items()})
print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
from kvshrink.kernels._exact_attention_triton import _combine_splits_kernel as c
const = dict(BLOCK_S=32, BLOCK_D=128)
ptr = dict(OP="*fp32", LP="*fp32", O="*bf16", L="*fp32")
sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in c.arg_names}
src = ASTSource(fn=c, signature=sig, constexprs={(c.arg_names.index(n),): v for n, v in const.items()})
print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
from kvshrink.kernels._exact_attention_triton import _merge_partials_kernel as m
const = dict(NUM=3, BLOCK_R=16, BLOCK_D=128)
sig = dict(OUTS=("*fp32",) * 3, LSES=("*fp32",) * 3, O="*fp32", L="*fp32", rows="i32", head_dim="i32",
           **{n: "constexpr" for n in const})
src = ASTSource(fn=m, signature=sig, constexprs={(m.arg_names.index(n),): v for n, v in const.items()})
print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
from kvshrink.kernels._exact_attention_triton import _int8_attention_kernel as i8
const = dict(NUM=2, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128, COMPUTE_FP32=False, KV_DTYPE=triton.language.bfloat16)
sets = {n: (kind,) * 2 for n, kind in dict(K_CODES="*u8", K_STEP="*fp16", K_ZERO="*fp16", V_CODES="*u8",
                                           V_STEP="*fp16", V_ZERO="*fp16", COUNTS="i32").items()}
ptr = dict(Q="*bf16", O="*fp32", L="*fp32", scaling="fp32", **sets)
sig = {n: "constexpr" if n in const else ptr.get(n, "i32") for n in i8.arg_names}
src = ASTSource(fn=i8, signature=sig, constexprs={(i8.arg_names.index(n),): v for n, v in const.items()})
print(sorted(triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm))
"""


@pytest.mark.slow
def test_exact_kernel_compiles_for_a_gpu():
    """The interpreter forgives what the compiler refuses: compile the bf16 kernels (attention, combine of
    the key splits, merge, attention over 8-bit codes) for sm_90 (no GPU needed)."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}   # compile, not interpret (no GPU here: ahead of time)
    env.update(PYTHONPATH=str(ROOT / "src"), TRITON_DEFAULT_FP_FUSION="1")
    proc = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=240, env=env)
    if proc.returncode and ("ptxas" in proc.stderr or "backend" in proc.stderr.lower()) and "CompilationError" not in proc.stderr:
        pytest.skip(f"no CUDA backend in this Triton: {proc.stderr[-300:]}")
    assert proc.returncode == 0 and proc.stdout.count("cubin") == 4, proc.stderr[-3000:]


# ---- host syncs and launches of one decode step ---------------------------------------------------------
# (spec, options, max syncs per layer, max launches per layer as a multiple of the stock layer's or None)
DECODE_ROWS = [
    pytest.param("full", {}, 0, 3.0, id="full"),
    pytest.param("streaming", {"sinks": 2, "window": 8}, 0, 3.0, id="streaming"),
    # a compressed middle at 40 tokens: 10 launches, 9 kernels per layer and 4 launches of the step's
    # bookkeeping on layer 0 (1 per layer on these 4 layers, 0.13 on a 30-layer model); steady layers at 3x the
    # stock layer's: test_a_steady_shard_layer_launches_at_most_3x_...
    pytest.param("shard", {"window": 8, "min_block": 16}, 0, 10 / 3, id="shard"),
    # 9.8 launches: 6 kernels, the top-k, the host tier's gather and the copy of the new token to it; 3 launches
    # of the step's bookkeeping on layer 0. Steady layers at 3x the stock layer's: test_a_steady_lrqk_layer_...
    pytest.param("lrqk", {"top_k": 8, "window": 4}, 1, 10 / 3, id="lrqk"),
]
_LAYERS = 4  # enough layers that the per-step bookkeeping (on layer 0) is amortised as on a real model


def _decode_count(spec: str, options: dict, batch_pad: bool = False, tokens: int = 40,
                  dtype: torch.dtype = torch.float32):
    model = tiny_model(num_hidden_layers=2 if batch_pad else _LAYERS, attn_implementation="sdpa").to(dtype)
    rows = prompts([tokens, tokens - 7] if batch_pad else [tokens])
    ids, mask = left_pad(rows)
    from kvshrink.kernels.lrqk_factor import in_interpreter

    # LRQK's factor-update kernel runs in the interpreter only when asked: counted as on a GPU
    with force_gpu_path(), torch.no_grad(), in_interpreter():
        cache = DynamicCache(config=model.config) if spec == "stock" else kvshrink.make_cache(spec, model, **options)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        for _ in range(1):  # a decode step, then the counted one (steady state)
            nxt = out.logits[:, -1:].argmax(-1)
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=positions, past_key_values=cache)
        nxt = out.logits[:, -1:].argmax(-1)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        return count_decode_step(model, cache, nxt, attention_mask=mask, position_ids=positions[:, -1:] + 1)


@pytest.fixture(scope="module")
def stock_count():
    return _decode_count("stock", {})


@pytest.mark.parametrize("spec,options,max_syncs,max_ratio", DECODE_ROWS)
def test_decode_step_syncs_and_launches(spec, options, max_syncs, max_ratio, stock_count):
    count = _decode_count(spec, options)
    print(f"\n{spec}: {count.describe()}\nstock: {stock_count.describe()}")
    assert count.layer_syncs <= max_syncs, count.describe()
    if max_ratio is not None:
        assert count.layer_launches <= max_ratio * stock_count.layer_launches, count.describe()
    if max_syncs == 0:  # the mask function of the "kvshrink" implementation does not sync either
        assert count.step_syncs == 0, count.describe()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_steady_shard_layer_launches_at_most_3x_a_stock_layer(dtype):
    """The new token has no exact kernel of its own: a 16-bit model writes it into the ring and attends it
    from there; an fp32 model's (unrounded; the ring holds fp16) is attended in the ring's launch. Every
    layer but the first (which also makes the step's RoPE tables and overflow check) launches 9 kernels,
    3x a stock layer's 3."""
    stock = _decode_count("stock", {}, dtype=dtype)
    shard = _decode_count("shard", {"window": 8, "min_block": 16}, dtype=dtype)
    assert max(stock.per_layer_launches) == 3, stock.describe()
    assert max(shard.per_layer_launches[1:]) <= 3 * 3 and shard.step_syncs == 0, shard.describe()
    assert shard.kernels.get("exact_attention") == _LAYERS, shard.describe()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_steady_lrqk_layer_launches_at_most_3x_a_stock_layer(dtype):
    """Every LRQK layer but the first (which also runs the step's bookkeeping) launches 9: the factor update, the
    proxy's two passes, the top-k, the slot plan, the host tier's gather of the misses, the attention (storing
    them), the commit and the new token's copy to the host tier; one host synchronisation, the miss plan."""
    stock = _decode_count("stock", {}, dtype=dtype)
    lrqk = _decode_count("lrqk", {"top_k": 8, "window": 4}, dtype=dtype)
    assert max(stock.per_layer_launches) == 3, stock.describe()
    assert max(lrqk.per_layer_launches[1:]) <= 3 * 3 and lrqk.layer_syncs <= 1, lrqk.describe()
    assert lrqk.kernels.get("lrqk_attention") == _LAYERS and lrqk.kernels.get("lrqk_slot_plan") == _LAYERS, \
        lrqk.describe()


@pytest.mark.parametrize("spec,options", [("full", {}), ("streaming", {"sinks": 2, "window": 8})])
def test_decode_step_of_a_padded_batch_never_syncs(spec, options):
    count = _decode_count(spec, options, batch_pad=True)
    assert count.layer_syncs == 0 and count.step_syncs == 0, count.describe()


# ---- results on the GPU path -----------------------------------------------------------------------------
def _teacher_forced_logits(model, cache, ids, mask, steps: int, forced: bool):
    """Prefill then ``steps`` decode steps feeding fixed tokens: ``[B, steps + 1, vocab]`` float32."""
    g = torch.Generator().manual_seed(5)
    nxt_all = torch.randint(3, 128, (ids.shape[0], steps), generator=g)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = []
    with force_gpu_path(forced), torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache)
        logits.append(out.logits[:, -1].float())
        for i in range(steps):
            nxt = nxt_all[:, i:i + 1]
            mask = torch.cat([mask, torch.ones_like(nxt)], 1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=nxt, attention_mask=mask, position_ids=positions, past_key_values=cache)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


def test_full_on_the_gpu_path_equals_dynamic_cache_padded_fp32():
    model = tiny_model(attn_implementation="sdpa")
    ids, mask = left_pad(prompts([12, 7]))
    ref = _teacher_forced_logits(model, DynamicCache(config=model.config), ids, mask, 4, forced=False)
    got = _teacher_forced_logits(model, kvshrink.make_cache("full", model), ids, mask, 4, forced=True)
    real = mask.bool()[:, -1]
    torch.testing.assert_close(got[real], ref[real], atol=1e-4, rtol=1e-4)


def test_streaming_on_the_gpu_path_equals_the_cpu_path_padded():
    model = tiny_model(attn_implementation="sdpa")
    ids, mask = left_pad(prompts([14, 9]))
    opts = {"sinks": 2, "window": 6}
    ref = _teacher_forced_logits(model, kvshrink.make_cache("streaming", model, **opts), ids, mask, 5, forced=False)
    got = _teacher_forced_logits(model, kvshrink.make_cache("streaming", model, **opts), ids, mask, 5, forced=True)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def test_bf16_full_end_to_end_equals_dynamic_cache():
    model = tiny_model(attn_implementation="sdpa").to(torch.bfloat16)
    ids = torch.stack(prompts([24]))
    mask = torch.ones_like(ids)
    cache = kvshrink.make_cache("full", model)
    ref = _teacher_forced_logits(model, DynamicCache(config=model.config), ids, mask, 8, forced=False)
    got = _teacher_forced_logits(model, cache, ids, mask, 8, forced=True)
    layer = cache.layers[0].store
    assert layer.keys.dtype == torch.bfloat16 and layer.values.dtype == torch.bfloat16  # stored in the model's dtype
    scale = ref.abs().max()  # (a random tiny model's logits are near ties: argmax may flip under bf16 rounding)
    assert (got - ref).abs().max() <= 0.03 * scale, ((got - ref).abs().max(), scale)


def test_checks_a_decode_step_defers_are_raised():
    """fp16 overflow and NaN are refused on the GPU path too: at the end of a prefill, within
    DEFERRED_CHECK_EVERY decode steps, and by nbytes()."""
    from kvshrink.cache import store
    from kvshrink.kernels.deferred import raise_deferred

    model = tiny_model(attn_implementation="sdpa")
    ids = torch.stack(prompts([10]))
    with force_gpu_path(), torch.no_grad():
        big = torch.full((1, 2, 10, 16), 1e5)
        with pytest.raises(ValueError, match="float16"):  # a prefill's overflow: raised at its end
            store.to_storage(big, torch.float16)
            raise_deferred()
        for dtype in (torch.float64, torch.bfloat16, torch.float32):  # any source dtype narrows without a sync
            assert store.to_storage(torch.ones(2, 3, dtype=dtype), torch.float16).dtype == torch.float16
        raise_deferred()
        cache = kvshrink.make_cache("full", model, dtype="float16")
        out = model(input_ids=ids, past_key_values=cache)
        store_of_layer = cache.layers[0].store
        original = store_of_layer.append

        def append_huge(key, value, index):  # a decode step whose key is beyond float16's range
            original(key * 1e7, value, index)

        store_of_layer.append = append_huge
        model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=cache)  # no sync: not raised yet
        with pytest.raises(ValueError, match="float16"):
            cache.nbytes()
        del store_of_layer.append
        cache.nbytes()  # raised once, then clear


def test_gpu_bench_tiny_runs_and_writes_json(tmp_path, capsys):
    """scripts/gpu_bench.py --tiny end to end, in this process (the script needs no install: PYTHONPATH=src)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    threads = torch.get_num_threads()
    try:
        import gpu_bench

        out = tmp_path / "bench.json"
        assert gpu_bench.main(["--tiny", "--lengths", "80", "--json", str(out)]) == 0
    finally:
        sys.path.remove(str(ROOT / "scripts"))
        torch.set_num_threads(threads)
    assert "random weights" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["versions"]["torch"] and report["shape"]["num_hidden_layers"] >= 1
    methods = {r["method"] for r in report["results"]}
    assert {"full", "shard", "lrqk"} <= methods
    full = [r for r in report["results"] if r["method"] == "full"]
    for r in full:
        assert r["error"] is None and r["decode_ms_per_token"] > 0 and r["prefill_s"] > 0 and r["nbytes"] > 0


# ---- a real device (scripts/gpu_check.sh) -----------------------------------------------------------------
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.cuda
@cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("masks,splits", [("none", None), ("pad", 4), ("causal", None), ("index", 3)])
def test_exact_kernel_on_cuda(dtype, masks, splits):
    shape = (2, 32, 8, 1 if masks != "causal" else 4, 1000, 128)
    _check_kernel("cuda", dtype, shape, masks, splits, tol=2e-5 if dtype == torch.float32 else 2e-2, lse_tol=1e-3)


@pytest.mark.cuda
@cuda
def test_full_on_cuda_bf16_equals_dynamic_cache():
    model = tiny_model(attn_implementation="sdpa").to(device="cuda", dtype=torch.bfloat16)
    ids = torch.stack(prompts([24])).cuda()
    mask = torch.ones_like(ids)
    ref = _teacher_forced_logits_cuda(model, DynamicCache(config=model.config), ids, mask, 8)
    got = _teacher_forced_logits_cuda(model, kvshrink.make_cache("full", model), ids, mask, 8)
    assert (got - ref).abs().max() <= 0.03 * ref.abs().max()


def _teacher_forced_logits_cuda(model, cache, ids, mask, steps):
    g = torch.Generator().manual_seed(5)
    nxt_all = torch.randint(3, 128, (ids.shape[0], steps), generator=g).cuda()
    logits = []
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, past_key_values=cache)
        logits.append(out.logits[:, -1].float())
        for i in range(steps):
            mask = torch.cat([mask, torch.ones_like(nxt_all[:, :1])], 1)
            out = model(input_ids=nxt_all[:, i:i + 1], attention_mask=mask, past_key_values=cache)
            logits.append(out.logits[:, -1].float())
    return torch.stack(logits, 1)


@pytest.mark.cuda
@cuda
def test_full_decode_step_on_cuda_never_syncs():
    model = tiny_model(num_hidden_layers=_LAYERS, attn_implementation="sdpa").to(device="cuda", dtype=torch.bfloat16)
    ids = torch.stack(prompts([40])).cuda()
    cache = kvshrink.make_cache("full", model)
    with torch.no_grad():
        out = model(input_ids=ids, past_key_values=cache)
        nxt = out.logits[:, -1:].argmax(-1)
        out = model(input_ids=nxt, past_key_values=cache)
    count = count_decode_step(model, cache, out.logits[:, -1:].argmax(-1), cuda_sync_debug=True)
    assert count.layer_syncs == 0 and count.step_syncs == 0 and count.cuda_sync_warnings == 0, count.describe()
