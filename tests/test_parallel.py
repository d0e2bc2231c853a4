"""The CPU kernels' worker pool (src/core/parallel.c): the thread count,
results that do not depend on it, calls from several threads at once, and
a child forked after the pool has started."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest

import mmdispatch
from mmdispatch.ops import (bbox_overlaps, box_iou_rotated, deform_conv2d,
                            deform_conv2d_backward, nms, nms_rotated, ps_roi_align,
                            ps_roi_align_backward, ps_roi_pool, ps_roi_pool_backward, roi_align,
                            roi_pool, sigmoid_focal_loss_backward)

# big enough that every op shares its loop out (mmd_worth_threads)
RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 32, 40, 40))
XY = RNG.uniform(0, 30, (64, 2))
ROIS = np.concatenate([RNG.integers(0, 2, (64, 1)), XY, XY + RNG.uniform(1, 10, (64, 2))], 1)
BOXES = np.concatenate([XY, XY + 5], 1)
LOGITS = RNG.standard_normal((4096, 8))
# nms decides 1,024 boxes at a time, the first test of each block shared out
MANY_XY = RNG.uniform(0, 100, (3000, 2))
MANY_BOXES = np.concatenate([MANY_XY, MANY_XY + RNG.uniform(1, 8, (3000, 2))], 1)
ROTATED = np.concatenate([MANY_XY, RNG.uniform(1, 8, (3000, 2)), RNG.uniform(-3, 3, (3000, 1))], 1)
SCORES = RNG.random(3000)
# deform_conv2d on the tiles (AVX2 and up): forward blocks of 48 pixels,
# backward strips of 32 columns and blocks of pixels
OFFSET, MASK = RNG.standard_normal((2, 18, 40, 40)), RNG.random((2, 9, 40, 40))
WEIGHT, BIAS = RNG.standard_normal((40, 32, 3, 3)), RNG.standard_normal(40)
GRAD = RNG.standard_normal((2, 40, 40, 40))
# roi_pool's channel groups (rois reading the map many times over), in parts of
# the rois where threads outnumber groups
GROUP_X = RNG.standard_normal((1, 16, 30, 30))
GROUP_XY = RNG.uniform(0, 20, (200, 2))
GROUP_ROIS = np.concatenate([np.zeros((200, 1)), GROUP_XY,
                             GROUP_XY + RNG.uniform(5, 15, (200, 2))], 1)
# the R-FCN ops: 98 = 2 x 7 x 7 channels, the forward's rois in parts (of
# 64 rois or more: 4 on 3 and 8 threads)
PS_X = RNG.standard_normal((2, 98, 20, 24))
PS_XY = RNG.uniform(0, 16, (600, 2))
PS_ROIS = np.concatenate([RNG.integers(0, 2, (600, 1)), PS_XY,
                          PS_XY + RNG.uniform(2, 8, (600, 2))], 1)
PS_GRAD = RNG.standard_normal((600, 2, 7, 7))
# 12 output channels of 2 x 2 bins: runs of 6, each run's rois in parts (3
# on 3 threads, 4 on 8: the 4 share a factor with the runs, where an item
# order that mixed runs and parts up would miss some)
PS_WIDE_X = RNG.standard_normal((2, 48, 20, 24))
# one image, one run and 50 rois: one part, too few for the threads, so the
# forward takes ranges of bins
PS_ONE_ROIS = np.concatenate([np.zeros((50, 1)), PS_ROIS[:50, 1:]], 1)


def outputs():
    return [roi_align(X, ROIS, 7, 1.0, 2), roi_align(X, ROIS, 5, 0.5, 0, "max"),
            roi_pool(X, ROIS, 7), bbox_overlaps(BOXES, BOXES),
            sigmoid_focal_loss_backward(LOGITS, np.arange(4096) % 9),
            nms(MANY_BOXES, SCORES, 0.3), nms_rotated(ROTATED, SCORES, 0.3),
            box_iou_rotated(ROTATED[:300], ROTATED), roi_pool(GROUP_X, GROUP_ROIS, 7),
            ps_roi_pool(PS_X, PS_ROIS, 7), ps_roi_align(PS_X, PS_ROIS, 7, 1.0, 2),
            ps_roi_pool_backward(PS_GRAD, PS_ROIS, PS_X.shape),
            ps_roi_align_backward(PS_GRAD, PS_ROIS, PS_X.shape, 1.0, 2),
            ps_roi_pool(PS_WIDE_X, PS_ROIS, 2), ps_roi_align(PS_WIDE_X, PS_ROIS, 2, 1.0, 2),
            ps_roi_pool(PS_X[:1], PS_ONE_ROIS, 7), ps_roi_align(PS_X[:1], PS_ONE_ROIS, 7, 1.0, 2)] + (
                [deform_conv2d(X, OFFSET, WEIGHT, BIAS, 1, 1, 1, MASK),
                 *deform_conv2d_backward(GRAD, X, OFFSET, WEIGHT, 1, 1, 1, MASK)]
                if mmdispatch._core.cpu_tiles() != "baseline" else [])


def script(body):
    """Python code that imports this module's workload, then runs `body`."""
    here = os.path.dirname(os.path.abspath(__file__))
    return (f"import os, sys; sys.path.insert(0, {here!r})\n"
            "import numpy as np, test_parallel as t\n" + body)


