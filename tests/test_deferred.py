"""Deferred errors and strict mode: a CUDA kernel that finds bad
data (a roi, an argmax entry, a class target) after its call has returned
makes the item harmless and reports it; the next call on that device, or
mmdispatch.synchronize(), raises DeferredKernelError. Strict mode checks
before writing and raises at the call.

On any machine: the host half in C (tests/c/deferred_test.c), what the
dispatcher hands kernels (the op's name, the strict flag), how a deferred
status becomes an exception, and synchronize()'s arguments. Where a GPU,
CuPy and the CUDA kernels are present: the whole path, op by op."""
import ctypes
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import threading
from pathlib import Path

import numpy as np
import pytest

import mmdispatch

ROOT = Path(__file__).resolve().parents[1]


# --- the host half, in C --------------------------------------------------------------

def test_deferred_records_keys_and_messages_in_c(tmp_path):
    sources = [ROOT / "tests" / "c" / "deferred_test.c",
               *(ROOT / "src" / "core" / name for name in ("deferred.c", "errors.c", "rois.c"))]
    if not all(p.exists() for p in sources):
        pytest.skip("needs the source tree (src/core), which an installed wheel's tests lack")
    compiler = shutil.which(os.environ.get("CC", "") or "") or shutil.which(
        (sysconfig.get_config_var("CC") or "cc").split()[0]) or shutil.which("cc")
    if compiler is None:
        pytest.skip("no C compiler")
    binary = tmp_path / "deferred_test"
    subprocess.run([compiler, "-std=c11", "-O1", "-Wall", "-Wextra", "-Werror", "-pthread",
                    "-I", str(ROOT / "include"), *map(str, sources), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr


# --- what kernels are handed, and what a deferred status becomes ------------------------

class Context(ctypes.Structure):   # mmd_context (include/mmdispatch/tensor.h)
    _fields_ = [("stream", ctypes.c_void_p), ("device_id", ctypes.c_int32),
                ("flags", ctypes.c_uint32), ("op", ctypes.c_char_p)]


ROI_ALIGN_FORWARD = ctypes.CFUNCTYPE(
    ctypes.c_int, *[ctypes.c_void_p] * 5, ctypes.c_int64, ctypes.c_int64, ctypes.c_double,
    ctypes.c_int64, ctypes.c_int64, ctypes.c_int, ctypes.POINTER(Context))


def capsule_kernel(fn):
    """A C kernel capsule for roi_align_forward_impl calling `fn(ctx)` (ctypes
    takes the GIL for it); fn's return value is the kernel's status."""
    callback = ROI_ALIGN_FORWARD(lambda *args: fn(args[-1].contents))
    new = ctypes.pythonapi.PyCapsule_New
    new.restype = ctypes.py_object
    new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    name = mmdispatch.kernel_capsule_name("roi_align_forward_impl").encode()
    capsule = new(ctypes.cast(callback, ctypes.c_void_p), name, None)
    return capsule, (callback, name)   # the second must outlive the capsule


def forward_args(rois=None):
    x = np.ones((1, 1, 4, 4))
    r = np.array([[0, 0, 0, 2, 2]], np.float64) if rois is None else rois
    return [x, r, np.zeros((len(r), 1, 1, 1)), np.empty(0), np.empty(0), 1, 1, 1.0, 2, 1, True]


def test_kernels_are_handed_the_op_name_and_the_strict_flag():
    seen = []

    def kernel(ctx):
        seen.append((ctx.op, ctx.flags, ctx.device_id))
        return 0

    capsule, keep = capsule_kernel(kernel)
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", capsule, backend="probe"):
        with mmdispatch.use_backend("cpu", "probe"):
            mmdispatch.roi_align_forward_impl(*forward_args())
            with mmdispatch.strict():
                mmdispatch.roi_align_forward_impl(*forward_args())
                with mmdispatch.strict(False):
                    mmdispatch.roi_align_forward_impl(*forward_args())
            mmdispatch.roi_align_forward_impl(*forward_args())
    assert seen == [(b"roi_align_forward_impl", 0, 0), (b"roi_align_forward_impl", 1, 0),
                    (b"roi_align_forward_impl", 0, 0), (b"roi_align_forward_impl", 0, 0)]


def test_strict_mode_is_per_thread_and_restored():
    assert not mmdispatch.is_strict()
    other = []
    with mmdispatch.strict():
        assert mmdispatch.is_strict()
        thread = threading.Thread(target=lambda: other.append(mmdispatch.is_strict()))
        thread.start()
        thread.join()
        with pytest.raises(KeyError):
            with mmdispatch.strict(False):
                assert not mmdispatch.is_strict()
                raise KeyError
        assert mmdispatch.is_strict()
    assert not mmdispatch.is_strict() and other == [False]


def test_strict_mode_default_comes_from_the_environment(tmp_path):
    code = ("import threading, mmdispatch\n"
            "t = []\n"
            "th = threading.Thread(target=lambda: t.append(mmdispatch.is_strict()))\n"
            "th.start(); th.join()\n"
            "with mmdispatch.strict(False):\n"
            "    off = mmdispatch.is_strict()\n"
            "print(mmdispatch.is_strict(), t[0], off)\n")
    env = dict(os.environ, MMDISPATCH_STRICT="1")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "False"]


def test_a_deferred_status_raises_deferred_kernel_error_with_the_message_as_written():
    """MMD_ERR_DEFERRED: the message, written by the C side, already names the
    op of the call that caused it, so the dispatcher adds no prefix."""
    with pytest.raises(ValueError, match="rois\\[0\\] contains NaN"):   # fills the message
        mmdispatch.roi_align_forward_impl(*forward_args(np.array([[0, np.nan, 0, 2, 2]])))
    capsule, keep = capsule_kernel(lambda ctx: 5)   # MMD_ERR_DEFERRED
    with mmdispatch.register_impl("roi_align_forward_impl", "cpu", capsule, backend="probe"):
        with mmdispatch.use_backend("cpu", "probe"):
            with pytest.raises(mmdispatch.DeferredKernelError) as info:
                mmdispatch.roi_align_forward_impl(*forward_args())
    assert str(info.value).startswith("rois[0] contains NaN")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", 2])
def test_synchronize_returns_when_nothing_is_pending(device):
    assert mmdispatch.synchronize(device) is None


@pytest.mark.parametrize("device, error", [("cuda:x", ValueError), ("cuda:-1", ValueError),
                                           ("nodevice", ValueError), (3.5, TypeError)])
def test_synchronize_rejects_bad_devices(device, error):
    with pytest.raises(error):
        mmdispatch.synchronize(device)


def test_arrays_on_a_device_that_does_not_exist_are_a_clear_error(fake_array):
    """cpu has one device; arrays claiming cpu:1 (a stand-in, or an array
    from another machine) are refused naming the op, the parameter and the
    devices there are, before anything is exported."""
    arrays = [fake_array(1, 1) for _ in range(5)]
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: at param 0 (input), the arrays are on cpu:1, which does "
            "not exist: this machine has 1 cpu device(s) (cpu:0)")):
        mmdispatch.roi_align_forward_impl(*arrays, 1, 1, 1.0, 2, 1, True)
    assert not any(a.exported for a in arrays)


