"""User-facing ops: validate, allocate outputs like the input, dispatch.

Each public module here is one op and lists its functions in `__all__`;
this package exports them all, so adding an op module needs no edit here."""
import importlib as _importlib
import pkgutil as _pkgutil

__all__ = []
for _info in _pkgutil.iter_modules(__path__):
    if _info.name.startswith("_"):
        continue
    _module = _importlib.import_module(f"{__name__}.{_info.name}")
    for _name in _module.__all__:
        globals()[_name] = getattr(_module, _name)
    __all__ += _module.__all__
__all__.sort()
del _info, _module, _name
