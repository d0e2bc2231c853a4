"""softmax_focal_loss (MMCV's definition): a slow reference from the
definition, MMCV's published values, stability for large logits, finite
differences, ignored rows and bad targets, reductions, the PyTorch layer,
properties, and CPU/CUDA agreement."""
import importlib
import math

import numpy as np
import pytest
from hypothesis import assume, strategies as st

import mmdispatch
from mmdispatch.ops import (softmax_focal_loss, softmax_focal_loss_backward,
                            softmax_focal_loss_forward)
from properties import OpProperties, float_arrays, guarded, sentinel

focal_module = importlib.import_module("mmdispatch.ops.softmax_focal_loss")
DTYPES = [np.float32, np.float64]


# --- slow reference, from the definition, in float64 -------------------------------------

def ref_loss_and_grad(x, target, gamma, alpha, weight=None, grad_output=None):
    """(loss (N,), d sum(loss * grad_output) / d x (N, C)): p by a plain
    softmax per row, d loss / d p by hand, then the chain rule through
    d p / d x_c = p * (delta - p_c)."""
    x = np.asarray(x, np.float64)
    n, c = x.shape
    grad_output = np.ones(n) if grad_output is None else np.asarray(grad_output, np.float64)
    loss, grad = np.zeros(n), np.zeros((n, c))
    for i in range(n):
        t = int(target[i])
        if t < 0:
            continue
        shifted = x[i] - x[i].max()
        probs = np.exp(shifted) / np.exp(shifted).sum()
        p = probs[t]
        log_p = shifted[t] - np.log(np.exp(shifted).sum())
        w = 1.0 if weight is None else float(weight[t])
        loss[i] = -alpha * (1 - p) ** gamma * log_p * w
        # d/dp of (1 - p)**gamma * log(p); the second term is 0 when gamma is,
        # and tends to 0 as p tends to 1
        d_focal = (1 - p) ** gamma / p
        if gamma and p < 1:
            d_focal -= gamma * (1 - p) ** (gamma - 1) * log_p
        d_loss_d_p = -alpha * w * d_focal
        grad[i] = grad_output[i] * d_loss_d_p * p * ((np.arange(c) == t) - probs)
    return loss, grad


def tolerance(dtype):
    return dict(rtol=2e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-10, atol=1e-12)


def random_case(rng, dtype, n=6, c=5):
    x = (rng.standard_normal((n, c)) * 3).astype(dtype)
    target = rng.integers(-1, c, n)
    weight = rng.random(c).astype(dtype)
    return x, target, weight


# --- values -------------------------------------------------------------------------------

MMCV_CASES = [   # MMCV's test_focal_loss.py: (input, target, mean loss, gradient), gamma 2, alpha 0.25
    ([[1., 0], [0, 1.]], [0, 1], 0.00566451, [[-0.00657264, 0.00657264],
                                              [0.00657264, -0.00657264]]),
    ([[1., 0, -1.], [0, 1., 2.]], [2, 1], 0.34956908, [[0.10165970, 0.03739851, -0.13905823],
                                                       [0.01227554, -0.10298023, 0.09070466]]),
    ([[1e-6, 2e-6, 3e-6], [4e-6, 5e-5, 6e-4], [7e-3, 8e-2, 9e-1]], [1, 2, 0], 0.15754992,
     [[0.02590877, -0.05181759, 0.02590882], [0.02589641, 0.02589760, -0.05179400],
      [-0.07307514, 0.02234372, 0.05073142]]),
]


