"""nms / batched_nms (MMCV semantics): a slow greedy reference, published
values, threshold boundaries, NaN / inf / ties, output properties, device
consistency, bad input, and CPU/CUDA agreement."""
import importlib
import math
import re

import numpy as np
import pytest

from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import batched_nms, nms
from properties import OpProperties, boxes_for, float_arrays, guarded, sentinel
from references import ref_iou, ref_order

nms_module = importlib.import_module("mmdispatch.ops.nms")

MMCV_BOXES = np.array([[6, 3, 8, 7], [3, 6, 9, 11], [3, 7, 10, 12], [1, 4, 13, 7]],
                      dtype=np.float32)
MMCV_SCORES = np.array([0.6, 0.9, 0.7, 0.2], dtype=np.float32)
MMCV_KEEP = [1, 0, 3]
DTYPES = [np.float32, np.float64]
INT_DTYPES = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]


# --- slow reference: greedy NMS, IoU computed in the boxes' dtype ------------

def ref_nms(boxes, scores, iou_threshold, offset=0, idxs=None):
    kept = []
    for i in ref_order(scores):
        suppressed = False
        for k in kept:
            if idxs is not None and idxs[k] != idxs[i]:
                continue
            # the IoU is a value of the boxes' dtype, compared as a double
            if float(ref_iou(boxes[k], boxes[i], offset, boxes.dtype)) > iou_threshold:
                suppressed = True
                break
        if not suppressed:
            kept.append(i)
    return np.array(kept, dtype=np.int64)


THRESHOLDS = [0.0, 0.1, 1 / 3, 0.3, 0.5, 0.7, 0.9, 1.0]


