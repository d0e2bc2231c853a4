/* roi_align: host-side argument checks and the per-roi / per-sample math
 * shared by the CPU kernels (src/cpu/roi_align.c) and the CUDA kernels
 * (src/cuda/roi_align.cu), so both devices compute the same thing.
 * Semantics follow MMCV / Detectron2 RoIAlign. */
#ifndef MMDISPATCH_OPS_ROI_ALIGN_H
#define MMDISPATCH_OPS_ROI_ALIGN_H

#include <math.h>

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/rois.h"

#ifdef __cplusplus
extern "C" {
#endif

enum { MMD_POOL_MAX = 0, MMD_POOL_AVG = 1 };

/* Shape/dtype/scalar checks; `float_mask` is the device's supported dtypes. */
int mmd_roi_align_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                                const mmd_tensor *output, const mmd_tensor *argmax_y,
                                const mmd_tensor *argmax_x, int64_t aligned_height,
                                int64_t aligned_width, double spatial_scale,
                                int64_t sampling_ratio, int64_t pool_mode, unsigned float_mask);
int mmd_roi_align_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                 const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
                                 const mmd_tensor *grad_input, int64_t aligned_height,
                                 int64_t aligned_width, double spatial_scale,
                                 int64_t sampling_ratio, int64_t pool_mode, unsigned float_mask);

#ifdef __cplusplus
}
#endif

/* Instantiate the typed math for float (also used for float16 on CUDA) and
 * double: mmd_roi_align_geometry_f32 / _f64, mmd_interp_axis_f32 / _f64. */
#define MMD_TYPED_FILE "mmdispatch/ops/roi_align_math.inc"
#include "mmdispatch/typed.h"

#endif