# --- the whole path on a GPU ------------------------------------------------------------

def bad_roi_call(cupy, dtype=np.float32):
    x = cupy.asarray(np.arange(2 * 3 * 8 * 8, dtype=dtype).reshape(2, 3, 8, 8))
    rois = np.array([[0, 0, 0, 4, 4], [1, 1, 1, 6, 6], [0, 2, 2, 5, 7]], dtype=dtype)
    bad = rois.copy()
    bad[1, 0] = 5   # batch index out of range
    return x, cupy.asarray(rois), cupy.asarray(bad)


def test_cuda_bad_roi_is_harmless_then_raised_by_the_next_call(cupy):
    x, rois, bad = bad_roi_call(cupy)
    out = mmdispatch.ops.roi_align(x, bad, 2, 1.0, 2)   # returns: nothing waited for
    expected = mmdispatch.ops.roi_align(cupy.asnumpy(x), cupy.asnumpy(rois), 2, 1.0, 2)
    # the first call that starts after the kernel has run raises (it sees the
    # error without waiting; one that starts earlier finds nothing yet)
    cupy.cuda.get_current_stream().synchronize()
    with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
            "roi_align_forward_impl: rois[1, 0] (batch index) must be an integer in [0, 2)")
            ) as info:
        mmdispatch.ops.bbox_overlaps(cupy.zeros((1, 4)), cupy.zeros((1, 4)))
    assert "raised by the next call on cuda:0, bbox_overlaps_impl, which did not run" in str(
        info.value)
    got = cupy.asnumpy(out)
    assert np.isnan(got[1]).all()                                  # the bad roi's bins
    np.testing.assert_allclose(got[[0, 2]], expected[[0, 2]], rtol=1e-5)   # the others
    mmdispatch.ops.bbox_overlaps(cupy.zeros((1, 4)), cupy.zeros((1, 4)))   # raised once only
    mmdispatch.synchronize()


