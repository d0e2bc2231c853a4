"""Boxed fallbacks (mmdispatch.register_fallback, _layers.pxi) and the
ready one, mmdispatch.fallbacks.copy_to_cpu, on stand-in arrays of a device
mmdispatch has no kernels for (ROCm), seen only through DLPack and the
Array API."""
import ctypes
import threading
import warnings

import numpy as np
import pytest

import mmdispatch
from mmdispatch import ops
from mmdispatch._codegen import ARG_OPTIONAL, ARG_OUTPUT
from mmdispatch.fallbacks import copy_to_cpu
from stand_ins import HostBackedDeviceArray as OnRocm

import fuzz_cases


@pytest.fixture
def rocm_fallback():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", copy_to_cpu) as handle:
            yield handle


def roi_inputs():
    rng = np.random.default_rng(0)
    x = rng.random((2, 3, 9, 9), dtype=np.float32)
    rois = np.array([[0, 0, 0, 5, 5], [1, 2, 1, 8, 6.5]], np.float32)
    return x, rois


def test_without_fallback_the_error_names_it_and_nothing_is_read():
    x, rois = roi_inputs()
    a, b = OnRocm(x), OnRocm(rois)
    with pytest.raises(mmdispatch.KernelNotFoundError) as info:
        ops.roi_align(a, b, 2)
    message = str(info.value)
    assert "roi_align_forward_impl: implementation for device rocm:0 not found." in message
    assert "mmdispatch.register_fallback('rocm', mmdispatch.fallbacks.copy_to_cpu)" in message
    assert a.exported == b.exported == 0
    assert mmdispatch.registered_fallbacks() == {}


def test_cpu_not_found_error_does_not_offer_the_copy_fallback():
    x, rois = roi_inputs()
    # the CPU has no kernels of the "deterministic" backend (its default ones are)
    with mmdispatch.use_backend("cpu", "deterministic"):
        with pytest.raises(mmdispatch.KernelNotFoundError) as info:
            mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2, 1.0, 0, 1, True)
    assert "register_fallback" not in str(info.value)


def test_copy_to_cpu_gives_the_cpu_results_on_the_device(rocm_fallback):
    x, rois = roi_inputs()
    result = ops.roi_align(OnRocm(x), OnRocm(rois), 3, 0.5, 2)
    assert isinstance(result, OnRocm) and result.device == (10, 0)
    np.testing.assert_array_equal(result.host(), ops.roi_align(x, rois, 3, 0.5, 2))


def test_copy_to_cpu_writes_given_outputs_back_and_leaves_inputs_alone(rocm_fallback):
    x, rois = roi_inputs()
    output = OnRocm(np.full((2, 3, 2, 2), -7, np.float32))
    argmax_y, argmax_x = (OnRocm(np.zeros((2, 3, 2, 2), np.float32)) for _ in range(2))
    a, b = OnRocm(x), OnRocm(rois)
    assert mmdispatch.roi_align_forward_impl(a, b, output, argmax_y, argmax_x, 2, 2, 1.0, 2,
                                             0, True) is None
    expected = ops.roi_align_forward(x, rois, 2, 1.0, 2, "max", True)
    for got, want in zip((output, argmax_y, argmax_x), expected):
        np.testing.assert_array_equal(got.host(), want)
    np.testing.assert_array_equal(a.host(), x)
    np.testing.assert_array_equal(b.host(), rois)


def test_copy_to_cpu_keeps_what_an_accumulating_output_held(rocm_fallback):
    x, rois = roi_inputs()
    grad = np.random.default_rng(1).random((2, 3, 2, 2), dtype=np.float32)
    start = np.full(x.shape, 0.5, np.float32)
    grad_input = OnRocm(start.copy())
    empty = OnRocm(np.zeros((0,), np.float32))
    mmdispatch.roi_align_backward_impl(OnRocm(grad), OnRocm(rois), empty, empty, grad_input,
                                       2, 2, 1.0, 2, 1, True)
    expected = start.copy()
    mmdispatch.roi_align_backward_impl(grad, rois, np.zeros((0,), np.float32),
                                       np.zeros((0,), np.float32), expected, 2, 2, 1.0, 2, 1,
                                       True)
    np.testing.assert_array_equal(grad_input.host(), expected)


