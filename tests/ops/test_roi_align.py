"""roi_align (MMCV semantics): published values, a slow independent
reference, finite differences, bad input, and CPU/CUDA agreement."""
import importlib
import math
import re

import numpy as np
import pytest

from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import roi_align, roi_align_backward, roi_align_forward
from properties import (TOL, OpProperties, assert_close, bad_rois, float_arrays, guarded,
                        roi_problem_sizes, rois_for, sentinel, small_map_and_rois,
                        torch_map_and_rois)
from references import mmcv_bilinear_terms

roi_align_module = importlib.import_module("mmdispatch.ops.roi_align")

MMCV_INPUT = np.array([[[[1, 2, 5, 6], [3, 4, 7, 8], [9, 10, 13, 14], [11, 12, 15, 16]]]],
                      dtype=np.float64)
MMCV_ROIS = np.array([[0, 0, 0, 3, 3]], dtype=np.float64)
CPU_BACKENDS = ["default", "reference"]


# --- slow reference, straight from the MMCV / Detectron2 definition -----------

def ref_bins(roi, out_h, out_w, scale, sampling_ratio, aligned):
    """Yields (ph, pw, [sample (y, x)]) for one roi."""
    offset = 0.5 if aligned else 0.0
    x1, y1, x2, y2 = (float(v) * scale - offset for v in roi[1:])
    roi_w, roi_h = x2 - x1, y2 - y1
    if not aligned:
        roi_w, roi_h = max(roi_w, 1.0), max(roi_h, 1.0)
    bin_h, bin_w = roi_h / out_h, roi_w / out_w
    grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_h / out_h)
    grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(roi_w / out_w)
    for ph in range(out_h):
        for pw in range(out_w):
            yield ph, pw, [(y1 + ph * bin_h + (iy + 0.5) * bin_h / grid_h,
                            x1 + pw * bin_w + (ix + 0.5) * bin_w / grid_w)
                           for iy in range(grid_h) for ix in range(grid_w)]


def ref_forward(x, rois, out_h, out_w, scale, sampling_ratio, mode, aligned):
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, out_h, out_w))
    arg_y = np.full(out.shape, -1.0)
    arg_x = np.full(out.shape, -1.0)
    for k, roi in enumerate(rois):
        plane = x[int(roi[0])].astype(np.float64)
        for ph, pw, samples in ref_bins(roi, out_h, out_w, scale, sampling_ratio, aligned):
            values = [[sum(wt * plane[ch, a, b] for a, b, wt in mmcv_bilinear_terms(h, w, sy, sx))
                       for sy, sx in samples] for ch in range(c)]
            for ch in range(c):
                if mode == "avg":
                    out[k, ch, ph, pw] = sum(values[ch]) / max(len(samples), 1)
                elif samples:
                    best = int(np.argmax(values[ch]))  # first maximum, like the kernels
                    out[k, ch, ph, pw] = values[ch][best]
                    arg_y[k, ch, ph, pw], arg_x[k, ch, ph, pw] = samples[best]
    return out, arg_y, arg_x


def ref_backward(grad_out, rois, arg_y, arg_x, shape, scale, sampling_ratio, mode, aligned):
    grad = np.zeros(shape)
    _, c, h, w = shape
    out_h, out_w = grad_out.shape[2:]
    for k, roi in enumerate(rois):
        b = int(roi[0])
        for ph, pw, samples in ref_bins(roi, out_h, out_w, scale, sampling_ratio, aligned):
            for ch in range(c):
                g = grad_out[k, ch, ph, pw]
                if mode == "avg":
                    for sy, sx in samples:
                        for a, bb, wt in mmcv_bilinear_terms(h, w, sy, sx):
                            grad[b, ch, a, bb] += g * wt / max(len(samples), 1)
                elif arg_y[k, ch, ph, pw] != -1:
                    for a, bb, wt in mmcv_bilinear_terms(h, w, arg_y[k, ch, ph, pw],
                                                        arg_x[k, ch, ph, pw]):
                        grad[b, ch, a, bb] += g * wt
    return grad


def random_rois(rng, count, batch, height, width, scale, outside=True):
    """Rois in image coordinates, some partly or fully outside the map, some
    degenerate (zero or tiny size)."""
    img_h, img_w = height / scale, width / scale
    margin = 0.5 if outside else 0.0
    x1 = rng.uniform(-margin * img_w, img_w * (1 + margin) * 0.9, count)
    y1 = rng.uniform(-margin * img_h, img_h * (1 + margin) * 0.9, count)
    x2 = x1 + rng.uniform(0, img_w * 0.8, count)
    y2 = y1 + rng.uniform(0, img_h * 0.8, count)
    rois = np.stack([rng.integers(0, batch, count), x1, y1, x2, y2], axis=1)
    rois[0, 3], rois[0, 4] = rois[0, 1], rois[0, 2]          # zero-size roi
    rois[1, 3], rois[1, 4] = rois[1, 1] + 0.3, rois[1, 2]     # thin roi
    return rois


CASES = [(mode, aligned, sampling_ratio, seed)
         for mode in ("avg", "max") for aligned in (True, False)
         for sampling_ratio in (0, 1, 2, 3) for seed in range(2)]


# --- published values ---------------------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_matches_mmcv_published_values(backend, dtype):
    with mmdispatch.use_backend("cpu", backend):
        out, _, _ = roi_align_forward(MMCV_INPUT.astype(dtype), MMCV_ROIS.astype(dtype), (2, 2),
                                      1.0, 2, "avg", True)
        grad = roi_align_backward(np.ones_like(out), MMCV_ROIS.astype(dtype), None, None,
                                  MMCV_INPUT.shape, 1.0, 2, "avg", True)
    assert out.dtype == dtype and grad.dtype == dtype
    np.testing.assert_allclose(out[0, 0], [[1.9375, 4.75], [7.5625, 10.375]], rtol=1e-6)
    np.testing.assert_allclose(grad[0, 0, 0], [0.47265625, 0.4296875, 0.4296875, 0.04296875],
                               rtol=1e-6)


# --- against the slow reference -----------------------------------------------

