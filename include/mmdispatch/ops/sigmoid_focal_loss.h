/* sigmoid_focal_loss: the argument checks and the per-element math shared
 * by the CPU kernels (src/cpu/sigmoid_focal_loss.cpp) and the CUDA kernels
 * (src/cuda/sigmoid_focal_loss.cu).
 *
 * input (N, C) logits, target (N,) int64 class indices in [0, C] where C
 * means background (every column is a negative). With p = sigmoid(x):
 *   column == target: alpha * (1 - p)^gamma * -log(p)
 *   otherwise:        (1 - alpha) * p^gamma * -log(1 - p)
 * times weight[target] when a (C,) weight is given (MMCV's CUDA kernel),
 * and times 1 for background rows, whose target has no weight entry.
 * -log(p) and -log(1 - p) are computed as softplus(-x) and softplus(x), so
 * large |x| neither takes log(0) nor overflows (binary_focal_loss.h's
 * formulas, whose target here is 1 in the target's column and 0
 * elsewhere). */
#ifndef MMDISPATCH_OPS_SIGMOID_FOCAL_LOSS_H
#define MMDISPATCH_OPS_SIGMOID_FOCAL_LOSS_H

#include <math.h>

#include "mmdispatch/ops/binary_focal_loss.h"
#include "mmdispatch/ops/focal_loss.h"

/* Shape/dtype/scalar checks; `output` is the loss (forward) or grad_input
 * (backward), `float_mask` the device's supported dtypes. */
inline int mmd_sigmoid_focal_loss_check(const mmd_tensor *input, const mmd_tensor *target,
                                        const mmd_tensor *weight, const mmd_tensor *output,
                                        const char *output_name, double gamma, double alpha,
                                        unsigned float_mask) {
    int s = mmd_focal_loss_check_common(input, target, weight, gamma, alpha, float_mask);
    if (!s) s = mmd_check_shape(output, output_name, 2, input->shape);
    if (!s) s = mmd_check_same_dtype(output, output_name, input, "input");
    if (!s) s = mmd_check_contiguous(output, output_name);
    return s;
}

/* Message for a target outside [0, C]. */
inline int mmd_sigmoid_focal_loss_target_error(int64_t row, int64_t value, int64_t num_classes) {
    return mmd_error(MMD_ERR_VALUE,
                     "target[%lld] = %lld is not a class index in [0, %lld] (%lld = background)",
                     (long long)row, (long long)value, (long long)num_classes,
                     (long long)num_classes);
}

/* Loss of one element; `positive` says whether its column is the target:
 * binary_focal_loss's of a one-hot target (the same definition, and one
 * exp and one log1p an element), with MMCV's class weight. */
template <typename T> MMD_HOSTDEV inline T mmd_focal_loss(T x, int positive, T gamma, T alpha) {
    return mmd_binary_focal_loss_of<mmd_scalar_math<T>>(x, (T)positive, gamma,
                                                        positive ? alpha : (T)1 - alpha);
}

/* d loss / d x of one element, with q = 1 - p = sigmoid(-x):
 *   positive: -alpha * q^gamma * (q + gamma * p * softplus(-x))
 *   negative: (1 - alpha) * p^gamma * (p + gamma * q * softplus(x))
 * (binary_focal_loss's of a one-hot target). */
template <typename T>
MMD_HOSTDEV inline T mmd_focal_loss_grad(T x, int positive, T gamma, T alpha) {
    T d_x, d_t;
    mmd_binary_focal_loss_grad_of<mmd_scalar_math<T>>(x, (T)positive, gamma,
                                                      positive ? alpha : (T)1 - alpha, (T)0,
                                                      &d_x, &d_t);
    return d_x;
}

#endif
