"""box_iou_rotated (MMCV's semantics): MMCV's published values, an
independent reference (the intersection as the convex hull of the corners
inside the other box and the edge crossings), exact cases (identical,
nested, touching, turned by multiples of pi/2, zero-size), undefined boxes,
bad input, the MMCV drop-in, properties and CPU/CUDA agreement."""
import importlib
import math

import numpy as np
import pytest
from hypothesis import strategies as st

from mmdispatch.ops import bbox_overlaps, box_iou_rotated
from properties import OpProperties, assert_close, float_arrays, guarded, sentinel

iou_module = importlib.import_module("mmdispatch.ops.box_iou_rotated")
DTYPES = [np.float32, np.float64]


# --- reference ---------------------------------------------------------------------------------

def corners(box, clockwise=True):
    cx, cy, w, h, angle = map(float, box)
    a = angle if clockwise else -angle
    c, s = math.cos(a), math.sin(a)
    return [(cx + dx * c - dy * s, cy + dx * s + dy * c)
            for dx, dy in ((-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2))]


def cross(o, a, b):
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def inside(p, polygon, eps=1e-9):
    return all(cross(polygon[i], polygon[(i + 1) % 4], p) >= -eps for i in range(4))


def crossings(p, q):
    found = []
    for i in range(4):
        a, b = p[i], p[(i + 1) % 4]
        for j in range(4):
            c, d = q[j], q[(j + 1) % 4]
            den = (b[0] - a[0]) * (d[1] - c[1]) - (b[1] - a[1]) * (d[0] - c[0])
            # (nearly) parallel edges: their shared points are corners found inside
            if abs(den) <= 1e-12 * math.dist(a, b) * math.dist(c, d):
                continue
            t = ((c[0] - a[0]) * (d[1] - c[1]) - (c[1] - a[1]) * (d[0] - c[0])) / den
            u = ((c[0] - a[0]) * (b[1] - a[1]) - (c[1] - a[1]) * (b[0] - a[0])) / den
            if 0 <= t <= 1 and 0 <= u <= 1:
                found.append((a[0] + t * (b[0] - a[0]), a[1] + t * (b[1] - a[1])))
    return found


def hull_area(points):
    if len(points) < 3:
        return 0.0
    mx = sum(p[0] for p in points) / len(points)
    my = sum(p[1] for p in points) / len(points)
    points = sorted(points, key=lambda p: math.atan2(p[1] - my, p[0] - mx))
    return abs(sum(points[i][0] * points[(i + 1) % len(points)][1]
                   - points[(i + 1) % len(points)][0] * points[i][1]
                   for i in range(len(points)))) / 2


def ref_overlap(b1, b2, mode="iou", clockwise=True):
    values = [float(v) for v in (*b1, *b2)]
    if not all(math.isfinite(v) for v in values) or min(values[2], values[3], values[7],
                                                         values[8]) < 0:
        return math.nan
    p, q = corners(b1, clockwise), corners(b2, clockwise)
    a1, a2 = values[2] * values[3], values[7] * values[8]
    inter = 0.0
    if a1 > 0 and a2 > 0:
        inter = hull_area([c for c in p if inside(c, q)] + [c for c in q if inside(c, p)]
                          + crossings(p, q))
    base = a1 + a2 - inter if mode == "iou" else a1
    return inter / base if base > 0 else 0.0


def ref_table(boxes1, boxes2, mode="iou", aligned=False, clockwise=True):
    if aligned:
        return np.array([ref_overlap(a, b, mode, clockwise) for a, b in zip(boxes1, boxes2)])
    return np.array([[ref_overlap(a, b, mode, clockwise) for b in boxes2] for a in boxes1]
                    ).reshape(len(boxes1), len(boxes2))


def random_boxes(rng, n, dtype, spread=6.0):
    boxes = np.concatenate([rng.uniform(0, spread, (n, 2)), rng.uniform(0.2, 4, (n, 2)),
                            rng.uniform(-math.pi, math.pi, (n, 1))], axis=1)
    return boxes.astype(dtype)