def test_copy_to_cpu_trims_a_given_keep_array_like_the_entry_point(rocm_fallback):
    boxes = np.array([[0, 0, 1, 1], [0, 0, 1, 1.1], [5, 5, 6, 6]], np.float32)
    scores = np.array([0.9, 0.8, 0.7], np.float32)
    keep = OnRocm(np.full(3, -1, np.int64))
    count = OnRocm(np.zeros(1, np.int64))
    assert mmdispatch.nms_impl(OnRocm(boxes), OnRocm(scores), None, keep, count, 0.5, 0) is None
    np.testing.assert_array_equal(keep.host()[:2], [0, 2])
    np.testing.assert_array_equal(count.host(), [2])
    kept = mmdispatch.nms_impl(OnRocm(boxes), OnRocm(scores), None, keep, None, 0.5, 0)
    assert isinstance(kept, OnRocm)
    np.testing.assert_array_equal(kept.host(), [0, 2])
    np.testing.assert_array_equal(ops.nms(OnRocm(boxes), OnRocm(scores), 0.5).host(), [0, 2])


def test_copy_to_cpu_raises_the_cpu_kernels_error_naming_op_and_parameter(rocm_fallback):
    boxes = OnRocm(np.zeros((3, 3), np.float32))   # wrong box width
    with pytest.raises(ValueError, match=r"^bbox_overlaps_impl: .*bboxes1"):
        mmdispatch.bbox_overlaps_impl(boxes, OnRocm(np.zeros((2, 4), np.float32)), None, 0,
                                      False, 0)


def _outcome(function, args):
    try:
        result = function(*args)
    except Exception as exc:   # the CPU kernel's error: the fallback must give the same
        return type(exc), str(exc)
    return result


def _host(value):
    if isinstance(value, tuple):
        return tuple(_host(v) for v in value)
    return value.host() if isinstance(value, OnRocm) else value


@pytest.mark.parametrize("op_name", sorted(mmdispatch.op_signatures()))
def test_every_entry_point_through_copy_to_cpu_matches_the_cpu_kernel(op_name, rocm_fallback):
    for seed in range(12):
        args, sig = fuzz_cases.plausible_call(op_name, seed)
        on_cpu = [a.copy() if isinstance(a, np.ndarray) else a for a in args]
        on_rocm = [OnRocm(a.copy()) if isinstance(a, np.ndarray) else a for a in args]
        for allocate in (False, True):
            if allocate and not sig.allocations:
                continue
            if allocate:   # the entry point (or the fallback) allocates the outputs
                for a in sig.allocations:
                    index = [p.name for p in sig.params].index(a.name)
                    on_cpu[index] = on_rocm[index] = None
            expected = _outcome(getattr(mmdispatch, op_name), on_cpu)
            got = _outcome(getattr(mmdispatch, op_name), on_rocm)
            if isinstance(expected, tuple) and isinstance(expected[0], type):
                assert got == expected, (op_name, seed, allocate)
                continue
            np.testing.assert_equal(_host(got), expected, err_msg=f"{op_name} seed {seed}")
            for cpu, rocm in zip(on_cpu, on_rocm):
                if isinstance(rocm, OnRocm):   # outputs written back, inputs untouched
                    np.testing.assert_equal(rocm.host(), cpu, err_msg=f"{op_name} seed {seed}")


def test_the_first_use_per_op_and_device_warns_once_naming_the_cost():
    x, rois = roi_inputs()
    boxes = np.array([[0, 0, 1, 1]], np.float32)
    with mmdispatch.register_fallback("rocm", copy_to_cpu):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                ops.roi_align(OnRocm(x), OnRocm(rois), 2)
            ops.nms(OnRocm(boxes), OnRocm(np.ones(1, np.float32)), 0.5)
            ops.roi_align(OnRocm(x, device=(10, 1)), OnRocm(rois, device=(10, 1)), 2)
    messages = [str(w.message) for w in caught if w.category is mmdispatch.FallbackWarning]
    assert len(messages) == 3
    assert messages[0].startswith("roi_align_forward_impl: no kernel for rocm:0")
    assert "copies its arrays to host memory" in messages[0]
    assert messages[1].startswith("nms_impl: no kernel for rocm:0")
    assert messages[2].startswith("roi_align_forward_impl: no kernel for rocm:1")
    assert all(w.filename == __file__ for w in caught)   # points at the caller


