"""sigmoid_focal_loss (MMCV semantics): published values, a slow
high-precision reference, extreme logits, finite differences, bad input,
device consistency and CPU/CUDA agreement."""
import importlib
import math
import re
from decimal import Decimal, localcontext, MAX_EMAX, MIN_EMIN

import numpy as np
import pytest

from hypothesis import assume, strategies as st

import mmdispatch
from mmdispatch.ops import (sigmoid_focal_loss, sigmoid_focal_loss_backward,
                            sigmoid_focal_loss_forward)
from properties import OpProperties, float_arrays, guarded, sentinel

focal_module = importlib.import_module("mmdispatch.ops.sigmoid_focal_loss")

DTYPES = [np.float32, np.float64]

# MMCV tests/test_ops/test_focal_loss.py, gamma 2, alpha 0.25, reduction "mean":
# (logits, targets, loss, d loss / d logits).
MMCV_CASES = [
    ([[1., 0], [0, 1.]], [0, 1], 0.13562961,
     [[-0.00657264, 0.11185755], [0.11185755, -0.00657264]]),
    ([[1., 0, -1.], [0, 1., 2.]], [2, 1], 1.10251057,
     [[0.28808805, 0.11185755, -0.09602935], [0.11185755, -0.00657264, 0.40376765]]),
    ([[1e-6, 2e-6, 3e-6], [4e-6, 5e-5, 6e-4], [7e-3, 8e-2, 9e-1]], [1, 2, 0], 0.42287254,
     [[0.07457182, -0.02485716, 0.07457201], [0.07457211, 0.07457669, -0.02483728],
      [-0.02462499, 0.08277918, 0.18050370]]),
]

# --- slow reference in 60-digit decimal arithmetic ---------------------------

PREC = 60


def _log1p(t):
    """log(1 + t) for a Decimal 0 <= t <= 1, to full relative precision even
    when 1 + t would round to 1 (series for small t)."""
    if t >= Decimal("1e-5"):
        return (1 + t).ln()
    return sum((-1) ** (k + 1) * t ** k / k for k in range(1, 15))


def _softplus(z):
    """log(1 + exp(z)) for a Decimal z, exact to ~PREC digits for any size."""
    return (z if z > 0 else Decimal(0)) + _log1p((-abs(z)).exp())


def _element_loss(x, positive, gamma, alpha):
    """The definition: p = sigmoid(x); positive: alpha (1 - p)^gamma (-log p),
    negative: (1 - alpha) p^gamma (-log(1 - p)); with 1 - p = sigmoid(-x),
    -log p = softplus(-x) and -log(1 - p) = softplus(x)."""
    p = 1 / (1 + (-x).exp())
    q = 1 / (1 + x.exp())
    if positive:
        return alpha * q ** gamma * _softplus(-x)
    return (1 - alpha) * p ** gamma * _softplus(x)


def ref_forward_backward(x, target, gamma, alpha, weight=None):
    """(loss, d sum(loss) / d x) as float64 arrays; the derivative is a central
    difference with step 1e-25 in 60-digit arithmetic (error ~1e-50)."""
    x = np.asarray(x)
    n, c = x.shape
    loss = np.zeros((n, c))
    grad = np.zeros((n, c))
    h = Decimal("1e-25")
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = PREC, MAX_EMAX, MIN_EMIN
        g, a = Decimal(float(gamma)), Decimal(float(alpha))
        for i in range(n):
            t = int(target[i])
            scale = Decimal(float(weight[t])) if weight is not None and t < c else Decimal(1)
            for j in range(c):
                v = Decimal(float(x[i, j]))
                loss[i, j] = float(scale * _element_loss(v, j == t, g, a))
                up = _element_loss(v + h, j == t, g, a)
                down = _element_loss(v - h, j == t, g, a)
                grad[i, j] = float(scale * (up - down) / (2 * h))
    return loss, grad


def tolerances(dtype):
    """(rtol, atol): atol covers float32 subnormals (and flush-to-zero)."""
    return (2e-6, 1e-37) if dtype == np.float32 else (1e-13, 1e-300)


def assert_close(got, expected, dtype, factor=1.0):
    rtol, atol = tolerances(dtype)
    np.testing.assert_allclose(np.asarray(got, dtype=np.float64), expected, rtol=rtol * factor,
                               atol=atol)


GAMMAS = [0.0, 0.5, 2.0, 1.0, 3.7]
ALPHAS = [0.25, 0.5, 1.0, 0.0, 0.9]


