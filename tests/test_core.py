"""The dispatcher: device checks, kernel lookup, Python registration,
backends, array intake and the error contract (DESIGN.md section 2)."""
import ctypes
import re
import threading

import numpy as np
import pytest

import mmdispatch
from mmdispatch import DeviceMismatchError, KernelNotFoundError

FWD = mmdispatch.roi_align_forward_impl
SCALARS = (2, 2, 1.0, 2, 1, True)  # aligned_h, aligned_w, scale, sampling, avg, aligned


def cuda_usable():
    return any(d["device"] == "cuda" and d["available"] for d in mmdispatch.devices())


def cpu_args(dtype=np.float64, rois=None):
    """Valid forward arguments on the CPU (avg mode, empty argmax)."""
    x = np.arange(2 * 3 * 6 * 6, dtype=dtype).reshape(2, 3, 6, 6)
    r = np.array([[0, 0, 0, 4, 4], [1, 1, 1, 5, 3]], dtype=dtype) if rois is None else rois
    out = np.zeros((r.shape[0], 3, 2, 2), dtype=dtype)
    empty = np.empty((0,), dtype=dtype)
    return [x, r, out, empty, empty.copy()]


# --- device consistency -------------------------------------------------------

def test_device_mismatch_reports_param_index_name_and_both_devices(fake_array):
    args = cpu_args()
    args[2] = fake_array(2, 0)
    with pytest.raises(DeviceMismatchError) as info:
        FWD(*args, *SCALARS)
    assert str(info.value) == (
        "roi_align_forward_impl: at param 2 (output), inconsistent device: cuda:0 vs cpu")
    assert isinstance(info.value, RuntimeError)


def test_device_mismatch_names_a_cpu_index_other_than_0(dlpack_only):
    """An array may claim cpu:1: the message tells it from cpu (it read
    'cpu vs cpu')."""
    class OnCpu1(dlpack_only):
        def __dlpack_device__(self):
            return (1, 1)

    args = cpu_args()
    with pytest.raises(DeviceMismatchError, match=re.escape(
            "roi_align_forward_impl: at param 1 (rois), inconsistent device: cpu:1 vs cpu")):
        FWD(args[0], OnCpu1(args[1]), *args[2:], *SCALARS)
    assert mmdispatch.device_name(1, 0) == "cpu" and mmdispatch.device_name(2, 1) == "cuda:1"


def test_device_index_mismatch_is_an_error(fake_array):
    arrays = [fake_array(2, 0), fake_array(2, 1)] + [fake_array(2, 0) for _ in range(3)]
    with pytest.raises(DeviceMismatchError, match=re.escape(
            "roi_align_forward_impl: at param 1 (rois), inconsistent device: cuda:1 vs cuda:0")):
        FWD(*arrays, *SCALARS)
    assert not any(a.exported for a in arrays)


def test_backward_mismatch_counts_all_parameters(fake_array):
    arrays = [np.zeros((1, 1, 2, 2)), np.zeros((1, 5)), np.zeros(0), np.zeros(0),
              fake_array(2, 0)]
    with pytest.raises(DeviceMismatchError, match=re.escape(
            "roi_align_backward_impl: at param 4 (grad_input), inconsistent device: "
            "cuda:0 vs cpu")):
        mmdispatch.roi_align_backward_impl(*arrays, *SCALARS)


def test_missing_cuda_kernel_explains_why_and_touches_nothing(fake_array):
    if cuda_usable():
        pytest.skip("CUDA kernels are registered on this machine")
    arrays = [fake_array(2, 0) for _ in range(5)]
    with pytest.raises(KernelNotFoundError) as info:
        FWD(*arrays, *SCALARS)
    message = str(info.value)
    assert message.startswith(
        "roi_align_forward_impl: implementation for device cuda:0 not found.")
    assert "Registered: cpu/default (C), cpu/reference (C)." in message
    assert "cuda slots are empty:" in message
    assert re.search(r"no CUDA kernels|no NVIDIA driver is installed|the NVIDIA driver supports|"
                     r"no CUDA device", message)
    assert "mmdispatch.register_impl('roi_align_forward_impl', 'cuda', fn)" in message
    assert isinstance(info.value, NotImplementedError)
    assert not any(a.exported for a in arrays)


def test_device_without_builtin_kernels_is_reported(fake_array):
    arrays = [fake_array(7, 0) for _ in range(5)]
    with pytest.raises(KernelNotFoundError, match=re.escape(
            "implementation for device vulkan:0 not found.")) as info:
        FWD(*arrays, *SCALARS)
    assert "no built-in kernels for vulkan devices" in str(info.value)


def test_unknown_device_code_is_kernel_not_found(fake_array):
    arrays = [fake_array(99, 3) for _ in range(5)]
    with pytest.raises(KernelNotFoundError, match=re.escape("device99:3 not found")):
        FWD(*arrays, *SCALARS)


# --- Python kernels -----------------------------------------------------------

def test_python_kernel_receives_original_arguments(fake_array):
    arrays = [fake_array(7, 0) for _ in range(5)]
    seen = []

    def kernel(*args):
        seen.append(args)
        return "ran"

    with mmdispatch.register_impl("roi_align_forward_impl", "vulkan", kernel) as handle:
        assert handle.active
        assert FWD(*arrays, *SCALARS) == "ran"
    assert seen[0][:5] == tuple(arrays) and seen[0][5:] == SCALARS
    assert all(a is b for a, b in zip(seen[0], arrays))
    with pytest.raises(KernelNotFoundError):
        FWD(*arrays, *SCALARS)


