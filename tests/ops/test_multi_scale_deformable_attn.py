"""multi_scale_deformable_attn (Deformable DETR, MMCV's semantics): a
reference written from the paper's definition (a numpy grid sample per
level), PyTorch's grid_sample as a second, independent one, finite
differences for all three gradients, NaN and far-off locations, bad levels
and shapes, the PyTorch layer and MMCV drop-ins, properties, and CPU/CUDA
agreement."""
import importlib

import numpy as np
import pytest
from hypothesis import assume, strategies as st

import mmdispatch
from mmdispatch.ops import multi_scale_deformable_attn, multi_scale_deformable_attn_backward
from properties import OpProperties, assert_close, float_arrays, guarded, sentinel

msda_module = importlib.import_module("mmdispatch.ops.multi_scale_deformable_attn")
DTYPES = [np.float32, np.float64]


# --- references, from the definition, in float64 -------------------------------------------

def starts_of(shapes):
    sizes = [int(h) * int(w) for h, w in shapes]
    return np.array([sum(sizes[:i]) for i in range(len(sizes))], np.int64)


def corners(value, shapes, locations):
    """Per level: (level values (N, H, W, M, D), x and y in cells (N, Q, M, P),
    and the four corners as (cy, cx, weight, d weight / dy, d weight / dx,
    valid)). Positions outside (-1, H) x (-1, W), or NaN, have no valid
    corner."""
    start = 0
    with np.errstate(invalid="ignore", over="ignore"):
        for l, (h, w) in enumerate(shapes):
            h, w = int(h), int(w)
            level = value[:, start:start + h * w].reshape(value.shape[0], h, w, *value.shape[2:])
            start += h * w
            x = locations[:, :, :, l, :, 0] * w - 0.5
            y = locations[:, :, :, l, :, 1] * h - 0.5
            inside = (y > -1) & (y < h) & (x > -1) & (x < w)
            y0, x0 = np.floor(y), np.floor(x)
            ly, lx = y - y0, x - x0
            found = []
            for dy, wy, dwy in ((0, 1 - ly, -1.0), (1, ly, 1.0)):
                for dx, wx, dwx in ((0, 1 - lx, -1.0), (1, lx, 1.0)):
                    cy, cx = y0 + dy, x0 + dx
                    valid = inside & (cy >= 0) & (cy < h) & (cx >= 0) & (cx < w)
                    found.append((np.where(valid, cy, 0).astype(np.int64),
                                  np.where(valid, cx, 0).astype(np.int64),
                                  wy * wx, dwy * wx, wy * dwx, valid))
            yield l, level, x, y, found


def gather(level, cy, cx):
    """level[n, cy, cx, m, :] for every (n, q, m, p): (N, Q, M, P, D)."""
    n, q, m, p = cy.shape
    if level.shape[1] * level.shape[2] == 0:   # an empty level: no corner is valid
        return np.zeros(cy.shape + level.shape[4:])
    ni = np.arange(n)[:, None, None, None]
    mi = np.arange(m)[None, None, :, None]
    return level[ni, cy, cx, mi]


def ref_forward(value, shapes, locations, weights):
    value, locations, weights = (np.asarray(a, np.float64) for a in (value, locations, weights))
    n, _, m, d = value.shape
    out = np.zeros((n, locations.shape[1], m, d))
    for l, level, x, y, found in corners(value, shapes, locations):
        sampled = np.zeros(x.shape + (d,))
        for cy, cx, wgt, _, _, valid in found:
            with np.errstate(invalid="ignore"):
                sampled += np.where(valid[..., None], wgt[..., None] * gather(level, cy, cx), 0)
        sampled[np.isnan(x) | np.isnan(y)] = np.nan
        out += (weights[:, :, :, l, :, None] * sampled).sum(axis=3)
    return out.reshape(n, locations.shape[1], m * d)


def ref_backward(value, shapes, locations, weights, grad_output):
    """(grad_value, grad_sampling_locations, grad_attention_weights)."""
    value, locations, weights, grad_output = (np.asarray(a, np.float64) for a in
                                              (value, locations, weights, grad_output))
    n, s, m, d = value.shape
    g = grad_output.reshape(n, locations.shape[1], m, 1, d)   # against (N, Q, M, P, D)
    grad_value = np.zeros_like(value)
    grad_locations = np.zeros_like(locations)
    grad_weights = np.zeros_like(weights)
    start = 0
    for l, level, x, y, found in corners(value, shapes, locations):
        h, w = int(shapes[l][0]), int(shapes[l][1])
        attn = weights[:, :, :, l, :]
        val, dval_dy, dval_dx = (np.zeros(x.shape + (d,)) for _ in range(3))
        grad_level = np.zeros((n, h, w, m, d))
        for cy, cx, wgt, dwy, dwx, valid in found:
            v = gather(level, cy, cx)
            for total, factor in ((val, wgt), (dval_dy, dwy), (dval_dx, dwx)):
                with np.errstate(invalid="ignore"):
                    total += np.where(valid[..., None], factor[..., None] * v, 0)
            contribution = np.where(valid[..., None], (attn * wgt)[..., None] * g, 0)
            ni = np.broadcast_to(np.arange(n)[:, None, None, None], cy.shape)
            mi = np.broadcast_to(np.arange(m)[None, None, :, None], cy.shape)
            if h * w:
                np.add.at(grad_level, (ni, cy, cx, mi), contribution)
        undefined = np.isnan(x) | np.isnan(y)
        grad_weights[:, :, :, l, :] = np.where(undefined, np.nan, (g * val).sum(-1))
        grad_locations[:, :, :, l, :, 0] = np.where(undefined, np.nan,
                                                    attn * (g * dval_dx).sum(-1) * w)
        grad_locations[:, :, :, l, :, 1] = np.where(undefined, np.nan,
                                                    attn * (g * dval_dy).sum(-1) * h)
        grad_value[:, start:start + h * w] = grad_level.reshape(n, h * w, m, d)
        start += h * w
    return grad_value, grad_locations, grad_weights