def random_case(seed, dtype):
    """Boxes with integer / half-integer / continuous coordinates (exact ties
    and exact threshold hits), zero-size boxes, duplicated boxes, heavily
    duplicated scores, some NaN and infinite scores, some NaN coordinates."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 41))
    kind = seed % 3
    if kind == 0:
        xy = rng.integers(-6, 10, (n, 2)).astype(np.float64)
        wh = rng.integers(0, 7, (n, 2)).astype(np.float64)
    elif kind == 1:
        xy = rng.integers(-12, 20, (n, 2)) / 2.0
        wh = rng.integers(0, 12, (n, 2)) / 2.0
    else:
        xy = rng.uniform(-10, 10, (n, 2))
        wh = rng.uniform(0, 8, (n, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1)
    if n > 3:
        boxes[rng.integers(0, n, 2)] = boxes[0]                  # duplicated boxes
    if seed % 2 == 0:
        scores = rng.integers(0, 4, n) / 4.0                    # many equal scores
    else:
        scores = rng.random(n)
    special = rng.random(n)
    scores[special < 0.08] = np.nan
    scores[(special >= 0.08) & (special < 0.11)] = np.inf
    scores[(special >= 0.11) & (special < 0.13)] = -np.inf
    nan_rows = rng.random(n) < 0.05
    boxes[nan_rows, rng.integers(0, 4)] = np.nan
    iou_threshold = THRESHOLDS[seed % len(THRESHOLDS)] if seed % 5 else float(rng.random())
    return boxes.astype(dtype), scores.astype(dtype), iou_threshold


SEEDS = range(48)


# --- against the slow reference -----------------------------------------------

@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS)
def test_nms_matches_slow_greedy_reference(seed, dtype, offset):
    boxes, scores, iou_threshold = random_case(seed, dtype)
    keep = nms(boxes, scores, iou_threshold, offset)
    np.testing.assert_array_equal(keep, ref_nms(boxes, scores, iou_threshold, offset))


@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", SEEDS[::2])
def test_batched_nms_matches_slow_greedy_reference(seed, dtype, offset):
    boxes, scores, iou_threshold = random_case(seed + 1000, dtype)
    rng = np.random.default_rng(seed)
    idxs = rng.integers(0, 3, len(boxes)).astype(INT_DTYPES[seed % len(INT_DTYPES)])
    keep = batched_nms(boxes, scores, idxs, iou_threshold, offset)
    np.testing.assert_array_equal(
        keep, ref_nms(boxes, scores, iou_threshold, offset, idxs.astype(np.int64)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(8))
def test_batched_nms_with_a_single_class_equals_nms(seed, dtype):
    boxes, scores, iou_threshold = random_case(seed + 2000, dtype)
    expected = nms(boxes, scores, iou_threshold)
    for label in (0, 7, -3):
        idxs = np.full(len(boxes), label, dtype=np.int64)
        np.testing.assert_array_equal(batched_nms(boxes, scores, idxs, iou_threshold),
                                      expected)


def test_nms_matches_reference_on_a_larger_continuous_case():
    """A bigger case (many overlaps, distinct scores) against the reference."""
    rng = np.random.default_rng(7)
    xy = rng.uniform(0, 50, (150, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(5, 25, (150, 2))], axis=1)
    scores = rng.random(150)
    for dtype in DTYPES:
        b, s = boxes.astype(dtype), scores.astype(dtype)
        np.testing.assert_array_equal(nms(b, s, 0.4), ref_nms(b, s, 0.4))


# --- published values -----------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_mmcv_published_keep(dtype):
    keep = nms(MMCV_BOXES.astype(dtype), MMCV_SCORES.astype(dtype), 0.3)
    assert keep.dtype == np.int64
    assert keep.tolist() == MMCV_KEEP


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_nms_mmcv_boxes_split_over_two_classes(dtype):
    # box 2 (class 1) can no longer be suppressed by box 1 (class 0)
    keep = batched_nms(MMCV_BOXES.astype(dtype), MMCV_SCORES.astype(dtype),
                       np.array([0, 0, 1, 0]), 0.3)
    assert keep.tolist() == [1, 2, 0, 3]


# --- threshold boundaries ---------------------------------------------------------

def pair_with_iou(inter, union):
    """Two boxes (offset 0) of height 1 with the given integer intersection
    and union widths: [0, a] and [a - inter, union]."""
    a = (union + inter) // 2
    return np.array([[0, 0, a, 1], [a - inter, 0, union, 1]], dtype=np.float64)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter, union", [(1, 2), (1, 3), (3, 10), (2, 7), (5, 8)])
def test_iou_equal_to_threshold_is_not_suppressed_but_just_below_threshold_is(dtype, inter,
                                                                               union):
    boxes = pair_with_iou(inter, union).astype(dtype)
    scores = np.array([0.9, 0.8], dtype=dtype)
    iou = float(ref_iou(boxes[0], boxes[1], 0, dtype))      # the value in the boxes' dtype
    assert iou == pytest.approx(inter / union, rel=1e-6)
    assert nms(boxes, scores, iou).tolist() == [0, 1]                     # equal: kept
    assert nms(boxes, scores, np.nextafter(iou, -np.inf)).tolist() == [0]  # just below
    assert nms(boxes, scores, np.nextafter(iou, np.inf)).tolist() == [0, 1]  # just above


@pytest.mark.parametrize("inter, union", [(1, 3), (3, 10)])
def test_threshold_is_compared_as_a_double_against_the_float32_iou(inter, union):
    """float32(1/3) > 1/3 and float32(0.3) > 0.3 as doubles, so with a double
    threshold of exactly inter/union float32 boxes are suppressed and float64
    boxes (whose IoU equals the threshold) are kept."""
    exact = inter / union
    assert float(np.float32(exact)) > exact
    scores = np.array([0.9, 0.8])
    boxes = pair_with_iou(inter, union)
    assert nms(boxes, scores, exact).tolist() == [0, 1]
    assert nms(boxes.astype(np.float32), scores.astype(np.float32), exact).tolist() == [0]
    # the float32 threshold itself equals the float32 IoU: kept
    assert nms(boxes.astype(np.float32), scores.astype(np.float32),
               float(np.float32(exact))).tolist() == [0, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_extreme_thresholds(dtype):
    boxes = np.array([[0, 0, 2, 2], [0, 0, 2, 2], [5, 5, 6, 6], [np.nan, 0, 2, 2]], dtype=dtype)
    scores = np.array([0.9, 0.8, 0.7, 0.6], dtype=dtype)
    # identical boxes have IoU exactly 1, which is not > 1
    assert nms(boxes, scores, 1.0).tolist() == [0, 1, 2, 3]
    assert nms(boxes, scores, np.inf).tolist() == [0, 1, 2, 3]
    assert nms(boxes, scores, 1e300).tolist() == [0, 1, 2, 3]
    # IoU 0 > negative threshold: disjoint boxes suppress each other; NaN IoU never does
    assert nms(boxes, scores, 0.0).tolist() == [0, 2, 3]
    assert nms(boxes, scores, -0.5).tolist() == [0, 3]
    assert nms(boxes, scores, -1e300).tolist() == [0, 3]
    assert nms(boxes, scores, -np.inf).tolist() == [0, 3]


# --- ties, duplicates, degenerate boxes, NaN and inf --------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_equal_scores_keep_the_lower_index_first(dtype):
    boxes = np.array([[0, 0, 1, 1], [10, 10, 11, 11], [0, 0, 1, 1], [20, 20, 21, 21],
                      [10, 10, 11, 11]], dtype=dtype)
    scores = np.full(5, 0.5, dtype=dtype)
    assert nms(boxes, scores, 0.5).tolist() == [0, 1, 3]
    # reversing the input reverses which duplicate survives
    assert nms(boxes[::-1], scores, 0.5).tolist() == [0, 1, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_many_equal_scores_keep_a_stable_descending_order_for_large_inputs(dtype):
    rng = np.random.default_rng(3)
    n = 6000
    x = rng.permutation(n).astype(np.float64) * 2
    boxes = np.stack([x, x * 0, x + 1, x * 0 + 1], axis=1).astype(dtype)   # all disjoint
    scores = rng.integers(0, 3, n).astype(dtype)
    keep = nms(boxes, scores, 0.0)
    np.testing.assert_array_equal(keep, np.argsort(-scores.astype(np.float64), kind="stable"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_zero_score_ties_with_positive_zero(dtype):
    boxes = np.array([[0, 0, 1, 1], [0, 0, 1, 1]], dtype=dtype)
    assert nms(boxes, np.array([-0.0, 0.0], dtype=dtype), 0.5).tolist() == [0]
    assert nms(boxes, np.array([0.0, -0.0], dtype=dtype), 0.5).tolist() == [0]


@pytest.mark.parametrize("dtype", DTYPES)
def test_duplicate_boxes_suppress_all_but_the_best(dtype):
    boxes = np.tile(np.array([[1.5, 2, 7, 9]], dtype=dtype), (6, 1))
    scores = np.array([0.1, 0.5, 0.3, 0.5, 0.9, 0.2], dtype=dtype)
    assert nms(boxes, scores, 0.99).tolist() == [4]


@pytest.mark.parametrize("dtype", DTYPES)
def test_zero_area_boxes_depend_on_offset(dtype):
    points = np.array([[3, 3, 3, 3], [3, 3, 3, 3], [0, 0, 5, 0], [0, 0, 5, 0]], dtype=dtype)
    scores = np.array([0.9, 0.8, 0.7, 0.6], dtype=dtype)
    # offset 0: zero area, zero union -> IoU 0, nothing suppressed
    assert nms(points, scores, 0.0).tolist() == [0, 1, 2, 3]
    # offset 1: a point is a 1x1 pixel, a line a 6x1 strip: duplicates have IoU 1
    assert nms(points, scores, 0.5, offset=1).tolist() == [0, 2]


@pytest.mark.parametrize("dtype", DTYPES)
def test_offset_one_counts_inclusive_pixels(dtype):
    # offset 0: IoU 1/7 (kept at 0.2); offset 1: [0,2]x[0,2] vs [1,3]x[0,2] IoU 6/12
    boxes = np.array([[0, 0, 2, 2], [1, 0, 3, 2]], dtype=dtype)
    scores = np.array([0.9, 0.8], dtype=dtype)
    assert nms(boxes, scores, 0.4).tolist() == [0, 1]
    assert nms(boxes, scores, 0.4, offset=1).tolist() == [0]
    assert nms(boxes, scores, 0.5, offset=1).tolist() == [0, 1]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_scores_rank_after_minus_infinity(dtype):
    boxes = np.array([[i * 10, 0, i * 10 + 5, 5] for i in range(6)], dtype=dtype)  # disjoint
    scores = np.array([np.nan, -np.inf, np.inf, 0.0, np.nan, -1e30], dtype=dtype)
    assert nms(boxes, scores, 0.5).tolist() == [2, 3, 5, 1, 0, 4]


@pytest.mark.parametrize("dtype", DTYPES)
def test_nan_score_boxes_are_suppressed_by_and_never_suppress_numbered_boxes(dtype):
    boxes = np.array([[0, 0, 4, 4], [0, 0, 4, 4], [0, 0, 4, 4.5]], dtype=dtype)
    # the NaN-score box comes last, so it cannot suppress anything ranked before it
    assert nms(boxes, np.array([np.nan, -np.inf, 0.1], dtype=dtype), 0.5).tolist() == [2]
    # two NaN scores: the lower index goes first and suppresses the other
    assert nms(boxes, np.array([np.nan, np.nan, np.nan], dtype=dtype), 0.5).tolist() == [0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("column", range(4))
def test_nan_coordinate_boxes_neither_suppress_nor_are_suppressed(dtype, column):
    boxes = np.array([[0, 0, 4, 4], [0, 0, 4, 4], [0, 0, 4, 4], [0, 0, 4, 4]], dtype=dtype)
    boxes[0, column] = np.nan
    boxes[3, column] = np.nan
    scores = np.array([0.9, 0.8, 0.7, 0.1], dtype=dtype)
    # box 0 (NaN, best) does not suppress box 1; box 2 is a duplicate of box 1;
    # box 3 (NaN) is not suppressed by anything
    assert nms(boxes, scores, 0.5).tolist() == [0, 1, 3]
    assert nms(boxes, scores, -1.0).tolist() == [0, 1, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinite_scores_are_ordinary_extremes(dtype):
    boxes = np.array([[0, 0, 4, 4], [0, 0, 4, 4], [0, 0, 4, 4], [10, 10, 12, 12]], dtype=dtype)
    scores = np.array([-np.inf, np.inf, 0.0, -np.inf], dtype=dtype)
    assert nms(boxes, scores, 0.5).tolist() == [1, 3]
    scores = np.array([np.inf, np.inf, np.inf, np.inf], dtype=dtype)
    assert nms(boxes, scores, 0.5).tolist() == [0, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_all_equal_scores_behave_like_input_order(dtype):
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [20, 20, 25, 25], [0, 0, 10, 10],
                      [21, 21, 25, 25]], dtype=dtype)
    scores = np.full(5, 3.0, dtype=dtype)
    assert nms(boxes, scores, 0.5).tolist() == [0, 2]
    assert nms(boxes, scores, 0.9).tolist() == [0, 1, 2, 4]


# --- batched_nms specifics ------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_nms_identical_boxes_in_different_classes_are_all_kept(dtype):
    boxes = np.tile(np.array([[-5, -5, 3, 3]], dtype=dtype), (4, 1))
    scores = np.array([0.1, 0.4, 0.3, 0.2], dtype=dtype)
    idxs = np.array([0, 1, 0, 2])
    assert batched_nms(boxes, scores, idxs, 0.5).tolist() == [1, 2, 3]


@pytest.mark.parametrize("dtype", DTYPES)
def test_batched_nms_is_correct_for_negative_coordinates(dtype):
    """MMCV's coordinate-offset trick (boxes + idxs * (max + 1)) would map the
    class-1 box onto the class-0 box here: max coordinate 1, so class 1 is
    shifted by 2 and [-5, -5, -1, -1] becomes [-3, -3, 1, 1]."""
    boxes = np.array([[-3, -3, 1, 1], [-5, -5, -1, -1], [-3, -3, 1, 0.9]], dtype=dtype)
    scores = np.array([0.9, 0.8, 0.7], dtype=dtype)
    assert batched_nms(boxes, scores, np.array([0, 1, 0]), 0.5).tolist() == [0, 1]
    assert batched_nms(boxes, scores, np.array([0, 1, 1]), 0.5).tolist() == [0, 1, 2]
    far = boxes - 1e6
    assert batched_nms(far, scores, np.array([0, 1, 0]), 0.5).tolist() == [0, 1]


@pytest.mark.parametrize("int_dtype", INT_DTYPES)
def test_batched_nms_accepts_every_integer_idxs_dtype(int_dtype):
    boxes, scores, _ = random_case(11, np.float64)
    idxs = (np.arange(len(boxes)) % 3).astype(int_dtype)
    expected = ref_nms(boxes, scores, 0.3, 0, idxs.astype(np.int64))
    np.testing.assert_array_equal(batched_nms(boxes, scores, idxs, 0.3), expected)


def test_batched_nms_extreme_class_labels_are_distinct():
    boxes = np.tile(np.array([[0, 0, 1, 1.0]]), (4, 1))
    scores = np.array([0.4, 0.3, 0.2, 0.1])
    idxs = np.array([np.iinfo(np.int64).min, np.iinfo(np.int64).max, -1, 0])
    assert batched_nms(boxes, scores, idxs, 0.5).tolist() == [0, 1, 2, 3]
    big = np.array([2**63 - 1, 0, 2**62, 2**63 - 1], dtype=np.uint64)
    assert batched_nms(boxes, scores, big, 0.5).tolist() == [0, 1, 2]


def test_batched_nms_rejects_uint64_labels_beyond_int64():
    boxes = np.tile(np.array([[0, 0, 1, 1.0]]), (2, 1))
    big = np.array([2**64 - 1, 0], dtype=np.uint64)
    with pytest.raises(ValueError, match=re.escape(
            "batched_nms: idxs holds 18446744073709551615, beyond the int64 range")):
        batched_nms(boxes, np.array([0.4, 0.3]), big, 0.5)


# --- output properties ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_result_is_a_fresh_1d_int64_array_and_inputs_are_untouched(dtype):
    boxes, scores, thr = random_case(4, dtype)
    idxs = np.arange(len(boxes), dtype=np.int64) % 2
    copies = boxes.copy(), scores.copy(), idxs.copy()
    for keep in (nms(boxes, scores, thr), batched_nms(boxes, scores, idxs, thr)):
        assert isinstance(keep, np.ndarray)
        assert keep.dtype == np.int64 and keep.ndim == 1
        assert len(keep) >= 1
        for array in (boxes, scores, idxs):
            assert not np.shares_memory(keep, array)
        assert len(np.unique(keep)) == len(keep)
        assert keep.min() >= 0 and keep.max() < len(boxes)
    np.testing.assert_array_equal(boxes, copies[0])
    np.testing.assert_array_equal(scores, copies[1])
    np.testing.assert_array_equal(idxs, copies[2])


@pytest.mark.parametrize("dtype", DTYPES)
def test_nms_fast_path_equals_the_general_path(dtype):
    """nms skips the conversions for plain float numpy arrays; it must keep
    what batched_nms with one class keeps (the general path) and what it
    keeps for strided copies of the same boxes."""
    for seed in range(5):
        boxes, scores, thr = random_case(seed, dtype)
        fast = nms(boxes, scores, thr)
        general = batched_nms(boxes, scores, np.zeros(len(boxes), np.int64), thr)
        strided = nms(np.repeat(boxes, 2, axis=1)[:, ::2], scores, thr)
        np.testing.assert_array_equal(fast, general)
        np.testing.assert_array_equal(strided, general)
        assert fast.dtype == np.int64


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_input_gives_empty_int64_array(dtype):
    boxes, scores = np.zeros((0, 4), dtype=dtype), np.zeros((0,), dtype=dtype)
    for keep in (nms(boxes, scores, 0.5, 1),
                 batched_nms(boxes, scores, np.zeros((0,), dtype=np.int32), 0.5)):
        assert isinstance(keep, np.ndarray)
        assert keep.dtype == np.int64 and keep.shape == (0,)


def test_single_box_is_kept():
    assert nms(np.array([[0, 0, 1, 1.0]]), np.array([0.5]), 0.5).tolist() == [0]
    assert nms(np.array([[0, 0, 1, 1.0]]), np.array([np.nan]), 0.5).tolist() == [0]


# --- layouts and foreign arrays --------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_views_give_the_same_result_as_contiguous_copies(dtype):
    boxes, scores, thr = random_case(6, dtype)
    wide = np.zeros((len(boxes) * 2, 8), dtype=dtype)
    wide[::2, 1::2] = boxes
    strided_boxes = wide[::2, 1::2]
    wide_scores = np.repeat(scores, 3)
    strided_scores = wide_scores[::3]
    idxs = np.repeat(np.arange(len(boxes)) % 2, 2)[::2]
    assert not strided_boxes.flags.c_contiguous and not strided_scores.flags.c_contiguous
    assert not idxs.flags.c_contiguous
    np.testing.assert_array_equal(nms(strided_boxes, strided_scores, thr),
                                  nms(boxes, scores, thr))
    np.testing.assert_array_equal(
        batched_nms(strided_boxes, strided_scores, idxs, thr),
        batched_nms(boxes, scores, np.ascontiguousarray(idxs), thr))
    np.testing.assert_array_equal(nms(np.asfortranarray(boxes), scores, thr),
                                  nms(boxes, scores, thr))


def test_negative_stride_views_index_into_the_view():
    boxes, scores, thr = random_case(9, np.float64)
    keep = nms(boxes[::-1], scores[::-1], thr)
    np.testing.assert_array_equal(keep, ref_nms(boxes[::-1].copy(), scores[::-1].copy(), thr))
    distinct = np.arange(len(boxes), dtype=np.float64)
    keep = nms(boxes[::-1], distinct[::-1], thr)
    # distinct scores: the same boxes visited in the same order, reindexed
    np.testing.assert_array_equal(len(boxes) - 1 - keep, nms(boxes, distinct, thr))


def test_dlpack_only_inputs_work(dlpack_only):
    boxes, scores, thr = random_case(10, np.float32)
    idxs = np.arange(len(boxes)) % 3
    expected = nms(boxes, scores, thr)
    np.testing.assert_array_equal(np.asarray(nms(dlpack_only(boxes), dlpack_only(scores), thr)),
                                  expected)
    np.testing.assert_array_equal(
        np.asarray(batched_nms(dlpack_only(boxes), dlpack_only(scores), dlpack_only(idxs), thr)),
        batched_nms(boxes, scores, idxs, thr))


# --- device consistency ------------------------------------------------------------------

def impl_args(n=3, with_idxs=True):
    boxes = np.array([[0, 0, 2, 2], [1, 1, 3, 3], [0, 0, 2, 2.1]])[:n]
    return [boxes, np.array([0.9, 0.8, 0.7])[:n],
            np.zeros(n, dtype=np.int64) if with_idxs else None,
            np.full(n, -7, dtype=np.int64), np.full(1, -7, dtype=np.int64)]


NMS_PARAMS = ["boxes", "scores", "idxs", "keep", "num_kept"]


@pytest.mark.parametrize("position", range(5))
def test_impl_reports_a_foreign_device_array_at_any_position(position, fake_array):
    args = impl_args()
    stand_in = fake_array(2, 0)
    args[position] = stand_in
    expected = (f"nms_impl: at param {max(position, 1)} ({NMS_PARAMS[max(position, 1)]}), "
                "inconsistent device: " + ("cpu vs cuda:0" if position == 0 else
                                           "cuda:0 vs cpu"))
    with pytest.raises(mmdispatch.DeviceMismatchError) as info:
        mmdispatch.nms_impl(*args, 0.5, 0)
    assert str(info.value) == expected
    assert not stand_in.exported
    assert np.all(args[-1] == -7) or position == 4


def test_impl_checks_the_optional_idxs_device_too(fake_array):
    args = impl_args()
    args[2] = fake_array(2, 0)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "nms_impl: at param 2 (idxs), inconsistent device: cuda:0 vs cpu")):
        mmdispatch.nms_impl(*args, 0.5, 0)
    args[2] = fake_array(1, 1)   # another cpu index is another device
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "nms_impl: at param 2 (idxs), inconsistent device: ")):
        mmdispatch.nms_impl(*args, 0.5, 0)
    assert not args[2].exported


def test_impl_skips_a_missing_idxs_but_checks_the_rest(fake_array):
    args = impl_args(with_idxs=False)
    args[4] = stand_in = fake_array(2, 0)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "nms_impl: at param 4 (num_kept), inconsistent device: cuda:0 vs cpu")):
        mmdispatch.nms_impl(*args, 0.5, 0)
    assert not stand_in.exported


def test_impl_without_a_kernel_for_the_device_raises_kernel_not_found(fake_array):
    arrays = [fake_array(7, 0) for _ in range(5)]
    with pytest.raises(mmdispatch.KernelNotFoundError, match=re.escape(
            "nms_impl: implementation for device vulkan:0 not found.")):
        mmdispatch.nms_impl(*arrays, 0.5, 0)
    arrays[2] = None
    with pytest.raises(mmdispatch.KernelNotFoundError, match=re.escape(
            "nms_impl: implementation for device vulkan:0 not found.")):
        mmdispatch.nms_impl(*arrays, 0.5, 0)
    assert not any(a.exported for a in arrays if a is not None)


def shaped_stand_in(fake_array, shape, dtype):
    """A stand-in array on cuda:0 that also reports shape / ndim / dtype, so it
    gets past the op layer's own checks and reaches the dispatcher."""
    class Shaped(fake_array):
        pass
    stand_in = Shaped(2, 0)
    stand_in.shape, stand_in.ndim, stand_in.dtype = shape, len(shape), np.dtype(dtype)
    return stand_in