@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("mode, aligned, sampling_ratio, seed", CASES)
def test_forward_and_backward_match_slow_reference(backend, mode, aligned, sampling_ratio, seed):
    rng = np.random.default_rng(seed * 100 + sampling_ratio)
    x = rng.standard_normal((2, 3, 7, 9))
    scale = 0.5
    rois = random_rois(rng, 6, 2, 7, 9, scale)
    expected, exp_y, exp_x = ref_forward(x, rois, 3, 2, scale, sampling_ratio, mode, aligned)
    with mmdispatch.use_backend("cpu", backend):
        out, arg_y, arg_x = roi_align_forward(x, rois, (3, 2), scale, sampling_ratio, mode,
                                              aligned)
        grad_out = rng.standard_normal(out.shape)
        grad = roi_align_backward(grad_out, rois, arg_y, arg_x, x.shape, scale, sampling_ratio,
                                  mode, aligned)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    if mode == "max":
        np.testing.assert_allclose(arg_y, exp_y, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(arg_x, exp_x, rtol=1e-12, atol=1e-12)
    else:
        assert arg_y.shape == (0,) and arg_x.shape == (0,)
    expected_grad = ref_backward(grad_out, rois, exp_y, exp_x, x.shape, scale, sampling_ratio,
                                 mode, aligned)
    np.testing.assert_allclose(grad, expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("mode", ["avg", "max"])
def test_float32_matches_reference_computed_in_float64(mode, rng):
    x = rng.standard_normal((2, 4, 12, 10)).astype(np.float32)
    rois = random_rois(rng, 12, 2, 12, 10, 0.25).astype(np.float32)
    expected, _, _ = ref_forward(x.astype(np.float64), rois.astype(np.float64), 4, 4, 0.25, 0,
                                 mode, True)
    out = roi_align(x, rois, 4, 0.25, 0, mode, True)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode, sampling_ratio", [("avg", 2), ("max", 0), ("max", 2)])
def test_default_backend_equals_reference_backend_bitwise(mode, sampling_ratio, rng):
    x = rng.standard_normal((2, 16, 20, 24)).astype(np.float32)
    rois = random_rois(rng, 40, 2, 20, 24, 0.5).astype(np.float32)
    results = {}
    for backend in CPU_BACKENDS:
        with mmdispatch.use_backend("cpu", backend):
            out, ay, ax = roi_align_forward(x, rois, 5, 0.5, sampling_ratio, mode)
            grad = roi_align_backward(np.ones_like(out), rois, ay, ax, x.shape, 0.5,
                                      sampling_ratio, mode)
            results[backend] = (out, grad)
    np.testing.assert_array_equal(results["default"][0], results["reference"][0])
    np.testing.assert_allclose(results["default"][1], results["reference"][1], rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [1, 3, 16])
@pytest.mark.parametrize("sampling_ratio", [1, 2, 3])
def test_fixed_sampling_avg_is_bitwise_the_reference_on_and_off_the_map(dtype, channels,
                                                                        sampling_ratio, rng):
    """With a fixed sampling_ratio the default backend shares every roi's
    weights across channels (a table, when it is smaller than the output: 16
    channels here, not 1 or 3) and pools rois whose
    samples all lie on the map without per-sample tests, grid width 2
    unrolled: the same sums in the same order as the reference, forward and
    backward, with rois partly or wholly off the map and NaN/inf pixels."""
    x = rng.standard_normal((2, channels, 20, 24)).astype(dtype)
    x[0, 0, 2:5, 4:7], x[1, -1, 10, 23] = np.nan, np.inf
    corner = rng.uniform(-8, 30, (40, 2))
    rois = np.concatenate([rng.integers(0, 2, (40, 1)), corner,
                           corner + rng.uniform(1, 20, (40, 2))], axis=1).astype(dtype)
    rois[7] = [0, 2, 2, 20, 16]   # on the map (and on the NaNs), with an inf gradient
    grad_out = rng.standard_normal((40, channels, 5, 4)).astype(dtype)
    grad_out[7, 0, 2, 1] = np.inf
    results = {}
    for backend in CPU_BACKENDS:
        with mmdispatch.use_backend("cpu", backend):
            results[backend] = (
                roi_align(x, rois, (5, 4), 0.5, sampling_ratio),
                roi_align_backward(grad_out, rois, None, None, x.shape, 0.5, sampling_ratio))
    assert not np.isfinite(results["reference"][0]).all()
    assert not np.isfinite(results["reference"][1]).all()
    for default, reference in zip(results["default"], results["reference"]):
        np.testing.assert_array_equal(default, reference)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("channels", [1, 3, 4, 8, 9, 21])
@pytest.mark.parametrize("layout", ["many rois", "few rois", "adaptive, small bins",
                                    "adaptive, few rois", "images without rois"])
def test_avg_by_channel_groups_gives_the_reference_bits(dtype, channels, layout, rng):
    """The default avg forward and backward take channels 8 (float) or 4
    (double) at a time through an image's planes interleaved (the
    backward's read from grad_input, added into and written back), where
    its rois read them often enough ("many rois"; otherwise a plane at a
    time; "few rois" with a fixed sampling_ratio: the per-channel loop), the
    forward each image's rois in parts where groups and images are fewer
    than twice the threads (one image of one group here: parts on any
    machine): every lane the scalar code's sums in its order, so the
    reference's bits, partial groups, rois off the map, NaN and inf, and a
    grad_input that is not zeros included (odd plane sizes: the
    interleaving's last cells come one at a time)."""
    batch, height, width, count = {"many rois": (2, 12, 15, 300), "few rois": (2, 40, 50, 3),
                                   "images without rois": (5, 12, 15, 200),
                                   "adaptive, small bins": (1, 19, 23, 160),
                                   "adaptive, few rois": (2, 40, 50, 3)}[layout]
    x = rng.standard_normal((batch, channels, height, width)).astype(dtype)
    x[0, -1, 2:4, 3:6], x[-1, 0, 5, 7] = np.nan, -np.inf
    x[:, :, 0, 0] = np.inf   # where a sample off the map points (weight 0): tests must skip it
    corner = rng.uniform([-6, -6], [width + 2, height + 2], (count, 2))
    if layout.startswith("adaptive"):   # bins under 2 cells: grids of 1 or 2, no dense path
        side, sampling_ratio = rng.uniform(0.2, 4.5, (count, 2)), 0
    else:
        side, sampling_ratio = rng.uniform(0.5, min(height, width), (count, 2)), 2
    rois = np.concatenate([rng.integers(0, batch, (count, 1)), corner, corner + side],
                          axis=1).astype(dtype)
    if layout == "images without rois":   # slices only for images 0, 1 and 3
        rois[:, 0] = rng.choice([1, 3], count)
    rois[0] = [0, 2, 1, 6, 5]   # on the NaNs
    rois[1] = [0, -3, -2, 1, 1]   # partly off the map (small: no dense weights), an inf gradient
    grad_out = rng.standard_normal((count, channels, 4, 5)).astype(dtype)
    grad_out[0, -1, 2, 3] = grad_out[1, 0, 1, 1] = np.inf   # roi 0 on the map, roi 1 partly off
    start = rng.standard_normal(x.shape).astype(dtype)   # grad_input adds into what it holds
    results = {}
    for backend in CPU_BACKENDS:
        with mmdispatch.use_backend("cpu", backend):
            grad = start.copy()
            unused = np.empty(0, dtype)   # avg mode's argmax
            mmdispatch.roi_align_backward_impl(grad_out, rois, unused, unused, grad, 4, 5, 1.0,
                                               sampling_ratio, 1, True)
            results[backend] = (roi_align(x, rois, (4, 5), 1.0, sampling_ratio), grad)
    for default, reference in zip(results["default"], results["reference"]):
        assert np.isfinite(reference).any() and not np.isfinite(reference).all()
        np.testing.assert_array_equal(default.view(np.uint8), reference.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_dense_avg_through_interleaved_planes_gives_the_bits_of_a_plane_at_a_time(dtype, rng):
    """Adaptive sampling's dense weights run on a group's interleaved planes
    when an image's rois read them often enough (30 rois here) and a plane
    at a time when they do not (each roi alone: it reads fewer cells than
    the map has); both ways take the same sums in the same order,
    forward and backward (each roi alone adding into what the rois before
    it left), a group whose gradients hold inf taking the samples."""
    x = rng.standard_normal((2, 11, 60, 80)).astype(dtype)
    corner = rng.uniform([-10, -10], [150, 110], (30, 2))
    rois = np.concatenate([rng.integers(0, 2, (30, 1)), corner,
                           corner + rng.uniform(20, 60, (30, 2))], axis=1).astype(dtype)
    grad_out = rng.standard_normal((30, 11, 6, 5)).astype(dtype)
    grad_out[4, 9, 1, 1] = np.inf
    unused = np.empty(0, dtype)
    together = roi_align(x, rois, (6, 5), 0.5, 0)
    grad_together = np.zeros_like(x)
    mmdispatch.roi_align_backward_impl(grad_out, rois, unused, unused, grad_together, 6, 5, 0.5,
                                       0, 1, True)
    alone = np.concatenate([roi_align(x, rois[k:k + 1], (6, 5), 0.5, 0) for k in range(30)])
    grad_alone = np.zeros_like(x)
    for k in range(30):
        mmdispatch.roi_align_backward_impl(grad_out[k:k + 1], rois[k:k + 1], unused, unused,
                                           grad_alone, 6, 5, 0.5, 0, 1, True)
    np.testing.assert_array_equal(together.view(np.uint8), alone.view(np.uint8))
    np.testing.assert_array_equal(grad_together.view(np.uint8), grad_alone.view(np.uint8))
    assert np.isinf(grad_together).any()


@pytest.mark.parametrize("dtype, rtol", [(np.float32, 2e-5), (np.float64, 1e-12)])
def test_adaptive_avg_pooling_through_dense_weights_matches_the_reference(dtype, rtol, rng):
    """With sampling_ratio=0 the default backend folds each bin's samples into
    per-pixel weights (two passes instead of four reads per sample): the same
    sums in another order, so equal to rounding."""
    x = rng.standard_normal((2, 8, 40, 48)).astype(dtype)
    rois = random_rois(rng, 30, 2, 40, 48, 0.5).astype(dtype)
    rois[:3, 1:] = [[0, 0, 95, 79], [-30, -20, 130, 110], [10, 10, 12, 60]]  # big, outside
    grad_out = rng.standard_normal((30, 8, 6, 5)).astype(dtype)
    results = {}
    for backend in CPU_BACKENDS:
        with mmdispatch.use_backend("cpu", backend):
            out = roi_align(x, rois, (6, 5), 0.5, 0)
            grad = roi_align_backward(grad_out, rois, None, None, x.shape, 0.5, 0)
            results[backend] = (out, grad)
    np.testing.assert_allclose(results["default"][0], results["reference"][0], rtol=rtol,
                               atol=rtol)
    np.testing.assert_allclose(results["default"][1], results["reference"][1], rtol=rtol,
                               atol=rtol)


def test_infinities_give_the_sample_by_sample_result_with_adaptive_sampling(rng):
    """0 * inf = NaN where a sample reads an inf pixel with weight 0: the dense
    path would fold that away, so planes and gradients with inf take the
    sample path, and NaN and inf land where the reference puts them."""
    x = rng.standard_normal((3, 3, 16, 16))   # image 0 finite
    x[1, 1, 5, 7] = np.inf
    x[1, 2, 9, 3] = x[2, 2, 5, 7] = -np.inf   # image 2: only the group's last lane
    # start 0.5, integer bins: samples fall on pixel centres, where the upper
    # tap has weight exactly 0; the rois on images 1, 2, then 0
    rois = np.array([[0, 0.5, 0.5, 9.5, 9.5], [0, 2.5, 3, 11, 12.5], [0, 4, 4, 9, 9]])
    rois = np.concatenate([rois + [image, 0, 0, 0, 0] for image in (1, 2, 0)])
    grad_out = np.ones((9, 3, 3, 3))
    grad_out[1, 0, 1, 1] = grad_out[0, 2, 1, 1] = np.inf   # lanes 0 and 2 of a group
    results = {}
    for backend in CPU_BACKENDS:
        with mmdispatch.use_backend("cpu", backend):
            out = roi_align(x, rois, 3, 1.0, 0, aligned=False)
            grad = roi_align_backward(grad_out, rois, None, None, x.shape, 1.0, 0,
                                      aligned=False)
            results[backend] = (out, grad)
    assert np.isnan(results["reference"][0]).any() and np.isinf(results["reference"][0]).any()
    assert np.isnan(results["reference"][0][3:6]).any()   # image 2's rois, through lane 2's inf
    for default, reference in zip(results["default"], results["reference"]):
        np.testing.assert_array_equal(np.isnan(default), np.isnan(reference))
        np.testing.assert_allclose(default, reference, rtol=1e-12, atol=1e-12)  # inf: equal


def test_backward_is_deterministic(rng):
    x = rng.standard_normal((2, 8, 16, 16)).astype(np.float32)
    rois = random_rois(rng, 64, 2, 16, 16, 1.0).astype(np.float32)
    grad_out = rng.standard_normal((64, 8, 7, 7)).astype(np.float32)
    first = roi_align_backward(grad_out, rois, None, None, x.shape, 1.0, 2)
    for _ in range(3):
        np.testing.assert_array_equal(roi_align_backward(grad_out, rois, None, None, x.shape,
                                                         1.0, 2), first)


# --- finite differences -------------------------------------------------------

@pytest.mark.parametrize("mode, aligned", [("avg", True), ("avg", False), ("max", True)])
def test_backward_matches_finite_differences(mode, aligned, rng, numeric_gradient):
    x = rng.standard_normal((1, 2, 6, 7))
    # inside the map, so every max sample is an interpolated (not clipped) value
    rois = np.array([[0, 0.7, 0.4, 5.1, 4.6], [0, 2.2, 1.3, 4.9, 5.2], [0, 1.0, 1.0, 3.0, 2.5]])
    grad_out = rng.standard_normal((3, 2, 2, 3))

    def loss(inp):
        return float(np.sum(roi_align(inp, rois, (2, 3), 1.0, 2, mode, aligned) * grad_out))

    _, ay, ax = roi_align_forward(x, rois, (2, 3), 1.0, 2, mode, aligned)
    analytic = roi_align_backward(grad_out, rois, ay, ax, x.shape, 1.0, 2, mode, aligned)
    numeric = numeric_gradient(loss, x)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7)


# --- edge cases ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_roi_align_fast_path_equals_the_general_path(dtype, rng):
    """roi_align skips the conversions for contiguous float numpy arrays in avg
    mode; the result must be what roi_align_forward computes, for int and
    tuple sizes, and the same as for a non-contiguous copy (general path)."""
    x = rng.standard_normal((2, 3, 9, 11)).astype(dtype)
    rois = np.array([[0, 1, 1, 6, 7], [1, 0, 2, 10, 8], [0, 3, 3, 3, 3]], dtype=dtype)
    for size in (3, (2, 4)):
        expected = roi_align_forward(x, rois, size, 0.5, 2, "avg", True)[0]
        fast = roi_align(x, rois, size, 0.5, 2)
        general = roi_align(np.asfortranarray(x), rois, size, 0.5, 2)
        np.testing.assert_array_equal(fast, expected)
        np.testing.assert_array_equal(general, expected)
        assert fast.flags.c_contiguous and fast.flags.writeable and fast.base is None
        # "avg" built at run time is not the interned constant: same answer
        built = roi_align(x, rois, size, 0.5, 2, "".join(["a", "vg"]))
        np.testing.assert_array_equal(built, expected)
    with pytest.raises(ValueError, match="roi_align_forward_impl"):
        roi_align(x, rois[:, :4], 3)


def test_empty_rois_give_empty_outputs():
    x = np.ones((1, 3, 4, 4), dtype=np.float32)
    out, ay, ax = roi_align_forward(x, np.zeros((0, 5), dtype=np.float32), (2, 2), 1.0, 0, "max")
    assert out.shape == (0, 3, 2, 2) and ay.shape == (0, 3, 2, 2)
    grad = roi_align_backward(out, np.zeros((0, 5), dtype=np.float32), ay, ax, x.shape)
    assert grad.shape == x.shape and not grad.any()


def test_empty_feature_map_pools_zeros():
    x = np.ones((1, 2, 0, 0))
    out = roi_align(x, np.array([[0, 0, 0, 3, 3.0]]), 2, 1.0, 2)
    assert out.shape == (1, 2, 2, 2) and not out.any()


def test_zero_size_aligned_roi_with_adaptive_sampling_pools_nothing():
    x = np.ones((1, 1, 4, 4))
    out, ay, ax = roi_align_forward(x, np.array([[0, 2, 2, 2, 2.0]]), 2, 1.0, 0, "max", True)
    assert not out.any() and np.all(ay == -1) and np.all(ax == -1)


def test_nan_in_the_feature_map_propagates_without_crashing():
    x = np.ones((1, 1, 4, 4))
    x[0, 0, 1, 1] = np.nan
    rois = np.array([[0, 0, 0, 3, 3.0]])
    assert np.isnan(roi_align(x, rois, 1, 1.0, 2, "avg")).all()
    x[0, 0] = np.nan
    out, ay, _ = roi_align_forward(x, rois, 1, 1.0, 2, "max")
    assert np.isnan(out).all() and np.all(ay == -1)


def test_strided_and_dlpack_inputs_through_the_op_layer(rng, dlpack_only):
    x = rng.standard_normal((2, 3, 8, 16))
    rois = random_rois(rng, 5, 2, 8, 8, 1.0)
    expected = roi_align(np.ascontiguousarray(x[..., ::2]), rois, 3)
    np.testing.assert_array_equal(roi_align(x[..., ::2], rois, 3), expected)
    wrapped = roi_align(dlpack_only(np.ascontiguousarray(x[..., ::2])), dlpack_only(rois), 3)
    np.testing.assert_array_equal(np.asarray(wrapped), expected)


# --- bad input ----------------------------------------------------------------

def good_call():
    x = np.zeros((2, 3, 5, 5))
    rois = np.array([[0, 0, 0, 2, 2], [1, 1, 1, 4, 4.0]])
    return x, rois


@pytest.mark.parametrize("bad_roi, message", [
    ([0, np.nan, 0, 2, 2], "rois[1] contains NaN or inf"),
    ([0, 0, np.inf, 2, 2], "rois[1] contains NaN or inf"),
    ([2, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in [0, 2)"),
    ([-1, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in [0, 2)"),
    ([0.5, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in [0, 2)"),
    ([0, 3, 0, 2, 2], "rois[1] has negative width or height"),
    ([0, 0, 0, 1e12, 2], "rois[1] needs more than 32768 samples per bin axis"),
])
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_bad_rois_raise_and_write_nothing(bad_roi, message, backend):
    x, rois = good_call()
    rois[1] = bad_roi
    output = np.full((2, 3, 2, 2), 7.0)
    empty = np.empty(0)
    with mmdispatch.use_backend("cpu", backend):
        with pytest.raises(ValueError, match=re.escape(message)):
            mmdispatch.roi_align_forward_impl(x, rois, output, empty, empty.copy(), 2, 2, 1.0,
                                              0, 1, True)
        grad_input = np.full(x.shape, 7.0)
        with pytest.raises(ValueError, match=re.escape(message)):
            mmdispatch.roi_align_backward_impl(np.ones((2, 3, 2, 2)), rois, empty, empty.copy(),
                                               grad_input, 2, 2, 1.0, 0, 1, True)
    assert np.all(output == 7.0) and np.all(grad_input == 7.0)


@pytest.mark.parametrize("call, error, message", [
    (lambda x, r: roi_align(x[0], r, 2), ValueError,
     "roi_align_forward: input must be 4-D (N, C, H, W), got shape (3, 5, 5)"),
    (lambda x, r: roi_align(x, r[:, :4], 2), ValueError,
     "roi_align_forward_impl: rois must have shape (*, 5), got (2, 4)"),
    (lambda x, r: roi_align(x, r[0], 2), ValueError,
     "roi_align_forward: rois must be 2-D (K, 5), got shape (5,)"),
    (lambda x, r: roi_align(x.astype(np.float32), r, 2), TypeError,
     "roi_align_forward_impl: rois has dtype float64 but input has dtype float32"),
    (lambda x, r: roi_align(x.astype(np.float16), r.astype(np.float16), 2), TypeError,
     "roi_align_forward_impl: input has dtype float16 on this device; supported: float32, "
     "float64"),
    (lambda x, r: roi_align(x.astype(np.int64), r.astype(np.int64), 2), TypeError,
     "input has dtype int64 on this device"),
    (lambda x, r: roi_align(x.tolist(), r, 2), TypeError,
     "roi_align_forward: input must be an array"),
    (lambda x, r: roi_align(x, r, 0), ValueError, "roi_align_forward: output_size must be >= 1"),
    (lambda x, r: roi_align(x, r, "7"), TypeError, "output_size must be an int or a pair"),
    (lambda x, r: roi_align(x, r, 2, pool_mode="sum"), ValueError,
     "pool_mode must be one of 'avg', 'max', got 'sum'"),
    (lambda x, r: roi_align(x, r, 2, spatial_scale=float("nan")), ValueError,
     "spatial_scale must be finite and > 0, got nan"),
    (lambda x, r: roi_align(x, r, 2, spatial_scale=0), ValueError,
     "spatial_scale must be finite and > 0"),
    (lambda x, r: roi_align(x, r, 2, sampling_ratio=10**6), ValueError,
     "sampling_ratio must be <= 32768"),
    (lambda x, r: roi_align_backward(np.ones((2, 3, 2, 2)), r, None, None, (2, 3, 5)),
     ValueError, "input_shape must be 4 non-negative ints"),
    (lambda x, r: roi_align_backward(np.ones((2, 3, 2, 2)), r, None, None, x.shape,
                                     pool_mode="max"), ValueError,
     "roi_align_backward_impl: argmax_y must have shape (2, 3, 2, 2), got (0,)"),
    (lambda x, r: roi_align_backward(np.ones((3, 3, 2, 2)), r, None, None, x.shape), ValueError,
     "roi_align_backward_impl: grad_output must have shape (2, 3, 2, 2), got (3, 3, 2, 2)"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    x, rois = good_call()
    with pytest.raises(error, match=re.escape(message)):
        call(x, rois)


def test_output_too_small_is_rejected_by_the_entry_point():
    x, rois = good_call()
    out = np.zeros((2, 3, 1, 2))
    empty = np.empty(0)
    with pytest.raises(ValueError, match=re.escape(
            "roi_align_forward_impl: output must have shape (2, 3, 2, 2), got (2, 3, 1, 2)")):
        mmdispatch.roi_align_forward_impl(x, rois, out, empty, empty, 2, 2, 1.0, 0, 1, True)
    with pytest.raises(ValueError, match="aligned_height and aligned_width must be >= 1"):
        mmdispatch.roi_align_forward_impl(x, rois, out, empty, empty, 0, 2, 1.0, 0, 1, True)
    with pytest.raises(ValueError, match=re.escape("pool_mode must be 0 (max) or 1 (avg), got 5")):
        mmdispatch.roi_align_forward_impl(x, rois, out, empty, empty, 1, 2, 1.0, 0, 5, True)


# --- CUDA (runs only where a GPU, CuPy and the CUDA kernels are present) ------

@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-10), (np.float32, 1e-4)])
def test_cuda_matches_cpu(cupy, mode, aligned, dtype, tol, rng):
    x = rng.standard_normal((2, 8, 20, 24)).astype(dtype)
    rois = random_rois(rng, 32, 2, 20, 24, 0.5).astype(dtype)
    out, ay, ax = roi_align_forward(x, rois, (4, 3), 0.5, 0, mode, aligned)
    out_gpu, ay_gpu, ax_gpu = roi_align_forward(cupy.asarray(x), cupy.asarray(rois), (4, 3), 0.5,
                                                0, mode, aligned)
    assert isinstance(out_gpu, cupy.ndarray) and out_gpu.dtype == dtype
    np.testing.assert_allclose(cupy.asnumpy(out_gpu), out, rtol=tol, atol=tol)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = roi_align_backward(grad_out, rois, ay, ax, x.shape, 0.5, 0, mode, aligned)
    grad_gpu = roi_align_backward(cupy.asarray(grad_out), cupy.asarray(rois), ay_gpu, ax_gpu,
                                  x.shape, 0.5, 0, mode, aligned)
    np.testing.assert_allclose(cupy.asnumpy(grad_gpu), grad, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("sampling_ratio", [0, 24])
def test_cuda_matches_cpu_over_a_partial_channel_group_and_bins_of_many_cells(
        cupy, mode, sampling_ratio, rng):
    """11 channels (the avg kernels' groups of 8, the second partial) and
    2x2 bins of 30 to 45 cells a side (the avg kernels' walk over many
    merged rows and columns, as the emulated tests check on the CPU)."""
    x = rng.standard_normal((2, 11, 80, 90))
    rois = np.array([[0, 0, 0, 89, 79], [1, 10, 5, 80, 70], [1, 3.5, 2.25, 64.75, 71.5],
                     [0, 20, 30, 21, 31]])
    out, ay, ax = roi_align_forward(x, rois, 2, 1.0, sampling_ratio, mode, True)
    out_gpu, ay_gpu, ax_gpu = roi_align_forward(cupy.asarray(x), cupy.asarray(rois), 2, 1.0,
                                                sampling_ratio, mode, True)
    np.testing.assert_allclose(cupy.asnumpy(out_gpu), out, rtol=1e-10, atol=1e-10)
    grad_out = rng.standard_normal(out.shape)
    grad = roi_align_backward(grad_out, rois, ay, ax, x.shape, 1.0, sampling_ratio, mode, True)
    grad_gpu = roi_align_backward(cupy.asarray(grad_out), cupy.asarray(rois), ay_gpu, ax_gpu,
                                  x.shape, 1.0, sampling_ratio, mode, True)
    np.testing.assert_allclose(cupy.asnumpy(grad_gpu), grad, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("dtype, tol", [(np.float64, 1e-10), (np.float32, 1e-4),
                                        (np.float16, 2e-2)])
@pytest.mark.parametrize("sampling_ratio", [0, 2])
def test_cuda_transposed_avg_kernels_match_cpu_on_many_rois_and_channels(
        cupy, sampling_ratio, dtype, tol, rng):
    """300 rois over a 40-channel map whose bins read its cells many times
    over: the avg forward and default backward take the transposed kernels
    on a GPU (chunks of 32 channels, the second partial; 256 rois or more),
    which the smaller cases above do not reach. float16 against the CPU's
    float32 on the same values."""
    x = rng.standard_normal((2, 40, 30, 36)).astype(dtype)
    rois = random_rois(rng, 300, 2, 30, 36, 0.5).astype(dtype)
    compute = np.float32 if dtype == np.float16 else dtype
    out, ay, ax = roi_align_forward(x.astype(compute), rois.astype(compute), 7, 0.5,
                                    sampling_ratio, "avg", True)
    out_gpu, ay_gpu, ax_gpu = roi_align_forward(cupy.asarray(x), cupy.asarray(rois), 7, 0.5,
                                                sampling_ratio, "avg", True)
    np.testing.assert_allclose(cupy.asnumpy(out_gpu).astype(compute), out, rtol=tol, atol=tol)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = roi_align_backward(grad_out.astype(compute), rois.astype(compute), ay, ax, x.shape,
                              0.5, sampling_ratio, "avg", True)
    grad_gpu = roi_align_backward(cupy.asarray(grad_out), cupy.asarray(rois), ay_gpu, ax_gpu,
                                  x.shape, 0.5, sampling_ratio, "avg", True)
    np.testing.assert_allclose(cupy.asnumpy(grad_gpu).astype(compute), grad, rtol=tol * 10,
                               atol=tol * 10 * max(1.0, float(np.abs(grad).max())))


def test_cuda_float16_computes_in_float32(cupy, rng):
    x = rng.standard_normal((1, 4, 16, 16)).astype(np.float16)
    rois = random_rois(rng, 8, 1, 16, 16, 1.0).astype(np.float16)
    expected = roi_align(x.astype(np.float32), rois.astype(np.float32), 3, 1.0, 2)
    out = roi_align(cupy.asarray(x), cupy.asarray(rois), 3, 1.0, 2)
    assert out.dtype == np.float16
    np.testing.assert_allclose(cupy.asnumpy(out).astype(np.float32), expected, rtol=2e-2,
                               atol=2e-2)


def test_cuda_bfloat16_computes_in_float32(torch_cuda, rng):
    """bfloat16 torch tensors (DLPack bfloat code) through the entry points,
    forward and backward: float32 math on the bfloat16 values."""
    torch = torch_cuda
    x = torch.from_numpy(rng.standard_normal((1, 4, 16, 16)).astype(np.float32)).bfloat16()
    rois = torch.from_numpy(random_rois(rng, 8, 1, 16, 16, 1.0).astype(np.float32)).bfloat16()
    x32, rois32 = x.float().numpy(), rois.float().numpy()
    expected = roi_align(x32, rois32, 3, 1.0, 2)
    gx, grois = x.cuda(), rois.cuda()
    out = torch.empty((8, 4, 3, 3), dtype=torch.bfloat16, device="cuda")
    empty = torch.empty(0, dtype=torch.bfloat16, device="cuda")
    mmdispatch.roi_align_forward_impl(gx, grois, out, empty, empty, 3, 3, 1.0, 2, 1, True)
    np.testing.assert_allclose(out.float().cpu().numpy(), expected, rtol=2e-2, atol=2e-2)
    grad_out = torch.ones_like(out)
    grad = torch.zeros_like(gx)
    mmdispatch.roi_align_backward_impl(grad_out, grois, empty, empty, grad, 3, 3, 1.0, 2, 1,
                                       True)
    expected_grad = roi_align_backward(np.ones((8, 4, 3, 3), np.float32), rois32, None, None,
                                       x32.shape, 1.0, 2)
    np.testing.assert_allclose(grad.float().cpu().numpy(), expected_grad, rtol=3e-2, atol=3e-2)


def test_cuda_published_values_and_nonfinite_rois(cupy):
    out = roi_align(cupy.asarray(MMCV_INPUT), cupy.asarray(MMCV_ROIS), 2, 1.0, 2)
    np.testing.assert_allclose(cupy.asnumpy(out)[0, 0], [[1.9375, 4.75], [7.5625, 10.375]])
    bad = MMCV_ROIS.copy()
    bad[0, 2] = np.nan
    output = cupy.full((1, 1, 2, 2), 7.0)
    empty = cupy.empty(0)
    with mmdispatch.strict():   # raised by the call itself, nothing written
        with pytest.raises(ValueError, match=re.escape("rois[0] contains NaN or inf")):
            mmdispatch.roi_align_forward_impl(cupy.asarray(MMCV_INPUT), cupy.asarray(bad),
                                              output, empty, empty.copy(), 2, 2, 1.0, 2, 1, True)
    assert bool((output == 7.0).all())
    # by default: the bad roi's bins are NaN, and the error is deferred
    mmdispatch.roi_align_forward_impl(cupy.asarray(MMCV_INPUT), cupy.asarray(bad), output, empty,
                                      empty.copy(), 2, 2, 1.0, 2, 1, True)
    with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
            "roi_align_forward_impl: rois[0] contains NaN or inf")):
        mmdispatch.synchronize()
    assert bool(cupy.isnan(output).all())


def test_cuda_and_cpu_arrays_cannot_be_mixed(cupy):
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "roi_align_forward_impl: at param 1 (rois), inconsistent device: cpu vs cuda:0")):
        roi_align(cupy.asarray(MMCV_INPUT), MMCV_ROIS, 2)


def test_cuda_runs_on_the_current_cupy_stream(cupy):
    x = cupy.asarray(np.random.default_rng(0).standard_normal((2, 4, 32, 32)))
    rois = cupy.asarray(random_rois(np.random.default_rng(1), 16, 2, 32, 32, 1.0))
    expected = cupy.asnumpy(roi_align(x, rois, 7))
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        out = roi_align(x, rois, 7)
    stream.synchronize()
    np.testing.assert_allclose(cupy.asnumpy(out), expected)


# --- CUDA deterministic backend --------------------------------------------------------

def crowded_rois(rng, count, batch, height, width):
    """Many rois over the same few places, so that atomics add into the same
    elements in whatever order the threads come."""
    base = random_rois(rng, 4, batch, height, width, 1.0, outside=False)
    rois = base[rng.integers(0, 4, count)].copy()
    shift = rng.uniform(-0.5, 0.5, (count, 2))
    rois[:, 1:3] += shift   # corners move together and sizes only grow: x2 >= x1, y2 >= y1
    rois[:, 3:5] += shift + rng.uniform(0, 0.5, (count, 2))
    return rois


@pytest.mark.parametrize("mode", ["avg", "max"])
@pytest.mark.parametrize("sampling_ratio", [2, 0])
@pytest.mark.parametrize("aligned", [True, False])
@pytest.mark.parametrize("dtype, tol", [(np.float32, 1e-4), (np.float64, 1e-10)])
@pytest.mark.parametrize("channels", [6, 40])   # avg: the per-plane kernel, then the tiled one
def test_cuda_deterministic_backward_matches_and_repeats_bit_for_bit(cupy, mode, sampling_ratio,
                                                                     aligned, dtype, tol,
                                                                     channels, rng):
    x = rng.standard_normal((2, channels, 24, 20)).astype(dtype)
    rois = np.concatenate([random_rois(rng, 40, 2, 24, 20, 0.5),
                           crowded_rois(rng, 200, 2, 48, 40)]).astype(dtype)
    out, ay, ax = roi_align_forward(x, rois, (3, 4), 0.5, sampling_ratio, mode, aligned)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    expected = roi_align_backward(grad_out, rois, ay, ax, x.shape, 0.5, sampling_ratio, mode,
                                  aligned)
    g_out, g_rois = cupy.asarray(grad_out), cupy.asarray(rois)
    g_ay, g_ax = cupy.asarray(ay), cupy.asarray(ax)
    runs = []
    with mmdispatch.use_backend("cuda", "deterministic"):
        for stream in (cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True),
                       cupy.cuda.Stream.null):
            with stream:
                runs.append(cupy.asnumpy(roi_align_backward(
                    g_out, g_rois, g_ay if mode == "max" else None,
                    g_ax if mode == "max" else None, x.shape, 0.5, sampling_ratio, mode,
                    aligned)))
            stream.synchronize()
    for run in runs[1:]:
        np.testing.assert_array_equal(run, runs[0])   # bit for bit, whatever the stream
    np.testing.assert_allclose(runs[0], expected, rtol=tol * 10, atol=tol * 10)


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_cuda_deterministic_tiled_backward_gives_the_per_plane_kernels_bits(cupy, dtype, rng):
    """The deterministic avg backward takes tiles of 32 channels from 16
    channels on, a block per plane's band below: each channel of a 40
    channel call (crowded rois across tile edges, an inf and a NaN bin
    gradient) gets the bits of the same call on 15 channels or fewer."""
    x_shape = (2, 40, 30, 70)
    rois = np.concatenate([random_rois(rng, 60, 2, 30, 70, 0.5),
                           crowded_rois(rng, 300, 2, 60, 140)]).astype(dtype)
    grad_out = rng.standard_normal((len(rois), 40, 7, 7)).astype(dtype)
    grad_out[5, 3, 2, 2], grad_out[300, 33, 0, 6] = np.inf, np.nan
    g_rois = cupy.asarray(rois)

    def backward(grad, channels):
        with mmdispatch.use_backend("cuda", "deterministic"):
            return cupy.asnumpy(roi_align_backward(cupy.asarray(grad), g_rois, None, None,
                                                   (2, channels, 30, 70), 0.5, 2))

    tiled = backward(grad_out, 40)
    assert np.isnan(tiled).any() and np.isfinite(tiled).any()
    for c in (0, 15, 30):
        per_plane = backward(np.ascontiguousarray(grad_out[:, c:c + 15]),
                             min(15, 40 - c))
        np.testing.assert_array_equal(tiled[:, c:c + 15].view(np.uint8),
                                      per_plane.view(np.uint8))


def test_cuda_deterministic_backward_handles_nonfinite_gradients_like_the_default(cupy, rng):
    x = rng.standard_normal((1, 2, 12, 12))
    rois = random_rois(rng, 20, 1, 12, 12, 1.0, outside=False)
    grad_out = rng.standard_normal((20, 2, 2, 2))
    grad_out[3, 1, 0, 1] = np.inf
    grad_out[7, 0, 1, 1] = np.nan
    expected = roi_align_backward(grad_out, rois, None, None, x.shape, 1.0, 2)
    with mmdispatch.use_backend("cuda", "deterministic"):
        got = cupy.asnumpy(roi_align_backward(cupy.asarray(grad_out), cupy.asarray(rois), None,
                                              None, x.shape, 1.0, 2))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(expected))
    finite = np.isfinite(expected)
    np.testing.assert_allclose(got[finite], expected[finite], rtol=1e-10, atol=1e-10)
    np.testing.assert_array_equal(got[~finite], expected[~finite])


def test_cuda_every_op_runs_under_the_deterministic_backend(cupy, rng):
    x = cupy.asarray(rng.standard_normal((1, 2, 8, 8)).astype(np.float32))
    rois = cupy.asarray(random_rois(rng, 5, 1, 8, 8, 1.0).astype(np.float32))
    boxes = cupy.asarray(np.array([[0, 0, 2, 2], [1, 1, 3, 3]], np.float32))
    with mmdispatch.use_backend("cuda", "deterministic"):
        out = roi_align(x, rois, 2)
        roi_align_backward(out, rois, None, None, x.shape)
        pooled, argmax = mmdispatch.ops.roi_pool_forward(x, rois, 2)
        mmdispatch.ops.roi_pool_backward(pooled, rois, argmax, x.shape)
        mmdispatch.ops.nms(boxes, boxes[:, 0], 0.5)
        mmdispatch.ops.bbox_overlaps(boxes, boxes)
        target = cupy.asarray(np.array([0, 1]))
        mmdispatch.ops.sigmoid_focal_loss(cupy.zeros((2, 3), np.float32), target)
        mmdispatch.ops.sigmoid_focal_loss_backward(cupy.zeros((2, 3), np.float32), target)


def test_cuda_deterministic_backward_reports_bad_rois_as_deferred_errors(cupy):
    x = np.zeros((2, 1, 4, 4), np.float32)
    rois = np.array([[0, 0, 0, 2, 2], [3, 0, 0, 2, 2]], np.float32)
    with mmdispatch.use_backend("cuda", "deterministic"):
        grad = roi_align_backward(cupy.ones((2, 1, 2, 2), np.float32), cupy.asarray(rois),
                                  None, None, x.shape)
    with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
            "roi_align_backward_impl: rois[1, 0] (batch index) must be an integer in [0, 2)")):
        mmdispatch.synchronize()
    assert float(grad.sum()) == pytest.approx(4.0)   # the good roi's gradient, all of it


# --- properties (tests/support/properties.py) ----------------------------------------------
# The references above compute in float64; these replay the kernels'
# arithmetic in their own dtype (mmd_roi_align_geometry, mmd_interp), so that
# edge cases (samples on a cell border, rois on the map's edge) agree exactly.

def roi_align_geometry(roi, t, batch, out_h, out_w, scale, sampling_ratio, aligned):
    """mmd_roi_align_geometry in dtype t: None for a rejected roi, else
    (batch, start_h, start_w, bin_h, bin_w, grid_h, grid_w)."""
    with np.errstate(all="ignore"):
        r = [t(v) for v in roi]
        if not all(np.isfinite(v) for v in r):
            return None
        if not (r[0] >= 0 and r[0] < t(batch) and r[0] == np.floor(r[0])):
            return None
        s, off = t(scale), t(0.5 if aligned else 0.0)
        start_w, start_h = r[1] * s - off, r[2] * s - off
        roi_w, roi_h = r[3] * s - off - start_w, r[4] * s - off - start_h
        if aligned and (roi_w < 0 or roi_h < 0):
            return None
        if not aligned:
            roi_w, roi_h = max(roi_w, t(1)), max(roi_h, t(1))
        bin_h, bin_w = roi_h / t(out_h), roi_w / t(out_w)
        grid_h = t(sampling_ratio) if sampling_ratio > 0 else np.ceil(bin_h)
        grid_w = t(sampling_ratio) if sampling_ratio > 0 else np.ceil(bin_w)
        if not (grid_h <= 32768 and grid_w <= 32768):
            return None
        return int(r[0]), start_h, start_w, bin_h, bin_w, int(grid_h), int(grid_w)


def roi_align_sample(t, start, bin_size, index, i, grid):
    return start + t(index) * bin_size + (t(i) + t(0.5)) * bin_size / t(grid)


def roi_align_axis(t, v, size):
    """mmd_interp in dtype t: None outside the map, else (low, high, w_low, w_high)."""
    if not (v >= t(-1) and v <= t(size)) or size <= 0:
        return None
    v = max(v, t(0))
    low = int(v)
    if low >= size - 1:
        low = high = size - 1
        v = t(low)
    else:
        high = low + 1
    w_high = v - t(low)
    return low, high, float(t(1) - w_high), float(w_high)


@np.errstate(invalid="ignore")   # inf * 0 weights are NaN, as in the kernels
def roi_align_reference(x, rois, out_h, out_w, scale, sampling_ratio, mode, aligned):
    """(output, [per bin: list of (value, y, x) samples] for max mode) in float64."""
    t = x.dtype.type
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, out_h, out_w))
    samples = {}
    for k, roi in enumerate(rois):
        b, start_h, start_w, bin_h, bin_w, grid_h, grid_w = roi_align_geometry(
            roi, t, n, out_h, out_w, scale, sampling_ratio, aligned)
        for ph in range(out_h):
            ys = [roi_align_sample(t, start_h, bin_h, ph, iy, grid_h) for iy in range(grid_h)]
            for pw in range(out_w):
                xs = [roi_align_sample(t, start_w, bin_w, pw, ix, grid_w) for ix in range(grid_w)]
                for ch in range(c):
                    plane = x[b, ch].astype(np.float64)
                    values = []
                    for y in ys:
                        ay = roi_align_axis(t, y, h)
                        for xx in xs:
                            ax = roi_align_axis(t, xx, w)
                            v = 0.0
                            if ay and ax:
                                v = (ay[2] * (ax[2] * plane[ay[0], ax[0]] + ax[3] * plane[ay[0], ax[1]])
                                     + ay[3] * (ax[2] * plane[ay[1], ax[0]]
                                                + ax[3] * plane[ay[1], ax[1]]))
                            values.append((v, float(y), float(xx)))
                    samples[k, ch, ph, pw] = values
                    if mode == 1:
                        out[k, ch, ph, pw] = sum(v for v, _, _ in values) / max(len(values), 1)
                        continue
                    numbers = [v for v, _, _ in values if not math.isnan(v)]
                    out[k, ch, ph, pw] = (max(numbers) if numbers else
                                          (math.nan if values else 0.0))
    return out, samples