def test_duplicate_registration_needs_override_and_removal_restores_c_kernel():
    args = cpu_args()
    with pytest.raises(ValueError, match="already has a kernel for cpu/default"):
        mmdispatch.register_impl("roi_align_forward_impl", "cpu", lambda *a: None)
    calls = []
    handle = mmdispatch.register_impl("roi_align_forward_impl", "cpu",
                                      lambda *a: calls.append(a), override=True)
    try:
        FWD(*args, *SCALARS)
        assert len(calls) == 1 and np.all(args[2] == 0)  # C kernel did not run
        inner = mmdispatch.register_impl("roi_align_forward_impl", "cpu", lambda *a: "inner",
                                         override=True)
        assert FWD(*args, *SCALARS) == "inner" and not handle.active
        inner.remove()
        assert handle.active
    finally:
        handle.remove()
    handle.remove()  # idempotent
    FWD(*args, *SCALARS)
    assert np.any(args[2] != 0)  # the C kernel is back


def test_registry_table_lists_c_and_python_slots():
    rows = mmdispatch.registry_table()
    c_rows = {(r["op"], r["device"], r["backend"]): r for r in rows if r["kind"] == "C"}
    row = c_rows["roi_align_forward_impl", "cpu", "default"]
    assert row["origin"] == "src/cpu/roi_align.cpp:roi_align_forward_cpu" and row["active"]
    assert ("roi_align_backward_impl", "cpu", "reference") in c_rows

    def my_kernel(*args):
        pass

    with mmdispatch.register_impl("roi_align_backward_impl", "metal", my_kernel, backend="fast"):
        rows = [r for r in mmdispatch.registry_table() if r["kind"] == "python"]
        assert rows == [{"op": "roi_align_backward_impl", "device": "metal", "backend": "fast",
                         "kind": "python", "active": True,
                         "origin": f"python:{__name__}.{my_kernel.__qualname__}"}]
    assert not [r for r in mmdispatch.registry_table() if r["kind"] == "python"]


def test_c_kernel_capsule_dispatches_and_stacks_with_python_kernels():
    from mmdispatch import _benchkit

    capsule = _benchkit.noop_roi_align_forward_kernel()
    args = cpu_args()
    handle = mmdispatch.register_impl("roi_align_forward_impl", "cpu", capsule, override=True)
    try:
        assert handle.kind == "C" and handle.active
        assert handle.origin == "capsule:mmdispatch.kernel.roi_align_forward_impl"
        assert FWD(*args, *SCALARS) is None and np.all(args[2] == 0)  # the no-op ran
        rows = [r for r in mmdispatch.registry_table()
                if (r["op"], r["device"], r["backend"]) == ("roi_align_forward_impl", "cpu",
                                                            "default")]
        assert [(r["kind"], r["active"]) for r in rows] == [("C", False), ("C", True)]
        with mmdispatch.register_impl("roi_align_forward_impl", "cpu", lambda *a: "python",
                                      override=True):
            assert FWD(*args, *SCALARS) == "python" and not handle.active
        assert handle.active and FWD(*args, *SCALARS) is None and np.all(args[2] == 0)
    finally:
        handle.remove()
    FWD(*args, *SCALARS)
    assert np.any(args[2] != 0)  # the built-in kernel is back


def test_capsule_named_for_another_op_is_rejected():
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = b"mmdispatch.kernel.nms_impl"  # kept alive: the capsule borrows it
    capsule = new_capsule(1, name, None)  # never called
    assert mmdispatch.kernel_capsule_name("nms_impl") == name.decode()
    with pytest.raises(TypeError, match=re.escape(
            "register_impl: a C kernel capsule for roi_align_forward_impl must be named "
            "'mmdispatch.kernel.roi_align_forward_impl', got 'mmdispatch.kernel.nms_impl'")):
        mmdispatch.register_impl("roi_align_forward_impl", "metal", capsule)
    assert not [r for r in mmdispatch.registry_table() if r["device"] == "metal"]


def test_contiguous_arrays_with_odd_strides_on_size_1_axes_give_the_same_result():
    expected = cpu_args()
    FWD(*expected, *SCALARS)
    args = cpu_args()
    base = np.zeros((2, 3, 6, 6))
    base[...] = args[0]
    odd = np.lib.stride_tricks.as_strided(base[:1], shape=(1, 3, 6, 6),
                                          strides=(8 * 1000,) + base.strides[1:])
    assert odd.flags.c_contiguous
    rois = args[1][args[1][:, 0] == 0]
    out = np.zeros((len(rois),) + args[2].shape[1:])
    FWD(odd, rois, out, *args[3:], *SCALARS)
    np.testing.assert_array_equal(out, expected[2][expected[1][:, 0] == 0])


def test_register_impl_rejects_bad_arguments():
    with pytest.raises(ValueError, match="unknown op 'nope'"):
        mmdispatch.register_impl("nope", "cpu", print)
    with pytest.raises(TypeError, match="fn must be callable"):
        mmdispatch.register_impl("roi_align_forward_impl", "metal", 3)
    with pytest.raises(ValueError, match="per device type"):
        mmdispatch.register_impl("roi_align_forward_impl", "cuda:1", print)
    with pytest.raises(ValueError, match="unknown device 'tpu'"):
        mmdispatch.register_impl("roi_align_forward_impl", "tpu", print)
    for name in ("", "default ", " x"):   # a backend name is created once and kept
        with pytest.raises(ValueError, match="backend must be a non-empty name without "
                                             "surrounding spaces"):
            mmdispatch.register_impl("roi_align_forward_impl", "cpu", print, backend=name)
    assert "" not in mmdispatch.backends()


# --- backends -----------------------------------------------------------------

def test_use_backend_is_thread_local_and_restored():
    seen = {}

    def other_thread():
        seen["other"] = mmdispatch.get_backend("cpu")

    with mmdispatch.use_backend("cpu", "reference"):
        assert mmdispatch.get_backend("cpu") == "reference"
        thread = threading.Thread(target=other_thread)
        thread.start()
        thread.join()
    assert seen["other"] == "default"
    assert mmdispatch.get_backend("cpu") == "default"