# --- values --------------------------------------------------------------------------------------

MMCV_BOXES1 = [[1.0, 1.0, 3.0, 4.0, 0.5], [2.0, 2.0, 3.0, 4.0, 0.6], [7.0, 7.0, 8.0, 8.0, 0.4]]
MMCV_BOXES2 = [[0.0, 2.0, 2.0, 5.0, 0.3], [2.0, 1.0, 3.0, 3.0, 0.5], [5.0, 5.0, 6.0, 7.0, 0.4]]
MMCV_IOU = [[0.3708, 0.4351, 0.0000], [0.1104, 0.4487, 0.0424], [0.0000, 0.0000, 0.3622]]
MMCV_IOF = [[0.4959, 0.5306, 0.0000], [0.1823, 0.5420, 0.1832], [0.0000, 0.0000, 0.4404]]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode, expected", [("iou", MMCV_IOU), ("iof", MMCV_IOF)])
def test_matches_mmcv_published_values_both_angle_conventions(dtype, mode, expected):
    b1, b2 = np.array(MMCV_BOXES1, dtype), np.array(MMCV_BOXES2, dtype)
    np.testing.assert_allclose(box_iou_rotated(b1, b2, mode), expected, atol=1e-4)
    np.testing.assert_allclose(box_iou_rotated(b1, b2, mode, aligned=True),
                               np.diag(expected), atol=1e-4)
    flipped1, flipped2 = b1.copy(), b2.copy()
    flipped1[:, 4] *= -1
    flipped2[:, 4] *= -1
    np.testing.assert_allclose(box_iou_rotated(flipped1, flipped2, mode, clockwise=False),
                               expected, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["iou", "iof"])