def check_roi_align_argmax(out, arg_y, arg_x, samples, rtol, atol):
    """Max mode: each argmax is a sample whose value is the bin's maximum
    (up to rounding, since the kernel interpolates in its own dtype), or -1
    when the bin took no number."""
    for index, values in samples.items():
        numbers = [(v, y, x) for v, y, x in values if not math.isnan(v)]
        if not numbers:
            assert arg_y[index] == -1 and arg_x[index] == -1, index
            continue
        best = max(v for v, _, _ in numbers)
        margin = atol + rtol * abs(best) if math.isfinite(best) else 0.0
        tied = {(y, x) for v, y, x in numbers if v >= best - margin}
        assert (float(arg_y[index]), float(arg_x[index])) in tied, (index, best)


def roi_align_backward_reference(grad_out, rois, arg_y, arg_x, shape, scale, sampling_ratio,
                                 mode, aligned):
    t = grad_out.dtype.type
    n, c, h, w = shape
    out_h, out_w = grad_out.shape[2:]
    grad = np.zeros(shape)
    for k, roi in enumerate(rois):
        b, start_h, start_w, bin_h, bin_w, grid_h, grid_w = roi_align_geometry(
            roi, t, n, out_h, out_w, scale, sampling_ratio, aligned)
        for ch in range(c):
            for ph in range(out_h):
                for pw in range(out_w):
                    g = float(grad_out[k, ch, ph, pw])
                    if mode == 0:
                        if arg_y[k, ch, ph, pw] == -1:
                            continue
                        points = [(arg_y[k, ch, ph, pw], arg_x[k, ch, ph, pw], g)]
                    else:
                        share = g / max(grid_h * grid_w, 1)
                        points = [(roi_align_sample(t, start_h, bin_h, ph, iy, grid_h),
                                   roi_align_sample(t, start_w, bin_w, pw, ix, grid_w), share)
                                  for iy in range(grid_h) for ix in range(grid_w)]
                    for y, xx, weight in points:
                        ay, ax = roi_align_axis(t, t(y), h), roi_align_axis(t, t(xx), w)
                        if not (ay and ax):
                            continue
                        for row, wy in ((ay[0], ay[2]), (ay[1], ay[3])):
                            for col, wx in ((ax[0], ax[2]), (ax[1], ax[3])):
                                grad[b, ch, row, col] += weight * wy * wx
    return grad