def test_op_reports_foreign_device_scores_and_idxs(fake_array):
    boxes, scores = impl_args()[:2]
    stand_in = shaped_stand_in(fake_array, (3,), np.float64)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "nms_impl: at param 1 (scores), inconsistent device: cuda:0 vs cpu")):
        nms(boxes, stand_in, 0.5)
    idxs = shaped_stand_in(fake_array, (3,), np.int64)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "nms_impl: at param 2 (idxs), inconsistent device: cuda:0 vs cpu")):
        batched_nms(boxes, scores, idxs, 0.5)
    assert not stand_in.exported and not idxs.exported


@pytest.mark.parametrize("call", [
    lambda b, s, f: nms(f((3, 4), np.float64), s, 0.5),
    lambda b, s, f: batched_nms(f((3, 4), np.float64), s, np.zeros(3, np.int64), 0.5),
    lambda b, s, f: batched_nms(b, s, f((3,), np.int32), 0.5),
    lambda b, s, f: nms(f(None, None), s, 0.5),
    lambda b, s, f: nms(b, f(None, None), 0.5),
], ids=["boxes", "batched-boxes", "int32-idxs", "bare-boxes", "bare-scores"])
def test_op_rejects_foreign_device_arrays_with_an_error_naming_the_op(call, fake_array):
    """Whatever the position, a foreign-device array must give a clear error
    that names the op (never an AttributeError, never a bare message), and
    its memory must not be touched."""
    boxes, scores = impl_args()[:2]
    made = []

    def make(shape, dtype):
        made.append(fake_array(2, 0) if shape is None else
                    shaped_stand_in(fake_array, shape, dtype))
        return made[-1]

    with pytest.raises((TypeError, ValueError, RuntimeError)) as info:
        call(boxes, scores, make)
    assert re.match(r"(batched_nms|nms|nms_impl): ", str(info.value)), str(info.value)
    assert not any(a.exported for a in made)


