"""roi_pool (Fast R-CNN RoIPool, torchvision's and MMCV's conventions):
published values, a slow independent reference, finite differences,
properties, bad input, device consistency and CPU/CUDA agreement."""
import importlib
import math
import re
from fractions import Fraction

import numpy as np
import pytest

from hypothesis import assume, strategies as st

import mmdispatch
from mmdispatch.ops import roi_pool, roi_pool_backward, roi_pool_forward
from properties import (OpProperties, assert_close, bad_rois, float_arrays, guarded,
                        roi_problem_sizes, rois_for, sentinel, small_map_and_rois,
                        torch_map_and_rois)

roi_pool_module = importlib.import_module("mmdispatch.ops.roi_pool")
DTYPES = [np.float32, np.float64]
NAMES = {code: name for name, code in roi_pool_module.CONVENTIONS.items()}

# MMCV tests/test_ops/test_roi_pool.py: (input, rois) -> (output, grad of sum(output)),
# output size (2, 2), spatial_scale 1.
MMCV_CASES = [
    ([[[[1., 2.], [3., 4.]]]], [[0., 0., 0., 1., 1.]],
     [[[[1., 2.], [3., 4.]]]], [[[[1., 1.], [1., 1.]]]]),
    ([[[[1., 2.], [3., 4.]], [[4., 3.], [2., 1.]]]], [[0., 0., 0., 1., 1.]],
     [[[[1., 2.], [3., 4.]], [[4., 3.], [2., 1.]]]],
     [[[[1., 1.], [1., 1.]], [[1., 1.], [1., 1.]]]]),
    ([[[[1., 2., 5., 6.], [3., 4., 7., 8.], [9., 10., 13., 14.], [11., 12., 15., 16.]]]],
     [[0., 0., 0., 3., 3.]],
     [[[[4., 8.], [12., 16.]]]],
     [[[[0., 0., 0., 0.], [0., 1., 0., 1.], [0., 0., 0., 0.], [0., 1., 0., 1.]]]]),
]


# --- slow reference, straight from the Fast R-CNN / MMCV definitions ----------
# Geometry is computed with scalars of the kernel's dtype (np.float32 /
# np.float64), because the definition is "in the dtype", as in MMCV.
# convention 0 is torchvision's (rounded corners), 1 MMCV's CUDA kernel's.

def round_half_away(v):
    """C round(): nearest integer, halves away from zero."""
    r = math.floor(v)
    frac = v - r
    if frac > 0.5 or (frac == 0.5 and v > 0):
        r += 1
    return r


def fused(a, b, c, t):
    """a * b + c rounded once to dtype t (a fused multiply-add)."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = t(float(exact))
    candidates = [near, np.nextafter(near, t(-np.inf)), np.nextafter(near, t(np.inf))]
    return min(candidates, key=lambda v: (abs(Fraction(float(v)) - exact),
                                          int(np.frombuffer(v.tobytes(), np.uint8)[0]) & 1))


def ref_geometry(roi, scale, pooled_h, pooled_w, t, convention=0):
    """(batch, start_h, start_w, offset_h, offset_w, bin_h, bin_w) of one roi
    in dtype t: bin k starts at floor(k * bin + offset) + start."""
    s = t(scale)
    if convention == 1:   # as nvcc compiles MMCV's kernel: the widths fused
        x1, y1 = t(roi[1]) * s, t(roi[2]) * s
        width, height = fused(t(roi[3]) + t(1), s, -x1, t), fused(t(roi[4]) + t(1), s, -y1, t)
        if not (width > 0 and height > 0):
            return int(roi[0]), t(0), t(0), t(0), t(0), t(0), t(0)
        return (int(roi[0]), t(0), t(0), y1, x1, height / t(pooled_h), width / t(pooled_w))
    x1, y1, x2, y2 = (t(round_half_away(float(t(v) * s))) for v in roi[1:])
    width = max(t(x2 - x1) + t(1), t(1))
    height = max(t(y2 - y1) + t(1), t(1))
    return int(roi[0]), y1, x1, t(0), t(0), height / t(pooled_h), width / t(pooled_w)


def ref_bin(start, offset, bin_size, k, size, t, convention=0):
    """Cells [lo, hi) of bin k along an axis of `size` cells; MMCV's edges
    go through float32 before floor and ceil (floorf, ceilf), as in its
    kernel, whatever the dtype."""
    edges = [fused(t(j), bin_size, offset, t) for j in (k, k + 1)]
    if convention == 1:
        edges = [np.float32(e) for e in edges]
    lo = t(math.floor(edges[0])) + start
    hi = t(math.ceil(edges[1])) + start
    lo = min(max(lo, t(0)), t(size))
    hi = min(max(hi, t(0)), t(size))
    return int(lo), int(hi)


def ref_forward(x, rois, pooled_h, pooled_w, scale, convention=0):
    t = x.dtype.type
    n, c, h, w = x.shape
    out = np.zeros((len(rois), c, pooled_h, pooled_w), dtype=x.dtype)
    arg = np.full(out.shape, -1, dtype=np.int64)
    for k, roi in enumerate(rois):
        b, start_h, start_w, off_h, off_w, bin_h, bin_w = ref_geometry(
            roi, scale, pooled_h, pooled_w, t, convention)
        for ch in range(c):
            for ph in range(pooled_h):
                h0, h1 = ref_bin(start_h, off_h, bin_h, ph, h, t, convention)
                for pw in range(pooled_w):
                    w0, w1 = ref_bin(start_w, off_w, bin_w, pw, w, t, convention)
                    best, best_index, saw_nan = None, -1, False
                    for hh in range(h0, h1):
                        for ww in range(w0, w1):
                            v = float(x[b, ch, hh, ww])
                            if math.isnan(v):
                                saw_nan = True
                            elif best is None or v > best:
                                best, best_index = v, hh * w + ww
                    if best is not None:
                        out[k, ch, ph, pw] = best
                    elif saw_nan:
                        out[k, ch, ph, pw] = math.nan
                    arg[k, ch, ph, pw] = best_index
    return out, arg


def ref_backward(grad_out, rois, arg, shape):
    grad = np.zeros(shape)
    width = shape[3]
    for k, roi in enumerate(rois):
        b = int(roi[0])
        for ch in range(shape[1]):
            for ph in range(grad_out.shape[2]):
                for pw in range(grad_out.shape[3]):
                    a = int(arg[k, ch, ph, pw])
                    if a >= 0:
                        grad[b, ch, a // width, a % width] += float(grad_out[k, ch, ph, pw])
    return grad


def random_rois(rng, count, batch, height, width, scale):
    """Rois in image coordinates: some inside, some partly or fully outside the
    map, zero-size, reversed, tiny and huge ones, and corners on multiples of
    0.25 so that scaled corners often land exactly on .5."""
    img_h, img_w = height / scale, width / scale
    x1 = rng.uniform(-0.5 * img_w, 1.2 * img_w, count)
    y1 = rng.uniform(-0.5 * img_h, 1.2 * img_h, count)
    x2 = x1 + rng.uniform(-0.1 * img_w, 0.9 * img_w, count)
    y2 = y1 + rng.uniform(-0.1 * img_h, 0.9 * img_h, count)
    rois = np.stack([rng.integers(0, batch, count).astype(float), x1, y1, x2, y2], axis=1)
    quarter = rng.random(count) < 0.5
    rois[quarter, 1:] = np.round(rois[quarter, 1:] * 4) / 4
    rois[0, 3:] = rois[0, 1:3]                                        # zero size
    rois[1, 3], rois[1, 4] = rois[1, 1] + 0.3, rois[1, 2] + 0.2       # tiny
    rois[2, 1:] = [-1e4, -3 * img_h, 1e4, 5 * img_h]                  # huge
    rois[3, 1:] = [-3 * img_w, -3 * img_h, -2 * img_w, -2 * img_h]    # fully outside
    rois[4, 1:] = [img_w - 2.5, 1.5, img_w + 40, 0.5]                 # reversed y, off the edge
    return rois


SCALES = [1.0, 0.5, 0.25, 0.125, 2.0, 0.3, 0.7]
POOLED = [(1, 1), (2, 2), (3, 2), (2, 5), (7, 7), (4, 3)]


def case_arrays(seed, dtype):
    rng = np.random.default_rng(seed)
    batch = 1 + seed % 3
    height, width = int(rng.integers(1, 10)), int(rng.integers(1, 11))
    x = rng.standard_normal((batch, 2, height, width)).astype(dtype)
    scale = SCALES[seed % len(SCALES)]
    pooled_h, pooled_w = POOLED[seed % len(POOLED)]
    rois = random_rois(rng, 9, batch, height, width, scale).astype(dtype)
    return rng, x, rois, scale, pooled_h, pooled_w


def good_call(dtype=np.float64):
    x = np.arange(2 * 3 * 5 * 5, dtype=dtype).reshape(2, 3, 5, 5)
    rois = np.array([[0, 0, 0, 2, 2], [1, 1, 1, 4, 4]], dtype=dtype)
    return x, rois


def filled(shape, dtype, value=7):
    return np.full(shape, value, dtype=dtype)


# --- published values ---------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", range(len(MMCV_CASES)))
def test_forward_and_backward_match_mmcv_published_values(case, dtype):
    x, rois, expected, expected_grad = (np.array(a, dtype=dtype) for a in MMCV_CASES[case])
    out, argmax = roi_pool_forward(x, rois, (2, 2), 1.0)
    grad = roi_pool_backward(np.ones_like(out), rois, argmax, x.shape, 1.0)
    assert out.dtype == dtype and grad.dtype == dtype and argmax.dtype == np.int64
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(grad, expected_grad)


# --- against the slow reference -----------------------------------------------

@pytest.mark.parametrize("convention", ["torchvision", "mmcv"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(32))
def test_forward_and_backward_match_slow_reference(seed, dtype, convention):
    rng, x, rois, scale, pooled_h, pooled_w = case_arrays(seed, dtype)
    code = roi_pool_module.CONVENTIONS[convention]
    expected, expected_arg = ref_forward(x, rois, pooled_h, pooled_w, scale, code)
    out, argmax = roi_pool_forward(x, rois, (pooled_h, pooled_w), scale, convention)
    assert out.shape == expected.shape and out.dtype == dtype
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(argmax, expected_arg)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = roi_pool_backward(grad_out, rois, argmax, x.shape, scale, convention)
    assert grad.shape == x.shape and grad.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(grad, ref_backward(grad_out, rois, expected_arg, x.shape),
                               rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_mmcv_convention_takes_unrounded_corners_and_end_plus_one(dtype):
    """mmcv.ops.roi_pool's CUDA kernel: the roi spans x1 * scale to
    (x2 + 1) * scale, unrounded; torchvision's rounds the scaled corners and
    counts x2 - x1 + 1 cells. Values worked out by hand on an 8 x 8 ramp."""
    x = np.arange(64, dtype=dtype).reshape(1, 1, 8, 8)
    cases = [  # roi, scale, MMCV's 2 x 2 bins, torchvision's
        ([0, 0, 0, 7, 7], 0.5, [9, 11, 25, 27], [18, 20, 34, 36]),       # 0..4 vs 0..4 cells
        ([0, 16, 16, 63, 63], 0.0625, [18, 19, 26, 27], [18, 20, 34, 36]),
        ([0, 1, 1, 2, 2], 1.0, [9, 10, 17, 18], [9, 10, 17, 18]),        # whole: the same
    ]
    for roi, scale, mmcv, torchvision in cases:
        rois = np.array([roi], dtype)
        assert roi_pool(x, rois, 2, scale, "mmcv").ravel().tolist() == mmcv
        assert roi_pool(x, rois, 2, scale).ravel().tolist() == torchvision


def test_mmcv_convention_fuses_the_width_as_nvcc_builds_mmcvs_kernel():
    """The width (x2 + 1) * scale - x1 * scale is one fused multiply-add in
    MMCV's compiled kernel: on this roi (found by comparing with nvcc's
    build of MMCV's kernel) the last of 7 bins starts at column 161, where
    two roundings give 160. A map falling along x puts each bin's maximum
    on its first column."""
    x = np.broadcast_to(-np.arange(200, dtype=np.float32), (1, 1, 4, 200)).copy()
    rois = np.array([[0, 168.58109, 0, 239.23648, 2]], np.float32)
    _, argmax = roi_pool_forward(x, rois, (1, 7), 0.7, "mmcv")
    assert argmax[0, 0, 0, -1] == 161
    t = np.float32
    plain = ((t(239.23648) + t(1)) * t(0.7) - t(168.58109) * t(0.7)) / t(7)
    assert math.floor(t(6) * plain + t(168.58109) * t(0.7)) == 160   # two roundings


def test_mmcv_convention_rounds_bin_edges_to_float_for_double_too():
    """MMCV's kernel takes floorf / ceilf of every bin edge, float64 maps
    included, whatever the roi's corner (0 here): 29 cells in 7 bins end
    the last at 7 * (29 / 7) = 29.000000000000004 in double, which ceil
    makes 30 and ceilf 29. torchvision's convention stays in double."""
    x = np.arange(31.0).reshape(1, 1, 1, 31)
    rois = np.array([[0, 0, 0, 28, 0]], np.float64)
    assert roi_pool_forward(x, rois, (1, 7), 1.0, "mmcv")[1][0, 0, 0, -1] == 28
    assert roi_pool_forward(x, rois, (1, 7), 1.0)[1][0, 0, 0, -1] == 29


