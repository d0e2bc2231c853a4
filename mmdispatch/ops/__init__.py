"""User-facing ops: validate, allocate outputs like the input, dispatch.

Each public module here is one op and lists its functions in `__all__`;
this package exports them all, so adding an op module needs no edit here."""
import importlib as _importlib
import pkgutil as _pkgutil

# the op modules, for the layers that read their tables (the PyTorch
# layer's GRADIENTS, the fuzzer's ENTRY_POINTS)
_MODULES = tuple(_importlib.import_module(f"{__name__}.{_info.name}")
                 for _info in _pkgutil.iter_modules(__path__) if not _info.name.startswith("_"))
__all__ = sorted(_name for _module in _MODULES for _name in _module.__all__)
for _module in _MODULES:
    globals().update({_name: getattr(_module, _name) for _name in _module.__all__})
del _module
