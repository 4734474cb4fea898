"""hubfuse rotary kernels: full and partial RoPE (q and k in one launch) and fused q/k RMSNorm + RoPE."""
from . import layers
from .ops import (apply_rotary_pos_emb, apply_rotary_pos_emb_, apply_rotary_pos_emb_flat, qk_norm_rope,
                  qk_norm_rope_flat, qk_norm_rope_zero_centered)
from .reference import apply_rotary_pos_emb_hf, qk_norm_rope_hf

__all__ = [
    "layers",
    "apply_rotary_pos_emb", "apply_rotary_pos_emb_flat", "apply_rotary_pos_emb_", "qk_norm_rope",
    "qk_norm_rope_zero_centered", "qk_norm_rope_flat", "apply_rotary_pos_emb_hf", "qk_norm_rope_hf",
]