def random_case(seed, dtype):
    rng = np.random.default_rng(seed)
    n, c = int(rng.integers(1, 7)), int(rng.integers(1, 6))
    x = (rng.standard_normal((n, c)) * rng.choice([0.5, 3.0, 12.0])).astype(dtype)
    target = rng.integers(0, c + 1, n)          # c = background
    target[0] = c                                # always one background row
    gamma = GAMMAS[seed % len(GAMMAS)]
    alpha = ALPHAS[(seed // len(GAMMAS)) % len(ALPHAS)]
    weight = rng.uniform(0.1, 3.0, c).astype(dtype) if seed % 2 else None
    return rng, x, target, gamma, alpha, weight


# --- published values ---------------------------------------------------------

@pytest.mark.parametrize("case", range(len(MMCV_CASES)))
def test_matches_mmcv_published_values_in_float32(case):
    x, target, expected, expected_grad = MMCV_CASES[case]
    x, target = np.array(x, dtype=np.float32), np.array(target)
    loss = sigmoid_focal_loss(x, target, 2.0, 0.25, None, "mean")
    assert loss.shape == () and loss.dtype == np.float32
    np.testing.assert_allclose(float(loss), expected, rtol=1e-6)
    grad = sigmoid_focal_loss_backward(x, target, 2.0, 0.25) / x.shape[0]
    assert grad.dtype == np.float32
    np.testing.assert_allclose(grad, expected_grad, rtol=2e-6, atol=1e-8)


@pytest.mark.parametrize("dtype", DTYPES)
def test_reductions_none_sum_and_mean_are_consistent(dtype):
    x = np.array([[1, 0], [0, 1]], dtype=dtype)
    target = np.array([0, 1])
    none = sigmoid_focal_loss(x, target, reduction="none")
    total = sigmoid_focal_loss(x, target, reduction="sum")
    mean = sigmoid_focal_loss(x, target)            # "mean" by default
    assert none.shape == (2, 2) and none.dtype == dtype
    assert total.shape == () and total.dtype == dtype and mean.dtype == dtype
    np.testing.assert_array_equal(none, sigmoid_focal_loss_forward(x, target))
    np.testing.assert_allclose(float(mean), 0.13562961, rtol=1e-6)
    np.testing.assert_allclose(float(total), 2 * 0.13562961, rtol=1e-6)
    np.testing.assert_allclose(float(total), float(none.sum()), rtol=1e-6)
    # the same element appears on both rows: loss of x = 1 as the target, x = 0 not
    np.testing.assert_array_equal(none[0, 0], none[1, 1])
    np.testing.assert_array_equal(none[0, 1], none[1, 0])


def test_mean_divides_by_rows_not_by_elements(rng):
    x = rng.standard_normal((4, 7))
    target = np.array([0, 6, 7, 3])
    total = float(sigmoid_focal_loss(x, target, reduction="sum"))
    assert float(sigmoid_focal_loss(x, target, reduction="mean")) == pytest.approx(total / 4,
                                                                                  rel=1e-14)


def test_mean_of_an_empty_batch_is_nan_and_sum_is_zero():
    x, target = np.zeros((0, 3)), np.zeros(0, dtype=np.int64)
    assert np.isnan(sigmoid_focal_loss(x, target))
    assert float(sigmoid_focal_loss(x, target, reduction="sum")) == 0.0
    assert sigmoid_focal_loss(x, target, reduction="none").shape == (0, 3)


# --- against the slow reference -----------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(32))
def test_forward_and_backward_match_slow_reference(seed, dtype):
    _, x, target, gamma, alpha, weight = random_case(seed, dtype)
    expected, expected_grad = ref_forward_backward(x, target, gamma, alpha, weight)
    loss = sigmoid_focal_loss_forward(x, target, gamma, alpha, weight)
    grad = sigmoid_focal_loss_backward(x, target, gamma, alpha, weight)
    assert loss.dtype == dtype and grad.dtype == dtype and loss.shape == x.shape
    assert_close(loss, expected, dtype, factor=4)
    assert_close(grad, expected_grad, dtype, factor=4)
    for reduction, value in [("sum", expected.sum()), ("mean", expected.sum() / x.shape[0])]:
        reduced = sigmoid_focal_loss(x, target, gamma, alpha, weight, reduction)
        assert reduced.dtype == dtype
        np.testing.assert_allclose(float(reduced), value, rtol=tolerances(dtype)[0] * 20,
                                   atol=1e-30)


EXTREME = [0.0, 0.5, -0.5, 17.0, -17.0, 30.0, -30.0, 89.0, -89.0, 100.0, -100.0, 104.0, -104.0,
           710.0, -710.0, 746.0, -746.0, 1e4, -1e4]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [0.0, 0.5, 2.0])
@pytest.mark.parametrize("alpha", [0.25, 1.0])
def test_large_logits_stay_finite_and_exact(dtype, gamma, alpha):
    values = np.array(EXTREME, dtype=dtype)
    # every value both as the target column (0) and as a negative column (1)
    x = np.stack([values, values], axis=1)
    target = np.zeros(len(values), dtype=np.int64)
    expected, expected_grad = ref_forward_backward(x, target, gamma, alpha)
    loss = sigmoid_focal_loss_forward(x, target, gamma, alpha)
    grad = sigmoid_focal_loss_backward(x, target, gamma, alpha)
    assert np.isfinite(loss).all() and np.isfinite(grad).all()
    assert_close(loss, expected, dtype, factor=4)
    assert_close(grad, expected_grad, dtype, factor=4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_confident_predictions_have_tiny_or_linear_loss(dtype):
    x = np.array([[1e4, -1e4], [-1e4, 1e4]], dtype=dtype)
    loss = sigmoid_focal_loss_forward(x, np.array([0, 0]), 2.0, 0.25)
    # row 0 is right on both columns: loss 0; row 1 is confidently wrong on both:
    # -log(sigmoid(-1e4)) = 1e4, so 0.25 * 1e4 and 0.75 * 1e4
    np.testing.assert_array_equal(loss[0], [0, 0])
    np.testing.assert_allclose(loss[1], [2500.0, 7500.0], rtol=1e-7)


@pytest.mark.parametrize("dtype", DTYPES)
def test_infinite_logits_give_the_limits_of_loss_and_gradient(dtype):
    """On the wrong side of its target an infinite logit's loss is inf and
    its gradient the cross entropy's slope, -alpha (target column) or
    1 - alpha, where q^gamma * (q + gamma * p * softplus(-x)) is 0 * inf;
    on the right side both are 0."""
    x = np.array([[-np.inf, np.inf], [np.inf, -np.inf]], dtype)
    target = np.array([0, 0])
    for gamma in (0.0, 0.5, 2.0):
        np.testing.assert_array_equal(sigmoid_focal_loss_forward(x, target, gamma, 0.25),
                                      [[np.inf, np.inf], [0, 0]])
        np.testing.assert_array_equal(sigmoid_focal_loss_backward(x, target, gamma, 0.25),
                                      [[-0.25, 0.75], [0, 0]])


@pytest.mark.parametrize("param", ["gamma", "alpha"])
def test_float32_never_returns_nan_or_inf_for_a_gamma_or_alpha_that_passed_validation(param):
    """gamma / alpha = 1e39 are finite doubles (they pass the finiteness check)
    but overflow float32. The float32 kernels must then either reject them with
    a ValueError naming the parameter, or give the finite float64 answer
    (here every true value fits float32 comfortably)."""
    x = np.array([[2.0, -2.0, -4.0]])
    target = np.array([0])
    kwargs = {"gamma": 2.0, "alpha": 0.25, param: 1e39}
    expected = [fn(x, target, **kwargs) for fn in (sigmoid_focal_loss_forward,
                                                 sigmoid_focal_loss_backward)]
    assert all(np.isfinite(e).all() and np.abs(e).max() < 1e38 for e in expected)
    for fn, want in zip((sigmoid_focal_loss_forward, sigmoid_focal_loss_backward), expected):
        try:
            got = fn(x.astype(np.float32), target, **kwargs)
        except ValueError as error:
            assert param in str(error)
            continue
        assert np.isfinite(got).all(), f"{fn.__name__}({param}=1e39) gave {got}"
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-30)


# --- weight -------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_weight_scales_whole_rows_by_the_target_class_weight(dtype, rng):
    x = rng.standard_normal((5, 3)).astype(dtype)
    target = np.array([0, 2, 3, 1, 2])       # row 2 is background
    weight = np.array([2.0, 0.5, 3.0], dtype=dtype)
    plain = sigmoid_focal_loss_forward(x, target)
    weighted = sigmoid_focal_loss_forward(x, target, weight=weight)
    row_scale = np.array([2.0, 3.0, 1.0, 0.5, 3.0])[:, None]
    np.testing.assert_allclose(weighted, plain * row_scale, rtol=tolerances(dtype)[0])
    grad_plain = sigmoid_focal_loss_backward(x, target)
    grad = sigmoid_focal_loss_backward(x, target, weight=weight)
    np.testing.assert_allclose(grad, grad_plain * row_scale, rtol=tolerances(dtype)[0])


def test_background_rows_are_all_negatives():
    x = np.array([[0.3, -1.2, 2.0]])
    loss = sigmoid_focal_loss_forward(x, np.array([3]), 2.0, 0.25)
    p = 1 / (1 + np.exp(-x))
    np.testing.assert_allclose(loss, 0.75 * p ** 2 * -np.log1p(-p), rtol=1e-12)


# --- finite differences -------------------------------------------------------

@pytest.mark.parametrize("gamma, alpha", [(2.0, 0.25), (0.5, 0.75), (0.0, 1.0), (3.0, 0.4)])
@pytest.mark.parametrize("with_weight", [False, True])
def test_backward_matches_finite_differences(gamma, alpha, with_weight, rng, numeric_gradient):
    x = rng.standard_normal((6, 4)) * 3
    target = np.array([0, 4, 3, 1, 4, 2])   # rows 1 and 4 are background
    weight = rng.uniform(0.2, 2.0, 4) if with_weight else None

    def total(inp):
        return float(np.sum(sigmoid_focal_loss_forward(inp, target, gamma, alpha, weight)))

    analytic = sigmoid_focal_loss_backward(x, target, gamma, alpha, weight)
    numeric = numeric_gradient(total, x)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-6, atol=1e-8)
    eps = 1e-6  # shifting every logit at once: d mean / d shift = sum(grad) / N
    np.testing.assert_allclose(
        float(np.sum(analytic)) / 6,
        (float(sigmoid_focal_loss(x + eps, target, gamma, alpha, weight))
         - float(sigmoid_focal_loss(x - eps, target, gamma, alpha, weight))) / (2 * eps),
        rtol=1e-6)


