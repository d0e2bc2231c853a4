"""deform_conv2d (DCNv1, DCNv2 with a mask; torchvision semantics): a slow
reference from the papers' definition, plain grouped convolution at zero
offsets, torchvision itself, finite differences, bad input, the matrix
product without a BLAS, the PyTorch layer, properties, and CPU/CUDA
agreement."""
import importlib
import math
import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import deform_conv2d, deform_conv2d_backward
from properties import (OpProperties, assert_close, float_arrays, guarded,
                        in_signalling_guards, sentinel)

deform_module = importlib.import_module("mmdispatch.ops.deform_conv2d")
DTYPES = [np.float32, np.float64]


# --- slow reference, from the definition (Dai et al. 2017; Zhu et al. 2019), float64 -------

def out_size(size, kernel, stride, pad, dilation):
    return (size + 2 * pad - (dilation * (kernel - 1) + 1)) // stride + 1


def corners(plane, y, x):
    """[(row, col, weight, valid)] of bilinear sampling at (y, x) (arrays),
    zero outside the map: a position outside (-1, H) x (-1, W) has no valid
    cell."""
    h, w = plane.shape
    inside = (y > -1) & (y < h) & (x > -1) & (x < w)
    y0, x0 = np.floor(np.where(inside, y, 0)), np.floor(np.where(inside, x, 0))
    found = []
    for dy in (0, 1):
        for dx in (0, 1):
            row, col = y0 + dy, x0 + dx
            weight = (1 - np.abs(y - row)) * (1 - np.abs(x - col))
            valid = inside & (row >= 0) & (row < h) & (col >= 0) & (col < w)
            found.append((np.clip(row, 0, max(h - 1, 0)).astype(np.int64),
                          np.clip(col, 0, max(w - 1, 0)).astype(np.int64), weight, valid))
    return found


def sample(plane, y, x):
    """Bilinear value, its derivatives along y and x; NaN at a NaN position."""
    value, dvy, dvx = np.zeros(y.shape), np.zeros(y.shape), np.zeros(y.shape)
    y0, x0 = np.floor(y), np.floor(x)
    with np.errstate(invalid="ignore"):
        for row, col, weight, valid in corners(plane, y, x):
            v = np.where(valid, plane[row, col] if plane.size else 0.0, 0.0)
            value += np.where(valid, weight * v, 0.0)
            # d weight / dy: -(1 - |x - col|) for the upper row, + for the lower (x alike)
            wy = 1 - np.abs(x - col)
            wx = 1 - np.abs(y - row)
            dvy += np.where(valid, np.where(np.isclose(row, y0), -wy, wy) * v, 0.0)
            dvx += np.where(valid, np.where(np.isclose(col, x0), -wx, wx) * v, 0.0)
    # On the low edges the floor rule gives one derivative although the value
    # is 0 (torchvision's backward): at y == -1, d/dy is row 0 interpolated
    # at x; at x == -1, d/dx is column 0 interpolated at y.
    h, w = plane.shape
    on_y_edge = (y == -1) & (x > -1) & (x < w)
    on_x_edge = (x == -1) & (y > -1) & (y < h)
    with np.errstate(invalid="ignore"):
        dvy = np.where(on_y_edge, interpolate(plane[:1].reshape(-1), x), dvy)
        dvx = np.where(on_x_edge, interpolate(plane[:, :1].reshape(-1), y), dvx)
    undefined = np.isnan(y) | np.isnan(x)
    for a in (value, dvy, dvx):
        a[undefined] = np.nan
    return value, dvy, dvx


def interpolate(line, at):
    """A line of cells (zeros off it) interpolated at positions `at` by the
    floor rule: (1 - f) line[floor] + f line[floor + 1]."""
    if line.size == 0:
        return np.zeros(at.shape)
    inside = np.isfinite(at)
    first = np.floor(np.where(inside, at, 0)).astype(np.int64)
    frac = np.where(inside, at, 0) - first
    cells = [np.where((k >= 0) & (k < line.size), line[np.clip(k, 0, line.size - 1)], 0.0)
             for k in (first, first + 1)]
    return (1 - frac) * cells[0] + frac * cells[1]


def positions(offset, n, g, i, j, kw, taps, out_hw, stride, pad, dilation):
    oy, ox = np.meshgrid(np.arange(out_hw[0]), np.arange(out_hw[1]), indexing="ij")
    t = i * kw + j
    y = oy * stride[0] - pad[0] + i * dilation[0] + offset[n, g * 2 * taps + 2 * t]
    x = ox * stride[1] - pad[1] + j * dilation[1] + offset[n, g * 2 * taps + 2 * t + 1]
    return y, x


def ref_columns(x, offset, mask, kernel, stride, pad, dilation, offset_groups):
    """(N, C, kh, kw, out_h, out_w): the masked samples, and the unmasked
    values and their y and x derivatives."""
    n_, c_, h, w = x.shape
    kh, kw = kernel
    out_hw = offset.shape[2:]
    taps, per_group = kh * kw, c_ // offset_groups
    cols = np.zeros((n_, c_, kh, kw) + out_hw)
    values, dys, dxs = (np.zeros_like(cols) for _ in range(3))
    for n in range(n_):
        for c in range(c_):
            g = c // per_group
            for i in range(kh):
                for j in range(kw):
                    y, sx = positions(offset, n, g, i, j, kw, taps, out_hw, stride, pad,
                                      dilation)
                    v, dvy, dvx = sample(x[n, c], y, sx)
                    m = 1.0 if mask is None else mask[n, g * taps + i * kw + j]
                    values[n, c, i, j], dys[n, c, i, j], dxs[n, c, i, j] = v, dvy, dvx
                    with np.errstate(invalid="ignore"):
                        cols[n, c, i, j] = m * v
    return cols, values, dys, dxs


def ref_forward(x, offset, mask, weight, bias, stride=(1, 1), pad=(0, 0), dilation=(1, 1)):
    x, offset, weight = (np.asarray(a, np.float64) for a in (x, offset, weight))
    mask = None if mask is None else np.asarray(mask, np.float64)
    c_out, per_group, kh, kw = weight.shape
    groups = x.shape[1] // per_group
    offset_groups = offset.shape[1] // (2 * kh * kw)
    cols, _, _, _ = ref_columns(x, offset, mask, (kh, kw), stride, pad, dilation, offset_groups)
    out = np.zeros((x.shape[0], c_out) + offset.shape[2:])
    o_per = c_out // groups
    with np.errstate(invalid="ignore", over="ignore"):
        for g in range(groups):
            out[:, g * o_per:(g + 1) * o_per] = np.einsum(
                "ocij,ncijhw->nohw", weight[g * o_per:(g + 1) * o_per],
                cols[:, g * per_group:(g + 1) * per_group])
        if bias is not None:
            out += np.asarray(bias, np.float64)[None, :, None, None]
    return out


