"""hubfuse fused cross-entropy: linear + cross-entropy without logits, cross-entropy from logits with the
gradient written in place, and a per-instance causal-LM loss hook for transformers."""
from . import layers
from .integration import (disable_fused_loss, enable_fused_loss, fused_loss_enabled, fused_loss_options,
                          install_loss_function, make_loss_function)
from .ops import cross_entropy, default_chunk_size, linear_cross_entropy
from .reference import cross_entropy_reference, linear_cross_entropy_reference

__all__ = [
    "layers",
    "linear_cross_entropy", "cross_entropy", "default_chunk_size",
    "cross_entropy_reference", "linear_cross_entropy_reference",
    "enable_fused_loss", "disable_fused_loss", "fused_loss_enabled", "fused_loss_options", "install_loss_function",
    "make_loss_function",
]