def test_a_threads_selection_and_strict_mode_move_to_another_thread_and_back():
    """_thread_selection / _set_thread_selection: what mmdispatch.torch hands
    to the threads torch runs work in (backends and strict mode together),
    set there for a call and restored after it; and the hook each change
    of a selection calls, on entry and on exit."""
    from mmdispatch import _core
    changes, hook = [], _core._selection_hook   # (the torch layer's, if imported)
    _core._set_selection_hook(lambda: changes.append(_core._thread_selection()))
    try:
        with mmdispatch.use_backend("cpu", "reference"), mmdispatch.strict():
            selection = _core._thread_selection()
    finally:
        _core._set_selection_hook(hook)
    assert len(changes) == 4 and changes[1] == selection and changes[3] is None
    seen = {}

    def other_thread():
        before = _core._set_thread_selection(selection)
        seen["during"] = (mmdispatch.get_backend("cpu"), mmdispatch.is_strict())
        _core._set_thread_selection(before)
        seen["after"] = (mmdispatch.get_backend("cpu"), mmdispatch.is_strict(), before)

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert seen == {"during": ("reference", True), "after": ("default", False, None)}
    assert _core._thread_selection() is None
    with pytest.raises(ValueError, match="not a thread selection"):
        _core._set_thread_selection(b"\x00")


def test_backend_without_kernel_is_kernel_not_found():
    with mmdispatch.use_backend("cpu", "deterministic"):
        with pytest.raises(KernelNotFoundError, match=re.escape(
                "implementation for device cpu (backend 'deterministic') not found.")):
            FWD(*cpu_args(), *SCALARS)
    with pytest.raises(ValueError, match="unknown backend 'fastest'"):
        with mmdispatch.use_backend("cpu", "fastest"):
            pass


# --- arguments and intake -----------------------------------------------------

def test_non_array_argument_names_the_parameter():
    args = cpu_args()
    args[1] = [[0, 0, 0, 1, 1]]
    with pytest.raises(TypeError, match=re.escape(
            "roi_align_forward_impl: at param 1 (rois), expected an array")):
        FWD(*args, *SCALARS)
    args = cpu_args()
    args[0] = None
    with pytest.raises(TypeError, match=re.escape("at param 0 (input), expected an array, got None")):
        FWD(*args, *SCALARS)


@pytest.mark.parametrize("position, value, expected", [
    (5, "2", "at param 5 (aligned_height), expected an int, got str"),
    (5, 2.0, "at param 5 (aligned_height), expected an int, got float"),
    (7, "1.0", "at param 7 (spatial_scale), expected a real number, got str"),
    (10, None, "at param 10 (aligned), expected a bool, got NoneType"),
    (8, 2**70, "at param 8 (sampling_ratio), 1180591620717411303424 does not fit in int64"),
])
def test_bad_scalar_arguments_name_the_parameter(position, value, expected):
    call = cpu_args() + list(SCALARS)
    call[position] = value
    with pytest.raises((TypeError, ValueError), match=re.escape(expected)):
        FWD(*call)


class _IndexTypeError:
    def __index__(self):
        raise TypeError("index refused")


class _IndexNotInt:
    def __index__(self):
        return "x"


@pytest.mark.parametrize("value, expected", [
    (_IndexTypeError(), "expected an int, got _IndexTypeError (its __index__: index refused)"),
    (_IndexNotInt(), "expected an int, got _IndexNotInt (its __index__: __index__ returned "
                     "non-int (type str))"),
])
def test_scalar_whose_index_refuses_keeps_its_message_and_cause(value, expected):
    args = cpu_args()
    with pytest.raises(TypeError, match=re.escape(
            f"roi_align_forward_impl: at param 5 (aligned_height), {expected}")) as info:
        FWD(*args, value, 2, 1.0, 2, 1, True)
    assert isinstance(info.value.__cause__, TypeError)
    assert not args[2].any()


def test_numpy_booleans_are_taken_for_int_parameters_as_python_booleans_are():
    results = []
    for flag in (True, np.bool_(True)):
        args = cpu_args()
        FWD(*args, 2, 2, 1.0, flag, 1, True)   # sampling_ratio 1
        results.append(args[2])
    np.testing.assert_array_equal(results[0], results[1])


class _IndexFails:
    def __index__(self):
        raise RuntimeError("index broke")


@pytest.mark.parametrize("position, expected", [
    (5, "at param 5 (aligned_height), expected an int, got _IndexFails (its __index__ raised "
        "RuntimeError: index broke)"),
    (10, "at param 10 (aligned), expected a bool, got _IndexFails (its __index__ raised "
         "RuntimeError: index broke)"),
])
def test_scalar_whose_index_fails_names_the_parameter(position, expected):
    """The caller's own __index__ may raise anything: the error still names
    the op and the parameter, with the original as its cause."""
    args = cpu_args()
    call = args + list(SCALARS)
    call[position] = _IndexFails()
    with pytest.raises(TypeError, match=re.escape(f"roi_align_forward_impl: {expected}")) as info:
        FWD(*call)
    assert isinstance(info.value.__cause__, RuntimeError)
    assert np.all(args[2] == 0)


class _DeviceFails:
    def __dlpack_device__(self):
        raise RuntimeError("device query broke")


class _DeviceMalformed:
    def __init__(self, answer):
        self.answer = answer

    def __dlpack_device__(self):
        return self.answer


@pytest.mark.parametrize("array, expected", [
    (_DeviceFails(), "at param 1 (rois), __dlpack_device__() raised RuntimeError: device query "
                     "broke"),
    (_DeviceMalformed("cpu"), "at param 1 (rois), __dlpack_device__() returned 'cpu'; expected "
                              "(device_type, device_id)"),
    (_DeviceMalformed((1,)), "at param 1 (rois), __dlpack_device__() returned (1,); expected "
                             "(device_type, device_id)"),
    (_DeviceMalformed((1, _IndexFails())), "at param 1 (rois), __dlpack_device__() returned"),
    (_DeviceMalformed((2 ** 70, 0)), "at param 1 (rois), __dlpack_device__() returned"),
])
def test_dlpack_device_that_fails_or_is_malformed_names_the_parameter(array, expected):
    args = cpu_args()
    args[1] = array
    with pytest.raises(TypeError, match=re.escape(f"roi_align_forward_impl: {expected}")):
        FWD(*args, *SCALARS)
    assert np.all(args[2] == 0)


