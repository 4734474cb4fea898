"""torch.distributed collectives under the name this torch has (vendored into every hub variant).

torch >= 2.13 names them `all_gather_single` / `reduce_scatter_single` and warns at every call of the old
`all_gather_into_tensor` / `reduce_scatter_tensor`; torch 2.11 has only the old names. None where this torch
has no torch.distributed.
"""
import torch

all_gather_single = reduce_scatter_single = None
if torch.distributed.is_available():
    import torch.distributed as dist

    all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
