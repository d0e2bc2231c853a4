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
 * log(0) nor overflow (MMCV clamps p to FLT_MIN instead), and q as
 * -expm1(log p). The gradient, scaled by the row's grad_output, is
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

/* A row's loss, from log(p) of its target class. */
template <typename T> MMD_HOSTDEV inline T mmd_softmax_focal_loss(T log_p, T gamma, T alpha) {
    const T q = -expm1(log_p);
    return -alpha * mmd_focal_power<mmd_scalar_math<T>>(q, gamma) * log_p;
}

/* The gradient's elements: for c not the target, -factor * p_c, taken as
 * -(factor / sum) * exp(x_c - max) (the sum 1 + mmd_softmax_others), whose
 * error does not grow with |x_c - max - log_sum| as exp of that difference
 * does; the target's is mmd_softmax_focal_loss_target_grad, q = 1 - p_t as
 * -expm1(log p_t) (1 - p_t kept few digits where p_t nears 1). */
template <typename T> MMD_HOSTDEV inline T mmd_softmax_focal_loss_target_grad(T factor, T log_p) {
    return factor * -expm1(log_p);
}
/* -(factor / sum): an other element's gradient per exp(x_c - max). */
template <typename T> MMD_HOSTDEV inline T mmd_softmax_focal_loss_term_scale(T factor, T others) {
    return -(factor / ((T)1 + others));
}

/* The factor of (delta_ct - p_c) in a row's gradient; p log(p) / q is
 * taken as its limit 0 where p = 0 (a target logit of -inf: 0 * inf). */
template <typename T> MMD_HOSTDEV inline T mmd_softmax_focal_loss_factor(T log_p, T gamma,
                                                                      T alpha) {
    const T p = exp(log_p), q = -expm1(log_p);
    const T ratio = q > 0 ? log_p / q : (T)-1;
    const T slope = p > 0 ? gamma * p * ratio : (T)0;
    return alpha * mmd_focal_power<mmd_scalar_math<T>>(q, gamma) * (slope - 1);
}

#endif
