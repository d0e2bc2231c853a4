"""nms_rotated / batched_nms_rotated (MMCV's semantics): exactly the
greedy definition on box_iou_rotated's values, classes, ties and NaN
scores, undefined boxes, thresholds, bad input, the MMCV drop-in,
properties and CPU/CUDA agreement."""
import importlib
import math

import numpy as np
import pytest
from hypothesis import strategies as st

from mmdispatch.ops import batched_nms_rotated, box_iou_rotated, nms, nms_rotated
from properties import OpProperties, float_arrays, guarded, sentinel

nms_module = importlib.import_module("mmdispatch.ops.nms_rotated")
DTYPES = [np.float32, np.float64]


def ref_keep(boxes, scores, threshold, idxs=None, clockwise=True):
    """The definition on box_iou_rotated's values: by descending score
    (NaN last, ties by index), keep a box unless a kept box of its class has
    IoU(kept, box) > threshold."""
    n = len(boxes)
    iou = box_iou_rotated(boxes, boxes, clockwise=clockwise) if n else np.zeros((0, 0))
    classes = np.zeros(n, np.int64) if idxs is None else np.asarray(idxs)
    key = [(1, 0.0, i) if math.isnan(s) else (0, -float(s), i) for i, s in enumerate(scores)]
    kept = []
    kept_mask = np.zeros(n, bool)
    for _, _, i in sorted(key):
        # in float64: a float32 IoU above the double threshold (NumPy 2 would
        # round the threshold to float32 to the nearest, not down)
        if not np.any(iou[kept_mask & (classes == classes[i]), i].astype(np.float64) > threshold):
            kept.append(i)
            kept_mask[i] = True
    return kept


def random_boxes(rng, n, dtype, spread=20.0):
    return np.concatenate([rng.uniform(0, spread, (n, 2)), rng.uniform(1, 6, (n, 2)),
                           rng.uniform(-math.pi, math.pi, (n, 1))], axis=1).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [0.0, 0.1, 0.3, 0.7, -0.5, 1.0])
@pytest.mark.parametrize("clockwise", [True, False])
def test_keeps_exactly_what_the_definition_keeps(dtype, threshold, clockwise):
    rng = np.random.default_rng(int(threshold * 10) + 10 + clockwise)
    boxes = random_boxes(rng, 300, dtype)
    scores = rng.random(300).astype(dtype)
    got = nms_rotated(boxes, scores, threshold, clockwise)
    assert got.dtype == np.int64
    assert got.tolist() == ref_keep(boxes, scores, threshold, clockwise=clockwise)
    if 0 < threshold < 1:
        assert 10 < len(got) < 300


def test_classes_never_suppress_each_other():
    rng = np.random.default_rng(1)
    boxes = random_boxes(rng, 200, np.float64)
    scores = rng.random(200)
    idxs = rng.integers(0, 4, 200)
    got = batched_nms_rotated(boxes, scores, idxs, 0.2)
    assert got.tolist() == ref_keep(boxes, scores, 0.2, idxs)
    # the same boxes in two classes are both kept
    twice = batched_nms_rotated(np.concatenate([boxes[:1], boxes[:1]]), np.array([0.9, 0.8]),
                                np.array([0, 1]), 0.5)
    assert twice.tolist() == [0, 1]
    assert batched_nms_rotated(boxes, scores, idxs.astype(np.int32), 0.2).tolist() == got.tolist()


def test_ties_keep_input_order_and_nan_scores_come_last():
    box = [5.0, 5.0, 4.0, 2.0, 0.3]
    boxes = np.array([box, box, box, [50, 50, 2, 2, 0]])
    assert nms_rotated(boxes, np.array([0.5, 0.5, 0.9, math.nan]), 0.5).tolist() == [2, 3]
    assert nms_rotated(boxes, np.array([0.5, 0.5, 0.1, 0.2]), 0.5).tolist() == [0, 3]
    assert nms_rotated(boxes, np.array([math.nan, 0.5, 0.1, 0.2]), 0.5).tolist() == [1, 3]