@st.composite
def forward_case(draw, dtype):
    n, c, h, w, k, out_h, out_w, scale = draw(roi_problem_sizes())
    sampling_ratio = draw(st.integers(-1, 3))
    mode, aligned = draw(st.sampled_from([0, 1])), draw(st.booleans())
    x = draw(float_arrays((n, c, h, w), dtype))
    rois = draw(rois_for(k, n, h, w, scale, aligned, dtype))
    pooled = (k, c, out_h, out_w)
    # avg mode does not use argmax_y/argmax_x: they may be empty
    argmax_shape = pooled if mode == 0 or draw(st.booleans()) else (0,)
    args = dict(input=guarded(x), rois=guarded(rois), output=guarded(sentinel(pooled, dtype)),
                argmax_y=guarded(sentinel(argmax_shape, dtype)),
                argmax_x=guarded(sentinel(argmax_shape, dtype)), aligned_height=out_h,
                aligned_width=out_w, spatial_scale=scale, sampling_ratio=sampling_ratio,
                pool_mode=mode, aligned=aligned)

    def check(a):
        expected, samples = roi_align_reference(x, rois, out_h, out_w, scale, sampling_ratio,
                                                mode, aligned)
        assert_close(a["output"], expected, dtype)
        if mode == 0:
            check_roi_align_argmax(np.asarray(a["output"], np.float64), a["argmax_y"],
                                   a["argmax_x"], samples, **TOL[dtype])
    return args, check


