"""roi_align_rotated (MMCV's semantics): MMCV's published values, a slow
reference written from the definition (turned sample points, bilinear
interpolation), agreement with roi_align at angle 0, finite differences,
bad rois writing nothing, the MMCV drop-in and module with gradcheck,
properties, and CPU/CUDA agreement."""
import importlib
import math

import numpy as np
import pytest
from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import roi_align, roi_align_rotated, roi_align_rotated_backward
from properties import OpProperties, assert_close, float_arrays, guarded, sentinel
from references import mmcv_bilinear_terms

rotated_module = importlib.import_module("mmdispatch.ops.roi_align_rotated")
DTYPES = [np.float32, np.float64]


# --- reference, from the definition, in float64 -------------------------------------------

def samples(roi, pooled, scale, ratio, aligned, clockwise):
    """{(ph, pw): [(y, x)]} of one roi, and the count each bin divides by."""
    _, cx, cy, w, h, angle = (float(v) for v in roi)
    offset = 0.5 if aligned else 0.0
    cx, cy, w, h = cx * scale - offset, cy * scale - offset, w * scale, h * scale
    if not aligned:
        w, h = max(w, 1.0), max(h, 1.0)
    theta = -angle if clockwise else angle
    bin_h, bin_w = h / pooled[0], w / pooled[1]
    grid_h = ratio if ratio > 0 else math.ceil(bin_h)
    grid_w = ratio if ratio > 0 else math.ceil(bin_w)
    points = {}
    for ph in range(pooled[0]):
        for pw in range(pooled[1]):
            points[ph, pw] = []
            for iy in range(grid_h):
                for ix in range(grid_w):
                    yy = -h / 2 + ph * bin_h + (iy + 0.5) * bin_h / grid_h
                    xx = -w / 2 + pw * bin_w + (ix + 0.5) * bin_w / grid_w
                    points[ph, pw].append((yy * math.cos(theta) - xx * math.sin(theta) + cy,
                                           yy * math.sin(theta) + xx * math.cos(theta) + cx))
    return points, max(grid_h * grid_w, 1)


def ref_forward(x, rois, pooled, scale, ratio, aligned, clockwise):
    x = np.asarray(x, np.float64)
    out = np.zeros((len(rois), x.shape[1]) + tuple(pooled))
    for k, roi in enumerate(rois):
        points, count = samples(roi, pooled, scale, ratio, aligned, clockwise)
        for (ph, pw), pts in points.items():
            for y, xx in pts:
                for r, c, wgt in mmcv_bilinear_terms(x.shape[2], x.shape[3], y, xx):
                    with np.errstate(invalid="ignore"):   # 0 x inf in the map
                        out[k, :, ph, pw] += wgt * x[int(roi[0]), :, r, c]
            out[k, :, ph, pw] /= count
    return out


def ref_backward(grad, rois, shape, pooled, scale, ratio, aligned, clockwise):
    grad_input = np.zeros(shape)
    for k, roi in enumerate(rois):
        points, count = samples(roi, pooled, scale, ratio, aligned, clockwise)
        for (ph, pw), pts in points.items():
            for y, xx in pts:
                for r, c, wgt in mmcv_bilinear_terms(shape[2], shape[3], y, xx):
                    grad_input[int(roi[0]), :, r, c] += wgt * grad[k, :, ph, pw] / count
    return grad_input


def random_case(rng, dtype, n=2, c=3, hw=(9, 11), k=6):
    x = rng.standard_normal((n, c) + hw).astype(dtype)
    rois = np.concatenate([rng.integers(0, n, (k, 1)), rng.uniform(-1, 12, (k, 2)),
                           rng.uniform(0.5, 7, (k, 2)), rng.uniform(-4, 4, (k, 1))], axis=1)
    return x, rois.astype(dtype)


# --- values --------------------------------------------------------------------------------

