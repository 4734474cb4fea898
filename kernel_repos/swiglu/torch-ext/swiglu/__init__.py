"""hubfuse SwiGLU MLP: fused `silu(gate) * up` on the concatenated gate/up projection, forward and backward,
the gate/up-fused MLP Layout and the RMSNorm + MLP fusion."""
from . import layers
from .ops import rms_norm_swiglu_mlp, swiglu, swiglu_mlp
from .reference import swiglu_hf, swiglu_mlp_hf

__all__ = ["layers", "swiglu", "swiglu_mlp", "rms_norm_swiglu_mlp", "swiglu_hf", "swiglu_mlp_hf"]
