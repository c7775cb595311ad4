"""Arrival counters: a kernel whose programs each write a partial result, and whose last program to finish
combines them, in one launch instead of two (the miss plan packed after the rows' plans, a row's
log-sum-exp after its blocks' sums, a row's split attention merged after its splits).

Each program stores its partial result, then takes a ticket from a counter in device memory (``atomic_add``,
acquire-release at device scope, after a barrier so every thread's stores are ordered before it); the
program that draws the last ticket reads the partials (``cache_modifier=".cg"``: from L2, past the SM's
cache), combines them and resets the counter for the next launch. The counters are zeroed once per device
and stream and reused: each launch leaves them at zero. Triton's interpreter runs programs one after
another, where the last ticket is the last program's.
"""

from __future__ import annotations

import torch

from kvshrink.kernels.backend import triton as _load_triton

triton = _load_triton()
import triton.language as tl  # noqa: E402

__all__ = ["counters", "last_to_arrive"]

_COUNTERS: dict[tuple, torch.Tensor] = {}


def counters(device: torch.device, n: int) -> torch.Tensor:
    """``n`` (or more) zeroed int32 arrival counters on ``device``, kept for the launches that follow on the
    current stream (a launch leaves its counters at zero)."""
    device = torch.device(device)
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    held = _COUNTERS.get(key)
    if held is None or held.numel() < n:
        held = torch.zeros(max(n, 64, 2 * (held.numel() if held is not None else 0)), dtype=torch.int32,
                           device=device)
        _COUNTERS[key] = held
    return held


@triton.jit
def last_to_arrive(counter, n):
    """Whether this program is the last of ``n`` to arrive at ``counter`` (which it then resets). Stores made
    before the call are visible to the last program's ``.cg`` loads after it."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
    last = ticket == n - 1
    if last:
        tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    return last