SHAPES = np.array([[6, 4], [3, 2], [1, 1]], np.int64)


def random_case(rng, dtype, shapes=SHAPES, n=2, q=5, m=2, d=3, p=2, spread=(-0.1, 1.1)):
    s = int(sum(h * w for h, w in shapes))
    value = rng.standard_normal((n, s, m, d)).astype(dtype)
    locations = rng.uniform(*spread, (n, q, m, len(shapes), p, 2)).astype(dtype)
    weights = rng.random((n, q, m, len(shapes), p)).astype(dtype)
    return value, np.asarray(shapes, np.int64), starts_of(shapes), locations, weights


def tolerance(dtype):
    return dict(rtol=1e-5, atol=1e-5) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-12)


# --- values and gradients ----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shapes", [SHAPES, np.array([[5, 7]]), np.array([[2, 3], [0, 4], [3, 1]])])
def test_forward_and_backward_match_the_definition(dtype, shapes):
    rng = np.random.default_rng(len(shapes))
    value, shapes, starts, locations, weights = random_case(rng, dtype, shapes)
    got = multi_scale_deformable_attn(value, shapes, starts, locations, weights)
    assert got.shape == (2, 5, 6) and got.dtype == dtype
    np.testing.assert_allclose(got, ref_forward(value, shapes, locations, weights),
                               **tolerance(dtype))
    grad = rng.standard_normal(got.shape).astype(dtype)
    for got_grad, expected in zip(
            multi_scale_deformable_attn_backward(value, shapes, starts, locations, weights, grad),
            ref_backward(value, shapes, locations, weights, grad)):
        assert got_grad.dtype == dtype
        np.testing.assert_allclose(got_grad, expected, **tolerance(dtype))


@pytest.mark.parametrize("which", [0, 3, 4])
def test_backward_is_the_forwards_gradient_by_finite_differences(which, numeric_gradient):
    rng = np.random.default_rng(7 + which)
    args = list(random_case(rng, np.float64, q=3, spread=(0.02, 0.98)))
    grad = rng.standard_normal((2, 3, 6))

    def loss(v):
        call = list(args)
        call[which] = v
        return float((multi_scale_deformable_attn(*call) * grad).sum())
    expected = numeric_gradient(loss, args[which])
    got = multi_scale_deformable_attn_backward(*args, grad)[{0: 0, 3: 1, 4: 2}[which]]
    np.testing.assert_allclose(got, expected, rtol=1e-6, atol=1e-8)


