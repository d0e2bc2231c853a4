/* Region-of-interest conventions shared by the roi ops (roi_align,
 * roi_pool, ps_roi_align, ps_roi_pool) on every device: rois are (K, 5)
 * rows [batch_index, x1, y1, x2, y2] of the input's dtype, and each kernel
 * validates every roi before it writes any output, reporting the first bad
 * one with these codes. */
#ifndef MMDISPATCH_OPS_ROIS_H
#define MMDISPATCH_OPS_ROIS_H

#include <math.h>
#include <stdint.h>

#include "mmdispatch/checks.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Outcome of validating one roi. */
enum {
    MMD_ROI_OK = 0,
    MMD_ROI_NONFINITE = 1,      /* NaN or inf, also after scaling */
    MMD_ROI_BAD_BATCH = 2,      /* batch index not an integer in [0, N) */
    MMD_ROI_NEGATIVE_SIZE = 3,  /* roi_align aligned=True: x2 < x1 or y2 < y1 */
    MMD_ROI_GRID_TOO_LARGE = 4, /* roi_align: too many samples per bin */
    MMD_ROI_NEGATIVE_SIDES = 5  /* roi_align_rotated aligned=True: w < 0 or h < 0 */
};

/* Samples per bin axis are capped so that a huge roi or sampling_ratio is an
 * error instead of an int overflow or an endless loop. */
#define MMD_ROI_ALIGN_MAX_GRID 32768

/* Formats the message for roi `roi_index`, rejected with `code`, and
 * returns MMD_ERR_VALUE (src/core/rois.c). */
int mmd_roi_error(int code, int64_t roi_index, int64_t batch_size);

/* The same for a roi reported as a deferred error (an mmd_deferred_format,
 * mmdispatch/deferred.h) by a call recorded with the batch size as args[0]. */
struct mmd_deferred_call;
int mmd_roi_deferred_error(const struct mmd_deferred_call *call, int64_t roi_index, int code);

/* The output size (at least 1 x 1; `size_names` names its two parameters,
 * "pooled_height and pooled_width") and spatial_scale (finite, > 0). */
static inline int mmd_roi_check_size_and_scale(int64_t height, int64_t width,
                                               const char *size_names, double spatial_scale) {
    if (height < 1 || width < 1)
        return mmd_error(MMD_ERR_VALUE, "%s must be >= 1, got %lld and %lld", size_names,
                         (long long)height, (long long)width);
    if (!(isfinite(spatial_scale) && spatial_scale > 0))
        return mmd_error(MMD_ERR_VALUE, "spatial_scale must be finite and > 0, got %g",
                         spatial_scale);
    return MMD_OK;
}

/* The feature map (input / grad_input: 4-d, one of the device's float
 * dtypes in `float_mask`) and the rois ((K, 5), the map's dtype), both
 * dense. */
static inline int mmd_roi_check_map_and_rois(const mmd_tensor *feature,
                                             const char *feature_name,
                                             const mmd_tensor *rois, unsigned float_mask) {
    const int64_t any4[4] = {MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM};
    const int64_t roi_shape[2] = {MMD_ANY_DIM, 5};
    int s = mmd_check_shape(feature, feature_name, 4, any4);
    if (!s) s = mmd_check_dtype(feature, feature_name, float_mask);
    if (!s) s = mmd_check_contiguous(feature, feature_name);
    if (!s) s = mmd_check_like(rois, "rois", 2, roi_shape, feature, feature_name);
    return s;
}

#ifdef __cplusplus
}

/* Validates every roi of a host call before anything is written: `call`
 * has num_rois, batch and geometry(k, &g), which fills a Geometry and
 * returns an MMD_ROI_* code. */
template <typename Geometry, typename Call> inline int mmd_check_rois(const Call &call) {
    for (int64_t k = 0; k < call.num_rois; ++k) {
        Geometry g{};
        const int code = call.geometry(k, &g);
        if (code != MMD_ROI_OK) return mmd_roi_error(code, k, call.batch);
    }
    return MMD_OK;
}
#endif
#endif