@pytest.mark.parametrize("clockwise", [True, False])
def test_random_boxes_match_the_reference(dtype, mode, clockwise):
    rng = np.random.default_rng(len(mode) + clockwise)
    b1, b2 = random_boxes(rng, 40, dtype), random_boxes(rng, 30, dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-9, atol=1e-12)
    got = box_iou_rotated(b1, b2, mode, clockwise=clockwise)
    assert got.dtype == dtype and got.shape == (40, 30)
    np.testing.assert_allclose(got, ref_table(b1, b2, mode, clockwise=clockwise), **tol)
    assert (got > 0).mean() > 0.2   # the case is not mostly disjoint boxes
    np.testing.assert_allclose(box_iou_rotated(b1, b2[:1].repeat(40, 0), mode, True, clockwise),
                               ref_table(b1, b2[:1].repeat(40, 0), mode, True, clockwise), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", ["iou", "iof"])
def test_a_table_wider_than_a_block_of_columns_equals_its_pairs_one_by_one(dtype, mode):
    """The CPU kernel readies boxes2 1,024 at a time: every entry of a
    3-row table of 2,500 columns (undefined boxes among them) is the same
    bits as its pair computed alone, in aligned mode."""
    rng = np.random.default_rng(9)
    b1, b2 = random_boxes(rng, 3, dtype), random_boxes(rng, 2500, dtype)
    b2[::97, 0] = math.nan
    got = box_iou_rotated(b1, b2, mode)
    assert (got > 0).sum() > 1000
    for i in range(3):
        np.testing.assert_array_equal(got[i], box_iou_rotated(b1[[i] * 2500], b2, mode, True))


def test_exact_cases():
    square = [0.0, 0.0, 2.0, 2.0, 0.0]
    cases = [
        (square, square, 1.0),                                    # identical
        ([3, 4, 2, 6, 0.7], [3, 4, 2, 6, 0.7], 1.0),               # identical, turned
        ([3, 4, 2, 6, 0.7], [3, 4, 6, 2, 0.7 + math.pi / 2], 1.0),  # the same box, other sides
        ([3, 4, 2, 6, 0.7], [3, 4, 2, 6, 0.7 + math.pi], 1.0),      # half a turn
        (square, [0.0, 0.0, 2.0, 2.0, math.pi / 4], 1 / math.sqrt(2)),   # the octagon
        (square, [2.0, 0.0, 2.0, 2.0, 0.0], 0.0),                 # touching edges
        (square, [2.0, 2.0, 2.0, 2.0, 0.0], 0.0),                 # touching corners
        (square, [1.0, 0.0, 2.0, 2.0, 0.0], 1 / 3),               # half overlapping
        (square, [0.0, 0.0, 1.0, 1.0, 0.3], 0.25),                # nested
        ([0.2, 0.1, 1.0, 0.5, 0.3], [0, 0, 8.0, 8.0, 1.1], 0.5 / 64),  # nested, turned
        (square, [0.0, 0.0, 0.0, 2.0, 0.0], 0.0),                 # zero width
        ([0, 0, 0, 0, 0], [0, 0, 0, 0, 0], 0.0),                  # both empty
    ]
    b1 = np.array([c[0] for c in cases], np.float64)
    b2 = np.array([c[1] for c in cases], np.float64)
    np.testing.assert_allclose(box_iou_rotated(b1, b2, aligned=True), [c[2] for c in cases],
                               rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(box_iou_rotated(b1.astype(np.float32), b2.astype(np.float32),
                                               aligned=True), [c[2] for c in cases], atol=2e-6)


def test_thin_boxes_meet_themselves_whole_and_others_in_no_more_than_their_area():
    """A box 1e-13 thick and 2.3 long: clipping leaves rounding of about
    1e-16 of the length in the area, 0.1 % of this box's. Met by itself it
    gives 1, and crossing a box 1e-300 thick (area 3e-300) it cannot
    share more than that area (it gave 6e-5 one way and 0 the other)."""
    a = [-6.797949678102604, 9.84374512758237, 2.2613206241255526, 1e-13, -3.9486787208516727]
    b = [-7.059811125877052, 10.472500636224916, 3.1946274990108336, 1e-300, 0.6850221312887079]
    boxes = np.array([a, b])
    got = box_iou_rotated(boxes, boxes)
    assert got[0, 0] == got[1, 1] == 1.0
    assert 0 <= got[0, 1] < 1e-280 and 0 <= got[1, 0] < 1e-280
    for mode in ("iou", "iof"):
        np.testing.assert_array_equal(box_iou_rotated(boxes, boxes, mode),
                                      box_iou_rotated(boxes, boxes, mode, clockwise=False))
    # sides that rounding absorbs into the same corners: not the same box
    # (the intersection is the smaller one; it gave IoU 2.0 one way)
    thin = np.array([[0, 0, 1, 2e-20, 0.3], [0, 0, 1, 1e-20, 0.3]])
    np.testing.assert_allclose(box_iou_rotated(thin[:1], thin[1:]), [[0.5]], rtol=1e-12)
    np.testing.assert_allclose(box_iou_rotated(thin[1:], thin[:1]), [[0.5]], rtol=1e-12)
    np.testing.assert_allclose(box_iou_rotated(thin[1:], thin[:1], "iof"), [[1.0]], rtol=1e-12)


def test_a_box_whose_area_leaves_doubles_range_is_undefined_or_of_zero_size():
    """Areas are w * h in double: past about 1e154 a side's area overflows
    (NaN: undefined, as a non-finite box; it gave 0 for a box met by
    itself); below about 1e-154 it underflows to 0 (a zero-size box)."""
    huge, tiny = [0, 0, 1e155, 1e155, 0.0], [0, 0, 1e-200, 1e-200, 0.0]
    normal = [0, 0, 1e150, 1e150, 0.0]
    got = box_iou_rotated(np.array([huge, tiny, normal]), np.array([huge, tiny, normal]),
                          aligned=True)
    assert np.isnan(got[0]) and got[1] == 0 and got[2] == 1


def test_axis_aligned_boxes_agree_with_bbox_overlaps():
    rng = np.random.default_rng(3)
    b1, b2 = random_boxes(rng, 20, np.float64), random_boxes(rng, 15, np.float64)
    b1[:, 4] = 0
    b2[:, 4] = rng.choice([0, math.pi, -math.pi], 15)

    def corners_of(b):
        return np.concatenate([b[:, :2] - b[:, 2:4] / 2, b[:, :2] + b[:, 2:4] / 2], axis=1)
    for mode in ("iou", "iof"):
        np.testing.assert_allclose(box_iou_rotated(b1, b2, mode),
                                   bbox_overlaps(corners_of(b1), corners_of(b2), mode),
                                   rtol=1e-10, atol=1e-12)


def test_far_from_the_origin_the_result_is_the_same():
    rng = np.random.default_rng(4)
    b1, b2 = random_boxes(rng, 10, np.float64), random_boxes(rng, 10, np.float64)
    near = box_iou_rotated(b1, b2)
    b1[:, :2] += 1e6
    b2[:, :2] += 1e6
    np.testing.assert_allclose(box_iou_rotated(b1, b2), near, rtol=1e-9, atol=1e-9)


def test_undefined_boxes_give_nan_for_their_pairs_only():
    good = [1.0, 1.0, 2.0, 2.0, 0.1]
    bad = [[math.nan, 1, 2, 2, 0], [1, 1, -2, 2, 0], [1, 1, 2, 2, math.inf],
           [1, 1, math.inf, 2, 0]]
    b1 = np.array([good] + bad)
    got = box_iou_rotated(b1, np.array([good, good]))
    assert (got[0] > 0.99).all() and np.isnan(got[1:]).all()


def test_empty_inputs_give_empty_results():
    assert box_iou_rotated(np.zeros((0, 5)), np.zeros((3, 5))).shape == (0, 3)
    assert box_iou_rotated(np.zeros((0, 5)), np.zeros((0, 5)), aligned=True).shape == (0,)


@pytest.mark.parametrize("call, error, message", [
    (lambda: box_iou_rotated(np.zeros((2, 4)), np.zeros((2, 5))), ValueError,
     r"^box_iou_rotated_impl: boxes1 must have shape \(\*, 5\)"),
    (lambda: box_iou_rotated(np.zeros((2, 5)), np.zeros((2, 4))), ValueError,
     r"^box_iou_rotated_impl: boxes2 must have shape"),
    (lambda: box_iou_rotated(np.zeros(5), np.zeros((2, 5))), ValueError,
     r"^box_iou_rotated: boxes1 must be 2-D"),
    (lambda: box_iou_rotated(np.zeros((2, 5)), np.zeros((3, 5)), aligned=True), ValueError,
     r"^box_iou_rotated_impl: aligned needs as many boxes2 as boxes1, got 2 and 3"),
    (lambda: box_iou_rotated(np.zeros((2, 5)), np.zeros((2, 5)), "giou"), ValueError,
     r"^box_iou_rotated: mode must be one of 'iou', 'iof'"),
    (lambda: box_iou_rotated(np.zeros((2, 5)), np.zeros((2, 5)), clockwise=1), TypeError,
     r"^box_iou_rotated: clockwise must be a bool"),
    (lambda: box_iou_rotated(np.zeros((2, 5)), np.zeros((2, 5), np.float32)), TypeError,
     r"^box_iou_rotated_impl: boxes2"),
    (lambda: box_iou_rotated(np.zeros((2, 5), np.float16), np.zeros((2, 5), np.float16)),
     TypeError, r"^box_iou_rotated_impl: boxes1 .*float16"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


# --- the PyTorch layer -----------------------------------------------------------------------

def test_mmcv_drop_in_takes_mmcvs_arguments():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch.mmcv import box_iou_rotated as mmcv_box_iou_rotated
    b1, b2 = torch.tensor(MMCV_BOXES1), torch.tensor(MMCV_BOXES2)
    np.testing.assert_allclose(mmcv_box_iou_rotated(b1, b2).numpy(), MMCV_IOU, atol=1e-4)
    np.testing.assert_allclose(mmcv_box_iou_rotated(b1, b2, "iof", True).numpy(),
                               np.diag(MMCV_IOF), atol=1e-4)
    flipped1, flipped2 = b1.clone(), b2.clone()
    flipped1[:, 4] *= -1
    flipped2[:, 4] *= -1
    np.testing.assert_allclose(mmcv_box_iou_rotated(flipped1, flipped2, clockwise=False).numpy(),
                               MMCV_IOU, atol=1e-4)


# --- CUDA ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(cupy, dtype):
    rng = np.random.default_rng(11)
    b1, b2 = random_boxes(rng, 300, dtype), random_boxes(rng, 200, dtype)
    for mode in ("iou", "iof"):
        np.testing.assert_allclose(
            cupy.asnumpy(box_iou_rotated(cupy.asarray(b1), cupy.asarray(b2), mode)),
            box_iou_rotated(b1, b2, mode), rtol=1e-6, atol=1e-7)


def test_cuda_float16_and_bfloat16(torch_cuda):
    torch = torch_cuda
    b1, b2 = torch.tensor(MMCV_BOXES1), torch.tensor(MMCV_BOXES2)
    for dtype in (torch.float16, torch.bfloat16):
        got = box_iou_rotated(b1.cuda().to(dtype), b2.cuda().to(dtype))
        assert got.dtype == dtype
        np.testing.assert_allclose(got.float().cpu().numpy(), MMCV_IOU, atol=3e-2)


# --- properties (tests/support/properties.py) --------------------------------------------------

@st.composite
def overlap_case(draw, dtype):
    n, m = draw(st.integers(0, 4)), draw(st.integers(0, 4))
    aligned = draw(st.booleans())
    if aligned:
        m = n
    b1 = draw(float_arrays((n, 5), dtype, -4, 4))
    b2 = draw(float_arrays((m, 5), dtype, -4, 4))
    mode, clockwise = draw(st.integers(0, 1)), draw(st.booleans())
    shape = (n,) if aligned else (n, m)
    args = dict(boxes1=guarded(b1), boxes2=guarded(b2), ious=guarded(sentinel(shape, dtype)),
                mode=mode, aligned=aligned, clockwise=clockwise)

    def check(a):
        expected = ref_table(b1, b2, ("iou", "iof")[mode], aligned, clockwise)
        # quarters make many exactly touching or collinear edges: a reference in
        # float64 of another algorithm agrees to rounding there
        np.testing.assert_allclose(np.asarray(a["ious"], np.float64), expected, equal_nan=True,
                                   rtol=1e-4 if dtype == np.float32 else 1e-7, atol=1e-6)
    return args, check


def user_case(draw, name, dtype, layout):
    a, check = draw(overlap_case(dtype))
    inputs = {"boxes1": layout(a["boxes1"]), "boxes2": layout(a["boxes2"])}

    def run():
        return box_iou_rotated(inputs["boxes1"], inputs["boxes2"], ("iou", "iof")[a["mode"]],
                               a["aligned"], a["clockwise"])
    return run, inputs, lambda result: check(dict(a, ious=result))


def torch_calls(torch, device):
    b1 = torch.tensor(MMCV_BOXES1, dtype=torch.float64, device=device)
    b2 = torch.tensor(MMCV_BOXES2, dtype=torch.float64, device=device)
    return [(b1, b2, 0, False, True), (b1, b2, 1, True, False)]


class TestProperties(OpProperties):
    module = iou_module
    torch_calls = {"box_iou_rotated_impl": torch_calls}
    entry_cases = {"box_iou_rotated_impl": overlap_case}
    fixed_axes = {"box_iou_rotated_impl": {"boxes1": [1], "boxes2": [1], "ious": [0]}}
    bad_scalars = {"mode": [-1, 2]}
    user_cases = {"box_iou_rotated": user_case}
    good_user_args = {"box_iou_rotated": lambda: [np.array(MMCV_BOXES1), np.array(MMCV_BOXES2),
                                                  "iou", False, True]}
    user_bad_values = {
        ("box_iou_rotated", 2): ["giou", None, 0],
        ("box_iou_rotated", 3): [1, "yes", None],
        ("box_iou_rotated", 4): [0, "no", None],
    }
