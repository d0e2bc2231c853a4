"""ps_roi_align (R-FCN position-sensitive RoIAlign, torchvision semantics):
a slow reference from the definition, torchvision itself, finite
differences, the channel mapping, bad input, the PyTorch layer, properties,
and CPU/CUDA agreement."""
import importlib
import math

import numpy as np
import pytest
from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import ps_roi_align, ps_roi_align_backward
from properties import (OpProperties, assert_close, bad_rois, float_arrays, guarded,
                        roi_problem_sizes, rois_for, sentinel, small_map_and_rois,
                        torch_map_and_rois)

ps_roi_align_module = importlib.import_module("mmdispatch.ops.ps_roi_align")
DTYPES = [np.float32, np.float64]


# --- slow reference, from the definition (R-FCN's position-sensitive pooling
# on roi_align's aligned sampling), in float64 ------------------------------------------

def ref_axis(v, size):
    """[(cell, weight)] of linear interpolation at v along an axis of `size`
    cells: nothing outside [-1, size], the edge cell beyond the last centre."""
    if not (-1 <= v <= size) or size == 0:
        return []
    v = max(v, 0.0)
    low = int(v)
    if low >= size - 1:
        return [(size - 1, 1.0), (size - 1, 0.0)]
    return [(low, 1 - (v - low)), (low + 1, v - low)]


def ref_samples(roi, out_h, out_w, scale, sampling_ratio, ph, pw):
    """[(y, x)] sample points of bin (ph, pw) of a roi."""
    x1, y1, x2, y2 = (v * scale - 0.5 for v in roi[1:])
    bin_h, bin_w = (y2 - y1) / out_h, (x2 - x1) / out_w
    grid_h = sampling_ratio if sampling_ratio > 0 else math.ceil(bin_h)
    grid_w = sampling_ratio if sampling_ratio > 0 else math.ceil(bin_w)
    return [(y1 + ph * bin_h + (iy + 0.5) * bin_h / grid_h,
             x1 + pw * bin_w + (ix + 0.5) * bin_w / grid_w)
            for iy in range(grid_h) for ix in range(grid_w)]


def ref_weights(roi, shape, out_h, out_w, scale, sampling_ratio, ph, pw):
    """{(y, x): weight} of bin (ph, pw): the mean of its samples' bilinear
    weights (an empty bin has none)."""
    h, w = shape
    samples = ref_samples(roi, out_h, out_w, scale, sampling_ratio, ph, pw)
    weights = {}
    for y, x in samples:
        for row, wy in ref_axis(y, h):
            for col, wx in ref_axis(x, w):
                weights[row, col] = weights.get((row, col), 0.0) + wy * wx / len(samples)
    return weights


def ref_forward(x, rois, out_h, out_w, scale, sampling_ratio):
    n, c, h, w = x.shape
    c_out = c // (out_h * out_w)
    out = np.zeros((len(rois), c_out, out_h, out_w))
    for k, roi in enumerate(np.asarray(rois, np.float64)):
        for ph in range(out_h):
            for pw in range(out_w):
                weights = ref_weights(roi, (h, w), out_h, out_w, scale, sampling_ratio, ph, pw)
                for co in range(c_out):
                    plane = x[int(roi[0]), (co * out_h + ph) * out_w + pw].astype(np.float64)
                    out[k, co, ph, pw] = sum(wt * plane[cell] for cell, wt in weights.items())
    return out


def ref_backward(grad_out, rois, shape, scale, sampling_ratio):
    n, c, h, w = shape
    _, c_out, out_h, out_w = grad_out.shape
    grad = np.zeros(shape)
    for k, roi in enumerate(np.asarray(rois, np.float64)):
        for ph in range(out_h):
            for pw in range(out_w):
                weights = ref_weights(roi, (h, w), out_h, out_w, scale, sampling_ratio, ph, pw)
                for co in range(c_out):
                    channel = (co * out_h + ph) * out_w + pw
                    for (row, col), wt in weights.items():
                        grad[int(roi[0]), channel, row, col] += wt * grad_out[k, co, ph, pw]
    return grad