def test_cuda_synchronize_raises_a_pending_error_and_clears_it(cupy):
    x, _, bad = bad_roi_call(cupy, np.float64)
    mmdispatch.ops.roi_pool(x, bad, 2)
    with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
            "roi_pool_forward_impl: rois[1, 0] (batch index)")) as info:
        mmdispatch.synchronize("cuda")
    assert "raised by mmdispatch.synchronize()" in str(info.value)
    mmdispatch.synchronize()


def test_cuda_strict_mode_raises_at_the_call_and_writes_nothing(cupy):
    x, _, bad = bad_roi_call(cupy)
    output = cupy.full((3, 3, 2, 2), 7, dtype=np.float32)
    empty = cupy.empty(0, dtype=np.float32)
    with mmdispatch.strict():
        with pytest.raises(ValueError, match=re.escape(
                "roi_align_forward_impl: rois[1, 0] (batch index)")) as info:
            mmdispatch.roi_align_forward_impl(x, bad, output, empty, empty.copy(), 2, 2, 1.0, 2,
                                              1, True)
    assert not isinstance(info.value, mmdispatch.DeferredKernelError)
    assert bool((output == 7).all())
    mmdispatch.synchronize()   # nothing was left pending


def test_cuda_bad_argmax_and_targets_are_deferred_too(cupy):
    x, rois, _ = bad_roi_call(cupy, np.float64)
    out, argmax = mmdispatch.ops.roi_pool_forward(x, rois, 2)
    # roi 0, channel 2: flat index 8 in argmax, thread 24 of the channel-major kernel
    argmax[0, 2, 0, 0] = 10 ** 6
    grad = mmdispatch.ops.roi_pool_backward(cupy.ones_like(out), rois, argmax, x.shape)
    with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
            "roi_pool_backward_impl: argmax holds a value outside [-1, 64) at flat index 8")):
        mmdispatch.synchronize()
    assert bool(cupy.isfinite(grad).all())   # the bad entry added nothing
    target = cupy.asarray(np.array([0, 7, 2]))
    loss = mmdispatch.ops.sigmoid_focal_loss_forward(cupy.zeros((3, 4)), target)
    with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
            "sigmoid_focal_loss_forward_impl: target[1] is not a class index in [0, 4]")):
        mmdispatch.synchronize()
    got = cupy.asnumpy(loss)
    assert np.isnan(got[1]).all() and np.isfinite(got[[0, 2]]).all()


def test_cuda_call_returns_while_earlier_work_is_still_running(cupy):
    """No synchronisation on the default path: a call queued behind a long
    kernel returns before that kernel has finished."""
    spin = cupy.RawKernel(r"""
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) {}
    }""", "spin")
    x, rois, _ = bad_roi_call(cupy)
    stream = cupy.cuda.get_current_stream()
    mmdispatch.ops.roi_align(x, rois, 2, 1.0, 2)          # warm: error word allocated
    stream.synchronize()
    spin((1,), (1,), (np.int64(2_000_000_000),))          # about a second
    out = mmdispatch.ops.roi_align(x, rois, 2, 1.0, 2)
    backward = mmdispatch.ops.roi_align_backward(out, rois, None, None, x.shape, 1.0, 2)
    assert not stream.done                                 # both returned; spin still runs
    stream.synchronize()
    assert backward.shape == x.shape
