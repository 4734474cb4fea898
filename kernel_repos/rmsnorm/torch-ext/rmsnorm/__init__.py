"""hubfuse RMSNorm kernels: standard, zero-centred (1 + w) and gated RMSNorm, forward and backward."""
from . import layers
from .ops import rms_norm, rms_norm_gated, rms_norm_zero_centered
from .reference import rms_norm_gated_hf, rms_norm_hf, rms_norm_zero_centered_hf

__all__ = [
    "layers",
    "rms_norm", "rms_norm_zero_centered", "rms_norm_gated",
    "rms_norm_hf", "rms_norm_zero_centered_hf", "rms_norm_gated_hf",
]
