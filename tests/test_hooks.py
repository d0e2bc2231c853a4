"""Dispatch hooks (mmdispatch.add_hook / trace, _layers.pxi): what a hook
sees, in which order, across threads, around failing kernels, and what a
raising hook does."""
import threading
import warnings

import numpy as np
import pytest

import mmdispatch
from mmdispatch import ops
from mmdispatch.fallbacks import copy_to_cpu
from stand_ins import HostBackedDeviceArray as OnRocm


def tiny():
    x = np.arange(2 * 3 * 6 * 6, dtype=np.float32).reshape(2, 3, 6, 6)
    rois = np.array([[0, 0, 0, 4, 4], [1, 1, 1, 5, 3]], np.float32)
    return x, rois


class Recorder:
    """A hook that logs (name, event, op) and keeps the records."""

    def __init__(self, name="hook", log=None):
        self.name, self.log, self.calls = name, [] if log is None else log, []

    def begin(self, call):
        self.log.append((self.name, "begin", call.op))

    def end(self, call):
        self.log.append((self.name, "end", call.op))
        self.calls.append(call)


def test_trace_sees_each_call_before_and_after_the_kernel_with_its_details():
    x, rois = tiny()
    events = []

    def callback(event, call):
        events.append((event, call.op, call.device, call.backend, call.kernel, call.names,
                       call.dtypes, call.shapes, call.scalars, call.error))

    with mmdispatch.trace(callback) as handle:
        assert handle.active and mmdispatch.hooks() == [handle.hook]
        out = ops.roi_align(x, rois, (2, 3), 0.5)
    assert not handle.active and mmdispatch.hooks() == []
    names = ("input", "rois", "output", "argmax_y", "argmax_x")
    dtypes = ("float32",) * 5
    shapes = ((2, 3, 6, 6), (2, 5), (2, 3, 2, 3), (0,), (0,))
    scalars = {"aligned_height": 2, "aligned_width": 3, "spatial_scale": 0.5,
               "sampling_ratio": 0, "pool_mode": 1, "aligned": True}
    assert events == [
        ("begin", "roi_align_forward_impl", "cpu", "default", "C", names, dtypes, shapes,
         scalars, None),
        ("end", "roi_align_forward_impl", "cpu", "default", "C", names, dtypes, shapes,
         scalars, None),
    ]
    assert out.shape == (2, 3, 2, 3)


def test_the_record_has_times_and_thread_and_keeps_no_arguments_after_the_end():
    x, rois = tiny()
    hook = Recorder()
    with mmdispatch.add_hook(hook):
        ops.roi_align(x, rois, 2)
    call, = hook.calls
    assert call.scalars is None   # the record holds no reference to the call's arrays
    assert 0 < call.start_ns <= call.end_ns and call.host_ns == call.end_ns - call.start_ns
    assert call.thread == threading.get_ident()
    assert call.stream is None
    assert call.notes == {}


def test_hooks_begin_in_the_order_added_and_end_in_reverse():
    x, rois = tiny()
    log = []
    with mmdispatch.add_hook(Recorder("a", log)), mmdispatch.add_hook(Recorder("b", log)):
        ops.roi_align(x, rois, 2)
    assert log == [("a", "begin", "roi_align_forward_impl"),
                   ("b", "begin", "roi_align_forward_impl"),
                   ("b", "end", "roi_align_forward_impl"),
                   ("a", "end", "roi_align_forward_impl")]


def test_nested_calls_from_a_python_kernel_are_seen_inside_the_outer_call():
    x, rois = tiny()
    boxes = np.array([[0, 0, 1, 1], [0, 0, 1, 1.05]], np.float32)

    def nms_kernel(boxes, scores, idxs, keep, num_kept, iou_threshold, offset):
        ops.roi_align(x, rois, 2)   # an op called from inside a kernel
        keep[0], num_kept[0] = 0, 1

    log = []
    with mmdispatch.register_impl("nms_impl", "cpu", nms_kernel, override=True):
        with mmdispatch.add_hook(Recorder("h", log)):
            ops.nms(boxes, np.ones(2, np.float32), 0.5)
    assert log == [("h", "begin", "nms_impl"), ("h", "begin", "roi_align_forward_impl"),
                   ("h", "end", "roi_align_forward_impl"), ("h", "end", "nms_impl")]