def test_matches_pytorch_grid_sample_forward_and_gradients():
    """The grid_sample formulation (MMCV's and Deformable DETR's pure-PyTorch
    fallback, written here from its definition): per level, value as an
    (N*M, D, H, W) map sampled at 2 * location - 1."""
    torch = pytest.importorskip("torch")
    import torch.nn.functional as F
    rng = np.random.default_rng(3)
    value, shapes, starts, locations, weights = random_case(rng, np.float64, q=7, m=3, d=4, p=3)
    n, s, m, d = value.shape
    tv, tl, tw = (torch.from_numpy(a).requires_grad_(True) for a in (value, locations, weights))
    sampled, start = [], 0
    for l, (h, w) in enumerate(shapes.tolist()):
        level = tv[:, start:start + h * w].permute(0, 2, 3, 1).reshape(n * m, d, h, w)
        start += h * w
        grid = (2 * tl[:, :, :, l] - 1).permute(0, 2, 1, 3, 4).reshape(n * m, -1, tl.shape[4], 2)
        sampled.append(F.grid_sample(level, grid, mode="bilinear", padding_mode="zeros",
                                     align_corners=False))          # (N*M, D, Q, P)
    attn = tw.permute(0, 2, 1, 3, 4).reshape(n * m, 1, -1, len(shapes) * tw.shape[4])
    expected = (torch.cat(sampled, dim=-1) * attn).sum(-1).reshape(n, m * d, -1).transpose(1, 2)
    grad = torch.randn(expected.shape, dtype=torch.float64)
    expected.backward(grad)
    got = multi_scale_deformable_attn(value, shapes, starts, locations, weights)
    np.testing.assert_allclose(got, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    for got_grad, leaf in zip(multi_scale_deformable_attn_backward(
            value, shapes, starts, locations, weights, grad.numpy()), (tv, tl, tw)):
        np.testing.assert_allclose(got_grad, leaf.grad.numpy(), rtol=1e-10, atol=1e-12)


def test_location_on_a_cell_centre_reads_the_cell_and_outside_reads_zero():
    shapes = np.array([[2, 4]])
    value = np.arange(8, dtype=np.float64).reshape(1, 8, 1, 1)
    # cell (row 1, column 2) has its centre at x = 2.5 / 4, y = 1.5 / 2
    locations = np.array([2.5 / 4, 1.5 / 2, 2.0, 0.5, -1e30, 0.5, np.inf, 0.5]).reshape(
        1, 4, 1, 1, 1, 2)
    got = multi_scale_deformable_attn(value, shapes, np.array([0]), locations,
                                      np.full((1, 4, 1, 1, 1), 2.0))
    np.testing.assert_array_equal(got.reshape(-1), [12.0, 0.0, 0.0, 0.0])


def test_a_nan_location_makes_its_query_and_head_nan_and_nothing_else():
    rng = np.random.default_rng(5)
    value, shapes, starts, locations, weights = random_case(rng, np.float64)
    locations[1, 2, 0, 1, 0, 1] = np.nan
    out = multi_scale_deformable_attn(value, shapes, starts, locations, weights).reshape(2, 5, 2, 3)
    assert np.isnan(out[1, 2, 0]).all()
    out[1, 2, 0] = 0
    assert np.isfinite(out).all()
    grad = np.ones((2, 5, 6))
    grad_value, grad_locations, grad_weights = multi_scale_deformable_attn_backward(
        value, shapes, starts, locations, weights, grad)
    assert np.isnan(grad_locations[1, 2, 0, 1, 0]).all() and np.isnan(grad_weights[1, 2, 0, 1, 0])
    assert np.isfinite(grad_value).all()
    assert np.isfinite(grad_locations).sum() == grad_locations.size - 2


def test_far_and_infinite_locations_read_nothing_and_have_zero_gradients():
    rng = np.random.default_rng(6)
    value, shapes, starts, _, weights = random_case(rng, np.float64, q=4)
    far = np.array([1e300, -1e300, np.inf, -np.inf])
    locations = np.stack(np.broadcast_arrays(far[:, None, None, None, None],
                                             np.zeros((1, 2, 3, 2, 1))), -1)
    locations = np.broadcast_to(locations[None, ..., 0, :], (2, 4, 2, 3, 2, 2)).copy()
    assert (multi_scale_deformable_attn(value, shapes, starts, locations, weights) == 0).all()
    for grad in multi_scale_deformable_attn_backward(value, shapes, starts, locations, weights,
                                                     np.ones((2, 4, 6))):
        assert (grad == 0).all()


@pytest.mark.parametrize("n, q", [(0, 3), (2, 0)])
def test_empty_batches_and_queries_give_empty_results(n, q):
    value, shapes, starts, locations, weights = random_case(np.random.default_rng(0), np.float32,
                                                            n=n, q=q)
    assert multi_scale_deformable_attn(value, shapes, starts, locations, weights).shape == (n, q, 6)
    grads = multi_scale_deformable_attn_backward(value, shapes, starts, locations, weights,
                                                 np.zeros((n, q, 6), np.float32))
    assert [g.shape for g in grads] == [value.shape, locations.shape, weights.shape]
    assert not grads[0].any()


def test_im2col_step_changes_nothing_and_is_checked():
    args = random_case(np.random.default_rng(1), np.float64)
    first = multi_scale_deformable_attn(*args, im2col_step=1)
    np.testing.assert_array_equal(first, multi_scale_deformable_attn(*args, im2col_step=64))
    with pytest.raises(ValueError, match="^multi_scale_deformable_attn: im2col_step must be >= 1"):
        multi_scale_deformable_attn(*args, im2col_step=0)
    with pytest.raises(TypeError, match="^multi_scale_deformable_attn: im2col_step must be an int"):
        multi_scale_deformable_attn(*args, im2col_step=2.0)


# --- bad input -------------------------------------------------------------------------------

def bad_levels_cases():
    return [
        (np.array([[6, 4], [3, 2], [1, 1]]), np.array([0, 25, 30]),
         r"level_start_index\[1\] = 25 is not the number of keys in the levels before it"),
        (np.array([[6, 4], [3, 2], [1, 1]]), np.array([1, 24, 30]),
         r"level_start_index\[0\] = 1"),
        (np.array([[6, 4], [3, 2], [2, 1]]), np.array([0, 24, 30]),
         r"the levels of spatial_shapes do not hold exactly value's 31 keys"),
        (np.array([[6, 4], [3, 2], [0, 1]]), np.array([0, 24, 30]),
         r"the levels of spatial_shapes do not hold exactly value's 31 keys"),
        (np.array([[6, 4], [-3, -2], [1, 1]]), np.array([0, 24, 30]),
         r"spatial_shapes\[1\] = \(-3, -2\): sizes must be >= 0 and < 2\*\*31"),
        (np.array([[6, 4], [2 ** 32, 0], [1, 1]]), np.array([0, 24, 24]),
         r"spatial_shapes\[1\] = \(4294967296, 0\)"),
    ]


@pytest.mark.parametrize("shapes, starts, message", bad_levels_cases())
@pytest.mark.parametrize("backward", [False, True])
def test_inconsistent_levels_are_errors_naming_the_level_and_nothing_is_written(
        shapes, starts, message, backward):
    value, _, _, locations, weights = random_case(np.random.default_rng(2), np.float64)
    if backward:
        outs = [np.full(value.shape, 7.0), np.full(locations.shape, 7.0),
                np.full(weights.shape, 7.0)]
        with pytest.raises(ValueError, match="^multi_scale_deformable_attn_backward_impl: "
                                             + message):
            mmdispatch.multi_scale_deformable_attn_backward_impl(
                value, shapes, starts, locations, weights, np.ones((2, 5, 6)), *outs)
    else:
        outs = [np.full((2, 5, 6), 7.0)]
        with pytest.raises(ValueError, match="^multi_scale_deformable_attn_forward_impl: "
                                             + message):
            mmdispatch.multi_scale_deformable_attn_forward_impl(value, shapes, starts, locations,
                                                                weights, outs[0])
    assert all((o == 7).all() for o in outs)


def test_bad_arguments_raise_clear_errors():
    value, shapes, starts, locations, weights = random_case(np.random.default_rng(0), np.float64)
    op = "multi_scale_deformable_attn"
    cases = [
        ((value[0], shapes, starts, locations, weights), ValueError, f"^{op}: value must be 4-D"),
        ((value, shapes, starts, locations[..., :1], weights), ValueError,
         f"^{op}_forward_impl: sampling_locations must have shape"),
        ((value, shapes, starts, locations[:, :, :, :2], weights), ValueError,
         f"^{op}_forward_impl: sampling_locations must have shape"),
        ((value, shapes, starts, locations, weights[..., :1]), ValueError,
         f"^{op}_forward_impl: attention_weights must have shape"),
        ((value, shapes.astype(np.float64), starts, locations, weights), TypeError,
         f"^{op}: spatial_shapes must have an integer dtype"),
        ((value, shapes[:, :1], starts, locations, weights), ValueError,
         f"^{op}_forward_impl: spatial_shapes must have shape"),
        ((value, shapes, starts[:2], locations, weights), ValueError,
         f"^{op}_forward_impl: level_start_index must have shape"),
        ((value, shapes, starts, locations.astype(np.float32), weights), TypeError,
         f"^{op}_forward_impl: sampling_locations"),
        ((value.astype(np.float16), shapes, starts, locations.astype(np.float16),
          weights.astype(np.float16)), TypeError, f"^{op}_forward_impl: value .*float16"),
    ]
    for args, error, message in cases:
        with pytest.raises(error, match=message):
            multi_scale_deformable_attn(*args)
    with pytest.raises(ValueError, match=f"^{op}_backward_impl: grad_output must have shape"):
        multi_scale_deformable_attn_backward(value, shapes, starts, locations, weights,
                                             np.ones((2, 5, 5)))


# --- the PyTorch layer -----------------------------------------------------------------------

def torch_case(torch, device="cpu", dtype=np.float64, **sizes):
    args = random_case(np.random.default_rng(8), dtype, **sizes)
    value, shapes, starts, locations, weights = (torch.from_numpy(a).to(device) for a in args)
    return (value.requires_grad_(True), shapes, starts, locations.requires_grad_(True),
            weights.requires_grad_(True))


def test_mmcv_drop_ins_give_the_op_with_autograd():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch import mmcv
    value, shapes, starts, locations, weights = torch_case(torch)
    expected = ref_forward(value.detach().numpy(), shapes.numpy(), locations.detach().numpy(),
                           weights.detach().numpy())
    for out in (mmcv.multi_scale_deformable_attn(value, shapes, starts, locations, weights, 64),
                mmcv.MultiScaleDeformableAttnFunction.apply(value, shapes, starts, locations,
                                                            weights, 64),
                mmcv.multi_scale_deformable_attn_pytorch(value, shapes, locations, weights)):
        np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    assert torch.autograd.gradcheck(
        lambda v, l, w: mmcv.multi_scale_deformable_attn(v, shapes, starts, l, w, 64),
        (value, locations.detach().clamp(0.05, 0.95).requires_grad_(True), weights))


def test_mmcv_module_projects_queries_to_locations_and_weights():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch.mmcv import MultiScaleDeformableAttention
    torch.manual_seed(0)
    module = MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=2,
                                           num_points=3, dropout=0.0,
                                           batch_first=True).double()
    shapes = torch.tensor([[4, 5], [2, 3]])
    starts = torch.tensor([0, 20])
    n, q, s = 2, 7, 26
    query = torch.randn(n, q, 16, dtype=torch.float64)
    value = torch.randn(n, s, 16, dtype=torch.float64, requires_grad=True)
    reference_points = torch.rand(n, q, 2, 2, dtype=torch.float64)
    out = module(query, value=value, reference_points=reference_points, spatial_shapes=shapes,
                 level_start_index=starts)
    assert out.shape == (n, q, 16)
    # the same computation through the plain op
    v = module.value_proj(value).view(n, s, 2, 8)
    offsets = module.sampling_offsets(query).view(n, q, 2, 2, 3, 2)
    weights = module.attention_weights(query).view(n, q, 2, 6).softmax(-1).view(n, q, 2, 2, 3)
    normaliser = torch.stack([shapes[..., 1], shapes[..., 0]], -1)
    locations = reference_points[:, :, None, :, None, :] + offsets / normaliser[None, None, None,
                                                                                :, None, :]
    from mmdispatch.torch.mmcv import multi_scale_deformable_attn as op
    expected = module.output_proj(op(v, shapes, starts, locations, weights, 64)) + query
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    assert value.grad is not None and module.sampling_offsets.weight.grad is not None


