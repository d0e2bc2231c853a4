"""Stand-in arrays shared by the tests (through conftest.py, which puts
this directory on sys.path) and the tools beside this file."""


class FakeDeviceArray:
    """An array on another device, seen only through __dlpack_device__;
    reading it fails the test (and sets .exported)."""

    def __init__(self, device_type=2, device_id=0):
        self.device = (device_type, device_id)
        self.exported = False

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, **kwargs):
        self.exported = True
        raise AssertionError("the dispatcher read a stand-in array on another device")


class DLPackOnly:
    """Only __dlpack__ / __dlpack_device__ (a DLPack 1.x request passes
    through): an array of some other library."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


class HostBackedDeviceArray:
    """An array of a library for a device mmdispatch has no kernels for
    (ROCm by default), kept in host memory, that speaks only what such a
    library offers: __dlpack_device__, a __dlpack__ that exports a host copy
    on request (DLPack 1.0's dl_device/copy) and refuses anything else,
    shape/dtype/device, __getitem__/__setitem__, and an Array API namespace
    (from_dlpack/asarray with device=). `exported` counts host copies."""

    def __init__(self, data, device=(10, 0)):
        import numpy as np

        self._data = np.asarray(data)
        self.device = tuple(device)
        self.exported = 0

    shape = property(lambda self: self._data.shape)
    dtype = property(lambda self: self._data.dtype)
    ndim = property(lambda self: self._data.ndim)

    def __dlpack_device__(self):
        return self.device

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        if dl_device is None or tuple(dl_device) != (1, 0) or copy is False:
            raise BufferError("device memory: only a host copy can be exported")
        self.exported += 1
        return self._data.copy().__dlpack__(max_version=max_version)

    def __array_namespace__(self):
        return HostBackedNamespace

    def __getitem__(self, key):
        return HostBackedDeviceArray(self._data[key], self.device)

    def __setitem__(self, key, value):
        if not isinstance(value, HostBackedDeviceArray) or value.device != self.device:
            raise TypeError("can only assign an array on the same device")
        self._data[key] = value._data

    def host(self):
        """The data, for the test's own checks."""
        return self._data.copy()


class HostBackedNamespace:
    """The Array API functions of HostBackedDeviceArray's library that the
    copy_to_cpu fallback and the op functions use."""

    @staticmethod
    def from_dlpack(x, *, device=None, copy=None):
        import numpy as np

        return HostBackedDeviceArray(np.from_dlpack(x).copy(), device or (10, 0))

    @staticmethod
    def asarray(x, *, device=None):
        import numpy as np

        return HostBackedDeviceArray(np.array(x), device or (10, 0))

    @staticmethod
    def zeros(shape, *, dtype=None, device=None):
        import numpy as np

        return HostBackedDeviceArray(np.zeros(shape, dtype), device or (10, 0))
