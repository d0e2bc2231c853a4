"""bbox_overlaps (MMCV semantics): a slow loop reference, published values,
degenerate and NaN boxes, output properties, device consistency, bad input,
and CPU/CUDA agreement."""
import importlib
import re

import numpy as np
import pytest

from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import bbox_overlaps
from properties import OpProperties, boxes_for, guarded, sentinel
from references import ref_overlap

bbox_overlaps_module = importlib.import_module("mmdispatch.ops.bbox_overlaps")

# MMCV's tests/test_ops/test_bbox.py, offset=1
MMCV_B1 = np.array([[1.0, 1.0, 3.0, 4.0], [2.0, 2.0, 3.0, 4.0], [7.0, 7.0, 8.0, 8.0]])
MMCV_B2 = np.array([[0.0, 2.0, 2.0, 5.0], [2.0, 1.0, 3.0, 3.0]])
MMCV_IOU = [[0.33333334, 0.5], [0.2, 0.5], [0.0, 0.0]]
# by hand, offset 1: areas b1 = 12, 6, 4; b2 = 12, 6; intersections
# [[6, 6], [3, 4], [0, 0]]
MMCV_IOF = [[0.5, 0.5], [0.5, 4 / 6], [0.0, 0.0]]
DTYPES = [np.float32, np.float64]
TOL = {np.float32: dict(rtol=1e-6, atol=1e-7), np.float64: dict(rtol=1e-14, atol=1e-15)}


# --- slow reference ----------------------------------------------------------------

def ref_bbox_overlaps(b1, b2, mode="iou", aligned=False, offset=0):
    dtype = b1.dtype
    if aligned:
        return np.array([ref_overlap(b1[i], b2[i], mode, offset, dtype)
                         for i in range(len(b1))], dtype=dtype)
    out = np.zeros((len(b1), len(b2)), dtype=dtype)
    for i in range(len(b1)):
        for j in range(len(b2)):
            out[i, j] = ref_overlap(b1[i], b2[j], mode, offset, dtype)
    return out


def vectorised_reference(b1, b2, mode, offset):
    """The same formula with numpy arrays (same dtype, same order of
    operations), for inputs too large for the loop reference; finite boxes."""
    t = b1.dtype.type
    off = t(offset)
    a, b = b1[:, None, :], b2[None, :, :]
    w = np.maximum(np.minimum(a[..., 2], b[..., 2]) - np.maximum(a[..., 0], b[..., 0]) + off,
                   t(0))
    h = np.maximum(np.minimum(a[..., 3], b[..., 3]) - np.maximum(a[..., 1], b[..., 1]) + off,
                   t(0))
    inter = w * h
    area_a = (a[..., 2] - a[..., 0] + off) * (a[..., 3] - a[..., 1] + off)
    area_b = (b[..., 2] - b[..., 0] + off) * (b[..., 3] - b[..., 1] + off)
    base = area_a if mode == "iof" else area_a + area_b - inter
    with np.errstate(all="ignore"):
        return np.where(base <= 0, t(0), inter / base).astype(b1.dtype)