def test_mmcv_module_initialisation_sequence_first_layout_and_box_references():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch.mmcv import MultiScaleDeformableAttention
    module = MultiScaleDeformableAttention(embed_dims=8, num_heads=4, num_levels=1, num_points=2,
                                           dropout=0.0)
    # head h starts looking along angle 2 pi h / 4, point i at i + 1 times that
    offsets = module.sampling_offsets.bias.detach().view(4, 1, 2, 2)
    torch.testing.assert_close(offsets[:, 0, 1], 2 * offsets[:, 0, 0])
    torch.testing.assert_close(offsets[:, 0, 0], torch.tensor([[1.0, 0], [0, 1], [-1, 0],
                                                               [0, -1]]), atol=1e-6, rtol=0)
    assert not module.attention_weights.weight.any() and not module.attention_weights.bias.any()
    shapes, starts = torch.tensor([[3, 4]]), torch.tensor([0])
    query, value = torch.randn(5, 2, 8), torch.randn(12, 2, 8)   # (Q or S, N, C)
    boxes = torch.rand(2, 5, 1, 4)
    out = module(query, value=value, reference_points=boxes, spatial_shapes=shapes,
                 level_start_index=starts)
    assert out.shape == (5, 2, 8)
    module.batch_first = True
    torch.testing.assert_close(module(query.transpose(0, 1), value=value.transpose(0, 1),
                                      reference_points=boxes, spatial_shapes=shapes,
                                      level_start_index=starts), out.transpose(0, 1))
    with pytest.raises(ValueError, match="^MultiScaleDeformableAttention: embed_dims"):
        MultiScaleDeformableAttention(embed_dims=10, num_heads=4)


