"""Every hubfuse Layer and Layout, re-exported from the op-family sub-packages (every sub-package of `hubfuse` but
`_common`: in the source tree the kernel repos' packages, in the built umbrella its physical sub-packages)."""
import importlib
import pkgutil

_umbrella = importlib.import_module(__package__)
_FAMILIES = sorted(m.name for m in pkgutil.iter_modules(_umbrella.__path__) if m.ispkg and m.name != "_common")
__all__ = []
for _family in _FAMILIES:
    _layers = importlib.import_module(f"{__package__}.{_family}.layers")
    _clash = set(__all__) & set(_layers.__all__)
    assert not _clash, f"two op families export the same layer names: {sorted(_clash)}"
    globals().update({name: getattr(_layers, name) for name in _layers.__all__})
    __all__ += _layers.__all__
del _umbrella, _family, _layers, _clash
