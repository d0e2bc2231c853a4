/* Position-sensitive roi ops (R-FCN: ps_roi_align, ps_roi_pool), on every
 * device. The input's C channels hold C_out groups of pooled_h * pooled_w
 * channels: output bin (ph, pw) of output channel c_out reads input channel
 * (c_out * pooled_h + ph) * pooled_w + pw, and only it (torchvision's
 * channel_mapping, which is therefore computed, never stored). Rois are the
 * roi ops' (K, 5) rows, see rois.h. */
#ifndef MMDISPATCH_OPS_PS_ROIS_H
#define MMDISPATCH_OPS_PS_ROIS_H

#include <math.h>

#include "mmdispatch/checks.h"
#include "mmdispatch/ops/rois.h"

/* The input channel that bin (ph, pw) of output channel c_out reads. */
MMD_HOSTDEV inline int64_t mmd_ps_channel(int64_t c_out, int64_t ph, int64_t pw, int64_t pooled_h,
                                          int64_t pooled_w) {
    return (c_out * pooled_h + ph) * pooled_w + pw;
}

/* Output element `index` of a (K, C_out, pooled_h, pooled_w) array. */
struct mmd_ps_bin {
    int64_t k, c_out, ph, pw;
    MMD_HOSTDEV mmd_ps_bin(int64_t index, int64_t c_out_count, int64_t pooled_h, int64_t pooled_w)
        : k(index / pooled_w / pooled_h / c_out_count),
          c_out((index / pooled_w / pooled_h) % c_out_count),
          ph((index / pooled_w) % pooled_h),
          pw(index % pooled_w) {}
};

/* Forward and backward take the same arrays under different names: a
 * feature map (input / grad_input) of C channels, the rois and a pooled
 * array (output / grad_output) of shape (K, C / (pooled_h * pooled_w),
 * pooled_h, pooled_w). */
inline int mmd_ps_roi_check_arrays(const mmd_tensor *feature, const char *feature_name,
                                   const mmd_tensor *rois, const mmd_tensor *pooled,
                                   const char *pooled_name, int64_t pooled_height,
                                   int64_t pooled_width, double spatial_scale,
                                   unsigned float_mask) {
    int s = mmd_roi_check_size_and_scale(pooled_height, pooled_width,
                                         "pooled_height and pooled_width", spatial_scale);
    if (s) return s;
    if (pooled_height > INT32_MAX / pooled_width)
        return mmd_error(MMD_ERR_VALUE,
                         "pooled_height * pooled_width must be < 2**31, got %lld * %lld",
                         (long long)pooled_height, (long long)pooled_width);
    s = mmd_roi_check_map_and_rois(feature, feature_name, rois, float_mask);
    if (s) return s;
    const int64_t group = pooled_height * pooled_width;
    if (feature->shape[1] % group != 0)
        return mmd_error(MMD_ERR_VALUE,
                         "%s has %lld channels, which must be a multiple of pooled_height * "
                         "pooled_width = %lld (one channel per bin of each output channel)",
                         feature_name, (long long)feature->shape[1], (long long)group);
    const int64_t pooled_shape[4] = {rois->shape[0], feature->shape[1] / group, pooled_height,
                                     pooled_width};
    return mmd_check_like(pooled, pooled_name, 4, pooled_shape, feature, feature_name);
}

inline int mmd_ps_roi_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                                    const mmd_tensor *output, int64_t pooled_height,
                                    int64_t pooled_width, double spatial_scale,
                                    unsigned float_mask) {
    return mmd_ps_roi_check_arrays(input, "input", rois, output, "output", pooled_height,
                                   pooled_width, spatial_scale, float_mask);
}

inline int mmd_ps_roi_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                     const mmd_tensor *grad_input, int64_t pooled_height,
                                     int64_t pooled_width, double spatial_scale,
                                     unsigned float_mask) {
    /* dtypes are reported against grad_output, which the user passed (the op
     * layer allocates grad_input like it) */
    int s = mmd_check_dtype(grad_output, "grad_output", float_mask);
    if (!s) s = mmd_check_same_dtype(rois, "rois", grad_output, "grad_output");
    if (!s) s = mmd_ps_roi_check_arrays(grad_input, "grad_input", rois, grad_output,
                                        "grad_output", pooled_height, pooled_width,
                                        spatial_scale, float_mask);
    return s;
}

#endif
