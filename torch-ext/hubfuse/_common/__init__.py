"""Code every op package shares: the op namespace (`_ops`), device dispatch (`device`), the cached Triton launch
(`launch`, imports triton), input checks (`checks`) and the two-front-door differentiable ops (`custom_op`).
The build vendors it into every hub variant as its `_common` sub-package."""
