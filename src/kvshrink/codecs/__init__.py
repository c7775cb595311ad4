"""Reusable tensor codecs (no cache logic): RoPE, bit packing, Hadamard rotations, PCA + DP bit
allocation, k-means vector quantization, Lloyd-Max / TurboQuant."""

from .bitpack import pack_bits, packed_size, unpack_bits
from .hadamard import RandomRotation, hadamard_matrix, is_power_of_two, random_orthogonal
from .lloyd_max import TURBO_BITS, TurboCode, TurboQuantizer, lloyd_max_boundaries, lloyd_max_centroids
from .bit_allocation import PCA_BITS, allocate_bits, group_sizes, group_variances
from .pca import PCACode, PCAFit, encode_pca, fit_pca
from .rope import apply_rope, apply_rope_paired, pair_order, rope_phases, rotate_half, undo_rope
from .vq import VQCode, assign_codes, fit_codebook, gaussian_codebook, vq_encode

__all__ = [
    "pack_bits", "packed_size", "unpack_bits",
    "RandomRotation", "hadamard_matrix", "is_power_of_two", "random_orthogonal",
    "TURBO_BITS", "TurboCode", "TurboQuantizer", "lloyd_max_boundaries", "lloyd_max_centroids",
    "PCA_BITS", "PCACode", "PCAFit", "allocate_bits", "encode_pca", "fit_pca", "group_sizes", "group_variances",
    "apply_rope", "apply_rope_paired", "pair_order", "rope_phases", "rotate_half", "undo_rope",
    "VQCode", "assign_codes", "fit_codebook", "gaussian_codebook", "vq_encode",
]