def random_boxes(rng, n, kind):
    """Integer-valued, half-integer or continuous boxes, some zero-sized,
    some inverted (x2 < x1 or y2 < y1), some duplicated."""
    if kind == 0:
        xy = rng.integers(-5, 10, (n, 2)).astype(np.float64)
        wh = rng.integers(0, 6, (n, 2)).astype(np.float64)
    elif kind == 1:
        xy = rng.integers(-10, 20, (n, 2)) / 2.0
        wh = rng.integers(-2, 10, (n, 2)) / 2.0
    else:
        xy = rng.uniform(-10, 10, (n, 2))
        wh = rng.uniform(-1, 8, (n, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1)
    if n > 2:
        boxes[-1] = boxes[0]
    return boxes


CASES = [(seed, mode) for seed in range(24) for mode in ("iou", "iof")]


# --- against the slow reference ------------------------------------------------------

@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed, mode", CASES)
def test_matches_slow_reference(seed, mode, dtype, offset):
    rng = np.random.default_rng(seed)
    n, m = int(rng.integers(0, 12)), int(rng.integers(0, 12))
    b1 = random_boxes(rng, n, seed % 3).astype(dtype)
    b2 = random_boxes(rng, m, (seed + 1) % 3).astype(dtype)
    if n and m:
        b2[0] = b1[0]                                          # an exact duplicate pair
    out = bbox_overlaps(b1, b2, mode, False, offset)
    assert out.dtype == dtype and out.shape == (n, m)
    np.testing.assert_allclose(out, ref_bbox_overlaps(b1, b2, mode, False, offset),
                               **TOL[dtype])
    b2 = random_boxes(rng, n, seed % 3).astype(dtype)
    out = bbox_overlaps(b1, b2, mode, True, offset)
    assert out.dtype == dtype and out.shape == (n,)
    np.testing.assert_allclose(out, ref_bbox_overlaps(b1, b2, mode, True, offset), **TOL[dtype])


def test_vectorised_reference_agrees_with_the_loop_reference():
    rng = np.random.default_rng(5)
    b1, b2 = random_boxes(rng, 15, 2), random_boxes(rng, 11, 0)
    for dtype in DTYPES:
        for mode in ("iou", "iof"):
            np.testing.assert_array_equal(
                vectorised_reference(b1.astype(dtype), b2.astype(dtype), mode, 1),
                ref_bbox_overlaps(b1.astype(dtype), b2.astype(dtype), mode, False, 1))


@pytest.mark.parametrize("mode", ["iou", "iof"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_multithreaded_case_matches_reference(mode, dtype):
    rng = np.random.default_rng(11)
    b1 = random_boxes(rng, 300, 2).astype(dtype)
    b2 = random_boxes(rng, 250, 1).astype(dtype)
    out = bbox_overlaps(b1, b2, mode, offset=1)
    np.testing.assert_allclose(out, vectorised_reference(b1, b2, mode, 1), **TOL[dtype])
    # every row equals the row computed on its own (below the threading cut-off)
    for i in (0, 137, 299):
        np.testing.assert_array_equal(out[i], bbox_overlaps(b1[i:i + 1], b2, mode, offset=1)[0])


@pytest.mark.parametrize("dtype", DTYPES)
def test_aligned_equals_the_diagonal_of_the_full_matrix(dtype, rng):
    b1 = random_boxes(rng, 40, 2).astype(dtype)
    b2 = random_boxes(rng, 40, 2).astype(dtype)
    for mode in ("iou", "iof"):
        for offset in (0, 1):
            np.testing.assert_array_equal(bbox_overlaps(b1, b2, mode, True, offset),
                                          np.diag(bbox_overlaps(b1, b2, mode, False, offset)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_iou_is_symmetric_and_at_most_one(dtype, rng):
    b1 = random_boxes(rng, 30, 2).astype(dtype)
    b2 = random_boxes(rng, 20, 0).astype(dtype)
    for offset in (0, 1):
        out = bbox_overlaps(b1, b2, offset=offset)
        np.testing.assert_array_equal(out, bbox_overlaps(b2, b1, offset=offset).T)
        valid = (b1[:, 2] >= b1[:, 0]) & (b1[:, 3] >= b1[:, 1])
        assert np.all(out[valid] <= 1) and np.all(out >= 0)


# --- published values ----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_mmcv_published_values(dtype):
    b1, b2 = MMCV_B1.astype(dtype), MMCV_B2.astype(dtype)
    out = bbox_overlaps(b1, b2, offset=1)
    assert out.dtype == dtype
    np.testing.assert_allclose(out, MMCV_IOU, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(bbox_overlaps(b1, b2, "iof", offset=1), MMCV_IOF, rtol=1e-6,
                               atol=1e-7)
    np.testing.assert_allclose(bbox_overlaps(b1[:2], b2, aligned=True, offset=1), [1 / 3, 0.5],
                               rtol=1e-6)
    np.testing.assert_allclose(bbox_overlaps(b1[:2], b2, "iof", aligned=True, offset=1),
                               [0.5, 4 / 6], rtol=1e-6)
    np.testing.assert_allclose(bbox_overlaps(b1[1:], b2[::-1], aligned=True, offset=1),
                               [0.5, 0.0], rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hand_computed_values_with_offset_zero(dtype):
    # b1[0] = [1, 1, 3, 4] area 6; b2[0] = [0, 2, 2, 5] area 6; inter 1 x 2 = 2
    # b1[1] = [2, 2, 3, 4] area 2; b2[1] = [2, 1, 3, 3] area 2; inter 1 x 1 = 1
    b1, b2 = MMCV_B1.astype(dtype), MMCV_B2.astype(dtype)
    np.testing.assert_allclose(bbox_overlaps(b1, b2),
                               [[2 / 10, 2 / 6], [0, 1 / 3], [0, 0]], rtol=1e-6)
    np.testing.assert_allclose(bbox_overlaps(b1, b2, "iof"),
                               [[2 / 6, 2 / 6], [0, 1 / 2], [0, 0]], rtol=1e-6)


# --- degenerate boxes and NaN ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["iou", "iof"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_union_or_area_gives_zero_not_nan(mode, dtype):
    point = np.array([[3, 3, 3, 3]], dtype=dtype)
    line = np.array([[0, 0, 5, 0]], dtype=dtype)
    inverted = np.array([[2, 0, 0, 1]], dtype=dtype)             # negative area
    for a in (point, line, inverted):
        for b in (point, line, inverted):
            with np.errstate(all="raise"):
                out = bbox_overlaps(a, b, mode)
            assert out.tolist() == [[0.0]]
            assert bbox_overlaps(a, b, mode, aligned=True).tolist() == [0.0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_area_boxes_with_offset_one_are_single_pixels(dtype):
    point = np.array([[3, 3, 3, 3]], dtype=dtype)
    big = np.array([[0, 0, 9, 9]], dtype=dtype)                   # 10 x 10 pixels
    assert bbox_overlaps(point, point, offset=1).tolist() == [[1.0]]
    np.testing.assert_allclose(bbox_overlaps(point, big, offset=1), [[0.01]], rtol=1e-6)
    assert bbox_overlaps(point, big, "iof", offset=1).tolist() == [[1.0]]
    # a zero-area point inside a box, offset 0: no intersection, no area
    assert bbox_overlaps(point, big, "iof").tolist() == [[0.0]]
    assert bbox_overlaps(point, big).tolist() == [[0.0]]


@pytest.mark.parametrize("dtype", DTYPES)
def test_touching_boxes_overlap_only_with_offset_one(dtype):
    a = np.array([[0, 0, 2, 2]], dtype=dtype)
    b = np.array([[2, 0, 4, 2]], dtype=dtype)
    assert bbox_overlaps(a, b).tolist() == [[0.0]]
    # offset 1: 3x3 pixels each, sharing the column x = 2: 3 / (9 + 9 - 3)
    np.testing.assert_allclose(bbox_overlaps(a, b, offset=1), [[3 / 15]], rtol=1e-6)


@pytest.mark.parametrize("mode", ["iou", "iof"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("side", ["bboxes1", "bboxes2"])
@pytest.mark.parametrize("column", range(4))
def test_nan_coordinates_give_nan(column, side, dtype, mode):
    """MMCV computes with torch.max / torch.min / clamp, which propagate NaN,
    so a NaN coordinate in either box makes the overlap NaN (iof included)."""
    b1 = np.array([[0, 0, 4, 4], [1, 1, 3, 3]], dtype=dtype)
    b2 = np.array([[0, 0, 4, 4], [2, 2, 6, 6]], dtype=dtype)
    (b1 if side == "bboxes1" else b2)[0, column] = np.nan
    out = bbox_overlaps(b1, b2, mode)
    nan_expected = np.zeros((2, 2), dtype=bool)
    if side == "bboxes1":
        nan_expected[0, :] = True
    else:
        nan_expected[:, 0] = True
    assert np.array_equal(np.isnan(out), nan_expected), out
    finite = ref_bbox_overlaps(b1, b2, mode)
    np.testing.assert_allclose(out[~nan_expected], finite[~nan_expected], **TOL[dtype])
    aligned = bbox_overlaps(b1, b2, mode, aligned=True)
    assert np.isnan(aligned[0]) and not np.isnan(aligned[1])


# --- output properties ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_result_is_a_fresh_array_of_the_input_dtype_and_inputs_are_untouched(dtype, rng):
    b1 = random_boxes(rng, 7, 2).astype(dtype)
    b2 = random_boxes(rng, 5, 1).astype(dtype)
    c1, c2 = b1.copy(), b2.copy()
    for out in (bbox_overlaps(b1, b2), bbox_overlaps(b1, b2[:5].copy(), "iof"),
                bbox_overlaps(b1[:5], b2, aligned=True)):
        assert isinstance(out, np.ndarray) and out.dtype == dtype
        assert out.flags.c_contiguous and out.flags.writeable
        assert not np.shares_memory(out, b1) and not np.shares_memory(out, b2)
    np.testing.assert_array_equal(b1, c1)
    np.testing.assert_array_equal(b2, c2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_inputs_give_empty_results(dtype):
    none, three = np.zeros((0, 4), dtype=dtype), np.ones((3, 4), dtype=dtype)
    assert bbox_overlaps(none, three).shape == (0, 3)
    assert bbox_overlaps(three, none, "iof").shape == (3, 0)
    assert bbox_overlaps(none, none).shape == (0, 0)
    out = bbox_overlaps(none, none, aligned=True)
    assert out.shape == (0,) and out.dtype == dtype


# --- layouts and foreign arrays --------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_give_the_same_result_as_contiguous_copies(dtype, rng):
    b1 = random_boxes(rng, 9, 2).astype(dtype)
    b2 = random_boxes(rng, 9, 0).astype(dtype)
    wide = np.zeros((18, 8), dtype=dtype)
    wide[::2, 1::2] = b1
    strided = wide[::2, 1::2]
    assert not strided.flags.c_contiguous
    # contiguous numpy boxes take the op's fast path, strided ones the general path
    for mode in ("iou", "iof"):
        for offset in (0, 1):
            np.testing.assert_array_equal(bbox_overlaps(strided, b2[::-1], mode, False, offset),
                                          bbox_overlaps(b1, b2[::-1].copy(), mode, False, offset))
            np.testing.assert_array_equal(
                bbox_overlaps(np.asfortranarray(b1), strided, mode, True, offset),
                bbox_overlaps(b1, b1, mode, True, offset))


def test_dlpack_only_inputs_work(dlpack_only, rng):
    b1 = random_boxes(rng, 6, 2)
    b2 = random_boxes(rng, 4, 1)
    out = bbox_overlaps(dlpack_only(b1), dlpack_only(b2), "iof", offset=1)
    np.testing.assert_array_equal(np.asarray(out), bbox_overlaps(b1, b2, "iof", offset=1))


# --- device consistency --------------------------------------------------------------------

def impl_args():
    return [MMCV_B1.copy(), MMCV_B2.copy(), np.full((3, 2), 7.0)]


@pytest.mark.parametrize("position", range(3))
def test_impl_reports_a_foreign_device_array_at_any_position(position, fake_array):
    args = impl_args()
    args[position] = stand_in = fake_array(2, 0)
    names = ["bboxes1", "bboxes2", "ious"]
    where = max(position, 1)
    expected = (f"bbox_overlaps_impl: at param {where} ({names[where]}), inconsistent device: "
                + ("cpu vs cuda:0" if position == 0 else "cuda:0 vs cpu"))
    with pytest.raises(mmdispatch.DeviceMismatchError) as info:
        mmdispatch.bbox_overlaps_impl(*args, 0, False, 1)
    assert str(info.value) == expected
    assert not stand_in.exported
    if position != 2:
        assert np.all(args[2] == 7.0)


def test_impl_without_a_kernel_for_the_device_raises_kernel_not_found(fake_array):
    arrays = [fake_array(7, 0) for _ in range(3)]
    with pytest.raises(mmdispatch.KernelNotFoundError, match=re.escape(
            "bbox_overlaps_impl: implementation for device vulkan:0 not found.")):
        mmdispatch.bbox_overlaps_impl(*arrays, 0, False, 0)
    assert not any(a.exported for a in arrays)


def shaped_stand_in(fake_array, shape):
    class Shaped(fake_array):
        pass
    stand_in = Shaped(2, 0)
    stand_in.shape, stand_in.ndim, stand_in.dtype = shape, len(shape), np.dtype(np.float64)
    return stand_in


def test_op_reports_foreign_device_bboxes2(fake_array):
    stand_in = shaped_stand_in(fake_array, (2, 4))
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "bbox_overlaps_impl: at param 1 (bboxes2), inconsistent device: cuda:0 vs cpu")):
        bbox_overlaps(MMCV_B1, stand_in)
    assert not stand_in.exported


@pytest.mark.parametrize("first", [True, False], ids=["bboxes1", "bboxes2"])
@pytest.mark.parametrize("shaped", [True, False], ids=["shaped", "bare"])
def test_op_rejects_foreign_device_arrays_with_an_error_naming_the_op(first, shaped,
                                                                      fake_array):
    stand_in = shaped_stand_in(fake_array, (2, 4)) if shaped else fake_array(2, 0)
    args = (stand_in, MMCV_B2) if first else (MMCV_B1, stand_in)
    with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
        bbox_overlaps(*args)
    assert re.match(r"bbox_overlaps(_impl)?: ", str(info.value)), str(info.value)
    assert not stand_in.exported


# --- bad input ----------------------------------------------------------------------------

B = MMCV_B1
C = MMCV_B2
ANY_ARRAY = ("must be an array (numpy, CuPy, or one with __dlpack__ or "
             "__cuda_array_interface__), got ")


@pytest.mark.parametrize("call, error, message", [
    (lambda: bbox_overlaps(B, C, "IoU"), ValueError,
     re.escape("bbox_overlaps: mode must be one of 'iou', 'iof', got 'IoU'")),
    (lambda: bbox_overlaps(B, C, None), ValueError,
     re.escape("bbox_overlaps: mode must be one of 'iou', 'iof', got None")),
    (lambda: bbox_overlaps(B, C, "giou"), ValueError,
     re.escape("bbox_overlaps: mode must be one of 'iou', 'iof', got 'giou'")),
    (lambda: bbox_overlaps(B, C, aligned=True), ValueError,
     re.escape("bbox_overlaps_impl: aligned=True needs as many bboxes1 as bboxes2, got 3 "
               "and 2")),
    (lambda: bbox_overlaps(np.zeros((0, 4)), C, aligned=True), ValueError,
     re.escape("bbox_overlaps_impl: aligned=True needs as many bboxes1 as bboxes2, got 0 "
               "and 2")),
    (lambda: bbox_overlaps(B, C, aligned=1), TypeError,
     re.escape("bbox_overlaps: aligned must be a bool, got 1")),
    (lambda: bbox_overlaps(B, C, aligned="yes"), TypeError,
     re.escape("bbox_overlaps: aligned must be a bool, got 'yes'")),
    (lambda: bbox_overlaps(B, C, offset=2), ValueError,
     re.escape("bbox_overlaps_impl: offset must be 0 or 1, got 2")),
    (lambda: bbox_overlaps(B, C, offset=-1), ValueError,
     re.escape("bbox_overlaps_impl: offset must be 0 or 1, got -1")),
    (lambda: bbox_overlaps(B, C, offset=0.5), TypeError,
     re.escape("bbox_overlaps_impl: at param 5 (offset), expected an int, got float")),
    (lambda: bbox_overlaps(B[:, :3], C), ValueError,
     re.escape("bbox_overlaps_impl: bboxes1 must have shape (*, 4), got (3, 3)")),
    (lambda: bbox_overlaps(B, np.zeros((2, 5))), ValueError,
     re.escape("bbox_overlaps_impl: bboxes2 must have shape (*, 4), got (2, 5)")),
    (lambda: bbox_overlaps(B[0], C), ValueError,
     re.escape("bbox_overlaps: bboxes1 must be 2-D (N, 4), got shape (4,)")),
    (lambda: bbox_overlaps(B, C[None]), ValueError,
     re.escape("bbox_overlaps: bboxes2 must be 2-D (M, 4), got shape (1, 2, 4)")),
    (lambda: bbox_overlaps(B.astype(np.int64), C.astype(np.int64)), TypeError,
     re.escape("bbox_overlaps_impl: bboxes1 has dtype int64 on this device; supported: "
               "float32, float64")),
    (lambda: bbox_overlaps(B.astype(np.float16), C.astype(np.float16)), TypeError,
     re.escape("bbox_overlaps_impl: bboxes1 has dtype float16 on this device; supported: "
               "float32, float64")),
    (lambda: bbox_overlaps(B.astype(np.float32), C), TypeError,
     re.escape("bbox_overlaps_impl: bboxes2 has dtype float64 but bboxes1 has dtype float32; "
               "they must match")),
    (lambda: bbox_overlaps(B, C.astype(np.int32)), TypeError,
     re.escape("bbox_overlaps_impl: bboxes2 has dtype int32 but bboxes1 has dtype float64")),
    (lambda: bbox_overlaps(B.tolist(), C), TypeError,
     re.escape("bbox_overlaps: bboxes1 " + ANY_ARRAY + "list")),
    (lambda: bbox_overlaps(B, tuple(map(tuple, C))), TypeError,
     re.escape("bbox_overlaps: bboxes2 " + ANY_ARRAY + "tuple")),
    (lambda: bbox_overlaps(B, None), TypeError,
     re.escape("bbox_overlaps: bboxes2 " + ANY_ARRAY + "NoneType")),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_numpy_bool_is_accepted_for_aligned():
    """The dispatcher accepts numpy booleans for bool parameters; the op
    should too (MMCV callers pass tensor-derived flags)."""
    np.testing.assert_array_equal(bbox_overlaps(B[:2], C, aligned=np.True_),
                                  bbox_overlaps(B[:2], C, aligned=True))


def test_impl_rejects_a_read_only_output_and_writes_nothing():
    b1, b2, ious = impl_args()
    ious.flags.writeable = False
    with pytest.raises(ValueError, match=re.escape(
            "bbox_overlaps_impl: at param 2 (ious), output array is read-only")):
        mmdispatch.bbox_overlaps_impl(b1, b2, ious, 0, False, 1)
    assert np.all(ious == 7.0)


@pytest.mark.parametrize("make, message", [
    (lambda b1, b2: (b1, b2, b1.reshape(-1)[:6].reshape(3, 2)),
     "bbox_overlaps_impl: at param 2 (ious), output memory overlaps param 0 (bboxes1)"),
    (lambda b1, b2: (b1, b2, b2.reshape(-1)[2:8].reshape(3, 2)),
     "bbox_overlaps_impl: at param 2 (ious), output memory overlaps param 1 (bboxes2)"),
    (lambda b1, b2: (b1[:2], b2, b1.reshape(-1)[6:10].reshape(2, 2)),
     "bbox_overlaps_impl: at param 2 (ious), output memory overlaps param 0 (bboxes1)"),
])
def test_impl_rejects_an_output_aliasing_an_input(make, message):
    storage1, storage2 = MMCV_B1.copy(), MMCV_B2.copy()
    args = make(storage1, storage2)
    with pytest.raises(ValueError, match=re.escape(message) + ".*outputs must not share memory"):
        mmdispatch.bbox_overlaps_impl(*args, 0, False, 1)
    np.testing.assert_array_equal(storage1, MMCV_B1)
    np.testing.assert_array_equal(storage2, MMCV_B2)


def test_impl_accepts_an_output_adjacent_to_but_not_overlapping_an_input():
    storage = np.concatenate([MMCV_B1[:2].reshape(-1), np.full(4, 7.0)])
    b1, ious = storage[:8].reshape(2, 4), storage[8:].reshape(2, 2)
    mmdispatch.bbox_overlaps_impl(b1, MMCV_B2.copy(), ious, 0, False, 1)
    np.testing.assert_allclose(ious, MMCV_IOU[:2], rtol=1e-6)
    np.testing.assert_array_equal(b1, MMCV_B1[:2])


@pytest.mark.parametrize("ious, mode, aligned, error, message", [
    (np.empty((3, 2)), 2, False, ValueError,
     re.escape("bbox_overlaps_impl: mode must be 0 (iou) or 1 (iof), got 2")),
    (np.empty((3, 2)), -1, False, ValueError,
     re.escape("bbox_overlaps_impl: mode must be 0 (iou) or 1 (iof), got -1")),
    (np.empty((3, 3)), 0, False, ValueError,
     r"bbox_overlaps_impl: ious must have shape \(3, 2\), got \(3, 3\)"),
    (np.empty(3), 0, False, ValueError,
     r"bbox_overlaps_impl: ious must have shape \(3, 2\), got \(3,\)"),
    (np.empty((3, 2), dtype=np.float32), 0, False, TypeError,
     re.escape("bbox_overlaps_impl: ious has dtype float32 but bboxes1 has dtype float64")),
    (np.empty((2, 3)).T, 0, False, ValueError,
     re.escape("bbox_overlaps_impl: ious must be C-contiguous")),
])
def test_impl_validates_mode_and_the_output(ious, mode, aligned, error, message):
    with pytest.raises(error, match=message):
        mmdispatch.bbox_overlaps_impl(MMCV_B1.copy(), MMCV_B2.copy(), ious, mode, aligned, 1)


# --- CUDA (runs only where a GPU, CuPy and the CUDA kernels are present) -----------------

@pytest.mark.parametrize("mode", ["iou", "iof"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(cupy, dtype, mode):
    rng = np.random.default_rng(2)
    b1 = random_boxes(rng, 700, 2).astype(dtype)
    b2 = random_boxes(rng, 300, 1).astype(dtype)
    tol = dict(rtol=1e-6, atol=1e-7) if dtype == np.float32 else dict(rtol=1e-13, atol=1e-14)
    for offset in (0, 1):
        out = bbox_overlaps(cupy.asarray(b1), cupy.asarray(b2), mode, False, offset)
        assert isinstance(out, cupy.ndarray) and out.dtype == dtype and out.shape == (700, 300)
        np.testing.assert_allclose(cupy.asnumpy(out), bbox_overlaps(b1, b2, mode, False, offset),
                                   **tol)
        out = bbox_overlaps(cupy.asarray(b1[:300]), cupy.asarray(b2), mode, True, offset)
        assert out.shape == (300,)
        np.testing.assert_allclose(cupy.asnumpy(out),
                                   bbox_overlaps(b1[:300], b2, mode, True, offset), **tol)


@pytest.mark.parametrize("mode", ["iou", "iof"])
def test_cuda_float16_computes_in_float32(cupy, mode):
    rng = np.random.default_rng(3)
    b1 = np.abs(random_boxes(rng, 200, 2)).astype(np.float16)
    b2 = np.abs(random_boxes(rng, 150, 0)).astype(np.float16)
    expected = bbox_overlaps(b1.astype(np.float32), b2.astype(np.float32), mode, offset=1)
    out = bbox_overlaps(cupy.asarray(b1), cupy.asarray(b2), mode, offset=1)
    assert out.dtype == np.float16 and out.shape == (200, 150)
    np.testing.assert_allclose(cupy.asnumpy(out).astype(np.float32), expected, rtol=1e-3,
                               atol=1e-3)


@pytest.mark.parametrize("mode", ["iou", "iof"])
def test_cuda_bfloat16_computes_in_float32(torch_cuda, mode):
    torch = torch_cuda
    rng = np.random.default_rng(4)
    b1 = torch.from_numpy(np.abs(random_boxes(rng, 200, 2)).astype(np.float32)).bfloat16()
    b2 = torch.from_numpy(np.abs(random_boxes(rng, 150, 0)).astype(np.float32)).bfloat16()
    expected = bbox_overlaps(b1.float().numpy(), b2.float().numpy(), mode, offset=1)
    ious = torch.empty((200, 150), dtype=torch.bfloat16, device="cuda")
    mmdispatch.bbox_overlaps_impl(b1.cuda(), b2.cuda(), ious, {"iou": 0, "iof": 1}[mode], False,
                                  1)
    # float32 math, then one rounding to bfloat16 (8 bits of mantissa)
    np.testing.assert_allclose(ious.float().cpu().numpy(), expected, rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES + [np.float16])
def test_cuda_published_values_and_edge_cases(cupy, dtype):
    b1, b2 = cupy.asarray(MMCV_B1.astype(dtype)), cupy.asarray(MMCV_B2.astype(dtype))
    np.testing.assert_allclose(cupy.asnumpy(bbox_overlaps(b1, b2, offset=1)).astype(np.float64),
                               MMCV_IOU, rtol=1e-3)
    np.testing.assert_allclose(cupy.asnumpy(bbox_overlaps(b1, b2, "iof", offset=1)),
                               MMCV_IOF, rtol=1e-3)
    np.testing.assert_allclose(cupy.asnumpy(bbox_overlaps(b1[:2], b2, aligned=True, offset=1)),
                               [1 / 3, 0.5], rtol=1e-3)
    degenerate = cupy.asarray(np.array([[3, 3, 3, 3], [2, 0, 0, 1]], dtype=dtype))
    assert cupy.asnumpy(bbox_overlaps(degenerate, degenerate)).tolist() == [[0, 0], [0, 0]]
    nan_box = cupy.asarray(np.array([[np.nan, 0, 4, 4]], dtype=dtype))
    assert np.isnan(cupy.asnumpy(bbox_overlaps(nan_box, b2))).all()
    empty = bbox_overlaps(cupy.zeros((0, 4), dtype=dtype), b2)
    assert isinstance(empty, cupy.ndarray) and empty.shape == (0, 2)


def test_cuda_result_stays_on_the_inputs_device(cupy):
    b1 = cupy.asarray(MMCV_B1)
    out = bbox_overlaps(b1, cupy.asarray(MMCV_B2))
    assert isinstance(out, cupy.ndarray) and out.device.id == b1.device.id


def test_cuda_and_cpu_arrays_cannot_be_mixed(cupy):
    device = f"cuda:{cupy.cuda.Device().id}"
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            f"bbox_overlaps_impl: at param 1 (bboxes2), inconsistent device: cpu vs {device}")):
        bbox_overlaps(cupy.asarray(MMCV_B1), MMCV_B2)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            f"bbox_overlaps_impl: at param 1 (bboxes2), inconsistent device: {device} vs cpu")):
        bbox_overlaps(MMCV_B1, cupy.asarray(MMCV_B2))


def test_cuda_large_input_matches_cpu(cupy):
    rng = np.random.default_rng(4)
    b1 = random_boxes(rng, 5000, 2)
    b2 = random_boxes(rng, 400, 0)
    out = bbox_overlaps(cupy.asarray(b1), cupy.asarray(b2), offset=1)
    np.testing.assert_allclose(cupy.asnumpy(out), bbox_overlaps(b1, b2, offset=1), rtol=1e-13,
                               atol=1e-14)


# --- properties (tests/support/properties.py) ----------------------------------------------

@st.composite
def overlaps_case(draw, dtype):
    n = draw(st.integers(0, 5))
    aligned = draw(st.booleans())
    m = n if aligned else draw(st.integers(0, 5))
    b1, b2 = draw(boxes_for(n, dtype)), draw(boxes_for(m, dtype))
    mode, offset = draw(st.sampled_from([0, 1])), draw(st.sampled_from([0, 1]))
    shape = (n,) if aligned else (n, m)
    args = dict(bboxes1=guarded(b1), bboxes2=guarded(b2), ious=guarded(sentinel(shape, dtype)),
                mode=mode, aligned=aligned, offset=offset)

    def check(a):
        expected = ref_bbox_overlaps(b1, b2, ["iou", "iof"][mode], aligned, offset)
        np.testing.assert_allclose(a["ious"], expected, equal_nan=True, **TOL[dtype])
    return args, check


def user_case(draw, name, dtype, layout):
    a, check = draw(overlaps_case(dtype))
    inputs = dict(bboxes1=layout(a["bboxes1"]), bboxes2=layout(a["bboxes2"]))

    def run():
        return bbox_overlaps(inputs["bboxes1"], inputs["bboxes2"], ["iou", "iof"][a["mode"]],
                             a["aligned"], a["offset"])
    return run, inputs, lambda result: check(dict(a, ious=result))


def torch_calls(torch, device):
    boxes = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6]], device=device)
    return [(boxes, boxes[:2], 0, False, 0), (boxes, boxes, 1, True, 0),
            (boxes.double(), boxes.double(), 0, False, 1)]


class TestProperties(OpProperties):
    module = bbox_overlaps_module
    torch_calls = {"bbox_overlaps_impl": torch_calls}
    entry_cases = {"bbox_overlaps_impl": overlaps_case}
    fixed_axes = {"bbox_overlaps_impl": {"bboxes1": [1], "bboxes2": [1], "ious": [0, 1]}}
    bad_scalars = {"offset": [2, -1], "mode": [2, -1]}
    user_cases = {"bbox_overlaps": user_case}
    good_user_args = {"bbox_overlaps": lambda: [
        np.array([[0, 0, 2, 2], [1, 1, 3, 3], [5, 5, 6, 7]], dtype=np.float64),
        np.array([[0, 0, 2, 2], [1, 1, 3, 3]], dtype=np.float64), "iou", False, 0]}
    user_bad_values = {
        ("bbox_overlaps", 2): ["giou", None, 0, "IOU"],
        ("bbox_overlaps", 3): ["yes", 2, None, 1.0],
        ("bbox_overlaps", 4): [2, -1, 0.5, None],
    }


@pytest.mark.parametrize("dtype", DTYPES)
def test_iof_with_a_nan_in_bboxes2_is_nan_even_when_the_bboxes1_area_is_zero(dtype):
    # the zero-area rule ("a base <= 0 gives 0") used to win over NaN
    b1 = np.zeros((2, 4), dtype)
    b2 = np.array([[np.nan, 0, 0, 0]], dtype)
    assert np.isnan(bbox_overlaps(b1, b2, "iof")).all()
    assert np.isnan(bbox_overlaps(b1[:1], b2, "iof", aligned=True)).all()
    assert np.isnan(bbox_overlaps(b1, b2, "iou")).all()
