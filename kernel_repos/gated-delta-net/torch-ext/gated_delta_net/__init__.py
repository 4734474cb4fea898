"""hubfuse gated delta rule kernels (Qwen3.5 / Qwen3-Next linear attention): chunked gated delta rule, causal
depthwise conv1d + SiLU, and the fused GatedDeltaNet core, forward and backward."""
from . import layers
from .ops import (causal_conv1d, causal_conv1d_fn, causal_conv1d_update, chunk_gated_delta_rule,
                  gated_delta_net_core, gated_delta_rule_qwen3_5)
from .reference import (causal_conv1d_fn_hf, causal_conv1d_update_hf, chunk_gated_delta_rule_hf,
                        recurrent_gated_delta_rule_hf)

__all__ = [
    "layers",
    "chunk_gated_delta_rule", "gated_delta_rule_qwen3_5", "causal_conv1d", "causal_conv1d_fn",
    "causal_conv1d_update", "gated_delta_net_core",
    "chunk_gated_delta_rule_hf", "recurrent_gated_delta_rule_hf", "causal_conv1d_fn_hf", "causal_conv1d_update_hf",
]