@pytest.mark.parametrize("case", MMCV_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_mmcv_published_values(case, dtype):
    x, target, mean, grad = case
    x, target = np.array(x, dtype), np.array(target)
    assert float(softmax_focal_loss(x, target, 2.0, 0.25)) == pytest.approx(mean, rel=1e-6)
    got = softmax_focal_loss_backward(x, target, np.full(len(target), 1 / len(target), dtype),
                                      2.0, 0.25)
    np.testing.assert_allclose(got, grad, rtol=1e-5, atol=2e-8)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma, alpha", [(2.0, 0.25), (0.0, 1.0), (0.5, 0.5), (3.5, -0.3)])
def test_forward_and_backward_match_the_definition(dtype, gamma, alpha):
    rng = np.random.default_rng(int(gamma * 10))
    x, target, weight = random_case(rng, dtype)
    grad_output = rng.standard_normal(len(target)).astype(dtype)
    for w in (None, weight):
        loss, grad = ref_loss_and_grad(x, target, gamma, alpha, w, grad_output)
        np.testing.assert_allclose(softmax_focal_loss_forward(x, target, gamma, alpha, w), loss,
                                   **tolerance(dtype))
        np.testing.assert_allclose(softmax_focal_loss_backward(x, target, grad_output, gamma,
                                                               alpha, w), grad,
                                   **tolerance(dtype))


def test_backward_is_the_forwards_gradient_by_finite_differences(numeric_gradient):
    rng = np.random.default_rng(4)
    x, target, weight = random_case(rng, np.float64)
    grad_output = rng.standard_normal(len(target))
    expected = numeric_gradient(
        lambda v: float((softmax_focal_loss_forward(v, target, 1.5, 0.4, weight)
                         * grad_output).sum()), x)
    np.testing.assert_allclose(softmax_focal_loss_backward(x, target, grad_output, 1.5, 0.4,
                                                           weight), expected, rtol=1e-6,
                               atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_give_the_exact_log_softmax_not_a_clamped_one(dtype):
    x = np.array([[1000.0, 0.0], [0.0, 1000.0], [-1e4, 1e4]], dtype)
    loss = softmax_focal_loss_forward(x, np.array([1, 1, 0]), 2.0, 0.25)
    # -log p = 1000 (MMCV's FLT_MIN clamp gives about 87.3), (1 - p)**2 = 1
    np.testing.assert_allclose(loss, [250.0, 0.0, 5000.0], rtol=1e-6)
    grad = softmax_focal_loss_backward(x, np.array([1, 1, 0]), np.ones(3, dtype), 2.0, 0.25)
    assert np.isfinite(grad).all()
    np.testing.assert_allclose(grad[0], [0.25, -0.25], rtol=1e-6)


def decimal_loss_and_grad(row, target, gamma, alpha):
    """A row's loss and gradient (gamma an integer) from the definition,
    in 50-digit decimal arithmetic from the row's exact values."""
    import decimal
    with decimal.localcontext() as ctx:
        ctx.prec = 50
        xs = [decimal.Decimal(float(v)) for v in row]
        top = max(xs)
        total = sum((v - top).exp() for v in xs)
        probs = [(v - top).exp() / total for v in xs]
        p, log_p = probs[target], xs[target] - top - total.ln()
        q, a = 1 - p, decimal.Decimal(alpha)
        loss = -a * q ** gamma * log_p
        # d loss / d p, times d p / d x_c = p (delta - p_c)
        d_p = -a * (q ** gamma / p - gamma * q ** (gamma - 1) * log_p)
        grad = [d_p * p * ((1 if c == target else 0) - probs[c]) for c in range(len(xs))]
        return float(loss), [float(g) for g in grad]


@pytest.mark.parametrize("dtype", DTYPES)
def test_confident_rows_keep_their_small_loss_and_gradient_to_a_few_ulps(dtype):
    """Rows whose target leads the others by 2 to 25 (float32) or 60
    (float64), some with the others tied at the maximum, against a 50-digit
    reference: the log-softmax of a sum near 1 is taken as log1p of the
    terms but one at the maximum, so the loss (about -log p, tiny) keeps its
    digits; log of the rounded sum gave 0 or a loss off by its whole value.
    The bound is a few ulps times what rounding x_c - max costs (about
    |x_c - max| ulps of e^(x_c - max))."""
    rng = np.random.default_rng(7)
    n, c = 60, 9
    x = rng.standard_normal((n, c)) * rng.choice([0.5, 3.0, 10.0], (n, 1))
    target = rng.integers(0, c, n)
    margin = rng.uniform(2, 25 if dtype == np.float32 else 60, n)
    for i in range(n):
        x[i, target[i]] = x[i].max() + margin[i]
        if i % 4 == 0:   # a tie at the maximum, next to the target
            x[i, (target[i] + 1) % c] = x[i, target[i]]
    x = x.astype(dtype)
    eps, tiny = np.finfo(dtype).eps, np.finfo(dtype).tiny
    loss = softmax_focal_loss_forward(x, target, 2.0, 0.25)
    grad = softmax_focal_loss_backward(x, target, np.ones(n, dtype), 2.0, 0.25)
    for i in range(n):
        ref_loss, ref_grad = decimal_loss_and_grad(x[i], int(target[i]), 2, 0.25)
        span = float(x[i].max()) - float(x[i].min())
        bound = 8 * eps * (4 + span)
        assert abs(loss[i] - ref_loss) <= bound * abs(ref_loss), (i, loss[i], ref_loss)
        for col in range(c):
            assert abs(grad[i, col] - ref_grad[col]) <= bound * max(abs(ref_grad[col]), tiny), \
                (i, col, grad[i, col], ref_grad[col])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("classes", [1, 3, 7, 8, 9, 16, 17, 81])
def test_each_row_is_bit_for_bit_what_it_is_alone_whatever_shares_its_vector(dtype, classes):
    """The CPU kernel takes a row's per-row math (log1p of its sum, its
    target's q and p) on a vector of 8 or 4 rows, and the rows whose sum or
    target lie outside the vector math's domain (NaN, infinity, a target
    far below the maximum) in scalar: each row, loss and gradient, has the
    bits it has on its own, next to any such rows, ignored rows, ties and
    rows of a block's tail; and matches the reference where finite. Rows of
    classes below, at and past a vector's length, and with a tail vector
    that overlaps the last whole one."""
    rng = np.random.default_rng(classes)
    n = 29
    x = rng.standard_normal((n, classes)) * 3
    target = rng.integers(0, classes, n)
    far = 200.0 if dtype == np.float32 else 1000.0   # beyond kSafe (80 or 700)
    x[1, target[1]] = np.nan
    x[2, :] = np.nan
    x[3, target[3]] = -np.inf
    x[4, :] = -np.inf
    x[5, target[5]] = x[5].max() - far
    x[6, target[6]] = x[6].max() + far
    x[7, :] = x[7].max()   # all tied
    x[8, 0] = np.inf
    target[[9, 17, 18]] = -1
    x[10, target[10]] = x[10].max() + 1e-3
    x = x.astype(dtype)
    weight = rng.random(classes).astype(dtype) + 0.5
    grad_output = rng.standard_normal(n).astype(dtype)
    with np.errstate(invalid="ignore"):
        loss = softmax_focal_loss_forward(x, target, 2.0, 0.25, weight)
        grad = softmax_focal_loss_backward(x, target, grad_output, 2.0, 0.25, weight)
    for i in range(n):
        one = slice(i, i + 1)
        alone = softmax_focal_loss_forward(x[one], target[one], 2.0, 0.25, weight)
        grad_alone = softmax_focal_loss_backward(x[one], target[one], grad_output[one], 2.0,
                                                 0.25, weight)
        assert loss[one].tobytes() == alone.tobytes(), (i, loss[i], alone)
        assert grad[one].tobytes() == grad_alone.tobytes(), (i, grad[i], grad_alone)
    finite = np.isfinite(x).all(axis=1) & (target >= 0)
    finite[5] = dtype == np.float32 or classes == 1   # the reference's p underflows: 0 * inf
    shifted = x[5].astype(np.float64) - x[5].max()
    log_p = shifted[target[5]] - np.log(np.exp(shifted).sum())
    np.testing.assert_allclose(loss[5], -0.25 * (-np.expm1(log_p)) ** 2 * log_p
                               * weight[target[5]], rtol=1e-6)
    with np.errstate(invalid="ignore", divide="ignore"):
        ref, ref_grad = ref_loss_and_grad(x, target, 2.0, 0.25, weight, grad_output)
    np.testing.assert_allclose(loss[finite], ref[finite], **tolerance(dtype))
    np.testing.assert_allclose(grad[finite], ref_grad[finite], **tolerance(dtype))
    assert not loss[[9, 17, 18]].any() and not grad[[9, 17, 18]].any()
    assert np.isnan(loss[[1, 2, 4]]).all()
    assert loss[3] == (np.inf if classes > 1 else -np.nan) or classes == 1 and np.isnan(loss[3])


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_target_logit_of_minus_infinity_gives_an_infinite_loss_and_the_gradients_limit(dtype):
    """p = 0: the loss is -alpha * log(0) = inf, and the gradient's limit is
    finite (p log(p) / q -> 0): -alpha at the target, alpha * p_c at the
    others, where the textbook factor gives 0 * inf = NaN."""
    x = np.array([[-np.inf, 0.0, np.log(3.0)]], dtype)
    target = np.array([0])
    assert softmax_focal_loss_forward(x, target, 2.0, 0.25)[0] == np.inf
    grad = softmax_focal_loss_backward(x, target, np.ones(1, dtype), 2.0, 0.25)
    np.testing.assert_allclose(grad[0], [-0.25, 0.25 * 0.25, 0.25 * 0.75], rtol=1e-6)


@pytest.mark.parametrize("gamma", [0.0, 0.3, 1.0])
def test_a_certain_row_has_zero_loss_and_a_finite_gradient(gamma):
    # p = 1 exactly in float64: (1 - p)**(gamma - 1) alone would be inf
    x = np.array([[800.0, 0.0, 0.0]])
    grad = softmax_focal_loss_backward(x, np.array([0]), np.ones(1), gamma, 0.25)
    assert softmax_focal_loss_forward(x, np.array([0]), gamma, 0.25)[0] == 0
    assert np.isfinite(grad).all() and np.abs(grad).max() < 1e-300 + (gamma == 0) * 1e-6


def test_negative_targets_are_ignored_rows():
    x = np.random.default_rng(0).standard_normal((3, 4))
    target = np.array([2, -1, -100])
    assert (softmax_focal_loss_forward(x, target)[1:] == 0).all()
    grad = softmax_focal_loss_backward(x, target, np.ones(3))
    assert (grad[1:] == 0).all() and grad[0].any()


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_none_sum_and_mean(dtype):
    x, target, weight = random_case(np.random.default_rng(1), dtype)
    loss = softmax_focal_loss(x, target, 2.0, 0.25, weight, "none")
    assert loss.shape == (len(target),)
    np.testing.assert_allclose(softmax_focal_loss(x, target, 2.0, 0.25, weight, "sum"),
                               loss.sum(), rtol=1e-6)
    np.testing.assert_allclose(softmax_focal_loss(x, target, 2.0, 0.25, weight, "mean"),
                               loss.sum() / len(target), rtol=1e-6)
    assert math.isnan(softmax_focal_loss(np.zeros((0, 3)), np.zeros(0, np.int64)))


@pytest.mark.parametrize("backward", [False, True])
def test_a_target_beyond_the_classes_is_an_error_naming_the_row_and_nothing_is_written(backward):
    x = np.zeros((3, 4))
    target = np.array([0, 4, 2])
    if backward:
        out = np.full((3, 4), 7.0)
        with pytest.raises(ValueError, match=r"^softmax_focal_loss_backward_impl: target\[1\] = 4 "
                                             r"is not a class index in \[0, 4\)"):
            mmdispatch.softmax_focal_loss_backward_impl(x, target, None, np.ones(3), out, 2.0,
                                                        0.25)
    else:
        out = np.full(3, 7.0)
        with pytest.raises(ValueError, match=r"^softmax_focal_loss_forward_impl: target\[1\]"):
            mmdispatch.softmax_focal_loss_forward_impl(x, target, None, out, 2.0, 0.25)
    assert (out == 7).all()


@pytest.mark.parametrize("call, error, message", [
    (lambda: softmax_focal_loss(np.zeros((2, 3)), np.array([0, 1]), reduction="avg"), ValueError,
     "^softmax_focal_loss: reduction"),
    (lambda: softmax_focal_loss(np.zeros(3), np.array([0])), ValueError,
     r"^softmax_focal_loss_forward: input must be 2-D"),
    (lambda: softmax_focal_loss(np.zeros((2, 3)), np.array([0.0, 1.0])), TypeError,
     "^softmax_focal_loss_forward: target must have an integer dtype"),
    (lambda: softmax_focal_loss(np.zeros((2, 3)), np.array([0, 1]), math.nan), ValueError,
     "^softmax_focal_loss_forward_impl: gamma"),
    (lambda: softmax_focal_loss(np.zeros((2, 3)), np.array([0, 1]), weight=np.ones(2)),
     ValueError, r"^softmax_focal_loss_forward_impl: weight must have shape \(3,\)"),
    (lambda: softmax_focal_loss_backward(np.zeros((2, 3)), np.array([0, 1]), np.ones(3)),
     ValueError, r"^softmax_focal_loss_backward_impl: grad_output must have shape \(2,\)"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_float16_on_the_cpu_is_refused_naming_the_dtype():
    with pytest.raises(TypeError, match="^softmax_focal_loss_forward_impl: input .*float16"):
        softmax_focal_loss(np.zeros((2, 3), np.float16), np.array([0, 1]))


# --- the PyTorch layer --------------------------------------------------------------------

def test_mmcv_drop_in_and_module_take_mmcvs_arguments_with_autograd():
    torch = pytest.importorskip("torch")
    from mmdispatch.torch.mmcv import SoftmaxFocalLoss
    from mmdispatch.torch.mmcv import softmax_focal_loss as mmcv_softmax_focal_loss

    for x, target, mean, grad in MMCV_CASES:
        xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
        loss = mmcv_softmax_focal_loss(xt, torch.tensor(target), 2.0, 0.25, None, "mean")
        loss.backward()
        assert float(loss.detach()) == pytest.approx(mean, rel=1e-6)
        np.testing.assert_allclose(xt.grad.numpy(), grad, rtol=1e-5, atol=2e-8)
    xt = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    target = torch.tensor([0, 2, -1, 1])
    module = SoftmaxFocalLoss(2.0, 0.25, torch.rand(3, dtype=torch.float64), "sum")
    assert torch.autograd.gradcheck(lambda v: module(v, target), (xt,))
    assert "gamma=2.0" in repr(module)


# --- CUDA ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_matches_cpu(cupy, dtype):
    rng = np.random.default_rng(11)
    x, target, weight = random_case(rng, dtype, n=300, c=81)
    grad_output = rng.standard_normal(len(target)).astype(dtype)
    tol = dict(rtol=1e-5, atol=1e-6) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-14)
    for w in (None, weight):
        gpu_w = None if w is None else cupy.asarray(w)
        np.testing.assert_allclose(
            cupy.asnumpy(softmax_focal_loss_forward(cupy.asarray(x), cupy.asarray(target), 2.0,
                                                    0.25, gpu_w)),
            softmax_focal_loss_forward(x, target, 2.0, 0.25, w), **tol)
        np.testing.assert_allclose(
            cupy.asnumpy(softmax_focal_loss_backward(cupy.asarray(x), cupy.asarray(target),
                                                     cupy.asarray(grad_output), 2.0, 0.25,
                                                     gpu_w)),
            softmax_focal_loss_backward(x, target, grad_output, 2.0, 0.25, w), **tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_cuda_rows_of_any_width_match_the_cpu_with_the_same_bits_each_run(
        cuda_emulator, dtype):
    """The CUDA kernel gives a row 1 to 32 lanes of a warp (a power of 2,
    at most 4 elements each), its maximum and sums reduced over them: rows
    of 1 to 200 classes, with ties at the maximum, ignored rows, a row
    spanning more than the vector exp's range and rows of NaN or infinity,
    against the CPU kernel (NaN where it is NaN); two runs give the same
    bits. Run by the emulator."""
    from cuda_emu import DeviceView
    rng = np.random.default_rng(8)
    tol = dict(rtol=1e-5, atol=1e-7) if dtype == np.float32 else dict(rtol=1e-12, atol=1e-15)
    # 11 rows, and rows enough that every group of the emulator's small
    # grid takes several and some leave the loop before others of their warp
    for classes, rows in [(c, 11) for c in (1, 2, 3, 5, 8, 9, 33, 81, 200)] + [
            (c, 2 * 768 // w + 16 // w + 1) for c, w in ((5, 2), (9, 4), (33, 16), (81, 32))]:
        x = rng.standard_normal((rows, classes)) * 4
        x[1] = x[1].max()   # all tied
        x[2, :: 3] = 30.0   # ties, spread more than 80 below
        x[2, 1 :: 3] = -90.0
        x[3, -1] = np.nan
        x[4, 0] = np.inf
        x[5, :] = -np.inf
        x = x.astype(dtype)
        target = rng.integers(0, classes, rows)
        target[6] = -1
        weight = rng.random(classes).astype(dtype)
        grad_output = rng.standard_normal(rows).astype(dtype)
        loss = softmax_focal_loss_forward(x, target, 2.0, 0.25, weight)
        grad = softmax_focal_loss_backward(x, target, grad_output, 2.0, 0.25, weight)
        runs = []
        with cuda_emulator.active():
            for _ in range(2):
                out, grad_input = np.full_like(loss, 7.0), np.full_like(grad, 7.0)
                mmdispatch.softmax_focal_loss_forward_impl(
                    DeviceView(x), DeviceView(target), DeviceView(weight), DeviceView(out),
                    2.0, 0.25)
                mmdispatch.softmax_focal_loss_backward_impl(
                    DeviceView(x), DeviceView(target), DeviceView(weight),
                    DeviceView(grad_output), DeviceView(grad_input), 2.0, 0.25)
                cuda_emulator.synchronize()
                runs.append((out, grad_input))
        (out, grad_input), (again, grad_again) = runs
        assert out.tobytes() == again.tobytes() and grad_input.tobytes() == grad_again.tobytes()
        np.testing.assert_allclose(out, loss, **tol)
        np.testing.assert_allclose(grad_input, grad, **tol)
        assert out[6] == 0 and not grad_input[6].any()
        assert np.isnan(out[3:6]).all() and np.isnan(grad_input[3:6]).all()


def test_cuda_bad_target_raises_in_strict_mode_and_writes_nothing(cupy):
    out = cupy.full(3, 7.0)
    with mmdispatch.strict():
        with pytest.raises(ValueError, match=r"^softmax_focal_loss_forward_impl: target\[2\] = 9"):
            mmdispatch.softmax_focal_loss_forward_impl(cupy.zeros((3, 4)),
                                                       cupy.asarray(np.array([0, 1, 9])), None,
                                                       out, 2.0, 0.25)
    assert bool((out == 7).all())


def test_cuda_float16_and_bfloat16_compute_in_float32(torch_cuda):
    torch = torch_cuda
    x, target, _ = random_case(np.random.default_rng(13), np.float32)
    expected = softmax_focal_loss_forward(x, target)
    for dtype in (torch.float16, torch.bfloat16):
        got = softmax_focal_loss_forward(torch.from_numpy(x).cuda().to(dtype),
                                         torch.from_numpy(target).cuda())
        assert got.dtype == dtype
        np.testing.assert_allclose(got.float().cpu().numpy(), expected, rtol=3e-2, atol=3e-2)


# --- properties (tests/support/properties.py) ----------------------------------------------

def focal_loss_case(backward):
    @st.composite
    def case(draw, dtype):
        n, c = draw(st.integers(0, 4)), draw(st.integers(0, 4))
        x = draw(float_arrays((n, c), dtype, -8, 8, specials=False))
        target = np.array(draw(st.lists(st.integers(-2, c - 1), min_size=n, max_size=n)),
                          np.int64)
        weight = (draw(float_arrays((c,), dtype, 0, 3, specials=False))
                  if draw(st.booleans()) else None)
        gamma = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]))
        alpha = draw(st.sampled_from([0.25, 0.5, 1.0, 0.0, -0.5]))
        grad_output = draw(float_arrays((n,), dtype, -2, 2, specials=False))
        args = dict(input=guarded(x), target=guarded(target),
                    weight=None if weight is None else guarded(weight), gamma=gamma, alpha=alpha)
        if backward:
            args.update(grad_output=guarded(grad_output),
                        grad_input=guarded(sentinel((n, c), dtype)))
        else:
            args.update(output=guarded(sentinel((n,), dtype)))

        def check(a):
            loss, grad = ref_loss_and_grad(x, target, gamma, alpha, weight, grad_output)
            got = a["grad_input" if backward else "output"]
            rtol, atol = (1e-4, 1e-5) if dtype == np.float32 else (1e-9, 1e-12)
            np.testing.assert_allclose(np.asarray(got, np.float64), grad if backward else loss,
                                       rtol=rtol, atol=atol)
        return args, check
    return case


def user_case(draw, name, dtype, layout):
    backward = name == "softmax_focal_loss_backward"
    a, check = draw(focal_loss_case(backward)(dtype))
    inputs = dict(input=layout(a["input"]), target=layout(a["target"]),
                  weight=layout(a["weight"]))
    if backward:
        inputs["grad_output"] = layout(a["grad_output"])
    reduction = draw(st.sampled_from(["none", "sum", "mean"]))

    def run():
        if backward:
            return softmax_focal_loss_backward(inputs["input"], inputs["target"],
                                               inputs["grad_output"], a["gamma"], a["alpha"],
                                               inputs["weight"])
        if name == "softmax_focal_loss":
            return softmax_focal_loss(inputs["input"], inputs["target"], a["gamma"], a["alpha"],
                                      inputs["weight"], reduction)
        return softmax_focal_loss_forward(inputs["input"], inputs["target"], a["gamma"],
                                          a["alpha"], inputs["weight"])

    def verify(result):
        if name != "softmax_focal_loss" or reduction == "none":
            return check(dict(a, output=result, grad_input=result))
        loss, _ = ref_loss_and_grad(a["input"], a["target"], a["gamma"], a["alpha"], a["weight"])
        expected = loss.sum() if reduction == "sum" else (
            loss.sum() / len(loss) if len(loss) else math.nan)
        assert result.shape == () and result.dtype == dtype
        np.testing.assert_allclose(float(result), expected,
                                   rtol=1e-4 if dtype == np.float32 else 1e-9, atol=1e-5)
    return run, inputs, verify


def small_call():
    return [np.zeros((2, 3)), np.array([0, 2]), 2.0, 0.25, None]


def torch_forward_calls(torch, device):
    logits = torch.randn(4, 5, dtype=torch.float64, device=device, requires_grad=True)
    target = torch.tensor([0, 4, -1, 1], device=device)
    weight = torch.rand(5, dtype=torch.float64, device=device)
    return [(logits, target, None, 2.0, 0.25), (logits, target, weight, 1.5, 0.5)]


def torch_backward_calls(torch, device):
    return [(logits.detach(), target, weight, torch.randn(4, dtype=torch.float64, device=device),
             gamma, alpha)
            for logits, target, weight, gamma, alpha in torch_forward_calls(torch, device)]


class TestProperties(OpProperties):
    module = focal_module
    torch_calls = {"softmax_focal_loss_forward_impl": torch_forward_calls,
                   "softmax_focal_loss_backward_impl": torch_backward_calls}
    entry_cases = {"softmax_focal_loss_forward_impl": focal_loss_case(False),
                   "softmax_focal_loss_backward_impl": focal_loss_case(True)}
    fixed_axes = {
        "softmax_focal_loss_forward_impl": {"target": [0], "weight": [0], "output": [0]},
        "softmax_focal_loss_backward_impl": {"target": [0], "weight": [0], "grad_output": [0],
                                             "grad_input": [0, 1]},
    }
    bad_scalars = {"gamma": [math.nan, math.inf, -1.0], "alpha": [math.nan, math.inf, -math.inf]}
    user_cases = {name: user_case for name in focal_module.__all__}
    good_user_args = {"softmax_focal_loss": lambda: small_call() + ["mean"],
                      "softmax_focal_loss_forward": small_call,
                      "softmax_focal_loss_backward": lambda: small_call()[:2] + [np.ones(2)]
                      + small_call()[2:]}
    user_bad_values = {
        ("softmax_focal_loss", 1): [np.array([0.0, 1.0]), np.array([0, 3]), np.array([0, 1, 2]),
                                    [0, 1]],
        ("softmax_focal_loss", 2): [math.nan, -1.0, math.inf, "2", None],
        ("softmax_focal_loss", 3): [math.nan, math.inf, None],
        ("softmax_focal_loss", 4): [np.ones(2), np.ones((3, 1)), np.ones(3, np.int64), "w"],
        ("softmax_focal_loss", 5): ["avg", None, 1],
        ("softmax_focal_loss_forward", 1): [np.array([0, 1, 2])],
        ("softmax_focal_loss_backward", 2): [np.ones(3), np.ones((2, 1)), None],
    }

    def bad_scalar_values(self, name, dtype):
        values = super().bad_scalar_values(name, dtype)
        # gamma and alpha are converted to the input's dtype: beyond float32
        return values + [1e39] if values and dtype == np.float32 else values

    def bad_data(self, draw, op_name, args):
        assume(args["target"].size > 0)
        target = args["target"].copy()
        target[draw(st.integers(0, target.size - 1))] = draw(st.sampled_from(
            [args["input"].shape[1], args["input"].shape[1] + 1, 2 ** 62]))
        return dict(args, target=guarded(target)), f"data: target = {target}"