def test_mmcv_convention_gives_a_roi_of_no_width_zeros_and_no_gradient():
    """A roi with x2 + 1 <= x1 (or y alike) has only empty bins under MMCV's
    convention: 0 with argmax -1, so no gradient (MMCV's kernel leaves argmax
    0 there); torchvision's makes it one cell."""
    x = np.arange(64.0).reshape(1, 1, 8, 8)
    rois = np.array([[0, 3, 3, 1, 1], [0, 3, 3, 1.999, 5]])
    out, argmax = roi_pool_forward(x, rois, (2, 2), 1.0, "mmcv")
    assert (out == 0).all() and (argmax == -1).all()
    grad = roi_pool_backward(np.ones_like(out), rois, argmax, x.shape, 1.0, "mmcv")
    assert (grad == 0).all()
    assert (roi_pool(x, rois[:1], 2) == 27).all()


def test_an_unknown_convention_is_a_clear_error():
    x, rois = good_call()
    with pytest.raises(ValueError, match="roi_pool_forward: convention must be one of "
                       "'torchvision', 'mmcv', got 'caffe'"):
        roi_pool(x, rois, 2, 1.0, "caffe")
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_forward_impl: convention must be 0 (torchvision's) or 1 (MMCV's), got 2")):
        mmdispatch.roi_pool_forward_impl(x, rois, None, None, 2, 2, 1.0, 2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_scaled_corners_round_half_away_from_zero(dtype):
    x = np.arange(64, dtype=dtype).reshape(1, 1, 8, 8)
    # corners 1 and 5 at scale 0.5 land on 0.5 and 2.5: C round() gives 1 and 3
    # (half-to-even would give 0 and 2)
    out, argmax = roi_pool_forward(x, np.array([[0, 1, 1, 5, 5]], dtype=dtype), 3, 0.5)
    np.testing.assert_array_equal(out[0, 0], x[0, 0, 1:4, 1:4])
    np.testing.assert_array_equal(argmax[0, 0], [[9, 10, 11], [17, 18, 19], [25, 26, 27]])
    # corners -5 and 5 at scale 0.5 land on -2.5 and 2.5: rounded to -3 and 3, a
    # 7-cell roi whose first three rows and columns lie off the map
    out, argmax = roi_pool_forward(x, np.array([[0, -5, -5, 5, 5]], dtype=dtype), 7, 0.5)
    assert not out[0, 0, :3].any() and not out[0, 0, :, :3].any()
    assert np.all(argmax[0, 0, :3] == -1) and np.all(argmax[0, 0, :, :3] == -1)
    np.testing.assert_array_equal(out[0, 0, 3:, 3:], x[0, 0, :4, :4])
    # scale 0.25: corner 2 -> 0.5 -> 1 and corner 10 -> 2.5 -> 3
    out, _ = roi_pool_forward(x, np.array([[0, 2, 2, 2, 10]], dtype=dtype), (3, 1), 0.25)
    np.testing.assert_array_equal(out[0, 0, :, 0], x[0, 0, 1:4, 1])


def test_roi_spans_at_least_one_cell_even_when_reversed():
    x = np.arange(25.0).reshape(1, 1, 5, 5)
    out, argmax = roi_pool_forward(x, np.array([[0, 3, 2, 1, 0.0]]), 2)
    # width = max(1 - 3 + 1, 1) = 1 from column 3, height 1 from row 2: every bin
    # is cell (2, 3)
    assert np.all(out == x[0, 0, 2, 3]) and np.all(argmax == 2 * 5 + 3)


def test_bins_cover_floor_to_ceil_so_neighbours_overlap():
    x = np.zeros((1, 1, 1, 5))
    x[0, 0, 0, 2] = 5.0
    # roi width 5 in 2 bins of 2.5: bin 0 = cells [0, 3), bin 1 = cells [2, 5)
    out, argmax = roi_pool_forward(x, np.array([[0, 0, 0, 4, 0.0]]), (1, 2))
    np.testing.assert_array_equal(out[0, 0, 0], [5.0, 5.0])
    np.testing.assert_array_equal(argmax[0, 0, 0], [2, 2])
    x[0, 0, 0, 2] = -5.0
    x[0, 0, 0] += [0, 1, 0, 0, 2]
    out, argmax = roi_pool_forward(x, np.array([[0, 0, 0, 4, 0.0]]), (1, 2))
    np.testing.assert_array_equal(argmax[0, 0, 0], [1, 4])


def test_first_maximum_wins_ties_in_row_major_order():
    x = np.ones((1, 1, 3, 3))
    out, argmax = roi_pool_forward(x, np.array([[0, 0, 0, 2, 2.0]]), 1)
    assert out[0, 0, 0, 0] == 1.0 and argmax[0, 0, 0, 0] == 0


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(6))
def test_ties_signed_zeros_infinities_and_nan_pool_as_the_row_major_scan(seed, dtype):
    """Maps of a few values (many ties, -0.0 next to 0.0, -inf as a maximum,
    all-NaN bins): the value, its sign and the argmax are those of the
    reference's row-major scan with a strict >."""
    rng = np.random.default_rng(seed)
    values = np.array([-np.inf, -1.0, -0.0, 0.0, 1.0, np.inf, np.nan], dtype=dtype)
    weights = [[4, 1, 2, 2, 1, 1, 3], [1, 1, 1, 1, 1, 1, 1], [3, 0, 0, 0, 0, 0, 5]][seed % 3]
    height, width = int(rng.integers(1, 30)), int(rng.integers(1, 90))
    x = rng.choice(values, size=(2, 3, height, width), p=np.divide(weights, sum(weights)))
    rois = random_rois(rng, 12, 2, height, width, 0.5).astype(dtype)
    pooled = POOLED[seed % len(POOLED)]
    out, argmax = roi_pool_forward(x, rois, pooled, 0.5)
    ref_out, ref_arg = ref_forward(x, rois, *pooled, 0.5)
    np.testing.assert_array_equal(argmax, ref_arg)
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(np.signbit(out), np.signbit(ref_out))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 2, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 33, 40])
def test_every_column_span_of_a_row_pools_as_the_reference(width, dtype):
    """The kernel reduces a roi's columns in register chunks of up to 4
    vectors (16 float32 or 8 float64 columns) that may overlap, or reach
    past the roi inside the map's row, and one column at a time on maps
    narrower than a vector: rois on every column span [x1, x2] of a row
    (a sample of them on wide maps), over small integers (many ties) with
    -0.0, -inf and NaN, pool as the reference's row-major scan."""
    rng = np.random.default_rng(width)
    height = 5
    values = np.array([-np.inf, -0.0, 0.0, 1.0, 2.0, np.nan], dtype=dtype)
    x = rng.choice(values, size=(1, 2, height, width), p=[0.1, 0.15, 0.15, 0.3, 0.2, 0.1])
    spans = [(a, b) for a in range(width) for b in range(a, width)]
    if len(spans) > 150:
        spans = [spans[i] for i in rng.choice(len(spans), 150, replace=False)]
    rois = np.array([[0, a, rng.integers(0, 2), b, rng.integers(2, height)] for a, b in spans],
                    dtype=dtype)
    for pooled in [(2, 1), (1, 3)]:
        out, argmax = roi_pool_forward(x, rois, pooled, 1.0)
        ref_out, ref_arg = ref_forward(x, rois, *pooled, 1.0)
        np.testing.assert_array_equal(argmax, ref_arg)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(np.signbit(out), np.signbit(ref_out))