def test_a_fallback_gets_the_op_name_and_the_boxed_arguments():
    seen = []

    def fallback(op, call):
        seen.append((op, call))
        return "from the fallback"

    x, rois = roi_inputs()
    a, b = OnRocm(x), OnRocm(rois)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", fallback) as handle:
            assert handle.active and mmdispatch.registered_fallbacks() == {
                "rocm": handle.origin}
            result = mmdispatch.roi_align_forward_impl(a, b, None, None, None, 2, 3, 0.5, 0, 1,
                                                       False)
    assert result == "from the fallback"
    (op, call), = seen
    assert op == call.op == "roi_align_forward_impl" and call.device == "rocm:0"
    assert list(call.arrays) == ["input", "rois", "output", "argmax_y", "argmax_x"]
    assert call.arrays["input"] is a and call.arrays["output"] is None
    assert call.devices == {"input": "rocm:0", "rois": "rocm:0", "output": None,
                            "argmax_y": None, "argmax_x": None}
    assert call.scalars == {"aligned_height": 2, "aligned_width": 3, "spatial_scale": 0.5,
                            "sampling_ratio": 0, "pool_mode": 1, "aligned": False}
    assert call.outputs == ("output", "argmax_y", "argmax_x")
    assert call.allocating and call.returns == ("output", "argmax_y", "argmax_x")
    np.testing.assert_array_equal(call.redispatch({"input": x, "rois": rois})[0],
                                  ops.roi_align(x, rois, (2, 3), 0.5, 0, aligned=False))
    assert not handle.active and mmdispatch.registered_fallbacks() == {}


def test_fallbacks_never_apply_where_a_kernel_is():
    called = []

    def fallback(op, call):
        called.append(op)
        with mmdispatch.use_backend("cpu", "default"):
            return call.redispatch()

    with mmdispatch.register_fallback("cpu", fallback):
        x, rois = roi_inputs()
        ops.roi_align(x, rois, 2)
        assert called == []
        # a backend without CPU kernels: the slot is empty, the fallback serves it
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
            with mmdispatch.use_backend("cpu", "deterministic"):
                ops.roi_align(x, rois, 2)
    assert called == ["roi_align_forward_impl"]


def test_copy_to_cpu_refuses_to_serve_the_cpu():
    x, rois = roi_inputs()
    with mmdispatch.register_fallback("cpu", copy_to_cpu):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
            with mmdispatch.use_backend("cpu", "deterministic"):
                with pytest.raises(TypeError, match="roi_align_forward_impl: copy_to_cpu "
                                                    "serves devices other than the CPU"):
                    ops.roi_align(x, rois, 2)


def test_register_fallback_refuses_a_second_one_unless_override_and_restores_on_remove():
    first = mmdispatch.register_fallback("oneapi", copy_to_cpu)
    try:
        with pytest.raises(ValueError, match="oneapi already has a fallback"):
            mmdispatch.register_fallback("oneapi", print)
        second = mmdispatch.register_fallback("oneapi", print, override=True)
        assert second.active and not first.active
        second.remove()
        second.remove()
        assert first.active
    finally:
        first.remove()
    assert mmdispatch.registered_fallbacks() == {}
    with pytest.raises(TypeError, match="fn must be callable"):
        mmdispatch.register_fallback("oneapi", 3)
    with pytest.raises(ValueError, match="unknown device"):
        mmdispatch.register_fallback("tpu", copy_to_cpu)


def test_copy_to_cpu_explains_an_array_it_cannot_copy(rocm_fallback, fake_array):
    rois = fake_array(10, 0)   # refuses every export
    x = OnRocm(np.zeros((1, 1, 4, 4), np.float32))
    with pytest.raises(TypeError, match=r"roi_align_forward_impl: the copy_to_cpu fallback "
                                        r"cannot copy rois \(FakeDeviceArray\) to the host"):
        mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 2, 1.0, 0, 1, True)


