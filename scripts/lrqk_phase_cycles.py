"""Where LRQK's compiled decode step spends its time inside a model step: a copy of `lrqk_fused` with the CPU's
cycle counter (LLVM's readcyclecounter) read between the phases of `_row_step`, run in place of the module while
the model decodes. Usage:
    PYTHONPATH=src .venv/bin/python scripts/lrqk_phase_cycles.py LENGTH STEPS [THREADS]
(docs/results.md, "Session 29"). Prints each phase's time per layer call, summed over the KV rows (with several
threads the rows run side by side: the call's wall time is printed too). The copy is made by text edits of the
module's source: an assertion names the line it no longer finds when the kernel changes."""
import importlib, importlib.util, pathlib, sys, tempfile, time
import numpy as np, torch
from numba import njit
from kvshrink.eval.backend import KVShrinkBackend
from kvshrink.eval.engine import _step, prefill
from kvshrink.eval.tasks import TokenCorpus

L = importlib.import_module("kvshrink.methods.lrqk")
source = pathlib.Path(importlib.import_module("kvshrink.methods.lrqk_fused").__file__).read_text()
source = source.replace("cache=True", "cache=False")
COUNTER = '''    from numba.extending import intrinsic as _intrinsic
    from llvmlite import ir as _ir
    import numba as _numba

    @_intrinsic
    def _cycles(typingctx):
        def codegen(context, builder, signature, args):
            fn = builder.module.declare_intrinsic("llvm.readcyclecounter", fnty=_ir.FunctionType(_ir.IntType(64), []))
            return builder.call(fn, [])
        return _numba.types.int64(), codegen

'''
anchor = '    @njit(inline="always")\n    def _tile_rows'
assert anchor in source, anchor
source = source.replace(anchor, COUNTER + anchor, 1)
PHASES = [("        # 1. the scores", "scores (slots, window)"), ("        # 2. the factor update", "fit sums"),
          ("        _head_step(h, q, k_new, b_q, b_k, lhs, rhs, lam, iters, update_bases, q_hat, k_hat)\n", "factor update"),
          ("        # 3. the selection\n", "proxy logits"),
          ("        _proxy_top_k_row(h, logits, scaling, first, g_rows, k, selected, top_mass, mass)\n", "softmax, mass, top-k"),
          ("        # 4. the fill", "fill plan, prefetch"), ("        top = 0\n        row = np.empty((1, d), np.uint32)\n", "fill copy"),
          ("        # 5. attention", "probabilities"), ("        total = np.zeros((g_rows, d), np.float32)\n", "values")]
for i, (line, _) in enumerate(PHASES):
    assert line in source, line
    source = source.replace(line, f"        STAMPS[h, {i}] = _cycles()\n" + line, 1)
last = "                out[h, g, j] = total[g, j] + p * v_new[h, j]\n"
assert last in source, last
source = source.replace(last, last + f"        STAMPS[h, {len(PHASES)}] = _cycles()\n", 1)
for old, new in [("q_hat, k_hat, out, missed, largest):", "q_hat, k_hat, out, missed, largest, STAMPS):"),
                 ("q_hat, k_hat, out, missed, largest)\n", "q_hat, k_hat, out, missed, largest, STAMPS)\n"),
                 ("tile_words, q_hat, k_hat, out):", "tile_words, q_hat, k_hat, out, STAMPS):"),
                 ("int(TILE_WORDS), q_hat, k_hat, out)", "int(TILE_WORDS), q_hat, k_hat, out, STAMPS)")]:
    assert old in source, old
    source = source.replace(old, new)
source = source.replace("\nTILE_WORDS = ", f"\nSTAMPS = np.zeros((256, {len(PHASES) + 1}), np.int64)\nTILE_WORDS = ")
path = pathlib.Path(tempfile.mkdtemp()) / "lrqk_fused_cycles.py"
path.write_text(source)
spec = importlib.util.spec_from_file_location("lrqk_fused_cycles", path)
P = importlib.util.module_from_spec(spec); spec.loader.exec_module(P); P.warm_up()

counter = P._cycles
@njit
def cycles():
    return counter()
t0, c0 = time.perf_counter(), cycles(); time.sleep(0.5); per_us = (cycles() - c0) / (time.perf_counter() - t0) / 1e6
spent = np.zeros(len(PHASES)); calls = [0, 0.0]; timing = [False]
decode_step = P.decode_step
def timed_step(*args, **kwargs):
    t = time.perf_counter(); result = decode_step(*args, **kwargs); wall = time.perf_counter() - t
    if timing[0]:
        spent[:] += np.diff(P.STAMPS[:args[0].shape[0]].astype(np.float64), axis=1).sum(0)
        calls[0] += 1; calls[1] += wall
    return result
P.decode_step = timed_step
L.lrqk_fused = P
length, steps = int(sys.argv[1]), int(sys.argv[2])
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 2)
be = KVShrinkBackend(None); model, tok = be.load_model()
cache = be.make_cache("lrqk:top_k=512,slot_dtype=float16", model)
logits, _ = prefill(model, cache, TokenCorpus(tok).ids[:length])
with torch.no_grad():
    for i in range(steps):
        timing[0] = i > 1
        logits = _step(model, cache, torch.tensor([[int(logits[0].argmax())]]))
n = calls[0]
print(f"{length} tokens, {torch.get_num_threads()} threads: {n} layer calls, the call {1e6 * calls[1] / n:.1f} us wall")
for (_, name), cyc in zip(PHASES, spent):
    print(f"  {name:24s} {cyc / per_us / n:7.1f} us per call (its KV rows summed)")
print(f"  {'sum':24s} {spent.sum() / per_us / n:7.1f}")