def test_rotation_matters_and_axis_aligned_boxes_agree_with_nms():
    rng = np.random.default_rng(2)
    boxes = random_boxes(rng, 200, np.float64)
    boxes[:, 4] = 0
    scores = rng.random(200)
    corners = np.concatenate([boxes[:, :2] - boxes[:, 2:4] / 2, boxes[:, :2] + boxes[:, 2:4] / 2],
                             axis=1)
    assert nms_rotated(boxes, scores, 0.3).tolist() == nms(corners, scores, 0.3).tolist()
    # a thin box and the same box turned a quarter overlap little
    cross = np.array([[0, 0, 10, 1, 0], [0, 0, 10, 1, math.pi / 2]])
    assert nms_rotated(cross, np.array([0.9, 0.8]), 0.2).tolist() == [0, 1]
    assert nms_rotated(cross[[0, 0]], np.array([0.9, 0.8]), 0.2).tolist() == [0]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [0.5, 1 / 3, 0.7, 1e-9])
@pytest.mark.parametrize("origin", [0.0, 1e6])
def test_nested_boxes_with_an_area_ratio_near_the_threshold_keep_what_the_definition_keeps(
        dtype, threshold, origin):
    """A box holding a narrower one (same centre, height and angle) has IoU =
    their area ratio, which bounds every pair's IoU: the kernel decides pairs
    whose ratio is below the threshold without their polygon, but only with a
    margin wider than the polygon's rounding. Ratios from 1e-6 below to 1e-6
    above the threshold, the narrower box kept first or second, near the
    origin and a million pixels away."""
    rows, scores = [], []
    for k, rel in enumerate([-1e-6, -1e-9, -1e-12, -1e-15, 0.0, 1e-15, 1e-12, 1e-9, 1e-6]):
        for inner_first in (False, True):
            cx, cy = origin + 100.0 * k, origin + 100.0 * inner_first
            outer = [cx, cy, 40.0, 8.0, 0.3]
            inner = [cx, cy, 40.0 * threshold * (1 + rel), 8.0, 0.3]
            rows += [outer, inner]
            scores += [0.5, 0.9] if inner_first else [0.9, 0.5]
    boxes, scores = np.array(rows, dtype), np.array(scores, dtype)
    got = nms_rotated(boxes, scores, threshold)
    assert got.tolist() == ref_keep(boxes, scores, threshold)
    assert len(boxes) // 2 < len(got) < len(boxes)   # some pairs suppress, some do not


ROUNDED_AWAY = [
    # a box small beside its coordinates: its corners vanish in the rounding,
    # the clipped polygon is not the intersection, and box_iou_rotated gives
    # an IoU of about 3e12 for an area ratio of 2e-31
    ([[0.0, 0.0, 10000.0, 1.0, 1.0], [-1874.5, 1250.25, 1e-14, 2e-14, 0.0]], 0.5, DTYPES),
    # the same far apart: box_iou_rotated gives 7e-17 > 0 for boxes whose
    # bounding rectangles are 3.3e7 apart (within reach of each other)
    ([[12223192.799801689, 29748803.2416144, 247346302811.25006, 0.3132183255467909, 1e-07],
      [62625197.74709353, 62780506.9802173, 3.992390377347512e-08, 1.249554426724923e-12,
       1.5707963367948965]], 0.0, DTYPES),
    # subnormal areas (2002 and 4006 x 2^-1074): the polygon's 2004 gives 0.5005
    ([[0.0, 0.0, 9.945448320584526e-161, 9.945448320584526e-161, 0.0],
      [0.0, 0.0, 1.989089664116905e-160, 9.95042602740449e-161, 0.0]], 0.5, [np.float64]),
    # boxes so large that squared distances overflow
    ([[0.0, 0.0, 1e200, 1e200, 0.3], [3e200, 0.0, 1e200, 1e200, 0.0]], 0.0, [np.float64]),
]


@pytest.mark.parametrize("boxes, threshold, dtype", [
    (boxes, threshold, dtype) for boxes, threshold, dtypes in ROUNDED_AWAY for dtype in dtypes])
def test_boxes_whose_polygon_is_not_their_intersection_keep_what_box_iou_rotated_says(
        boxes, threshold, dtype):
    """nms_rotated follows box_iou_rotated's values even where rounding makes
    them wrong geometry (found by a reviewer's fuzzing): the area and grid
    shortcuts leave such pairs to the polygon."""
    boxes = np.array(boxes, dtype)
    scores = np.array([0.9, 0.8], dtype)
    assert nms_rotated(boxes, scores, threshold).tolist() == ref_keep(boxes, scores, threshold)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("threshold", [0.0, 0.3, 0.6])
