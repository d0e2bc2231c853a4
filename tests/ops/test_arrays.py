"""The ops' array plumbing (mmdispatch/ops/_arrays.py): what an op does with
another library's arrays must not depend on whether the caller happened to
import CuPy first."""
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mmdispatch
from mmdispatch.ops import batched_nms

FAKE_CUPY = '''
"""A stand-in CuPy: installed, but no GPU; records what the ops ask of it."""
import types
calls = []
class ndarray:
    pass
def from_dlpack(x):
    calls.append("from_dlpack")
    raise AssertionError("exported a foreign-device array")
def asarray(x):
    calls.append("asarray")
    raise RuntimeError("no GPU")
def _no_gpu(*args):
    calls.append("runtime")
    raise RuntimeError("cudaErrorNoDevice")
cuda = types.SimpleNamespace(get_current_stream=_no_gpu,
                             runtime=types.SimpleNamespace(getDeviceCount=_no_gpu))
'''

CALLS = '''
import numpy as np
import mmdispatch
from mmdispatch.ops import batched_nms, nms, roi_align

class StandIn:
    """An array on cuda:0, seen only through __dlpack_device__ (plus shape)."""
    def __init__(self, shape, dtype=np.float32):
        self.shape, self.ndim, self.dtype = shape, len(shape), np.dtype(dtype)
        self.exported = False
    def __dlpack_device__(self):
        return (2, 0)
    def __dlpack__(self, **kwargs):
        self.exported = True
        raise AssertionError("exported")

boxes = np.zeros((3, 4), np.float32)
scores = np.zeros(3, np.float32)
outcomes = []
for call in [lambda: nms(boxes, StandIn((3,)), 0.5),
             lambda: nms(StandIn((3, 4)), scores, 0.5),
             lambda: batched_nms(boxes, scores, StandIn((3,), np.int64), 0.5),
             lambda: roi_align(np.zeros((1, 1, 4, 4), np.float32), StandIn((1, 5)), 2),
             lambda: nms(StandIn((3, 4)), StandIn((3,)), 0.5)]:
    try:
        call()
        outcomes.append("no error")
    except Exception as exc:
        outcomes.append(f"{type(exc).__name__}: {exc}")
print(repr(outcomes))
'''


def outcomes(tmp_path, import_cupy_first):
    (tmp_path / "cupy.py").write_text(FAKE_CUPY)
    code = ("import cupy\n" if import_cupy_first else "") + textwrap.dedent(CALLS)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=tmp_path, env={"PYTHONPATH": str(tmp_path)}, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_foreign_cuda_arrays_get_the_same_errors_whether_or_not_cupy_was_imported(tmp_path):
    first = outcomes(tmp_path, import_cupy_first=True)
    assert first == outcomes(tmp_path, import_cupy_first=False)
    results = eval(first)
    # the dispatcher's device check, before anything is exported
    assert results[0] == ("DeviceMismatchError: nms_impl: at param 1 (scores), inconsistent "
                          "device: cuda:0 vs cpu")
    assert results[2] == ("DeviceMismatchError: nms_impl: at param 2 (idxs), inconsistent "
                          "device: cuda:0 vs cpu")
    assert results[3] == ("DeviceMismatchError: roi_align_forward_impl: at param 1 (rois), "
                          "inconsistent device: cuda:0 vs cpu")
    assert results[1] == ("DeviceMismatchError: nms_impl: at param 1 (scores), inconsistent "
                          "device: cpu vs cuda:0")
    # all on cuda:0: no CUDA kernel here (on a GPU, the export the stand-in refuses)
    assert results[4].startswith(("KernelNotFoundError: nms_impl: implementation for device "
                                  "cuda:0 not found", "TypeError: nms_impl: at param 0 (boxes)"))