# --- default (grid) vs reference (definition) backends ---------------------------

def grid_stress_case(seed, dtype):
    """Many boxes of mixed sizes, including boxes covering most of the map,
    infinite and NaN coordinates, inverted and zero-size boxes, so that the
    default backend's grid meets every kind of box."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(200, 1500))
    xy = rng.uniform(-50, 300, (n, 2))
    wh = rng.uniform(0, 40, (n, 2)) * (rng.random((n, 1)) < 0.9) + \
        rng.uniform(0, 400, (n, 2)) * (rng.random((n, 1)) >= 0.9)
    boxes = np.concatenate([xy, xy + wh], axis=1)
    if seed % 2:
        boxes = np.round(boxes)                                    # exact ties
    special = rng.random(n)
    boxes[special < 0.01, 0] = -np.inf
    boxes[(special >= 0.01) & (special < 0.02), 2] = np.inf
    boxes[(special >= 0.02) & (special < 0.03), 1] = np.nan
    boxes[(special >= 0.03) & (special < 0.05), 2] -= 60           # inverted
    scores = rng.integers(0, 50, n) / 7.0
    scores[rng.random(n) < 0.03] = np.nan
    return boxes.astype(dtype), scores.astype(dtype), rng.integers(0, 4, n)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [0.0, -0.0, 0.3, 0.5, 1 / 3, 1.0, np.inf, -0.2])
def test_default_backend_keeps_exactly_what_the_reference_backend_keeps(seed, dtype, threshold):
    boxes, scores, idxs = grid_stress_case(seed, dtype)
    for offset in (0, 1):
        with mmdispatch.use_backend("cpu", "reference"):
            expected = nms(boxes, scores, threshold, offset)
            expected_batched = batched_nms(boxes, scores, idxs, threshold, offset)
        np.testing.assert_array_equal(nms(boxes, scores, threshold, offset), expected)
        np.testing.assert_array_equal(batched_nms(boxes, scores, idxs, threshold, offset),
                                      expected_batched)


@pytest.mark.parametrize("dtype, x", [(np.float64, 2.0 ** 53), (np.float32, 1e30),
                                      (np.float64, 1e30)])
def test_a_box_whose_offset_is_lost_beside_its_coordinates_still_meets_its_twin(dtype, x):
    """x2 + 1 rounds to x2 in double for these, so the grid once took the
    boxes for empty; in the boxes' dtype (x2 - x1) + 1 = 1 and the two
    overlap fully (found by a reviewer's fuzzing)."""
    boxes = np.array([[x, 0, x, 10], [x, 0, x, 10]], dtype)
    scores = np.array([0.9, 0.8], dtype)
    with mmdispatch.use_backend("cpu", "reference"):
        assert nms(boxes, scores, 0.5, 1).tolist() == [0]
    assert nms(boxes, scores, 0.5, 1).tolist() == [0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.7])
