/* roi_align_rotated (MMCV's semantics): the argument checks and the
 * sampling geometry shared by the CPU kernels
 * (src/cpu/roi_align_rotated.cpp) and the CUDA kernels
 * (src/cuda/roi_align_rotated.cu).
 *
 * rois are (K, 6) rows [batch_index, cx, cy, w, h, angle in radians]. With
 * s = spatial_scale and o = 0.5 when aligned (else 0), the roi's centre is
 * (cx * s - o, cy * s - o) and its sides w * s and h * s (at least 1 each
 * when not aligned; negative sides are an error when aligned). Its
 * pooled_height x pooled_width bins are laid over the unrotated roi, each
 * sampled on a grid_h x grid_w grid (sampling_ratio, or when it is <= 0
 * ceil(side / pooled size)), and every sample point is turned about the
 * centre by theta = angle (counter-clockwise in image coordinates), or
 * -angle when `clockwise`:
 *     y = yy cos(theta) - xx sin(theta) + centre_y
 *     x = yy sin(theta) + xx cos(theta) + centre_x
 * for the offsets (yy, xx) from the centre. Each sample is MMCV's bilinear
 * interpolation (roi_align.h's mmd_interp: 0 outside [-1, H] x [-1, W]);
 * a bin is the mean of its samples. */
#ifndef MMDISPATCH_OPS_ROI_ALIGN_ROTATED_H
#define MMDISPATCH_OPS_ROI_ALIGN_ROTATED_H

#include <math.h>

#include "mmdispatch/ops/roi_align.h"
#include "mmdispatch/ops/rois.h"

/* `map` is input (forward) or grad_input (backward), `pooled` output or
 * grad_output. */
inline int mmd_roi_align_rotated_check(const mmd_tensor *map, const char *map_name,
                                       const mmd_tensor *rois, const mmd_tensor *pooled,
                                       const char *pooled_name, int64_t pooled_height,
                                       int64_t pooled_width, double spatial_scale,
                                       unsigned float_mask) {
    int s = mmd_roi_check_size_and_scale(pooled_height, pooled_width,
                                         "pooled_height and pooled_width", spatial_scale);
    if (s) return s;
    const int64_t any4[4] = {MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM};
    const int64_t roi_shape[2] = {MMD_ANY_DIM, 6};
    s = mmd_check_shape(map, map_name, 4, any4);
    if (!s) s = mmd_check_dtype(map, map_name, float_mask);
    if (!s) s = mmd_check_contiguous(map, map_name);
    if (!s) s = mmd_check_like(rois, "rois", 2, roi_shape, map, map_name);
    if (s) return s;
    const int64_t out_shape[4] = {rois->shape[0], map->shape[1], pooled_height, pooled_width};
    return mmd_check_like(pooled, pooled_name, 4, out_shape, map, map_name);
}

/* One roi's sampling geometry. */
template <typename T> struct mmd_rotated_roi {
    int64_t batch;
    T centre_h, centre_w, start_h, start_w, bin_h, bin_w, cos_theta, sin_theta;
    int64_t grid_h, grid_w;

    /* sample (iy, ix) of bin (ph, pw), in map coordinates */
    MMD_HOSTDEV void sample(int64_t ph, int64_t pw, int64_t iy, int64_t ix, T *y, T *x) const {
        const T yy = mmd_roi_align_sample(start_h, bin_h, ph, iy, grid_h);
        const T xx = mmd_roi_align_sample(start_w, bin_w, pw, ix, grid_w);
        *y = yy * cos_theta - xx * sin_theta + centre_h;
        *x = yy * sin_theta + xx * cos_theta + centre_w;
    }
    MMD_HOSTDEV int64_t count() const {
        return grid_h * grid_w > 0 ? grid_h * grid_w : 1;
    }
};

/* Validates roi [batch, cx, cy, w, h, angle] and computes its geometry;
 * MMD_ROI_OK or the reason it is rejected. */
template <typename T>
MMD_HOSTDEV inline int mmd_roi_align_rotated_geometry(const T roi[6], int64_t batch_size,
                                                      T spatial_scale, int64_t pooled_h,
                                                      int64_t pooled_w, int64_t sampling_ratio,
                                                      int aligned, int clockwise,
                                                      mmd_rotated_roi<T> *g) {
    for (int i = 0; i < 6; ++i)
        if (!isfinite(roi[i])) return MMD_ROI_NONFINITE;
    if (mmd_roi_batch(roi[0], batch_size, &g->batch) != MMD_ROI_OK) return MMD_ROI_BAD_BATCH;
    const T offset = aligned ? (T)0.5 : (T)0;
    g->centre_w = roi[1] * spatial_scale - offset;
    g->centre_h = roi[2] * spatial_scale - offset;
    T roi_w = roi[3] * spatial_scale, roi_h = roi[4] * spatial_scale;
    if (!(isfinite(g->centre_w) && isfinite(g->centre_h) && isfinite(roi_w) && isfinite(roi_h)))
        return MMD_ROI_NONFINITE;
    if (aligned) {
        if (roi_w < 0 || roi_h < 0) return MMD_ROI_NEGATIVE_SIDES;
    } else {
        roi_w = roi_w > 1 ? roi_w : (T)1;
        roi_h = roi_h > 1 ? roi_h : (T)1;
    }
    const T theta = clockwise ? -roi[5] : roi[5];
    g->cos_theta = cos(theta);
    g->sin_theta = sin(theta);
    g->start_h = -roi_h / 2;
    g->start_w = -roi_w / 2;
    g->bin_h = roi_h / (T)pooled_h;
    g->bin_w = roi_w / (T)pooled_w;
    return mmd_roi_grid(g->bin_h, g->bin_w, sampling_ratio, &g->grid_h, &g->grid_w);
}

#endif