@st.composite
def backward_case(draw, dtype):
    n, c, h, w, k, out_h, out_w, scale = draw(roi_problem_sizes())
    sampling_ratio = draw(st.integers(-1, 3))
    mode, aligned = draw(st.sampled_from([0, 1])), draw(st.booleans())
    rois = draw(rois_for(k, n, h, w, scale, aligned, dtype))
    pooled = (k, c, out_h, out_w)
    grad_out = draw(float_arrays(pooled, dtype))
    if mode == 0:
        # argmax positions anywhere around the map (backward checks them), some -1
        arg_y = draw(float_arrays(pooled, dtype, -2, h + 2, specials=False))
        arg_x = draw(float_arrays(pooled, dtype, -2, w + 2, specials=False))
    else:
        arg_y = arg_x = np.zeros((0,), dtype)
    args = dict(grad_output=guarded(grad_out), rois=guarded(rois), argmax_y=guarded(arg_y),
                argmax_x=guarded(arg_x), grad_input=guarded(np.zeros((n, c, h, w), dtype)),
                aligned_height=out_h, aligned_width=out_w, spatial_scale=scale,
                sampling_ratio=sampling_ratio, pool_mode=mode, aligned=aligned)

    def check(a):
        expected = roi_align_backward_reference(grad_out, rois, arg_y, arg_x, (n, c, h, w),
                                                scale, sampling_ratio, mode, aligned)
        assert_close(a["grad_input"], expected, dtype)
    return args, check