def test_default_backend_agrees_with_the_reference_over_several_decision_blocks(dtype, threshold):
    """The default backend decides 1,024 boxes at a time: each box of a block
    against the boxes kept before the block (shared out over threads), then
    the survivors against the boxes the block keeps, in order. 5,000 crowded
    boxes cross four such boundaries; a few cover much of the map (kept out
    of the grid), half of those ahead of every other box."""
    rng = np.random.default_rng(41)
    n = 5000
    xy = rng.uniform(0, 200, (n, 2))
    large = rng.random(n) < 0.02
    wh = np.where(large[:, None], rng.uniform(50, 200, (n, 2)), rng.uniform(1, 12, (n, 2)))
    boxes = np.concatenate([xy, xy + wh], axis=1).astype(dtype)
    scores = rng.random(n)
    scores[large & (rng.random(n) < 0.5)] += 1   # half the large boxes come first
    scores = scores.astype(dtype)
    idxs = rng.integers(0, 3, n)
    with mmdispatch.use_backend("cpu", "reference"):
        expected = nms(boxes, scores, threshold)
        expected_batched = batched_nms(boxes, scores, idxs, threshold)
    got = nms(boxes, scores, threshold)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(batched_nms(boxes, scores, idxs, threshold), expected_batched)
    rank = np.empty(n, np.int64)
    rank[np.lexsort((np.arange(n), -scores.astype(np.float64)))] = np.arange(n)
    suppressed = np.setdiff1d(np.arange(n), got)
    assert set(rank[suppressed] // 1024) == set(range(5))   # suppressions in every block


# --- bad input -------------------------------------------------------------------------

B = np.array([[0, 0, 2, 2], [1, 1, 3, 3.0]])
S = np.array([0.9, 0.8])
I = np.array([0, 1])


@pytest.mark.parametrize("call, error, message", [
    (lambda: nms(B[:, :3], S, 0.5), ValueError,
     re.escape("nms_impl: boxes must have shape (*, 4), got (2, 3)")),
    (lambda: nms(np.zeros((0, 3)), np.zeros(0), 0.5), ValueError,
     re.escape("nms_impl: boxes must have shape (*, 4), got (0, 3)")),
    (lambda: nms(B[0], S, 0.5), ValueError,
     re.escape("nms: boxes must be 2-D (N, 4), got shape (4,)")),
    (lambda: nms(B, S[:, None], 0.5), ValueError,
     re.escape("nms: scores must be 1-D (N,), got shape (2, 1)")),
    (lambda: nms(B, S[:1], 0.5), ValueError,
     r"nms_impl: scores must have shape \(2,?\), got \(1,\)"),
    (lambda: batched_nms(B, S, I[:1], 0.5), ValueError,
     r"nms_impl: idxs must have shape \(2,?\), got \(1,\)"),
    (lambda: batched_nms(B, S, I[None], 0.5), ValueError,
     re.escape("batched_nms: idxs must be 1-D (N,), got shape (1, 2)")),
    (lambda: batched_nms(B, S, I.astype(np.float64), 0.5), TypeError,
     re.escape("batched_nms: idxs must have an integer dtype, got float64")),
    (lambda: batched_nms(B, S, I.astype(bool), 0.5), TypeError,
     re.escape("batched_nms: idxs must have an integer dtype, got bool")),
    (lambda: batched_nms(B, S, [0, 1], 0.5), TypeError,
     re.escape("batched_nms: idxs must be an array")),
    (lambda: nms(B.astype(np.int64), S.astype(np.int64), 0.5), TypeError,
     re.escape("nms_impl: boxes has dtype int64 on this device; supported: float32, float64")),
    (lambda: nms(B.astype(np.float16), S.astype(np.float16), 0.5), TypeError,
     re.escape("nms_impl: boxes has dtype float16 on this device; supported: float32, "
               "float64")),
    (lambda: nms(B.astype(np.float32), S, 0.5), TypeError,
     re.escape("nms_impl: scores has dtype float64 but boxes has dtype float32; they must "
               "match")),
    (lambda: nms(B, S.astype(np.float32), 0.5), TypeError,
     re.escape("nms_impl: scores has dtype float32 but boxes has dtype float64")),
    (lambda: batched_nms(B, S.astype(np.float32), I, 0.5), TypeError,
     re.escape("nms_impl: scores has dtype float32 but boxes has dtype float64")),
    (lambda: nms(B, S, float("nan")), ValueError,
     re.escape("nms_impl: iou_threshold must not be NaN")),
    (lambda: nms(np.zeros((0, 4)), np.zeros(0), float("nan")), ValueError,
     re.escape("nms_impl: iou_threshold must not be NaN")),
    (lambda: nms(B, S, 0.5, 2), ValueError, re.escape("nms_impl: offset must be 0 or 1, got 2")),
    (lambda: batched_nms(B, S, I, 0.5, -1), ValueError,
     re.escape("nms_impl: offset must be 0 or 1, got -1")),
    (lambda: nms(B, S, 0.5, 0.5), TypeError,
     re.escape("nms_impl: at param 6 (offset), expected an int, got float")),
    (lambda: nms(B, S, "0.5"), TypeError,
     re.escape("nms_impl: at param 5 (iou_threshold), expected a real number, got str")),
    (lambda: nms(B, S, None), TypeError,
     re.escape("nms_impl: at param 5 (iou_threshold), expected a real number, got NoneType")),
    (lambda: nms(B.tolist(), S, 0.5), TypeError,
     re.escape("nms: boxes must be an array (numpy, CuPy, or one with __dlpack__ or "
               "__cuda_array_interface__), got list")),
    (lambda: nms(B, tuple(S), 0.5), TypeError,
     re.escape("nms: scores must be an array (numpy, CuPy, or one with __dlpack__ or "
               "__cuda_array_interface__), got tuple")),
    (lambda: batched_nms(B.tolist(), S, I, 0.5), TypeError,
     re.escape("batched_nms: boxes must be an array")),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_impl_rejects_read_only_outputs_and_writes_nothing():
    boxes, scores, idxs, keep, num_kept = impl_args()
    for name, position in (("keep", 3), ("num_kept", 4)):
        args = [boxes, scores, idxs, keep.copy(), num_kept.copy()]
        args[position].flags.writeable = False
        with pytest.raises(ValueError, match=re.escape(
                f"nms_impl: at param {position} ({name}), output array is read-only")):
            mmdispatch.nms_impl(*args, 0.5, 0)
        assert np.all(args[3] == -7) and np.all(args[4] == -7)


@pytest.mark.parametrize("make, message", [
    (lambda a: [a[0], a[1], a[2], a[2], a[4]],
     "nms_impl: at param 3 (keep), output memory overlaps param 2 (idxs)"),
    (lambda a: [a[0], a[1], a[2], a[3], a[3][1:2]],
     "nms_impl: at param 3 (keep), output memory overlaps param 4 (num_kept)"),
    (lambda a: [a[0], a[1], None, a[0].view(np.int64)[:, 0].copy(), a[0].view(np.int64)[0, :1]],
     "nms_impl: at param 4 (num_kept), output memory overlaps param 0 (boxes)"),
    (lambda a: [a[0], a[1], None, a[1].view(np.int64), a[4]],
     "nms_impl: at param 3 (keep), output memory overlaps param 1 (scores)"),
])
def test_impl_rejects_outputs_aliasing_other_arguments(make, message):
    args = make(impl_args())
    before = [None if a is None else a.copy() for a in args]
    with pytest.raises(ValueError, match=re.escape(message) + ".*outputs must not share memory"):
        mmdispatch.nms_impl(*args, 0.5, 0)
    for a, b in zip(args, before):
        if a is not None:
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("make, error, message", [
    (lambda a: [np.asfortranarray(a[0])] + a[1:], ValueError,
     "nms_impl: boxes must be C-contiguous (got a strided view)"),
    (lambda a: a[:2] + [a[2].astype(np.int32)] + a[3:], TypeError,
     "nms_impl: idxs has dtype int32 on this device; supported: int64"),
    (lambda a: a[:3] + [a[3].astype(np.int32), a[4]], TypeError,
     "nms_impl: keep has dtype int32 on this device; supported: int64"),
    (lambda a: a[:3] + [a[3][:2], a[4]], ValueError, "nms_impl: keep must have shape"),
    (lambda a: a[:4] + [np.zeros(2, dtype=np.int64)], ValueError,
     "nms_impl: num_kept must have shape"),
])
def test_impl_validates_layout_dtype_and_shape_of_every_array(make, error, message):
    args = make(impl_args())
    with pytest.raises(error, match=re.escape(message)):
        mmdispatch.nms_impl(*args, 0.5, 0)


# --- CUDA (runs only where a GPU, CuPy and the CUDA kernels are present) ---------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(12))
def test_cuda_matches_cpu_on_random_cases(cupy, seed, dtype):
    boxes, scores, thr = random_case(seed, dtype)
    for offset in (0, 1):
        keep = nms(cupy.asarray(boxes), cupy.asarray(scores), thr, offset)
        assert isinstance(keep, cupy.ndarray) and keep.dtype == np.int64 and keep.ndim == 1
        np.testing.assert_array_equal(cupy.asnumpy(keep), nms(boxes, scores, thr, offset))
        idxs = np.arange(len(boxes)) % 3
        keep = batched_nms(cupy.asarray(boxes), cupy.asarray(scores), cupy.asarray(idxs), thr,
                           offset)
        np.testing.assert_array_equal(cupy.asnumpy(keep),
                                      batched_nms(boxes, scores, idxs, thr, offset))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [5000, 700])
def test_cuda_matches_cpu_on_many_overlapping_boxes(cupy, n, dtype):
    rng = np.random.default_rng(n)
    xy = rng.uniform(0, 400, (n, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(1, 60, (n, 2))], axis=1).astype(dtype)
    scores = rng.random(n).astype(dtype)
    scores[rng.random(n) < 0.3] = 0.5                            # many ties
    idxs = rng.integers(0, 5, n)
    keep = nms(cupy.asarray(boxes), cupy.asarray(scores), 0.5)
    np.testing.assert_array_equal(cupy.asnumpy(keep), nms(boxes, scores, 0.5))
    keep = batched_nms(cupy.asarray(boxes), cupy.asarray(scores), cupy.asarray(idxs), 0.5)
    np.testing.assert_array_equal(cupy.asnumpy(keep), batched_nms(boxes, scores, idxs, 0.5))


@pytest.mark.parametrize("seed", range(6))
def test_cuda_float16_matches_cpu_float32_on_the_same_values(cupy, seed):
    """float16 boxes on a grid of 1/8 (so float32 arithmetic on them is exact
    up to the division) compute in float32 like the CPU kernel on the upcast
    values."""
    rng = np.random.default_rng(seed)
    n = 600
    xy = rng.integers(0, 400, (n, 2)) / 8.0
    boxes = np.concatenate([xy, xy + rng.integers(0, 120, (n, 2)) / 8.0], axis=1)
    boxes16 = boxes.astype(np.float16)
    scores16 = (rng.integers(0, 50, n) / 7.0).astype(np.float16)
    scores16[rng.random(n) < 0.05] = np.nan
    for thr in (0.3, 0.5, 1 / 3):
        keep = nms(cupy.asarray(boxes16), cupy.asarray(scores16), thr)
        assert keep.dtype == np.int64
        np.testing.assert_array_equal(
            cupy.asnumpy(keep), nms(boxes16.astype(np.float32), scores16.astype(np.float32), thr))


@pytest.mark.parametrize("seed", range(3))
def test_cuda_bfloat16_matches_cpu_float32_on_the_same_values(torch_cuda, seed):
    """bfloat16 boxes and scores (torch tensors through DLPack): float32 math
    on the bfloat16 values, so the CPU kernel on the upcast values keeps the
    same boxes."""
    torch = torch_cuda
    rng = np.random.default_rng(seed)
    n = 500
    xy = rng.integers(0, 64, (n, 2)).astype(np.float32)
    boxes = torch.from_numpy(np.concatenate([xy, xy + rng.integers(0, 32, (n, 2))],
                                            axis=1).astype(np.float32)).bfloat16()
    scores = torch.from_numpy((rng.integers(0, 50, n) / 7.0).astype(np.float32)).bfloat16()
    for thr in (0.3, 0.5):
        keep = torch.empty(n, dtype=torch.int64, device="cuda")
        count = torch.zeros(1, dtype=torch.int64, device="cuda")
        mmdispatch.nms_impl(boxes.cuda(), scores.cuda(), None, keep, count, thr, 0)
        np.testing.assert_array_equal(keep[:int(count)].cpu().numpy(),
                                      nms(boxes.float().numpy(), scores.float().numpy(), thr))


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_published_values_edge_cases_and_empty_input(cupy, dtype):
    keep = nms(cupy.asarray(MMCV_BOXES.astype(dtype)), cupy.asarray(MMCV_SCORES.astype(dtype)),
               0.3)
    assert cupy.asnumpy(keep).tolist() == MMCV_KEEP
    boxes = np.array([[0, 0, 4, 4], [0, 0, 4, 4], [np.nan, 0, 4, 4], [0, 0, 4, 4],
                      [3, 3, 3, 3], [3, 3, 3, 3], [-5, -5, -1, -1]], dtype=dtype)
    scores = np.array([np.nan, -0.0, np.inf, 0.0, 0.5, 0.5, -np.inf], dtype=dtype)
    for offset in (0, 1):
        for thr in (-1.0, 0.0, 0.5, 1.0):
            expected = ref_nms(boxes, scores, thr, offset)
            keep = nms(cupy.asarray(boxes), cupy.asarray(scores), thr, offset)
            np.testing.assert_array_equal(cupy.asnumpy(keep), expected)
    empty = nms(cupy.zeros((0, 4), dtype=dtype), cupy.zeros((0,), dtype=dtype), 0.5)
    assert isinstance(empty, cupy.ndarray) and empty.shape == (0,) and empty.dtype == np.int64


def test_cuda_result_stays_on_the_inputs_device(cupy):
    boxes = cupy.asarray(MMCV_BOXES)
    keep = nms(boxes, cupy.asarray(MMCV_SCORES), 0.3)
    assert isinstance(keep, cupy.ndarray)
    assert keep.device.id == boxes.device.id


def test_cuda_and_cpu_arrays_cannot_be_mixed(cupy):
    device = f"cuda:{cupy.cuda.Device().id}"
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            f"nms_impl: at param 1 (scores), inconsistent device: cpu vs {device}")):
        nms(cupy.asarray(MMCV_BOXES), MMCV_SCORES, 0.3)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            f"nms_impl: at param 1 (scores), inconsistent device: {device} vs cpu")):
        nms(MMCV_BOXES, cupy.asarray(MMCV_SCORES), 0.3)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            f"nms_impl: at param 2 (idxs), inconsistent device: cpu vs {device}")):
        batched_nms(cupy.asarray(MMCV_BOXES), cupy.asarray(MMCV_SCORES), np.zeros(4, np.int64),
                    0.3)