def ref_backward(grad, x, offset, mask, weight, stride=(1, 1), pad=(0, 0), dilation=(1, 1)):
    """(grad_input, grad_offset, grad_mask, grad_weight, grad_bias), from the
    chain rule through the columns (grad_mask with mask None: the gradient
    of a mask of ones)."""
    grad, x, offset, weight = (np.asarray(a, np.float64) for a in (grad, x, offset, weight))
    mask = None if mask is None else np.asarray(mask, np.float64)
    c_out, per_group, kh, kw = weight.shape
    n_, c_, h, w = x.shape
    groups, taps = c_ // per_group, kh * kw
    offset_groups = offset.shape[1] // (2 * taps)
    cols, values, dys, dxs = ref_columns(x, offset, mask, (kh, kw), stride, pad, dilation,
                                         offset_groups)
    o_per = c_out // groups
    grad_weight = np.zeros(weight.shape)
    grad_cols = np.zeros(cols.shape)
    with np.errstate(invalid="ignore", over="ignore"):
        for g in range(groups):
            o, c = slice(g * o_per, (g + 1) * o_per), slice(g * per_group, (g + 1) * per_group)
            grad_weight[o] = np.einsum("nohw,ncijhw->ocij", grad[:, o], cols[:, c])
            grad_cols[:, c] = np.einsum("ocij,nohw->ncijhw", weight[o], grad[:, o])
        grad_bias = grad.sum(axis=(0, 2, 3))
        ones = np.ones((n_, offset_groups * taps) + offset.shape[2:])
        m = ones if mask is None else mask
        grad_offset = np.zeros(offset.shape)
        grad_mask = np.zeros(ones.shape)
        grad_input = np.zeros(x.shape)
        c_per = c_ // offset_groups
        for n in range(n_):
            for c in range(c_):
                g = c // c_per
                for i in range(kh):
                    for j in range(kw):
                        t = i * kw + j
                        gc = grad_cols[n, c, i, j]
                        mk = m[n, g * taps + t]
                        grad_mask[n, g * taps + t] += gc * values[n, c, i, j]
                        grad_offset[n, g * 2 * taps + 2 * t] += gc * mk * dys[n, c, i, j]
                        grad_offset[n, g * 2 * taps + 2 * t + 1] += gc * mk * dxs[n, c, i, j]
                        y, sx = positions(offset, n, g, i, j, kw, taps, offset.shape[2:],
                                          stride, pad, dilation)
                        for row, col, weight_q, valid in corners(x[n, c], y, sx):
                            np.add.at(grad_input[n, c], (row[valid], col[valid]),
                                      (gc * mk * weight_q)[valid])
    return grad_input, grad_offset, grad_mask, grad_weight, grad_bias


def random_case(rng, dtype, n=2, c_in=4, c_out=6, hw=(7, 8), kernel=(3, 3), groups=2,
                offset_groups=2, stride=(1, 1), pad=(1, 1), dilation=(1, 1), spread=2.0):
    kh, kw = kernel
    out_hw = tuple(out_size(s, k, st_, p, d) for s, k, st_, p, d in
                   zip(hw, kernel, stride, pad, dilation))
    x = rng.standard_normal((n, c_in) + hw).astype(dtype)
    offset = (rng.standard_normal((n, 2 * offset_groups * kh * kw) + out_hw) * spread).astype(dtype)
    mask = rng.random((n, offset_groups * kh * kw) + out_hw).astype(dtype)
    weight = rng.standard_normal((c_out, c_in // groups, kh, kw)).astype(dtype)
    bias = rng.standard_normal(c_out).astype(dtype)
    return x, offset, mask, weight, bias


def tolerance(dtype):
    return dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-10)


# --- forward ----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize("geometry", [
    dict(), dict(stride=(2, 1), pad=(0, 2), dilation=(1, 2)),
    dict(groups=1, offset_groups=1, kernel=(1, 3)), dict(groups=2, offset_groups=4, c_in=4),
    dict(c_in=6, c_out=3, groups=3, offset_groups=1, kernel=(2, 2), stride=(2, 2))])
def test_forward_matches_the_definition(dtype, with_mask, geometry):
    rng = np.random.default_rng(len(str(geometry)) + with_mask)
    x, offset, mask, weight, bias = random_case(rng, dtype, **geometry)
    mask = mask if with_mask else None
    kw = {k: geometry[k] for k in ("stride", "pad", "dilation") if k in geometry}
    out = deform_conv2d(x, offset, weight, bias, kw.get("stride", 1), kw.get("pad", (1, 1)),
                        kw.get("dilation", 1), mask)
    expected = ref_forward(x, offset, mask, weight, bias, kw.get("stride", (1, 1)),
                           kw.get("pad", (1, 1)), kw.get("dilation", (1, 1)))
    assert out.dtype == dtype and out.shape == expected.shape
    np.testing.assert_allclose(out, expected, **tolerance(dtype))


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_zero_offsets_and_a_mask_of_ones_are_a_plain_grouped_convolution(groups):
    rng = np.random.default_rng(groups)
    x = rng.standard_normal((2, 8, 9, 7))
    weight = rng.standard_normal((4, 8 // groups, 3, 3))
    bias = rng.standard_normal(4)
    offset = np.zeros((2, 2 * 9, 9, 7))
    out = deform_conv2d(x, offset, weight, bias, 1, 1, 1, np.ones((2, 9, 9, 7)))
    padded = np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1)))
    expected = np.zeros((2, 4, 9, 7))
    o_per, c_per = 4 // groups, 8 // groups
    for o in range(4):
        g = o // o_per
        for i in range(3):
            for j in range(3):
                expected[:, o] += np.einsum("c,nchw->nhw", weight[o, :, i, j],
                                            padded[:, g * c_per:(g + 1) * c_per, i:i + 9, j:j + 7])
    expected += bias[None, :, None, None]
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(deform_conv2d(x, offset, weight, bias, 1, 1), expected,
                               rtol=1e-12, atol=1e-12)


def test_samples_outside_the_map_read_zero_and_a_nan_offset_reads_nan():
    x = np.ones((1, 1, 4, 4))
    weight = np.ones((1, 1, 1, 1))
    offset = np.zeros((1, 2, 4, 4))
    offset[0, 0, 0, 0] = -1.0        # y = -1: outside, 0
    offset[0, 0, 0, 1] = -0.5        # y = -0.5: half of row 0
    offset[0, 1, 1, 1] = math.inf    # x = inf: outside, 0
    offset[0, 1, 2, 2] = math.nan
    out = deform_conv2d(x, offset, weight)[0, 0]
    assert out[0, 0] == 0 and out[0, 1] == 0.5 and out[1, 1] == 0
    assert math.isnan(out[2, 2]) and out[3, 3] == 1


def test_on_the_maps_low_edges_the_offset_gradient_is_the_floor_rules():
    """A sample at y == -1 exactly reads 0, but its y gradient is row 0
    interpolated at x (row 0 enters with weight y + 1), as torchvision's
    backward has it; x == -1 alike; at (-1, -1) both are 0. Zero offsets with
    padding 1 put every first-row and first-column tap there."""
    x = np.arange(16.0).reshape(1, 1, 4, 4) + 1
    x[0, 0, 1:] = np.inf      # rows past 0 never enter a y-edge gradient
    weight = np.ones((1, 1, 1, 1))
    offset = np.zeros((1, 2, 4, 4))
    offset[0, :, 0, 0] = (-1, 0)         # (-1, 0): d/dy = x[0, 0]
    offset[0, :, 0, 1] = (-1, 0.25)      # (-1, 1.25): 0.75 x[0, 1] + 0.25 x[0, 2]
    offset[0, :, 0, 2] = (-1, -3)        # (-1, -1): both 0
    offset[0, :, 0, 3] = (-1, 1)         # (-1, 4): outside, both 0
    out = deform_conv2d(x, offset, weight)
    assert (out[0, 0, 0] == 0).all()
    grad_input, grad_offset, *_ = deform_conv2d_backward(np.ones_like(out), x, offset, weight)
    dy, dx = grad_offset[0, 0, 0], grad_offset[0, 1, 0]
    assert dy.tolist() == [1.0, 0.75 * 2 + 0.25 * 3, 0.0, 0.0]
    assert dx.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert (grad_input[0, 0, 0] == 0).all()   # an edge sample adds nothing to row 0
    x = np.arange(16.0).reshape(1, 1, 4, 4) + 1
    offset = np.zeros((1, 2, 4, 4))
    offset[0, :, 1, 0] = (0.5, -1)       # (1.5, -1): d/dx = 0.5 x[1, 0] + 0.5 x[2, 0]
    offset[0, :, 2, 1] = (0, -2)         # (2, -1): d/dx = x[2, 0]
    grad_offset = deform_conv2d_backward(np.ones((1, 1, 4, 4)), x, offset, weight)[1]
    assert grad_offset[0, 1, 1, 0] == 0.5 * 5 + 0.5 * 9 and grad_offset[0, 0, 1, 0] == 0
    assert grad_offset[0, 1, 2, 1] == 9 and grad_offset[0, 0, 2, 1] == 0