def test_thousands_of_boxes_over_several_decision_blocks_keep_what_the_definition_keeps(
        dtype, threshold):
    """The kernel decides 1,024 boxes at a time (against the boxes kept before
    the block, shared out over threads, then within the block in order), each
    box meeting only the kept boxes whose reach squares share a grid
    cell with its own: 3,000 crowded boxes of 3 classes, a few of them large
    (kept out of the grid; half of those ahead of every other box),
    zero-size or undefined."""
    rng = np.random.default_rng(17)
    n = 3000
    boxes = random_boxes(rng, n, np.float64, spread=150.0)
    large = rng.random(n) < 0.02
    boxes[large, 2:4] = rng.uniform(60, 150, (int(large.sum()), 2))
    special = rng.random(n)
    boxes[special < 0.01, 2] = 0.0
    boxes[(special >= 0.01) & (special < 0.02), 0] = math.nan
    boxes[(special >= 0.02) & (special < 0.03), 3] = -2.0
    boxes = boxes.astype(dtype)
    scores = rng.random(n)
    scores[large & (rng.random(n) < 0.5)] += 1   # half the large boxes come first
    scores = scores.astype(dtype)
    idxs = rng.integers(0, 3, n)
    got = batched_nms_rotated(boxes, scores, idxs, threshold)
    assert got.tolist() == ref_keep(boxes, scores, threshold, idxs)
    rank = np.empty(n, np.int64)
    rank[np.lexsort((np.arange(n), -scores.astype(np.float64)))] = np.arange(n)
    suppressed = np.setdiff1d(np.arange(n), got)
    assert set(rank[suppressed] // 1024) == {0, 1, 2}   # suppressions in every block


def test_undefined_boxes_neither_suppress_nor_are_suppressed():
    box = [5.0, 5.0, 4.0, 2.0, 0.3]
    boxes = np.array([box, [math.nan, 5, 4, 2, 0.3], [5, 5, -4, 2, 0.3], box])
    assert nms_rotated(boxes, np.array([0.9, 0.8, 0.7, 0.6]), 0.5).tolist() == [0, 1, 2]


def test_empty_input_keeps_nothing():
    assert nms_rotated(np.zeros((0, 5)), np.zeros(0), 0.5).tolist() == []


@pytest.mark.parametrize("call, error, message", [
    (lambda: nms_rotated(np.zeros((2, 4)), np.zeros(2), 0.5), ValueError,
     r"^nms_rotated_impl: boxes must have shape \(\*, 5\)"),
    (lambda: nms_rotated(np.zeros((2, 5)), np.zeros(3), 0.5), ValueError,
     r"^nms_rotated_impl: scores must have shape \(2,\)"),
    (lambda: nms_rotated(np.zeros((2, 5)), np.zeros(2), math.nan), ValueError,
     r"^nms_rotated_impl: iou_threshold must not be NaN"),
    (lambda: nms_rotated(np.zeros((2, 5)), np.zeros(2, np.float32), 0.5), TypeError,
     r"^nms_rotated_impl: scores"),
    (lambda: nms_rotated(np.zeros((2, 5)), np.zeros(2), 0.5, clockwise="yes"), TypeError,
     r"^nms_rotated: clockwise must be a bool"),
    (lambda: batched_nms_rotated(np.zeros((2, 5)), np.zeros(2), np.zeros(2), 0.5), TypeError,
     r"^batched_nms_rotated: idxs must have an integer dtype"),
    (lambda: nms_rotated(np.zeros(5), np.zeros(1), 0.5), ValueError,
     r"^nms_rotated: boxes must be 2-D"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- the PyTorch layer -----------------------------------------------------------------------

def test_mmcv_drop_in_returns_dets_and_indices():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch.mmcv import nms_rotated as mmcv_nms_rotated
    rng = np.random.default_rng(3)
    boxes, scores = random_boxes(rng, 100, np.float32), rng.random(100).astype(np.float32)
    labels = rng.integers(0, 3, 100)
    dets, keep = mmcv_nms_rotated(torch.from_numpy(boxes), torch.from_numpy(scores), 0.3)
    expected = ref_keep(boxes, scores, 0.3)
    assert keep.tolist() == expected and dets.shape == (len(expected), 6)
    np.testing.assert_array_equal(dets[:, :5].numpy(), boxes[expected])
    np.testing.assert_array_equal(dets[:, 5].numpy(), scores[expected])
    _, keep = mmcv_nms_rotated(torch.from_numpy(boxes), torch.from_numpy(scores), 0.3,
                               torch.from_numpy(labels))
    assert keep.tolist() == ref_keep(boxes, scores, 0.3, labels)
    dets, keep = mmcv_nms_rotated(torch.zeros(0, 5), torch.zeros(0), 0.3)
    assert dets.shape == (0, 5) and keep is None   # as MMCV returns no boxes


# --- CUDA ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(cupy, dtype):
    rng = np.random.default_rng(11)
    boxes, scores = random_boxes(rng, 3000, dtype, 200), rng.random(3000).astype(dtype)
    idxs = rng.integers(0, 5, 3000)
    for threshold in (0.1, 0.5):
        got = nms_rotated(cupy.asarray(boxes), cupy.asarray(scores), threshold)
        assert cupy.asnumpy(got).tolist() == nms_rotated(boxes, scores, threshold).tolist()
    got = batched_nms_rotated(cupy.asarray(boxes), cupy.asarray(scores), cupy.asarray(idxs), 0.3)
    assert cupy.asnumpy(got).tolist() == batched_nms_rotated(boxes, scores, idxs, 0.3).tolist()


# --- properties (tests/support/properties.py) --------------------------------------------------

@st.composite
def nms_case(draw, dtype):
    n = draw(st.integers(0, 6))
    boxes = draw(float_arrays((n, 5), dtype, -3, 3))
    boxes[:, 2:4] = np.abs(boxes[:, 2:4]) if draw(st.booleans()) else boxes[:, 2:4]
    scores = draw(float_arrays((n,), dtype, 0, 1))
    idxs = (np.array(draw(st.lists(st.integers(0, 2), min_size=n, max_size=n)), np.int64)
            if draw(st.booleans()) else None)
    threshold = draw(st.sampled_from([0.0, 0.3, 0.5, 1.0, -1.0]))
    clockwise = draw(st.booleans())
    args = dict(boxes=guarded(boxes), scores=guarded(scores),
                idxs=None if idxs is None else guarded(idxs),
                keep=guarded(sentinel((n,), np.int64)),
                num_kept=guarded(sentinel((1,), np.int64)), iou_threshold=threshold,
                clockwise=clockwise)

    def check(a):
        expected = ref_keep(boxes, scores, threshold, idxs, clockwise)
        assert int(a["num_kept"][0]) == len(expected)
        assert a["keep"][:len(expected)].tolist() == expected
    return args, check


def user_case(draw, name, dtype, layout):
    a, check = draw(nms_case(dtype))
    batched = name == "batched_nms_rotated"
    if batched and a["idxs"] is None:
        a = dict(a, idxs=guarded(np.zeros(len(a["scores"]), np.int64)))
    inputs = {"boxes": layout(a["boxes"]), "scores": layout(a["scores"])}
    if batched:
        inputs["idxs"] = layout(a["idxs"])

    def run():
        if batched:
            return batched_nms_rotated(inputs["boxes"], inputs["scores"], inputs["idxs"],
                                       a["iou_threshold"], a["clockwise"])
        return nms_rotated(inputs["boxes"], inputs["scores"], a["iou_threshold"], a["clockwise"])

    def verify(result):
        expected = ref_keep(a["boxes"], a["scores"], a["iou_threshold"],
                            a["idxs"] if batched else None, a["clockwise"])
        assert np.asarray(result).tolist() == expected
    return run, inputs, verify


def torch_calls(torch, device):
    rng = np.random.default_rng(0)
    boxes = torch.from_numpy(random_boxes(rng, 20, np.float64, 8)).to(device)
    scores = torch.rand(20, dtype=torch.float64, device=device)
    return [(boxes, scores, None, 0.3, True),
            (boxes, scores, torch.randint(0, 3, (20,), device=device), 0.5, False)]


def small_args():
    return [random_boxes(np.random.default_rng(0), 4, np.float64), np.array([0.9, 0.1, 0.5, 0.3])]


class TestProperties(OpProperties):
    module = nms_module
    torch_calls = {"nms_rotated_impl": torch_calls}
    entry_cases = {"nms_rotated_impl": nms_case}
    fixed_axes = {"nms_rotated_impl": {"boxes": [1], "scores": [0], "idxs": [0], "keep": [0],
                                       "num_kept": [0]}}
    bad_scalars = {"iou_threshold": [math.nan]}
    user_cases = {name: user_case for name in nms_module.__all__}
    good_user_args = {"nms_rotated": lambda: small_args() + [0.5, True],
                      "batched_nms_rotated": lambda: small_args()[:2] + [np.zeros(4, np.int64),
                                                                         0.5, True]}
    user_bad_values = {
        ("nms_rotated", 2): [math.nan, "0.5", None],
        ("nms_rotated", 3): [1, "yes", None],
        ("batched_nms_rotated", 2): [np.zeros(4), np.zeros(3, np.int64), [0, 0, 0, 0]],
    }
