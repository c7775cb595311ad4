"""kvshrink leaves the process as it found it: importing it and building a cache on CPU sets no environment
variable and neither re-imports nor removes a Triton module that was already loaded."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_SCRIPT = r"""
import os, sys
import torch
import transformers.cache_utils                      # kvshrink's dependencies, imported as they are anyway
import triton, triton.language                      # another library's Triton, loaded before kvshrink
from transformers import AutoModelForCausalLM, LlamaConfig

def triton_modules():
    return {name: id(module) for name, module in sys.modules.items() if name.split(".")[0] == "triton"}

env, modules = dict(os.environ), triton_modules()
import kvshrink
config = LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=64, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1)
model = AutoModelForCausalLM.from_config(config).eval()
for method in ("full", "streaming", "kivi"):     # (shard and lrqk: the same framework, plus numba)
    cache = kvshrink.make_cache(method, model)
changed_env = {k for k in set(env) | set(os.environ) if env.get(k) != os.environ.get(k)}
after = triton_modules()
replaced = {name for name, ident in modules.items() if after.get(name) != ident}
assert not changed_env, f"environment changed: {sorted(changed_env)}"
assert not replaced, f"Triton modules removed or re-imported: {sorted(replaced)[:5]}"
print("ok")
"""


def test_import_and_make_cache_leave_the_environment_and_triton_alone():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "KVSHRINK_GPU_PATH")}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]


def test_kernels_run_interpreted_without_touching_the_environment():
    """Without a GPU kvshrink's kernels run in Triton's interpreter, chosen per kernel, while Triton itself
    (imported before kvshrink, as transformers does) stays in compiled mode for everyone else."""
    script = r"""
import os, sys, torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from kvshrink.kernels.backend import interpreting
from kvshrink.kernels.exact_attention import exact_attention
from kvshrink.cache.attention import exact_partial
assert interpreting() and "TRITON_INTERPRET" not in os.environ
q, k, v = torch.randn(1, 4, 1, 16), torch.randn(1, 2, 37, 16), torch.randn(1, 2, 37, 16)
out, lse = exact_attention(q, k, v, 0.25)
ref = exact_partial(q, k, v, 0.25)
ref_out, ref_lse = ref.out, ref.lse
assert torch.allclose(out, ref_out, atol=1e-5) and torch.allclose(lse, ref_lse, atol=1e-5)
assert isinstance(tl.sum, JITFunction) and isinstance(tl.standard.sum, JITFunction)   # restored after the launch
assert "TRITON_INTERPRET" not in os.environ
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=str(ROOT / "src"), HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