# --- CUDA ------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(cupy, dtype):
    rng = np.random.default_rng(11)
    shapes = np.array([[20, 30], [10, 15], [5, 8], [3, 4]])
    args = random_case(rng, dtype, shapes, n=2, q=300, m=4, d=32, p=4)
    grad = rng.standard_normal((2, 300, 128)).astype(dtype)
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == np.float32 else dict(rtol=1e-11, atol=1e-11)
    on_gpu = [cupy.asarray(a) for a in args]
    np.testing.assert_allclose(cupy.asnumpy(multi_scale_deformable_attn(*on_gpu)),
                               multi_scale_deformable_attn(*args), **tol)
    for backend in ("default", "deterministic"):
        with mmdispatch.use_backend("cuda", backend):
            got = multi_scale_deformable_attn_backward(*on_gpu, cupy.asarray(grad))
        for g, e in zip(got, multi_scale_deformable_attn_backward(*args, grad)):
            np.testing.assert_allclose(cupy.asnumpy(g), e, **tol)


@pytest.mark.parametrize("backend", ["default", "deterministic"])
@pytest.mark.parametrize("d, p", [(1, 3), (32, 3), (70, 3), (32, 12), (70, 12)])
def test_emulated_cuda_backward_over_one_warp_of_channels_and_more_equals_the_cpu(
        cuda_emulator, backend, d, p):
    """The CUDA backward's warp per (image, query, head): 1 channel (31
    lanes idle), 32 (one per lane, held in registers), 70 (a lane's first
    channel held, the rest read as they come); the four sums over the
    channels (warp_sum4) equal the CPU's. Its samples' locations come 32 at
    a time, a lane each: 9 samples (3 levels of 3 points) and 36 (of 12
    points: a chunk of 32, then 4, with NaN locations in both). Run by the
    emulator."""
    from cuda_emu import DeviceView
    rng = np.random.default_rng(d * p)
    args = random_case(rng, np.float64, n=2, q=3, m=2, d=d, p=p)
    if p == 12:   # samples 17 and 35 of two warps: NaN gradients, nothing for value
        args[3][0, 1, 0, 1, 5, 0] = np.nan
        args[3][1, 2, 1, 2, 11, 1] = np.nan
    grad = rng.standard_normal((2, 3, 2 * d))
    expected = multi_scale_deformable_attn_backward(*args, grad)
    assert np.isnan(expected[2]).sum() == (2 if p == 12 else 0)   # the NaN samples' weights
    got = [np.zeros_like(expected[0])] + [np.full_like(e, 7.0) for e in expected[1:]]
    # (grad_value is added into: Tensor+)
    with cuda_emulator.active(), mmdispatch.use_backend("cuda", backend):
        mmdispatch.multi_scale_deformable_attn_backward_impl(
            *[DeviceView(a) for a in args], DeviceView(grad), *[DeviceView(g) for g in got])
        cuda_emulator.synchronize()
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-12)


