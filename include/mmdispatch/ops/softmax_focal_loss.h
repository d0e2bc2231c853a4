/* softmax_focal_loss (MMCV's definition): the argument checks and the
 * per-row math shared by the CPU kernels (src/cpu/softmax_focal_loss.cpp)
 * and the CUDA kernels (src/cuda/softmax_focal_loss.cu).
 *
 * input (N, C) logits, target (N,) int64: a class index in [0, C), or
 * negative for a row that is ignored (loss 0, gradient 0). With p the
 * softmax probability of the target class and q = 1 - p, a row's loss is
 *     -alpha * q^gamma * log(p)   (times weight[target] with a (C,) weight).
 * log(p) is computed as a log-softmax (x_t - max - log(sum(exp(x - max)))),
 * so large logits neither take log(0) nor overflow (MMCV clamps p to
 * FLT_MIN instead), and q as -expm1(log p). The gradient, scaled by the
 * row's grad_output, is
 *     d loss / d x_c = alpha * q^gamma * (gamma * p * log(p) / q - 1) * (delta_ct - p_c),
 * with log(p) / q taken as -1 where q = 0 (its limit). T, the compute type,
 * is float or double. */
#ifndef MMDISPATCH_OPS_SOFTMAX_FOCAL_LOSS_H
#define MMDISPATCH_OPS_SOFTMAX_FOCAL_LOSS_H

#include <math.h>

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

/* One row's softmax: its maximum and log(sum(exp(x - max))). */
template <typename T, typename V> struct mmd_softmax_row {
    T max, log_sum;

    MMD_HOSTDEV mmd_softmax_row(const V *x, int64_t classes) {
        max = -INFINITY;
        for (int64_t c = 0; c < classes; ++c) max = (T)x[c] > max ? (T)x[c] : max;
        T sum = 0;
        for (int64_t c = 0; c < classes; ++c) sum += exp((T)x[c] - max);
        log_sum = log(sum);
    }
    MMD_HOSTDEV T log_p(T x) const { return x - max - log_sum; }
};

/* A row's loss, from log(p) of its target class. */
template <typename T> MMD_HOSTDEV inline T mmd_softmax_focal_loss(T log_p, T gamma, T alpha) {
    const T q = -expm1(log_p);
    return -alpha * pow(q, gamma) * log_p;
}

/* The factor of (delta_ct - p_c) in a row's gradient. */
template <typename T> MMD_HOSTDEV inline T mmd_softmax_focal_loss_factor(T log_p, T gamma,
                                                                      T alpha) {
    const T p = exp(log_p), q = -expm1(log_p);
    const T ratio = q > 0 ? log_p / q : (T)-1;
    return alpha * pow(q, gamma) * (gamma * p * ratio - 1);
}

#endif