def _user_cases():
    rng = np.random.default_rng(3)
    f = np.float64
    x = rng.random((2, 8, 6, 6))
    rois = np.array([[0, 0, 0, 4, 4], [1, 1, 0.5, 5, 3]], f)
    offset = rng.normal(size=(2, 18, 6, 6))
    mask = rng.random((2, 9, 6, 6))
    weight = rng.normal(size=(4, 8, 3, 3))
    rboxes = np.array([[5, 5, 4, 2, 0.3], [5, 5.2, 4, 2, 0.35], [20, 20, 3, 3, 1.0]], f)
    logits, target = rng.normal(size=(5, 4)), np.array([0, 3, 1, -1, 2], np.int64)
    grad, ps_grad = rng.normal(size=(2, 8, 2, 2)), rng.normal(size=(2, 2, 2, 2))
    rotated = np.array([[0, 3, 3, 4, 2, 0.4], [1, 2, 3, 3, 3, -0.2]], f)
    _, argmax_y, argmax_x = ops.roi_align_forward(x, rois, 2, 1.0, 2, "max", True)
    argmax = ops.roi_pool_forward(x, rois, 2)[1]
    return [
        (ops.deform_conv2d, (x, offset, weight), {"padding": 1, "mask": mask}),
        (ops.ps_roi_align, (x, rois, 2, 1.0, 2), {}),
        (ops.ps_roi_pool, (x, rois, 2), {}),
        (ops.nms_rotated, (rboxes, np.array([0.9, 0.8, 0.7]), 0.5), {}),
        (ops.softmax_focal_loss, (logits, target), {"reduction": "none"}),
        # the backward functions allocate grad_input in the array's own library
        (ops.roi_align_backward, (grad, rois, None, None, x.shape, 1.0, 2), {}),
        (ops.roi_align_backward, (grad, rois, argmax_y, argmax_x, x.shape, 1.0, 2, "max"), {}),
        (ops.roi_pool_backward, (grad, rois, argmax, x.shape), {}),
        (ops.ps_roi_align_backward, (ps_grad, rois, x.shape, 1.0, 2), {}),
        (ops.ps_roi_pool_backward, (ps_grad, rois, x.shape), {}),
        (ops.roi_align_rotated_backward, (grad, rotated, x.shape, 1.0, 2), {}),
    ]


