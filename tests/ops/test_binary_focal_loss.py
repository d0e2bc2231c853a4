"""binary_focal_loss (torchvision's sigmoid_focal_loss, soft targets): a slow
high-precision reference from the definition, hand-derived values,
saturated logits, finite differences of both gradients, bad input, device
consistency and CPU/CUDA agreement."""
import importlib
import math
import re
from decimal import Decimal, localcontext, MAX_EMAX, MIN_EMIN

import numpy as np
import pytest

from hypothesis import strategies as st

import mmdispatch
from mmdispatch.ops import binary_focal_loss, binary_focal_loss_backward
from properties import OpProperties, float_arrays, guarded, sentinel

focal_module = importlib.import_module("mmdispatch.ops.binary_focal_loss")

DTYPES = [np.float32, np.float64]
FORWARD, BACKWARD = "binary_focal_loss_forward_impl", "binary_focal_loss_backward_impl"

# --- slow reference in 450-digit decimal arithmetic ----------------------------

# digits enough for the change a step of 1e-100 makes in a loss of 1e-218
# (logits of +-500) beside terms of size 1
PREC = 450


def _element_loss(x, t, gamma, alpha):
    """The definition (Lin et al.; torchvision's sigmoid_focal_loss):
    p = sigmoid(x), cross entropy -t log p - (1 - t) log(1 - p),
    p_t = p t + (1 - p)(1 - t), loss = a_t (1 - p_t)^gamma * cross entropy,
    a_t = alpha t + (1 - alpha)(1 - t) (1 for alpha = -1)."""
    p = 1 / (1 + (-x).exp())
    one_minus_p = 1 / (1 + x.exp())
    cross_entropy = -t * p.ln() - (1 - t) * one_minus_p.ln()
    remaining = 1 - (p * t + one_minus_p * (1 - t))
    modulating = Decimal(1) if gamma == 0 else remaining ** gamma
    weight = Decimal(1) if alpha < 0 else alpha * t + (1 - alpha) * (1 - t)
    return weight * modulating * cross_entropy


def _derivative(f, v, low=None, high=None):
    """f'(v) by a central difference with step 1e-100 (error ~1e-200
    relative), one-sided at an end of [low, high] (targets at 0 or 1, where
    1 - p_t would turn negative)."""
    h = Decimal("1e-100")
    if low is not None and v - h < low:
        return (f(v + h) - f(v)) / h
    if high is not None and v + h > high:
        return (f(v) - f(v - h)) / h
    return (f(v + h) - f(v - h)) / (2 * h)


def ref_forward_backward(x, t, gamma, alpha):
    """(loss, d loss / d x, d loss / d t) as float64 arrays of x's shape,
    for targets in [0, 1]."""
    x, t = np.asarray(x, np.float64), np.asarray(t, np.float64)
    loss, d_x, d_t = (np.zeros(x.shape) for _ in range(3))
    with localcontext() as ctx:
        ctx.prec, ctx.Emax, ctx.Emin = PREC, MAX_EMAX, MIN_EMIN
        g, a = Decimal(float(gamma)), Decimal(float(alpha))
        for index in np.ndindex(x.shape):
            v, w = Decimal(float(x[index])), Decimal(float(t[index]))
            loss[index] = float(_element_loss(v, w, g, a))
            d_x[index] = float(_derivative(lambda u: _element_loss(u, w, g, a), v))
            d_t[index] = float(_derivative(lambda u: _element_loss(v, u, g, a), w, 0, 1))
    return loss, d_x, d_t


def tolerances(dtype):
    """(rtol, atol): atol covers float32 subnormals (and flush-to-zero)."""
    return (4e-6, 1e-37) if dtype == np.float32 else (1e-13, 1e-300)


def assert_close(got, expected, dtype, factor=1.0, scale=None):
    """got within rtol of expected, or within rtol of `scale` (the size of
    the terms a gradient sums, where they cancel)."""
    rtol, atol = tolerances(dtype)
    got = np.asarray(got, dtype=np.float64)
    if scale is None:
        return np.testing.assert_allclose(got, expected, rtol=rtol * factor, atol=atol)
    bound = np.maximum(atol, rtol * factor * np.asarray(scale, np.float64)) + \
        rtol * factor * np.abs(expected)
    bad = ~(np.abs(got - expected) <= bound)
    assert not bad.any(), f"got {got[bad]}, expected {np.asarray(expected)[bad]}"


GAMMAS = [0.0, 0.5, 1.0, 2.0, 3.7]
ALPHAS = [0.25, -1.0, 0.0, 1.0, 0.5]