class _FloatReturnsStr:
    def __float__(self):
        return "x"


@pytest.mark.parametrize("value, error, expected", [
    (2 ** 1024, ValueError, "at param 7 (spatial_scale), 1797693134862315907729305190789024733"),
    (np.ones(3), TypeError, "at param 7 (spatial_scale), expected a real number, got ndarray"),
    (_FloatReturnsStr(), TypeError, "at param 7 (spatial_scale), expected a real number, got "
                                    "_FloatReturnsStr"),
])
def test_float_arguments_whose_conversion_fails_name_the_parameter(value, error, expected):
    args = cpu_args()
    with pytest.raises(error, match=re.escape(f"roi_align_forward_impl: {expected}")):
        FWD(*args, 2, 2, value, 2, 1, True)
    assert np.all(args[2] == 0)


@pytest.mark.parametrize("field, value", [("shape", (2 ** 70,)), ("shape", ("a",)),
                                          ("shape", (1.5,)), ("data", (2 ** 80, False))])
def test_cuda_array_interface_values_beyond_c_types_are_malformed(field, value):
    from mmdispatch import _benchkit

    class Cai:
        __cuda_array_interface__ = dict({"shape": (2,), "typestr": "<f4", "data": (0, False),
                                         "version": 3}, **{field: value})

    noop = _benchkit.noop_roi_align_forward_kernel()
    with mmdispatch.register_impl("roi_align_forward_impl", "cuda", noop, override=True):
        with pytest.raises(TypeError, match=re.escape(
                "roi_align_forward_impl: at param 0 (input), malformed "
                "__cuda_array_interface__")):
            FWD(*[Cai() for _ in range(5)], *SCALARS)


def test_numpy_scalars_are_accepted_as_scalar_arguments():
    expected = cpu_args()
    FWD(*expected, *SCALARS)
    args = cpu_args()
    FWD(*args, np.int64(2), np.int32(2), np.float32(1.0), np.int8(2), np.int64(1), np.True_)
    np.testing.assert_array_equal(args[2], expected[2])


def test_read_only_output_is_rejected_and_untouched():
    args = cpu_args()
    args[2].setflags(write=False)
    with pytest.raises(ValueError, match=re.escape(
            "at param 2 (output), output array is read-only")):
        FWD(*args, *SCALARS)
    assert np.all(args[2] == 0)


def test_output_overlapping_an_input_is_rejected():
    args = cpu_args()
    big = np.zeros(2 * 3 * 6 * 6, dtype=np.float64)
    args[0] = big.reshape(2, 3, 6, 6)
    args[2] = big[:24].reshape(2, 3, 2, 2)
    with pytest.raises(ValueError, match=re.escape(
            "at param 2 (output), output memory overlaps param 0 (input)")):
        FWD(*args, *SCALARS)


def test_outputs_overlapping_each_other_are_rejected():
    args = cpu_args()
    argmax = np.zeros((2, 3, 2, 2))
    args[3], args[4] = argmax, argmax
    call = args + [2, 2, 1.0, 2, 0, True]  # max mode writes both
    with pytest.raises(ValueError, match=re.escape("at param 3 (argmax_y), output memory "
                                                   "overlaps param 4 (argmax_x)")):
        FWD(*call)


@pytest.mark.parametrize("dtype", [np.complex128, ">f8", object])
def test_unsupported_dtypes_are_type_errors(dtype):
    args = cpu_args()
    args[0] = np.zeros((2, 3, 6, 6), dtype=dtype)
    with pytest.raises(TypeError, match=re.escape("at param 0 (input), unsupported dtype")):
        FWD(*args, *SCALARS)


def test_misaligned_array_is_rejected():
    raw = np.zeros(2 * 3 * 6 * 6 * 8 + 1, dtype=np.uint8)
    misaligned = raw[1:].view(np.float64).reshape(2, 3, 6, 6)
    args = cpu_args()
    args[0] = misaligned
    with pytest.raises(ValueError, match="not aligned"):
        FWD(*args, *SCALARS)


def test_strided_input_is_rejected_by_the_entry_point():
    args = cpu_args()
    args[0] = np.zeros((2, 3, 6, 12))[..., ::2]
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: input must be C-contiguous")):
        FWD(*args, *SCALARS)


def test_dlpack_arrays_are_viewed_without_copy(dlpack_only):
    expected = cpu_args()
    FWD(*expected, *SCALARS)
    args = cpu_args()
    wrapped = [dlpack_only(a) for a in args[:3]] + args[3:]
    FWD(*wrapped, *SCALARS)
    np.testing.assert_array_equal(args[2], expected[2])  # written through the DLPack view


class _DLPackVersioned:
    """Only the DLPack protocol, passing max_version (DLPack 1.x) and copy on
    to numpy, so the capsule carries its flags."""

    def __init__(self, array, copy=None):
        self.array, self.copy = array, copy
        self.asked = []

    def __dlpack__(self, stream=None, max_version=None):
        self.asked.append(max_version)
        return self.array.__dlpack__(max_version=max_version, copy=self.copy)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_versioned_dlpack_is_asked_for_and_read_only_inputs_are_read():
    expected = cpu_args()
    FWD(*expected, *SCALARS)
    args = cpu_args()
    args[0].flags.writeable = False   # numpy exports read-only memory only as DLPack 1.x
    wrapped = [_DLPackVersioned(a) for a in args[:3]] + args[3:]
    FWD(*wrapped, *SCALARS)
    np.testing.assert_array_equal(args[2], expected[2])  # written through the 1.x view
    assert wrapped[0].asked == [(1, 0)]