@pytest.mark.parametrize("case", range(11))
def test_user_functions_on_a_device_without_kernels_give_the_cpu_results(case, rocm_fallback):
    function, args, kwargs = _user_cases()[case]
    on_rocm = [OnRocm(a) if isinstance(a, np.ndarray) else a for a in args]
    kw_rocm = {k: OnRocm(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    got = function(*on_rocm, **kw_rocm)
    assert isinstance(got, OnRocm) and got.device == (10, 0)
    np.testing.assert_array_equal(got.host(), function(*args, **kwargs))


# --- C fallbacks: a capsule holding an mmd_boxed_fn (include/mmdispatch/boxed.h) ---

class MmdTensor(ctypes.Structure):   # mmdispatch/tensor.h
    _fields_ = [("data", ctypes.c_void_p), ("shape", ctypes.c_int64 * 8),
                ("strides", ctypes.c_int64 * 8), ("ndim", ctypes.c_int32),
                ("dtype", ctypes.c_int32), ("device_type", ctypes.c_int32),
                ("device_id", ctypes.c_int32), ("writable", ctypes.c_int32)]


class MmdContext(ctypes.Structure):
    _fields_ = [("stream", ctypes.c_void_p), ("device_id", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("op", ctypes.c_char_p), ("fallback", ctypes.c_void_p)]


class BoxedArg(ctypes.Structure):    # mmdispatch/boxed.h
    _fields_ = [("name", ctypes.c_char_p), ("kind", ctypes.c_int32), ("flags", ctypes.c_int32),
                ("array", ctypes.POINTER(MmdTensor)), ("int_value", ctypes.c_int64),
                ("float_value", ctypes.c_double)]


class BoxedCallStruct(ctypes.Structure):
    pass


BoxedCallStruct._fields_ = [
    ("op", ctypes.c_char_p), ("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32),
    ("num_args", ctypes.c_int32), ("args", ctypes.POINTER(BoxedArg)),
    ("ctx", ctypes.POINTER(MmdContext)),
    ("error", ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(BoxedCallStruct), ctypes.c_int,
                               ctypes.c_char_p)),
    ("state", ctypes.c_void_p)]


BOXED_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(BoxedCallStruct))
NUMPY_DTYPES = {4: np.int32, 5: np.int64, 12: np.float32, 13: np.float64}   # mmd_dtype codes
DLPACK_DTYPES = {np.dtype(np.float32): (2, 32), np.dtype(np.float64): (2, 64),
                 np.dtype(np.int64): (0, 64), np.dtype(np.int32): (0, 32)}


class HostMemoryOnRocm:
    """An array of a device without kernels (ROCm) whose memory the test can
    read: it exports DLPack views of host memory that say rocm:0."""

    def __init__(self, array):
        self.array = np.ascontiguousarray(array)

    def __dlpack_device__(self):
        return (10, 0)

    def __dlpack__(self, **kwargs):
        code, bits = DLPACK_DTYPES[self.array.dtype]
        return fuzz_cases.crafted_capsule(self.array, self.array.shape, self.array.ndim, code,
                                          bits, 1, (10, 0))


def host_view(tensor):
    """The numpy view of a boxed array's memory (host memory here)."""
    t = tensor.contents
    shape = tuple(t.shape[d] for d in range(t.ndim))
    dtype = np.dtype(NUMPY_DTYPES[t.dtype])
    size = int(np.prod(shape)) if shape else 1
    if size == 0:
        return np.zeros(shape, dtype)
    buffer = (ctypes.c_char * (size * dtype.itemsize)).from_address(t.data)
    return np.frombuffer(buffer, dtype).reshape(shape)


LIVE_C_FALLBACKS = []


class CFallback:
    """A C fallback made with ctypes: it records each boxed call and, by
    default, runs the CPU kernel on the arrays' memory in place; `status`
    and `message` make it fail instead."""

    def __init__(self, status=0, message=None, from_thread=False):
        self.calls, self.status, self.message = [], status, message
        self.from_thread = from_thread
        self.function = BOXED_FN(self)
        # the capsule holds only the function's address: the ctypes function
        # must outlive every call (a test may keep just the capsule)
        LIVE_C_FALLBACKS.append(self)
        self.capsule = fuzz_cases.pycapsule_new(ctypes.cast(self.function, ctypes.c_void_p),
                                                b"mmdispatch.boxed_fallback", None)

    def __call__(self, call_pointer):
        call = call_pointer.contents
        args = [call.args[i] for i in range(call.num_args)]
        self.calls.append({
            "op": call.op.decode(), "device": (call.device_type, call.device_id),
            "ctx_op": call.ctx.contents.op.decode(),
            "args": [(a.name.decode(), a.kind, a.flags,
                      None if a.kind or not a.array else host_view(a.array).copy(),
                      a.int_value, a.float_value) for a in args]})
        if self.status:
            if self.message is None:
                return self.status
            if self.from_thread:   # the call's own message, whichever thread sets it
                worker = threading.Thread(
                    target=call.error, args=(call_pointer, self.status, self.message))
                worker.start()
                worker.join()
                return self.status
            return call.error(call_pointer, self.status, self.message)
        values = [(host_view(a.array) if a.array else None) if a.kind == 0
                  else a.float_value if a.kind == 2 else bool(a.int_value) if a.kind == 3
                  else a.int_value for a in args]
        try:
            getattr(mmdispatch, call.op.decode())(*values)
        except (ValueError, TypeError) as exc:
            return call.error(call_pointer, 1 if isinstance(exc, ValueError) else 2,
                              str(exc).partition(": ")[2].encode())
        return 0


def test_a_c_fallback_runs_the_op_on_the_device_arrays_in_place():
    x, rois = roi_inputs()
    fallback = CFallback()
    output = HostMemoryOnRocm(np.zeros((2, 3, 2, 2), np.float32))
    unused = HostMemoryOnRocm(np.zeros(0, np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mmdispatch.register_fallback("rocm", fallback.capsule) as handle:
            assert handle.kind == "C" and handle.active
            origin = mmdispatch.registered_fallbacks()["rocm"]
            assert origin == handle.origin and origin.startswith(
                "capsule:mmdispatch.boxed_fallback at 0x")
            for _ in range(2):
                mmdispatch.roi_align_forward_impl(HostMemoryOnRocm(x), HostMemoryOnRocm(rois),
                                                  output, unused, unused, 2, 2, 0.5, 0, 1, True)
    np.testing.assert_array_equal(output.array, ops.roi_align(x, rois, 2, 0.5, 0))
    assert len(fallback.calls) == 2
    warned = [str(w.message) for w in caught if w.category is mmdispatch.FallbackWarning]
    assert len(warned) == 1 and warned[0].startswith(
        "roi_align_forward_impl: no kernel for rocm:0; running it through the rocm fallback")
    assert mmdispatch.registered_fallbacks() == {}
    with pytest.raises(mmdispatch.KernelNotFoundError):
        mmdispatch.roi_align_forward_impl(HostMemoryOnRocm(x), HostMemoryOnRocm(rois), output,
                                          unused, unused, 2, 2, 0.5, 0, 1, True)


def test_a_c_fallback_gets_every_argument_boxed_in_signature_order():
    boxes = np.array([[0, 0, 4, 4], [1, 1, 5, 5], [9, 9, 12, 12]], np.float64)
    fallback = CFallback()
    keep, count = np.zeros(3, np.int64), np.zeros(1, np.int64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", fallback.capsule):
            mmdispatch.nms_impl(HostMemoryOnRocm(boxes), HostMemoryOnRocm(boxes[:, 0] * -1),
                                None, HostMemoryOnRocm(keep), HostMemoryOnRocm(count), 0.25, 1)
    (call,) = fallback.calls
    assert call["op"] == call["ctx_op"] == "nms_impl" and call["device"] == (10, 0)
    names = [a[0] for a in call["args"]]
    assert names == ["boxes", "scores", "idxs", "keep", "num_kept", "iou_threshold", "offset"]
    kinds = {a[0]: (a[1], a[2]) for a in call["args"]}
    assert kinds["boxes"] == (0, 0) and kinds["idxs"] == (0, ARG_OPTIONAL)
    assert kinds["keep"] == (0, ARG_OUTPUT) and kinds["iou_threshold"] == (2, 0)
    assert kinds["offset"][0] == 1
    args = {a[0]: a for a in call["args"]}
    np.testing.assert_array_equal(args["boxes"][3], boxes)
    assert args["idxs"][3] is None
    assert args["iou_threshold"][5] == 0.25 and args["offset"][4] == 1


def test_a_c_fallbacks_error_is_raised_with_its_type_and_message():
    x, rois = roi_inputs()
    args = [HostMemoryOnRocm(x), HostMemoryOnRocm(rois),
            HostMemoryOnRocm(np.zeros((2, 3, 2, 2), np.float32)),
            HostMemoryOnRocm(np.zeros(0, np.float32)), HostMemoryOnRocm(np.zeros(0, np.float32)),
            2, 2, 0.5, 0, 1, True]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", CFallback(1, b"no such luck").capsule):
            with pytest.raises(ValueError, match=r"^roi_align_forward_impl: no such luck$"):
                mmdispatch.roi_align_forward_impl(*args)
        with mmdispatch.register_fallback("rocm", CFallback(2, b"set by a worker",
                                                            from_thread=True).capsule):
            with pytest.raises(TypeError, match=r"^roi_align_forward_impl: set by a worker$"):
                mmdispatch.roi_align_forward_impl(*args)
        with mmdispatch.register_fallback("rocm", CFallback(3).capsule):
            with pytest.raises(RuntimeError, match=r"^roi_align_forward_impl: the C fallback "
                                                   r"returned status 3 without a message"):
                mmdispatch.roi_align_forward_impl(*args)
        bad_rois = rois.copy()
        bad_rois[1, 0] = 5
        args[1] = HostMemoryOnRocm(bad_rois)
        with mmdispatch.register_fallback("rocm", CFallback().capsule):   # the CPU kernel's error
            with pytest.raises(ValueError, match=r"^roi_align_forward_impl: rois\[1, 0\] "
                                                 r"\(batch index\) must be an integer in \[0, 2\)"):
                mmdispatch.roi_align_forward_impl(*args)


def test_hooks_see_a_c_fallback_call_as_the_fallback_kernel():
    x, rois = roi_inputs()
    seen = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", CFallback().capsule), \
                mmdispatch.trace(lambda when, call: seen.append((when, call.kernel, call.device))):
            mmdispatch.roi_align_forward_impl(
                HostMemoryOnRocm(x), HostMemoryOnRocm(rois),
                HostMemoryOnRocm(np.zeros((2, 3, 2, 2), np.float32)),
                HostMemoryOnRocm(np.zeros(0, np.float32)),
                HostMemoryOnRocm(np.zeros(0, np.float32)), 2, 2, 0.5, 0, 1, True)
    assert seen == [("begin", "fallback", "rocm:0"), ("end", "fallback", "rocm:0")]


def test_a_c_fallback_capsule_must_carry_the_boxed_fallback_name():
    function = BOXED_FN(lambda call: 0)   # never called: the capsule is refused
    capsule = fuzz_cases.pycapsule_new(ctypes.cast(function, ctypes.c_void_p),
                                       b"mmdispatch.kernel.nms_impl", None)
    with pytest.raises(TypeError, match="a C fallback capsule must be named "
                                        "'mmdispatch.boxed_fallback', got "
                                        "'mmdispatch.kernel.nms_impl'"):
        mmdispatch.register_fallback("rocm", capsule)
    assert mmdispatch.registered_fallbacks() == {}


def test_a_c_fallback_warns_only_for_a_call_whose_outputs_pass_their_checks():
    """An output that overlaps an input is refused before the fallback runs:
    that call neither reaches the fallback nor uses up its one warning,
    which the next good call gives."""
    x, rois = roi_inputs()
    fallback = CFallback()
    features = HostMemoryOnRocm(x)
    unused = HostMemoryOnRocm(np.zeros(0, np.float32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mmdispatch.register_fallback("rocm", fallback.capsule):
            with pytest.raises(ValueError, match=r"^roi_align_forward_impl: .*overlap"):
                mmdispatch.roi_align_forward_impl(features, HostMemoryOnRocm(rois), features,
                                                  unused, unused, 2, 2, 0.5, 0, 1, True)
            assert fallback.calls == []
            assert not [w for w in caught if w.category is mmdispatch.FallbackWarning]
            output = HostMemoryOnRocm(np.zeros((2, 3, 2, 2), np.float32))
            mmdispatch.roi_align_forward_impl(features, HostMemoryOnRocm(rois), output, unused,
                                              unused, 2, 2, 0.5, 0, 1, True)
    assert len(fallback.calls) == 1
    assert len([w for w in caught if w.category is mmdispatch.FallbackWarning]) == 1


def test_the_cost_given_at_registration_is_what_the_warning_names():
    """A capsule has no `cost` attribute: register_fallback's cost= names
    what it costs; for a callable, cost= wins over its attribute. Without
    either the warning names the fallback's origin."""
    x, rois = roi_inputs()
    unused = HostMemoryOnRocm(np.zeros(0, np.float32))

    def call_c():
        output = HostMemoryOnRocm(np.zeros((2, 3, 2, 2), np.float32))
        mmdispatch.roi_align_forward_impl(HostMemoryOnRocm(x), HostMemoryOnRocm(rois), output,
                                          unused, unused, 2, 2, 0.5, 0, 1, True)

    def warned(register, call):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with register() as handle:
                call()
        messages = [str(w.message) for w in caught if w.category is mmdispatch.FallbackWarning]
        assert len(messages) == 1
        return handle, messages[0]

    handle, message = warned(lambda: mmdispatch.register_fallback(
        "rocm", CFallback().capsule, cost="a host copy of every array, each way"), call_c)
    assert handle.cost == "a host copy of every array, each way"
    assert message.endswith("which costs: a host copy of every array, each way")
    handle, message = warned(lambda: mmdispatch.register_fallback("rocm", CFallback().capsule),
                             call_c)
    assert handle.cost is None
    assert message.endswith(f"which costs: each call goes through {handle.origin} instead of "
                            "a kernel")
    handle, message = warned(lambda: mmdispatch.register_fallback("rocm", copy_to_cpu,
                                                                  cost="the test's words"),
                             lambda: ops.roi_align(OnRocm(x), OnRocm(rois), 2))
    assert message.endswith("which costs: the test's words")
    assert mmdispatch.register_fallback("rocm", copy_to_cpu).remove() is None
    with pytest.raises(TypeError, match="register_fallback: cost must be a string, got int"):
        mmdispatch.register_fallback("rocm", copy_to_cpu, cost=3)
    assert mmdispatch.registered_fallbacks() == {}


def test_a_c_fallback_needs_given_outputs_where_the_dispatcher_cannot_allocate():
    x, rois = roi_inputs()
    fallback = CFallback()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", fallback.capsule):
            with pytest.raises(TypeError, match=r"^roi_align_forward_impl: "):
                mmdispatch.roi_align_forward_impl(HostMemoryOnRocm(x), HostMemoryOnRocm(rois),
                                                  None, None, None, 2, 2, 0.5, 0, 1, True)
    assert fallback.calls == []


def test_the_c_fallback_chosen_for_a_call_runs_it_even_if_replaced_meanwhile():
    """Python code can run between the choice and the call (a hook's begin,
    here): the call keeps the fallback it chose, held alive for the call."""
    x, rois = roi_inputs()
    chosen, replacement = CFallback(), CFallback()
    replaced = []

    class Replacer:
        def begin(self, call):
            if not replaced:
                replaced.append(mmdispatch.register_fallback("rocm", replacement.capsule,
                                                             override=True))

        def end(self, call):
            pass

    arrays = [HostMemoryOnRocm(x), HostMemoryOnRocm(rois),
              HostMemoryOnRocm(np.zeros((2, 3, 2, 2), np.float32)),
              HostMemoryOnRocm(np.zeros(0, np.float32)), HostMemoryOnRocm(np.zeros(0, np.float32))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", chosen.capsule), \
                mmdispatch.add_hook(Replacer()):
            mmdispatch.roi_align_forward_impl(*arrays, 2, 2, 0.5, 0, 1, True)
            replaced[0].remove()
    assert len(chosen.calls) == 1 and replacement.calls == []


def test_a_c_fallback_on_the_cpu_gets_the_outputs_the_dispatcher_allocates():
    """numpy arrays, a backend with no CPU kernels: the plain-numpy intake
    and the entry point's allocation serve the C fallback as a kernel."""
    x, rois = roi_inputs()
    fallback = CFallback(1, b"recorded")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("cpu", fallback.capsule), \
                mmdispatch.use_backend("cpu", "deterministic"):
            with pytest.raises(ValueError, match="^roi_align_forward_impl: recorded$"):
                mmdispatch.roi_align_forward_impl(x, rois, None, None, None, 2, 3, 0.5, 0, 1,
                                                  True)
            with pytest.raises(ValueError, match="^roi_align_forward_impl: recorded$"):
                mmdispatch.roi_align_forward_impl(x, rois, np.zeros((2, 3, 2, 3), np.float32),
                                                  np.zeros(0, np.float32),
                                                  np.zeros(0, np.float32), 2, 3, 0.5, 0, 1, True)
    allocated, given = fallback.calls
    for call in (allocated, given):
        args = {a[0]: a for a in call["args"]}
        assert call["device"] == (1, 0)
        np.testing.assert_array_equal(args["input"][3], x)
        assert args["output"][3].shape == (2, 3, 2, 3)
        assert args["aligned_width"][4] == 3 and args["aligned"][4] == 1
