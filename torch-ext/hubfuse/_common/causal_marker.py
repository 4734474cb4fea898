"""The causal marker (vendored into every hub variant): a 4D attention mask with no key positions, (1, 1, 0, 0).

transformers' mask builders return a 4D mask unchanged (`create_causal_mask` reads it as already prepared), so a
decoder given it as `attention_mask` builds no mask and hands it to each attention module. hubfuse's attention
Layouts read it as "causal over the whole sequence, no padding, no packing": the attention function gets no mask
and takes SDPA's / flash-attention's `is_causal` path. `hubfuse.training` passes it only to decoders whose every
attention module is such a Layout (`accepts_causal_marker`), for an implementation that reads a None mask as
causal. A real mask always has key positions, so it is never mistaken for the marker.
"""
import torch


def causal_marker(device) -> torch.Tensor:
    return torch.empty((1, 1, 0, 0), dtype=torch.bool, device=device)


def is_causal_marker(mask) -> bool:
    return isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == 0