def test_cuda_rejects_bad_dtypes_like_the_cpu(cupy):
    with pytest.raises(TypeError, match=re.escape("nms_impl: boxes has dtype int64")):
        nms(cupy.zeros((2, 4), dtype=np.int64), cupy.zeros(2, dtype=np.int64), 0.5)
    with pytest.raises(ValueError, match=re.escape("nms_impl: iou_threshold must not be NaN")):
        nms(cupy.asarray(MMCV_BOXES), cupy.asarray(MMCV_SCORES), float("nan"))


# --- properties (tests/support/properties.py) ----------------------------------------------

@st.composite
def nms_case(draw, dtype):
    n = draw(st.integers(0, 10))
    boxes = draw(boxes_for(n, dtype))
    scores = draw(float_arrays((n,), dtype, -1, 1))
    idxs = (np.array(draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n)), np.int64)
            if draw(st.booleans()) else None)
    threshold = draw(st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 0.5, 1.0, math.inf,
                                                                     -math.inf])))
    offset = draw(st.sampled_from([0, 1]))
    args = dict(boxes=guarded(boxes), scores=guarded(scores),
                idxs=None if idxs is None else guarded(idxs),
                keep=guarded(sentinel((n,), np.int64)), num_kept=guarded(sentinel((1,), np.int64)),
                iou_threshold=threshold, offset=offset)

    def check(a):
        expected = ref_nms(boxes, scores, threshold, offset, idxs)
        kept = int(a["num_kept"][0])
        np.testing.assert_array_equal(a["keep"][:kept], expected)
    return args, check


