"""hubfuse MoE experts: Triton grouped GEMM for the transformers v5 experts layout, forward and backward."""
from . import layers
from .layers import register_experts_implementation
from .ops import moe_experts
from .reference import experts_hf

__all__ = ["layers", "moe_experts", "experts_hf", "register_experts_implementation"]