def test_a_python_kernel_is_recorded_as_python_with_the_shapes_of_its_arguments():
    boxes = np.zeros((3, 4), np.float32)
    hook = Recorder()
    with mmdispatch.register_impl("bbox_overlaps_impl", "cpu", lambda *a: None, override=True):
        with mmdispatch.add_hook(hook):
            mmdispatch.bbox_overlaps_impl(boxes, boxes, np.zeros((3, 3), np.float32), 0, False,
                                          0)
    call, = hook.calls
    assert call.kernel == "python"
    assert call.shapes == ((3, 4), (3, 4), (3, 3)) and call.dtypes == ("float32",) * 3


def test_an_exception_inside_the_kernel_still_reaches_the_end():
    x = np.zeros((1, 1, 4, 4), np.float32)
    bad_rois = np.array([[5, 0, 0, 1, 1]], np.float32)   # batch index out of range
    hook = Recorder()
    with mmdispatch.add_hook(hook):
        with pytest.raises(ValueError, match="roi_align_forward_impl: ") as info:
            ops.roi_align(x, bad_rois, 2)

        def failing(*args):
            raise KeyError("from the kernel")

        with mmdispatch.register_impl("bbox_overlaps_impl", "cpu", failing, override=True):
            with pytest.raises(KeyError):
                ops.bbox_overlaps(np.zeros((1, 4)), np.zeros((1, 4)))
    assert [c.op for c in hook.calls] == ["roi_align_forward_impl", "bbox_overlaps_impl"]
    assert hook.calls[0].error is info.value
    assert isinstance(hook.calls[1].error, KeyError)


def test_calls_rejected_before_a_kernel_is_chosen_are_not_seen():
    hook = Recorder()
    boxes = np.zeros((2, 4), np.float32)
    read_only = np.zeros((2, 2), np.float32)
    read_only.flags.writeable = False
    with mmdispatch.add_hook(hook):
        with pytest.raises(TypeError):
            mmdispatch.bbox_overlaps_impl("not an array", None, None, 0, False, 0)
        with pytest.raises(ValueError, match="read-only"):
            mmdispatch.bbox_overlaps_impl(boxes, boxes, read_only, 0, False, 0)
    assert hook.calls == []


def test_calls_refused_by_the_kernels_own_argument_checks_are_seen_with_their_error():
    """Shapes, dtypes and scalars are checked by the kernel, after the
    hooks' begin (README: Fallbacks, hooks and profiling)."""
    x, rois = tiny()
    hook = Recorder()
    with mmdispatch.add_hook(hook):
        with pytest.raises(ValueError, match="rois") as shape:
            ops.roi_align(x, rois[:, 1:], 2)
        with pytest.raises(TypeError, match="rois") as dtype:
            ops.roi_align(x, rois.astype(np.float64), 2)
    assert [c.op for c in hook.calls] == ["roi_align_forward_impl"] * 2
    assert hook.calls[0].error is shape.value and hook.calls[1].error is dtype.value


def test_a_hook_that_raises_in_begin_stops_the_kernel_and_the_others_still_end():
    x, rois = tiny()
    log = []

    class Raising(Recorder):
        def begin(self, call):
            raise RuntimeError("hook failed")

    output = np.full((2, 3, 2, 2), -1, np.float32)
    empty = np.zeros((0,), np.float32)
    with mmdispatch.add_hook(Recorder("first", log)), mmdispatch.add_hook(Raising("bad", log)):
        with pytest.raises(RuntimeError, match="hook failed"):
            mmdispatch.roi_align_forward_impl(x, rois, output, empty, empty, 2, 2, 1.0, 0, 1,
                                              True)
    assert (output == -1).all()   # the kernel did not run
    assert log == [("first", "begin", "roi_align_forward_impl"),
                   ("first", "end", "roi_align_forward_impl")]