def test_read_only_versioned_dlpack_output_is_rejected_and_untouched():
    args = cpu_args()
    args[2].flags.writeable = False
    args[2] = _DLPackVersioned(args[2])
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: at param 2 (output), output array is read-only")):
        FWD(*args, *SCALARS)
    assert not args[2].array.any()


def test_copied_dlpack_export_is_refused_as_an_output_and_read_as_an_input():
    args = cpu_args()
    output = args[2]
    args[2] = _DLPackVersioned(output, copy=True)
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: at param 2 (output), __dlpack__ exported a copy of this "
            "output (DLPack flag IS_COPIED)")):
        FWD(*args, *SCALARS)
    expected = cpu_args()
    FWD(*expected, *SCALARS)
    args = cpu_args()
    args[0] = _DLPackVersioned(args[0], copy=True)
    FWD(*args, *SCALARS)
    np.testing.assert_array_equal(args[2], expected[2])


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


class _HandMadeVersioned:
    """A DLPack producer built with ctypes: a versioned capsule of any
    version over a numpy array's memory (kept alive by this object)."""

    def __init__(self, array, major):
        self.array = array
        self.shape = (ctypes.c_int64 * array.ndim)(*array.shape)
        self.managed = _DLManagedTensorVersioned(
            major=major, minor=0, flags=0,
            dl_tensor=_DLTensor(data=array.ctypes.data, device_type=1, device_id=0,
                                ndim=array.ndim, code=2, bits=8 * array.itemsize, lanes=1,
                                shape=self.shape, strides=None, byte_offset=0))

    def __dlpack__(self, stream=None, max_version=None):
        new = ctypes.pythonapi.PyCapsule_New
        new.restype, new.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_char_p,
                                                       ctypes.c_void_p]
        return new(ctypes.addressof(self.managed), b"dltensor_versioned", None)

    def __dlpack_device__(self):
        return (1, 0)


def test_dlpack_capsules_of_a_major_version_other_than_1_are_refused():
    expected = cpu_args()
    FWD(*expected, *SCALARS)
    args = cpu_args()
    FWD(_HandMadeVersioned(args[0], 1), *args[1:], *SCALARS)   # the ctypes producer works
    np.testing.assert_array_equal(args[2], expected[2])
    args = cpu_args()
    with pytest.raises(TypeError, match=re.escape(
            "roi_align_forward_impl: at param 0 (input), __dlpack__ gave DLPack 2.0, which is "
            "not 1.x")):
        FWD(_HandMadeVersioned(args[0], 2), *args[1:], *SCALARS)
    assert not args[2].any()


class _NullData(_HandMadeVersioned):
    """A DLPack export that claims the array's shape at address 0."""

    def __init__(self, array):
        super().__init__(array, 1)
        self.managed.dl_tensor.data = None


def test_an_array_at_address_0_is_refused_before_a_c_kernel_reads_it():
    """A DLPack producer (or a __cuda_array_interface__) may answer a NULL
    data pointer: a kernel would read or write address 0 (it crashed the
    process). With no element it is read nowhere, and is fine."""
    args = cpu_args()
    with pytest.raises(TypeError, match=re.escape(
            "roi_align_forward_impl: at param 0 (input), the array's data pointer is NULL for "
            "216 elements")):
        FWD(_NullData(args[0]), *args[1:], *SCALARS)
    with pytest.raises(TypeError, match=re.escape("at param 2 (output), the array's data")):
        FWD(*args[:2], _NullData(args[2]), *args[3:], *SCALARS)
    assert not args[2].any()
    empty = cpu_args(rois=np.zeros((0, 5)))
    FWD(*empty[:2], _NullData(empty[2]), *empty[3:], *SCALARS)   # (0, 3, 2, 2): nothing to write


def test_a_cuda_array_interface_that_raises_names_the_parameter():
    class Raises:
        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("interface broke")

    args = cpu_args()
    with pytest.raises(TypeError, match=re.escape(
            "roi_align_forward_impl: at param 1 (rois), __cuda_array_interface__ raised "
            "RuntimeError: interface broke")) as info:
        FWD(args[0], Raises(), *args[2:], *SCALARS)
    assert isinstance(info.value.__cause__, RuntimeError)


def test_python_kernels_outputs_pass_the_c_kernels_checks_first():
    """Read-only outputs and outputs sharing memory with another argument
    are refused before a Python kernel runs, as before a C kernel, whether
    the outputs are given or allocated; a DLPack-only array is not exported
    for the checks (the kernel takes the objects themselves)."""
    calls = []
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", lambda *a: calls.append(a),
                                  backend="probe"), mmdispatch.use_backend("cpu", "probe"):
        args = cpu_args()
        args[2].setflags(write=False)
        with pytest.raises(ValueError, match=re.escape(
                "roi_align_forward_impl: at param 2 (output), output array is read-only")):
            FWD(*args, *SCALARS)
        args = cpu_args()
        with pytest.raises(ValueError, match=re.escape(
                "at param 2 (output), output memory overlaps param 0 (input)")):
            FWD(args[0], args[1], args[0][:2, :, :2, :2], *args[3:], *SCALARS)
        assert calls == []
        args = cpu_args()
        FWD(args[0], args[1], args[2][:, :, :, ::-1], *args[3:], *SCALARS)   # strided: fine here
        FWD(_HandMadeVersioned(args[0], 1), *args[1:], *SCALARS)
        FWD(args[0].astype(np.complex128), *args[1:], *SCALARS)   # the C layer's refusal
        assert len(calls) == 3


def test_masked_arrays_are_refused_rather_than_read_under_their_mask():
    args = cpu_args()
    masked = np.ma.masked_array(args[0], mask=args[0] > 100)
    with pytest.raises(TypeError, match=re.escape(
            "roi_align_forward_impl: at param 0 (input), masked arrays are not supported")):
        FWD(masked, *args[1:], *SCALARS)
    assert not args[2].any()


