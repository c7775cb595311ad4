"""Rotary position embedding (rotate-half convention, as Llama / Qwen2 / Mistral in transformers).

`apply_rope` rotates each pair of channels ``(i, i + d/2)`` by the angle of its frequency at the
token's position; `undo_rope` applies the inverse rotation, so ``undo_rope(apply_rope(x)) == x`` up to
float rounding (the rotation is orthogonal; no information is lost).

``cos`` / ``sin`` are what the model's rotary embedding returns: ``[B, T, d]`` (broadcast over heads)
or already ``[B, 1, T, d]`` / anything broadcastable to ``x``. Both halves of ``cos`` / ``sin`` must be
equal (``cat(freqs, freqs)``), which is how transformers builds them.
"""

from __future__ import annotations

import torch

__all__ = ["rotate_half", "apply_rope", "undo_rope", "pair_order", "rope_phases", "apply_rope_paired"]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """``[a, b] -> [-b, a]`` along the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _broadcastable(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    # transformers gives [B, T, d]; keys are [B, H, T, d]: insert the head axis.
    if t.dim() == x.dim() - 1 and x.dim() >= 3:
        t = t.unsqueeze(-3)
    return t.to(device=x.device)


def _promoted(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """``x, cos, sin`` in their common dtype: float32 cos/sin rotate half-precision keys in float32
    (rounding the angles to bf16 would misplace every key by up to ~1%)."""
    dtype = torch.promote_types(x.dtype, cos.dtype)
    cos, sin = _broadcastable(x, cos), _broadcastable(x, sin)
    return x.to(dtype), cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[..., T, d]``) to its positions: ``x*cos + rotate_half(x)*sin`` (in the common
    dtype of ``x`` and ``cos``)."""
    if x.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head size, got {x.shape[-1]}")
    x, cos, sin = _promoted(x, cos, sin)
    return x * cos + rotate_half(x) * sin


def undo_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of `apply_rope` (rotation by the negative angle): ``x*cos - rotate_half(x)*sin`` (in the
    common dtype of ``x`` and ``cos``)."""
    if x.shape[-1] % 2:
        raise ValueError(f"RoPE needs an even head size, got {x.shape[-1]}")
    x, cos, sin = _promoted(x, cos, sin)
    # x*cos - rotate_half(x)*sin, half by half in place: one output-sized tensor, no temporaries
    # (compression runs it on a whole layer's prompt keys)
    half = x.shape[-1] // 2
    out = x * cos
    out[..., :half].addcmul_(x[..., half:], sin[..., :half])
    out[..., half:].addcmul_(x[..., :half], sin[..., half:], value=-1)
    return out


def pair_order(head_dim: int, device=None) -> torch.Tensor:
    """Channel order ``[0, h, 1, h+1, ...]`` (h = d/2) that puts each RoPE pair side by side."""
    half = head_dim // 2
    return torch.stack([torch.arange(half, device=device), torch.arange(half, 2 * half, device=device)], -1).reshape(-1)


def rope_phases(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotation of each pair as a unit complex number ``cos + i·sin``: ``[..., T, d/2]`` complex."""
    half = cos.shape[-1] // 2
    return torch.complex(cos[..., :half].float(), sin[..., :half].float())


def apply_rope_paired(x: torch.Tensor, phases: torch.Tensor) -> torch.Tensor:
    """`apply_rope` for ``x`` (float32, ``[..., T, d]``) whose channels are in `pair_order`: one
    complex product per pair instead of the rotate-half arithmetic (several times faster on CPU).
    Returns the rotated rows in the same pair order."""
    pairs = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2).contiguous())
    return torch.view_as_real(pairs * phases).reshape(x.shape)
