"""soft_nms / batched_soft_nms (MMCV semantics): a slow reference written from
the definition (Bodla et al. 2017), MMCV's published values, the relation to
hard nms, min_score and class rules, bad input, and CPU/CUDA agreement."""
import ctypes
import ctypes.util
import importlib
import math
import re

import numpy as np
import pytest

from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import batched_soft_nms, nms, soft_nms
from properties import OpProperties, boxes_for, float_arrays, guarded, sentinel
from references import ref_iou, ref_order

soft_nms_module = importlib.import_module("mmdispatch.ops.soft_nms")
DTYPES = [np.float32, np.float64]
METHODS = ["naive", "linear", "gaussian"]

# the exp of the C library the kernels call, so the gaussian weights of the
# reference are the kernels' bits (numpy's own exp may differ in the last one)
_LIBM = ctypes.CDLL(ctypes.util.find_library("m"))
_LIBM.expf.restype, _LIBM.expf.argtypes = ctypes.c_float, [ctypes.c_float]
_LIBM.exp.restype, _LIBM.exp.argtypes = ctypes.c_double, [ctypes.c_double]


def libm_exp(x):
    """exp of a numpy float32 / float64 scalar, as expf / exp compute it."""
    if isinstance(x, np.float32):
        return np.float32(_LIBM.expf(x))
    return np.float64(_LIBM.exp(x))


# --- slow reference, from the definition -------------------------------------------

def ref_soft_nms(boxes, scores, iou_threshold, sigma, min_score, method, offset=0, idxs=None):
    """(dets, inds): each step selects the remaining box of highest score
    (ties: lower index; NaN last), then multiplies the scores of the
    remaining boxes of its class by the method's weight of their IoU (in the
    boxes' dtype; a NaN IoU changes nothing) and drops every remaining box
    whose score is below min_score."""
    boxes = np.asarray(boxes)
    t = boxes.dtype.type
    score = [t(v) for v in np.asarray(scores)]
    remaining = set(range(len(score)))
    dets, inds = [], []
    while remaining:
        first = ref_order([score[j] if j in remaining else np.nan for j in range(len(score))])
        i = next(j for j in first if j in remaining)
        inds.append(i)
        dets.append([*boxes[i], score[i]])
        remaining.discard(i)
        for j in sorted(remaining):
            if idxs is not None and idxs[j] != idxs[i]:
                continue
            iou = ref_iou(boxes[i], boxes[j], offset, boxes.dtype)
            if math.isnan(float(iou)):
                continue
            with np.errstate(all="ignore"):
                if method == "gaussian":
                    score[j] = score[j] * libm_exp(-(iou * iou) / t(sigma))
                elif float(iou) >= iou_threshold:
                    score[j] = score[j] * (t(1) - iou if method == "linear" else t(0))
        remaining = {j for j in remaining if not float(score[j]) < min_score}
    return (np.array(dets, dtype=boxes.dtype).reshape(-1, 5), np.array(inds, dtype=np.int64))


def assert_same(got, expected):
    dets, inds = got
    assert dets.dtype == expected[0].dtype and inds.dtype == np.int64
    np.testing.assert_array_equal(inds, expected[1])
    np.testing.assert_array_equal(dets, expected[0])   # NaN == NaN here


