/* roi_align: the argument checks and the per-roi / per-sample math shared
 * by the CPU kernels (src/cpu/roi_align*.cpp) and the CUDA kernels
 * (src/cuda/roi_align.cu), so both devices compute the same thing.
 * Semantics follow MMCV / Detectron2 RoIAlign. T, the compute type, is
 * float or double. */
#ifndef MMDISPATCH_OPS_ROI_ALIGN_H
#define MMDISPATCH_OPS_ROI_ALIGN_H

#include <math.h>

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/rois.h"

enum { MMD_POOL_MAX = 0, MMD_POOL_AVG = 1 };

inline int mmd_roi_align_check_scalars(int64_t aligned_height, int64_t aligned_width,
                                       double spatial_scale, int64_t sampling_ratio,
                                       int64_t pool_mode) {
    const int s = mmd_roi_check_size_and_scale(aligned_height, aligned_width,
                                               "aligned_height and aligned_width", spatial_scale);
    if (s) return s;
    if (sampling_ratio > MMD_ROI_ALIGN_MAX_GRID)
        return mmd_error(MMD_ERR_VALUE, "sampling_ratio must be <= %d, got %lld",
                         MMD_ROI_ALIGN_MAX_GRID, (long long)sampling_ratio);
    if (pool_mode != MMD_POOL_MAX && pool_mode != MMD_POOL_AVG)
        return mmd_error(MMD_ERR_VALUE, "pool_mode must be 0 (max) or 1 (avg), got %lld",
                         (long long)pool_mode);
    return MMD_OK;
}

/* Forward and backward take the same arrays under different names: a
 * feature map (input / grad_input), the rois, a pooled array (output /
 * grad_output) and the argmax pair, which are pooled-shaped in max mode
 * and in avg mode unused and may also be empty. */
inline int mmd_roi_align_check_arrays(const mmd_tensor *feature, const char *feature_name,
                                      const mmd_tensor *rois, const mmd_tensor *pooled,
                                      const char *pooled_name, const mmd_tensor *argmax_y,
                                      const mmd_tensor *argmax_x, int64_t aligned_height,
                                      int64_t aligned_width, double spatial_scale,
                                      int64_t sampling_ratio, int64_t pool_mode,
                                      unsigned float_mask) {
    int s = mmd_roi_align_check_scalars(aligned_height, aligned_width, spatial_scale,
                                        sampling_ratio, pool_mode);
    if (!s) s = mmd_roi_check_map_and_rois(feature, feature_name, rois, float_mask);
    if (s) return s;
    const int64_t pooled_shape[4] = {rois->shape[0], feature->shape[1], aligned_height,
                                     aligned_width};
    s = mmd_check_like(pooled, pooled_name, 4, pooled_shape, feature, feature_name);
    const mmd_tensor *argmax[2] = {argmax_y, argmax_x};
    const char *argmax_name[2] = {"argmax_y", "argmax_x"};
    for (int i = 0; i < 2 && !s; ++i)
        if (pool_mode != MMD_POOL_AVG || mmd_numel(argmax[i]) != 0)
            s = mmd_check_like(argmax[i], argmax_name[i], 4, pooled_shape, feature,
                                         feature_name);
    return s;
}

/* Shape/dtype/scalar checks; `float_mask` is the device's supported dtypes. */
inline int mmd_roi_align_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                                       const mmd_tensor *output, const mmd_tensor *argmax_y,
                                       const mmd_tensor *argmax_x, int64_t aligned_height,
                                       int64_t aligned_width, double spatial_scale,
                                       int64_t sampling_ratio, int64_t pool_mode,
                                       unsigned float_mask) {
    return mmd_roi_align_check_arrays(input, "input", rois, output, "output", argmax_y,
                                      argmax_x, aligned_height, aligned_width, spatial_scale,
                                      sampling_ratio, pool_mode, float_mask);
}

inline int mmd_roi_align_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                        const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
                                        const mmd_tensor *grad_input, int64_t aligned_height,
                                        int64_t aligned_width, double spatial_scale,
                                        int64_t sampling_ratio, int64_t pool_mode,
                                        unsigned float_mask) {
    /* dtypes are reported against grad_output, which the user passed (the op
     * layer allocates grad_input like it) */
    int s = mmd_check_dtype(grad_output, "grad_output", float_mask);
    if (!s) s = mmd_check_same_dtype(rois, "rois", grad_output, "grad_output");
    if (!s) s = mmd_roi_align_check_arrays(grad_input, "grad_input", rois, grad_output,
                                           "grad_output", argmax_y, argmax_x, aligned_height,
                                           aligned_width, spatial_scale, sampling_ratio,
                                           pool_mode, float_mask);
    return s;
}

/* Where one roi's bins and samples are, in input-map coordinates. */
template <typename T> struct mmd_roi_geometry {
    int64_t batch;
    T start_h, start_w;
    T bin_h, bin_w;
    int64_t grid_h, grid_w;   /* samples per bin along each axis */
};

/* Linear interpolation along one axis: the sample reads `low` with weight
 * `w_low` and `high` with `w_high`. The 2-D bilinear weights of MMCV are the
 * products of the two axes' weights, so rows and columns are computed once. */
template <typename T> struct mmd_interp_axis {
    int64_t low, high;
    T w_low, w_high;
    int valid;   /* 0: sample outside [-1, size]; it contributes 0 */
};

/* A roi's batch index (its first value, finite) as an integer in
 * [0, batch_size): MMD_ROI_OK, or MMD_ROI_BAD_BATCH. */