# Channel groups (the CPU forward): where an image's rois read as many cells as
# it has or more, 8 float32 / 4 float64 channels at a time from the image's planes
# interleaved; an image of few rois beside them a plane at a time; a slice of
# many rois on one group split into parts. (batch, channels, rois per image).
GROUP_LAYOUTS = {
    "one image, a whole group": (1, 8, [40]),
    "one image, a group and a part": (1, 13, [40]),
    "three images, one without rois, one of a roi": (3, 11, [45, 0, 1]),
    "one group of many rois in parts": (1, 8, [150]),
}


@pytest.mark.parametrize("convention", ["torchvision", "mmcv"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", GROUP_LAYOUTS)
def test_channel_groups_pool_as_the_row_major_scan(layout, dtype, convention):
    """Maps of a few values (ties, -0.0 beside 0.0, -inf and NaN, all-NaN
    and only -inf bins) pooled by channel groups: the value, its sign and
    the argmax are the reference's, for whole and partial groups, images
    with and without interleaved planes, rois partly or wholly off the map
    (empty bins) and a slice of rois split into parts."""
    batch, channels, counts = GROUP_LAYOUTS[layout]
    rng = np.random.default_rng(len(layout) * 7 + channels)
    height, width = 12, 15
    values = np.array([-np.inf, -1.0, -0.0, 0.0, 1.0, np.inf, np.nan], dtype=dtype)
    x = rng.choice(values, size=(batch, channels, height, width),
                   p=[0.2, 0.15, 0.15, 0.15, 0.1, 0.05, 0.2])
    x[0, channels - 1, :4, :5] = np.nan       # all-NaN bins in the group's last lane
    x[0, 0, 6:, 8:] = -np.inf                 # bins of only -inf
    scale = 0.5
    rois = np.concatenate([random_rois(rng, max(count, 5), batch, height, width, scale)[:count]
                           for count in counts if count])
    rois[:, 0] = np.repeat(np.arange(batch), counts)
    rois = rois[rng.permutation(len(rois))].astype(dtype)   # images' rois interleaved
    for pooled in [(3, 4), (2, 2), (5, 3)]:
        out, argmax = roi_pool_forward(x, rois, pooled, scale, convention)
        ref_out, ref_arg = ref_forward(x, rois, *pooled, scale,
                                       roi_pool_module.CONVENTIONS[convention])
        np.testing.assert_array_equal(argmax, ref_arg)
        np.testing.assert_array_equal(out, ref_out)
        np.testing.assert_array_equal(np.signbit(out), np.signbit(ref_out))


# --- properties ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_points_at_the_maximum_of_its_bin(dtype, rng):
    x = rng.standard_normal((3, 4, 9, 11)).astype(dtype)
    rois = random_rois(rng, 20, 3, 9, 11, 0.5).astype(dtype)
    out, argmax = roi_pool_forward(x, rois, (3, 4), 0.5)
    flat = x.reshape(3, 4, -1)
    found = argmax >= 0
    assert found.any() and not found.all()
    for k, ch, ph, pw in zip(*np.nonzero(found)):
        assert out[k, ch, ph, pw] == flat[int(rois[k, 0]), ch, argmax[k, ch, ph, pw]]
    assert not out[~found].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rois_outside_the_map_give_zero_and_argmax_minus_one(dtype):
    x = np.full((1, 2, 4, 4), 3.0, dtype=dtype)
    rois = np.array([[0, 10, 10, 20, 20], [0, -20, -20, -10, -10], [0, -8, 1, -1, 2],
                     [0, 2, 5, 3, 9]], dtype=dtype)
    out, argmax = roi_pool_forward(x, rois, 2)
    assert not out.any() and np.all(argmax == -1)
    grad = roi_pool_backward(np.ones_like(out), rois, argmax, x.shape)
    assert not grad.any()


def test_roi_partly_outside_empties_only_the_outer_bins():
    x = np.arange(16.0).reshape(1, 1, 4, 4) + 1
    # columns -4..3 in 2 bins of 4: the left bin lies off the map
    out, argmax = roi_pool_forward(x, np.array([[0, -4, 0, 3, 3.0]]), (1, 2))
    np.testing.assert_array_equal(out[0, 0, 0], [0.0, 16.0])
    np.testing.assert_array_equal(argmax[0, 0, 0], [-1, 15])


def test_nan_values_are_skipped_and_an_all_nan_bin_gives_nan():
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    x[0, 0, 3, 3] = np.nan          # would be the maximum of bin (1, 1)
    x[0, 0, :2, :2] = np.nan        # all of bin (0, 0)
    out, argmax = roi_pool_forward(x, np.array([[0, 0, 0, 3, 3.0]]), 2)
    assert np.isnan(out[0, 0, 0, 0]) and argmax[0, 0, 0, 0] == -1
    assert out[0, 0, 1, 1] == 14.0 and argmax[0, 0, 1, 1] == 14
    assert out[0, 0, 0, 1] == 7.0 and argmax[0, 0, 0, 1] == 7
    grad = roi_pool_backward(np.ones_like(out), np.array([[0, 0, 0, 3, 3.0]]), argmax, x.shape)
    assert grad[0, 0, :2, :2].sum() == 0 and grad[0, 0, 3, 2] == 1.0


def test_backward_sums_gradients_of_overlapping_rois():
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    rois = np.array([[0, 0, 0, 3, 3], [0, 0, 0, 3, 3], [0, 2, 2, 3, 3.0]])
    out, argmax = roi_pool_forward(x, rois, 1)
    assert np.all(argmax == 15)
    grad = roi_pool_backward(np.array([1.0, 2.0, 4.0]).reshape(3, 1, 1, 1), rois, argmax,
                             x.shape)
    expected = np.zeros_like(x)
    expected[0, 0, 3, 3] = 7.0
    np.testing.assert_array_equal(grad, expected)


def test_backward_sends_each_roi_to_its_own_batch_item():
    x = np.stack([np.arange(16.0), -np.arange(16.0)]).reshape(2, 1, 4, 4)
    rois = np.array([[1, 0, 0, 3, 3], [0, 0, 0, 3, 3.0]])
    out, argmax = roi_pool_forward(x, rois, 1)
    np.testing.assert_array_equal(out.ravel(), [0.0, 15.0])
    grad = roi_pool_backward(np.array([2.0, 3.0]).reshape(2, 1, 1, 1), rois, argmax, x.shape)
    assert grad[1, 0, 0, 0] == 2.0 and grad[0, 0, 3, 3] == 3.0 and grad.sum() == 5.0


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_is_bit_identical_on_repeat(dtype, rng):
    x = rng.standard_normal((2, 8, 16, 16)).astype(dtype)
    rois = random_rois(rng, 64, 2, 16, 16, 1.0).astype(dtype)
    out, argmax = roi_pool_forward(x, rois, 7)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    first = roi_pool_backward(grad_out, rois, argmax, x.shape)
    for _ in range(3):
        again = roi_pool_backward(grad_out, rois, argmax, x.shape)
        assert again.tobytes() == first.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_returns_input_shape_and_dtype_and_accepts_int32_argmax(dtype, rng):
    x = rng.standard_normal((2, 3, 6, 5)).astype(dtype)
    rois = random_rois(rng, 7, 2, 6, 5, 1.0).astype(dtype)
    out, argmax = roi_pool_forward(x, rois, (2, 3))
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = roi_pool_backward(grad_out, rois, argmax, x.shape)
    assert grad.shape == x.shape and grad.dtype == dtype
    np.testing.assert_array_equal(
        roi_pool_backward(grad_out, rois, argmax.astype(np.int32), list(x.shape)), grad)


def test_impl_backward_accumulates_into_grad_input():
    x, rois = good_call()
    out, argmax = roi_pool_forward(x, rois, 2)
    grad_input = np.full(x.shape, 0.5)
    mmdispatch.roi_pool_backward_impl(np.ones_like(out), rois, argmax, grad_input, 2, 2, 1.0, 0)
    np.testing.assert_array_equal(grad_input, 0.5 + roi_pool_backward(np.ones_like(out), rois,
                                                                        argmax, x.shape))


# --- finite differences -------------------------------------------------------

@pytest.mark.parametrize("scale", [1.0, 0.5])
def test_backward_matches_finite_differences(scale, rng, numeric_gradient):
    shape = (2, 2, 6, 7)
    # distinct values 0.1 apart, so a perturbation of 1e-6 never changes an argmax
    x = rng.permutation(int(np.prod(shape))).reshape(shape) * 0.1 + 0.01
    rois = np.array([[0, 0.7, 0.4, 5.1, 4.6], [1, 2.2, 1.3, 4.9, 5.2], [0, -3, -2, 3, 2.5],
                     [1, 4, 3, 9, 8], [0, 0, 0, 6, 5], [1, 20, 20, 30, 30]])
    rois[:, 1:] /= scale
    grad_out = rng.standard_normal((6, 2, 2, 3))

    def loss(inp):
        return float(np.sum(roi_pool(inp, rois, (2, 3), scale) * grad_out))

    _, argmax = roi_pool_forward(x, rois, (2, 3), scale)
    analytic = roi_pool_backward(grad_out, rois, argmax, x.shape, scale)
    numeric = numeric_gradient(loss, x)
    assert np.count_nonzero(analytic) > 10
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-7)


# --- edge cases ---------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rois_give_empty_outputs_and_zero_gradient(dtype):
    x = np.ones((1, 3, 4, 4), dtype=dtype)
    rois = np.zeros((0, 5), dtype=dtype)
    out, argmax = roi_pool_forward(x, rois, (2, 3))
    assert out.shape == (0, 3, 2, 3) and argmax.shape == (0, 3, 2, 3)
    grad = roi_pool_backward(out, rois, argmax, x.shape)
    assert grad.shape == x.shape and grad.dtype == dtype and not grad.any()


def test_empty_feature_map_pools_zeros_with_argmax_minus_one():
    x = np.ones((1, 2, 0, 0))
    out, argmax = roi_pool_forward(x, np.array([[0, 0, 0, 3, 3.0]]), 2)
    assert out.shape == (1, 2, 2, 2) and not out.any() and np.all(argmax == -1)


def test_huge_float32_rois_are_clipped_without_overflow():
    x = np.arange(32, dtype=np.float32).reshape(1, 2, 4, 4)
    rois = np.array([[0, -1e30, -1e30, 1e30, 1e30], [0, 0, 0, 1e30, 1e30],
                     [0, -3e37, 1, 3e37, 2]], dtype=np.float32)
    expected, expected_arg = ref_forward(x, rois, 2, 2, 1.0)
    out, argmax = roi_pool_forward(x, rois, 2)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(argmax, expected_arg)
    # the second roi starts at the origin and its first bin covers the whole map
    assert out[1, 0, 0, 0] == 15.0 and argmax[1, 1, 0, 0] == 15


def test_float32_map_wider_than_two_to_the_24_clips_bins_to_its_last_column():
    """float32 cannot hold 2**24 + 3: the map width rounds up to 2**24 + 4 in
    the bin clipping, which must still end the bin at the last column."""
    width = 2 ** 24 + 3
    x = np.zeros((1, 1, 1, width), np.float32)
    x[0, 0, 0, -1] = 5.0
    rois = np.array([[0, width - 40, 0, width + 100, 0]], np.float32)
    out, argmax = roi_pool_forward(x, rois, 1)
    assert out[0, 0, 0, 0] == 5.0 and argmax[0, 0, 0, 0] == width - 1


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_roi_pool_fast_path_equals_the_general_path(dtype, rng):
    """roi_pool skips the conversions for plain float numpy arrays; the result
    must be roi_pool_forward's, and that of a Fortran-order copy (general
    path), for int and tuple sizes."""
    x = rng.standard_normal((2, 3, 9, 11)).astype(dtype)
    rois = np.array([[0, 1, 1, 6, 7], [1, 0, 2, 10, 8], [0, 3, 3, 3, 3]], dtype=dtype)
    for size in (3, (2, 4)):
        expected = roi_pool_forward(x, rois, size, 0.5)[0]
        fast = roi_pool(x, rois, size, 0.5)
        general = roi_pool(np.asfortranarray(x), rois, size, 0.5)
        np.testing.assert_array_equal(fast, expected)
        np.testing.assert_array_equal(general, expected)
        assert fast.dtype == dtype and fast.flags.c_contiguous and fast.base is None
    with pytest.raises(ValueError, match="spatial_scale"):
        roi_pool(x, rois, 3, -1.0)


def test_strided_inputs_give_the_same_results_as_contiguous_ones(rng):
    x = rng.standard_normal((2, 3, 8, 16))
    rois = np.asfortranarray(random_rois(rng, 6, 2, 8, 8, 1.0))
    expected, expected_arg = roi_pool_forward(np.ascontiguousarray(x[..., ::2]),
                                              np.ascontiguousarray(rois), 3)
    out, argmax = roi_pool_forward(x[..., ::2], rois, 3)
    np.testing.assert_array_equal(out, expected)
    np.testing.assert_array_equal(argmax, expected_arg)
    grad_out = rng.standard_normal((6, 3, 3, 6))[..., ::2]
    expected_grad = roi_pool_backward(np.ascontiguousarray(grad_out), rois, expected_arg,
                                      (2, 3, 8, 8))
    wide_arg = np.repeat(argmax, 2, axis=-1)[..., ::2]
    np.testing.assert_array_equal(roi_pool_backward(grad_out, rois, wide_arg, (2, 3, 8, 8)),
                                  expected_grad)


def test_dlpack_only_inputs_are_accepted(rng, dlpack_only):
    x = rng.standard_normal((2, 3, 8, 8))
    rois = random_rois(rng, 5, 2, 8, 8, 1.0)
    expected = roi_pool(x, rois, 3)
    np.testing.assert_array_equal(np.asarray(roi_pool(dlpack_only(x), dlpack_only(rois), 3)),
                                  expected)


# --- bad rois and bad argmax: errors before anything is written -----------------

@pytest.mark.parametrize("bad_roi, message", [
    ([0, np.nan, 0, 2, 2], "rois[1] contains NaN or inf"),
    ([0, 0, 0, 2, np.nan], "rois[1] contains NaN or inf"),
    ([0, 0, np.inf, 2, 2], "rois[1] contains NaN or inf"),
    ([np.nan, 0, 0, 2, 2], "rois[1] contains NaN or inf"),
    ([2, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in [0, 2)"),
    ([-1, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in [0, 2)"),
    ([0.5, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in [0, 2)"),
    ([1e30, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in [0, 2)"),
])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bad_rois_raise_and_write_nothing(bad_roi, message, dtype):
    x, rois = good_call(dtype)
    rois = np.concatenate([rois, rois[:1]])
    rois[1] = bad_roi        # the roi after it is fine, the one before too
    output = filled((3, 3, 2, 2), dtype)
    argmax = filled((3, 3, 2, 2), np.int64)
    with pytest.raises(ValueError, match=re.escape("roi_pool_forward_impl: " + message)):
        mmdispatch.roi_pool_forward_impl(x, rois, output, argmax, 2, 2, 1.0, 0)
    assert np.all(output == 7) and np.all(argmax == 7)
    grad_input = filled(x.shape, dtype)
    with pytest.raises(ValueError, match=re.escape("roi_pool_backward_impl: " + message)):
        mmdispatch.roi_pool_backward_impl(np.ones((3, 3, 2, 2), dtype=dtype), rois,
                                          np.zeros((3, 3, 2, 2), dtype=np.int64), grad_input, 2,
                                          2, 1.0, 0)
    assert np.all(grad_input == 7)
    with pytest.raises(ValueError, match=re.escape(message)):
        roi_pool(x, rois, 2)


@pytest.mark.parametrize("roi, scale", [
    ([0, 0, 0, 3e38, 3e38], 2.0),           # overflows once scaled
    ([0, -3e38, 0, 3e38, 3], 1.0),          # width x2 - x1 + 1 overflows
    ([0, 1, 1, 2, 2], 1e39),                # spatial_scale is inf in float32
])
def test_float32_rois_that_overflow_are_rejected(roi, scale):
    x = np.zeros((1, 1, 4, 4), dtype=np.float32)
    output = filled((1, 1, 2, 2), np.float32)
    argmax = filled((1, 1, 2, 2), np.int64)
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_forward_impl: rois[0] contains NaN or inf (or overflows once scaled)")):
        mmdispatch.roi_pool_forward_impl(x, np.array([roi], dtype=np.float32), output, argmax,
                                         2, 2, scale, 0)
    assert np.all(output == 7) and np.all(argmax == 7)


@pytest.mark.parametrize("value, position", [(25, 0), (-2, 5), (10**12, 23), (-(2**63), 11)])
def test_backward_rejects_argmax_out_of_range_and_writes_nothing(value, position):
    x, rois = good_call()
    argmax = np.zeros((2, 3, 2, 2), dtype=np.int64)
    argmax.flat[position] = value
    grad_input = filled(x.shape, np.float64)
    with pytest.raises(ValueError, match=re.escape(
            f"roi_pool_backward_impl: argmax holds {value} at flat index {position}; entries "
            f"must be -1 or in [0, 25) (H * W of grad_input)")):
        mmdispatch.roi_pool_backward_impl(np.ones((2, 3, 2, 2)), rois, argmax, grad_input, 2,
                                          2, 1.0, 0)
    assert np.all(grad_input == 7)


def test_backward_accepts_argmax_bounds_minus_one_and_last_cell():
    x, rois = good_call()
    argmax = np.full((2, 3, 2, 2), -1, dtype=np.int64)
    argmax[1, 2, 1, 1] = 24
    grad = roi_pool_backward(np.ones((2, 3, 2, 2)), rois, argmax, x.shape)
    assert grad.sum() == 1.0 and grad[1, 2, 4, 4] == 1.0


# --- bad arguments ------------------------------------------------------------

def ones_grad(dtype=np.float64):
    return np.ones((2, 3, 2, 2), dtype=dtype)


def zero_argmax():
    return np.zeros((2, 3, 2, 2), dtype=np.int64)


@pytest.mark.parametrize("call, error, message", [
    (lambda x, r: roi_pool(x[0], r, 2), ValueError,
     "roi_pool_forward: input must be 4-D (N, C, H, W), got shape (3, 5, 5)"),
    (lambda x, r: roi_pool(x, r[:, :4], 2), ValueError,
     "roi_pool_forward_impl: rois must have shape (*, 5), got (2, 4)"),
    (lambda x, r: roi_pool(x, r[0], 2), ValueError,
     "roi_pool_forward: rois must be 2-D (K, 5), got shape (5,)"),
    (lambda x, r: roi_pool(x.astype(np.float32), r, 2), TypeError,
     "roi_pool_forward_impl: rois has dtype float64 but input has dtype float32"),
    (lambda x, r: roi_pool(x.astype(np.float16), r.astype(np.float16), 2), TypeError,
     "roi_pool_forward_impl: input has dtype float16 on this device; supported: float32, "
     "float64"),
    (lambda x, r: roi_pool(x.astype(np.int64), r.astype(np.int64), 2), TypeError,
     "roi_pool_forward_impl: input has dtype int64 on this device; supported: float32, "
     "float64"),
    (lambda x, r: roi_pool(x.tolist(), r, 2), TypeError,
     "roi_pool_forward: input must be an array"),
    (lambda x, r: roi_pool(x, r.tolist(), 2), TypeError,
     "roi_pool_forward: rois must be an array"),
    (lambda x, r: roi_pool(x, r, 0), ValueError, "roi_pool_forward: output_size must be >= 1"),
    (lambda x, r: roi_pool(x, r, (2, 0)), ValueError,
     "roi_pool_forward: output_size must be >= 1, got (2, 0)"),
    (lambda x, r: roi_pool(x, r, "7"), TypeError,
     "roi_pool_forward: output_size must be an int or a pair of ints, got '7'"),
    (lambda x, r: roi_pool(x, r, 2, float("nan")), ValueError,
     "roi_pool_forward_impl: spatial_scale must be finite and > 0, got nan"),
    (lambda x, r: roi_pool(x, r, 2, 0), ValueError,
     "roi_pool_forward_impl: spatial_scale must be finite and > 0, got 0"),
    (lambda x, r: roi_pool(x, r, 2, -1.0), ValueError,
     "roi_pool_forward_impl: spatial_scale must be finite and > 0, got -1"),
    (lambda x, r: roi_pool(x, r, 2, float("inf")), ValueError,
     "roi_pool_forward_impl: spatial_scale must be finite and > 0, got inf"),
    (lambda x, r: roi_pool(x, r, 2, "1"), TypeError,
     "roi_pool_forward_impl: at param 6 (spatial_scale), expected a real number, got str"),
    (lambda x, r: roi_pool_backward(ones_grad(), r, zero_argmax(), (2, 3, 5)), ValueError,
     "roi_pool_backward: input_shape must be 4 non-negative ints (N, C, H, W), got (2, 3, 5)"),
    (lambda x, r: roi_pool_backward(ones_grad(), r, zero_argmax(), (2, 3, -5, 5)), ValueError,
     "roi_pool_backward: input_shape must be 4 non-negative ints"),
    (lambda x, r: roi_pool_backward(ones_grad(), r, zero_argmax(), 5), TypeError,
     "roi_pool_backward: input_shape must be a sequence of 4 ints (N, C, H, W), got 5"),
    (lambda x, r: roi_pool_backward(ones_grad(), r, zero_argmax().astype(float), x.shape),
     TypeError, "roi_pool_backward: argmax must have an integer dtype, got float64"),
    (lambda x, r: roi_pool_backward(ones_grad(), r, None, x.shape), TypeError,
     "roi_pool_backward: argmax must be an array"),
    (lambda x, r: roi_pool_backward(ones_grad(), r, zero_argmax()[:, :, :1], x.shape),
     ValueError, "roi_pool_backward_impl: argmax must have shape (2, 3, 2, 2), got (2, 3, 1, 2)"),
    (lambda x, r: roi_pool_backward(ones_grad()[:1], r, zero_argmax(), x.shape), ValueError,
     "roi_pool_backward_impl: grad_output must have shape (2, 3, 2, 2), got (1, 3, 2, 2)"),
    (lambda x, r: roi_pool_backward(ones_grad()[0], r, zero_argmax(), x.shape), ValueError,
     "roi_pool_backward: grad_output must be 4-D (K, C, out_h, out_w), got shape (3, 2, 2)"),
    (lambda x, r: roi_pool_backward(ones_grad(), r, zero_argmax(), (2, 4, 5, 5)), ValueError,
     "roi_pool_backward_impl: grad_output must have shape (2, 4, 2, 2), got (2, 3, 2, 2)"),
    (lambda x, r: roi_pool_backward(ones_grad(np.float32), r, zero_argmax(), x.shape),
     TypeError, "roi_pool_backward_impl: rois has dtype float64"),
    (lambda x, r: roi_pool_backward(ones_grad(np.float16), r.astype(np.float16), zero_argmax(),
                                    x.shape), TypeError,
     "roi_pool_backward_impl: grad_output has dtype float16 on this device; supported: float32, "
     "float64"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    x, rois = good_call()
    with pytest.raises(error, match=re.escape(message)):
        call(x, rois)


def impl_arrays(dtype=np.float64):
    x, rois = good_call(dtype)
    return x, rois, filled((2, 3, 2, 2), dtype), filled((2, 3, 2, 2), np.int64)


def test_impl_rejects_bad_pooled_size_and_wrong_output_arrays():
    x, rois, out, argmax = impl_arrays()
    cases = [
        (lambda: mmdispatch.roi_pool_forward_impl(x, rois, out, argmax, 0, 2, 1.0, 0), ValueError,
         "roi_pool_forward_impl: pooled_height and pooled_width must be >= 1, got 0 and 2"),
        (lambda: mmdispatch.roi_pool_forward_impl(x, rois, out, argmax, 2, 1, 1.0, 0), ValueError,
         "roi_pool_forward_impl: output must have shape (2, 3, 2, 1), got (2, 3, 2, 2)"),
        (lambda: mmdispatch.roi_pool_backward_impl(out, rois, argmax, x.copy(), 2, -1, 1.0, 0),
         ValueError, "roi_pool_backward_impl: pooled_height and pooled_width must be >= 1, got "
                     "2 and -1"),
        (lambda: mmdispatch.roi_pool_forward_impl(x, rois, out.astype(np.float32), argmax, 2, 2,
                                                  1.0, 0), TypeError,
         "roi_pool_forward_impl: output has dtype float32 but input has dtype float64"),
        (lambda: mmdispatch.roi_pool_forward_impl(x, rois, out, argmax.astype(np.int32), 2, 2,
                                                  1.0, 0), TypeError,
         "roi_pool_forward_impl: argmax has dtype int32 on this device; supported: int64"),
        (lambda: mmdispatch.roi_pool_forward_impl(x, rois, np.full((2, 3, 2, 4), 7.0)[..., ::2],
                                                  argmax, 2, 2, 1.0, 0), ValueError,
         "roi_pool_forward_impl: output must be C-contiguous"),
        (lambda: mmdispatch.roi_pool_backward_impl(out, rois, argmax, np.zeros((2, 3, 5)), 2, 2,
                                                   1.0, 0), ValueError,
         "roi_pool_backward_impl: grad_input must have shape (*, *, *, *), got (2, 3, 5)"),
        (lambda: mmdispatch.roi_pool_forward_impl(x.tolist(), rois, out, argmax, 2, 2, 1.0, 0),
         TypeError, "roi_pool_forward_impl: at param 0 (input), expected an array"),
        # an output left to the entry point to allocate: the other one is still checked
        (lambda: mmdispatch.roi_pool_forward_impl(x, rois, None, argmax.astype(np.int32), 2, 2,
                                                  1.0, 0), TypeError,
         "roi_pool_forward_impl: argmax has dtype int32 on this device; supported: int64"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()
    assert np.all(out == 7) and np.all(argmax == 7)


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_impl_rejects_read_only_outputs():
    x, rois, out, argmax = impl_arrays()
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_forward_impl: at param 2 (output), output array is read-only")):
        mmdispatch.roi_pool_forward_impl(x, rois, readonly(out), argmax, 2, 2, 1.0, 0)
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_forward_impl: at param 3 (argmax), output array is read-only")):
        mmdispatch.roi_pool_forward_impl(x, rois, out, readonly(argmax), 2, 2, 1.0, 0)
    grad_input = readonly(filled(x.shape, np.float64))
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_backward_impl: at param 3 (grad_input), output array is read-only")):
        mmdispatch.roi_pool_backward_impl(ones_grad(), rois, zero_argmax(), grad_input, 2, 2,
                                          1.0, 0)
    assert np.all(out == 7) and np.all(argmax == 7) and np.all(grad_input == 7)


def test_impl_rejects_outputs_that_alias_inputs():
    x, rois, out, argmax = impl_arrays()
    overlap = "output memory overlaps param {}; outputs must not share memory"
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_forward_impl: at param 2 (output), " + overlap.format("0 (input)"))):
        mmdispatch.roi_pool_forward_impl(x, rois, x[:2, :, :2, :2], argmax, 2, 2, 1.0, 0)
    shared = np.full(48, 7.0)
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_forward_impl: at param 2 (output), " + overlap.format("3 (argmax)"))):
        mmdispatch.roi_pool_forward_impl(x, rois, shared[:24].reshape(2, 3, 2, 2),
                                         shared[:24].view(np.int64).reshape(2, 3, 2, 2), 2, 2,
                                         1.0, 0)
    grad_output = np.full(200, 7.0)
    with pytest.raises(ValueError, match=re.escape(
            "roi_pool_backward_impl: at param 3 (grad_input), " +
            overlap.format("0 (grad_output)"))):
        mmdispatch.roi_pool_backward_impl(grad_output[:24].reshape(2, 3, 2, 2), rois,
                                          zero_argmax(), grad_output[:150].reshape(2, 3, 5, 5),
                                          2, 2, 1.0, 0)
    assert np.all(shared == 7) and np.all(grad_output == 7) and np.all(argmax == 7)


# --- device consistency -------------------------------------------------------

FORWARD_NAMES = ["input", "rois", "output", "argmax"]
BACKWARD_NAMES = ["grad_output", "rois", "argmax", "grad_input"]


def impl_args(backward):
    x, rois, out, argmax = impl_arrays()
    if backward:
        return [ones_grad(), rois, zero_argmax(), filled(x.shape, np.float64)]
    return [x, rois, out, argmax]


@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("position", range(4))
def test_impl_rejects_an_array_on_another_device(backward, position, fake_array):
    names = BACKWARD_NAMES if backward else FORWARD_NAMES
    op = "roi_pool_backward_impl" if backward else "roi_pool_forward_impl"
    impl = getattr(mmdispatch, op)
    args = impl_args(backward)
    fake = fake_array(2, 0)
    args[position] = fake
    if position == 0:   # the reference device is then cuda:0 and param 1 mismatches
        message = f"{op}: at param 1 ({names[1]}), inconsistent device: cpu vs cuda:0"
    else:
        message = f"{op}: at param {position} ({names[position]}), inconsistent device: " \
                  "cuda:0 vs cpu"
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(message)):
        impl(*args, 2, 2, 1.0, 0)
    assert not fake.exported
    outputs = [3] if backward else [2, 3]
    assert all(np.all(args[i] == 7) for i in outputs if i != position)


def test_impl_names_the_device_index_of_a_mismatch(fake_array):
    x, rois, out, argmax = impl_arrays()
    fake = fake_array(2, 1)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "roi_pool_forward_impl: at param 3 (argmax), inconsistent device: cuda:1 vs cpu")):
        mmdispatch.roi_pool_forward_impl(x, rois, out, fake, 2, 2, 1.0, 0)
    assert not fake.exported and np.all(out == 7)


@pytest.mark.parametrize("op", ["roi_pool_forward_impl", "roi_pool_backward_impl"])
def test_impl_on_a_device_without_kernels_raises_kernel_not_found(op, fake_array):
    fakes = [fake_array(12, 0) for _ in range(4)]
    with pytest.raises(mmdispatch.KernelNotFoundError, match=re.escape(
            f"{op}: implementation for device ext_dev:0 not found.")):
        getattr(mmdispatch, op)(*fakes, 2, 2, 1.0, 0)
    assert not any(f.exported for f in fakes)


# --- CUDA (runs only where a GPU, CuPy and the CUDA kernels are present) ------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_cuda_matches_cpu_exactly_in_forward_and_closely_in_backward(cupy, seed, dtype):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((2, 8, 20, 24)).astype(dtype)
    scale = [1.0, 0.5, 0.25, 0.3][seed]
    rois = random_rois(rng, 48, 2, 20, 24, scale).astype(dtype)
    out, argmax = roi_pool_forward(x, rois, (4, 3), scale)
    out_gpu, argmax_gpu = roi_pool_forward(cupy.asarray(x), cupy.asarray(rois), (4, 3), scale)
    assert isinstance(out_gpu, cupy.ndarray) and isinstance(argmax_gpu, cupy.ndarray)
    assert out_gpu.dtype == dtype and argmax_gpu.dtype == np.int64
    np.testing.assert_array_equal(cupy.asnumpy(out_gpu), out)
    np.testing.assert_array_equal(cupy.asnumpy(argmax_gpu), argmax)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = roi_pool_backward(grad_out, rois, argmax, x.shape, scale)
    grad_gpu = roi_pool_backward(cupy.asarray(grad_out), cupy.asarray(rois), argmax_gpu,
                                 x.shape, scale)
    assert isinstance(grad_gpu, cupy.ndarray) and grad_gpu.dtype == dtype
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(cupy.asnumpy(grad_gpu), grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16])
@pytest.mark.parametrize("convention", ["torchvision", "mmcv"])
def test_cuda_chunked_forward_matches_cpu_exactly_on_many_rois_and_channels(
        cupy, convention, dtype):
    """300 rois over a 40-channel map whose bins read its cells many times
    over: the forward takes the chunked kernel on a GPU (chunks of 32
    channels, the second partial; 256 rois or more), which the smaller cases
    above do not reach. Maxima and argmax exactly the CPU's (float16 against
    the CPU's float32 on the same values); the backward from that argmax
    too."""
    rng = np.random.default_rng(len(convention))
    x = rng.standard_normal((2, 40, 30, 36)).astype(dtype)
    x[1, 33, 4:12, 5:20:3] = np.nan
    rois = random_rois(rng, 300, 2, 30, 36, 0.5).astype(dtype)
    compute = np.float32 if dtype == np.float16 else dtype
    out, argmax = roi_pool_forward(x.astype(compute), rois.astype(compute), 7, 0.5, convention)
    out_gpu, argmax_gpu = roi_pool_forward(cupy.asarray(x), cupy.asarray(rois), 7, 0.5,
                                           convention)
    np.testing.assert_array_equal(cupy.asnumpy(out_gpu), out.astype(dtype))
    np.testing.assert_array_equal(cupy.asnumpy(argmax_gpu), argmax)
    grad_out = rng.standard_normal(out.shape).astype(compute)
    grad = roi_pool_backward(grad_out, rois.astype(compute), argmax, x.shape, 0.5, convention)
    grad_gpu = roi_pool_backward(cupy.asarray(grad_out), cupy.asarray(rois.astype(compute)),
                                 argmax_gpu, x.shape, 0.5, convention)
    tol = 1e-4 if compute == np.float32 else 1e-10
    np.testing.assert_allclose(cupy.asnumpy(grad_gpu), grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_mmcv_published_values_and_nan_handling(cupy, dtype):
    for case in MMCV_CASES:
        x, rois, expected, expected_grad = (np.array(a, dtype=dtype) for a in case)
        out, argmax = roi_pool_forward(cupy.asarray(x), cupy.asarray(rois), 2)
        grad = roi_pool_backward(cupy.ones_like(out), cupy.asarray(rois), argmax, x.shape)
        np.testing.assert_array_equal(cupy.asnumpy(out), expected)
        np.testing.assert_array_equal(cupy.asnumpy(grad), expected_grad)
    x = np.arange(16, dtype=dtype).reshape(1, 1, 4, 4)
    x[0, 0, 3, 3] = np.nan
    x[0, 0, :2, :2] = np.nan
    rois = np.array([[0, 0, 0, 3, 3], [0, 9, 9, 12, 12]], dtype=dtype)
    expected, expected_arg = roi_pool_forward(x, rois, 2)
    out, argmax = roi_pool_forward(cupy.asarray(x), cupy.asarray(rois), 2)
    np.testing.assert_array_equal(cupy.asnumpy(out), expected)
    np.testing.assert_array_equal(cupy.asnumpy(argmax), expected_arg)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_bad_rois_and_argmax_raise_and_write_nothing_in_strict_mode(cupy, dtype):
    x, rois = good_call(dtype)
    x, bad = cupy.asarray(x), rois.copy()
    for roi, message in [([0, np.nan, 0, 2, 2], "rois[1] contains NaN or inf"),
                         ([2, 0, 0, 2, 2], "rois[1, 0] (batch index) must be an integer in "
                                           "[0, 2)")]:
        bad[1] = roi
        output = cupy.full((2, 3, 2, 2), 7, dtype=dtype)
        argmax = cupy.full((2, 3, 2, 2), 7, dtype=np.int64)
        with mmdispatch.strict():
            with pytest.raises(ValueError, match=re.escape("roi_pool_forward_impl: " + message)):
                mmdispatch.roi_pool_forward_impl(x, cupy.asarray(bad), output, argmax, 2, 2, 1.0, 0)
        assert bool((output == 7).all()) and bool((argmax == 7).all())
        # by default the bad roi's bins are NaN with argmax -1, the others
        # computed, and the error deferred
        mmdispatch.roi_pool_forward_impl(x, cupy.asarray(bad), output, argmax, 2, 2, 1.0, 0)
        with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
                "roi_pool_forward_impl: " + message)):
            mmdispatch.synchronize()
        assert bool(cupy.isnan(output[1]).all()) and bool((argmax[1] == -1).all())
        assert bool((argmax[0] >= 0).all())
    argmax = cupy.zeros((2, 3, 2, 2), dtype=np.int64)
    argmax[1, 0, 0, 1] = 25
    grad_input = cupy.full(x.shape, 7, dtype=dtype)
    with mmdispatch.strict():
        with pytest.raises(ValueError, match=re.escape(
                "roi_pool_backward_impl: argmax holds 25 at flat index 13")):
            mmdispatch.roi_pool_backward_impl(cupy.ones((2, 3, 2, 2), dtype=dtype),
                                              cupy.asarray(rois), argmax, grad_input, 2, 2, 1.0, 0)
    assert bool((grad_input == 7).all())


def test_cuda_and_cpu_arrays_cannot_be_mixed(cupy):
    x, rois = good_call()
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "roi_pool_forward_impl: at param 1 (rois), inconsistent device: cpu vs cuda:0")):
        roi_pool(cupy.asarray(x), rois, 2)
    out, argmax = roi_pool_forward(cupy.asarray(x), cupy.asarray(rois), 2)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "roi_pool_backward_impl: at param 2 (argmax), inconsistent device: cpu vs cuda:0")):
        roi_pool_backward(cupy.ones_like(out), cupy.asarray(rois), cupy.asnumpy(argmax),
                          x.shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_deterministic_backward_matches_and_repeats_bit_for_bit(cupy, dtype):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 5, 16, 12)).astype(dtype)
    one = random_rois(rng, 8, 2, 16, 12, 1.0)   # the special rois and three more
    rois = np.concatenate([random_rois(rng, 30, 2, 16, 12, 1.0),
                           one[rng.integers(0, 8, 300)]]).astype(dtype)   # crowded
    out, argmax = roi_pool_forward(x, rois, (3, 2))
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    expected = roi_pool_backward(grad_out, rois, argmax, x.shape)
    runs = []
    with mmdispatch.use_backend("cuda", "deterministic"):
        for stream in (cupy.cuda.Stream.null, cupy.cuda.Stream(non_blocking=True)):
            with stream:
                runs.append(cupy.asnumpy(roi_pool_backward(
                    cupy.asarray(grad_out), cupy.asarray(rois), cupy.asarray(argmax), x.shape)))
            stream.synchronize()
    np.testing.assert_array_equal(runs[1], runs[0])
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(runs[0], expected, rtol=tol, atol=tol)


def test_cuda_float16_forward_is_exact_and_backward_close(cupy):
    """float16 (CuPy): maxima are input values, so the forward equals the
    CPU's float32 forward on the same values exactly; the backward adds in
    float16 (as torchvision's does), both backends."""
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 6, 20, 24)).astype(np.float16)
    rois = np.round(random_rois(rng, 40, 2, 20, 24, 0.5) * 4).astype(np.float16) / 4
    out32, argmax32 = roi_pool_forward(x.astype(np.float32), rois.astype(np.float32), (4, 3), 0.5)
    out, argmax = roi_pool_forward(cupy.asarray(x), cupy.asarray(rois), (4, 3), 0.5)
    assert out.dtype == np.float16
    np.testing.assert_array_equal(cupy.asnumpy(out).astype(np.float32), out32)
    np.testing.assert_array_equal(cupy.asnumpy(argmax), argmax32)
    grad_out = rng.standard_normal(out32.shape).astype(np.float16)
    expected = roi_pool_backward(grad_out.astype(np.float32), rois.astype(np.float32), argmax32,
                                 x.shape, 0.5)
    for backend in ("default", "deterministic"):
        with mmdispatch.use_backend("cuda", backend):
            grad = roi_pool_backward(cupy.asarray(grad_out), cupy.asarray(rois), argmax, x.shape,
                                     0.5)
        assert grad.dtype == np.float16
        np.testing.assert_allclose(cupy.asnumpy(grad).astype(np.float32), expected, rtol=1e-2,
                                   atol=2e-2)


def test_cuda_bfloat16_through_torch_forward_and_backward(torch_cuda):
    torch = torch_cuda
    rng = np.random.default_rng(6)
    x = torch.from_numpy(rng.standard_normal((1, 4, 16, 16)).astype(np.float32)).bfloat16()
    rois = torch.from_numpy(random_rois(rng, 8, 1, 16, 16, 1.0).astype(np.float32)).bfloat16()
    x32, rois32 = x.float().numpy(), rois.float().numpy()
    out32, argmax32 = roi_pool_forward(x32, rois32, 3)
    out = torch.empty((8, 4, 3, 3), dtype=torch.bfloat16, device="cuda")
    argmax = torch.empty((8, 4, 3, 3), dtype=torch.int64, device="cuda")
    mmdispatch.roi_pool_forward_impl(x.cuda(), rois.cuda(), out, argmax, 3, 3, 1.0, 0)
    np.testing.assert_array_equal(out.float().cpu().numpy(), out32)
    np.testing.assert_array_equal(argmax.cpu().numpy(), argmax32)
    grad = torch.zeros((1, 4, 16, 16), dtype=torch.bfloat16, device="cuda")
    mmdispatch.roi_pool_backward_impl(torch.ones_like(out), rois.cuda(), argmax, grad, 3, 3, 1.0, 0)
    expected = roi_pool_backward(np.ones(out32.shape, np.float32), rois32, argmax32, x32.shape)
    # sums of ones: exact in bfloat16 up to 256
    np.testing.assert_array_equal(grad.float().cpu().numpy(), expected)


# --- properties (tests/support/properties.py) ----------------------------------------------

@st.composite
def forward_case(draw, dtype):
    n, c, h, w, k, out_h, out_w, scale = draw(roi_problem_sizes())
    x = draw(float_arrays((n, c, h, w), dtype))
    rois = draw(rois_for(k, n, h, w, scale, False, dtype))
    pooled = (k, c, out_h, out_w)
    convention = draw(st.sampled_from([0, 1]))
    args = dict(input=guarded(x), rois=guarded(rois), output=guarded(sentinel(pooled, dtype)),
                argmax=guarded(sentinel(pooled, np.int64)), pooled_height=out_h,
                pooled_width=out_w, spatial_scale=scale, convention=convention)

    def check(a):
        out, arg = ref_forward(x, rois, out_h, out_w, scale, convention)
        assert_close(a["output"], out, dtype)
        np.testing.assert_array_equal(a["argmax"], arg)
    return args, check


@st.composite
def backward_case(draw, dtype):
    n, c, h, w, k, out_h, out_w, scale = draw(roi_problem_sizes())
    rois = draw(rois_for(k, n, h, w, scale, False, dtype))
    pooled = (k, c, out_h, out_w)
    grad_out = draw(float_arrays(pooled, dtype))
    argmax = np.array(draw(st.lists(st.integers(-1, h * w - 1), min_size=int(np.prod(pooled)),
                                    max_size=int(np.prod(pooled)))), np.int64).reshape(pooled)
    args = dict(grad_output=guarded(grad_out), rois=guarded(rois), argmax=guarded(argmax),
                grad_input=guarded(np.zeros((n, c, h, w), dtype)), pooled_height=out_h,
                pooled_width=out_w, spatial_scale=scale, convention=draw(st.sampled_from([0, 1])))

    def check(a):
        assert_close(a["grad_input"], ref_backward(grad_out, rois, argmax, (n, c, h, w)), dtype)
    return args, check


def forward_user_case(draw, name, dtype, layout):
    a, check = draw(forward_case(dtype))
    inputs = dict(input=layout(a["input"]), rois=layout(a["rois"]))

    def run():
        return getattr(roi_pool_module, name)(inputs["input"], inputs["rois"],
                                              (a["pooled_height"], a["pooled_width"]),
                                              a["spatial_scale"], NAMES[a["convention"]])

    def verify(result):
        if name == "roi_pool":
            out, _ = ref_forward(a["input"], a["rois"], a["pooled_height"], a["pooled_width"],
                                 a["spatial_scale"], a["convention"])
            assert_close(result, out, dtype)
            return
        check(dict(a, output=result[0], argmax=result[1]))
    return run, inputs, verify


def backward_user_case(draw, name, dtype, layout):
    a, check = draw(backward_case(dtype))
    # argmax may have any integer dtype: the op converts it to int64
    argmax = a["argmax"].astype(draw(st.sampled_from([np.int64, np.int32, np.int16])))
    inputs = dict(grad_output=layout(a["grad_output"]), rois=layout(a["rois"]),
                  argmax=layout(argmax))

    def run():
        return roi_pool_backward(inputs["grad_output"], inputs["rois"], inputs["argmax"],
                                 a["grad_input"].shape, a["spatial_scale"],
                                 NAMES[a["convention"]])
    return run, inputs, lambda result: check(dict(a, grad_input=result))


def torch_forward_calls(torch, device):
    x, rois = torch_map_and_rois(torch, device)
    return [(x, rois, 2, 2, 1.0, 0), (x, rois, 3, 1, 0.5, 1)]


def torch_backward_calls(torch, device):
    x, rois = torch_map_and_rois(torch, device)
    _, argmax = torch.ops.mmdispatch.roi_pool_forward(x.detach(), rois, 2, 2, 1.0, 0)
    grad = torch.randn(3, 3, 2, 2, dtype=torch.float64, device=device)
    return [(grad, rois, argmax, tuple(x.shape), torch.float64, 2, 2, 1.0, 0)]


class TestProperties(OpProperties):
    module = roi_pool_module
    torch_calls = {"roi_pool_forward_impl": torch_forward_calls,
                   "roi_pool_backward_impl": torch_backward_calls}
    entry_cases = {"roi_pool_forward_impl": forward_case, "roi_pool_backward_impl": backward_case}
    fixed_axes = {
        "roi_pool_forward_impl": {"rois": [1], "output": [0, 1, 2, 3], "argmax": [0, 1, 2, 3]},
        "roi_pool_backward_impl": {"rois": [1], "grad_output": [0, 1, 2, 3],
                                   "argmax": [0, 1, 2, 3], "grad_input": [1]},
    }
    bad_scalars = {"pooled_height": [0, -1, 2 ** 40], "pooled_width": [0, -7, 99],
                   "spatial_scale": [0.0, -1.0, math.nan, math.inf, -math.inf]}
    user_cases = {"roi_pool": forward_user_case, "roi_pool_forward": forward_user_case,
                  "roi_pool_backward": backward_user_case}
    good_user_args = {
        "roi_pool": lambda: [*small_map_and_rois(), (2, 2), 1.0],
        "roi_pool_forward": lambda: [*small_map_and_rois(), (2, 2), 1.0],
        "roi_pool_backward": lambda: [np.ones((2, 3, 2, 2)), small_map_and_rois()[1],
                                      np.zeros((2, 3, 2, 2), np.int64), (2, 3, 4, 5), 1.0],
    }
    user_bad_values = {
        ("roi_pool", 2): [0, -1, (2, 0), 2.5, "2", (1, 2, 3), None, (2 ** 40, 2 ** 40),
                          (2 ** 64, 2), (2 ** 62, 2 ** 62), (2 ** 22, 2 ** 22)],
        ("roi_pool_forward", 2): [0, (2 ** 63, 1), (2 ** 31, 2 ** 31)],
        ("roi_pool_backward", 3): [(2, 3, 4), (2, -3, 4, 5), "abcd", None, (2 ** 64, 3, 4, 5),
                                   (2 ** 40, 3, 2 ** 40, 5)],
        ("roi_pool_backward", 2): [np.zeros((2, 3, 2, 2)),
                                   np.full((2, 3, 2, 2), 20, np.int64)],
    }

    def bad_data(self, draw, op_name, args):
        backward = op_name == "roi_pool_backward_impl"
        if not backward or draw(st.booleans()):
            return bad_rois(draw, args, args["grad_input" if backward else "input"].shape[0])
        assume(args["argmax"].size > 0)
        argmax = args["argmax"].copy()
        plane = args["grad_input"].shape[2] * args["grad_input"].shape[3]
        argmax.reshape(-1)[draw(st.integers(0, argmax.size - 1))] = draw(st.sampled_from(
            [-2, plane, plane + 10, 2 ** 62, -2 ** 63]))
        return dict(args, argmax=guarded(argmax)), "data: argmax out of range"


# Output shapes whose size overflows int64 (or memory): the op's own error,
# never a wrapped size.
HUGE_OUTPUT_CALLS = [
    (lambda x, r: roi_pool(x, r, (2 ** 40, 2 ** 40)), ValueError),
    (lambda x, r: roi_pool(x, r, (2 ** 31, 2 ** 31)), ValueError),
    (lambda x, r: roi_pool(x, r, (2 ** 64, 1)), ValueError),
    (lambda x, r: roi_pool(x, r, (2 ** 22, 2 ** 22)), MemoryError),
    (lambda x, r: roi_pool_backward(np.ones((2, 3, 1, 1)), r, np.zeros((2, 3, 1, 1), np.int64),
                                    (2 ** 40, 3, 2 ** 40, 5)), ValueError),
    (lambda x, r: roi_pool_backward(np.ones((2, 3, 1, 1)), r, np.zeros((2, 3, 1, 1), np.int64),
                                    (0, 3, 2 ** 62, 2 ** 62)), ValueError),
]


@pytest.mark.parametrize("call, error", HUGE_OUTPUT_CALLS)
def test_output_sizes_beyond_int64_or_memory_are_refused_naming_the_op(call, error):
    with pytest.raises(error, match=r"^roi_pool_(forward|backward)(_impl)?: "):
        call(*small_map_and_rois())
