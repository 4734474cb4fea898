"""Per-instance switch: make one model's forward compute its MoE aux loss with the fused kernel.

No KernelConfig hook reaches `load_balancing_loss_func`: transformers' `*ForCausalLM.forward` looks it up
in its modeling module's globals at call time. `enable_fused_aux_loss(model)` gives that one instance its
own copy of the class's forward function whose globals are a copy of the modeling module's globals with
`load_balancing_loss_func` replaced by the fused `load_balancing_loss_func`; the decorator chain
(`can_return_tuple`, ...) is rebuilt around the copy, and the result is bound to the instance
(`model.forward = MethodType(...)`).

When the hubfuse cross-entropy hook is on the instance, its `aux_loss_fn` slot is used instead (see
`enable_fused_aux_loss`).

Why this design: nothing global is touched (no module attribute is swapped, not even temporarily), so other
instances of the same architecture, other threads and later plain loads see stock transformers; it is safe
under threads and async code (no swap-and-restore window), and `torch.compile` traces it like any function.
Cost: the copied globals are a snapshot taken at enable time (later monkey-patches of that modeling module
are not seen by this instance until you disable and re-enable).
"""
import types

from torch import nn

from .ops import group_load_balancing_loss_func, load_balancing_loss_func

_HF_NAME = "load_balancing_loss_func"
_MARK = "_hubfuse_fused_aux_loss"  # per-instance state (a plain dict in the instance __dict__)
_CE_STATE = "_hubfuse_fused_loss"  # the hubfuse cross-entropy hook's per-instance state (its aux_loss_fn slot)


def _rebuild(fn, new_globals: dict):
    """Copy of `fn` (and of every function it wraps via `__wrapped__`) where the innermost function's
    globals are `new_globals`. Returns None when some wrapper does not hold the wrapped function in a
    closure cell (then we cannot rebuild it faithfully)."""
    inner = getattr(fn, "__wrapped__", None)
    if inner is None:
        if fn.__globals__.get(_HF_NAME) is None:
            return None
        new = types.FunctionType(fn.__code__, new_globals, fn.__name__, fn.__defaults__, fn.__closure__)
    else:
        new_inner = _rebuild(inner, new_globals)
        if new_inner is None or not fn.__closure__:
            return None
        cells, replaced = [], False
        for cell in fn.__closure__:
            if cell.cell_contents is inner:
                cells.append(types.CellType(new_inner))
                replaced = True
            else:
                cells.append(cell)
        if not replaced:
            return None
        new = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, tuple(cells))
        new.__wrapped__ = new_inner
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "__wrapped__"})
    new.__qualname__, new.__doc__, new.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    new.__annotations__ = dict(fn.__annotations__)
    return new


def _fused_forward_for(model: nn.Module, aux_fn):
    class_forward = type(model).forward
    innermost = class_forward
    while getattr(innermost, "__wrapped__", None) is not None:
        innermost = innermost.__wrapped__
    if _HF_NAME not in getattr(innermost, "__globals__", {}) or _HF_NAME not in innermost.__code__.co_names:
        raise ValueError(f"enable_fused_aux_loss: {type(model).__name__}.forward does not use "
                         f"`{_HF_NAME}` (not a transformers MoE causal-LM?)")
    new_globals = dict(innermost.__globals__)
    new_globals[_HF_NAME] = aux_fn
    new_forward = _rebuild(class_forward, new_globals)
    if new_forward is None:
        raise ValueError(f"enable_fused_aux_loss: cannot rebuild the decorators of {type(model).__name__}.forward")
    return types.MethodType(new_forward, model)


def enable_fused_aux_loss(model: nn.Module, group=None) -> nn.Module:
    """Make this model instance (a transformers MoE `*ForCausalLM`: Qwen3-MoE, Qwen3.5-MoE, ...) compute
    `aux_loss` with the fused kernel. Per instance, idempotent; returns the model.

    `group` (a torch.distributed process group, e.g. the world in data-parallel training): the load-balancing
    statistics are reduced over it, so every rank's aux loss is that of the whole group's batch (the
    single-process value on the concatenated batch; see `load_balancing_loss`). None: each rank's own tokens,
    as transformers computes it. Enabling again with another group replaces the first.

    With the hubfuse cross-entropy hook (`enable_fused_loss(model)`, state in `model._hubfuse_fused_loss`)
    already on the instance, this plugs the fused aux loss into that hook's `aux_loss_fn` slot (and into its
    no-labels path) instead of installing a forward; call it after `enable_fused_loss`, or pass
    `aux_loss_fn=load_balancing_loss_func` to `enable_fused_loss` directly. Under accelerate hooks
    (`device_map` dispatch), the hook's `_old_forward` is swapped instead. Any other per-instance forward
    already installed is refused (ValueError) rather than silently overridden."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_fused_aux_loss: expected an nn.Module, got {type(model).__name__}")
    state = model.__dict__.get(_MARK)
    if state is not None and state["group"] is not group:
        disable_fused_aux_loss(model)
        state = None
    if state is None:
        aux_fn = load_balancing_loss_func if group is None else group_load_balancing_loss_func(group)
        state = {"fused_forward": _fused_forward_for(model, aux_fn), "aux_fn": aux_fn, "group": group}
    ce_state = model.__dict__.get(_CE_STATE)
    if ce_state is not None:
        if "ce_previous_aux" not in state:
            state["ce_previous_aux"] = ce_state.get("aux_loss_fn")
        ce_state["aux_loss_fn"] = state["aux_fn"]
        if ce_state.get("previous_forward") is None:
            ce_state["previous_forward"] = state["fused_forward"]
    elif "_hf_hook" in model.__dict__ and "_old_forward" in model.__dict__:
        # accelerate hooks (device_map offload/dispatch) wrap the instance forward and call `_old_forward`
        if "accelerate_previous" not in state:
            state["accelerate_previous"] = model.__dict__["_old_forward"]
        model.__dict__["_old_forward"] = state["fused_forward"]
    else:
        current = model.__dict__.get("forward")
        if current is not None and current is not state["fused_forward"]:
            raise ValueError(
                "enable_fused_aux_loss: this model instance already has its own forward (another per-instance "
                "hook); give that hook this kernel's `load_balancing_loss_func` as its aux-loss function instead")
        model.__dict__["forward"] = state["fused_forward"]
    model.__dict__[_MARK] = state
    return model


def disable_fused_aux_loss(model: nn.Module) -> nn.Module:
    """Undo `enable_fused_aux_loss` on this instance (no-op if it was not enabled). Returns the model."""
    state = model.__dict__.pop(_MARK, None)
    if state is None:
        return model
    ce_state = model.__dict__.get(_CE_STATE)
    if ce_state is not None:
        if "ce_previous_aux" in state and ce_state.get("aux_loss_fn") is state["aux_fn"]:
            ce_state["aux_loss_fn"] = state["ce_previous_aux"]
        if ce_state.get("previous_forward") is state["fused_forward"]:
            ce_state["previous_forward"] = None
    if model.__dict__.get("forward") is state["fused_forward"]:
        del model.__dict__["forward"]
    if "accelerate_previous" in state and model.__dict__.get("_old_forward") is state["fused_forward"]:
        model.__dict__["_old_forward"] = state["accelerate_previous"]
    return model


def fused_aux_loss_enabled(model: nn.Module) -> bool:
    return _MARK in model.__dict__
