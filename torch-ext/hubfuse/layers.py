"""Every hubfuse Layer and Layout, re-exported from the op-family sub-packages (assembled at build time)."""
from .rmsnorm.layers import *  # noqa: F401,F403
from .rmsnorm.layers import __all__ as _rmsnorm_all

__all__ = [*_rmsnorm_all]
