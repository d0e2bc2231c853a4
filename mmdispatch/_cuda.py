"""The CUDA device's Python side: which stream a kernel launches on, and
which device a __cuda_array_interface__ pointer lives on.

Kernels launch on CuPy's current stream for the array's device. Without
CuPy (e.g. torch arrays through DLPack) they use the legacy default stream,
and ask DLPack producers to make their data ready on it.
"""
import sys

from mmdispatch import _core

_CUDA = 2
# DLPack's __dlpack__(stream=...) code for the legacy default stream.
_DLPACK_LEGACY_DEFAULT_STREAM = 1


def _cupy():
    cupy = sys.modules.get("cupy")
    if cupy is None:
        try:
            import cupy
        except ImportError:
            return None
    return cupy


def stream_for(device_id):
    """(stream pointer, __dlpack__ stream argument) for a launch on device_id."""
    cupy = _cupy()
    if cupy is None:
        return 0, _DLPACK_LEGACY_DEFAULT_STREAM
    with cupy.cuda.Device(device_id):
        ptr = cupy.cuda.get_current_stream().ptr
    return ptr, ptr if ptr else _DLPACK_LEGACY_DEFAULT_STREAM


def pointer_device(pointer):
    """CUDA device index owning a device pointer (0 when CuPy is absent)."""
    cupy = _cupy()
    if cupy is None:
        return 0
    return cupy.cuda.runtime.pointerGetAttributes(pointer).device


# Installed whatever the build: neither touches CUDA until a CUDA array is
# dispatched (importing mmdispatch initialises no CUDA state).
_core._set_context_provider(_CUDA, stream_for)
_core._set_cai_device_resolver(pointer_device)