def misaligned(array):
    """A copy of `array` whose data starts an element past a 16-byte boundary
    (aligned to its dtype, as the dispatcher requires, but not to 16)."""
    raw = np.empty(array.nbytes + 16 + array.itemsize, np.uint8)
    start = (-raw.ctypes.data) % 16 + array.itemsize
    out = raw[start:start + array.nbytes].view(array.dtype).reshape(array.shape)
    out[...] = array
    return out


@pytest.mark.parametrize("backend", ["default", "deterministic"])
@pytest.mark.parametrize("dtype, d", [(np.float32, 4), (np.float32, 8), (np.float32, 12),
                                      (np.float32, 32), (np.float32, 256), (np.float64, 2),
                                      (np.float64, 70), (np.float16, 32), (np.float32, 6)])
@pytest.mark.parametrize("aligned", [True, False])
def test_emulated_cuda_kernels_in_16_byte_packs_of_channels_equal_the_cpu(
        cuda_emulator, backend, dtype, d, aligned):
    """A head's channels in 16-byte packs (4 float32, 2 float64, 8 float16)
    where they split so: a thread per pack in the forward, and backward
    groups of 1, 2, 4, 8 and 32 lanes per item (a lane per pack; 256
    float32 channels give each lane two packs, 70 float64 ones three lanes
    two), several items per warp; 6 float32 channels, and arrays that are
    not 16-byte aligned, go channel by channel. The forward and every
    gradient equal the CPU's (float16 computes in float32 on the GPU and
    is compared with the float32 CPU kernel). Run by the emulator."""
    from cuda_emu import DeviceView
    rng = np.random.default_rng(d)
    cpu_dtype = np.float32 if dtype == np.float16 else dtype
    args = random_case(rng, np.float64, n=2, q=7, m=3, d=d, p=3)
    args[3][1, 4, 2, 1, 2, 0] = np.nan   # one sample of the last item: NaN gradients
    args = [a.astype(dtype) if a.dtype == np.float64 else a for a in args]
    grad = rng.standard_normal((2, 7, 3 * d)).astype(dtype)
    cpu = [a.astype(cpu_dtype) if a.dtype == dtype else a for a in args]
    expected_out = multi_scale_deformable_attn(*cpu)
    expected = multi_scale_deformable_attn_backward(*cpu, grad.astype(cpu_dtype))
    place = (lambda a: a) if aligned else misaligned
    out = place(np.full(expected_out.shape, 7.0, dtype))
    got = [place(np.zeros(expected[0].shape, dtype))] + [
        np.full(e.shape, 7.0, dtype) for e in expected[1:]]
    device_args = [DeviceView(place(a)) if a.dtype == dtype else DeviceView(a) for a in args]
    with cuda_emulator.active(), mmdispatch.use_backend("cuda", backend):
        mmdispatch.multi_scale_deformable_attn_forward_impl(*device_args, DeviceView(out))
        mmdispatch.multi_scale_deformable_attn_backward_impl(
            *device_args, DeviceView(place(grad)), *[DeviceView(g) for g in got])
        cuda_emulator.synchronize()
    tol = {np.float16: 2e-3, np.float32: 1e-5, np.float64: 1e-12}[dtype]
    np.testing.assert_allclose(out.astype(cpu_dtype), expected_out, rtol=tol, atol=tol)
    assert np.isnan(expected[1]).sum() == 2 and np.isnan(expected[2]).sum() == 1
    # the default backend adds into a float16 grad_value with float16
    # atomics, each add rounded, in the order the threads come (a GPU's, or
    # MMD_EMU_ORDER's): several float16 steps apart from one order to another
    atomic_tol = 1e-2 if dtype == np.float16 and backend == "default" else tol
    for g, e, t in zip(got, expected, [atomic_tol, tol, tol]):
        np.testing.assert_allclose(g.astype(cpu_dtype), e, rtol=t, atol=t)


def test_emulated_deterministic_backward_bits_do_not_depend_on_the_arrays_alignment(
        cuda_emulator):
    """The same call on 16-byte aligned arrays and on copies an element off
    gives the same bits in the deterministic backend (the default one takes
    16-byte packs only where it can). Run by the emulator."""
    from cuda_emu import DeviceView
    rng = np.random.default_rng(5)
    args = random_case(rng, np.float32, n=2, q=7, m=3, d=32, p=3)
    grad = rng.standard_normal((2, 7, 96)).astype(np.float32)
    runs = []
    for place in (lambda a: a, misaligned):
        got = [place(np.zeros(args[0].shape, np.float32)),
               np.zeros(args[3].shape, np.float32), np.zeros(args[4].shape, np.float32)]
        arrays = [DeviceView(place(a)) if a.dtype == np.float32 else DeviceView(a)
                  for a in args]
        with cuda_emulator.active(), mmdispatch.use_backend("cuda", "deterministic"):
            mmdispatch.multi_scale_deformable_attn_backward_impl(
                *arrays, DeviceView(place(grad)), *[DeviceView(g) for g in got])
            cuda_emulator.synchronize()
        runs.append([g.tobytes() for g in got])
    assert runs[0] == runs[1]


