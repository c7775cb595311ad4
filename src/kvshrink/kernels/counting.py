"""Counting what a decode step launches and where it waits for the device.

``OpCounter`` is a ``TorchDispatchMode``: it sees every aten op that reaches a kernel (composite ops
arrive decomposed, ops run inside another op's kernel are not seen) and sorts them into

- *launches*: ops that run a device kernel, i.e. every op except views and metadata/allocation-only
  ops (``view``, ``transpose``, ``expand``, ``empty``...), plus the Triton kernels kvshrink launches
  (reported through :func:`kernel_launch`);
- *syncs*: ops that make the host wait for the device: ``_local_scalar_dense`` (``.item()``,
  ``int(t)``, ``bool(t)``, ``if t.any():``), ``equal``, data-dependent output sizes (``nonzero``,
  ``masked_select``, ``unique``..., boolean-mask indexing), error checks that read a device flag
  (``_linalg_check_errors`` behind ``linalg_solve``, ``linalg_inv``, ``cholesky``), and copies from a
  CUDA tensor to the host (on CUDA only).

``count_decode_step(model, cache, input_ids, ...)`` runs one forward and attributes the ops between
each layer's ``cache.update`` call and its attention output projection (``self_attn.o_proj``) to that
layer: the cost of the cache and of attention, per layer, comparable between a ``DynamicCache`` with
SDPA and a kvshrink cache. Usage (a method's GPU-path test)::

    from kvshrink.kernels.backend import force_gpu_path
    from kvshrink.kernels.counting import count_decode_step
    with force_gpu_path():
        ...prefill...
        c = count_decode_step(model, cache, next_ids)
    assert c.layer_syncs == 0 and c.layer_launches <= 3 * stock.layer_launches, c.describe()

``Python`` calls that sync without an aten op (``tensor.tolist()``, ``torch.cuda.synchronize``) are
not seen here; on a real GPU, ``count_decode_step(..., cuda_sync_debug=True)`` also counts the
warnings of ``torch.cuda.set_sync_debug_mode``.
"""

from __future__ import annotations

import collections
import contextlib
import threading
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["OpCounter", "StepCount", "count_decode_step", "kernel_launch", "uncounted", "SYNC_OPS", "NO_LAUNCH_OPS"]

# ops that make the host wait for the device (by name of the overload packet)
SYNC_OPS = frozenset({
    "_local_scalar_dense", "item", "is_nonzero", "equal", "allclose",
    "nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "unique_dim_consecutive", "bincount", "histc", "_linalg_check_errors", "linalg_solve", "linalg_inv",
    "cholesky", "repeat_interleave_tensor_nosize", "argwhere", "_assert_tensor_metadata_sync",
    "masked_scatter_sync", "_nested_tensor_from_mask", "segment_reduce_nosize",
})
# ops that run no device kernel: allocation and metadata only (views are recognised by their schema)
NO_LAUNCH_OPS = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
    "resize_", "set_", "size", "stride", "numel", "dim", "is_contiguous", "sym_size", "sym_stride",
    "sym_numel", "sym_storage_offset", "storage_offset", "_reshape_alias", "_unsafe_view", "is_same_size",
    "_has_compatible_shallow_copy_type", "record_stream", "_to_copy_noop",
})

_state = threading.local()


def _active() -> list["OpCounter"]:
    if not hasattr(_state, "counters"):
        _state.counters = []
        _state.suppress = 0
    return _state.counters


@contextlib.contextmanager
def kernel_launch(name: str) -> Iterator[None]:
    """Wrap the launch of one kvshrink kernel: counted as one launch by every active counter; the aten
    ops Triton's interpreter runs to emulate it on CPU are not counted."""
    counters = _active()
    for c in counters:
        if c.counting and not _state.suppress:
            c.kernels[name] += 1
    _state.suppress += 1
    try:
        yield
    finally:
        _state.suppress -= 1


@contextlib.contextmanager
def uncounted() -> Iterator[None]:
    """Run work that is not part of the step being counted (a kernel's one-time check on first use): no launch or
    synchronisation counted here, and CUDA's sync debug mode off meanwhile (a check's torch path reads the device;
    under the "error" mode that would fail the check and leave the kernels untrusted for good)."""
    from torch.utils._python_dispatch import _disable_current_modes

    _active()
    _state.suppress += 1
    debug_mode = torch.cuda.get_sync_debug_mode() if torch.cuda.is_available() else 0
    try:
        if debug_mode:
            torch.cuda.set_sync_debug_mode(0)
        with _disable_current_modes():
            yield
    finally:
        if debug_mode:
            torch.cuda.set_sync_debug_mode(debug_mode)
        _state.suppress -= 1


def _is_view(func: Any) -> bool:
    return bool(getattr(func, "is_view", False))