def test_an_allocating_call_without_the_memory_to_copy_a_strided_input_names_it():
    """A stride-0 view of 2**38 boxes needs 8 TiB in C order."""
    boxes = np.broadcast_to(np.array([[0, 0, 1, 1.0]]), (2 ** 38, 4))
    scores = np.broadcast_to(np.array([1.0]), (2 ** 38,))
    with pytest.raises(MemoryError, match=re.escape(
            "nms_impl: at param 0 (boxes), out of memory copying the strided array to C "
            "order")):
        mmdispatch.nms_impl(boxes, scores, None, None, None, 0.5, 0)


def test_cuda_array_interface_objects_are_classified_as_cuda():
    class CaiOnly:   # empty: stand-ins at address 0 meet nothing in the output checks
        __cuda_array_interface__ = {"shape": (0, 5), "typestr": "<f4", "data": (0, False),
                                    "strides": None, "version": 3}

    arrays = [CaiOnly() for _ in range(5)]
    with mmdispatch.register_impl("roi_align_forward_impl", "cuda", lambda *a: "cuda kernel",
                                  override=True):
        assert FWD(*arrays, *SCALARS) == "cuda kernel"
    with pytest.raises(DeviceMismatchError, match="cuda:0 vs cpu"):
        FWD(np.zeros((1, 1, 2, 2)), CaiOnly(), *cpu_args()[2:], *SCALARS)


def test_kernel_errors_carry_the_op_name():
    args = cpu_args(rois=np.array([[5, 0, 0, 1, 1]], dtype=np.float64))
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: rois[0, 0] (batch index) must be an integer in [0, 2)")):
        FWD(*args, *SCALARS)


# --- introspection ------------------------------------------------------------

def test_devices_and_build_info_describe_this_build():
    devices = {d["device"]: d for d in mmdispatch.devices()}
    assert devices["cpu"]["available"]
    assert "cuda" in devices
    info = mmdispatch.build_info()
    assert info["version"] == mmdispatch.__version__
    assert isinstance(info["cuda"], bool)
    assert info["cuda"] == (info["no_cuda_reason"] is None)
    assert mmdispatch.op_signatures()["roi_align_forward_impl"].startswith(
        "roi_align_forward_impl(Tensor input, Tensor rois, Tensor! output")


def run_in_fresh_process(code, tmp_path):
    """Runs `code` in a new interpreter outside the source tree (whose
    mmdispatch/ would shadow the installed package); returns its stdout."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_and_cpu_calls_ask_no_device_driver(tmp_path):
    """Importing mmdispatch and running CPU ops leaves every other device
    module unregistered: no CUDA runtime call, no driver library mapped (so a
    process may fork after the import and use CUDA in the child). devices()
    then asks."""
    out = run_in_fresh_process(r"""
import numpy as np
import mmdispatch
from mmdispatch import _core
x = np.ones((1, 1, 4, 4), np.float32); rois = np.array([[0, 0, 0, 2, 2]], np.float32)
mmdispatch.ops.roi_align(x, rois, 2)
mmdispatch.ops.nms(np.zeros((2, 4), np.float32), np.zeros(2, np.float32), 0.5)
print(sorted(_core._device_status))
print("libcuda.so" in open("/proc/self/maps").read())
mmdispatch.devices()
print(sorted(_core._device_status))
""", tmp_path)
    before, mapped, after = out.split("\n")[:3]
    assert before == "[1]" and mapped == "False"
    assert after == "[1, 2]"   # every build has a cuda module, built or not


def test_first_dispatch_to_a_device_registers_its_module(tmp_path):
    """The first call with arrays of a device type registers that device's
    built-in kernels, so the call finds them (or says why there are none)."""
    out = run_in_fresh_process(r"""
import mmdispatch
from mmdispatch import _core
class Fake:
    def __dlpack_device__(self): return (2, 0)
try:
    mmdispatch.roi_align_forward_impl(*[Fake()] * 5, 1, 1, 1.0, 1, 1, True)
except mmdispatch.KernelNotFoundError as exc:
    print("not found:", "cuda slots are empty" in str(exc))
except Exception as exc:
    print("called:", type(exc).__name__)
print(sorted(_core._device_status))
""", tmp_path)
    first, status = out.strip().split("\n")
    assert status == "[1, 2]"
    # without a usable GPU the slot stays empty and the error says why; with
    # one, the CUDA kernel was found (and then refused the stand-in's export)
    assert first == ("called: TypeError" if cuda_usable() else "not found: True")


def test_a_child_forked_after_import_can_use_cuda(cupy, tmp_path):
    out = run_in_fresh_process(r"""
import os
import numpy as np
import mmdispatch
pid = os.fork()
if pid == 0:
    import cupy
    boxes = cupy.asarray(np.array([[0, 0, 2, 2], [1, 1, 3, 3]], np.float32))
    ious = mmdispatch.ops.bbox_overlaps(boxes, boxes)
    os._exit(0 if abs(float(ious[0, 1]) - 1 / 7) < 1e-6 else 3)