def random_case(seed, dtype, shape=None):
    rng = np.random.default_rng(seed)
    shape = shape or tuple(int(s) for s in rng.integers(1, 6, int(rng.integers(1, 4))))
    x = (rng.standard_normal(shape) * rng.choice([0.5, 3.0, 12.0])).astype(dtype)
    soft = rng.uniform(0, 1, shape)
    t = np.where(rng.uniform(size=shape) < 0.5, np.round(soft), soft).astype(dtype)
    gamma = GAMMAS[seed % len(GAMMAS)]
    alpha = ALPHAS[(seed // len(GAMMAS)) % len(ALPHAS)]
    return rng, x, t, gamma, alpha


# --- values --------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_hand_derived_values(dtype):
    """x = 0: p = 1/2, cross entropy log 2, 1 - p_t = 1/2 for any target, so
    the loss is a_t (1/2)^gamma log 2; the x gradient at t = 1 is
    a_t ((1/2 - 1)(1/2)^2 + log 2 * 2 (1/2) (1/4)(-1)) for gamma 2."""
    x = np.zeros(3, dtype)
    t = np.array([1.0, 0.0, 0.5], dtype)
    loss = binary_focal_loss(x, t, 2.0, 0.25)
    log2 = math.log(2)
    expected = [0.25 * 0.25 * log2, 0.75 * 0.25 * log2, 0.5 * 0.25 * log2]
    assert_close(loss, expected, dtype)
    grad_x, _ = binary_focal_loss_backward(x[:1], t[:1], np.ones(1, dtype))
    assert_close(grad_x, [0.25 * (-0.5 * 0.25 - log2 * 0.25)], dtype)
    # alpha -1: no weighting
    assert_close(binary_focal_loss(x, t, 0.0, -1), [log2] * 3, dtype)


@pytest.mark.parametrize("seed", range(25))
@pytest.mark.parametrize("dtype", DTYPES)
def test_forward_and_both_gradients_match_slow_reference(seed, dtype):
    rng, x, t, gamma, alpha = random_case(seed, dtype)
    g = rng.uniform(-2, 2, x.shape).astype(dtype)
    loss, d_x, d_t = ref_forward_backward(x, t, gamma, alpha)
    assert_close(binary_focal_loss(x, t, gamma, alpha), loss, dtype, factor=4)
    grad_x, grad_t = binary_focal_loss_backward(x, t, g, gamma, alpha)
    assert grad_x.dtype == grad_t.dtype == dtype and grad_x.shape == grad_t.shape == x.shape
    # d_t sums terms of size |x| r^gamma and cross entropy, which cancel
    scale_t = np.abs(g) * (np.abs(x.astype(np.float64)) + 1) * 4
    assert_close(grad_x, g * d_x, dtype, factor=16, scale=np.abs(g) * 2)
    assert_close(grad_t, g * d_t, dtype, factor=16, scale=scale_t)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", GAMMAS)
@pytest.mark.parametrize("alpha", [0.25, -1.0])
def test_large_logits_stay_finite_and_match_the_reference(dtype, gamma, alpha):
    """Hard and soft targets at logits where exp overflows float32 or the
    textbook 1 - p_t rounds to 0: finite, and the reference's values."""
    values = [88.5, -88.5, 100.0, -100.0, 500.0, -500.0, 30.0, -30.0, 17.0, -17.0]
    x = np.repeat(np.array(values, dtype), 3)
    t = np.tile(np.array([0.0, 1.0, 0.25], dtype), len(values))
    loss, d_x, _ = ref_forward_backward(x, t, gamma, alpha)
    got = binary_focal_loss(x, t, gamma, alpha)
    grad_x, grad_t = binary_focal_loss_backward(x, t, np.ones_like(x), gamma, alpha)
    assert np.isfinite(got).all() and np.isfinite(grad_x).all() and np.isfinite(grad_t).all()
    assert_close(got, loss, dtype, factor=4)
    assert_close(grad_x, d_x, dtype, factor=8)


@pytest.mark.parametrize("gamma", [0.01, 0.1, 0.25, 0.5, 0.9, 1.0, 2.0])
def test_saturated_logit_on_its_targets_side_has_a_zero_or_tiny_gradient(gamma):
    """1 - p_t rounds to 0 there, or is subnormal (a logit of about 88 to
    104 in float32, 708 to 745 in float64), where r^(gamma - 1) overflows
    for small gamma: pow's slope is infinite (and torchvision's gradient
    NaN); ours is the exact value's rounding (below 1e-39), never inf or
    NaN."""
    for dtype, values in ((np.float32, [100.0, 1e4, 90.0, 95.0, 103.0]),
                          (np.float64, [720.0, 740.0, 1e4])):
        x = np.array(values + [-v for v in values], dtype)
        t = np.array([1.0] * len(values) + [0.0] * len(values), dtype)
        grad_x, grad_t = binary_focal_loss_backward(x, t, np.ones_like(x), gamma)
        assert np.isfinite(grad_x).all() and np.isfinite(grad_t).all()
        assert (np.abs(grad_x) < 1e-39).all()
        finite = np.abs(x) < 1000   # (1e4: the finiteness checks above)
        _, d_x, _ = ref_forward_backward(x[finite], t[finite], gamma, 0.25)
        assert_close(grad_x[finite], d_x, dtype, factor=8)


def test_infinite_logits_give_the_limits_where_they_are_finite():
    """A hard target at an infinite logit: its loss and gradients are the
    limits (0 on the target's side, where 0 * inf would give NaN; the
    cross entropy's slope of 1 away from it)."""
    x = np.array([-np.inf, np.inf, np.inf, -np.inf])
    t = np.array([0.0, 1.0, 0.0, 1.0])
    for gamma in (0.0, 1.0, 2.0):
        loss = binary_focal_loss(x, t, gamma, 0.25)
        np.testing.assert_array_equal(loss, [0, 0, np.inf, np.inf])
        grad_x, _ = binary_focal_loss_backward(x, t, np.ones(4), gamma, 0.25)
        np.testing.assert_array_equal(grad_x, [0, 0, 0.75, -0.25])


# The CPU kernel takes runs of 8 float32 or 4 float64 elements through its
# own vector exp and log1p where |x| <= 80 (float32) or 700 (float64), and the
# C library's elsewhere (src/cpu/vec_math.h).
VECTOR_DOMAIN = {np.float32: 80.0, np.float64: 700.0}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma", [2.0, 0.5])
def test_logits_at_the_edge_of_the_vector_math_domain_match_the_reference(dtype, gamma):
    """Logits just inside and just outside the vector math's domain, in the
    same runs of elements as ordinary ones: each the reference's value."""
    edge = VECTOR_DOMAIN[dtype]
    step = float(np.spacing(dtype(edge)))
    values = [edge - 0.5, edge - step, edge, edge + step, edge + 0.5, 1.5, -3.0, 0.0]
    x = np.repeat(np.array(values + [-v for v in values], dtype), 3)
    t = np.tile(np.array([0.0, 1.0, 0.25], dtype), len(values) * 2)
    loss, d_x, d_t = ref_forward_backward(x, t, gamma, 0.25)
    assert_close(binary_focal_loss(x, t, gamma, 0.25), loss, dtype, factor=4)
    grad_x, grad_t = binary_focal_loss_backward(x, t, np.ones_like(x), gamma, 0.25)
    assert_close(grad_x, d_x, dtype, factor=8)
    assert_close(grad_t, d_t, dtype, factor=16, scale=(np.abs(x.astype(np.float64)) + 1) * 4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_elements_value_does_not_depend_on_where_it_lies(dtype, rng):
    """Every element gets the same bits alone, at any offset within a run of
    vector lanes, and in the short run the arrays end with (padded), for
    logits inside and outside the vector math's domain and NaN. (About 3 %
    of elements round differently in the C library's exp and log1p than in
    the vector math: 200 elements show where one path stands in for the
    other.)"""
    n = 200
    x = (rng.standard_normal(n) * 30).astype(dtype)
    x[:49:7] = [VECTOR_DOMAIN[dtype] * 1.5, -np.inf, np.nan, 1e4, -VECTOR_DOMAIN[dtype], 0.0, -0.0]
    t = rng.choice([0.0, 1.0, 0.3], n).astype(dtype)
    t[5] = np.nan
    g = rng.uniform(-2, 2, n).astype(dtype)

    def results(begin, end):
        s = slice(begin, end)
        return (binary_focal_loss(x[s], t[s], 1.5, 0.25),
                *binary_focal_loss_backward(x[s], t[s], g[s], 1.5, 0.25))

    whole = results(0, len(x))
    for begin in range(9):
        for got, want in zip(results(begin, len(x) - begin % 3), whole):
            np.testing.assert_array_equal(got, want[begin:len(x) - begin % 3])
    for i in range(len(x)):
        for got, want in zip(results(i, i + 1), whole):
            np.testing.assert_array_equal(got, want[i:i + 1])
    loss = whole[0]
    assert np.isnan(loss[[5, 14]]).all() and not np.isnan(np.delete(loss, [5, 14])).any()


def test_float32_loss_and_gradient_over_many_logits_are_within_a_few_ulp(rng):
    """10^6 elements, their logits over the vector math's domain and past
    it, against the same formulas in float64 (numpy's exp and log1p): the
    loss, a product of positive terms, within 8 ulp of float32, and the
    input gradient at hard targets too."""
    n = 1_000_000
    x = np.concatenate([rng.uniform(-90, 90, n // 2),
                        rng.standard_normal(n - n // 2) * 4]).astype(np.float32)
    t = (rng.uniform(size=n) < 0.1).astype(np.float32)
    gamma, alpha = 2.0, 0.25
    x64, hard = x.astype(np.float64), t == 1
    p, q = 1 / (1 + np.exp(-x64)), 1 / (1 + np.exp(x64))
    ce = np.logaddexp(0, np.where(hard, -x64, x64))   # softplus(-x) at t = 1, else softplus(x)
    r, a = np.where(hard, q, p), np.where(hard, alpha, 1 - alpha)
    loss = a * ce * r ** 2
    # d/dx: a ((p - t) r^2 + ce * 2 r * p q * (1 - 2t)), with p - 1 = -q
    d_x = a * (np.where(hard, -q, p) * r ** 2 + ce * 2 * r * p * q * np.where(hard, -1, 1))
    eps, tiny = np.finfo(np.float32).eps, np.finfo(np.float32).tiny
    got = binary_focal_loss(x, t, gamma, alpha).astype(np.float64)
    assert (np.abs(got - loss) <= 8 * eps * np.abs(loss) + tiny).all()
    grad_x, _ = binary_focal_loss_backward(x, t, np.ones_like(x), gamma, alpha)
    assert (np.abs(grad_x - d_x) <= 16 * eps * np.abs(d_x) + tiny).all()


@pytest.mark.parametrize("gamma, alpha", [(2.0, 0.25), (0.5, 0.75), (0.0, 1.0)])
def test_one_hot_targets_give_mmcvs_sigmoid_focal_loss_of_their_indices(gamma, alpha, rng):
    """Another kernel, the same loss: MMCV's sigmoid_focal_loss of class
    indices (C = background) is this one of their one-hot rows, and its
    input gradient too."""
    x = rng.standard_normal((20, 6)) * 6
    labels = rng.integers(0, 7, 20)
    one_hot = (labels[:, None] == np.arange(6)).astype(np.float64)
    np.testing.assert_allclose(binary_focal_loss(x, one_hot, gamma, alpha),
                               mmdispatch.ops.sigmoid_focal_loss_forward(x, labels, gamma, alpha),
                               rtol=1e-13, atol=1e-300)
    grad_x, _ = binary_focal_loss_backward(x, one_hot, np.ones_like(x), gamma, alpha)
    np.testing.assert_allclose(grad_x, mmdispatch.ops.sigmoid_focal_loss_backward(
        x, labels, gamma, alpha), rtol=1e-12, atol=1e-300)


def test_reductions_none_sum_and_mean_are_torchvisions(rng):
    x = rng.standard_normal((4, 3, 2)) * 3
    t = rng.uniform(0, 1, (4, 3, 2))
    loss = binary_focal_loss(x, t)
    assert loss.shape == x.shape
    np.testing.assert_allclose(binary_focal_loss(x, t, reduction="sum"), loss.sum(), rtol=1e-14)
    np.testing.assert_allclose(binary_focal_loss(x, t, reduction="mean"), loss.mean(),
                               rtol=1e-14)
    empty = np.zeros((0, 3))
    assert np.isnan(binary_focal_loss(empty, empty, reduction="mean"))
    assert binary_focal_loss(empty, empty, reduction="sum") == 0
    assert binary_focal_loss(empty, empty).shape == (0, 3)


def test_targets_of_another_dtype_are_refused_naming_both(rng):
    """Targets in the input's dtype only (the PyTorch layer promotes, as
    torch does): a float32 loss of float64 labels would round them."""
    x = np.zeros((2, 3), np.float32)
    for t in (np.zeros((2, 3)), np.zeros((2, 3), bool)):
        with pytest.raises(TypeError, match=re.escape(
                f"{FORWARD}: target has dtype {t.dtype} but input has dtype float32")):
            binary_focal_loss(x, t)


def test_zero_dimensional_and_strided_inputs(rng):
    x = rng.standard_normal((6, 8)) * 3
    t = rng.uniform(0, 1, (6, 8))
    np.testing.assert_array_equal(binary_focal_loss(x[:, ::2], t[:, ::2]),
                                  binary_focal_loss(x, t)[:, ::2])
    np.testing.assert_array_equal(binary_focal_loss(np.array(x[0, 0]), np.array(t[0, 0])),
                                  binary_focal_loss(x, t)[0, 0])


@pytest.mark.parametrize("gamma, alpha", [(2.0, 0.25), (0.0, -1.0), (1.0, 0.75), (3.5, 0.5)])
def test_backward_matches_finite_differences(gamma, alpha, rng, numeric_gradient):
    x = rng.standard_normal((3, 4)) * 3
    t = rng.uniform(0.05, 0.95, (3, 4))
    g = rng.uniform(-1, 1, (3, 4))
    grad_x, grad_t = binary_focal_loss_backward(x, t, g, gamma, alpha)
    np.testing.assert_allclose(grad_x, numeric_gradient(
        lambda v: (binary_focal_loss(v, t, gamma, alpha) * g).sum(), x), rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(grad_t, numeric_gradient(
        lambda v: (binary_focal_loss(x, v, gamma, alpha) * g).sum(), t), rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_gradient_for_every_element_gives_what_its_full_array_gives(dtype, rng):
    """A 0-d grad_output (a "sum"'s or "mean"'s gradient, which
    mmdispatch.torch hands over so instead of an array of it) is the
    gradient of every element: the same bits as an array of that value, on
    the vector path, its padded end and past its domain."""
    x = (rng.standard_normal((37, 11)) * 30).astype(dtype)
    x[0, :3] = [np.inf, np.nan, 1e4]
    t = rng.uniform(0, 1, x.shape).astype(dtype)
    for value in (1.0, -0.37, 0.0):
        one = np.array(value, dtype)
        for got, want in zip(binary_focal_loss_backward(x, t, one, 1.5, 0.25),
                             binary_focal_loss_backward(x, t, np.full(x.shape, one), 1.5, 0.25)):
            assert got.shape == x.shape
            np.testing.assert_array_equal(got, want)


def test_a_gradient_of_one_element_but_not_0_d_or_of_another_dtype_is_refused():
    x = np.zeros((2, 3))
    for bad, error, message in (
            (np.ones(1), ValueError, "grad_output must have shape (2, 3), got (1,)"),
            (np.ones((1, 1)), ValueError, "grad_output must have shape (2, 3), got (1, 1)"),
            (np.array(1.0, np.float32), TypeError,
             "grad_output has dtype float32 but input has dtype float64")):
        with pytest.raises(error, match=re.escape(f"{BACKWARD}: {message}")):
            binary_focal_loss_backward(x, x, bad)


@pytest.mark.parametrize("with_grad_input, with_grad_target", [(True, False), (False, True),
                                                               (False, False)])
def test_backward_computes_only_the_gradients_asked_for(with_grad_input, with_grad_target, rng):
    x, t, g = rng.standard_normal((3, 4)), rng.uniform(0, 1, (3, 4)), rng.standard_normal((3, 4))
    expected = binary_focal_loss_backward(x, t, g, 1.5, 0.25)
    grads = [np.full((3, 4), 7.0), np.full((3, 4), 7.0)]
    mmdispatch.binary_focal_loss_backward_impl(x, t, g, *grads, 1.5, 0.25, with_grad_input,
                                               with_grad_target)
    for wanted, got, want in zip((with_grad_input, with_grad_target), grads, expected):
        if wanted:
            np.testing.assert_array_equal(got, want)
        else:
            assert (got == 7.0).all()
    # the entry point allocates (0,) for a gradient not asked for, and a
    # gradient not asked for may be any array: it is not read or written
    gi, gt = mmdispatch.binary_focal_loss_backward_impl(x, t, g, None, None, 1.5, 0.25,
                                                        with_grad_input, with_grad_target)
    assert gi.shape == ((3, 4) if with_grad_input else (0,))
    assert gt.shape == ((3, 4) if with_grad_target else (0,))
    unused = np.full(5, 7.0)
    mmdispatch.binary_focal_loss_backward_impl(
        x, t, g, np.empty((3, 4)) if with_grad_input else unused,
        np.empty((3, 4)) if with_grad_target else np.full(5, 7.0), 1.5, 0.25, with_grad_input,
        with_grad_target)
    assert (unused == 7.0).all()


# --- bad input -------------------------------------------------------------------

X = np.zeros((3, 4))


@pytest.mark.parametrize("call, error, message", [
    (lambda: binary_focal_loss(X, np.zeros((3, 5))), ValueError,
     "binary_focal_loss_forward_impl: target must have shape (3, 4), got (3, 5)"),
    (lambda: binary_focal_loss(X, np.zeros(4)), ValueError,
     "binary_focal_loss_forward_impl: target must have shape (3, 4), got (4,)"),
    (lambda: binary_focal_loss(X.astype(np.int64), X), TypeError,
     "binary_focal_loss_forward_impl: input has dtype int64"),
    (lambda: binary_focal_loss(X, X, alpha=1.5), ValueError,
     "binary_focal_loss: alpha must be in [0, 1], or -1 for no class weighting, got 1.5"),
    (lambda: binary_focal_loss(X, X, alpha=math.nan), ValueError,
     "binary_focal_loss: alpha must be in [0, 1]"),
    (lambda: binary_focal_loss(X, X, gamma=-1.0), ValueError,
     "binary_focal_loss_forward_impl: gamma must be finite and >= 0, got -1"),
    (lambda: binary_focal_loss(X.astype(np.float32), X.astype(np.float32), gamma=1e39),
     ValueError,
     "binary_focal_loss_forward_impl: gamma must be finite in float32 and >= 0"),
    (lambda: binary_focal_loss(X, X, reduction="avg"), ValueError,
     "binary_focal_loss: reduction must be one of 'none', 'mean', 'sum', got 'avg'"),
    (lambda: binary_focal_loss(X.tolist(), X), TypeError,
     "binary_focal_loss: input must be an array"),
    (lambda: binary_focal_loss_backward(X, X, np.zeros((4, 3))), ValueError,
     "binary_focal_loss_backward_impl: grad_output must have shape (3, 4), got (4, 3)"),
    (lambda: mmdispatch.binary_focal_loss_forward_impl(X, X, None, 2.0, -0.5), ValueError,
     "binary_focal_loss_forward_impl: alpha must be in [0, 1], or -1 for no class weighting, "
     "got -0.5"),
])
def test_bad_arguments_raise_clear_errors(call, error, message):
    with pytest.raises(error, match=re.escape(message)):
        call()


def readonly(a):
    a = a.copy()
    a.flags.writeable = False
    return a


def test_impl_rejects_bad_outputs_and_writes_nothing():
    x, t, g = np.zeros((3, 4)), np.full((3, 4), 0.5), np.ones((3, 4))
    out = np.full((3, 4), 7.0)
    other = np.full((3, 4), 7.0)
    forward = mmdispatch.binary_focal_loss_forward_impl
    backward = mmdispatch.binary_focal_loss_backward_impl
    cases = [
        (lambda: forward(x, t, readonly(out), 2.0, 0.25), ValueError,
         f"{FORWARD}: at param 2 (output), output array is read-only"),
        (lambda: forward(x, t, t, 2.0, 0.25), ValueError,
         f"{FORWARD}: at param 2 (output), output memory overlaps param 1 (target)"),
        (lambda: forward(x, t, np.full((3, 5), 7.0), 2.0, 0.25), ValueError,
         f"{FORWARD}: output must have shape (3, 4), got (3, 5)"),
        (lambda: forward(x, t, out.astype(np.float32), 2.0, 0.25), TypeError,
         f"{FORWARD}: output has dtype float32 but input has dtype float64"),
        (lambda: forward(x, t, np.full((3, 8), 7.0)[:, ::2], 2.0, 0.25), ValueError,
         f"{FORWARD}: output must be C-contiguous"),
        (lambda: backward(x, t, g, out, out, 2.0, 0.25, True, True), ValueError,
         f"{BACKWARD}: at param 3 (grad_input), output memory overlaps param 4 (grad_target)"),
        (lambda: backward(x, t, g, out, np.zeros((3, 3)), 2.0, 0.25, True, True), ValueError,
         f"{BACKWARD}: grad_target must have shape (3, 4), got (3, 3)"),
        (lambda: backward(x, t, g.astype(np.float32), out, other, 2.0, 0.25, True, True),
         TypeError, f"{BACKWARD}: grad_output has dtype float32 but input has dtype float64"),
        (lambda: backward(x, t, g, np.zeros(0), other, 2.0, 0.25, True, True), ValueError,
         f"{BACKWARD}: grad_input must have shape (3, 4), got (0,)"),
    ]
    for call, error, message in cases:
        with pytest.raises(error, match=re.escape(message)):
            call()
    assert np.all(out == 7.0) and np.all(other == 7.0)


NAMES = {FORWARD: ["input", "target", "output"],
         BACKWARD: ["input", "target", "grad_output", "grad_input", "grad_target"]}


def _args(op):
    arrays = [np.zeros((3, 4)) for _ in NAMES[op]]
    return arrays, ([2.0, 0.25] if op == FORWARD else [2.0, 0.25, True, True])


@pytest.mark.parametrize("op", sorted(NAMES))
def test_impl_rejects_an_array_on_another_device(op, fake_array):
    for position in range(len(NAMES[op])):
        arrays, scalars = _args(op)
        fake = fake_array(2, 0)
        arrays[position] = fake
        if position == 0:
            message = f"{op}: at param 1 (target), inconsistent device: cpu vs cuda:0"
        else:
            message = (f"{op}: at param {position} ({NAMES[op][position]}), inconsistent "
                       "device: cuda:0 vs cpu")
        with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(message)):
            getattr(mmdispatch, op)(*arrays, *scalars)
        assert not fake.exported


@pytest.mark.parametrize("op", sorted(NAMES))
def test_impl_with_all_arrays_on_a_device_without_kernels_raises_kernel_not_found(op,
                                                                                  fake_array):
    arrays, scalars = _args(op)
    fakes = [fake_array(12, 0) for _ in arrays]
    with pytest.raises(mmdispatch.KernelNotFoundError, match=re.escape(
            f"{op}: implementation for device ext_dev:0 not found.")):
        getattr(mmdispatch, op)(*fakes, *scalars)
    assert not any(f.exported for f in fakes)


# --- CUDA (runs only where a GPU, CuPy and the CUDA kernels are present) ------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gamma, alpha", [(2.0, 0.25), (0.5, -1.0), (0.0, 1.0), (1.0, 0.5)])
def test_cuda_matches_cpu(cupy, dtype, gamma, alpha, rng):
    x = (rng.standard_normal((64, 9)) * 4).astype(dtype)
    x[0, :6] = [100, -100, 1e4, -1e4, 30, -30]
    t = np.where(rng.uniform(size=(64, 9)) < 0.5, rng.uniform(size=(64, 9)),
                 rng.uniform(size=(64, 9)) < 0.2).astype(dtype)
    g = rng.standard_normal((64, 9)).astype(dtype)
    rtol = 1e-5 if dtype == np.float32 else 1e-12
    expected = binary_focal_loss(x, t, gamma, alpha)
    got = binary_focal_loss(cupy.asarray(x), cupy.asarray(t), gamma, alpha)
    assert isinstance(got, cupy.ndarray) and got.dtype == dtype
    np.testing.assert_allclose(cupy.asnumpy(got), expected, rtol=rtol, atol=1e-30)
    for got, want in zip(binary_focal_loss_backward(*map(cupy.asarray, (x, t, g)), gamma, alpha),
                         binary_focal_loss_backward(x, t, g, gamma, alpha)):
        assert isinstance(got, cupy.ndarray) and got.dtype == dtype
        np.testing.assert_allclose(cupy.asnumpy(got), want, rtol=rtol, atol=1e-30)
    for reduction in ("sum", "mean"):
        got = binary_focal_loss(cupy.asarray(x), cupy.asarray(t), gamma, alpha, reduction)
        np.testing.assert_allclose(float(got), binary_focal_loss(x, t, gamma, alpha, reduction),
                                   rtol=rtol * 10)


def test_cuda_float16_and_bfloat16_compute_in_float32(torch_cuda, rng):
    torch = torch_cuda
    x32 = (rng.standard_normal((32, 7)) * 4).astype(np.float32)
    t32 = rng.uniform(size=(32, 7)).astype(np.float32)
    for dtype, tol in ((torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)):
        x, t = torch.from_numpy(x32).to(dtype), torch.from_numpy(t32).to(dtype)
        g = torch.ones_like(x)
        expected = binary_focal_loss(x.float().numpy(), t.float().numpy())
        got = binary_focal_loss(x.cuda(), t.cuda())
        assert isinstance(got, torch.Tensor) and got.dtype == dtype
        np.testing.assert_allclose(got.float().cpu().numpy(), expected, rtol=tol, atol=1e-6)
        expected = binary_focal_loss_backward(x.float().numpy(), t.float().numpy(),
                                              g.float().numpy())
        for got, want in zip(binary_focal_loss_backward(x.cuda(), t.cuda(), g.cuda()), expected):
            assert got.dtype == dtype
            np.testing.assert_allclose(got.float().cpu().numpy(), want, rtol=tol, atol=2e-3)


def test_cuda_and_cpu_arrays_cannot_be_mixed(cupy):
    with pytest.raises(mmdispatch.DeviceMismatchError, match=re.escape(
            f"{FORWARD}: at param 1 (target), inconsistent device: cpu vs cuda:0")):
        binary_focal_loss(cupy.zeros((3, 4)), X)


# --- properties (tests/support/properties.py) ----------------------------------------------

def focal_case(backward):
    @st.composite
    def case(draw, dtype):
        shape = tuple(draw(st.lists(st.integers(0, 4), min_size=2, max_size=2)))
        x = draw(float_arrays(shape, dtype, -40, 40, specials=False))
        size = int(np.prod(shape))
        if size and draw(st.booleans()):
            x.reshape(-1)[draw(st.integers(0, size - 1))] = draw(
                st.sampled_from([1e4, -1e4, 88.5, -88.5, 0.0]))
        t = draw(float_arrays(shape, dtype, 0, 1, specials=False))
        gamma = draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]))
        alpha = draw(st.sampled_from([0.25, 0.5, 1.0, 0.0, -1.0]))
        args = dict(input=guarded(x), target=guarded(t), gamma=gamma, alpha=alpha)
        if backward:
            # one gradient for every element (0-d, a sum's) or one each
            g = draw(float_arrays(() if draw(st.booleans()) else shape, dtype, -2, 2,
                                  specials=False))
            wanted = draw(st.sampled_from([(True, True), (True, False), (False, True)]))
            args.update(grad_output=guarded(g), with_grad_input=wanted[0],
                        with_grad_target=wanted[1],
                        grad_input=guarded(sentinel(shape if wanted[0] else (0,), dtype)),
                        grad_target=guarded(sentinel(shape if wanted[1] else (0,), dtype)))
        else:
            args["output"] = guarded(sentinel(shape, dtype))

        def check(a):
            loss, d_x, d_t = ref_forward_backward(x, t, gamma, alpha)
            if not backward:
                return assert_close(a["output"], loss, dtype, factor=8)
            if a["with_grad_input"]:
                assert_close(a["grad_input"], g * d_x, dtype, factor=16, scale=np.abs(g) * 2)
            if a["with_grad_target"]:
                scale = np.abs(g) * (np.abs(x.astype(np.float64)) + 1) * 4
                assert_close(a["grad_target"], g * d_t, dtype, factor=16, scale=scale)
        return args, check
    return case


def user_case(draw, name, dtype, layout):
    a, check = draw(focal_case(name == "binary_focal_loss_backward")(dtype))
    inputs = dict(input=layout(a["input"]), target=layout(a["target"]))
    if name == "binary_focal_loss_backward":
        inputs["grad_output"] = layout(a["grad_output"])
    reduction = draw(st.sampled_from(["none", "sum", "mean"]))

    def run():
        if name == "binary_focal_loss":
            return binary_focal_loss(inputs["input"], inputs["target"], a["gamma"], a["alpha"],
                                     reduction)
        return binary_focal_loss_backward(inputs["input"], inputs["target"],
                                          inputs["grad_output"], a["gamma"], a["alpha"])

    def verify(result):
        if name == "binary_focal_loss_backward":
            return check(dict(a, grad_input=result[0], grad_target=result[1],
                              with_grad_input=True, with_grad_target=True))
        if reduction == "none":
            return check(dict(a, output=result))
        loss, _, _ = ref_forward_backward(a["input"], a["target"], a["gamma"], a["alpha"])
        expected = loss.sum() if reduction == "sum" else (loss.mean() if loss.size else math.nan)
        assert result.shape == () and result.dtype == dtype
        slack = (1e-6 if dtype == np.float32 else 1e-13) * float(np.abs(loss).sum())
        np.testing.assert_allclose(float(result), expected, rtol=1e-12, atol=slack)
    return run, inputs, verify


def small_call():
    return [np.zeros((2, 3)), np.full((2, 3), 0.5), 2.0, 0.25]


def small_backward_call():
    return [np.zeros((2, 3)), np.full((2, 3), 0.5), np.ones((2, 3)), 2.0, 0.25]


def torch_forward_calls(torch, device):
    logits = torch.randn(4, 5, dtype=torch.float64, device=device, requires_grad=True)
    target = torch.rand(4, 5, dtype=torch.float64, device=device)
    return [(logits, target, 2.0, 0.25), (logits, target.requires_grad_(True), 1.5, -1.0),
            (logits.detach(), target, 0.5, 0.75)]


def torch_backward_calls(torch, device):
    logits = torch.randn(4, 5, dtype=torch.float64, device=device)
    target = torch.rand(4, 5, dtype=torch.float64, device=device)
    grad = torch.randn(4, 5, dtype=torch.float64, device=device)
    return [(logits, target, grad, 2.0, 0.25, True, True),
            (logits, target, grad, 1.0, -1.0, True, False),
            (logits, target, grad, 0.0, 0.5, False, True),
            (logits, target, grad.sum(), 2.0, 0.25, True, True)]   # one gradient for all


class TestProperties(OpProperties):
    module = focal_module
    torch_calls = {FORWARD: torch_forward_calls, BACKWARD: torch_backward_calls}
    entry_cases = {FORWARD: focal_case(False), BACKWARD: focal_case(True)}
    fixed_axes = {
        FORWARD: {"target": [0, 1], "output": [0, 1]},
        BACKWARD: {"target": [0, 1], "grad_output": [0, 1], "grad_input": [0, 1],
                   "grad_target": [0, 1]},
    }
    bad_scalars = {"gamma": [math.nan, math.inf, -1.0],
                   "alpha": [math.nan, math.inf, -math.inf, 1.5, -0.5]}
    user_cases = {name: user_case for name in ("binary_focal_loss",
                                               "binary_focal_loss_backward")}
    good_user_args = {"binary_focal_loss": lambda: small_call() + ["mean"],
                      "binary_focal_loss_backward": small_backward_call}
    any_ndim = {"binary_focal_loss": (0, 1), "binary_focal_loss_backward": (0, 1, 2)}
    user_bad_values = {
        ("binary_focal_loss", 1): [np.zeros((2, 4)), np.zeros(3), [0.5, 0.5]],
        ("binary_focal_loss", 2): [math.nan, -1.0, math.inf, "2", None],
        ("binary_focal_loss", 3): [math.nan, math.inf, None, 1.5, -0.5, "x"],
        ("binary_focal_loss", 4): ["avg", None, 1],
        ("binary_focal_loss_backward", 2): [np.zeros((3, 2)), np.zeros(6)],
        ("binary_focal_loss_backward", 4): [-0.5, math.nan],
    }

    def bad_scalar_values(self, name, dtype):
        values = super().bad_scalar_values(name, dtype)
        # gamma and alpha are converted to the input's dtype: beyond float32
        return values + [1e39] if name == "gamma" and dtype == np.float32 else values

    def ignores(self, op_name, args, name):
        """A gradient the backward is not asked for is not read or written."""
        return name in ("grad_input", "grad_target") and not args[f"with_{name}"]