def test_cuda_deterministic_backward_is_bit_identical_across_runs(cupy):
    rng = np.random.default_rng(12)
    # many queries sampling the same few cells: the atomic sums' order varies
    args = random_case(rng, np.float32, np.array([[2, 2]]), n=1, q=4000, m=2, d=32, p=4,
                       spread=(0.2, 0.8))
    on_gpu = [cupy.asarray(a) for a in args]
    grad = cupy.asarray(rng.standard_normal((1, 4000, 64)).astype(np.float32))
    with mmdispatch.use_backend("cuda", "deterministic"):
        runs = [cupy.asnumpy(multi_scale_deformable_attn_backward(*on_gpu, grad)[0])
                for _ in range(3)]
    assert all(r.tobytes() == runs[0].tobytes() for r in runs)


@pytest.mark.parametrize("shapes, starts, message", bad_levels_cases()[:3])
def test_cuda_bad_levels_raise_in_strict_mode_and_write_nothing(cupy, shapes, starts, message):
    value, _, _, locations, weights = random_case(np.random.default_rng(2), np.float64)
    out = cupy.full((2, 5, 6), 7.0)
    with mmdispatch.strict():
        with pytest.raises(ValueError, match="^multi_scale_deformable_attn_forward_impl: "
                                             + message.split(" = ")[0]):
            mmdispatch.multi_scale_deformable_attn_forward_impl(
                cupy.asarray(value), cupy.asarray(shapes), cupy.asarray(starts),
                cupy.asarray(locations), cupy.asarray(weights), out)
    assert bool((out == 7).all())


def test_cuda_bad_levels_are_a_deferred_error_and_read_nothing_outside(cupy):
    value, _, _, locations, weights = random_case(np.random.default_rng(2), np.float64)
    shapes = cupy.asarray(np.array([[60, 40], [3, 2], [1, 1]]))   # far more keys than value has
    multi_scale_deformable_attn(cupy.asarray(value), shapes, cupy.asarray(starts_of(SHAPES)),
                                cupy.asarray(locations), cupy.asarray(weights))
    with pytest.raises(ValueError, match="multi_scale_deformable_attn_forward_impl: "):
        mmdispatch.synchronize("cuda")


def test_cuda_float16_and_bfloat16_compute_in_float32(torch_cuda):
    torch = torch_cuda
    args = random_case(np.random.default_rng(13), np.float32)
    expected = multi_scale_deformable_attn(*args)
    for dtype in (torch.float16, torch.bfloat16):
        value, shapes, starts, locations, weights = (torch.from_numpy(a).cuda() for a in args)
        got = multi_scale_deformable_attn(value.to(dtype), shapes, starts, locations.to(dtype),
                                          weights.to(dtype))
        assert got.dtype == dtype
        np.testing.assert_allclose(got.float().cpu().numpy(), expected, rtol=3e-2, atol=3e-2)


# --- properties (tests/support/properties.py) --------------------------------------------------

@st.composite
def problem(draw, dtype):
    levels = draw(st.integers(0, 3))
    shapes = np.array([[draw(st.integers(0, 3)), draw(st.integers(0, 3))]
                       for _ in range(levels)], np.int64).reshape(levels, 2)
    s = int(sum(h * w for h, w in shapes))
    n, q, m, d, p = (draw(st.integers(0, 2)), draw(st.integers(0, 3)), draw(st.integers(1, 2)),
                     draw(st.integers(0, 3)), draw(st.integers(1, 2)))
    value = draw(float_arrays((n, s, m, d), dtype))
    locations = draw(float_arrays((n, q, m, levels, p, 2), dtype, -1.5, 1.5))
    weights = draw(float_arrays((n, q, m, levels, p), dtype, -2, 2))
    return value, shapes, starts_of(shapes), locations, weights


@st.composite
def forward_case(draw, dtype):
    value, shapes, starts, locations, weights = draw(problem(dtype))
    out_shape = (value.shape[0], locations.shape[1], value.shape[2] * value.shape[3])
    args = dict(value=guarded(value), spatial_shapes=guarded(shapes),
                level_start_index=guarded(starts), sampling_locations=guarded(locations),
                attention_weights=guarded(weights), output=guarded(sentinel(out_shape, dtype)))

    def check(a):
        assert_close(a["output"], ref_forward(value, shapes, locations, weights), dtype)
    return args, check