def random_case(rng, dtype, out=(3, 2), c_out=2, n=2, h=9, w=11, k=6, scale=0.5):
    x = rng.standard_normal((n, c_out * out[0] * out[1], h, w)).astype(dtype)
    corners = rng.uniform(-4, 2.2 * max(h, w), (k, 4))
    rois = np.concatenate([rng.integers(0, n, (k, 1)),
                           np.minimum(corners[:, :2], corners[:, 2:]),
                           np.maximum(corners[:, :2], corners[:, 2:])], axis=1).astype(dtype)
    return x, rois


TOL = {np.float32: dict(rtol=1e-5, atol=1e-5), np.float64: dict(rtol=1e-12, atol=1e-12)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampling_ratio", [-1, 0, 1, 2, 3])
@pytest.mark.parametrize("seed", range(4))
def test_forward_and_backward_match_the_slow_reference(dtype, sampling_ratio, seed):
    rng = np.random.default_rng(seed)
    x, rois = random_case(rng, dtype)
    out = ps_roi_align(x, rois, (3, 2), 0.5, sampling_ratio)
    assert out.shape == (6, 2, 3, 2) and out.dtype == dtype
    np.testing.assert_allclose(out, ref_forward(x, rois, 3, 2, 0.5, sampling_ratio), **TOL[dtype])
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = ps_roi_align_backward(grad_out, rois, x.shape, 0.5, sampling_ratio)
    assert grad.shape == x.shape and grad.dtype == dtype
    np.testing.assert_allclose(grad, ref_backward(grad_out, rois, x.shape, 0.5, sampling_ratio),
                               **TOL[dtype])



# The CPU kernel does one bin of up to 8 output channels' planes at a time
# (src/cpu/ps_plane_groups.h): 8, 9 and 17 output channels take one run of
# 8, runs of 4 and 5, and runs of 5, 6 and 6. With 256 rois on one image, a
# forward on more than one thread also takes each run's rois in 4 parts, a
# count that shares a factor with 2 runs (with coprime counts, an item order
# that mixed runs and parts up would still visit every pair).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("c_out, n, k", [(8, 2, 9), (9, 2, 9), (17, 2, 9), (9, 1, 256)])
def test_many_output_channels_match_the_slow_reference(dtype, c_out, n, k):
    rng = np.random.default_rng(c_out)
    x, rois = random_case(rng, dtype, out=(2, 2), c_out=c_out, n=n, h=13, w=15, k=k)
    out = ps_roi_align(x, rois, (2, 2), 0.5, -1)
    np.testing.assert_allclose(out, ref_forward(x, rois, 2, 2, 0.5, -1), **TOL[dtype])
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = ps_roi_align_backward(grad_out, rois, x.shape, 0.5, -1)
    np.testing.assert_allclose(grad, ref_backward(grad_out, rois, x.shape, 0.5, -1), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_each_output_channel_is_bit_for_bit_what_it_is_alone(dtype):
    """17 output channels (runs of 5, 6 and 6) with 40 rois on 2 images, and
    10 (runs of 5 and 5) with 256 rois on one, in 4 parts where more than one
    thread runs."""
    rng = np.random.default_rng(3)
    for c_out, n, k in [(17, 2, 40), (10, 1, 256)]:
        check_channels_alone(rng, dtype, c_out, n, k)


def check_channels_alone(rng, dtype, c_out, n, k):
    x, rois = random_case(rng, dtype, out=(2, 2), c_out=c_out, n=n, h=13, w=15, k=k)
    out = ps_roi_align(x, rois, (2, 2), 0.5, -1)
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    grad = ps_roi_align_backward(grad_out, rois, x.shape, 0.5, -1)
    for co in range(c_out):
        assert np.array_equal(out[:, co:co + 1], ps_roi_align(x[:, co * 4:(co + 1) * 4], rois, (2, 2), 0.5, -1), equal_nan=True)
        assert np.array_equal(grad[:, co * 4:(co + 1) * 4], ps_roi_align_backward(grad_out[:, co:co + 1], rois, (n, 4, 13, 15), 0.5, -1))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
def test_forward_and_gradient_equal_torchvision(dtype, sampling_ratio):
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    x, rois = random_case(np.random.default_rng(7), dtype, out=(3, 3), c_out=3, h=20, w=17, k=12)
    xt = torch.from_numpy(x).requires_grad_(True)
    expected = torchvision.ops.ps_roi_align(xt, torch.from_numpy(rois), 3, 0.5, sampling_ratio)
    out = ps_roi_align(x, rois, 3, 0.5, sampling_ratio)
    np.testing.assert_allclose(out, expected.detach().numpy(), **TOL[dtype])
    grad_out = np.random.default_rng(8).standard_normal(out.shape).astype(dtype)
    expected.backward(torch.from_numpy(grad_out))
    np.testing.assert_allclose(ps_roi_align_backward(grad_out, rois, x.shape, 0.5, sampling_ratio),
                               xt.grad.numpy(), **TOL[dtype])


def test_backward_matches_finite_differences(numeric_gradient):
    rng = np.random.default_rng(3)
    x, rois = random_case(rng, np.float64, h=6, w=7, k=3)
    grad_out = rng.standard_normal((3, 2, 3, 2))
    numeric = numeric_gradient(lambda v: float((ps_roi_align(v, rois, (3, 2), 0.5, 2)
                                                * grad_out).sum()), x)
    np.testing.assert_allclose(ps_roi_align_backward(grad_out, rois, x.shape, 0.5, 2), numeric,
                               rtol=1e-6, atol=1e-8)


def test_bin_ph_pw_of_output_channel_c_reads_input_channel_c_ph_pw():
    out_h, out_w, c_out = 2, 3, 2
    channels = c_out * out_h * out_w
    x = np.broadcast_to(np.arange(channels, dtype=np.float64)[None, :, None, None],
                        (1, channels, 8, 8)).copy()
    out = ps_roi_align(x, np.array([[0, 1.0, 1.0, 6.0, 7.0]]), (out_h, out_w))
    expected = [[[(co * out_h + ph) * out_w + pw for pw in range(out_w)] for ph in range(out_h)]
                for co in range(c_out)]
    np.testing.assert_array_equal(out[0], expected)


def test_a_bin_without_samples_is_zero():
    x = np.ones((1, 4, 5, 5))
    out = ps_roi_align(x, np.array([[0, 2.0, 2.0, 2.0, 4.0]]), 2, 1.0, -1)   # zero width
    np.testing.assert_array_equal(out, np.zeros((1, 1, 2, 2)))


def test_empty_rois_and_an_empty_batch_give_empty_results():
    assert ps_roi_align(np.zeros((2, 8, 4, 4)), np.zeros((0, 5)), 2).shape == (0, 2, 2, 2)
    grad = ps_roi_align_backward(np.zeros((0, 2, 2, 2)), np.zeros((0, 5)), (2, 8, 4, 4))
    np.testing.assert_array_equal(grad, np.zeros((2, 8, 4, 4)))
    assert ps_roi_align(np.zeros((0, 8, 4, 4)), np.zeros((0, 5)), 2).shape == (0, 2, 2, 2)


@pytest.mark.parametrize("channels", [3, 5, 7, 10])
def test_channels_not_a_multiple_of_the_bins_are_an_error_naming_input(channels):
    with pytest.raises(ValueError, match=r"^ps_roi_align_forward_impl: input has \d+ channels, "
                                         r"which must be a multiple of pooled_height \* "
                                         r"pooled_width = 4"):
        ps_roi_align(np.zeros((1, channels, 4, 4)), np.zeros((1, 5)), 2)
    with pytest.raises(ValueError, match="^ps_roi_align_backward_impl: grad_input has"):
        ps_roi_align_backward(np.zeros((1, 1, 2, 2)), np.zeros((1, 5)), (1, channels, 4, 4))


@pytest.mark.parametrize("roi, message", [
    ([0, 3, 1, 2, 4], "negative width"), ([0, 1, 3, 4, 2], "negative width"),
    ([2, 1, 1, 3, 3], "batch index"), ([0, math.nan, 1, 3, 3], "NaN or inf"),
    ([0.5, 1, 1, 3, 3], "batch index")])
def test_bad_rois_are_refused_naming_the_roi_and_nothing_is_written(roi, message):
    rois = np.array([[0, 1, 1, 3, 3], roi], dtype=np.float64)
    with pytest.raises(ValueError, match=rf"^ps_roi_align_forward_impl: rois\[1.*{message}"):
        ps_roi_align(np.zeros((2, 4, 5, 5)), rois, 2)
    grad_input = np.full((2, 4, 5, 5), 7.0)
    with pytest.raises(ValueError, match=rf"^ps_roi_align_backward_impl: rois\[1.*{message}"):
        mmdispatch.ps_roi_align_backward_impl(np.ones((2, 1, 2, 2)), rois, grad_input, 2, 2,
                                              1.0, -1)
    assert (grad_input == 7).all()


def test_float16_on_the_cpu_is_refused_naming_the_dtype():
    with pytest.raises(TypeError, match="^ps_roi_align_forward_impl: input .*float16"):
        ps_roi_align(np.zeros((1, 4, 4, 4), np.float16), np.zeros((1, 5), np.float16), 2)


# --- the PyTorch layer --------------------------------------------------------------------

def test_the_drop_in_equals_torchvision_with_autograd():
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    from mmdispatch.torch import PSRoIAlign
    from mmdispatch.torch import ps_roi_align as torch_ps_roi_align

    x, rois = random_case(np.random.default_rng(2), np.float64, out=(2, 2), h=7, w=9, k=4)
    xt, rt = torch.from_numpy(x).requires_grad_(True), torch.from_numpy(rois)
    ours = torch_ps_roi_align(xt, rt, 2, 0.5, 2)
    (grad,) = torch.autograd.grad(ours.sum(), xt)
    x2 = xt.detach().clone().requires_grad_(True)
    theirs = torchvision.ops.ps_roi_align(x2, rt, 2, 0.5, 2)
    (expected,) = torch.autograd.grad(theirs.sum(), x2)
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(grad, expected)
    # boxes as a list of Tensor[L, 4] per image, and the module
    per_image = [rt[rt[:, 0] == i, 1:] for i in range(2)]
    order = torch.cat([torch.nonzero(rt[:, 0] == i)[:, 0] for i in range(2)])
    torch.testing.assert_close(torch_ps_roi_align(xt, per_image, 2, 0.5, 2), ours[order])
    module = PSRoIAlign(2, 0.5, 2)
    torch.testing.assert_close(module(xt, rt), ours)
    assert "output_size=2" in repr(module)


# --- CUDA ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("sampling_ratio", [-1, 2])
def test_cuda_matches_cpu_in_forward_and_backward(cupy, dtype, sampling_ratio):
    rng = np.random.default_rng(11)
    x, rois = random_case(rng, dtype, out=(3, 3), c_out=4, h=24, w=31, k=40)
    out = ps_roi_align(cupy.asarray(x), cupy.asarray(rois), 3, 0.5, sampling_ratio)
    np.testing.assert_allclose(cupy.asnumpy(out), ps_roi_align(x, rois, 3, 0.5, sampling_ratio),
                               **TOL[dtype])
    grad_out = rng.standard_normal(out.shape).astype(dtype)
    expected = ps_roi_align_backward(grad_out, rois, x.shape, 0.5, sampling_ratio)
    for backend in ("default", "deterministic"):
        with mmdispatch.use_backend("cuda", backend):
            grad = ps_roi_align_backward(cupy.asarray(grad_out), cupy.asarray(rois), x.shape, 0.5,
                                         sampling_ratio)
        np.testing.assert_allclose(cupy.asnumpy(grad), expected,
                                   rtol=TOL[dtype]["rtol"] * 10, atol=TOL[dtype]["atol"] * 10)


def test_cuda_deterministic_backward_repeats_bit_for_bit(cupy):
    rng = np.random.default_rng(12)
    x, rois = random_case(rng, np.float32, out=(3, 3), c_out=4, h=24, w=31, k=200)
    grad_out = cupy.asarray(rng.standard_normal((200, 4, 3, 3)).astype(np.float32))
    with mmdispatch.use_backend("cuda", "deterministic"):
        runs = [cupy.asnumpy(ps_roi_align_backward(grad_out, cupy.asarray(rois), x.shape, 0.5))
                for _ in range(3)]
    np.testing.assert_array_equal(runs[0], runs[1])
    np.testing.assert_array_equal(runs[0], runs[2])


def test_cuda_float16_and_bfloat16_compute_in_float32(torch_cuda):
    torch = torch_cuda
    x, rois = random_case(np.random.default_rng(13), np.float32, out=(2, 2), h=12, w=12, k=8)
    expected = ps_roi_align(x, rois, 2, 0.5, 2)
    for dtype in (torch.float16, torch.bfloat16):
        out = ps_roi_align(torch.from_numpy(x).cuda().to(dtype),
                           torch.from_numpy(rois).cuda().to(dtype), 2, 0.5, 2)
        assert out.dtype == dtype
        np.testing.assert_allclose(out.float().cpu().numpy(), expected, rtol=2e-2, atol=3e-2)


def test_cuda_bad_roi_raises_in_strict_mode_and_writes_nothing(cupy):
    rois = cupy.asarray(np.array([[0, 1, 1, 3, 3], [0, 3, 1, 2, 4]], float))
    output = cupy.full((2, 1, 2, 2), 7.0)
    with mmdispatch.strict():
        with pytest.raises(ValueError, match=r"^ps_roi_align_forward_impl: rois\[1\]"):
            mmdispatch.ps_roi_align_forward_impl(cupy.zeros((1, 4, 5, 5)), rois, output, 2, 2,
                                                 1.0, -1)
    assert bool((output == 7).all())


# --- properties (tests/support/properties.py) ----------------------------------------------

@st.composite
def forward_case(draw, dtype):
    n, c_out, h, w, k, out_h, out_w, scale = draw(roi_problem_sizes())
    sampling_ratio = draw(st.integers(-1, 3))
    x = draw(float_arrays((n, c_out * out_h * out_w, h, w), dtype))
    rois = draw(rois_for(k, n, h, w, scale, True, dtype))
    args = dict(input=guarded(x), rois=guarded(rois),
                output=guarded(sentinel((k, c_out, out_h, out_w), dtype)), pooled_height=out_h,
                pooled_width=out_w, spatial_scale=scale, sampling_ratio=sampling_ratio)

    def check(a):
        with np.errstate(invalid="ignore"):   # inf * 0 weights are NaN, as in the kernels
            expected = ref_forward(x, rois, out_h, out_w, scale, sampling_ratio)
        assert_close(a["output"], expected, dtype)
    return args, check


@st.composite
def backward_case(draw, dtype):
    n, c_out, h, w, k, out_h, out_w, scale = draw(roi_problem_sizes())
    sampling_ratio = draw(st.integers(-1, 3))
    rois = draw(rois_for(k, n, h, w, scale, True, dtype))
    grad_out = draw(float_arrays((k, c_out, out_h, out_w), dtype))
    shape = (n, c_out * out_h * out_w, h, w)
    args = dict(grad_output=guarded(grad_out), rois=guarded(rois),
                grad_input=guarded(np.zeros(shape, dtype)), pooled_height=out_h,
                pooled_width=out_w, spatial_scale=scale, sampling_ratio=sampling_ratio)

    def check(a):
        with np.errstate(invalid="ignore"):
            expected = ref_backward(grad_out, rois, shape, scale, sampling_ratio)
        assert_close(a["grad_input"], expected, dtype)
    return args, check


def forward_user_case(draw, name, dtype, layout):
    a, check = draw(forward_case(dtype))
    inputs = dict(input=layout(a["input"]), rois=layout(a["rois"]))

    def run():
        return ps_roi_align(inputs["input"], inputs["rois"], (a["pooled_height"],
                            a["pooled_width"]), a["spatial_scale"], a["sampling_ratio"])
    return run, inputs, lambda result: check(dict(a, output=result))


def backward_user_case(draw, name, dtype, layout):
    a, check = draw(backward_case(dtype))
    inputs = dict(grad_output=layout(a["grad_output"]), rois=layout(a["rois"]))

    def run():
        return ps_roi_align_backward(inputs["grad_output"], inputs["rois"], a["grad_input"].shape,
                                     a["spatial_scale"], a["sampling_ratio"])
    return run, inputs, lambda result: check(dict(a, grad_input=result))


def torch_forward_calls(torch, device):
    x, rois = torch_map_and_rois(torch, device, channels=8)
    return [(x, rois, 2, 2, 0.5, 2), (x, rois, 1, 2, 1.0, 2)]


def torch_backward_calls(torch, device):
    x, rois = torch_map_and_rois(torch, device, channels=8)
    grad = torch.randn(3, 2, 2, 2, dtype=torch.float64, device=device)
    return [(grad, rois, tuple(x.shape), torch.float64, 2, 2, 0.5, 2)]


class TestProperties(OpProperties):
    module = ps_roi_align_module
    torch_calls = {"ps_roi_align_forward_impl": torch_forward_calls,
                   "ps_roi_align_backward_impl": torch_backward_calls}
    entry_cases = {"ps_roi_align_forward_impl": forward_case,
                   "ps_roi_align_backward_impl": backward_case}
    fixed_axes = {"ps_roi_align_forward_impl": {"rois": [1], "output": [0, 1, 2, 3]},
                  "ps_roi_align_backward_impl": {"rois": [1], "grad_output": [0, 1, 2, 3]}}
    bad_scalars = {"pooled_height": [0, -1, 2 ** 40], "pooled_width": [0, -3, 2 ** 40],
                   "spatial_scale": [0.0, -1.0, math.nan, math.inf, -math.inf],
                   "sampling_ratio": [32769, 2 ** 62]}
    user_cases = {"ps_roi_align": forward_user_case,
                  "ps_roi_align_backward": backward_user_case}
    good_user_args = {
        "ps_roi_align": lambda: [np.zeros((2, 12, 4, 5)), small_map_and_rois()[1], (2, 3), 1.0,
                                 -1],
        "ps_roi_align_backward": lambda: [np.ones((2, 2, 2, 3)), small_map_and_rois()[1],
                                          (2, 12, 4, 5), 1.0, -1],
    }
    user_bad_values = {
        ("ps_roi_align", 2): [0, -1, (2, 0), 2.5, "2", (1, 2, 3), None, (5, 5)],
        ("ps_roi_align", 3): [0.0, -1.0, math.nan, "1"],
        ("ps_roi_align", 4): [2 ** 40, 1.5, None],
        ("ps_roi_align_backward", 2): [(2, 12, 4), (2, -12, 4, 5), (2, 13, 4, 5), None],
    }

    def bad_data(self, draw, op_name, args):
        batch = args["input" if "input" in args else "grad_input"].shape[0]
        return bad_rois(draw, args, batch, [(3, lambda roi: roi[1] - 1)])
