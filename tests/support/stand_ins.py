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
