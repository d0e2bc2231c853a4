/* roi_pool (Fast R-CNN RoIPool, MMCV / torchvision semantics): host-side
 * checks and the per-roi math shared by the CPU kernels (src/cpu/roi_pool.c)
 * and the CUDA kernels (src/cuda/roi_pool.cu).
 *
 * Roi corners are scaled and rounded to the nearest integer (halves away
 * from zero); the roi spans max(end - start + 1, 1) cells per axis; bin k
 * covers [floor(k * bin), ceil((k + 1) * bin)) from the roi start, clipped
 * to the map. A bin's output is its maximum and argmax the flat h * W + w
 * index of it; NaN values are skipped, an empty bin gives 0 and a bin of
 * only NaN gives NaN, both with argmax -1 (no gradient). */
#ifndef MMDISPATCH_OPS_ROI_POOL_H
#define MMDISPATCH_OPS_ROI_POOL_H

#include <math.h>

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/rois.h"

#ifdef __cplusplus
extern "C" {
#endif

int mmd_roi_pool_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                               const mmd_tensor *output, const mmd_tensor *argmax,
                               int64_t pooled_height, int64_t pooled_width,
                               double spatial_scale, unsigned float_mask);
int mmd_roi_pool_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                const mmd_tensor *argmax, const mmd_tensor *grad_input,
                                int64_t pooled_height, int64_t pooled_width,
                                double spatial_scale, unsigned float_mask);
/* Message for an argmax entry outside [-1, H * W) (backward). */
int mmd_roi_pool_argmax_error(int64_t flat_index, int64_t value, int64_t plane_size);

#ifdef __cplusplus
}
#endif

#define MMD_TYPED_FILE "mmdispatch/ops/roi_pool_math.inc"
#include "mmdispatch/typed.h"

#endif
