/* softmax_focal_loss (MMCV's definition): the argument checks and the
 * per-row math shared by the CPU kernels (src/cpu/softmax_focal_loss.cpp)
 * and the CUDA kernels (src/cuda/softmax_focal_loss.cu).
 *
 * input (N, C) logits, target (N,) int64: a class index in [0, C), or
 * negative for a row that is ignored (loss 0, gradient 0). With p the
 * softmax probability of the target class and q = 1 - p, a row's loss is
 *     -alpha * q^gamma * log(p)   (times weight[target] with a (C,) weight).
 * log(p) is computed as a log-softmax (x_t - max - log(sum(exp(x - max))),
 * the log as log1p: see mmd_softmax_others), so large logits neither take
 * log(0) nor overflow (MMCV clamps p to FLT_MIN instead), and q from the
 * sum of the other classes' terms (mmd_softmax_focal_target). The
 * gradient, scaled by the row's grad_output, is
 *     d loss / d x_c = alpha * q^gamma * (gamma * p * log(p) / q - 1) * (delta_ct - p_c),
 * with log(p) / q taken as -1 where q = 0 (its limit), and 1 - p_t as q.
 * T, the compute type, is float or double. */
#ifndef MMDISPATCH_OPS_SOFTMAX_FOCAL_LOSS_H
#define MMDISPATCH_OPS_SOFTMAX_FOCAL_LOSS_H

#include <math.h>

#include "mmdispatch/ops/binary_focal_loss.h"   /* mmd_focal_power */
#include "mmdispatch/ops/focal_loss.h"

/* Shape/dtype/scalar checks; `grad_output` and `grad_input` only in
 * backward (else null), `output` only in forward. */
inline int mmd_softmax_focal_loss_check(const mmd_tensor *input, const mmd_tensor *target,
                                        const mmd_tensor *weight, const mmd_tensor *output,
                                        const mmd_tensor *grad_output,
                                        const mmd_tensor *grad_input, double gamma, double alpha,
                                        unsigned float_mask) {
    int s = mmd_focal_loss_check_common(input, target, weight, gamma, alpha, float_mask);
    const int64_t rows[1] = {input->shape[0]};
    if (!s && output) s = mmd_check_like(output, "output", 1, rows, input, "input");
    if (!s && grad_output)
        s = mmd_check_like(grad_output, "grad_output", 1, rows, input, "input");
    if (!s && grad_input) s = mmd_check_like(grad_input, "grad_input", 2, input->shape, input,
                                             "input");
    return s;
}

/* Message for a target >= C. */
inline int mmd_softmax_focal_loss_target_error(int64_t row, int64_t value, int64_t num_classes) {
    return mmd_error(MMD_ERR_VALUE,
                     "target[%lld] = %lld is not a class index in [0, %lld) (negative: ignored)",
                     (long long)row, (long long)value, (long long)num_classes);
}

/* A row's softmax is its maximum and log(sum(exp(x - max))), the latter
 * taken as log1p of the sum without one element at the maximum (whose
 * term is 1): a confident row's sum is 1 + a little, and log of its
 * rounded value kept few of the little's digits (the loss of a row whose
 * target is the maximum is -log_sum times q^gamma: thousands of ulps off
 * where the others' terms summed to 1e-4 in float32, and 0 where they
 * summed below half an ulp of 1). The kernels sum `rest`, the terms of the
 * elements below the maximum, and count the `ties` at it (0 for a row of
 * NaN or -inf only, whose rest is NaN); this gives the sum but one term of
 * 1 from them, log_sum its log1p. */
template <typename T> MMD_HOSTDEV inline T mmd_softmax_others(T rest, T ties) {
    return ties > 1 ? rest + (ties - 1) : rest;   /* the sum but one term of 1 */
}

/* What a row's loss and gradient take from its target class t, given
 * y = x_t - max and `others` (mmd_softmax_others; the row's sum of exps is
 * S = 1 + others): log p = y - log1p(others), p = e^y / S and
 * q = 1 - p = (S - e^y) / S, where S - e^y is `others` for a target at the
 * maximum (y = 0: its term is the 1 that others leaves out) and
 * 1 + (others - e^y) otherwise (at least 1: no digits cancel), so a q near 0
 * (p near 1) keeps its digits where 1 - p would round them away. Over a
 * math policy M (mmd_scalar_math, or the CPU's vectors of rows: there
 * `log_one_plus_wide` and `exponential` hold for others in [0, kWide] and
 * y in [-kSafe, 0], and other rows take the scalar policy). */
template <typename M> struct mmd_softmax_focal_target {
    typedef typename M::value V;
    typedef typename M::scalar T;
    V log_p, p, q;
    MMD_HOSTDEV mmd_softmax_focal_target(V y, V others) {
        const V sum = (T)1 + others, term = M::exponential(y);
        log_p = y - M::log_one_plus_wide(others);
        p = term / sum;
        q = M::where(y == (T)0, others, (T)1 + (others - term)) / sum;
    }
};

/* A row's loss. */
template <typename M>
MMD_HOSTDEV inline typename M::value mmd_softmax_focal_loss(const mmd_softmax_focal_target<M> &f,
                                                            typename M::scalar gamma,
                                                            typename M::scalar alpha) {
    return -alpha * mmd_focal_power<M>(f.q, gamma) * f.log_p;
}

/* The factor of (delta_ct - p_c) in a row's gradient:
 * alpha * q^gamma * (gamma * p * log(p) / q - 1), log(p) / q taken as its
 * limit -1 where q = 0 and p log(p) / q as its limit 0 where p = 0 (a
 * target logit of -inf: 0 * inf). The gradient's elements: the target's
 * factor * q; another's -factor * p_c, taken as -(factor / S) *
 * exp(x_c - max) (mmd_softmax_focal_loss_term_scale), whose error does not
 * grow with |x_c - max - log S| as exp of that difference does. */
template <typename M>
MMD_HOSTDEV inline typename M::value mmd_softmax_focal_loss_factor(
        const mmd_softmax_focal_target<M> &f, typename M::scalar gamma,
        typename M::scalar alpha) {
    typedef typename M::value V;
    typedef typename M::scalar T;
    const V ratio = M::where(f.q > (T)0, f.log_p / f.q, V() + (T)-1);
    const V slope = M::where(f.p > (T)0, gamma * f.p * ratio, V());
    return alpha * mmd_focal_power<M>(f.q, gamma) * (slope - (T)1);
}
/* -(factor / S): an other element's gradient per exp(x_c - max). */
template <typename V> MMD_HOSTDEV inline V mmd_softmax_focal_loss_term_scale(V factor, V others) {
    return -(factor / (1 + others));
}

#endif