def random_case(seed, dtype, sizes=(1, 40), classes=3):
    """Boxes on a half-integer grid (exact ties, IoUs on the threshold) or
    continuous, zero-size and duplicated boxes, tied scores, and a few NaN /
    infinite scores and NaN coordinates."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(*sizes))
    if seed % 2:
        xy = rng.integers(-6, 12, (n, 2)) / 2.0
        wh = rng.integers(0, 12, (n, 2)) / 2.0
    else:
        xy = rng.uniform(-5, 20, (n, 2))
        wh = rng.uniform(0, 12, (n, 2))
    boxes = np.concatenate([xy, xy + wh], axis=1)
    if n > 3:
        boxes[1] = boxes[0]
    scores = rng.choice([0.1, 0.5, 0.9], n) if seed % 3 == 0 else rng.random(n)
    if seed % 5 == 0:
        scores[rng.integers(0, n)] = np.nan
        scores[rng.integers(0, n)] = np.inf
        boxes[rng.integers(0, n), rng.integers(0, 4)] = np.nan
    idxs = rng.integers(0, classes, n)
    return boxes.astype(dtype), scores.astype(dtype), idxs


# --- published values ---------------------------------------------------------------

# MMCV's test of its soft_nms (tests/test_ops/test_nms.py): these boxes and
# scores, iou_threshold 0.3, sigma 0.5, min_score 0.01
MMCV_BOXES = np.array([[6, 3, 8, 7], [3, 6, 9, 11], [3, 7, 10, 12], [1, 4, 13, 7]],
                      dtype=np.float32)
MMCV_SCORES = np.array([0.6, 0.9, 0.7, 0.2], dtype=np.float32)
MMCV_OUTPUT = {
    "linear": ([0.9, 0.6, 0.29024392, 0.2], [1, 0, 2, 3]),
    "gaussian": ([0.9, 0.59630775, 0.35275510, 0.18650459], [1, 0, 2, 3]),
    "naive": ([0.9, 0.6, 0.2], [1, 0, 3]),
}


@pytest.mark.parametrize("method", METHODS)
def test_mmcv_published_values(method):
    dets, inds = soft_nms(MMCV_BOXES, MMCV_SCORES, 0.3, 0.5, 0.01, method)
    expected_scores, expected_inds = MMCV_OUTPUT[method]
    np.testing.assert_array_equal(inds, expected_inds)
    np.testing.assert_array_equal(dets[:, :4], MMCV_BOXES[expected_inds])
    np.testing.assert_allclose(dets[:, 4], expected_scores, rtol=1e-6)
    assert dets.dtype == np.float32


def test_defaults_are_mmcvs():
    expected = soft_nms(MMCV_BOXES, MMCV_SCORES, 0.3, 0.5, 1e-3, "linear", 0)
    assert_same(soft_nms(MMCV_BOXES, MMCV_SCORES), expected)


# --- the definition -----------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", range(30))
def test_matches_the_definition_on_random_cases(seed, method, dtype):
    boxes, scores, idxs = random_case(seed, dtype)
    rng = np.random.default_rng(seed + 1000)
    thr = float(rng.choice([0.0, 0.3, 0.5, 1 / 3, 0.7, 1.0]))
    sigma = float(rng.choice([0.5, 0.1, 2.0]))
    min_score = float(rng.choice([0.0, 1e-3, 0.05, 0.3, -1.0]))
    for offset in (0, 1):
        assert_same(soft_nms(boxes, scores, thr, sigma, min_score, method, offset),
                    ref_soft_nms(boxes, scores, thr, sigma, min_score, method, offset))
        assert_same(batched_soft_nms(boxes, scores, idxs, thr, sigma, min_score, method, offset),
                    ref_soft_nms(boxes, scores, thr, sigma, min_score, method, offset, idxs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", range(5))
def test_large_classes_match_the_definition(seed, method, dtype):
    """One class of more than 128 boxes: the CPU kernel's grid path (its
    grouped path is for calls whose sum of squared class sizes is below
    128 n)."""
    boxes, scores, idxs = random_case(seed, dtype, sizes=(140, 200), classes=1)
    rng = np.random.default_rng(seed + 2000)
    thr = float(rng.choice([0.3, 0.5, 1 / 3, 1.0]))
    min_score = float(rng.choice([0.0, 0.05, 0.3, -1.0]))
    for offset in (0, 1):
        for classes in (None, idxs):
            got = (soft_nms(boxes, scores, thr, 0.5, min_score, method, offset) if classes is None
                   else batched_soft_nms(boxes, scores, idxs, thr, 0.5, min_score, method,
                                         offset))
            assert_same(got, ref_soft_nms(boxes, scores, thr, 0.5, min_score, method, offset,
                                          classes))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", range(4))
def test_many_classes_and_negative_scores_match_the_definition(seed, method):
    """Groups of classes taken in turn (the CPU kernel's heap of classes),
    and negative scores, which a decay can raise (towards 0)."""
    rng = np.random.default_rng(seed)
    n = 150
    corner = rng.integers(0, 40, (n, 2)).astype(np.float64)
    boxes = np.concatenate([corner, corner + rng.integers(1, 12, (n, 2))], axis=1)
    scores = np.round(rng.uniform(-1, 1, n), 1)                 # ties across classes
    idxs = rng.integers(-10, 10, n)
    for min_score in (-0.5, 0.05, -math.inf):
        assert_same(batched_soft_nms(boxes, scores, idxs, 0.2, 0.3, min_score, method),
                    ref_soft_nms(boxes, scores, 0.2, 0.3, min_score, method, 0, idxs))


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("classes", [1, 2])
def test_big_infinite_empty_and_nan_boxes_among_many_match_the_definition(classes, method):
    """The CPU kernel's grid: boxes spanning many cells (met on every step),
    a box with infinite sides, empty and NaN boxes (in no cell: they meet
    nothing), among 200 small ones; a selected big box meets all. With two
    classes, one of about 180 boxes (through the grid) and one of about 27
    (read whole)."""
    rng = np.random.default_rng(classes)
    corner = rng.uniform(0, 100, (200, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(1, 12, (200, 2))], axis=1)
    special = [[-50, -50, 150, 150], [10, 0, 90, 100], [-np.inf, 20, np.inf, 30],
               [40, 40, 40, 45], [60, 60, 55, 70], [np.nan, 0, 10, 10], [0, 0, 200, 5]]
    boxes = np.concatenate([boxes, special])[rng.permutation(207)]
    scores = rng.random(207)
    idxs = (rng.random(207) < 0.13).astype(np.int64) if classes == 2 else np.zeros(207, int)
    for thr, min_score in ((0.3, 0.05), (0.6, 0.0), (0.1, 0.3)):
        assert_same(batched_soft_nms(boxes, scores, idxs, thr, 0.5, min_score, method),
                    ref_soft_nms(boxes, scores, thr, 0.5, min_score, method, 0, idxs))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(10))
def test_naive_method_keeps_what_hard_nms_keeps(seed, dtype):
    """With continuous coordinates no IoU equals the threshold, so removing at
    IoU >= t (naive soft-NMS, min_score > 0) and at IoU > t (nms) agree, and
    the scores are untouched."""
    rng = np.random.default_rng(seed)
    n = 300
    xy = rng.uniform(0, 200, (n, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(1, 40, (n, 2))], axis=1).astype(dtype)
    scores = rng.random(n).astype(dtype)
    dets, inds = soft_nms(boxes, scores, 0.45, 0.5, 1e-6, "naive")
    np.testing.assert_array_equal(inds, nms(boxes, scores, 0.45))
    np.testing.assert_array_equal(dets[:, 4], scores[inds])
    np.testing.assert_array_equal(dets[:, :4], boxes[inds])


def test_negative_scores_can_rise_so_the_output_follows_the_selections():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10]], dtype=np.float64)
    dets, inds = soft_nms(boxes, np.array([-0.5, -0.6]), 0.3, 0.5, -1.0, "linear")
    np.testing.assert_array_equal(inds, [0, 1])
    assert dets[0, 4] == -0.5 and dets[1, 4] == 0.0          # -0.6 * (1 - 1)


@pytest.mark.parametrize("method", METHODS)
def test_output_is_by_non_increasing_final_score_for_scores_of_at_least_zero(method):
    rng = np.random.default_rng(3)
    n = 400
    xy = rng.uniform(0, 100, (n, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(1, 30, (n, 2))], axis=1)
    dets, inds = soft_nms(boxes, rng.random(n), 0.3, 0.5, 0.0, method)
    assert np.all(np.diff(dets[:, 4]) <= 0)
    assert len(set(inds.tolist())) == len(inds) == n   # min_score 0 drops nothing


def test_first_box_is_kept_below_min_score_and_the_others_are_dropped():
    boxes = np.array([[0, 0, 1, 1], [5, 5, 6, 6], [9, 9, 10, 10]], dtype=np.float64)
    dets, inds = soft_nms(boxes, np.array([0.01, 0.02, 0.005]), min_score=0.1)
    np.testing.assert_array_equal(inds, [1])
    assert dets[0, 4] == 0.02


def test_boxes_of_other_classes_are_not_decayed_but_are_held_to_min_score():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [50, 50, 60, 60]],
                     dtype=np.float32)
    scores = np.array([0.9, 0.8, 0.7, 0.0005], dtype=np.float32)
    dets, inds = batched_soft_nms(boxes, scores, np.array([0, 1, 0, 1]), 0.3, 0.5, 1e-3,
                                  "linear")
    np.testing.assert_array_equal(inds, [0, 1])       # 2 decays to 0, 3 is below min_score
    np.testing.assert_array_equal(dets[:, 4], scores[:2])


def test_gaussian_decays_every_overlap_and_ignores_the_threshold():
    boxes = np.array([[0, 0, 10, 10], [5, 0, 15, 10]], dtype=np.float64)
    scores = np.array([0.9, 0.8])
    for thr in (0.0, 0.9, 5.0):
        dets, inds = soft_nms(boxes, scores, thr, 0.5, 0.0, "gaussian")
        np.testing.assert_array_equal(inds, [0, 1])
        assert dets[1, 4] == 0.8 * math.exp(-(1 / 3) ** 2 / 0.5)


def test_naive_with_min_score_zero_keeps_suppressed_boxes_with_score_zero():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10]], dtype=np.float32)
    dets, inds = soft_nms(boxes, np.array([0.9, 0.8], np.float32), 0.5, 0.5, 0.0, "naive")
    np.testing.assert_array_equal(inds, [0, 1])
    np.testing.assert_array_equal(dets[:, 4], np.array([0.9, 0.0], np.float32))


def test_nan_scores_come_last_and_nan_boxes_decay_nothing():
    boxes = np.array([[0, 0, 10, 10], [0, 0, 10, 10], [0, np.nan, 10, 10]])
    dets, inds = soft_nms(boxes, np.array([np.nan, 0.5, 0.8]), 0.0, 0.5, 0.0, "naive")
    np.testing.assert_array_equal(inds, [2, 1, 0])
    assert dets[0, 4] == 0.8 and dets[1, 4] == 0.5 and math.isnan(dets[2, 4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_input_gives_empty_results(dtype):
    dets, inds = soft_nms(np.zeros((0, 4), dtype), np.zeros((0,), dtype))
    assert dets.shape == (0, 5) and dets.dtype == dtype
    assert inds.shape == (0,) and inds.dtype == np.int64


def test_inputs_are_not_modified():
    boxes, scores, idxs = random_case(4, np.float32)
    before = boxes.copy(), scores.copy()
    batched_soft_nms(boxes, scores, idxs, 0.3, 0.5, 0.0, "linear")
    np.testing.assert_array_equal(boxes, before[0])
    np.testing.assert_array_equal(scores, before[1])


# --- bad input ----------------------------------------------------------------------

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(method="hard"), ValueError,
     "soft_nms: method must be one of 'naive', 'linear', 'gaussian', got 'hard'"),
    (dict(method=1), ValueError, "soft_nms: method must be one of"),
    (dict(method="gaussian", sigma=0.0), ValueError,
     "soft_nms_impl: sigma must be > 0 for the gaussian method (in the boxes' compute type, "
     "float32), got 0"),
    (dict(method="gaussian", sigma=1e-46), ValueError,        # 0 in float32
     "soft_nms_impl: sigma must be > 0 for the gaussian method (in the boxes' compute type, "
     "float32), got 1e-46"),
    (dict(method="gaussian", sigma=math.nan), ValueError, "soft_nms_impl: sigma must be > 0"),
    (dict(min_score=math.nan), ValueError, "soft_nms_impl: min_score must not be NaN"),
    (dict(iou_threshold=math.nan), ValueError, "soft_nms_impl: iou_threshold must not be NaN"),
    (dict(offset=2), ValueError, "soft_nms_impl: offset must be 0 or 1, got 2"),
])
def test_bad_parameters_are_refused_naming_them(kwargs, error, message):
    with pytest.raises(error, match=re.escape(message)):
        soft_nms(MMCV_BOXES, MMCV_SCORES, **kwargs)


def test_a_sigma_that_float32_holds_is_taken_with_float64_boxes():
    boxes = MMCV_BOXES.astype(np.float64)
    dets, inds = soft_nms(boxes, MMCV_SCORES.astype(np.float64), 0.3, 1e-46, 0.0, "gaussian")
    np.testing.assert_array_equal(inds, [1, 0, 2, 3])
    # every other box overlaps box 1: exp(-IoU^2 / 1e-46) is 0
    np.testing.assert_array_equal(dets[:, 4], [np.float32(0.9), 0.0, 0.0, 0.0])
    with pytest.raises(ValueError, match="float32"):
        soft_nms(MMCV_BOXES, MMCV_SCORES, 0.3, 1e-46, 0.0, "gaussian")


def test_one_large_class_among_many_tiny_ones_is_not_quadratic_and_matches():
    """The CPU kernel chooses its path by its largest class, not the mean:
    a large class among many one-box classes gives the same answer as on
    its own (and takes the grid path, not one pass per step over it)."""
    rng = np.random.default_rng(8)
    corner = rng.uniform(0, 300, (400, 2))
    boxes = np.concatenate([corner, corner + rng.uniform(5, 40, (400, 2))], axis=1)
    scores = rng.random(400)
    idxs = np.concatenate([np.zeros(80, np.int64), np.arange(1, 321)])
    got = batched_soft_nms(boxes, scores, idxs, 0.3, 0.5, 0.0, "linear")
    expected = ref_soft_nms(boxes, scores, 0.3, 0.5, 0.0, "linear", 0, idxs)
    assert_same(got, expected)


def test_sigma_is_not_checked_outside_the_gaussian_method():
    assert_same(soft_nms(MMCV_BOXES, MMCV_SCORES, 0.3, 0.0, 0.01, "linear"),
                soft_nms(MMCV_BOXES, MMCV_SCORES, 0.3, 0.5, 0.01, "linear"))


F32 = np.float32


@pytest.mark.parametrize("boxes, scores, message", [
    (np.zeros((3, 5), F32), np.zeros(3, F32), "soft_nms_impl: boxes must have shape"),
    (np.zeros((3, 4), F32), np.zeros(2, F32), "soft_nms_impl: scores must have shape"),
    (np.zeros((3, 4), F32), np.zeros(3), "soft_nms_impl: scores has dtype float64 but boxes "
                                         "has dtype float32"),
    (np.zeros((3, 4), np.int32), np.zeros(3, np.int32), "soft_nms_impl: boxes has dtype int32 "
                                                        "on this device"),
    (np.zeros(4, F32), np.zeros(1, F32), "soft_nms: boxes must be 2-D (N, 4), got shape (4,)"),
])
def test_bad_arrays_are_refused_naming_them(boxes, scores, message):
    with pytest.raises((ValueError, TypeError), match=re.escape(message)):
        soft_nms(boxes, scores)


def test_batched_idxs_must_be_integers_of_the_boxes_length():
    with pytest.raises(TypeError, match="batched_soft_nms: idxs must have an integer dtype"):
        batched_soft_nms(MMCV_BOXES, MMCV_SCORES, np.zeros(4))
    with pytest.raises(ValueError, match=re.escape("soft_nms_impl: idxs must have shape")):
        batched_soft_nms(MMCV_BOXES, MMCV_SCORES, np.zeros(3, np.int64))


def test_entry_point_checks_its_outputs():
    boxes, scores = MMCV_BOXES, MMCV_SCORES
    keep, count = np.empty(4, np.int64), np.empty(1, np.int64)
    with pytest.raises(ValueError, match=re.escape("soft_nms_impl: dets must have shape")):
        mmdispatch.soft_nms_impl(boxes, scores, None, np.empty((4, 4), np.float32), keep, count,
                                 0.3, 0.5, 0.0, 1, 0)
    with pytest.raises(TypeError, match=re.escape("soft_nms_impl: dets has dtype float64 but "
                                                  "boxes has dtype float32")):
        mmdispatch.soft_nms_impl(boxes, scores, None, np.empty((4, 5)), keep, count,
                                 0.3, 0.5, 0.0, 1, 0)
    with pytest.raises(ValueError, match=re.escape("soft_nms_impl: method must be 0 (naive)")):
        mmdispatch.soft_nms_impl(boxes, scores, None, None, None, None, 0.3, 0.5, 0.0, 3, 0)


# --- CUDA (runs only where a GPU, CuPy and the CUDA kernels are present) ---------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("seed", range(8))
def test_cuda_matches_cpu_on_random_cases(cupy, seed, method, dtype):
    boxes, scores, idxs = random_case(seed, dtype)
    for offset in (0, 1):
        got = batched_soft_nms(cupy.asarray(boxes), cupy.asarray(scores), cupy.asarray(idxs),
                               0.3, 0.5, 1e-3, method, offset)
        assert isinstance(got[0], cupy.ndarray) and isinstance(got[1], cupy.ndarray)
        expected = batched_soft_nms(boxes, scores, idxs, 0.3, 0.5, 1e-3, method, offset)
        if method == "gaussian":   # the device's exp may differ in the last bits
            np.testing.assert_array_equal(cupy.asnumpy(got[1])[:3], expected[1][:3])
            np.testing.assert_allclose(cupy.asnumpy(got[0])[:3], expected[0][:3], rtol=1e-5)
        else:
            assert_same((cupy.asnumpy(got[0]), cupy.asnumpy(got[1])), expected)


@pytest.mark.parametrize("method", ["naive", "linear"])
def test_cuda_matches_cpu_on_many_boxes(cupy, method):
    rng = np.random.default_rng(7)
    n = 5000
    xy = rng.uniform(0, 400, (n, 2))
    boxes = np.concatenate([xy, xy + rng.uniform(1, 60, (n, 2))], axis=1).astype(np.float32)
    scores = rng.random(n).astype(np.float32)
    idxs = rng.integers(0, 5, n)
    got = batched_soft_nms(cupy.asarray(boxes), cupy.asarray(scores), cupy.asarray(idxs),
                           0.3, 0.5, 1e-3, method)
    assert_same((cupy.asnumpy(got[0]), cupy.asnumpy(got[1])),
                batched_soft_nms(boxes, scores, idxs, 0.3, 0.5, 1e-3, method))


def test_cuda_float16_decays_in_float32(cupy):
    rng = np.random.default_rng(1)
    n = 300
    xy = rng.integers(0, 400, (n, 2)) / 8.0
    boxes16 = np.concatenate([xy, xy + rng.integers(8, 160, (n, 2)) / 8.0],
                             axis=1).astype(np.float16)
    scores16 = (rng.integers(1, 50, n) / 64.0).astype(np.float16)
    dets, inds = soft_nms(cupy.asarray(boxes16), cupy.asarray(scores16), 0.3, 0.5, 1e-3, "linear")
    expected = soft_nms(boxes16.astype(np.float32), scores16.astype(np.float32), 0.3, 0.5, 1e-3,
                        "linear")
    assert dets.dtype == np.float16
    np.testing.assert_array_equal(cupy.asnumpy(inds), expected[1])
    np.testing.assert_array_equal(cupy.asnumpy(dets), expected[0].astype(np.float16))


# --- property tests (tests/support/properties.py) -----------------------------------

@st.composite
def soft_nms_case(draw, dtype):
    n = draw(st.integers(0, 10))
    boxes = draw(boxes_for(n, dtype))
    scores = draw(float_arrays((n,), dtype, -1, 1))
    idxs = (np.array(draw(st.lists(st.integers(-2, 2), min_size=n, max_size=n)), np.int64)
            if draw(st.booleans()) else None)
    threshold = draw(st.one_of(st.floats(-0.5, 1.5), st.sampled_from([0.0, 0.5, 1.0, math.inf])))
    sigma = draw(st.sampled_from([0.5, 0.01, 3.0]))
    min_score = draw(st.one_of(st.floats(-1, 1), st.sampled_from([0.0, 1e-3, -math.inf])))
    method = draw(st.sampled_from([0, 1, 2]))
    offset = draw(st.sampled_from([0, 1]))
    args = dict(boxes=guarded(boxes), scores=guarded(scores),
                idxs=None if idxs is None else guarded(idxs),
                dets=guarded(sentinel((n, 5), dtype)), keep=guarded(sentinel((n,), np.int64)),
                num_kept=guarded(sentinel((1,), np.int64)), iou_threshold=threshold,
                sigma=sigma, min_score=min_score, method=method, offset=offset)

    def check(a):
        expected = ref_soft_nms(boxes, scores, threshold, sigma, min_score, METHODS[method],
                                offset, idxs)
        kept = int(a["num_kept"][0])
        assert_same((a["dets"][:kept], a["keep"][:kept]), expected)
    return args, check


def user_case(draw, name, dtype, layout):
    a, _ = draw(soft_nms_case(dtype))
    method = METHODS[a["method"]]
    idxs = None
    if name == "batched_soft_nms":
        idxs = a["idxs"] if a["idxs"] is not None else np.zeros(len(a["scores"]), np.int64)
        idxs = idxs.astype(draw(st.sampled_from([np.int64, np.int32, np.uint8]))
                           if idxs.min(initial=0) >= 0 else np.int64)
    inputs = dict(boxes=layout(a["boxes"]), scores=layout(a["scores"]), idxs=layout(idxs))
    params = (a["iou_threshold"], a["sigma"], a["min_score"], method, a["offset"])

    def run():
        if name == "soft_nms":
            return soft_nms(inputs["boxes"], inputs["scores"], *params)
        return batched_soft_nms(inputs["boxes"], inputs["scores"], inputs["idxs"], *params)

    def verify(result):
        assert_same(result, ref_soft_nms(np.asarray(a["boxes"]), np.asarray(a["scores"]),
                                         *params[:4], params[4],
                                         None if idxs is None else idxs.astype(np.int64)))
    return run, inputs, verify


def torch_calls(torch, device):
    boxes = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6]], device=device)
    scores = torch.tensor([0.9, 0.8, 0.7], device=device)
    return [(boxes, scores, None, 0.5, 0.5, 1e-3, 1, 0),
            (boxes, scores, torch.tensor([0, 1, 0], device=device), 0.3, 0.5, 0.0, 2, 0),
            (boxes.double(), scores.double(), None, 0.1, 0.5, 0.2, 0, 1)]


class TestProperties(OpProperties):
    module = soft_nms_module
    torch_calls = {"soft_nms_impl": torch_calls}
    entry_cases = {"soft_nms_impl": soft_nms_case}
    fixed_axes = {"soft_nms_impl": {"boxes": [1], "scores": [0], "idxs": [0], "dets": [0, 1],
                                    "keep": [0], "num_kept": [0]}}
    bad_scalars = {"iou_threshold": [math.nan], "min_score": [math.nan], "method": [3, -1],
                   "offset": [2, -1]}
    user_cases = {"soft_nms": user_case, "batched_soft_nms": user_case}
    good_user_args = {
        "soft_nms": lambda: [MMCV_BOXES.copy(), MMCV_SCORES.copy(), 0.3, 0.5, 0.01, "linear", 0],
        "batched_soft_nms": lambda: [MMCV_BOXES.copy(), MMCV_SCORES.copy(),
                                     np.array([0, 1, 0, 1]), 0.3, 0.5, 0.01, "linear", 0],
    }
    user_bad_values = {
        ("soft_nms", 2): [math.nan, "0.5", None, [0.5], 2j],
        ("soft_nms", 4): [math.nan, "0", None],
        ("soft_nms", 5): ["hard", 1, None, "Linear"],
        ("soft_nms", 6): [2, -1, 0.5, "0", 2 ** 64],
        ("batched_soft_nms", 2): [np.array([0.0, 1.0, 0.0, 1.0]), np.array([0, 1]), "abc",
                                  [0, 1, 0, 1]],
    }