def forward_user_case(draw, name, dtype, layout):
    a, _ = draw(forward_case(dtype))
    mode = ["max", "avg"][a["pool_mode"]]
    inputs = dict(input=layout(a["input"]), rois=layout(a["rois"]))

    def run():
        return getattr(roi_align_module, name)(inputs["input"], inputs["rois"],
                                               (a["aligned_height"], a["aligned_width"]),
                                               a["spatial_scale"], a["sampling_ratio"], mode,
                                               a["aligned"])

    def verify(result):
        output = result[0] if name == "roi_align_forward" else result
        expected, samples = roi_align_reference(
            a["input"], a["rois"], a["aligned_height"], a["aligned_width"],
            a["spatial_scale"], a["sampling_ratio"], a["pool_mode"], a["aligned"])
        assert output.dtype == dtype
        assert_close(output, expected, dtype)
        if name == "roi_align_forward" and mode == "max":
            check_roi_align_argmax(np.asarray(output, np.float64), result[1], result[2],
                                   samples, **TOL[dtype])
    return run, inputs, verify


def backward_user_case(draw, name, dtype, layout):
    a, check = draw(backward_case(dtype))
    mode = ["max", "avg"][a["pool_mode"]]
    unused = mode == "avg" and draw(st.booleans())
    inputs = dict(grad_output=layout(a["grad_output"]), rois=layout(a["rois"]),
                  argmax_y=None if unused else layout(a["argmax_y"]),
                  argmax_x=None if unused else layout(a["argmax_x"]))

    def run():
        return roi_align_backward(inputs["grad_output"], inputs["rois"], inputs["argmax_y"],
                                  inputs["argmax_x"], a["grad_input"].shape, a["spatial_scale"],
                                  a["sampling_ratio"], mode, a["aligned"])
    return run, inputs, lambda result: check(dict(a, grad_input=result))


