/* sigmoid_focal_loss: host-side checks and the per-element math shared by
 * the CPU kernels (src/cpu/sigmoid_focal_loss.c) and the CUDA kernels
 * (src/cuda/sigmoid_focal_loss.cu).
 *
 * input (N, C) logits, target (N,) int64 class indices in [0, C] where C
 * means background (every column is a negative). With p = sigmoid(x):
 *   column == target: alpha * (1 - p)^gamma * -log(p)
 *   otherwise:        (1 - alpha) * p^gamma * -log(1 - p)
 * times weight[target] when a (C,) weight is given (MMCV's CUDA kernel),
 * and times 1 for background rows, whose target has no weight entry.
 * -log(p) and -log(1 - p) are computed as softplus(-x) and softplus(x), so
 * large |x| neither takes log(0) nor overflows. */
#ifndef MMDISPATCH_OPS_SIGMOID_FOCAL_LOSS_H
#define MMDISPATCH_OPS_SIGMOID_FOCAL_LOSS_H

#include <math.h>

#include "mmdispatch/checks.h"

#ifdef __cplusplus
extern "C" {
#endif

/* `output` is the loss (forward) or grad_input (backward). */
int mmd_sigmoid_focal_loss_check(const mmd_tensor *input, const mmd_tensor *target,
                                 const mmd_tensor *weight, const mmd_tensor *output,
                                 const char *output_name, double gamma, double alpha,
                                 unsigned float_mask);
/* Message for a target outside [0, C]. */
int mmd_sigmoid_focal_loss_target_error(int64_t row, int64_t value, int64_t num_classes);

#ifdef __cplusplus
}
#endif

#define MMD_TYPED_FILE "mmdispatch/ops/sigmoid_focal_loss_math.inc"
#include "mmdispatch/typed.h"

#ifdef __cplusplus
/* The same math overloaded by type, for CUDA templates. */
#define MMD_FOCAL_OVERLOADS(A, sfx)                                                \
    MMD_HOSTDEV inline A mmd_focal_loss(A x, int positive, A gamma, A alpha) {     \
        return mmd_focal_loss_##sfx(x, positive, gamma, alpha);                    \
    }                                                                              \
    MMD_HOSTDEV inline A mmd_focal_loss_grad(A x, int positive, A gamma, A alpha) { \
        return mmd_focal_loss_grad_##sfx(x, positive, gamma, alpha);               \
    }
MMD_FOCAL_OVERLOADS(float, f32)
MMD_FOCAL_OVERLOADS(double, f64)
#undef MMD_FOCAL_OVERLOADS
#endif

#endif
