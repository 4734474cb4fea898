"""When a fused op may read a submodule's parameters instead of calling it (vendored into every hub variant).

A fused op that takes `q_proj.weight` or `down_proj.weight` and runs its own GEMM skips the module's call: its
hooks would not run and a wrapper's own computation (a LoRA / PEFT layer, a quantized or other Linear class) would
be lost, silently. So the fused path is taken only for modules whose call is exactly what the op computes; every
other module is called. Global module hooks (`torch.nn.modules.module.register_module_forward_hook` and the like)
are not consulted: they are process-wide, and tools use them to attribute work to modules (FlopCounterMode).
"""
from torch import nn

# Set on a forward hook that only records an attention module's attention weights (transformers' output
# recorder, installed by hubfuse.KernelConfig on a Layout's attention that stands in for the HF class): a fused path
# may skip such a hook where the attention returns no weights (every implementation but "eager").
RECORDS_ATTENTION_WEIGHTS = "hubfuse_records_attention_weights"


def hooked(module: nn.Module) -> bool:
    """Whether the module has a forward, forward-pre, backward or backward-pre hook of its own."""
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def plain_linear(module, dtype=None) -> bool:
    """True for an `nn.Linear` itself (no subclass, wrapper or adapter) without hooks or a forward of its own
    instance (accelerate's offloading hooks replace `module.forward`), with its weight a parameter (of `dtype` if
    given): calling it is `F.linear(x, weight, bias)`, which a fused op may compute from the parameters."""
    if type(module) is not nn.Linear or hooked(module) or "forward" in module.__dict__:
        return False
    weight = module._parameters.get("weight")
    return weight is not None and (dtype is None or weight.dtype == dtype)


def only_weight_recorders(module: nn.Module) -> bool:
    """Whether the module's hooks, if any, are all attention-weight recorders (`RECORDS_ATTENTION_WEIGHTS`)."""
    if module._forward_pre_hooks or module._backward_hooks or module._backward_pre_hooks:
        return False
    return all(getattr(hook, RECORDS_ATTENTION_WEIGHTS, False) for hook in module._forward_hooks.values())