print(os.waitpid(pid, 0)[1])
""", tmp_path)
    assert out.strip() == "0"


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", 2])
def test_empty_cache_takes_every_device_synchronize_takes(device):
    """Nothing kept (the CPU keeps nothing; CUDA only once a call has
    needed scratch) is nothing to release: it returns None."""
    assert mmdispatch.empty_cache(device) is None


@pytest.mark.parametrize("device, error", [("cuda:x", ValueError), ("cuda:-1", ValueError),
                                           ("nodevice", ValueError), (3.5, TypeError)])
def test_empty_cache_rejects_bad_devices_naming_itself(device, error):
    with pytest.raises(error) as info:
        mmdispatch.empty_cache(device)
    if isinstance(device, str) and ":" in device:
        assert str(info.value) == f"empty_cache: bad device {device!r}"


def test_cuda_empty_cache_after_calls_with_scratch_leaves_later_calls_working(cupy):
    """nms keeps its mask in the scratch pool across the synchronisation
    that reads its count; empty_cache releases it, and the next nms maps
    scratch again and keeps the same boxes."""
    rng = np.random.default_rng(5)
    corners = rng.uniform(0, 100, (3000, 2)).astype(np.float32)
    boxes = cupy.asarray(np.concatenate([corners, corners + 20], axis=1))
    scores = cupy.asarray(rng.random(3000, dtype=np.float32))
    first = mmdispatch.ops.nms(boxes, scores, 0.5)
    mmdispatch.synchronize("cuda")
    assert mmdispatch.empty_cache("cuda") is None
    assert mmdispatch.empty_cache("cuda:0") is None
    cupy.testing.assert_array_equal(mmdispatch.ops.nms(boxes, scores, 0.5), first)


def test_plain_numpy_intake_and_general_intake_agree_on_overlaps():
    """The inline intake of plain numpy calls must accept exactly what the
    general path accepts: random slices of one buffer, empty ones included,
    as the five arrays of roi_align_forward_impl (outputs at 2, 3, 4), with a
    no-op C kernel; the general path is forced by handing rois as an ndarray
    subclass, which the inline intake leaves alone."""
    from mmdispatch import _benchkit

    class Sub(np.ndarray):
        pass

    rng = np.random.default_rng(7)
    buffer = np.zeros(48, np.float32)
    noop = _benchkit.noop_roi_align_forward_kernel()
    outcomes = set()
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", noop, backend="intake"):
        with mmdispatch.use_backend("cpu", "intake"):
            for _ in range(400):
                arrays = []
                for _ in range(5):
                    start = int(rng.integers(0, 48))
                    stop = start + int(rng.integers(0, 4)) * int(rng.integers(0, 2))
                    arrays.append(buffer[start:min(stop, 48)])
                results = []
                for general in (False, True):
                    call = list(arrays)
                    if general:
                        call[1] = call[1].view(Sub)
                    try:
                        FWD(*call, 1, 1, 1.0, 2, 1, True)
                        results.append("ok")
                    except ValueError as exc:
                        results.append(str(exc))
                assert results[0] == results[1], arrays
                outcomes.add(results[0] == "ok")
    assert outcomes == {True, False}   # both accepted and rejected cases were drawn


def test_first_backend_selection_in_a_process_takes_effect_at_once(tmp_path):
    """Until a thread selects a backend other than "default", dispatch skips
    the thread-local table; the first selection in a fresh process must still
    route the very next call, in that thread only."""
    code = r"""
import threading
import numpy as np
import mmdispatch
x = np.zeros((1, 1, 4, 4), np.float32); rois = np.zeros((1, 5), np.float32)
e = np.empty(0, np.float32)
def call():
    return mmdispatch.roi_align_forward_impl(x, rois, np.empty((1, 1, 1, 1), np.float32),
                                             e, e, 1, 1, 1.0, 2, 1, True)
assert call() is None                     # the C kernel, before any selection
with mmdispatch.register_impl("roi_align_forward_impl", "cpu", lambda *a: "mine",
                              backend="mine"):
    with mmdispatch.use_backend("cpu", "mine"):
        assert call() == "mine"
        other = []
        t = threading.Thread(target=lambda: other.append(call()))
        t.start(); t.join()
        assert other == [None]            # other threads keep "default"
    assert call() is None
