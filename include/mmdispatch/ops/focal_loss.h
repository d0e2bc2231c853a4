/* The focal losses' common arguments (sigmoid_focal_loss.h,
 * softmax_focal_loss.h): input (N, C) logits in one of `float_mask`'s
 * dtypes, gamma and alpha (finite; gamma >= 0; within float32 for the
 * kernels that compute in it), target (N,) int64, weight (C,) like input or
 * absent; all dense. */
#ifndef MMDISPATCH_OPS_FOCAL_LOSS_H
#define MMDISPATCH_OPS_FOCAL_LOSS_H

#include <math.h>

#include "mmdispatch/checks.h"

/* gamma finite and >= 0, alpha finite, both within float32 where the
 * kernels compute in it (any dtype but float64). */
inline int mmd_focal_loss_check_scalars(const mmd_tensor *input, double gamma, double alpha) {
    const int in_float = input->dtype != MMD_FLOAT64;
    if (!(isfinite(gamma) && gamma >= 0 && (!in_float || isfinite((float)gamma))))
        return mmd_error(MMD_ERR_VALUE, "gamma must be finite%s and >= 0, got %g",
                         in_float ? " in float32" : "", gamma);
    if (!(isfinite(alpha) && (!in_float || isfinite((float)alpha))))
        return mmd_error(MMD_ERR_VALUE, "alpha must be finite%s, got %g",
                         in_float ? " in float32" : "", alpha);
    return MMD_OK;
}

inline int mmd_focal_loss_check_common(const mmd_tensor *input, const mmd_tensor *target,
                                       const mmd_tensor *weight, double gamma, double alpha,
                                       unsigned float_mask) {
    const int64_t any2[2] = {MMD_ANY_DIM, MMD_ANY_DIM};
    int s = mmd_check_shape(input, "input", 2, any2);
    if (!s) s = mmd_check_dtype(input, "input", float_mask);
    if (!s) s = mmd_check_contiguous(input, "input");
    if (!s) s = mmd_focal_loss_check_scalars(input, gamma, alpha);
    if (s) return s;
    const int64_t rows[1] = {input->shape[0]}, classes[1] = {input->shape[1]};
    s = mmd_check_shape(target, "target", 1, rows);
    if (!s) s = mmd_check_dtype(target, "target", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(target, "target");
    if (!s && weight) s = mmd_check_like(weight, "weight", 1, classes, input, "input");
    return s;
}

#endif