# --- layouts ------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_strided_inputs_give_the_same_results_as_contiguous_ones(dtype, rng):
    x = rng.standard_normal((8, 10)).astype(dtype)[::2, ::2]
    target = rng.integers(0, 6, 8)[::2]
    weight = rng.uniform(0.5, 2, 10).astype(dtype)[::2]
    contiguous = [np.ascontiguousarray(a) for a in (x, target, weight)]
    for fn in (sigmoid_focal_loss_forward, sigmoid_focal_loss_backward):
        np.testing.assert_array_equal(fn(x, target, 2.0, 0.25, weight),
                                      fn(*contiguous[:2], 2.0, 0.25, contiguous[2]))
    np.testing.assert_array_equal(sigmoid_focal_loss(x.T.copy().T, target.astype(np.int32)),
                                  sigmoid_focal_loss(*contiguous[:2]))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("classes", [3, 8, 13, 80])
def test_an_elements_value_does_not_depend_on_its_column_or_the_rows_length(dtype, classes,
                                                                            rng):
    """The CPU kernel takes a row's columns 8 float32 or 4 float64 at a
    time (the last run padded), through its own exp and log1p inside
    |x| <= 80 or 700 and the C library's outside: each element of (N, C) has
    the bits it has alone, as the one column of an (N * C, 1) input whose
    target is 0 where its column was the target and background elsewhere."""
    rows = 12
    x = (rng.standard_normal((rows, classes)) * 30).astype(dtype)
    x.flat[::11] = np.nan
    x.flat[3::17] = 1e4 if dtype == np.float32 else 1e3
    target = np.arange(rows) % (classes + 1)   # every column, and background
    alone = (np.arange(classes)[None, :] != target[:, None]).astype(np.int64).ravel()
    for fn in (sigmoid_focal_loss_forward, sigmoid_focal_loss_backward):
        np.testing.assert_array_equal(fn(x, target, 1.5, 0.25).ravel(),
                                      fn(x.reshape(-1, 1), alone, 1.5, 0.25).ravel())


