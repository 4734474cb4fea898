"""Every hubfuse Layer and Layout, re-exported from the op-family sub-packages (assembled at build time)."""
from .cross_entropy.layers import *  # noqa: F401,F403
from .cross_entropy.layers import __all__ as _cross_entropy_all
from .gated_delta_net.layers import *  # noqa: F401,F403
from .gated_delta_net.layers import __all__ as _gated_delta_net_all
from .load_balancing_loss.layers import *  # noqa: F401,F403
from .load_balancing_loss.layers import __all__ as _load_balancing_loss_all
from .moe.layers import *  # noqa: F401,F403
from .moe.layers import __all__ as _moe_all
from .rmsnorm.layers import *  # noqa: F401,F403
from .rmsnorm.layers import __all__ as _rmsnorm_all
from .rotary.layers import *  # noqa: F401,F403
from .rotary.layers import __all__ as _rotary_all
from .swiglu.layers import *  # noqa: F401,F403
from .swiglu.layers import __all__ as _swiglu_all

_FAMILIES = {"cross_entropy": _cross_entropy_all, "gated_delta_net": _gated_delta_net_all,
             "load_balancing_loss": _load_balancing_loss_all, "moe": _moe_all,
             "rmsnorm": _rmsnorm_all, "rotary": _rotary_all, "swiglu": _swiglu_all}
_names = [n for names in _FAMILIES.values() for n in names]
assert len(_names) == len(set(_names)), "two op families export the same layer name"
__all__ = _names