def test_a_hook_that_raises_in_end_propagates_after_every_hook_ended():
    x, rois = tiny()
    log = []

    class Raising(Recorder):
        def end(self, call):
            super().end(call)
            raise RuntimeError("end failed")

    with mmdispatch.add_hook(Recorder("first", log)), mmdispatch.add_hook(Raising("bad", log)):
        with pytest.raises(RuntimeError, match="end failed"):
            ops.roi_align(x, rois, 2)
    assert [entry[:2] for entry in log] == [("first", "begin"), ("bad", "begin"),
                                            ("bad", "end"), ("first", "end")]


def test_a_hooks_own_calls_are_not_seen_by_hooks():
    x, rois = tiny()
    seen = []

    def callback(event, call):
        seen.append((event, call.op))
        if event == "begin":   # an op called from inside the hook
            ops.bbox_overlaps(np.zeros((1, 4)), np.zeros((1, 4)))

    with mmdispatch.trace(callback):
        ops.roi_align(x, rois, 2)
    assert seen == [("begin", "roi_align_forward_impl"), ("end", "roi_align_forward_impl")]


def test_a_fallbacks_inner_calls_are_hidden_and_the_call_is_recorded_as_fallback():
    x, rois = tiny()
    hook = Recorder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", mmdispatch.FallbackWarning)
        with mmdispatch.register_fallback("rocm", copy_to_cpu), mmdispatch.add_hook(hook):
            ops.roi_align(OnRocm(x), OnRocm(rois), 2)
    call, = hook.calls
    assert (call.op, call.device, call.kernel) == ("roi_align_forward_impl", "rocm:0",
                                                   "fallback")
    assert call.shapes == ((2, 3, 6, 6), (2, 5), None, None, None)


def test_hooks_are_process_wide_and_see_calls_from_other_threads():
    x, rois = tiny()
    hook = Recorder()
    with mmdispatch.add_hook(hook):
        worker = threading.Thread(target=lambda: ops.roi_align(x, rois, 2))
        worker.start()
        worker.join()
    call, = hook.calls
    assert call.thread == worker.ident != threading.get_ident()


def test_the_exclusion_guard_is_per_thread():
    x, rois = tiny()
    inside, release = threading.Event(), threading.Event()
    seen = []

    def callback(event, call):
        seen.append((event, threading.get_ident()))
        if event == "begin" and threading.get_ident() == main:
            inside.set()
            release.wait(10)   # this thread is inside a hook while the other one calls

    main = threading.get_ident()
    with mmdispatch.trace(callback):
        worker = threading.Thread(target=lambda: (inside.wait(10), ops.roi_align(x, rois, 2),
                                                  release.set()))
        worker.start()
        ops.roi_align(x, rois, 2)
        worker.join()
    assert ("begin", worker.ident) in seen and ("end", worker.ident) in seen


def test_removing_a_hook_stops_it_and_removing_twice_is_harmless():
    x, rois = tiny()
    hook = Recorder()
    handle = mmdispatch.add_hook(hook)
    ops.roi_align(x, rois, 2)
    handle.remove()
    handle.remove()
    ops.roi_align(x, rois, 2)
    assert len(hook.calls) == 1 and mmdispatch.hooks() == []


def test_add_hook_checks_the_hook():
    with pytest.raises(TypeError, match="begin\\(call\\) and end\\(call\\)"):
        mmdispatch.add_hook(object())
    with pytest.raises(TypeError, match="callback must be callable"):
        mmdispatch.trace(3)
    hook = Recorder()
    with mmdispatch.add_hook(hook):
        with pytest.raises(ValueError, match="already added"):
            mmdispatch.add_hook(hook)


def test_allocating_calls_show_the_allocated_outputs_and_nms_its_full_keep():
    boxes = np.array([[0, 0, 1, 1], [0, 0, 1, 1.05], [3, 3, 4, 4]], np.float32)
    hook = Recorder()
    with mmdispatch.add_hook(hook):
        keep = ops.nms(boxes, np.array([0.9, 0.8, 0.7], np.float32), 0.5)
    call, = hook.calls
    assert call.shapes == ((3, 4), (3,), None, (3,), (1,))
    assert call.dtypes == ("float32", "float32", None, "int64", "int64")
    np.testing.assert_array_equal(keep, [0, 2])
