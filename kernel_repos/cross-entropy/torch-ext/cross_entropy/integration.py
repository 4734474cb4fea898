"""transformers integration: the fused loss for one causal-LM instance, and a logits-based loss_function.

KernelConfig has no hook for losses, so `enable_fused_loss(model, **options)` replaces the `forward` of
that one instance (`types.MethodType`; the class and every other instance keep HF's forward). With labels
the new forward computes the loss from the last hidden states through `linear_cross_entropy` (no logits;
`outputs.logits` is None unless `return_logits=True`), honouring HF's label shift, `shift_labels`,
`logits_to_keep`, `num_items_in_batch`, and -- for MoE models with `output_router_logits` -- still adding
`router_aux_loss_coef * aux_loss`. The aux loss comes from `state["aux_loss_fn"]`, by default the model
module's own `load_balancing_loss_func`; a fused aux-loss kernel is plugged in explicitly,
`enable_fused_loss(model, aux_loss_fn=my_fn)` (signature `(router_logits, num_experts, top_k, attention_mask) ->
scalar`; calling it again updates the options). Without labels the forward is HF's own (HF's aux loss).
`fused_loss_options(model)` reads the options of an instance; `disable_fused_loss(model)` restores the previous
forward. The state lives in the instance (`_STATE_ATTR`, private to this module: other packages go through these
functions).

The loss is computed by calling the `lm_head` module (its instance forward takes the shifted labels and returns
the loss): the module's hooks run as for the logits, so FSDP2 all-gathers, reshards and reduces `lm_head` like
any other module when it is sharded in a group of its own (transformers' FSDP plan).

transformers is imported lazily inside the functions: the package itself depends only on torch.
"""
import sys
import types
from typing import Callable, Optional

import torch

from .ops import cross_entropy, linear_cross_entropy

_STATE_ATTR = "_hubfuse_fused_loss"
_HEAD_PREVIOUS_FORWARD = "_hubfuse_previous_forward"  # on lm_head: its instance forward before the switch, or None
_LOSS_ONLY_KWARGS = ("num_items_in_batch", "shift_labels", "ignore_index")
_OPTION_NAMES = ("ignore_index", "label_smoothing", "z_loss_weight", "softcap", "chunk_size", "weight_grad_fp32",
                 "return_logits", "aux_loss_fn")


def _find_in_mro(model, name: str):
    for cls in type(model).__mro__:
        fn = getattr(sys.modules.get(cls.__module__), name, None)
        if fn is not None:
            return fn
    return None


def _is_moe(model) -> bool:
    return hasattr(model, "router_aux_loss_coef") and hasattr(model, "num_experts")


def fused_loss_enabled(model) -> bool:
    return _STATE_ATTR in model.__dict__


def fused_loss_options(model) -> Optional[dict]:
    """The options `enable_fused_loss` gave this instance (`aux_loss_fn` included), or None if it is not on."""
    state = model.__dict__.get(_STATE_ATTR)
    return None if state is None else {name: state[name] for name in _OPTION_NAMES}


def enable_fused_loss(
    model, *, ignore_index: int = -100, label_smoothing: float = 0.0, z_loss_weight: float = 0.0,
    softcap: Optional[float] = None, chunk_size: Optional[int] = None, weight_grad_fp32: bool = False,
    return_logits: bool = False, aux_loss_fn: Optional[Callable] = None,
):
    """Switch this causal-LM instance to the fused linear cross-entropy loss. Returns the model.

    The instance needs `model` (the decoder, returning `last_hidden_state`) and `lm_head` (nn.Linear), as
    Llama / Qwen2 / Qwen3 / Qwen3-MoE / Qwen3.5-MoE `*ForCausalLM` have. Calling it again updates the options.
    """
    if not isinstance(model, torch.nn.Module) or not isinstance(getattr(model, "lm_head", None), torch.nn.Linear) \
            or not isinstance(getattr(model, "model", None), torch.nn.Module):
        raise TypeError(f"enable_fused_loss: expected a *ForCausalLM model with `.model` and an nn.Linear "
                        f"`.lm_head`, got {type(model).__name__}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"enable_fused_loss: softcap must be None or > 0, got {softcap}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"enable_fused_loss: label_smoothing must be in [0, 1], got {label_smoothing}")
    if _is_moe(model) and aux_loss_fn is None:
        aux_loss_fn = _find_in_mro(model, "load_balancing_loss_func")
        if aux_loss_fn is None:
            raise TypeError(f"enable_fused_loss: no load_balancing_loss_func found for {type(model).__name__}; "
                            f"pass aux_loss_fn=")
    from transformers.utils.generic import can_return_tuple

    state = model.__dict__.get(_STATE_ATTR)
    if state is None:
        state = {"previous_forward": model.__dict__.get("forward")}
        model.__dict__[_STATE_ATTR] = state  # plain dict: not a submodule, not a parameter
        model.forward = types.MethodType(can_return_tuple(_fused_causal_lm_forward), model)
        head = model.lm_head
        head.__dict__[_HEAD_PREVIOUS_FORWARD] = head.__dict__.get("forward")
        head.forward = types.MethodType(_lm_head_forward, head)
    state.update(ignore_index=ignore_index, label_smoothing=label_smoothing, z_loss_weight=z_loss_weight,
                 softcap=softcap, chunk_size=chunk_size, weight_grad_fp32=weight_grad_fp32,
                 return_logits=return_logits, aux_loss_fn=aux_loss_fn)
    return model