template <typename T>
MMD_HOSTDEV inline int mmd_roi_batch(T value, int64_t batch_size, int64_t *batch) {
    if (!(value >= 0 && value < (T)batch_size && value == floor(value))) return MMD_ROI_BAD_BATCH;
    *batch = (int64_t)value;
    return MMD_ROI_OK;
}

/* Samples per bin axis: sampling_ratio, or when it is <= 0 the ceiling of
 * the bin's size; MMD_ROI_OK, or MMD_ROI_GRID_TOO_LARGE past the cap. */
template <typename T>
MMD_HOSTDEV inline int mmd_roi_grid(T bin_h, T bin_w, int64_t sampling_ratio, int64_t *grid_h,
                                    int64_t *grid_w) {
    const T h = sampling_ratio > 0 ? (T)sampling_ratio : ceil(bin_h);
    const T w = sampling_ratio > 0 ? (T)sampling_ratio : ceil(bin_w);
    if (!(h <= MMD_ROI_ALIGN_MAX_GRID && w <= MMD_ROI_ALIGN_MAX_GRID))
        return MMD_ROI_GRID_TOO_LARGE;
    *grid_h = (int64_t)h;
    *grid_w = (int64_t)w;
    return MMD_ROI_OK;
}

/* Validates one roi ([batch, x1, y1, x2, y2]) and computes its geometry.
 * Returns MMD_ROI_OK or the reason it is rejected. */
template <typename T>
MMD_HOSTDEV inline int mmd_roi_align_geometry(const T roi[5], int64_t batch_size, T spatial_scale,
                                              int64_t pooled_h, int64_t pooled_w,
                                              int64_t sampling_ratio, int aligned,
                                              mmd_roi_geometry<T> *g) {
    for (int i = 0; i < 5; ++i)
        if (!isfinite(roi[i])) return MMD_ROI_NONFINITE;
    if (mmd_roi_batch(roi[0], batch_size, &g->batch) != MMD_ROI_OK) return MMD_ROI_BAD_BATCH;
    const T offset = aligned ? (T)0.5 : (T)0;
    g->start_w = roi[1] * spatial_scale - offset;
    g->start_h = roi[2] * spatial_scale - offset;
    T roi_w = roi[3] * spatial_scale - offset - g->start_w;
    T roi_h = roi[4] * spatial_scale - offset - g->start_h;
    if (aligned) {
        if (roi_w < 0 || roi_h < 0) return MMD_ROI_NEGATIVE_SIZE;
    } else {
        /* legacy (Detectron v1) mode: force malformed rois to be 1x1 */
        roi_w = roi_w > 1 ? roi_w : (T)1;
        roi_h = roi_h > 1 ? roi_h : (T)1;
    }
    g->bin_h = roi_h / (T)pooled_h;
    g->bin_w = roi_w / (T)pooled_w;
    return mmd_roi_grid(g->bin_h, g->bin_w, sampling_ratio, &g->grid_h, &g->grid_w);
}

/* Where bin `bin_index` begins along one axis. */
template <typename T>
MMD_HOSTDEV inline T mmd_roi_align_bin_start(T start, T bin, int64_t bin_index) {
    return start + (T)bin_index * bin;
}

/* Coordinate of sample `i` of the bin that begins at `bin_start`. */
template <typename T>
MMD_HOSTDEV inline T mmd_roi_align_bin_sample(T bin_start, T bin, int64_t i, int64_t grid) {
    return bin_start + ((T)i + (T)0.5) * bin / (T)grid;
}

/* Coordinate of sample `i` of bin `bin_index` along one axis. */
template <typename T>
MMD_HOSTDEV inline T mmd_roi_align_sample(T start, T bin, int64_t bin_index, int64_t i,
                                          int64_t grid) {
    return mmd_roi_align_bin_sample(mmd_roi_align_bin_start(start, bin, bin_index), bin, i, grid);
}

/* MMCV's bilinear_interpolate, one axis at a time; `size` is H or W.
 * The range test is written so that NaN is rejected too. */
template <typename T> MMD_HOSTDEV inline void mmd_interp(T v, int64_t size, mmd_interp_axis<T> *a) {
    if (!(v >= (T)-1 && v <= (T)size) || size <= 0) {
        a->low = a->high = 0;
        a->w_low = a->w_high = 0;
        a->valid = 0;
        return;
    }
    if (v <= 0) v = 0;
    int64_t low = (int64_t)v;
    int64_t high;
    if (low >= size - 1) {
        low = high = size - 1;
        v = (T)low;
    } else {
        high = low + 1;
    }
    a->low = low;
    a->high = high;
    a->w_high = v - (T)low;
    a->w_low = (T)1 - a->w_high;
    a->valid = 1;
}

/* Max pooling over a bin's samples. Out-of-map samples count as 0, as in
 * MMCV; NaN samples are skipped, and if no sample is taken (empty grid, or
 * every sample NaN) the bin is 0 (or NaN) with argmax -1. */
template <typename T> struct mmd_max_state {
    T best, y, x;
    int found, saw_nan;
};

template <typename T> MMD_HOSTDEV inline void mmd_max_init(mmd_max_state<T> *s) {
    s->best = 0;
    s->y = s->x = (T)-1;
    s->found = s->saw_nan = 0;
}

template <typename T>
MMD_HOSTDEV inline void mmd_max_update(mmd_max_state<T> *s, T v, T y, T x) {
    if (v != v) {
        s->saw_nan = 1;
    } else if (!s->found || v > s->best) {
        s->found = 1;
        s->best = v;
        s->y = y;
        s->x = x;
    }
}

template <typename T> MMD_HOSTDEV inline T mmd_max_value(const mmd_max_state<T> *s) {
    return s->found ? s->best : (s->saw_nan ? (T)NAN : (T)0);
}

#endif