def user_case(draw, name, dtype, layout):
    a, _ = draw(nms_case(dtype))
    idxs = None
    if name == "batched_nms":
        idxs = a["idxs"] if a["idxs"] is not None else np.zeros(len(a["scores"]), np.int64)
        idxs = idxs.astype(draw(st.sampled_from([np.int64, np.int32, np.int8, np.uint8]))
                           if idxs.min(initial=0) >= 0 else np.int64)
    inputs = dict(boxes=layout(a["boxes"]), scores=layout(a["scores"]), idxs=layout(idxs))

    def run():
        if name == "nms":
            return nms(inputs["boxes"], inputs["scores"], a["iou_threshold"], a["offset"])
        return batched_nms(inputs["boxes"], inputs["scores"], inputs["idxs"],
                           a["iou_threshold"], a["offset"])

    def verify(result):
        expected = ref_nms(np.asarray(a["boxes"]), np.asarray(a["scores"]), a["iou_threshold"],
                           a["offset"], None if idxs is None else idxs.astype(np.int64))
        assert result.dtype == np.int64
        np.testing.assert_array_equal(result, expected)
    return run, inputs, verify


SMALL_BOXES = np.array([[0, 0, 2, 2], [1, 1, 3, 3], [5, 5, 6, 7]], dtype=np.float64)
SMALL_SCORES = np.array([0.9, 0.8, 0.1])


