"""Per-instance switch: make one model's forward compute its MoE aux loss with the fused kernel.

No KernelConfig hook reaches `load_balancing_loss_func`: transformers' `*ForCausalLM.forward` looks it up in its
modeling module's globals at call time. `enable_fused_aux_loss(model)` gives that one instance its own forward
(`model.forward = MethodType(can_return_tuple(_moe_causal_lm_forward), model)`): transformers' MoE causal-LM forward (Qwen3-MoE,
Qwen3.5-MoE: decoder, `lm_head`, `model.loss_function`, `router_aux_loss_coef * aux_loss`), written out here with
the fused `load_balancing_loss_func` as its aux loss.

Why this design: nothing global is touched (no module attribute is swapped, not even temporarily), so other
instances of the same architecture, other threads and later plain loads see stock transformers; it is safe
under threads and async code (no swap-and-restore window), and `torch.compile` traces it like any function.

With the hubfuse cross-entropy hook (its own per-instance forward), do not enable this: give that hook the aux loss
instead, `enable_fused_loss(model, aux_loss_fn=load_balancing_loss_func)` (what `hubfuse.presets.enable_losses`
does). `enable_fused_aux_loss` refuses an instance that already has its own forward.
"""
import types

from torch import nn

from .ops import group_load_balancing_loss_func, load_balancing_loss_func

_MARK = "_hubfuse_fused_aux_loss"  # this module's per-instance state (a plain dict in the instance __dict__)


def _is_moe_causal_lm(model: nn.Module) -> bool:
    return all(hasattr(model, name) for name in ("num_experts", "num_experts_per_tok", "router_aux_loss_coef")) \
        and isinstance(getattr(model, "lm_head", None), nn.Linear) and isinstance(getattr(model, "model", None),
                                                                                  nn.Module)


def _moe_causal_lm_forward(self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                          inputs_embeds=None, labels=None, use_cache=None, output_router_logits=None,
                          logits_to_keep=0, **kwargs):
    """transformers 5's `Qwen3MoeForCausalLM.forward` / `Qwen3_5MoeForCausalLM.forward` (same code), with this
    instance's fused aux loss."""
    from transformers.modeling_outputs import MoeCausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    output_router_logits = (output_router_logits if output_router_logits is not None
                            else self.config.output_router_logits)
    outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
                         output_router_logits=output_router_logits, **kwargs)
    logits = self.lm_head(slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep))
    loss = None
    if labels is not None:
        loss = self.loss_function(logits, labels, self.vocab_size, **kwargs)
    aux_loss = None
    if output_router_logits:
        aux_loss = self.__dict__[_MARK]["aux_fn"](outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                                  attention_mask)
        if labels is not None:
            loss += self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits,
                                     past_key_values=outputs.past_key_values, hidden_states=outputs.hidden_states,
                                     attentions=outputs.attentions, router_logits=outputs.router_logits)


def enable_fused_aux_loss(model: nn.Module, group=None) -> nn.Module:
    """Make this model instance (a transformers MoE `*ForCausalLM`: Qwen3-MoE, Qwen3.5-MoE) compute `aux_loss` with
    the fused kernel. Per instance, idempotent; returns the model.

    `group` (a torch.distributed process group, e.g. the world in data-parallel training): the load-balancing
    statistics are reduced over it, so every rank's aux loss is that of the whole group's batch (the
    single-process value on the concatenated batch; see `load_balancing_loss`). None: each rank's own tokens,
    as transformers computes it. Enabling again with another group replaces the first.

    Under accelerate hooks (`device_map` dispatch), the hook's `_old_forward` is swapped instead. Any other
    per-instance forward already installed (e.g. the hubfuse cross-entropy hook) is refused (ValueError) rather
    than silently overridden: give that hook this kernel's `load_balancing_loss_func` as its aux-loss function."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"enable_fused_aux_loss: expected an nn.Module, got {type(model).__name__}")
    if not _is_moe_causal_lm(model):
        raise ValueError(f"enable_fused_aux_loss: {type(model).__name__} is not a transformers MoE causal LM "
                         f"(num_experts, num_experts_per_tok, router_aux_loss_coef, `model`, nn.Linear `lm_head`): "
                         f"it has no load_balancing_loss_func to replace")
    state = model.__dict__.get(_MARK)
    if state is not None and state["group"] is not group:
        disable_fused_aux_loss(model)
        state = None
    if state is None:
        from transformers.utils.generic import can_return_tuple  # HF's decorator of the forward (return_dict=False)

        aux_fn = load_balancing_loss_func if group is None else group_load_balancing_loss_func(group)
        state = {"fused_forward": types.MethodType(can_return_tuple(_moe_causal_lm_forward), model), "aux_fn": aux_fn,
                 "group": group}
    if "_hf_hook" in model.__dict__ and "_old_forward" in model.__dict__:
        # accelerate hooks (device_map offload/dispatch) wrap the instance forward and call `_old_forward`
        if "accelerate_previous" not in state:
            state["accelerate_previous"] = model.__dict__["_old_forward"]
        model.__dict__["_old_forward"] = state["fused_forward"]
    else:
        current = model.__dict__.get("forward")
        if current is not None and current is not state["fused_forward"]:
            raise ValueError(
                "enable_fused_aux_loss: this model instance already has its own forward (another per-instance "
                "hook, e.g. the cross-entropy kernel's enable_fused_loss); give that hook this kernel's "
                "`load_balancing_loss_func` as its aux-loss function instead (enable_fused_loss(model, "
                "aux_loss_fn=load_balancing_loss_func))")
        model.__dict__["forward"] = state["fused_forward"]
    model.__dict__[_MARK] = state
    return model


def disable_fused_aux_loss(model: nn.Module) -> nn.Module:
    """Undo `enable_fused_aux_loss` on this instance (no-op if it was not enabled). Returns the model."""
    state = model.__dict__.pop(_MARK, None)
    if state is None:
        return model
    if model.__dict__.get("forward") is state["fused_forward"]:
        del model.__dict__["forward"]
    if "accelerate_previous" in state and model.__dict__.get("_old_forward") is state["fused_forward"]:
        model.__dict__["_old_forward"] = state["accelerate_previous"]
    return model


def fused_aux_loss_enabled(model: nn.Module) -> bool:
    return _MARK in model.__dict__
