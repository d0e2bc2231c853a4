/* roi_pool (Fast R-CNN RoIPool): the argument checks and the per-roi math
 * shared by the CPU kernels (src/cpu/roi_pool.cpp) and the CUDA kernels
 * (src/cuda/roi_pool.cu). `convention` says how a roi's corners map to
 * cells:
 *
 * - MMD_ROI_POOL_TORCHVISION (torchvision's, Caffe's Fast R-CNN): corners
 *   scaled and rounded to the nearest integer (halves away from zero); the
 *   roi spans max(end - start + 1, 1) cells per axis; bin k covers
 *   [floor(k * bin), ceil((k + 1) * bin)) from the roi start.
 * - MMD_ROI_POOL_MMCV (mmcv.ops.roi_pool's CUDA kernel, MMCV's only one):
 *   x1 * scale to (x2 + 1) * scale, not rounded (y alike); a roi of width
 *   or height <= 0 has only empty bins; bin k covers [floor(start + k *
 *   bin), ceil(start + (k + 1) * bin)). The arithmetic is what nvcc makes
 *   of MMCV's kernel (read off its SASS, sm_90): the width (x2 + 1) *
 *   scale - x1 * scale and each bin edge are fused multiply-adds, and the
 *   edges are rounded to float before floor / ceil (floorf, ceilf), for
 *   double too. MMCV's float16 kernel rounds every step to half; ours
 *   computes float16 in float32.
 *
 * Bins are clipped to the map. A bin's output is its maximum and argmax the
 * flat h * W + w index of it; NaN values are skipped, an empty bin gives 0
 * and a bin of only NaN gives NaN, both with argmax -1 (no gradient; MMCV
 * leaves argmax 0 for a roi of no width, and so sends its gradient to cell
 * 0). T, the compute type, is float or double. */
#ifndef MMDISPATCH_OPS_ROI_POOL_H
#define MMDISPATCH_OPS_ROI_POOL_H

#include <math.h>

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/rois.h"

enum { MMD_ROI_POOL_TORCHVISION = 0, MMD_ROI_POOL_MMCV = 1 };

/* Forward and backward take the same arrays under different names: a
 * feature map (input / grad_input), the rois, a pooled array (output /
 * grad_output) and argmax. */
inline int mmd_roi_pool_check_arrays(const mmd_tensor *feature, const char *feature_name,
                                     const mmd_tensor *rois, const mmd_tensor *pooled,
                                     const char *pooled_name, const mmd_tensor *argmax,
                                     int64_t pooled_height, int64_t pooled_width,
                                     double spatial_scale, int64_t convention,
                                     unsigned float_mask) {
    if (convention != MMD_ROI_POOL_TORCHVISION && convention != MMD_ROI_POOL_MMCV)
        return mmd_error(MMD_ERR_VALUE, "convention must be %d (torchvision's) or %d (MMCV's), "
                         "got %lld", MMD_ROI_POOL_TORCHVISION, MMD_ROI_POOL_MMCV,
                         (long long)convention);
    int s = mmd_roi_check_size_and_scale(pooled_height, pooled_width,
                                         "pooled_height and pooled_width", spatial_scale);
    if (!s) s = mmd_roi_check_map_and_rois(feature, feature_name, rois, float_mask);
    if (s) return s;
    const int64_t pooled_shape[4] = {rois->shape[0], feature->shape[1], pooled_height,
                                     pooled_width};
    s = mmd_check_like(pooled, pooled_name, 4, pooled_shape, feature, feature_name);
    if (!s) s = mmd_check_shape(argmax, "argmax", 4, pooled_shape);
    if (!s) s = mmd_check_dtype(argmax, "argmax", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(argmax, "argmax");
    return s;
}

/* Shape/dtype/scalar checks; `float_mask` is the device's supported dtypes. */
inline int mmd_roi_pool_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                                      const mmd_tensor *output, const mmd_tensor *argmax,
                                      int64_t pooled_height, int64_t pooled_width,
                                      double spatial_scale, int64_t convention,
                                      unsigned float_mask) {
    return mmd_roi_pool_check_arrays(input, "input", rois, output, "output", argmax,
                                     pooled_height, pooled_width, spatial_scale, convention,
                                     float_mask);
}