class OpCounter(TorchDispatchMode):
    """Counts aten ops (``ops``), device launches (``launches``) and host syncs (``syncs``).

    ``counting`` switches counting off and on without leaving the mode (regions of a forward).
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()
        self.launch_ops: collections.Counter[str] = collections.Counter()
        self.sync_ops: collections.Counter[str] = collections.Counter()
        self.kernels: collections.Counter[str] = collections.Counter()
        self.counting = True

    @property
    def launches(self) -> int:
        return sum(self.launch_ops.values()) + sum(self.kernels.values())

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    @property
    def total_ops(self) -> int:
        return sum(self.ops.values())

    def __enter__(self):
        _active().append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        _active().remove(self)
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting and not getattr(_state, "suppress", 0):
            name = func.overloadpacket.__name__
            self.ops[name] += 1
            if name in SYNC_OPS or _device_to_host(name, args, kwargs):
                self.sync_ops[name] += 1
            if name not in NO_LAUNCH_OPS and not _is_view(func):
                self.launch_ops[name] += 1
        return func(*args, **kwargs)


def _device_to_host(name: str, args: tuple, kwargs: dict) -> bool:
    """A copy from a CUDA tensor to the host (waits for the device)."""
    if name not in ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize"):
        return False
    if name == "_to_copy":
        src, dst = args[0], kwargs.get("device")
        return isinstance(src, torch.Tensor) and src.is_cuda and dst is not None and torch.device(dst).type == "cpu"
    dst, src = args[0], args[1] if len(args) > 1 else None
    return (isinstance(src, torch.Tensor) and isinstance(dst, torch.Tensor) and src.is_cuda
            and dst.device.type == "cpu")


@dataclass
class StepCount:
    """What one decode step ran: per layer (the region between ``cache.update`` and ``o_proj``, summed over
    layers and divided by their number) and for the whole forward."""

    num_layers: int
    layer_ops: float
    layer_launches: float
    layer_syncs: float
    step_ops: int
    step_launches: int
    step_syncs: int
    layer_sync_ops: dict[str, int] = field(default_factory=dict)
    step_sync_ops: dict[str, int] = field(default_factory=dict)
    layer_launch_ops: dict[str, int] = field(default_factory=dict)
    kernels: dict[str, int] = field(default_factory=dict)
    cuda_sync_warnings: int | None = None
    per_layer_launches: list[int] = field(default_factory=list)
    per_layer_syncs: list[int] = field(default_factory=list)

    def row(self) -> dict[str, float]:
        return {"ops/layer": self.layer_ops, "launches/layer": self.layer_launches, "syncs/layer": self.layer_syncs,
                "ops/step": self.step_ops, "launches/step": self.step_launches, "syncs/step": self.step_syncs}

    def describe(self) -> str:
        return (f"per layer: {self.layer_ops:.1f} ops, {self.layer_launches:.1f} launches, {self.layer_syncs:.2f} "
                f"syncs {dict(self.layer_sync_ops)}; step: {self.step_ops} ops, {self.step_launches} launches, "
                f"{self.step_syncs} syncs {dict(self.step_sync_ops)}; kernels {dict(self.kernels)}; "
                f"launches in layers (all layers) {dict(self.layer_launch_ops)}; launches of each layer "
                f"{self.per_layer_launches}")


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    base = getattr(model, "model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError("count_decode_step: expected a decoder with model.model.layers (Llama family)")
    return list(layers)


def count_decode_step(model: torch.nn.Module, cache: Any, input_ids: torch.Tensor,
                      cuda_sync_debug: bool = False, **forward_kwargs) -> StepCount:
    """Run ``model(input_ids, past_key_values=cache, **forward_kwargs)`` once (no grad) and count its ops.

    Each layer's region starts when the layer calls ``cache.update`` and ends when its ``self_attn.o_proj``
    is called; everything else (embeddings, norms, MLPs, projections, RoPE, the mask) counts only towards
    the step totals.
    """
    layers = _decoder_layers(model)
    whole, region = OpCounter(), OpCounter()
    region.counting = False
    original_update = cache.update

    marks: list[tuple[int, int]] = []
    per_launches: list[int] = []
    per_syncs: list[int] = []

    def update(*args, **kwargs):
        region.counting = True
        marks.append((region.launches, region.syncs))
        return original_update(*args, **kwargs)

    def stop(module, args):
        if region.counting and marks:
            launches, syncs = marks.pop()
            per_launches.append(region.launches - launches)
            per_syncs.append(region.syncs - syncs)
        region.counting = False

    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(stop) for layer in layers]
    cache.update = update
    sync_warnings = None
    try:
        with contextlib.ExitStack() as stack:
            if cuda_sync_debug and torch.cuda.is_available():
                caught = stack.enter_context(warnings.catch_warnings(record=True))
                warnings.simplefilter("always")
                before = torch.cuda.get_sync_debug_mode()
                torch.cuda.set_sync_debug_mode(1)
                stack.callback(torch.cuda.set_sync_debug_mode, before)
            else:
                caught = None
            stack.enter_context(torch.no_grad())
            stack.enter_context(whole)
            stack.enter_context(region)
            model(input_ids=input_ids, past_key_values=cache, **forward_kwargs)
        if caught is not None:
            sync_warnings = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    finally:
        del cache.update  # back to the class's method
        for h in hooks:
            h.remove()
    n = len(layers)
    return StepCount(
        num_layers=n,
        layer_ops=region.total_ops / n, layer_launches=region.launches / n, layer_syncs=region.syncs / n,
        step_ops=whole.total_ops, step_launches=whole.launches, step_syncs=whole.syncs,
        layer_sync_ops=dict(region.sync_ops), step_sync_ops=dict(whole.sync_ops),
        layer_launch_ops=dict(region.launch_ops), kernels=dict(whole.kernels),
        cuda_sync_warnings=sync_warnings, per_layer_launches=per_launches, per_layer_syncs=per_syncs,
    )
