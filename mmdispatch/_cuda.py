"""The CUDA device's Python side: which device a __cuda_array_interface__
pointer lives on (asked of CuPy, which is imported for it). Which stream a
kernel launches on is decided in the dispatcher (_intake.pxi,
_cuda_launch_stream): CuPy's current stream for CuPy arrays, else the legacy
default stream. Nothing here touches CUDA before a CUDA array is dispatched.
"""
from mmdispatch import _core


def pointer_device(pointer):
    """CUDA device index owning a device pointer (0 when CuPy is absent)."""
    try:
        import cupy
    except ImportError:
        return 0
    return cupy.cuda.runtime.pointerGetAttributes(pointer).device


_core._set_cai_device_resolver(pointer_device)