MMCV_CASES = [   # MMCV's test_roi_align_rotated.py: output 2x2, scale 1, ratio 2, aligned
    ([[[[1., 2.], [3., 4.]]]], [[0., 0.5, 0.5, 1., 1., 0]], [[[[1.0, 1.25], [1.5, 1.75]]]],
     [[[[3.0625, 0.4375], [0.4375, 0.0625]]]]),
    ([[[[1., 2.], [3., 4.]]]], [[0., 0.5, 0.5, 1., 1., np.pi / 2]],
     [[[[1.5, 1], [1.75, 1.25]]]], [[[[3.0625, 0.4375], [0.4375, 0.0625]]]]),
    ([[[[1., 2.], [3., 4.]], [[4., 3.], [2., 1.]]]], [[0., 0.5, 0.5, 1., 1., 0]],
     [[[[1.0, 1.25], [1.5, 1.75]], [[4.0, 3.75], [3.5, 3.25]]]],
     [[[[3.0625, 0.4375], [0.4375, 0.0625]], [[3.0625, 0.4375], [0.4375, 0.0625]]]]),
    ([[[[1., 2., 5., 6.], [3., 4., 7., 8.], [9., 10., 13., 14.], [11., 12., 15., 16.]]]],
     [[0., 1.5, 1.5, 3., 3., 0]], [[[[1.9375, 4.75], [7.5625, 10.375]]]],
     [[[[0.47265625, 0.42968750, 0.42968750, 0.04296875],
        [0.42968750, 0.39062500, 0.39062500, 0.03906250],
        [0.42968750, 0.39062500, 0.39062500, 0.03906250],
        [0.04296875, 0.03906250, 0.03906250, 0.00390625]]]]),
    ([[[[1., 2., 5., 6.], [3., 4., 7., 8.], [9., 10., 13., 14.], [11., 12., 15., 16.]]]],
     [[0., 1.5, 1.5, 3., 3., np.pi / 2]], [[[[7.5625, 1.9375], [10.375, 4.75]]]],
     [[[[0.47265625, 0.42968750, 0.42968750, 0.04296875],
        [0.42968750, 0.39062500, 0.39062500, 0.03906250],
        [0.42968750, 0.39062500, 0.39062500, 0.03906250],
        [0.04296875, 0.03906250, 0.03906250, 0.00390625]]]]),
]


