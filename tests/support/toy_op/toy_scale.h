/* toy_scale: output = input * factor (the toy op of tests/test_toy_op.py). */
#ifndef MMDISPATCH_OPS_TOY_SCALE_H
#define MMDISPATCH_OPS_TOY_SCALE_H

#include "mmdispatch/checks.h"

inline int mmd_toy_scale_check(const mmd_tensor *input, const mmd_tensor *output, double factor,
                               unsigned float_mask) {
    if (factor != factor) return mmd_error(MMD_ERR_VALUE, "factor must not be NaN");
    int s = mmd_check_dtype(input, "input", float_mask);
    if (!s) s = mmd_check_contiguous(input, "input");
    if (!s) s = mmd_check_shape(output, "output", input->ndim, input->shape);
    if (!s) s = mmd_check_same_dtype(output, "output", input, "input");
    if (!s) s = mmd_check_contiguous(output, "output");
    return s;
}

template <typename T> MMD_HOSTDEV inline T mmd_toy_scale(T x, T factor) { return x * factor; }

#endif
