/* ps_roi_align (R-FCN position-sensitive RoIAlign, torchvision semantics):
 * the argument checks and the math shared by the CPU kernels
 * (src/cpu/ps_roi_align.cpp) and the CUDA kernels (src/cuda/ps_roi_align.cu).
 *
 * It is roi_align with aligned=True in avg mode (roi_align.h: corners
 * scaled and shifted by -0.5, sampling_ratio samples per bin axis or
 * ceil(bin size) when <= 0, bilinear interpolation, the mean of a bin's
 * samples), except that bin (ph, pw) of output channel c_out reads input
 * channel (c_out * pooled_h + ph) * pooled_w + pw (ps_rois.h). A roi with
 * x2 < x1 or y2 < y1 is rejected, as roi_align's aligned mode rejects it; a
 * bin with no samples (an empty roi with adaptive sampling) is 0. T, the
 * compute type, is float or double. */
#ifndef MMDISPATCH_OPS_PS_ROI_ALIGN_H
#define MMDISPATCH_OPS_PS_ROI_ALIGN_H

#include "mmdispatch/ops/ps_rois.h"
#include "mmdispatch/ops/roi_align.h"

inline int mmd_ps_roi_align_check_sampling(int64_t sampling_ratio) {
    if (sampling_ratio > MMD_ROI_ALIGN_MAX_GRID)
        return mmd_error(MMD_ERR_VALUE, "sampling_ratio must be <= %d, got %lld",
                         MMD_ROI_ALIGN_MAX_GRID, (long long)sampling_ratio);
    return MMD_OK;
}

inline int mmd_ps_roi_align_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                                          const mmd_tensor *output, int64_t pooled_height,
                                          int64_t pooled_width, double spatial_scale,
                                          int64_t sampling_ratio, unsigned float_mask) {
    int s = mmd_ps_roi_forward_check(input, rois, output, pooled_height, pooled_width,
                                     spatial_scale, float_mask);
    return s ? s : mmd_ps_roi_align_check_sampling(sampling_ratio);
}

inline int mmd_ps_roi_align_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                           const mmd_tensor *grad_input, int64_t pooled_height,
                                           int64_t pooled_width, double spatial_scale,
                                           int64_t sampling_ratio, unsigned float_mask) {
    int s = mmd_ps_roi_backward_check(grad_output, rois, grad_input, pooled_height, pooled_width,
                                      spatial_scale, float_mask);
    return s ? s : mmd_ps_roi_align_check_sampling(sampling_ratio);
}

/* Validates one roi and computes its geometry (roi_align's, aligned). */
template <typename T>
MMD_HOSTDEV inline int mmd_ps_roi_align_geometry(const T roi[5], int64_t batch_size,
                                                 T spatial_scale, int64_t pooled_h,
                                                 int64_t pooled_w, int64_t sampling_ratio,
                                                 mmd_roi_geometry<T> *g) {
    return mmd_roi_align_geometry(roi, batch_size, spatial_scale, pooled_h, pooled_w,
                                  sampling_ratio, 1, g);
}

/* One sample of a bin: the value at (y, x) of `plane`, interpolated from
 * the axes' weights in torchvision's order of operations. */
template <typename T, typename V>
MMD_HOSTDEV inline T mmd_ps_roi_align_bilinear(const V *plane, int64_t width,
                                               const mmd_interp_axis<T> &ay,
                                               const mmd_interp_axis<T> &ax) {
    return ay.w_low * ax.w_low * (T)plane[ay.low * width + ax.low] +
           ay.w_low * ax.w_high * (T)plane[ay.low * width + ax.high] +
           ay.w_high * ax.w_low * (T)plane[ay.high * width + ax.low] +
           ay.w_high * ax.w_high * (T)plane[ay.high * width + ax.high];
}

#endif