def test_zero_size_batches_and_channels_give_empty_results():
    rng = np.random.default_rng(0)
    x, offset, mask, weight, bias = random_case(rng, np.float64, n=0)
    assert deform_conv2d(x, offset, weight, bias, 1, 1, 1, mask).shape == (0, 6, 7, 8)
    grads = deform_conv2d_backward(np.zeros((0, 6, 7, 8)), x, offset, weight, 1, 1, 1, mask)
    assert [g.shape for g in grads] == [x.shape, offset.shape, mask.shape, weight.shape, (6,)]
    assert not grads[3].any() and not grads[4].any()
    out = deform_conv2d(np.zeros((1, 2, 3, 3)), np.zeros((1, 18, 3, 3)), np.zeros((0, 2, 3, 3)),
                        None, 1, 1)
    assert out.shape == (1, 0, 3, 3)


# --- backward ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize("geometry", [
    dict(), dict(stride=(2, 1), pad=(0, 2), dilation=(1, 2), offset_groups=1),
    dict(c_in=6, c_out=3, groups=3, offset_groups=3, kernel=(2, 3)),
    dict(spread=0.0), dict(spread=0.0, kernel=(2, 3), pad=(1, 1), stride=(1, 2))])
def test_backward_matches_the_chain_rule_of_the_definition(dtype, with_mask, geometry):
    rng = np.random.default_rng(7 + with_mask)
    x, offset, mask, weight, _ = random_case(rng, dtype, **geometry)
    mask = mask if with_mask else None
    stride, pad, dilation = (geometry.get(k, d) for k, d in
                             (("stride", (1, 1)), ("pad", (1, 1)), ("dilation", (1, 1))))
    grad = rng.standard_normal(ref_forward(x, offset, mask, weight, None, stride, pad,
                                           dilation).shape).astype(dtype)
    got = deform_conv2d_backward(grad, x, offset, weight, stride, pad, dilation, mask)
    expected = ref_backward(grad, x, offset, mask, weight, stride, pad, dilation)
    if mask is None:
        assert got[2] is None
        expected = expected[:2] + (None,) + expected[3:]
    for name, g, e in zip(("input", "offset", "mask", "weight", "bias"), got, expected):
        if e is not None:
            assert g.dtype == dtype, name
            np.testing.assert_allclose(g, e, err_msg=name, **tolerance(dtype))


@pytest.mark.parametrize("with_mask", [True, False])
def test_every_gradient_is_the_forwards_by_finite_differences(numeric_gradient, with_mask):
    rng = np.random.default_rng(3)
    x, offset, mask, weight, bias = random_case(rng, np.float64, n=1, c_in=2, c_out=2,
                                                hw=(4, 5), groups=1, offset_groups=2,
                                                stride=(1, 2), spread=1.3)
    mask = mask if with_mask else None
    grad = rng.standard_normal(deform_conv2d(x, offset, weight, bias, (1, 2), 1, 1,
                                             mask).shape)
    args = dict(input=x, offset=offset, mask=mask, weight=weight, bias=bias)

    def loss(name):
        def f(value):
            a = dict(args, **{name: value})
            return float((deform_conv2d(a["input"], a["offset"], a["weight"], a["bias"], (1, 2),
                                        1, 1, a["mask"]) * grad).sum())
        return f

    got = dict(zip(("input", "offset", "mask", "weight", "bias"),
                   deform_conv2d_backward(grad, x, offset, weight, (1, 2), 1, 1, mask)))
    for name, value in args.items():
        if value is None:
            continue
        np.testing.assert_allclose(got[name], numeric_gradient(loss(name), value), rtol=1e-5,
                                   atol=1e-6, err_msg=name)


ISAS = ["baseline", "avx2", "avx512"]


GEOMETRY = dict(stride=(1, 2), pad=(1, 0), dilation=(2, 1))


def product_cases():
    """Shapes whose groups have enough out channels and columns for the
    tiles (at least 8 of each), leaving partial register tiles (45 and 12
    output pixels an image) and partial strips of outs (37; 19 per group), channel
    runs that cross offset groups, a bias, a NaN offset, and one case
    without a mask (each case's geometry GEOMETRY)."""
    rng = np.random.default_rng(5)
    cases = []
    for dtype, c_in, c_out, groups, offset_groups, hw, masked in [
            (np.float64, 6, 37, 1, 1, (11, 11), True), (np.float32, 6, 38, 2, 3, (11, 11), True),
            (np.float64, 12, 38, 2, 3, (6, 7), True), (np.float32, 8, 16, 1, 2, (11, 11), False)]:
        x, offset, mask, weight, bias = random_case(rng, dtype, c_in=c_in, c_out=c_out, hw=hw,
                                                    kernel=(3, 2), groups=groups,
                                                    offset_groups=offset_groups, **GEOMETRY)
        offset[0, 1, 2, 2] = np.nan
        grad = rng.standard_normal((2, c_out) + offset.shape[2:]).astype(dtype)
        cases.append((x, offset, mask if masked else None, weight, bias, grad))
    return cases