inline int mmd_roi_pool_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                       const mmd_tensor *argmax, const mmd_tensor *grad_input,
                                       int64_t pooled_height, int64_t pooled_width,
                                       double spatial_scale, int64_t convention,
                                       unsigned float_mask) {
    /* dtypes are reported against grad_output, which the user passed (the op
     * layer allocates grad_input like it) */
    int s = mmd_check_dtype(grad_output, "grad_output", float_mask);
    if (!s) s = mmd_check_same_dtype(rois, "rois", grad_output, "grad_output");
    if (!s) s = mmd_roi_pool_check_arrays(grad_input, "grad_input", rois, grad_output,
                                          "grad_output", argmax, pooled_height, pooled_width,
                                          spatial_scale, convention, float_mask);
    return s;
}

/* Message for an argmax entry outside [-1, H * W) (backward). */
inline int mmd_roi_pool_argmax_error(int64_t flat_index, int64_t value, int64_t plane_size) {
    return mmd_error(MMD_ERR_VALUE,
                     "argmax holds %lld at flat index %lld; entries must be -1 or in [0, %lld) "
                     "(H * W of grad_input)",
                     (long long)value, (long long)flat_index, (long long)plane_size);
}

/* One roi's geometry along each axis (mmd_roi_pool_bin): bin k starts at
 * floor(k * bin) + start cells (torchvision's: start its rounded corner),
 * or with `mmcv` at floor(start + k * bin) (MMCV's: its scaled corner). */
template <typename T> struct mmd_pool_geometry {
    int64_t batch;
    T start_h, start_w;
    T bin_h, bin_w;
    bool mmcv;
};

/* Validates one roi ([batch, x1, y1, x2, y2]) and computes its geometry.
 * Returns MMD_ROI_OK or the reason it is rejected. */
template <typename T>
MMD_HOSTDEV inline int mmd_roi_pool_geometry(const T roi[5], int64_t batch_size, T spatial_scale,
                                             int64_t pooled_h, int64_t pooled_w,
                                             int64_t convention, mmd_pool_geometry<T> *g) {
    for (int i = 0; i < 5; ++i)
        if (!isfinite(roi[i])) return MMD_ROI_NONFINITE;
    if (!(roi[0] >= 0 && roi[0] < (T)batch_size && roi[0] == floor(roi[0])))
        return MMD_ROI_BAD_BATCH;
    g->batch = (int64_t)roi[0];
    if (convention == MMD_ROI_POOL_MMCV) {
        const T x1 = roi[1] * spatial_scale, y1 = roi[2] * spatial_scale;
        const T width = fma(roi[3] + 1, spatial_scale, -x1);
        const T height = fma(roi[4] + 1, spatial_scale, -y1);
        if (!(isfinite(width) && isfinite(height))) return MMD_ROI_NONFINITE;
        g->mmcv = true;
        if (width > 0 && height > 0) {
            g->start_w = x1;
            g->start_h = y1;
            g->bin_w = width / (T)pooled_w;
            g->bin_h = height / (T)pooled_h;
        } else {   /* every bin [0, 0): empty */
            g->start_w = g->start_h = g->bin_w = g->bin_h = 0;
        }
        return MMD_ROI_OK;
    }
    const T x1 = round(roi[1] * spatial_scale), y1 = round(roi[2] * spatial_scale);
    const T x2 = round(roi[3] * spatial_scale), y2 = round(roi[4] * spatial_scale);
    T width = x2 - x1 + 1, height = y2 - y1 + 1;
    if (!(isfinite(width) && isfinite(height))) return MMD_ROI_NONFINITE;
    width = width > 1 ? width : (T)1;
    height = height > 1 ? height : (T)1;
    g->start_w = x1;
    g->start_h = y1;
    g->mmcv = false;
    g->bin_w = width / (T)pooled_w;
    g->bin_h = height / (T)pooled_h;
    return MMD_ROI_OK;
}

/* Cells [*lo, *hi) of bin `index` along an axis of `size` cells; clipped in
 * floating point first, so huge rois cannot overflow the integer cast, and
 * again after it: (T)size rounds up for float sizes above 2^24. */
template <typename T>
MMD_HOSTDEV inline void mmd_roi_pool_bin(T start, T bin, bool mmcv, int64_t index, int64_t size,
                                         int64_t *lo, int64_t *hi) {
    T a, b;
    if (mmcv) {
        a = floor((T)(float)fma((T)index, bin, start));
        b = ceil((T)(float)fma((T)(index + 1), bin, start));
    } else {
        a = floor((T)index * bin) + start;
        b = ceil((T)(index + 1) * bin) + start;
    }
    const T top = (T)size;
    a = a < 0 ? (T)0 : (a > top ? top : a);
    b = b < 0 ? (T)0 : (b > top ? top : b);
    *lo = (int64_t)a < size ? (int64_t)a : size;
    *hi = (int64_t)b < size ? (int64_t)b : size;
}

#endif
