"""``lrqk``: low-rank query/key scoring, exact top-k attention, and a two-tier cache (`layer` explains the
method). Importing the package registers the method.

- `layer`: ``LRQKLayer`` (state, prefill, commit and the decode step's dispatch) and its options;
- `cpu_step`: the whole CPU decode step of one layer in one numba call;
- `tiers`: the slow tier (every token's K/V, host or disk) and the fast tier of slots;
- `prefill`: chunked prefill; `report`: data-movement counters and per-step logs.

The GPU path's Triton kernels are in ``kvshrink.kernels.lrqk_*``, the CPU path's numba ones in
``kvshrink.kernels.cpu.lrqk_*``, the factor math in ``kvshrink.codecs.lowrank``.
"""

from kvshrink.methods.lrqk.layer import LRQKLayer, LRQKOptions
from kvshrink.methods.lrqk.prefill import chunked_prefill
from kvshrink.methods.lrqk.report import step_report

__all__ = ["LRQKLayer", "LRQKOptions", "chunked_prefill", "step_report"]