def test_dlpack_only_and_other_integer_targets_are_accepted(rng, dlpack_only):
    x = rng.standard_normal((4, 3))
    target = np.array([0, 3, 2, 1])
    expected = sigmoid_focal_loss_forward(x, target)
    got = sigmoid_focal_loss_forward(dlpack_only(x), dlpack_only(target))
    np.testing.assert_array_equal(np.asarray(got), expected)
    for dtype in (np.int8, np.uint8, np.int32, np.uint64):
        np.testing.assert_array_equal(sigmoid_focal_loss_forward(x, target.astype(dtype)),
                                      expected)


# --- bad targets: errors before anything is written ---------------------------

@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("bad, row", [(-1, 2), (6, 0), (7, 3), (-(2**63), 1), (2**40, 3)])
def test_targets_out_of_range_raise_and_write_nothing(backward, bad, row):
    x = np.zeros((4, 5))
    target = np.array([0, 5, 4, 1])
    target[row] = bad
    out = np.full((4, 5), 7.0)
    op = "sigmoid_focal_loss_backward_impl" if backward else "sigmoid_focal_loss_forward_impl"
    message = f"{op}: target[{row}] = {bad} is not a class index in [0, 5] (5 = background)"
    with pytest.raises(ValueError, match=re.escape(message)):
        getattr(mmdispatch, op)(x, target, np.ones(5), out, 2.0, 0.25)
    assert np.all(out == 7.0)
    with pytest.raises(ValueError, match=re.escape(f"target[{row}] = {bad}")):
        sigmoid_focal_loss(x, target)


# --- bad arguments ------------------------------------------------------------

X = np.zeros((3, 4))
T = np.array([0, 4, 2])