@pytest.mark.parametrize("case", MMCV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_mmcv_published_values(case, dtype):
    x, rois, out, grad = (np.array(a, dtype) for a in case)
    got = roi_align_rotated(x, rois, (2, 2), 1.0, 2, True)
    np.testing.assert_allclose(got, out, atol=1e-6)
    np.testing.assert_allclose(roi_align_rotated_backward(np.ones_like(got), rois, x.shape, 1.0,
                                                          2, True), grad, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("ratio, aligned, clockwise", [(2, True, False), (0, True, True),
                                                       (1, False, False), (-1, False, True)])
def test_forward_and_backward_match_the_definition(dtype, ratio, aligned, clockwise):
    rng = np.random.default_rng(ratio + 3 * aligned + 7 * clockwise + 10)
    x, rois = random_case(rng, dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)
    out = roi_align_rotated(x, rois, (3, 2), 0.8, ratio, aligned, clockwise)
    assert out.dtype == dtype and out.shape == (6, 3, 3, 2)
    np.testing.assert_allclose(out, ref_forward(x, rois, (3, 2), 0.8, ratio, aligned, clockwise),
                               **tol)
    grad = rng.standard_normal(out.shape).astype(dtype)
    np.testing.assert_allclose(
        roi_align_rotated_backward(grad, rois, x.shape, 0.8, ratio, aligned, clockwise),
        ref_backward(grad, rois, x.shape, (3, 2), 0.8, ratio, aligned, clockwise), **tol)


def test_at_angle_zero_it_is_roi_align():
    rng = np.random.default_rng(1)
    x, rois = random_case(rng, np.float64)
    rois[:, 5] = 0
    # sides of at least one cell once scaled: below that the unaligned modes
    # differ by design (roi_align keeps x1 and widens, this keeps the centre)
    rois[:, 3:5] = np.maximum(rois[:, 3:5], 2.5)
    corners = np.concatenate([rois[:, :1], rois[:, 1:3] - rois[:, 3:5] / 2,
                              rois[:, 1:3] + rois[:, 3:5] / 2], axis=1)
    for aligned in (True, False):
        np.testing.assert_allclose(roi_align_rotated(x, rois, 4, 0.5, 2, aligned),
                                   roi_align(x, corners, 4, 0.5, 2, "avg", aligned),
                                   rtol=1e-12, atol=1e-12)


def test_backward_is_the_forwards_gradient_by_finite_differences(numeric_gradient):
    rng = np.random.default_rng(2)
    x, rois = random_case(rng, np.float64, c=2, k=3)
    grad = rng.standard_normal((3, 2, 2, 3))
    expected = numeric_gradient(
        lambda v: float((roi_align_rotated(v, rois, (2, 3), 1.0, 2, True, False) * grad).sum()), x)
    np.testing.assert_allclose(roi_align_rotated_backward(grad, rois, x.shape, 1.0, 2, True,
                                                          False), expected, rtol=1e-6,
                               atol=1e-8)


@pytest.mark.parametrize("bad, message", [
    ([0, 1, 1, 2, 2, math.nan], r"rois\[1\] contains NaN or inf"),
    ([2, 1, 1, 2, 2, 0], r"rois\[1, 0\] \(batch index\) must be an integer in \[0, 2\)"),
    ([0.5, 1, 1, 2, 2, 0], r"rois\[1, 0\] \(batch index\)"),
    ([0, 1, 1, -2, 2, 0], r"rois\[1\] has a negative width or height"),
])
@pytest.mark.parametrize("backward", [False, True])
def test_bad_rois_are_errors_naming_the_roi_and_nothing_is_written(bad, message, backward):
    x = np.zeros((2, 1, 4, 4))
    rois = np.array([[0, 1, 1, 2, 2, 0], bad], np.float64)
    if backward:
        out = np.full(x.shape, 7.0)
        with pytest.raises(ValueError, match="^roi_align_rotated_backward_impl: " + message):
            mmdispatch.roi_align_rotated_backward_impl(np.ones((2, 1, 2, 2)), rois, out, 2, 2,
                                                       1.0, 2, True, False)
    else:
        out = np.full((2, 1, 2, 2), 7.0)
        with pytest.raises(ValueError, match="^roi_align_rotated_forward_impl: " + message):
            mmdispatch.roi_align_rotated_forward_impl(x, rois, out, 2, 2, 1.0, 2, True, False)
    assert (out == 7).all()


def test_negative_sides_are_one_cell_when_not_aligned():
    x = np.arange(16.0).reshape(1, 1, 4, 4)
    rois = np.array([[0, 1.5, 1.5, -3, -3, 0]])
    np.testing.assert_allclose(roi_align_rotated(x, rois, 1, 1.0, 1, False),
                               roi_align_rotated(x, np.array([[0, 1.5, 1.5, 1, 1, 0]]), 1, 1.0, 1,
                                                 False))


@pytest.mark.parametrize("call, error, message", [
    (lambda: roi_align_rotated(np.zeros((1, 1, 4, 4)), np.zeros((1, 5)), 2), ValueError,
     r"^roi_align_rotated_forward_impl: rois must have shape \(\*, 6\)"),
    (lambda: roi_align_rotated(np.zeros((1, 4, 4)), np.zeros((1, 6)), 2), ValueError,
     r"^roi_align_rotated: input must be 4-D"),
    (lambda: roi_align_rotated(np.zeros((1, 1, 4, 4)), np.zeros((1, 6)), 0), ValueError,
     r"^roi_align_rotated: output_size"),
    (lambda: roi_align_rotated(np.zeros((1, 1, 4, 4)), np.zeros((1, 6)), 2, 0.0), ValueError,
     r"^roi_align_rotated_forward_impl: spatial_scale must be finite and > 0"),
    (lambda: roi_align_rotated(np.zeros((1, 1, 4, 4)), np.zeros((1, 6), np.float32), 2),
     TypeError, r"^roi_align_rotated_forward_impl: rois"),
    (lambda: roi_align_rotated(np.zeros((1, 1, 4, 4)), np.zeros((1, 6)), 2, clockwise=2),
     TypeError, r"^roi_align_rotated: clockwise must be a bool"),
    (lambda: roi_align_rotated(np.zeros((1, 1, 4, 4), np.float16), np.zeros((1, 6), np.float16),
                               2), TypeError, r"^roi_align_rotated_forward_impl: input .*float16"),
    # the backward names grad_output, which the caller passed, not the
    # grad_input the wrapper allocated
    (lambda: roi_align_rotated_backward(np.ones((1, 2, 2, 2)), np.zeros((1, 6), np.float32),
                                        (1, 2, 5, 5)), TypeError,
     r"^roi_align_rotated_backward_impl: rois has dtype float32 but grad_output has dtype "
     r"float64"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_no_rois_give_an_empty_output_and_a_zero_gradient():
    x = np.ones((1, 2, 4, 4))
    assert roi_align_rotated(x, np.zeros((0, 6)), 2).shape == (0, 2, 2, 2)
    assert not roi_align_rotated_backward(np.zeros((0, 2, 2, 2)), np.zeros((0, 6)),
                                          x.shape).any()


def test_no_channels_give_an_empty_output_at_once_whatever_the_sampling_ratio():
    """A map without channels has no output to compute: the call returns at
    once, where the CPU forward walked every bin's 32768 x 32768 samples for
    nothing (the fuzz harness's hang, 2026-11-27). Its rois are still
    checked."""
    x = np.zeros((1, 0, 5, 4), np.float32)
    rois = np.array([[0, 2, 2, 3, 3, 0.5]] * 2, np.float32)
    assert roi_align_rotated(x, rois, 8, 1.0, 32768).shape == (2, 0, 8, 8)
    with pytest.raises(ValueError, match="rois"):
        roi_align_rotated(x, np.array([[3, 2, 2, 3, 3, 0.5]], np.float32), 8, 1.0, 32768)


# --- the PyTorch layer -----------------------------------------------------------------------

def test_mmcv_drop_in_and_module_with_autograd():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch.mmcv import RoIAlignRotated
    from mmdispatch.torch.mmcv import roi_align_rotated as mmcv_roi_align_rotated
    for x, rois, out, grad in MMCV_CASES:
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        got = mmcv_roi_align_rotated(xt, torch.tensor(rois, dtype=torch.float32), (2, 2), 1.0, 2)
        got.backward(torch.ones_like(got))
        np.testing.assert_allclose(got.detach().numpy(), out, atol=1e-6)
        np.testing.assert_allclose(xt.grad.numpy(), grad, atol=1e-6)
    x, rois = random_case(np.random.default_rng(4), np.float64, k=3)
    module = RoIAlignRotated((2, 3), 0.8, 2, True, True)
    xt = torch.from_numpy(x).requires_grad_(True)
    assert torch.autograd.gradcheck(lambda v: module(v, torch.from_numpy(rois)), (xt,))
    assert "clockwise=True" in repr(module)


# --- CUDA ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(cupy, dtype):
    rng = np.random.default_rng(11)
    x, rois = random_case(rng, dtype, n=2, c=16, hw=(40, 50), k=200)
    rois[:, 1:3] *= 4
    grad = rng.standard_normal((200, 16, 7, 7)).astype(dtype)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-12)
    for ratio, aligned, clockwise in ((2, True, False), (0, False, True)):
        np.testing.assert_allclose(
            cupy.asnumpy(roi_align_rotated(cupy.asarray(x), cupy.asarray(rois), 7, 0.5, ratio,
                                           aligned, clockwise)),
            roi_align_rotated(x, rois, 7, 0.5, ratio, aligned, clockwise), **tol)
        expected = roi_align_rotated_backward(grad, rois, x.shape, 0.5, ratio, aligned, clockwise)
        for backend in ("default", "deterministic"):
            with mmdispatch.use_backend("cuda", backend):
                got = roi_align_rotated_backward(cupy.asarray(grad), cupy.asarray(rois), x.shape,
                                                 0.5, ratio, aligned, clockwise)
            np.testing.assert_allclose(cupy.asnumpy(got), expected, **tol)


def test_cuda_deterministic_backward_is_bit_identical_across_runs(cupy):
    rng = np.random.default_rng(12)
    x, rois = random_case(rng, np.float32, n=1, c=8, hw=(16, 16), k=500)
    grad = cupy.asarray(rng.standard_normal((500, 8, 7, 7)).astype(np.float32))
    with mmdispatch.use_backend("cuda", "deterministic"):
        runs = [cupy.asnumpy(roi_align_rotated_backward(grad, cupy.asarray(rois), x.shape, 1.0,
                                                        2)).tobytes() for _ in range(3)]
    assert runs[0] == runs[1] == runs[2]


def test_cuda_bad_roi_raises_in_strict_mode_and_writes_nothing(cupy):
    out = cupy.full((2, 1, 2, 2), 7.0)
    rois = cupy.asarray(np.array([[0, 1, 1, 2, 2, 0], [3, 1, 1, 2, 2, 0]], np.float64))
    with mmdispatch.strict():
        with pytest.raises(ValueError, match=r"^roi_align_rotated_forward_impl: rois\[1, 0\]"):
            mmdispatch.roi_align_rotated_forward_impl(cupy.zeros((2, 1, 4, 4)), rois, out, 2, 2,
                                                      1.0, 2, True, False)
    assert bool((out == 7).all())


def test_cuda_float16_and_bfloat16_compute_in_float32(torch_cuda):
    torch = torch_cuda
    x, rois = random_case(np.random.default_rng(13), np.float32)
    expected = roi_align_rotated(x, rois, 3, 1.0, 2)
    for dtype in (torch.float16, torch.bfloat16):
        got = roi_align_rotated(torch.from_numpy(x).cuda().to(dtype),
                                torch.from_numpy(rois).cuda().to(dtype), 3, 1.0, 2)
        assert got.dtype == dtype
        np.testing.assert_allclose(got.float().cpu().numpy(), expected, rtol=5e-2, atol=5e-2)


# --- properties (tests/support/properties.py) --------------------------------------------------

@st.composite
def problem(draw, dtype):
    n, c = draw(st.integers(1, 2)), draw(st.integers(0, 2))
    hw = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
    k = draw(st.integers(0, 3))
    x = draw(float_arrays((n, c) + hw, dtype))
    rois = draw(float_arrays((k, 6), dtype, -2, 6, specials=False))
    rois[:, 0] = [draw(st.integers(0, n - 1)) for _ in range(k)]
    rois[:, 3:5] = np.abs(rois[:, 3:5])
    pooled = (draw(st.integers(1, 3)), draw(st.integers(1, 3)))
    scalars = dict(pooled_height=pooled[0], pooled_width=pooled[1],
                   spatial_scale=draw(st.sampled_from([1.0, 0.5, 2.0])),
                   sampling_ratio=draw(st.integers(-1, 2)), aligned=draw(st.booleans()),
                   clockwise=draw(st.booleans()))
    return x, rois, scalars


def ref_args(s):
    return ((s["pooled_height"], s["pooled_width"]), s["spatial_scale"], s["sampling_ratio"],
            s["aligned"], s["clockwise"])


@st.composite
def forward_case(draw, dtype):
    x, rois, s = draw(problem(dtype))
    shape = (len(rois), x.shape[1], s["pooled_height"], s["pooled_width"])
    args = dict(input=guarded(x), rois=guarded(rois), output=guarded(sentinel(shape, dtype)), **s)

    def check(a):
        assert_close(a["output"], ref_forward(x, rois, *ref_args(s)), dtype)
    return args, check


@st.composite
def backward_case(draw, dtype):
    x, rois, s = draw(problem(dtype))
    shape = (len(rois), x.shape[1], s["pooled_height"], s["pooled_width"])
    grad = draw(float_arrays(shape, dtype, -2, 2, specials=False))
    initial = draw(float_arrays(x.shape, dtype, -2, 2, specials=False))
    args = dict(grad_output=guarded(grad), rois=guarded(rois), grad_input=guarded(initial), **s)

    def check(a):
        assert_close(a["grad_input"], initial + ref_backward(grad, rois, x.shape, *ref_args(s)),
                     dtype)
    return args, check


def forward_user_case(draw, name, dtype, layout):
    a, check = draw(forward_case(dtype))
    inputs = {"input": layout(a["input"]), "rois": layout(a["rois"])}

    def run():
        return roi_align_rotated(inputs["input"], inputs["rois"],
                                 (a["pooled_height"], a["pooled_width"]), a["spatial_scale"],
                                 a["sampling_ratio"], a["aligned"], a["clockwise"])
    return run, inputs, lambda result: check(dict(a, output=result))


def backward_user_case(draw, name, dtype, layout):
    a, check = draw(backward_case(dtype))
    inputs = {"grad_output": layout(a["grad_output"]), "rois": layout(a["rois"])}
    shape = a["grad_input"].shape

    def run():
        return roi_align_rotated_backward(inputs["grad_output"], inputs["rois"], shape,
                                          a["spatial_scale"], a["sampling_ratio"], a["aligned"],
                                          a["clockwise"])

    def verify(result):
        expected = ref_backward(a["grad_output"], a["rois"], shape,
                                *ref_args(a))
        assert_close(result, expected, dtype)
    return run, inputs, verify


def torch_forward_calls(torch, device):
    x, rois = random_case(np.random.default_rng(0), np.float64, k=3)
    xt = torch.from_numpy(x).to(device).requires_grad_(True)
    rt = torch.from_numpy(rois).to(device)
    return [(xt, rt, 2, 3, 0.8, 2, True, False), (xt, rt, 1, 1, 1.0, 0, False, True)]


def torch_backward_calls(torch, device):
    rois = torch.from_numpy(random_case(np.random.default_rng(0), np.float64, k=3)[1]).to(device)
    grad = torch.randn(3, 3, 2, 3, dtype=torch.float64, device=device)
    return [(grad, rois, (2, 3, 9, 11), torch.float64, 2, 3, 0.8, 2, True, False)]


def small_args():
    return list(random_case(np.random.default_rng(0), np.float64, k=2))


class TestProperties(OpProperties):
    module = rotated_module
    torch_calls = {"roi_align_rotated_forward_impl": torch_forward_calls,
                   "roi_align_rotated_backward_impl": torch_backward_calls}
    entry_cases = {"roi_align_rotated_forward_impl": forward_case,
                   "roi_align_rotated_backward_impl": backward_case}
    fixed_axes = {
        "roi_align_rotated_forward_impl": {"rois": [1], "output": [0, 1, 2, 3]},
        "roi_align_rotated_backward_impl": {"rois": [1], "grad_output": [0, 1, 2, 3]},
    }
    bad_scalars = {"pooled_height": [0, -1], "pooled_width": [0, -2],
                   "spatial_scale": [0.0, -1.0, math.nan, math.inf]}
    user_cases = {"roi_align_rotated": forward_user_case,
                  "roi_align_rotated_backward": backward_user_case}
    good_user_args = {"roi_align_rotated": lambda: small_args() + [2, 1.0, 2, True, False],
                      "roi_align_rotated_backward": lambda: [np.ones((2, 3, 2, 2)),
                                                             small_args()[1], (2, 3, 9, 11),
                                                             1.0, 2, True, False]}
    user_bad_values = {
        ("roi_align_rotated", 2): [0, -1, (1, 0), "2", None],
        ("roi_align_rotated", 3): [0.0, -1.0, math.nan, "1"],
        ("roi_align_rotated", 5): [1, "yes", None],
        ("roi_align_rotated_backward", 2): [(2, 3, 9), "shape", None],
    }

    def bad_data(self, draw, op_name, args):
        from hypothesis import assume
        rois = args["rois"].copy()
        assume(rois.size > 0)
        k = draw(st.integers(0, len(rois) - 1))
        column, value = draw(st.sampled_from([(0, -1.0), (0, 0.5), (0, 99.0), (1, math.nan),
                                              (5, math.inf), (3, -1.0)]))
        assume(column != 3 or args["aligned"])
        rois[k, column] = value
        return dict(args, rois=guarded(rois)), f"data: rois[{k}, {column}] = {value}"