print("ok")
"""
    assert run_in_fresh_process(code, tmp_path).strip() == "ok"


# --- outputs the entry point allocates ------------------------------------------

def _roi_call():
    rng = np.random.default_rng(0)
    x = rng.random((2, 3, 8, 8))
    rois = np.array([[0, 1, 1, 5, 5], [1, 0, 0, 7, 3]], np.float64)
    return x, rois


def test_outputs_given_as_none_are_allocated_by_the_signatures_allocation_lines():
    x, rois = _roi_call()
    output, argmax_y, argmax_x = mmdispatch.roi_align_forward_impl(
        x, rois, None, None, None, 2, 3, 1.0, 0, 0, True)
    given = [np.empty((2, 3, 2, 3)) for _ in range(3)]
    mmdispatch.roi_align_forward_impl(x, rois, *given, 2, 3, 1.0, 0, 0, True)
    for got, expected in zip((output, argmax_y, argmax_x), given):
        assert type(got) is np.ndarray and got.dtype == np.float64 and got.flags.owndata
        np.testing.assert_array_equal(got, expected)
    # avg mode: the argmax pair is (0,), one shared array per dtype, as declared
    out, y, x_ = mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 3, 1.0, 0, 1,
                                                   True)
    assert out.shape == (2, 3, 2, 3) and y.shape == (0,) and y is x_
    # some outputs given, some left: every output is returned
    mine = np.empty((2, 3, 2, 3))
    assert mmdispatch.roi_align_forward_impl(x, rois, mine, None, None, 2, 3, 1.0, 0, 1,
                                             True)[0] is mine
    pool, argmax = mmdispatch.roi_pool_forward_impl(x, rois, None, None, 2, 2, 1.0, 0)
    assert pool.shape == argmax.shape == (2, 3, 2, 2) and argmax.dtype == np.int64
    boxes = np.array([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6]], np.float32)
    keep = mmdispatch.nms_impl(boxes, np.array([0.9, 0.8, 0.7], np.float32), None, None, None,
                               0.5, 0)
    np.testing.assert_array_equal(keep, [0, 2])   # trimmed to the kept count
    assert mmdispatch.bbox_overlaps_impl(boxes, boxes[:2], None, 0, False, 0).shape == (3, 2)
    assert mmdispatch.bbox_overlaps_impl(boxes, boxes, None, 0, True, 0).shape == (3,)


def test_allocating_calls_copy_strided_inputs_once_and_check_the_rest_as_usual():
    x, rois = _roi_call()
    wide = np.zeros((2, 3, 8, 16))
    wide[..., ::2] = x
    strided = mmdispatch.roi_align_forward_impl(wide[..., ::2], rois, None, None, None, 2, 2,
                                                1.0, 0, 1, True)[0]
    plain = mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2, 1.0, 0, 1, True)
    np.testing.assert_array_equal(strided, plain[0])
    with pytest.raises(TypeError, match=re.escape(
            "roi_align_forward_impl: rois has dtype float32 but input has dtype float64")):
        mmdispatch.roi_align_forward_impl(x, rois.astype(np.float32), None, None, None, 2, 2,
                                          1.0, 0, 1, True)
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: output cannot have shape (2, 3, 1073741824, 1073741824)")):
        mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2 ** 30, 2 ** 30, 1.0, 0,
                                          1, True)
    with pytest.raises(ValueError, match="output memory overlaps param 0 .input."):
        mmdispatch.roi_align_forward_impl(x, rois, x[:2, :3, :2, :2].copy(), x, None, 2, 2,
                                          1.0, 0, 0, True)


def test_allocating_calls_give_python_kernels_the_allocated_outputs():
    x, rois = _roi_call()
    seen = {}

    def kernel(input, rois, output, argmax_y, argmax_x, *scalars):
        seen["shapes"] = (output.shape, argmax_y.shape)
        output[...] = 7.0

    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", kernel, backend="probe"):
        with mmdispatch.use_backend("cpu", "probe"):
            output, _, _ = mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2,
                                                             1.0, 0, 1, True)
    assert seen["shapes"] == ((2, 3, 2, 2), (0,)) and np.all(output == 7.0)


def test_allocating_calls_answer_in_the_library_of_the_first_array(dlpack_only):
    x, rois = _roi_call()
    expected = mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2, 1.0, 0, 1,
                                                 True)[0]
    # a library without from_dlpack (this module) gets numpy outputs
    got = mmdispatch.roi_align_forward_impl(dlpack_only(x), dlpack_only(rois), None, None, None,
                                            2, 2, 1.0, 0, 1, True)[0]
    np.testing.assert_array_equal(got, expected)
    torch = pytest.importorskip("torch")
    got = mmdispatch.roi_align_forward_impl(torch.from_numpy(x), torch.from_numpy(rois), None,
                                            None, None, 2, 2, 1.0, 0, 1, True)[0]
    assert type(got) is torch.Tensor and got.dtype == torch.float64
    np.testing.assert_array_equal(got.numpy(), expected)


def _allocation_cases():
    """(entry point, arguments with None outputs) covering each allocation
    line's branches, and sizes the dispatcher clamps (a negative size)."""
    x, rois = _roi_call()
    boxes = np.array([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6]])
    logits, target = np.zeros((4, 5)), np.zeros(4, np.int64)
    return [
        ("roi_align_forward_impl", (x, rois, None, None, None, 2, 3, 1.0, 0, 0, True)),
        ("roi_align_forward_impl", (x, rois, None, None, None, 2, 3, 1.0, 0, 1, True)),
        ("roi_align_forward_impl", (x, rois, None, None, None, -4, 3, 1.0, 0, 0, True)),
        ("roi_pool_forward_impl", (x, rois, None, None, 3, 1, 1.0, 0)),
        ("nms_impl", (boxes, boxes[:, 0], None, None, None, 0.5, 0)),
        ("bbox_overlaps_impl", (boxes, boxes[:2], None, 0, False, 0)),
        ("bbox_overlaps_impl", (boxes, boxes, None, 0, True, 0)),
        ("sigmoid_focal_loss_forward_impl", (logits, target, None, None, 2.0, 0.25)),
        ("sigmoid_focal_loss_backward_impl", (logits, target, None, None, 2.0, 0.25)),
    ]


@pytest.mark.parametrize("index", range(9))
def test_shape_functions_give_the_shapes_and_dtypes_the_entry_point_allocates(index):
    """_codegen.shape_function (what the PyTorch layer allocates by) and the
    C the build generates from the same allocation lines agree."""
    from mmdispatch._codegen import parse_signature, shape_function
    name, args = _allocation_cases()[index]
    op = parse_signature(mmdispatch.op_signatures()[name])
    seen = {}

    def kernel(*call):
        for k, p in enumerate(op.params):
            if p.is_output:
                seen[p.name] = (call[k].shape, call[k].dtype)
                call[k][...] = 0

    with mmdispatch.register_impl(name, "cpu", kernel, backend="probe"):
        with mmdispatch.use_backend("cpu", "probe"):
            getattr(mmdispatch, name)(*args)
    shapes = shape_function(op, {p.name: k for k, p in enumerate(op.params)})(args)
    for a, shape in zip(op.allocations, shapes):
        dtype = np.dtype(a.dtype) if a.dtype else args[0].dtype
        assert seen[a.name] == (shape, dtype), a.text


def test_float32_matmul_precision_takes_torchs_three_names_only():
    """set_float32_matmul_precision takes torch's names (its effect on
    products: tests/ops/test_deform_conv2d.py); strict mode is apart."""
    for name in ("high", "medium", "highest"):
        mmdispatch.set_float32_matmul_precision(name)
        assert mmdispatch.get_float32_matmul_precision() == name
    for bad in ("low", "HIGH", None, 1):
        with pytest.raises(ValueError, match=re.escape(
                "set_float32_matmul_precision: precision must be one of 'highest', 'high', "
                "'medium', got " + repr(bad))):
            mmdispatch.set_float32_matmul_precision(bad)
    assert mmdispatch.get_float32_matmul_precision() == "highest"
    mmdispatch.set_float32_matmul_precision("high")
    try:
        assert not mmdispatch.is_strict()
        with mmdispatch.strict():
            assert mmdispatch.is_strict()
    finally:
        mmdispatch.set_float32_matmul_precision("highest")