@st.composite
def backward_case(draw, dtype):
    value, shapes, starts, locations, weights = draw(problem(dtype))
    out_shape = (value.shape[0], locations.shape[1], value.shape[2] * value.shape[3])
    # finite: backward weights the corners after the sums over channels, so
    # an infinite gradient may give NaN where the definition gives inf (the
    # module docstring says so)
    grad = draw(float_arrays(out_shape, dtype, -2, 2, specials=False))
    initial = draw(float_arrays(value.shape, dtype, -2, 2, specials=False))
    args = dict(value=guarded(value), spatial_shapes=guarded(shapes),
                level_start_index=guarded(starts), sampling_locations=guarded(locations),
                attention_weights=guarded(weights), grad_output=guarded(grad),
                grad_value=guarded(initial),
                grad_sampling_locations=guarded(sentinel(locations.shape, dtype)),
                grad_attention_weights=guarded(sentinel(weights.shape, dtype)))

    def check(a):
        expected = ref_backward(value, shapes, locations, weights, grad)
        assert_close(a["grad_value"], initial + expected[0], dtype)
        assert_close(a["grad_sampling_locations"], expected[1], dtype)
        assert_close(a["grad_attention_weights"], expected[2], dtype)
    return args, check


def user_case(draw, name, dtype, layout):
    backward = name == "multi_scale_deformable_attn_backward"
    a, check = draw((backward_case if backward else forward_case)(dtype))
    names = ["value", "spatial_shapes", "level_start_index", "sampling_locations",
             "attention_weights"] + (["grad_output"] if backward else [])
    inputs = {k: layout(a[k]) for k in names}

    def run():
        args = [inputs[k] for k in names]
        return (multi_scale_deformable_attn_backward if backward
                else multi_scale_deformable_attn)(*args)

    def verify(result):
        if not backward:
            return check(dict(a, output=result))
        expected = ref_backward(*(a[k] for k in names[:2]), a["sampling_locations"],
                                a["attention_weights"], a["grad_output"])
        for got, e in zip(result, expected):
            assert_close(got, e, dtype)
    return run, inputs, verify


def small_args():
    return list(random_case(np.random.default_rng(0), np.float64, q=2))


def torch_forward_calls(torch, device):
    value, shapes, starts, locations, weights = torch_case(torch, device, q=3)
    return [(value, shapes, starts, locations, weights),
            (value.detach(), shapes, starts, locations, weights.detach())]


def torch_backward_calls(torch, device):
    value, shapes, starts, locations, weights = torch_case(torch, device, q=3)
    return [(value.detach(), shapes, starts, locations.detach(), weights.detach(),
             torch.randn(2, 3, 6, dtype=torch.float64, device=device))]


class TestProperties(OpProperties):
    module = msda_module
    torch_calls = {"multi_scale_deformable_attn_forward_impl": torch_forward_calls,
                   "multi_scale_deformable_attn_backward_impl": torch_backward_calls}
    entry_cases = {"multi_scale_deformable_attn_forward_impl": forward_case,
                   "multi_scale_deformable_attn_backward_impl": backward_case}
    _common = {"value": [0, 1, 2, 3], "spatial_shapes": [0, 1], "level_start_index": [0],
               "sampling_locations": [0, 1, 2, 3, 4, 5], "attention_weights": [0, 1, 2, 3, 4]}
    fixed_axes = {
        "multi_scale_deformable_attn_forward_impl": dict(_common, output=[0, 1, 2]),
        "multi_scale_deformable_attn_backward_impl": dict(
            _common, grad_output=[0, 1, 2], grad_value=[0, 1, 2, 3],
            grad_sampling_locations=[0, 1, 2, 3, 4, 5], grad_attention_weights=[0, 1, 2, 3, 4]),
    }
    user_cases = {name: user_case for name in msda_module.__all__}
    good_user_args = {"multi_scale_deformable_attn": small_args,
                      "multi_scale_deformable_attn_backward":
                      lambda: small_args() + [np.ones((2, 2, 6))]}
    user_bad_values = {
        ("multi_scale_deformable_attn", 1): [np.array([[6, 4], [3, 2]]), np.array([6, 4, 3]),
                                             np.array([[6.0, 4], [3, 2], [1, 1]]), "shapes"],
        ("multi_scale_deformable_attn", 2): [np.array([0, 24]), np.array([0, 23, 30]),
                                             np.array([0.0, 24, 30])],
        ("multi_scale_deformable_attn_backward", 5): [np.ones((2, 2, 5)), np.ones((2, 6)),
                                                      None],
    }

    def bad_data(self, draw, op_name, args):
        shapes, starts = args["spatial_shapes"].copy(), args["level_start_index"].copy()
        assume(shapes.size > 0)
        level = draw(st.integers(0, len(shapes) - 1))
        if draw(st.booleans()):
            starts[level] += draw(st.sampled_from([1, -1, 2 ** 40]))
        else:
            shapes[level, draw(st.integers(0, 1))] = draw(st.sampled_from([-1, 2 ** 31, 2 ** 62]))
        assume(not (shapes == args["spatial_shapes"]).all() or
               not (starts == args["level_start_index"]).all())
        return (dict(args, spatial_shapes=guarded(shapes), level_start_index=guarded(starts)),
                f"data: spatial_shapes = {shapes.tolist()}, level_start_index = {starts.tolist()}")