@pytest.mark.parametrize("call, error, message", [
    (lambda: sigmoid_focal_loss(X[0], T), ValueError,
     "sigmoid_focal_loss: input must be 2-D (N, C), got shape (4,)"),
    (lambda: sigmoid_focal_loss(X[None], T), ValueError,
     "sigmoid_focal_loss: input must be 2-D (N, C), got shape (1, 3, 4)"),
    (lambda: sigmoid_focal_loss(X, T[:, None]), ValueError,
     "sigmoid_focal_loss: target must be 1-D (N,), got shape (3, 1)"),
    (lambda: sigmoid_focal_loss(X, T[:2]), ValueError,
     "sigmoid_focal_loss_forward_impl: target must have shape"),
    (lambda: sigmoid_focal_loss(X.astype(np.float16), T), TypeError,
     "sigmoid_focal_loss_forward_impl: input has dtype float16 on this device; supported: "
     "float32, float64"),
    (lambda: sigmoid_focal_loss(X.astype(np.int64), T), TypeError,
     "sigmoid_focal_loss_forward_impl: input has dtype int64 on this device; supported: "
     "float32, float64"),
    (lambda: sigmoid_focal_loss(X, T.astype(np.float64)), TypeError,
     "sigmoid_focal_loss: target must have an integer dtype, got float64"),
    (lambda: sigmoid_focal_loss(X, T > 0), TypeError,
     "sigmoid_focal_loss: target must have an integer dtype, got bool"),
    (lambda: sigmoid_focal_loss_forward(X, T.astype(np.float32)), TypeError,
     "sigmoid_focal_loss_forward: target must have an integer dtype, got float32"),
    (lambda: sigmoid_focal_loss_backward(X, T.astype(np.float32)), TypeError,
     "sigmoid_focal_loss_backward: target must have an integer dtype, got float32"),
    (lambda: sigmoid_focal_loss(X.tolist(), T), TypeError,
     "sigmoid_focal_loss: input must be an array"),
    (lambda: sigmoid_focal_loss(X, T.tolist()), TypeError,
     "sigmoid_focal_loss: target must be an array"),
    (lambda: sigmoid_focal_loss(X, T, weight=[1.0] * 4), TypeError,
     "sigmoid_focal_loss: weight must be an array"),
    (lambda: sigmoid_focal_loss(X, T, weight=np.ones(3)), ValueError,
     "sigmoid_focal_loss_forward_impl: weight must have shape"),
    (lambda: sigmoid_focal_loss(X, T, weight=np.ones((4, 1))), ValueError,
     "sigmoid_focal_loss_forward_impl: weight must have shape"),
    (lambda: sigmoid_focal_loss(X, T, weight=np.ones(4, dtype=np.float32)), TypeError,
     "sigmoid_focal_loss_forward_impl: weight has dtype float32 but input has dtype float64"),
    (lambda: sigmoid_focal_loss(X, T, weight=np.ones(4, dtype=np.int64)), TypeError,
     "sigmoid_focal_loss_forward_impl: weight has dtype int64 but input has dtype float64"),
    (lambda: sigmoid_focal_loss(X, T, gamma=float("nan")), ValueError,
     "sigmoid_focal_loss_forward_impl: gamma must be finite and >= 0, got nan"),
    (lambda: sigmoid_focal_loss(X, T, gamma=-0.5), ValueError,
     "sigmoid_focal_loss_forward_impl: gamma must be finite and >= 0, got -0.5"),
    (lambda: sigmoid_focal_loss(X, T, gamma=float("inf")), ValueError,
     "sigmoid_focal_loss_forward_impl: gamma must be finite and >= 0, got inf"),
    (lambda: sigmoid_focal_loss(X, T, alpha=float("inf")), ValueError,
     "sigmoid_focal_loss_forward_impl: alpha must be finite, got inf"),
    (lambda: sigmoid_focal_loss(X, T, alpha=float("nan")), ValueError,
     "sigmoid_focal_loss_forward_impl: alpha must be finite, got nan"),
    (lambda: sigmoid_focal_loss_backward(X, T, alpha=float("-inf")), ValueError,
     "sigmoid_focal_loss_backward_impl: alpha must be finite, got -inf"),
    (lambda: sigmoid_focal_loss(X, T, gamma="2"), TypeError,
     "sigmoid_focal_loss_forward_impl: at param 4 (gamma), expected a real number, got str"),
    (lambda: sigmoid_focal_loss(X, T, reduction="avg"), ValueError,
     "sigmoid_focal_loss: reduction must be one of 'none', 'mean', 'sum', got 'avg'"),
    (lambda: sigmoid_focal_loss(X, T, reduction=None), ValueError,
     "sigmoid_focal_loss: reduction must be one of 'none', 'mean', 'sum', got None"),
    (lambda: sigmoid_focal_loss(X, T, reduction="MEAN"), ValueError,
     "sigmoid_focal_loss: reduction must be one of 'none', 'mean', 'sum', got 'MEAN'"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def test_bad_target_and_weight_shapes_report_what_they_got():
    with pytest.raises(ValueError, match=re.escape("target must have shape")) as info:
        sigmoid_focal_loss(X, T[:2])
    assert "got (2,)" in str(info.value)
    with pytest.raises(ValueError, match=re.escape("weight must have shape")) as info:
        sigmoid_focal_loss(X, T, weight=np.ones(3))
    assert "got (3,)" in str(info.value)


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


@pytest.mark.parametrize("op, out_name", [("sigmoid_focal_loss_forward_impl", "output"),
                                          ("sigmoid_focal_loss_backward_impl", "grad_input")])
def test_impl_rejects_bad_outputs_and_writes_nothing(op, out_name):
    impl = getattr(mmdispatch, op)
    x, weight = np.zeros((3, 4)), np.ones(4)
    out = np.full((3, 4), 7.0)
    cases = [
        (lambda: impl(x, T, weight, readonly(out), 2.0, 0.25), ValueError,
         f"{op}: at param 3 ({out_name}), output array is read-only"),
        (lambda: impl(x, T, weight, x, 2.0, 0.25), ValueError,
         f"{op}: at param 3 ({out_name}), output memory overlaps param 0 (input); outputs must "
         "not share memory with other arguments"),
        (lambda: impl(x, T, out[0], out, 2.0, 0.25), ValueError,
         f"{op}: at param 3 ({out_name}), output memory overlaps param 2 (weight)"),
        (lambda: impl(x, T, weight, np.full((3, 5), 7.0), 2.0, 0.25), ValueError,
         f"{op}: {out_name} must have shape (3, 4), got (3, 5)"),
        (lambda: impl(x, T, weight, out.astype(np.float32), 2.0, 0.25), TypeError,
         f"{op}: {out_name} has dtype float32 but input has dtype float64"),
        (lambda: impl(x, T, weight, np.full((3, 8), 7.0)[:, ::2], 2.0, 0.25), ValueError,
         f"{op}: {out_name} must be C-contiguous"),
        (lambda: impl(x, T.astype(np.int32), weight, out, 2.0, 0.25), TypeError,
         f"{op}: target has dtype int32 on this device; supported: int64"),
        (lambda: impl(x, T.astype(np.float64), weight, out, 2.0, 0.25), TypeError,
         f"{op}: target has dtype float64 on this device; supported: int64"),
        (lambda: impl(x[0], T, None, out, 2.0, 0.25), ValueError,
         f"{op}: input must have shape (*, *), got (4,)"),
        # the output left to the entry point to allocate: the inputs are still checked
        (lambda: impl(x, T.astype(np.int32), weight, None, 2.0, 0.25), TypeError,
         f"{op}: target has dtype int32 on this device; supported: int64"),
        (lambda: impl(x.tolist(), T, weight, out, 2.0, 0.25), TypeError,
         f"{op}: at param 0 (input), expected an array"),
        (lambda: impl(x, T, weight, out, -1.0, 0.25), ValueError,
         f"{op}: gamma must be finite and >= 0, got -1"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()
    assert np.all(out == 7.0)


def test_impl_accepts_none_weight_and_fills_the_output():
    x = np.array([[1.0, 0.0], [0.0, 1.0]])
    out = np.full((2, 2), 7.0)
    mmdispatch.sigmoid_focal_loss_forward_impl(x, np.array([0, 1]), None, out, 2.0, 0.25)
    np.testing.assert_allclose(out.sum() / 2, 0.13562961, rtol=1e-7)


# --- device consistency -------------------------------------------------------

NAMES = {"sigmoid_focal_loss_forward_impl": ["input", "target", "weight", "output"],
         "sigmoid_focal_loss_backward_impl": ["input", "target", "weight", "grad_input"]}


@pytest.mark.parametrize("op", sorted(NAMES))
@pytest.mark.parametrize("position", range(4))
@pytest.mark.parametrize("with_weight", [True, False])
def test_impl_rejects_an_array_on_another_device(op, position, with_weight, fake_array):
    names = NAMES[op]
    args = [np.zeros((3, 4)), T.copy(), np.ones(4) if with_weight else None, np.full((3, 4), 7.0)]
    fake = fake_array(2, 0)
    args[position] = fake
    if position == 0:
        message = f"{op}: at param 1 (target), inconsistent device: cpu vs cuda:0"
    else:
        message = f"{op}: at param {position} ({names[position]}), inconsistent device: " \
                  "cuda:0 vs cpu"
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(message)):
        getattr(mmdispatch, op)(*args, 2.0, 0.25)
    assert not fake.exported
    assert position == 3 or np.all(args[3] == 7.0)


@pytest.mark.parametrize("op", sorted(NAMES))
def test_impl_with_all_arrays_on_a_device_without_kernels_raises_kernel_not_found(op,
                                                                                  fake_array):
    fakes = [fake_array(12, 0) for _ in range(3)]
    with pytest.raises(mmdispatch.KernelNotFoundError, match=re.escape(
            f"{op}: implementation for device ext_dev:0 not found.")):
        getattr(mmdispatch, op)(fakes[0], fakes[1], None, fakes[2], 2.0, 0.25)
    assert not any(f.exported for f in fakes)


# --- CUDA (runs only where a GPU, CuPy and the CUDA kernels are present) ------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_weight", [False, True])
@pytest.mark.parametrize("gamma, alpha", [(2.0, 0.25), (0.5, 0.5), (0.0, 1.0)])
def test_cuda_matches_cpu(cupy, dtype, with_weight, gamma, alpha, rng):
    x = (rng.standard_normal((64, 9)) * 4).astype(dtype)
    x[0, :6] = [100, -100, 1e4, -1e4, 30, -30]
    target = rng.integers(0, 10, 64)
    target[:3] = [0, 9, 3]
    weight = rng.uniform(0.1, 3, 9).astype(dtype) if with_weight else None
    gpu = [cupy.asarray(x), cupy.asarray(target), None if weight is None else cupy.asarray(weight)]
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    for fn in (sigmoid_focal_loss_forward, sigmoid_focal_loss_backward):
        expected = fn(x, target, gamma, alpha, weight)
        got = fn(*gpu[:2], gamma, alpha, gpu[2])
        assert isinstance(got, cupy.ndarray) and got.dtype == dtype
        assert bool(cupy.isfinite(got).all())
        np.testing.assert_allclose(cupy.asnumpy(got), expected, rtol=rtol, atol=1e-30)
    for reduction in ("none", "sum", "mean"):
        got = sigmoid_focal_loss(*gpu[:2], gamma, alpha, gpu[2], reduction)
        assert isinstance(got, cupy.ndarray) and got.dtype == dtype
        np.testing.assert_allclose(cupy.asnumpy(got),
                                   sigmoid_focal_loss(x, target, gamma, alpha, weight, reduction),
                                   rtol=rtol * 10, atol=1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_large_logits_match_the_slow_reference(cupy, dtype):
    values = np.array(EXTREME, dtype=dtype)
    x = np.stack([values, values], axis=1)
    target = np.zeros(len(values), dtype=np.int64)
    expected, expected_grad = ref_forward_backward(x, target, 2.0, 0.25)
    loss = sigmoid_focal_loss_forward(cupy.asarray(x), cupy.asarray(target))
    grad = sigmoid_focal_loss_backward(cupy.asarray(x), cupy.asarray(target))
    assert_close(cupy.asnumpy(loss), expected, dtype, factor=4)
    assert_close(cupy.asnumpy(grad), expected_grad, dtype, factor=4)


def test_cuda_matches_mmcv_published_value(cupy):
    x = cupy.asarray(np.array([[1, 0], [0, 1]], dtype=np.float32))
    target = cupy.asarray(np.array([0, 1]))
    loss = sigmoid_focal_loss(x, target, 2.0, 0.25, None, "mean")
    assert isinstance(loss, cupy.ndarray) and loss.dtype == np.float32
    np.testing.assert_allclose(float(loss), 0.13562961, rtol=1e-6)
    np.testing.assert_allclose(float(sigmoid_focal_loss(x, target, reduction="sum")),
                               2 * 0.13562961, rtol=1e-6)
    grad = sigmoid_focal_loss_backward(x, target) / 2
    np.testing.assert_allclose(cupy.asnumpy(grad), MMCV_CASES[0][3], rtol=2e-6, atol=1e-8)


@pytest.mark.parametrize("op", sorted(NAMES))
@pytest.mark.parametrize("bad", [-1, 6])
def test_cuda_bad_target_raises_and_writes_nothing_in_strict_mode(cupy, op, bad):
    target = np.array([0, 5, 4, 1])
    target[2] = bad
    out = cupy.full((4, 5), 7.0)
    with mmdispatch.strict():
        with pytest.raises(ValueError, match=re.escape(
                f"{op}: target[2] = {bad} is not a class index in [0, 5] (5 = background)")):
            getattr(mmdispatch, op)(cupy.zeros((4, 5)), cupy.asarray(target), cupy.ones(5), out,
                                    2.0, 0.25)
    assert bool((out == 7.0).all())
    # by default the row is NaN, the others computed, and the error deferred
    getattr(mmdispatch, op)(cupy.zeros((4, 5)), cupy.asarray(target), cupy.ones(5), out, 2.0,
                            0.25)
    with pytest.raises(mmdispatch.DeferredKernelError, match=re.escape(
            f"{op}: target[2] is not a class index in [0, 5] (5 = background)")):
        mmdispatch.synchronize()
    assert bool(cupy.isnan(out[2]).all()) and bool(cupy.isfinite(out[[0, 1, 3]]).all())


def test_cuda_and_cpu_arrays_cannot_be_mixed(cupy):
    x = cupy.zeros((3, 4))
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "sigmoid_focal_loss_forward_impl: at param 1 (target), inconsistent device: cpu vs "
            "cuda:0")):
        sigmoid_focal_loss(x, T)
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            "sigmoid_focal_loss_backward_impl: at param 2 (weight), inconsistent device: cpu vs "
            "cuda:0")):
        sigmoid_focal_loss_backward(x, cupy.asarray(T), weight=np.ones(4))


def test_cuda_float16_and_bfloat16_compute_in_float32(torch_cuda, rng):
    """float16 (CuPy-free: torch tensors) and bfloat16 logits and weights:
    float32 math on the 16-bit values, one rounding at the end."""
    torch = torch_cuda
    x32 = (rng.standard_normal((32, 7)) * 4).astype(np.float32)
    target = rng.integers(0, 8, 32)
    weight32 = rng.uniform(0.1, 3, 7).astype(np.float32)
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        x = torch.from_numpy(x32).to(dtype)
        weight = torch.from_numpy(weight32).to(dtype)
        for fn in (sigmoid_focal_loss_forward, sigmoid_focal_loss_backward):
            expected = fn(x.float().numpy(), target, 2.0, 0.25, weight.float().numpy())
            got = fn(x.cuda(), torch.from_numpy(target).cuda(), 2.0, 0.25, weight.cuda())
            assert isinstance(got, torch.Tensor) and got.dtype == dtype
            np.testing.assert_allclose(got.float().cpu().numpy(), expected, rtol=tol, atol=1e-6)


# --- properties (tests/support/properties.py) ----------------------------------------------

def focal_loss_case(backward):
    @st.composite
    def case(draw, dtype):
        n, c = draw(st.integers(0, 4)), draw(st.integers(0, 4))
        x = draw(float_arrays((n, c), dtype, -40, 40, specials=False))
        if n * c and draw(st.booleans()):
            x.reshape(-1)[draw(st.integers(0, n * c - 1))] = draw(
                st.sampled_from([1e4, -1e4, 88.5, -88.5, 0.0]))
        target = np.array(draw(st.lists(st.integers(0, c), min_size=n, max_size=n)), np.int64)
        weight = (draw(float_arrays((c,), dtype, 0, 3, specials=False))
                  if draw(st.booleans()) else None)
        gamma = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]))
        alpha = draw(st.sampled_from([0.25, 0.5, 1.0, 0.0, -0.5, 1.5]))
        name = "grad_input" if backward else "output"
        args = dict(input=guarded(x), target=guarded(target),
                    weight=None if weight is None else guarded(weight),
                    **{name: guarded(sentinel((n, c), dtype))}, gamma=gamma, alpha=alpha)

        def check(a):
            loss, grad = ref_forward_backward(x, target, gamma, alpha, weight)
            rtol, atol = tolerances(dtype)
            np.testing.assert_allclose(np.asarray(a[name], np.float64), grad if backward else loss,
                                       rtol=rtol * 8, atol=atol)
        return args, check
    return case


