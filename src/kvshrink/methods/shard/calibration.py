"""Per-layer key budgets for ``key_alloc="global"``: spectra of the pre-RoPE keys measured on
calibration tokens, and one DP over the component groups of all layers."""

from __future__ import annotations

import torch

from kvshrink.codecs.bit_allocation import allocate_bits, group_sizes, group_variances
from kvshrink.codecs.pca import fit_pca
from kvshrink.methods.shard.config import ShardConfig


def pre_rope_key_spectra(model: torch.nn.Module, info, input_ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, the PCA variances of the pre-RoPE keys (all KV heads stacked) on ``input_ids``.

    Keys are captured at the output of ``k_proj`` (``k_norm`` where the model has one, as Qwen3),
    i.e. before RoPE, during one ordinary forward without a cache.
    """
    layers = model.model.layers
    captured: list[torch.Tensor | None] = [None] * len(layers)
    hooks = []
    for i, layer in enumerate(layers):
        attn = layer.self_attn
        target = getattr(attn, "k_norm", None) or attn.k_proj

        def hook(_module, _inputs, output, i=i):
            captured[i] = output.detach().reshape(-1, info.num_kv_heads * info.head_dim).float()

        hooks.append(target.register_forward_hook(hook))
    try:
        with torch.no_grad():
            model(input_ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return [fit_pca(k, k.shape[1]).variances for k in captured]


def allocate_layer_budgets(spectra: list[torch.Tensor], key_bits: float, group: int,
                           drop_penalty: float = 1.0, levels: str = "lloyd") -> list[float]:
    """Bits per key element for each layer: one DP over the component groups of all layers, with each
    layer's variances normalised by its total (relative error), under ``key_bits`` on average."""
    variances, sizes, owner = [], [], []
    for layer, spectrum in enumerate(spectra):
        rel = spectrum / spectrum.sum().clamp_min(1e-30)
        layer_sizes = group_sizes(rel.shape[0], group)
        variances += group_variances(rel, layer_sizes)
        sizes += layer_sizes
        owner += [layer] * len(layer_sizes)
    dim = spectra[0].shape[0]
    bits = allocate_bits(variances, sizes, int(round(key_bits * dim * len(spectra))), drop_penalty=drop_penalty,
                         levels=levels)
    per_layer = [0.0] * len(spectra)
    for layer, b, size in zip(owner, bits, sizes):
        per_layer[layer] += b * size / dim
    return per_layer


def global_key_budgets(model: torch.nn.Module, info, cfg: ShardConfig) -> list[float]:
    """Per-layer key budgets from spectra measured on seeded random calibration tokens."""
    g = torch.Generator().manual_seed(cfg.seed)
    vocab = model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(0, vocab, (1, cfg.calibration_tokens), generator=g)
    spectra = pre_rope_key_spectra(model, info, ids)
    group = cfg.pca_group or max(1, info.num_kv_heads * info.head_dim // 16)
    return allocate_layer_budgets(spectra, cfg.key_bits, group, cfg.drop_penalty, cfg.k_levels)