def disable_fused_loss(model):
    """Give this instance its previous forward back (HF's). Returns the model."""
    state = model.__dict__.pop(_STATE_ATTR, None)
    if state is None:
        return model
    del model.forward
    if state["previous_forward"] is not None:
        model.forward = state["previous_forward"]
    head = model.lm_head
    del head.forward
    previous = head.__dict__.pop(_HEAD_PREVIOUS_FORWARD, None)
    if previous is not None:
        head.forward = previous
    return model


def _lm_head_forward(self, hidden_states, shift_labels=None, *, return_logits: bool = False, **loss_options):
    """lm_head's forward while the fused loss is on. Without labels: the logits (its previous forward). With the
    shifted labels: (loss, z_loss, logits or None) of `linear_cross_entropy` over this module's weight."""
    if shift_labels is None:
        return _logits(self, hidden_states)
    loss, z_loss = linear_cross_entropy(
        hidden_states.reshape(-1, hidden_states.shape[-1]), self.weight, shift_labels.reshape(-1), self.bias,
        reduction="mean", return_z_loss=True, **loss_options)
    logits = None
    if return_logits:
        with torch.no_grad():
            logits = _logits(self, hidden_states)
    return loss, z_loss, logits


def _logits(head, hidden_states):
    previous = head.__dict__.get(_HEAD_PREVIOUS_FORWARD)
    return previous(hidden_states) if previous is not None else \
        torch.nn.functional.linear(hidden_states, head.weight, head.bias)


def _fused_causal_lm_forward(
    self, input_ids=None, attention_mask=None, position_ids=None, past_key_values=None, inputs_embeds=None,
    labels=None, use_cache=None, output_router_logits=None, logits_to_keep=0, **kwargs,
):
    state = self.__dict__[_STATE_ATTR]
    is_moe = _is_moe(self)
    if labels is None:  # inference / no loss: HF's forward, unchanged
        extra = {"output_router_logits": output_router_logits} if is_moe else {}
        previous = state["previous_forward"] or types.MethodType(type(self).forward, self)
        return previous(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids, past_key_values=past_key_values,
                                  inputs_embeds=inputs_embeds, use_cache=use_cache, logits_to_keep=logits_to_keep,
                                  **extra, **kwargs)
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast
    from transformers.modeling_utils import slice_logits_to_keep

    num_items_in_batch = kwargs.pop("num_items_in_batch", None)
    shift_labels = kwargs.pop("shift_labels", None)
    ignore_index = kwargs.pop("ignore_index", state["ignore_index"])
    model_kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                        past_key_values=past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache)
    if is_moe:
        output_router_logits = (output_router_logits if output_router_logits is not None
                                else self.config.output_router_logits)
        model_kwargs["output_router_logits"] = output_router_logits
    outputs = self.model(**model_kwargs, **kwargs)

    hidden_states = slice_logits_to_keep(outputs.last_hidden_state, logits_to_keep)
    if shift_labels is None:  # HF's shift: tokens < n predict n, the last position predicts nothing
        padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = padded[..., 1:]
    shift_labels = shift_labels.to(hidden_states.device)
    loss, z_loss, logits = self.lm_head(  # through the module: its (FSDP) hooks run
        hidden_states, shift_labels, return_logits=state["return_logits"], ignore_index=ignore_index,
        label_smoothing=state["label_smoothing"], z_loss_weight=state["z_loss_weight"], softcap=state["softcap"],
        num_items_in_batch=num_items_in_batch, chunk_size=state["chunk_size"],
        weight_grad_fp32=state["weight_grad_fp32"])

    if not is_moe:
        out = CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=outputs.past_key_values,
                                     hidden_states=outputs.hidden_states, attentions=outputs.attentions)
    else:
        aux_loss = None
        if output_router_logits:
            aux_loss = state["aux_loss_fn"](outputs.router_logits, self.num_experts, self.num_experts_per_tok,
                                             attention_mask)
            loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
        out = MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=logits,
                                        past_key_values=outputs.past_key_values,
                                        hidden_states=outputs.hidden_states, attentions=outputs.attentions,
                                        router_logits=outputs.router_logits)
    if state["z_loss_weight"]:
        out.z_loss = z_loss  # for logging (already included in `loss`)
    return out


def make_loss_function(*, label_smoothing: float = 0.0, z_loss_weight: float = 0.0,
                       softcap: Optional[float] = None, inplace: bool = False):
    """A `model.loss_function` with HF's `ForCausalLMLoss` signature, computed by the logits-based kernel.

    `inplace=False` (default) writes the gradient into one bf16/fp16 copy of the logits, so `outputs.logits`
    stay valid; `inplace=True` overwrites the logits with their gradient (saves that copy; then do not read
    `outputs.logits` after the forward).
    """
    def fused_for_causal_lm_loss(logits, labels, vocab_size: int, num_items_in_batch=None,
                                 ignore_index: int = -100, shift_labels=None, **kwargs):
        if logits.shape[-1] != vocab_size:
            raise ValueError(f"loss_function: logits have {logits.shape[-1]} classes but vocab_size={vocab_size}")
        if shift_labels is None:
            padded = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)
            shift_labels = padded[..., 1:]
        shift_labels = shift_labels.to(logits.device)
        return cross_entropy(logits.reshape(-1, vocab_size), shift_labels.reshape(-1), ignore_index=ignore_index,
                             label_smoothing=label_smoothing, z_loss_weight=z_loss_weight, softcap=softcap,
                             num_items_in_batch=num_items_in_batch, inplace=inplace)

    return fused_for_causal_lm_loss


def install_loss_function(model, **options):
    """`model.loss_function = make_loss_function(**options)` (per instance); `del model._loss_function` undoes it."""
    model.loss_function = make_loss_function(**options)
    return model
