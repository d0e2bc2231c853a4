"""mmdispatch: MMCV's device dispatcher as a standalone package.

Dispatch entry points (MMCV's DISPATCH_DEVICE_IMPL functions) such as
``roi_align_forward_impl`` check that all array arguments share one device
and call the kernel registered for it; user-facing ops live in
``mmdispatch.ops``.
"""
import os as _os

try:
    from mmdispatch import _core
except ImportError as _exc:   # the source tree shadows the installed package
    _here = _os.path.dirname(_os.path.abspath(__file__))
    if _os.path.exists(_os.path.join(_here, _os.pardir, "setup.py")):
        raise ImportError(
            f"mmdispatch was imported from its source tree ({_here}), which has no compiled "
            "extension: run Python from another directory to use the installed mmdispatch, or "
            "build in place with `pip install -e .`") from _exc
    raise
from mmdispatch._names import FROM_CORE as _FROM_CORE, OWN as _OWN

globals().update({name: getattr(_core, name) for name in _FROM_CORE})
from mmdispatch._version import __version__
from mmdispatch import _cuda  # resolves __cuda_array_interface__ pointers' devices

# Every dispatch entry point, generated from signatures.txt.
globals().update({name: getattr(_core, name) for name in _core.op_signatures()})

from mmdispatch import fallbacks, ops  # noqa: E402
from mmdispatch.profiler import profile  # noqa: E402


def build_info():
    """How this copy was built: CUDA or not, archs, compilers."""
    from mmdispatch._build_info import BUILD_INFO

    return dict(BUILD_INFO)


__all__ = [*_FROM_CORE, *_OWN, *_core.op_signatures()]