def torch_calls(torch, device):
    boxes = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6]], device=device)
    scores = torch.tensor([0.9, 0.8, 0.7], device=device)
    return [(boxes, scores, None, 0.5, 0),
            (boxes, scores, torch.tensor([0, 1, 0], device=device), 0.5, 0),
            (boxes.double(), scores.double(), None, 0.1, 1)]


class TestProperties(OpProperties):
    module = nms_module
    torch_calls = {"nms_impl": torch_calls}
    entry_cases = {"nms_impl": nms_case}
    fixed_axes = {"nms_impl": {"boxes": [1], "scores": [0], "idxs": [0], "keep": [0],
                               "num_kept": [0]}}
    bad_scalars = {"iou_threshold": [math.nan], "offset": [2, -1]}
    user_cases = {"nms": user_case, "batched_nms": user_case}
    good_user_args = {
        "nms": lambda: [SMALL_BOXES.copy(), SMALL_SCORES.copy(), 0.5, 0],
        "batched_nms": lambda: [SMALL_BOXES.copy(), SMALL_SCORES.copy(), np.array([0, 1, 0]),
                                0.5, 0],
    }
    user_bad_values = {
        ("nms", 2): [math.nan, "0.5", None, [0.5], 2j],
        ("nms", 3): [2, -1, 0.5, "0", 2 ** 64],
        ("batched_nms", 2): [np.array([0.0, 1.0, 0.0]), np.array([0, 1]), "abc", [0, 1, 0]],
    }


def test_nms_of_extents_near_the_double_range_equals_the_reference():
    # the grid's span and summed widths overflow to inf there: its cell
    # count was inf / inf, converted to an int (undefined behaviour, seen
    # with -fsanitize=float-cast-overflow)
    rng = np.random.default_rng(3)
    corner = rng.uniform(0, 50, (100, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(1, 10, (100, 2))], axis=1)
    boxes[0] = [-1.7e308, 0, 1.7e308, 10]
    boxes[1] = [-1.6e308, 5, 1.6e308, 20]
    scores = rng.random(100)
    with mmdispatch.use_backend("cpu", "reference"):
        expected = nms(boxes, scores, 0.3)
    np.testing.assert_array_equal(nms(boxes, scores, 0.3), expected)


@pytest.mark.parametrize("backend", ["default", "reference"])
def test_nms_of_boxes_that_are_all_infinite_keeps_them_all(backend):
    # with no finite box the grid's cell lookup converted NaN (inf - inf) to
    # an int (undefined behaviour, seen with -fsanitize=float-cast-overflow)
    boxes = np.array([[0, 0, np.inf, 1], [0, 0, np.inf, 1], [-np.inf, 0, np.inf, 1]])
    with mmdispatch.use_backend("cpu", backend):
        np.testing.assert_array_equal(nms(boxes, np.array([1.0, 0.5, 0.2]), 0.5), [0, 1, 2])
