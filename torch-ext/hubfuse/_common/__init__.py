"""Code every op package shares: the op namespace (`_ops`), device dispatch (`device`), the cached Triton launch
(`launch`, imports triton), input checks (`checks`), the two-front-door differentiable ops (`custom_op`), activations
released until the backward (`released`), the causal marker (`causal_marker`), the initialisation of parameters
a checkpoint lacked (`missing_init`) and when a fused op may bypass a submodule's call (`modules`).
The build vendors it into every hub variant as its `_common` sub-package."""
