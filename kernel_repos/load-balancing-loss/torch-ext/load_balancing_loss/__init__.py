"""hubfuse load-balancing loss: the fused MoE auxiliary loss over all layers, and a fused softmax-top-k router."""
from . import layers
from .integration import disable_fused_aux_loss, enable_fused_aux_loss, fused_aux_loss_enabled
from .ops import (
    group_load_balancing_loss_func,
    load_balancing_loss,
    load_balancing_loss_func,
    softmax_topk,
    topk_router,
)
from .reference import load_balancing_loss_hf, topk_router_hf

__all__ = [
    "layers",
    "load_balancing_loss", "load_balancing_loss_func", "group_load_balancing_loss_func", "softmax_topk", "topk_router",
    "enable_fused_aux_loss", "disable_fused_aux_loss", "fused_aux_loss_enabled",
    "load_balancing_loss_hf", "topk_router_hf",
]