@pytest.mark.parametrize("blas", ["none", ""])
@pytest.mark.parametrize("isa", ISAS)
def test_every_tile_instruction_set_with_or_without_a_blas_gives_the_definition(
        tmp_path, isa, blas):
    """MMDISPATCH_CPU_ISA caps the register tiles of our own products (the
    forward runs on them from AVX2 up, else on the BLAS); MMDISPATCH_BLAS=none
    puts our own under the backward too. Every combination this CPU has
    gives the slow reference's values."""
    cases = product_cases()
    inputs = tmp_path / "inputs.npz"
    # a missing mask travels as an empty array
    np.savez(inputs, *[np.empty(0) if a is None else a for case in cases for a in case])
    script = (
        "import numpy as np, sys\n"
        "from mmdispatch import _core\n"
        "from mmdispatch.ops import deform_conv2d, deform_conv2d_backward\n"
        "with np.load(sys.argv[1]) as d:\n"
        "    a = [d[f'arr_{i}'] for i in range(len(d.files))]\n"
        "out = []\n"
        "for x, off, m, w, b, g in zip(*[a[i::6] for i in range(6)]):\n"
        "    m = m if m.size else None\n"
        f"    geometry = {GEOMETRY!r}\n"
        "    out.append(deform_conv2d(x, off, w, b, geometry['stride'], geometry['pad'],\n"
        "                             geometry['dilation'], m))\n"
        "    grads = deform_conv2d_backward(g, x, off, w, geometry['stride'], geometry['pad'],\n"
        "                                   geometry['dilation'], m)\n"
        "    out += [np.empty(0) if a is None else a for a in grads]\n"
        "np.savez(sys.argv[2], *out)\n"
        "print(_core.gemm_provider(), _core.cpu_tiles(), sep='\\n')\n")
    path = tmp_path / "out.npz"
    proc = subprocess.run([sys.executable, "-c", script, str(inputs), str(path)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env=dict(os.environ, MMDISPATCH_BLAS=blas, MMDISPATCH_CPU_ISA=isa))
    assert proc.returncode == 0, proc.stderr
    provider, tiles = proc.stdout.split("\n")[:2]
    # numpy's wheels bring OpenBLAS, which the lookup must find
    assert (provider == "mmdispatch's own") == (blas == "none"), provider
    best = os.environ.get("MMDISPATCH_CPU_ISA") or mmdispatch._core.cpu_tiles()
    assert tiles == ISAS[min(ISAS.index(isa), ISAS.index(best))]
    with np.load(path) as data:
        got = [data[f"arr_{i}"] for i in range(len(data.files))]
    for (x, offset, mask, weight, bias, grad), i in zip(cases, range(0, len(got), 6)):
        expected = [ref_forward(x, offset, mask, weight, bias, **GEOMETRY)]
        expected += ref_backward(grad, x, offset, mask, weight, **GEOMETRY)
        for name, g, e in zip(["out", "input", "offset", "mask", "weight", "bias"],
                              got[i:i + 6], expected):
            if mask is None and name == "mask":   # the user function returns None
                assert g.size == 0
                continue
            assert g.dtype == x.dtype and g.shape == e.shape, name
            np.testing.assert_allclose(g, e, err_msg=f"{name}, {x.dtype}", **tolerance(x.dtype))


def test_mmcvs_published_values_are_reproduced():
    """MMCV's DeformConv2dPack test case (values from its test file): a 3x3
    map, offsets from a 2x2 convolution of the map (8 channels, given weight
    and bias), a 2x2 deformable kernel; output and gradients for a gradient
    of ones, those of the offset convolution by the chain rule here."""
    x = np.array([[[[1.0, 2, 3], [0, 1, 2], [3, 5, 2]]]])
    offset_weight = np.array([[0.1, 0.4, 0.6, 0.1], [0.3, 0.2, 0.1, 0.3], [0.5, 0.5, 0.2, 0.8],
                              [0.8, 0.3, 0.9, 0.1], [0.3, 0.1, 0.2, 0.5], [0.3, 0.7, 0.5, 0.3],
                              [0.6, 0.2, 0.5, 0.3], [0.4, 0.1, 0.8, 0.4]]).reshape(8, 2, 2)
    offset_bias = np.array([0.7, 0.1, 0.8, 0.5, 0.6, 0.5, 0.4, 0.7])
    weight = np.array([0.4, 0.2, 0.1, 0.9]).reshape(1, 1, 2, 2)
    windows = [(i, j) for i in range(2) for j in range(2)]
    offset = np.zeros((1, 8, 2, 2))
    for i, j in windows:
        offset[0, :, i, j] = offset_bias + (offset_weight * x[0, 0, i:i + 2, j:j + 2]).sum((1, 2))
    out = deform_conv2d(x, offset, weight)
    grad_x, grad_offset, _, grad_weight, _ = deform_conv2d_backward(np.ones_like(out), x, offset,
                                                                   weight)
    grad_offset_weight = np.zeros_like(offset_weight)
    for i, j in windows:
        grad_x[0, 0, i:i + 2, j:j + 2] += np.einsum("o,oab->ab", grad_offset[0, :, i, j],
                                                   offset_weight)
        grad_offset_weight += grad_offset[0, :, i, j, None, None] * x[0, 0, i:i + 2, j:j + 2]
    close = dict(rtol=1e-3, atol=1e-9)
    np.testing.assert_allclose(out, [[[[1.650, 0], [0, 0]]]], **close)
    np.testing.assert_allclose(grad_x, [[[[-0.666, 0.204, 0], [0.030, -0.416, 0.012],
                                          [0, 0.252, 0.129]]]], **close)
    np.testing.assert_allclose(grad_offset_weight.reshape(8, 4), [
        [1.44, 2.88, 0, 1.44], [-0.72, -1.44, 0, -0.72], [0, 0, 0, 0], [0, 0, 0, 0],
        [-0.10, -0.20, 0, -0.10], [-0.08, -0.16, 0, -0.08], [-0.54, -1.08, 0, -0.54],
        [-0.54, -1.08, 0, -0.54]], **close)
    np.testing.assert_allclose(grad_offset.sum((0, 2, 3)),
                               [1.44, -0.72, 0, 0, -0.10, -0.08, -0.54, -0.54], **close)
    np.testing.assert_allclose(grad_weight, [[[[3.62, 0], [0.40, 0.18]]]], **close)


# --- bad input --------------------------------------------------------------------------

def bad_calls():
    x, offset, mask, weight, bias = random_case(np.random.default_rng(0), np.float64)
    return [
        (dict(offset=offset[:, :-2]), ValueError, r"offset has 34 channels, which must be a "
                                                  r"multiple of 2 \* kh \* kw = 18"),
        (dict(mask=mask[:, :-1]), ValueError, r"mask must have shape \(2, 18, 7, 8\)"),
        (dict(offset=offset[:, :, :-1]), ValueError, r"offset must have shape \(2, 36, 7, 8\)"),
        (dict(weight=weight[:, :1].copy()), ValueError, r"groups \(4\) must divide the "
                                                        r"input's channels \(4\) and the "
                                                        r"output's \(weight's first dimension, 6\)"),
        (dict(weight=np.zeros((6, 3, 3, 3))), ValueError, r"weight has 3 input channels per "
                                                          r"group, which must divide"),
        (dict(weight=np.zeros((5, 2, 3, 3))), ValueError, r"groups \(2\) must divide"),
        (dict(bias=bias[:-1]), ValueError, r"bias must have shape \(6,\)"),
        (dict(stride=0), ValueError, r"stride must be >= 1"),
        (dict(padding=-1), ValueError, r"padding must be >= 0"),
        (dict(dilation=(1, 0)), ValueError, r"dilation must be >= 1"),
        (dict(input=x.astype(np.float32)), TypeError, r"must have the dtype of input|dtype"),
        (dict(input=x[0]), ValueError, r"input must be 4-D"),
    ]


@pytest.mark.parametrize("index", range(12))
def test_bad_arguments_are_clear_errors_naming_the_op_and_the_parameter(index):
    x, offset, mask, weight, bias = random_case(np.random.default_rng(0), np.float64)
    change, error, message = bad_calls()[index]
    args = dict(input=x, offset=offset, weight=weight, bias=bias, stride=1, padding=1,
                dilation=1, mask=mask)
    args.update(change)
    with pytest.raises(error, match=f"^deform_conv2d(_forward_impl)?: .*({message})"):
        deform_conv2d(**args)


def test_a_refused_call_writes_nothing_into_its_outputs():
    x, offset, mask, weight, bias = random_case(np.random.default_rng(0), np.float64)
    output = np.full((2, 6, 7, 8), 7.0)
    with pytest.raises(ValueError, match="^deform_conv2d_forward_impl: groups"):
        mmdispatch.deform_conv2d_forward_impl(x, offset, mask, weight, bias, output, 1, 1, 1, 1,
                                              1, 1, 3, 2)
    assert (output == 7).all()
    grads = [np.full(a.shape, 7.0) for a in (x, offset, mask, weight, bias)]
    with pytest.raises(ValueError, match=r"^deform_conv2d_backward_impl: pad_h and pad_w"):
        mmdispatch.deform_conv2d_backward_impl(np.zeros((2, 6, 7, 8)), x, offset, mask, weight,
                                               *grads, 1, 1, -1, 1, 1, 1, 2, 2)
    assert all((g == 7).all() for g in grads)


def test_a_kernel_larger_than_the_padded_input_is_an_error():
    with pytest.raises(ValueError, match="smaller than the dilated kernel"):
        deform_conv2d(np.zeros((1, 1, 2, 2)), np.zeros((1, 18, 1, 1)), np.zeros((1, 1, 3, 3)))


def test_float16_on_the_cpu_is_refused_naming_the_dtype():
    with pytest.raises(TypeError, match="^deform_conv2d_forward_impl: input .*float16"):
        deform_conv2d(np.zeros((1, 1, 3, 3), np.float16), np.zeros((1, 2, 3, 3), np.float16),
                      np.zeros((1, 1, 1, 1), np.float16))


# --- torchvision and the PyTorch layer ----------------------------------------------------

@pytest.mark.parametrize("with_mask", [True, False])
def test_forward_and_gradients_equal_torchvisions(with_mask):
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    from mmdispatch.torch import deform_conv2d as torch_deform_conv2d

    x, offset, mask, weight, bias = random_case(np.random.default_rng(9), np.float64,
                                                stride=(2, 1), pad=(1, 0), dilation=(1, 2))
    tensors = [torch.from_numpy(a).requires_grad_(True) for a in (x, offset, mask, weight, bias)]
    twins = [t.detach().clone().requires_grad_(True) for t in tensors]
    m, m2 = (tensors[2], twins[2]) if with_mask else (None, None)
    ours = torch_deform_conv2d(tensors[0], tensors[1], tensors[3], tensors[4], stride=(2, 1),
                               padding=(1, 0), dilation=(1, 2), mask=m)
    theirs = torchvision.ops.deform_conv2d(twins[0], twins[1], twins[3], twins[4], stride=(2, 1),
                                           padding=(1, 0), dilation=(1, 2), mask=m2)
    torch.testing.assert_close(ours, theirs)
    grad = torch.randn_like(ours)
    wanted = [t for t in tensors if t is not tensors[2] or with_mask]
    wanted2 = [t for t in twins if t is not twins[2] or with_mask]
    for a, b in zip(torch.autograd.grad(ours, wanted, grad),
                    torch.autograd.grad(theirs, wanted2, grad)):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("with_mask", [True, False])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_zero_offsets_with_padding_give_torchvisions_gradients(with_mask, dtype):
    """Deformable convolution's usual start: zero offsets and padding 1 put
    the first row's and column's taps at -1 exactly, where the offset
    gradient is the floor rule's (mmdispatch/bilinear.h), as torchvision's."""
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    from mmdispatch.torch import deform_conv2d as torch_deform_conv2d

    gen = torch.Generator().manual_seed(5)
    dt = getattr(torch, dtype)
    x = torch.randn(2, 4, 6, 7, generator=gen, dtype=dt)
    weight = torch.randn(6, 2, 3, 3, generator=gen, dtype=dt)
    offset = torch.zeros(2, 2 * 2 * 9, 6, 7, dtype=dt)
    mask = torch.rand(2, 2 * 9, 6, 7, generator=gen, dtype=dt) if with_mask else None
    grads = []
    for fn in (torch_deform_conv2d, torchvision.ops.deform_conv2d):
        leaves = [t.clone().requires_grad_(True) for t in (x, offset, weight)]
        m = mask.clone().requires_grad_(True) if with_mask else None
        out = fn(leaves[0], leaves[1], leaves[2], padding=1, mask=m)
        g = torch.ones_like(out)
        grads.append(torch.autograd.grad(out, leaves + ([m] if with_mask else []), g))
    assert grads[1][1][:, :, 0].abs().sum() > 0   # torchvision's edge gradients exist
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


def test_the_module_equals_torchvisions_module_with_its_parameters():
    torch = pytest.importorskip("torch")
    torchvision = pytest.importorskip("torchvision")
    from mmdispatch.torch import DeformConv2d

    torch.manual_seed(0)
    theirs = torchvision.ops.DeformConv2d(4, 6, 3, stride=1, padding=1, groups=2)
    ours = DeformConv2d(4, 6, 3, stride=1, padding=1, groups=2)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(2, 4, 5, 6)
    offset, mask = torch.randn(2, 18, 5, 6), torch.rand(2, 9, 5, 6)
    torch.testing.assert_close(ours(x, offset, mask), theirs(x, offset, mask))
    torch.testing.assert_close(ours(x, offset), theirs(x, offset))
    assert repr(ours).startswith("DeformConv2d(4, 6, kernel_size=(3, 3)")


def test_mmcv_names_take_mmcvs_argument_order():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch import deform_conv2d as vision_deform_conv2d
    from mmdispatch.torch import mmcv

    x, offset, mask, weight, bias = (torch.from_numpy(a) for a in random_case(
        np.random.default_rng(2), np.float64, groups=2, offset_groups=2))
    expected = vision_deform_conv2d(x, offset, weight, None, 1, 1, 1, None)
    torch.testing.assert_close(mmcv.deform_conv2d(x, offset, weight, 1, 1, 1, 2, 2), expected)
    expected = vision_deform_conv2d(x, offset, weight, bias, 1, 1, 1, mask)
    torch.testing.assert_close(mmcv.modulated_deform_conv2d(x, offset, mask, weight, bias, 1, 1,
                                                            1, 2, 2), expected)
    module = mmcv.ModulatedDeformConv2d(4, 6, 3, padding=1, groups=2, deform_groups=2)
    assert module(x.float(), offset.float(), mask.float()).shape == (2, 6, 7, 8)
    dcn = mmcv.DeformConv2d(4, 6, 3, padding=1, groups=2, deform_groups=2)
    assert not hasattr(dcn, "bias") and dcn(x.float(), offset.float()).shape == (2, 6, 7, 8)
    with pytest.raises(ValueError, match="deform_groups"):
        mmcv.deform_conv2d(x, offset, weight, 1, 1, 1, 2, 3)


# --- CUDA ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("backend", ["default", "deterministic"])
def test_cuda_matches_cpu_in_forward_and_backward(cupy, dtype, backend):
    rng = np.random.default_rng(11)
    x, offset, mask, weight, bias = random_case(rng, dtype, n=2, c_in=8, c_out=6, hw=(13, 17),
                                                stride=(2, 1), dilation=(1, 2))
    args = (x, offset, weight, bias, (2, 1), 1, (1, 2), mask)
    expected = deform_conv2d(*args)
    grad = rng.standard_normal(expected.shape).astype(dtype)
    expected_grads = deform_conv2d_backward(grad, x, offset, weight, (2, 1), 1, (1, 2), mask)
    on_gpu = [None if a is None or isinstance(a, tuple) or isinstance(a, int)
              else cupy.asarray(a) for a in args]
    with mmdispatch.use_backend("cuda", backend):
        out = deform_conv2d(on_gpu[0], on_gpu[1], on_gpu[2], on_gpu[3], (2, 1), 1, (1, 2),
                            on_gpu[7])
        grads = deform_conv2d_backward(cupy.asarray(grad), on_gpu[0], on_gpu[1], on_gpu[2],
                                       (2, 1), 1, (1, 2), on_gpu[7])
    tol = dict(rtol=1e-3, atol=1e-3) if dtype == np.float32 else dict(rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(cupy.asnumpy(out), expected, **tol)
    for g, e in zip(grads, expected_grads):
        np.testing.assert_allclose(cupy.asnumpy(g), e, **tol)


def test_cuda_deterministic_backward_repeats_bit_for_bit(cupy):
    rng = np.random.default_rng(12)
    x, offset, mask, weight, _ = random_case(rng, np.float32, n=2, c_in=8, c_out=8, hw=(20, 20))
    gpu = [cupy.asarray(a) for a in (x, offset, mask, weight)]
    grad = cupy.asarray(rng.standard_normal((2, 8, 20, 20)).astype(np.float32))
    with mmdispatch.use_backend("cuda", "deterministic"):
        first = deform_conv2d_backward(grad, gpu[0], gpu[1], gpu[3], 1, 1, 1, gpu[2])
        again = deform_conv2d_backward(grad, gpu[0], gpu[1], gpu[3], 1, 1, 1, gpu[2])
    for a, b in zip(first, again):
        assert bool((a == b).all())


def cublas_products(n, rows, pixels, groups, batched):
    """The cuBLAS calls the default backend's forward and backward make
    under the emulator's lowered column budgets (cuda_emu): passes of whole
    images where an image's columns fit, else of an image's pixels in
    chunks; per pass and weight group, the forward's product and the
    columns' gradient batched over the pass's images (one call each, or one
    per image without batched products), grad_weight one per image."""
    import cuda_emu
    count = min(pixels, max(1, cuda_emu.DCN_COLUMN_BUDGET // rows))
    images = max(1, min(n, cuda_emu.DCN_IMAGES_BUDGET // (rows * pixels))) \
        if count == pixels else 1
    passes = [min(images, n - n0) for n0 in range(0, n, images) for _ in range(0, pixels, count)]
    return groups * sum((1 if batched else i) * 2 + i for i in passes)


@pytest.mark.parametrize("backend, cublas", [("default", None), ("default", "batched"),
                                             ("default", "single"),
                                             ("deterministic", "batched")])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("n, hw", [(2, (11, 12)), (2, (24, 25)), (5, (11, 12))])
@pytest.mark.parametrize("dtype, c_out, tol", [(np.float64, 70, 1e-12), (np.float32, 130, 2e-4)])
def test_emulated_cuda_products_over_many_tiles_and_part_tiles_equal_the_cpu(
        cuda_emulator, backend, cublas, groups, n, hw, dtype, c_out, tol):
    """The CUDA kernels' matrix products, 16 deep, in tiles of 64 x 64
    (double; float products under 128 rows or columns) or 128 x 128 (float):
    70 or 130 output channels, 9 * 10 = 90 rows of columns per group (k not
    a multiple of 16) and 11 x 12 = 132 pixels, each past one tile with a
    part tile left; the weight read along k, its transpose along rows, the
    columns along pixels and across them (grad_weight). With 24 x 25 = 600
    pixels, grad_weight's few tiles split its k (the pixels) in two slices of
    300, summed in order. Under the emulator's lowered column budgets, an
    image of 600 pixels goes in 4 chunks of pixels, and images of 132 two at
    a time (5 images: passes of 2, 2 and 1), through im2col, col2im and the
    products together. Run by the emulator. Where the process has cuBLAS
    (the emulator's stand-in), the default backend's products go to it, in
    every operand layout: the forward's and the columns' gradient in one
    strided batched call per pass and group (or, where cuBLAS lacks those,
    one per image), grad_weight one per image; the deterministic backend's
    never do."""
    import contextlib

    from cuda_emu import DeviceView
    rng = np.random.default_rng(21)
    x, offset, mask, weight, bias = random_case(rng, dtype, n=n, c_in=20, c_out=c_out,
                                                hw=hw, groups=groups, offset_groups=2)
    geometry = (1, 1, 1, 1, 1, 1, groups, 2)
    expected = np.zeros((n, c_out) + hw, dtype)
    mmdispatch.deform_conv2d_forward_impl(x, offset, mask, weight, bias, expected, *geometry)
    grad = rng.standard_normal(expected.shape).astype(dtype)
    expected_grads = [np.zeros_like(a) for a in (x, offset, mask, weight, bias)]
    mmdispatch.deform_conv2d_backward_impl(grad, x, offset, mask, weight, *expected_grads,
                                           *geometry)
    out = np.full_like(expected, 7.0)
    grads = [np.full_like(a, 7.0) for a in expected_grads]
    with cuda_emulator.active(), mmdispatch.use_backend("cuda", backend), \
            (cuda_emulator.cublas(batched=cublas == "batched") if cublas
             else contextlib.nullcontext()):
        calls = cuda_emulator.counters()["cublas_calls"]
        view = [DeviceView(a) for a in (x, offset, mask, weight, bias, grad)]
        mmdispatch.deform_conv2d_forward_impl(*view[:5], DeviceView(out), *geometry)
        mmdispatch.deform_conv2d_backward_impl(view[5], *view[:4], *map(DeviceView, grads),
                                               *geometry)
        cuda_emulator.synchronize()
        calls = cuda_emulator.counters()["cublas_calls"] - calls
    assert calls == (cublas_products(n, 20 * 9, hw[0] * hw[1], groups, cublas == "batched")
                     if cublas and backend == "default" else 0)
    np.testing.assert_allclose(out, expected, rtol=tol, atol=tol)
    for got, want in zip(grads, expected_grads):
        np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def emulated_products(cuda_emulator, args, backend="default"):
    """deform_conv2d's forward and backward of (x, offset, mask, weight,
    bias, grad) on the emulated GPU with the cuBLAS stand-in: (output,
    grads, products made, products made in TF32)."""
    from cuda_emu import DeviceView
    x, offset, mask, weight, bias, grad = args
    geometry = (1, 1, 1, 1, 1, 1, 1, 1)
    out = np.full(grad.shape, 7.0, x.dtype)
    grads = [np.full_like(a, 7.0) for a in (x, offset, mask, weight, bias)]
    with cuda_emulator.active(), mmdispatch.use_backend("cuda", backend), \
            cuda_emulator.cublas():
        before = cuda_emulator.counters()
        view = [DeviceView(a) for a in args]
        mmdispatch.deform_conv2d_forward_impl(*view[:5], DeviceView(out), *geometry)
        mmdispatch.deform_conv2d_backward_impl(view[5], *view[:4], *map(DeviceView, grads),
                                               *geometry)
        assert cuda_emulator.synchronize() == (0, "")
        after = cuda_emulator.counters()
    return (out, grads, after["cublas_calls"] - before["cublas_calls"],
            after["cublas_tf32_calls"] - before["cublas_tf32_calls"])


@pytest.fixture
def float32_matmul_precision():
    """Restores the process's float32 matmul precision after the test."""
    before = mmdispatch.get_float32_matmul_precision()
    yield
    mmdispatch.set_float32_matmul_precision(before)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_emulated_float32_products_take_tf32_only_where_the_precision_allows_it(
        cuda_emulator, float32_matmul_precision, dtype):
    """mmdispatch.set_float32_matmul_precision("high") lets the default
    CUDA backend's float32 products run in cuBLAS's TF32 math (the
    stand-in then rounds their operands to TF32's 10 mantissa bits):
    results within TF32's error of the IEEE ones, and not equal to them;
    "highest" (the default) sets the math back. float64 products, and the
    deterministic backend's own products, never take it."""
    rng = np.random.default_rng(5)
    x, offset, mask, weight, bias = random_case(rng, dtype, n=2, c_in=6, c_out=5, hw=(6, 7),
                                                groups=1, offset_groups=1)
    grad = rng.standard_normal((2, 5, 6, 7)).astype(dtype)
    args = (x, offset, mask, weight, bias, grad)
    assert mmdispatch.get_float32_matmul_precision() == "highest"
    ieee_out, ieee_grads, calls, tf32_calls = emulated_products(cuda_emulator, args)
    assert calls > 0 and tf32_calls == 0
    mmdispatch.set_float32_matmul_precision("high")
    assert mmdispatch.get_float32_matmul_precision() == "high"
    out, grads, calls, tf32_calls = emulated_products(cuda_emulator, args)
    assert tf32_calls == (calls if dtype == np.float32 else 0) and calls > 0
    deterministic = emulated_products(cuda_emulator, args, "deterministic")
    assert deterministic[2:] == (0, 0)
    if dtype == np.float32:
        assert not np.array_equal(out, ieee_out)
        # TF32 keeps 11 significant bits: each operand within 2**-11 relative
        np.testing.assert_allclose(out, ieee_out, rtol=0, atol=4e-3 * np.abs(ieee_out).max())
        for got, want in zip(grads, ieee_grads):
            np.testing.assert_allclose(got, want, rtol=0, atol=4e-3 * np.abs(want).max())
    else:
        np.testing.assert_array_equal(out, ieee_out)
    mmdispatch.set_float32_matmul_precision("highest")
    again = emulated_products(cuda_emulator, args)
    assert again[3] == 0
    np.testing.assert_array_equal(again[0], ieee_out)


@pytest.mark.parametrize("lead", [0, 1, 2, 3])
@pytest.mark.parametrize("hw", [(9, 4), (9, 5), (9, 6), (9, 7), (1, 3), (6, 2)])
def test_emulated_float32_input_gradient_in_windows_of_four_cells_equals_the_cpus(
        cuda_emulator, hw, lead):
    """The default CUDA backward's float input gradient on devices with
    vector atomics (the emulator has them): a sample's cells that share the
    4 cells of an aligned address (two of a row, or on a map 2 wide all four)
    take one float4 atomic, whatever a row's phase in its 4 (widths 2 to 7);
    samples across the map's edges and outside it. A launch whose vector
    atomic is not 16-byte aligned fails in the emulator. grad_input starts 0
    to 3 floats past a 16-byte boundary, and no window reaches the cells
    before or after it."""
    from cuda_emu import DeviceView
    rng = np.random.default_rng(hw[0] * 10 + hw[1])
    x, offset, mask, weight, _ = random_case(rng, np.float32, n=2, c_in=3, c_out=4, hw=hw,
                                             groups=1, offset_groups=1)
    offset *= 3   # many samples past the edges
    geometry = (1, 1, 1, 1, 1, 1, 1, 1)
    grad = rng.standard_normal((2, 4) + hw).astype(np.float32)
    expected = [np.zeros_like(a) for a in (x, offset, mask, weight)] + [np.zeros(4, np.float32)]
    mmdispatch.deform_conv2d_backward_impl(grad, x, offset, mask, weight, *expected, *geometry)
    got = [np.full_like(a, 7.0) for a in expected]
    got[0], guards_untouched = in_signalling_guards(got[0], lead)
    with cuda_emulator.active():
        cuda_emulator.clear_error()
        mmdispatch.deform_conv2d_backward_impl(*map(DeviceView, (grad, x, offset, mask, weight)),
                                               *map(DeviceView, got), *geometry)
        assert cuda_emulator.synchronize() == (0, "")
    assert np.abs(expected[0]).max() > 0 and guards_untouched()
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=2e-5, atol=2e-5 * np.abs(e).max())


@pytest.mark.parametrize("backend", ["default", "deterministic"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_cuda_offset_gradients_on_the_maps_low_edges_equal_the_cpus(
        cuda_emulator, backend, dtype):
    """Zero or whole-number offsets with padding 1 put taps at y == -1 or
    x == -1 exactly, where the offset gradient is the floor rule's
    (mmdispatch/bilinear.h): the CUDA kernels' edge samples, with a mask and
    two offset groups, against the CPU's. Run by the emulator."""
    from cuda_emu import DeviceView
    rng = np.random.default_rng(31)
    x, offset, mask, weight, _ = random_case(rng, dtype, n=2, c_in=4, c_out=4, hw=(5, 6))
    offset[:] = rng.integers(-2, 3, offset.shape)   # whole numbers: many edge samples
    offset[0] = 0
    offset[1, :, 0, 0] = 0.5                        # edges at fractional positions too
    geometry = (1, 1, 1, 1, 1, 1, 2, 2)
    grad = rng.standard_normal((2, 4, 5, 6)).astype(dtype)
    expected = [np.zeros_like(a) for a in (x, offset, mask, weight)] + [np.zeros(4, dtype)]
    mmdispatch.deform_conv2d_backward_impl(grad, x, offset, mask, weight, *expected, *geometry)
    assert np.abs(expected[1][0, 0::2, 0]).max() > 0   # y gradients on row 0's edge exist
    got = [np.full_like(a, 7.0) for a in expected]
    with cuda_emulator.active(), mmdispatch.use_backend("cuda", backend):
        mmdispatch.deform_conv2d_backward_impl(*map(DeviceView, (grad, x, offset, mask, weight)),
                                               *map(DeviceView, got), *geometry)
        assert cuda_emulator.synchronize() == (0, "")
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, **tolerance(dtype))


def test_a_cupy_call_has_cupy_load_its_cublas_once_before_the_first_product(monkeypatch):
    """CuPy loads cuBLAS lazily (its cupy.cuda.cublas attribute); the CUDA
    kernels take the process's cuBLAS at their first product and load
    nothing, so the op asks CuPy first, once per process, for CuPy arrays
    only (a stand-in CuPy records the asking)."""
    import types

    module = importlib.import_module("mmdispatch.ops.deform_conv2d")
    asked = []

    class Cuda:
        @property
        def cublas(self):
            asked.append(1)
            raise ImportError("libcublas.so.13: cannot open shared object file")

    class FakeArray:
        shape = (1, 1, 3, 3)

    fake = types.SimpleNamespace(ndarray=FakeArray, cuda=Cuda())
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(module, "_cublas_asked", False)
    x, offset, mask, weight, bias = random_case(np.random.default_rng(0), np.float32)
    deform_conv2d(x, offset, weight, bias, 1, 1, 1, mask)   # numpy: CuPy is not asked
    assert asked == []
    for _ in range(2):
        with pytest.raises((TypeError, ValueError)):   # the stand-in is no array
            deform_conv2d(FakeArray(), offset, weight, bias, 1, 1, 1, mask)
    assert asked == [1]   # asked once; CuPy's failure to load cuBLAS is not the call's


CUBLAS_CHILD = r"""
import json
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile
from mmdispatch.ops import deform_conv2d, deform_conv2d_backward

rng = np.random.default_rng(4)
x = rng.standard_normal((2, 64, 24, 24)).astype(np.float32)
offset = (rng.standard_normal((2, 18, 24, 24)) * 2).astype(np.float32)
mask = rng.random((2, 9, 24, 24)).astype(np.float32)
weight = (rng.standard_normal((128, 64, 3, 3)) / 24).astype(np.float32)
bias = rng.standard_normal(128).astype(np.float32)
grad = rng.standard_normal((2, 128, 24, 24)).astype(np.float32)
cpu = [deform_conv2d(x, offset, weight, bias, 1, 1, 1, mask),
       *deform_conv2d_backward(grad, x, offset, weight, 1, 1, 1, mask)]
on_gpu = [torch.from_numpy(a).cuda() for a in (x, offset, mask, weight, bias, grad)]
with profile(activities=[ProfilerActivity.CUDA]) as prof:
    gpu = [deform_conv2d(*on_gpu[0:2], *on_gpu[3:5], 1, 1, 1, on_gpu[2]),
           *deform_conv2d_backward(on_gpu[5], *on_gpu[0:2], on_gpu[3], 1, 1, 1, on_gpu[2])]
    torch.cuda.synchronize()
errors = [float(np.abs(g.cpu().numpy() - c).max() / max(1.0, float(np.abs(c).max())))
          for g, c in zip(gpu, cpu)]
names = {e.key for e in prof.key_averages()}
kernels = sorted(k for k in names if "gemm" in k.lower())
seen = any("im2col_kernel" in k for k in names)   # ours, in every call: kernels are seen
print("\n" + json.dumps({"errors": errors, "kernels": kernels, "seen": seen}))
"""


@pytest.mark.parametrize("cublas", ["default", "none"])
def test_cuda_products_through_torchs_cublas_or_our_tiles_match_the_cpu(torch_cuda, tmp_path,
                                                                        cublas):
    """In a fresh process that imported torch (which loads cuBLAS), the
    default backend's float products run in cuBLAS's kernels; with
    MMDISPATCH_CUBLAS=none in our own tiles (TileShape); either way forward
    and every gradient agree with the CPU kernels. The kernels are named
    by torch's profiler."""
    import json
    env = dict(os.environ, MMDISPATCH_CUBLAS=cublas)
    proc = subprocess.run([sys.executable, "-c", CUBLAS_CHILD], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(next(line for line in proc.stdout.splitlines()   # the profiler's
                             if line.startswith('{"errors"')))              # lines aside
    assert max(result["errors"]) < 1e-4, result["errors"]
    if not result["seen"]:
        pytest.skip("torch's profiler names no CUDA kernels here (no CUPTI?): the results "
                    "matched, the products' kernels are unchecked")
    ours = [k for k in result["kernels"] if "TileShape" in k]
    theirs = [k for k in result["kernels"] if "TileShape" not in k]
    if cublas == "none":
        assert ours and not theirs, result["kernels"]
    else:
        assert theirs and not ours, result["kernels"]


def test_cuda_float16_and_bfloat16_compute_in_float32(torch_cuda):
    torch = torch_cuda
    x, offset, mask, weight, bias = random_case(np.random.default_rng(13), np.float32)
    expected = deform_conv2d(x, offset, weight, bias, 1, 1, 1, mask)
    for dtype in (torch.float16, torch.bfloat16):
        t = [torch.from_numpy(a).cuda().to(dtype) for a in (x, offset, mask, weight, bias)]
        out = deform_conv2d(t[0], t[1], t[3], t[4], 1, 1, 1, t[2])
        assert out.dtype == dtype
        np.testing.assert_allclose(out.float().cpu().numpy(), expected, rtol=5e-2, atol=2e-1)


# --- properties (tests/support/properties.py) ----------------------------------------------

@st.composite
def problem(draw, dtype):
    groups, offset_groups = draw(st.integers(1, 2)), draw(st.integers(1, 2))
    # 0 leaves groups undefined; 8 out channels and 4 or more channels a
    # group send the products to the register tiles where the CPU has them
    c_in = groups * offset_groups * draw(st.sampled_from([1, 2, 4]))
    c_out = groups * draw(st.sampled_from([0, 1, 2, 8]))
    kh, kw = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    stride = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    pad = (draw(st.integers(0, 2)), draw(st.integers(0, 2)))
    dilation = (draw(st.integers(1, 2)), draw(st.integers(1, 2)))
    span = (dilation[0] * (kh - 1) + 1, dilation[1] * (kw - 1) + 1)
    hw = tuple(draw(st.integers(max(0, s - 2 * p), max(0, s - 2 * p) + 3))
               for s, p in zip(span, pad))
    n = draw(st.integers(0, 2))
    out_hw = tuple(out_size(s, k, st_, p, d) for s, k, st_, p, d in
                   zip(hw, (kh, kw), stride, pad, dilation))
    x = draw(float_arrays((n, c_in) + hw, dtype))
    offset = draw(float_arrays((n, 2 * offset_groups * kh * kw) + out_hw, dtype, -3, 3))
    mask = draw(st.none() | float_arrays((n, offset_groups * kh * kw) + out_hw, dtype, -2, 2))
    # weight and grad_output finite: a BLAS may skip a product by 0, so a NaN
    # or inf there need not reach the outputs (the module docstring says so)
    weight = draw(float_arrays((c_out, c_in // groups if groups else 0, kh, kw), dtype, -2, 2,
                               specials=False))
    bias = draw(st.none() | float_arrays((c_out,), dtype))
    scalars = dict(stride_h=stride[0], stride_w=stride[1], pad_h=pad[0], pad_w=pad[1],
                   dilation_h=dilation[0], dilation_w=dilation[1], groups=groups,
                   offset_groups=offset_groups)
    return x, offset, mask, weight, bias, scalars


def geometry_of(s):
    return ((s["stride_h"], s["stride_w"]), (s["pad_h"], s["pad_w"]),
            (s["dilation_h"], s["dilation_w"]))


@st.composite
def forward_case(draw, dtype):
    x, offset, mask, weight, bias, scalars = draw(problem(dtype))
    shape = (x.shape[0], weight.shape[0]) + offset.shape[2:]
    args = dict(input=guarded(x), offset=guarded(offset),
                mask=None if mask is None else guarded(mask), weight=guarded(weight),
                bias=None if bias is None else guarded(bias), output=guarded(sentinel(shape, dtype)),
                **scalars)

    def check(a):
        assert_close(a["output"], ref_forward(x, offset, mask, weight, bias,
                                              *geometry_of(scalars)), dtype)
    return args, check


@st.composite
def backward_case(draw, dtype):
    x, offset, mask, weight, _, scalars = draw(problem(dtype))
    grad = draw(float_arrays((x.shape[0], weight.shape[0]) + offset.shape[2:], dtype, -2, 2,
                             specials=False))
    mask_shape = (offset.shape[0], offset.shape[1] // 2) + offset.shape[2:]
    args = dict(grad_output=guarded(grad), input=guarded(x), offset=guarded(offset),
                mask=None if mask is None else guarded(mask), weight=guarded(weight),
                grad_input=guarded(sentinel(x.shape, dtype)),
                grad_offset=guarded(sentinel(offset.shape, dtype)),
                grad_mask=guarded(sentinel(mask_shape, dtype)),
                grad_weight=guarded(sentinel(weight.shape, dtype)),
                grad_bias=guarded(sentinel((weight.shape[0],), dtype)), **scalars)

    def check(a):
        expected = ref_backward(grad, x, offset, mask, weight, *geometry_of(scalars))
        for name, e in zip(("grad_input", "grad_offset", "grad_mask", "grad_weight",
                            "grad_bias"), expected):
            assert_close(a[name], e, dtype)
    return args, check


def forward_user_case(draw, name, dtype, layout):
    a, check = draw(forward_case(dtype))
    inputs = {k: layout(a[k]) for k in ("input", "offset", "mask", "weight", "bias")
              if a[k] is not None}

    def run():
        return deform_conv2d(inputs["input"], inputs["offset"], inputs["weight"],
                             inputs.get("bias"), *geometry_of(a), inputs.get("mask"))
    return run, inputs, lambda result: check(dict(a, output=result))


def backward_user_case(draw, name, dtype, layout):
    a, check = draw(backward_case(dtype))
    inputs = {k: layout(a[k]) for k in ("grad_output", "input", "offset", "mask", "weight")
              if a[k] is not None}

    def run():
        return deform_conv2d_backward(inputs["grad_output"], inputs["input"], inputs["offset"],
                                      inputs["weight"], *geometry_of(a), inputs.get("mask"))

    def verify(result):
        names = ("grad_input", "grad_offset", "grad_mask", "grad_weight", "grad_bias")
        got = dict(a, **dict(zip(names, result)))
        if a["mask"] is None:
            assert result[2] is None
            got["grad_mask"] = a["grad_mask"]   # not returned; its reference is not compared
            expected = ref_backward(a["grad_output"], a["input"], a["offset"], None, a["weight"],
                                    *geometry_of(a))
            for name, e in zip(names, expected):
                if name != "grad_mask":
                    assert_close(got[name], e, a["input"].dtype)
            return
        check(got)
    return run, inputs, verify


def torch_forward_calls(torch, device):
    rng = np.random.default_rng(0)
    x, offset, mask, weight, bias = (
        torch.from_numpy(a).to(device) for a in random_case(rng, np.float64, n=1, hw=(5, 4)))
    x.requires_grad_(True), offset.requires_grad_(True), weight.requires_grad_(True)
    geometry = (1, 1, 1, 1, 1, 1, 2, 2)
    return [(x, offset, mask.requires_grad_(True), weight, bias.requires_grad_(True), *geometry),
            (x, offset, None, weight, None, *geometry)]


def torch_backward_calls(torch, device):
    return [(torch.randn(1, 6, 5, 4, dtype=torch.float64, device=device),
             *(a.detach() if a is not None else None for a in args[:4]), *args[5:])
            for args in torch_forward_calls(torch, device)]


def small_args():
    x, offset, mask, weight, bias = random_case(np.random.default_rng(0), np.float64, n=1,
                                                hw=(3, 4))
    return x, offset, mask, weight, bias


class TestProperties(OpProperties):
    module = deform_module
    torch_calls = {"deform_conv2d_forward_impl": torch_forward_calls,
                   "deform_conv2d_backward_impl": torch_backward_calls}
    entry_cases = {"deform_conv2d_forward_impl": forward_case,
                   "deform_conv2d_backward_impl": backward_case}
    fixed_axes = {
        "deform_conv2d_forward_impl": {
            "input": [0, 1], "offset": [0, 1, 2, 3], "mask": [0, 1, 2, 3],
            "weight": [0, 1, 2, 3], "bias": [0], "output": [0, 1, 2, 3]},
        "deform_conv2d_backward_impl": {
            "grad_output": [0, 1, 2, 3], "input": [0, 1], "offset": [0, 1, 2, 3],
            "mask": [0, 1, 2, 3], "weight": [0, 1, 2, 3], "grad_input": [0, 1, 2, 3],
            "grad_offset": [0, 1, 2, 3], "grad_mask": [0, 1, 2, 3],
            "grad_weight": [0, 1, 2, 3], "grad_bias": [0]},
    }
    bad_scalars = {"stride_h": [0, -1, 2 ** 31], "stride_w": [0, -2, 2 ** 40],
                   "pad_h": [-1, 2 ** 31], "pad_w": [-3, 2 ** 62],
                   "dilation_h": [0, -1, 2 ** 31], "dilation_w": [0, 2 ** 35],
                   "groups": [0, -1], "offset_groups": [0, -2]}
    user_cases = {"deform_conv2d": forward_user_case,
                  "deform_conv2d_backward": backward_user_case}
    good_user_args = {
        "deform_conv2d": lambda: [*(lambda a: (a[0], a[1], a[3], a[4]))(small_args()), 1, 1, 1,
                                  small_args()[2]],
        "deform_conv2d_backward": lambda: [np.ones((1, 6, 3, 4)),
                                           *(lambda a: (a[0], a[1], a[3]))(small_args()), 1, 1,
                                           1, small_args()[2]],
    }
    user_bad_values = {
        ("deform_conv2d", 4): [0, -1, (1, 0), "1", None, (1, 2, 3), 1.5],
        ("deform_conv2d", 5): [-1, (0, -1), "0", None],
        ("deform_conv2d", 6): [0, (1, 0), "1"],
        ("deform_conv2d_backward", 4): [0, (0, 1), "1", None],
        ("deform_conv2d_backward", 5): [-1, (2, 0)],
        ("deform_conv2d_backward", 6): [0, -1],
    }