def torch_forward_calls(torch, device):
    x, rois = torch_map_and_rois(torch, device)
    return [(x, rois, 2, 2, 1.0, 2, mode, aligned) for mode in (0, 1) for aligned in (False, True)]


def torch_backward_calls(torch, device):
    x, rois = torch_map_and_rois(torch, device)
    grad = torch.randn(3, 3, 2, 2, dtype=torch.float64, device=device)
    _, argmax_y, argmax_x = torch.ops.mmdispatch.roi_align_forward(x.detach(), rois, 2, 2, 1.0, 2,
                                                                   0, True)
    none = torch.empty(0, dtype=torch.float64, device=device)
    return [(grad, rois, none, none, tuple(x.shape), torch.float64, 2, 2, 1.0, 2, 1, True),
            (grad, rois, argmax_y, argmax_x, tuple(x.shape), torch.float64, 2, 2, 1.0, 2, 0, True)]


class TestProperties(OpProperties):
    module = roi_align_module
    torch_calls = {"roi_align_forward_impl": torch_forward_calls,
                   "roi_align_backward_impl": torch_backward_calls}
    entry_cases = {"roi_align_forward_impl": forward_case,
                   "roi_align_backward_impl": backward_case}
    fixed_axes = {
        "roi_align_forward_impl": {"rois": [1], "output": [0, 1, 2, 3],
                                   "argmax_y": [0, 1, 2, 3], "argmax_x": [0, 1, 2, 3]},
        "roi_align_backward_impl": {"rois": [1], "grad_output": [0, 1, 2, 3],
                                    "argmax_y": [0, 1, 2, 3], "argmax_x": [0, 1, 2, 3],
                                    "grad_input": [1]},
    }
    bad_scalars = {"aligned_height": [0, -1, 2 ** 40], "aligned_width": [0, -3, 99],
                   "spatial_scale": [0.0, -1.0, math.nan, math.inf, -math.inf],
                   "sampling_ratio": [32769, 2 ** 62], "pool_mode": [2, -1, 7]}
    user_cases = {"roi_align": forward_user_case, "roi_align_forward": forward_user_case,
                  "roi_align_backward": backward_user_case}
    good_user_args = {
        "roi_align": lambda: [*small_map_and_rois(), (2, 2), 1.0, 0, "avg", True],
        "roi_align_forward": lambda: [*small_map_and_rois(), (2, 2), 1.0, 0, "avg", True],
        "roi_align_backward": lambda: [np.ones((2, 3, 2, 2)), small_map_and_rois()[1], None,
                                       None, (2, 3, 4, 5), 1.0, 0, "avg", True],
    }
    user_bad_values = {
        ("roi_align", 2): [0, -1, (2, 0), 2.5, "2", (1, 2, 3), None],
        ("roi_align_forward", 2): [0, (-1, 2), 1.5],
        ("roi_align", 3): [0.0, -1.0, math.nan, math.inf, "1"],
        ("roi_align", 5): ["median", 1, None],
        ("roi_align_forward", 5): ["MAX", 0],
        ("roi_align_forward", 6): ["yes", None, 1.5],
        ("roi_align_backward", 4): [(2, 3, 4), (2, -3, 4, 5), "abcd", None, (2, 3.5, 4, 5)],
        ("roi_align_backward", 7): ["sum", None],
    }

    def ignores(self, op_name, args, name):
        # avg mode reads no argmax, and takes empty ones
        return name.startswith("argmax") and args["pool_mode"] == 1 and args[name].size == 0

    def bad_data(self, draw, op_name, args):
        # an aligned roi must not be reversed
        reversed_roi = [(3, lambda roi: roi[1] - 1)] if args["aligned"] else []
        batch = args["input" if "input" in args else "grad_input"].shape[0]
        return bad_rois(draw, args, batch, reversed_roi)
