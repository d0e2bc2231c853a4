/* ps_roi_pool (R-FCN position-sensitive RoIPool, torchvision semantics):
 * the argument checks and the math shared by the CPU kernels
 * (src/cpu/ps_roi_pool.cpp) and the CUDA kernels (src/cuda/ps_roi_pool.cu).
 *
 * Roi corners are scaled and rounded to the nearest integer (halves away
 * from zero); the roi spans max(end - start, 1) cells per axis; bin k covers
 * [floor(k * bin), ceil((k + 1) * bin)) from the roi start, clipped to
 * [0, size - 1], so that, as in torchvision, the map's last row and column
 * are never pooled. A bin's output is the mean of its cells (NaN if one is
 * NaN), 0 for an empty bin; bin (ph, pw) of output channel c_out reads input
 * channel (c_out * pooled_h + ph) * pooled_w + pw (ps_rois.h). T, the
 * compute type, is float or double. */
#ifndef MMDISPATCH_OPS_PS_ROI_POOL_H
#define MMDISPATCH_OPS_PS_ROI_POOL_H

#include "mmdispatch/ops/ps_rois.h"
#include "mmdispatch/ops/roi_pool.h"

/* Validates one roi ([batch, x1, y1, x2, y2]) and computes its geometry.
 * Returns MMD_ROI_OK or the reason it is rejected. */
template <typename T>
MMD_HOSTDEV inline int mmd_ps_roi_pool_geometry(const T roi[5], int64_t batch_size,
                                                T spatial_scale, int64_t pooled_h,
                                                int64_t pooled_w, mmd_pool_geometry<T> *g) {
    for (int i = 0; i < 5; ++i)
        if (!isfinite(roi[i])) return MMD_ROI_NONFINITE;
    if (!(roi[0] >= 0 && roi[0] < (T)batch_size && roi[0] == floor(roi[0])))
        return MMD_ROI_BAD_BATCH;
    const T x1 = round(roi[1] * spatial_scale), y1 = round(roi[2] * spatial_scale);
    const T x2 = round(roi[3] * spatial_scale), y2 = round(roi[4] * spatial_scale);
    T width = x2 - x1, height = y2 - y1;
    if (!(isfinite(width) && isfinite(height))) return MMD_ROI_NONFINITE;
    width = width > 1 ? width : (T)1;
    height = height > 1 ? height : (T)1;
    g->batch = (int64_t)roi[0];
    g->start_w = x1;
    g->start_h = y1;
    g->bin_w = width / (T)pooled_w;
    g->bin_h = height / (T)pooled_h;
    return MMD_ROI_OK;
}

/* Cells [*lo, *hi) of bin `index` along an axis of `size` cells (clipped to
 * size - 1, see above; an empty range when *hi <= *lo). */
template <typename T>
MMD_HOSTDEV inline void mmd_ps_roi_pool_bin(T start, T bin, int64_t index, int64_t size,
                                            int64_t *lo, int64_t *hi) {
    mmd_roi_pool_bin(start, bin, false, index, size > 0 ? size - 1 : 0, lo, hi);
}

#endif
