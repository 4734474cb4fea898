"""hubfuse MoE experts: Triton grouped GEMM for the transformers v5 experts layout, forward and backward;
expert parallelism over an EP mesh (`shard_experts`)."""
from . import expert_parallel, layers
from .expert_parallel import set_capacity, shard_experts
from .layers import register_experts_implementation
from .ops import moe_experts
from .reference import experts_hf

__all__ = ["layers", "expert_parallel", "shard_experts", "set_capacity", "moe_experts", "experts_hf", "register_experts_implementation"]
