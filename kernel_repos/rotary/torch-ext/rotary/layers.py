import torch
from torch import nn
from .ops import apply_rotary_pos_emb
class RotaryPosEmb(nn.Module):
    has_backward = True
    can_torch_compile = True
    def forward(self, q, k, cos, sin, unsqueeze_dim=1):
        return apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim)
