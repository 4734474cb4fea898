"""Initialisation of the parameters a checkpoint did not have (vendored into every hub variant).

transformers initialises missing weights through the model class's `_init_weights`, which recognises its own module
classes: a Layout (a replacement class) gets no initialisation there, or a generic one (any class named "*RMSNorm*"
gets ones). After loading, a parameter the checkpoint filled carries `_is_hf_initialized`; one it lacked does not.
Each Layout's `init_missing_parameters(std)` gives such parameters the initialisation transformers gives the class
the Layout replaces (`std`: the config's `initializer_range`); `hubfuse.KernelConfig` calls it after every load.
"""
import torch


def init_missing(module: torch.nn.Module, rules: dict) -> None:
    """rules: parameter name -> function filling the tensor in place; applied to the parameters not loaded."""
    with torch.no_grad():
        for name, fill in rules.items():
            param = module._parameters.get(name)
            if param is None or param.is_meta or getattr(param, "_is_hf_initialized", False):
                continue
            fill(param)
