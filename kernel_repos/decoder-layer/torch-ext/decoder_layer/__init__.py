"""hubfuse decoder layer: the dense decoder layer of Qwen3 / Llama / Qwen2 (attention, MLP, both norms and the
residuals) as one autograd node in eager training, built from the rotary, swiglu and rmsnorm kernels."""
from . import layers

__all__ = ["layers"]
