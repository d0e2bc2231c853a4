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

#ifdef __cplusplus
/* The same math overloaded by type, for CUDA templates:
 * mmd_pool_geometry<A>::type is the geometry struct of compute type A. */
template <typename A> struct mmd_pool_geometry;
#define MMD_ROI_POOL_OVERLOADS(A, sfx)                                                      \
    template <> struct mmd_pool_geometry<A> { typedef mmd_pool_geometry_##sfx type; };      \
    MMD_HOSTDEV inline int mmd_roi_pool_geometry(const A roi[5], int64_t batch_size,        \
                                                 A spatial_scale, int64_t pooled_h,         \
                                                 int64_t pooled_w, mmd_pool_geometry_##sfx *g) { \
        return mmd_roi_pool_geometry_##sfx(roi, batch_size, spatial_scale, pooled_h, pooled_w, \
                                           g);                                              \
    }                                                                                       \
    MMD_HOSTDEV inline void mmd_roi_pool_bin(A start, A bin, int64_t index, int64_t size,   \
                                             int64_t *lo, int64_t *hi) {                    \
        mmd_roi_pool_bin_##sfx(start, bin, index, size, lo, hi);                            \
    }
MMD_ROI_POOL_OVERLOADS(float, f32)
MMD_ROI_POOL_OVERLOADS(double, f64)
#undef MMD_ROI_POOL_OVERLOADS
#endif

#endif