def run(code, tmp_path, threads):
    """stdout of `code` in a fresh interpreter with OMP_NUM_THREADS=threads."""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path,
                          env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_thread_count_comes_from_omp_num_threads_and_shows_in_the_cpu_status(tmp_path):
    code = "import mmdispatch; print(mmdispatch.devices()[0]['status'])"
    assert run(code, tmp_path, 3).startswith("available; up to 3 threads")
    assert run(code, tmp_path, 1).startswith("available; up to 1 thread ")


@pytest.mark.parametrize("threads", [1, 3, 8])
def test_results_are_the_same_bits_whatever_the_thread_count(threads, tmp_path):
    """Every item is computed by one thread in a fixed order, so the thread
    count changes nothing (the roi_align and roi_pool backward too: each
    channel is one thread's)."""
    code = script(
            "from mmdispatch.ops import roi_align_backward, roi_pool_backward, roi_pool_forward\n"
            "out = t.outputs()\n"
            "pooled, argmax = roi_pool_forward(t.X, t.ROIS, 7)\n"
            "out.append(roi_pool_backward(np.ones_like(pooled), t.ROIS, argmax, t.X.shape))\n"
            "out.append(roi_align_backward(np.ones((64, 32, 7, 7)), t.ROIS, None, None, "
            "t.X.shape, 1.0, 2))\n"
            "np.savez(sys.argv[1] if len(sys.argv) > 1 else 'out.npz', *out)\n")
    run(code, tmp_path, threads)
    got = np.load(tmp_path / "out.npz")
    (tmp_path / "one").mkdir()
    run(code, tmp_path / "one", 1)
    expected = np.load(tmp_path / "one" / "out.npz")
    for name in expected.files:
        np.testing.assert_array_equal(got[name], expected[name])


def test_calls_from_several_threads_at_once_are_each_right():
    """One call at a time has the workers; the others run on their own
    thread, and every result is the same as alone."""
    expected = outputs()
    results, errors = {}, []

    def worker(i):
        try:
            results[i] = outputs()
        except Exception as exc:   # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for got in results.values():
        for a, b in zip(got, expected):
            np.testing.assert_array_equal(a, b)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_child_forked_after_parallel_calls_runs_them_too(tmp_path):
    """Only the forking thread survives a fork: the child starts its own
    workers instead of waiting for the parent's."""
    code = script(
            "before = t.outputs()\n"
            "pid = os.fork()\n"
            "if pid == 0:\n"
            "    after = t.outputs()\n"
            "    ok = all(np.array_equal(a, b) for a, b in zip(before, after))\n"
            "    os._exit(0 if ok else 3)\n"
            "_, status = os.waitpid(pid, 0)\n"
            "print(os.waitstatus_to_exitcode(status))\n")
    assert run(code, tmp_path, 2).strip() == "0"