def test_avg_mode_allocates_only_the_outputs_it_returns(monkeypatch):
    """roi_align (avg) allocates its output and nothing else, its backward
    only grad_input: the (0,) argmax pair that avg mode leaves unused is one
    shared array per dtype (the entry point's allocation of a (0,) output,
    which has no element to write)."""
    import numpy as np

    from mmdispatch.ops import _arrays, roi_align, roi_align_backward, roi_align_forward

    x = np.ones((1, 2, 8, 8))[:, :, ::2]   # strided: copied once
    rois = np.array([[0, 0, 0, 3, 3]], np.float64)
    first, second = roi_align_forward(x, rois, 2), roi_align_forward(x, rois, 2)
    assert first[0] is not second[0] and first[0].flags.owndata and first[0].flags.writeable
    assert first[1] is first[2] is second[1] and first[1].shape == (0,)
    assert first[1].dtype == np.float64
    np.testing.assert_array_equal(roi_align(x, rois, 2), first[0])
    _, argmax_y, argmax_x = roi_align_forward(x, rois, 2, pool_mode="max")
    assert argmax_y.shape == argmax_x.shape == (1, 2, 2, 2) and argmax_y.flags.writeable

    allocated = []
    real = _arrays.allocate

    def counting(op, name, *args, **kwargs):
        allocated.append(name)
        return real(op, name, *args, **kwargs)

    monkeypatch.setattr(_arrays, "allocate", counting)
    roi_align_backward(np.ones((1, 2, 2, 2)), rois, None, None, (1, 2, 4, 8))
    assert allocated == ["grad_input"]


def test_another_librarys_index_array_goes_on_to_the_dispatchers_checks():
    """A torch CUDA tensor's dtype is torch's, not numpy's (no .kind): an
    index argument such as batched_nms's idxs is handed on as it is, and the
    dispatcher's device (and the kernel's int64) checks name it."""
    from stand_ins import FakeDeviceArray

    class TorchLikeInt64:
        def __str__(self):
            return "torch.int64"

    idxs = FakeDeviceArray()
    idxs.shape, idxs.ndim, idxs.dtype = (3,), 1, TorchLikeInt64()
    with pytest.raises(mmdispatch.DeviceMismatchError, match=r"\(idxs\), inconsistent device"):
        batched_nms(np.zeros((3, 4), np.float32), np.zeros(3, np.float32), idxs, 0.5)
    assert not idxs.exported
    with pytest.raises(TypeError, match="^batched_nms: idxs must have an integer dtype, got "
                                        "float32"):
        batched_nms(np.zeros((3, 4), np.float32), np.zeros(3, np.float32),
                    np.zeros(3, np.float32), 0.5)


class _Index:
    """An int only through __index__."""
    def __index__(self):
        return 3


class _BadIter:
    """Neither an int nor iterable without failing."""
    def __iter__(self):
        raise RuntimeError("broken iterator")


@pytest.mark.parametrize("value, expected", [
    (4, (4, 4)), (np.int32(5), (5, 5)), (np.array(6), (6, 6)), (_Index(), (3, 3)),
    ((2, 3), (2, 3)), ([2, 3], (2, 3)), (np.array([2, 3]), (2, 3)), ((np.int64(2), 3), (2, 3)),
    ({1: 0, 4: 0}, (1, 4))])
def test_pair_takes_an_int_or_a_pair_of_ints(value, expected):
    from mmdispatch.ops._arrays import pair
    assert pair("op", "output_size", value) == expected
    assert all(type(v) is int for v in pair("op", "output_size", value))


@pytest.mark.parametrize("value", ["7", "ab", 2.0, (2.0, 3), (1, 2, 3), [4], None,
                                   np.array([1.5, 2]), _BadIter()])
def test_pair_refuses_what_is_not_an_int_or_a_pair_of_ints_naming_op_and_parameter(value):
    from mmdispatch.ops._arrays import pair
    with pytest.raises(TypeError, match=r"^op: stride must be an int or a pair of ints, got "):
        pair("op", "stride", value)


def test_pair_bounds_each_size_unless_the_bound_is_none():
    from mmdispatch.ops._arrays import pair
    with pytest.raises(ValueError, match=r"^op: padding must be >= 0, got \(1, -1\)$"):
        pair("op", "padding", (1, -1), low=0)
    with pytest.raises(ValueError, match=r"^op: output_size must be >= 1, got 0$"):
        pair("op", "output_size", 0)
    assert pair("op", "output_size", (0, -2), low=None) == (0, -2)   # the torch layer's call