def user_case(draw, name, dtype, layout):
    a, check = draw(focal_loss_case(name == "sigmoid_focal_loss_backward")(dtype))
    target = a["target"].astype(draw(st.sampled_from([np.int64, np.int32, np.uint8])))
    inputs = dict(input=layout(a["input"]), target=layout(target), weight=layout(a["weight"]))
    reduction = draw(st.sampled_from(["none", "sum", "mean"]))

    def run():
        function = getattr(focal_module, name)
        if name == "sigmoid_focal_loss":
            return function(inputs["input"], inputs["target"], a["gamma"], a["alpha"],
                            inputs["weight"], reduction)
        return function(inputs["input"], inputs["target"], a["gamma"], a["alpha"],
                        inputs["weight"])

    def verify(result):
        if name != "sigmoid_focal_loss" or reduction == "none":
            return check(dict(a, output=result, grad_input=result))
        loss, _ = ref_forward_backward(a["input"], a["target"], a["gamma"], a["alpha"],
                                       a["weight"])
        if reduction == "sum":
            expected = loss.sum()
        else:
            expected = loss.sum() / loss.shape[0] if loss.shape[0] else math.nan
        assert result.shape == () and result.dtype == dtype
        # numpy sums the loss in its dtype
        slack = (1e-6 if dtype == np.float32 else 1e-13) * float(np.abs(loss).sum())
        np.testing.assert_allclose(float(result), expected, rtol=1e-12, atol=slack)
    return run, inputs, verify


