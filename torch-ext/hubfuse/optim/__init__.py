"""hubfuse's optimizers: `AdamW`, torch's AdamW with a one-pass update of large tensors on the GPU."""
from .adamw import AdamW

__all__ = ["AdamW"]