def small_call():
    return [np.zeros((2, 3)), np.array([0, 3]), 2.0, 0.25, None]


def torch_forward_calls(torch, device):
    logits = torch.randn(4, 5, dtype=torch.float64, device=device, requires_grad=True)
    target = torch.tensor([0, 5, 2, 1], device=device)
    weight = torch.rand(5, dtype=torch.float64, device=device)
    return [(logits, target, None, 2.0, 0.25), (logits, target, weight, 1.5, 0.5)]


def torch_backward_calls(torch, device):
    return [(logits.detach(), target, weight, gamma, alpha)
            for logits, target, weight, gamma, alpha in torch_forward_calls(torch, device)]


class TestProperties(OpProperties):
    module = focal_module
    torch_calls = {"sigmoid_focal_loss_forward_impl": torch_forward_calls,
                   "sigmoid_focal_loss_backward_impl": torch_backward_calls}
    entry_cases = {"sigmoid_focal_loss_forward_impl": focal_loss_case(False),
                   "sigmoid_focal_loss_backward_impl": focal_loss_case(True)}
    fixed_axes = {
        "sigmoid_focal_loss_forward_impl": {"target": [0], "weight": [0], "output": [0, 1]},
        "sigmoid_focal_loss_backward_impl": {"target": [0], "weight": [0],
                                             "grad_input": [0, 1]},
    }
    bad_scalars = {"gamma": [math.nan, math.inf, -1.0], "alpha": [math.nan, math.inf, -math.inf]}
    user_cases = {name: user_case for name in ("sigmoid_focal_loss", "sigmoid_focal_loss_forward",
                                               "sigmoid_focal_loss_backward")}
    good_user_args = {"sigmoid_focal_loss": lambda: small_call() + ["mean"],
                      "sigmoid_focal_loss_forward": small_call,
                      "sigmoid_focal_loss_backward": small_call}
    user_bad_values = {
        ("sigmoid_focal_loss", 1): [np.array([0.0, 1.0]), np.array([0, 4]), np.array([-1, 0]),
                                    np.array([0, 1, 2]), [0, 1]],
        ("sigmoid_focal_loss", 2): [math.nan, -1.0, math.inf, "2", None],
        ("sigmoid_focal_loss", 3): [math.nan, math.inf, None],
        ("sigmoid_focal_loss", 4): [np.ones(2), np.ones((3, 1)), np.ones(3, np.int64), "w"],
        ("sigmoid_focal_loss", 5): ["avg", None, 1],
        ("sigmoid_focal_loss_forward", 1): [np.array([0, 1, 2])],
        ("sigmoid_focal_loss_backward", 2): [-0.5, math.nan],
    }

    def bad_scalar_values(self, name, dtype):
        values = super().bad_scalar_values(name, dtype)
        # gamma and alpha are converted to the input's dtype: beyond float32
        return values + [1e39] if values and dtype == np.float32 else values

    def bad_data(self, draw, op_name, args):
        assume(args["target"].size > 0)
        target = args["target"].copy()
        target[draw(st.integers(0, target.size - 1))] = draw(st.sampled_from(
            [-1, args["input"].shape[1] + 1, 2 ** 62, -2 ** 63]))
        return dict(args, target=guarded(target)), f"data: target = {target}"
