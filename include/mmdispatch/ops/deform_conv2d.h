/* deform_conv2d (deformable convolution, DCNv1 and with a mask DCNv2,
 * torchvision semantics): the argument checks and the sampling math shared
 * by the CPU kernels (src/cpu/deform_conv2d.cpp) and the CUDA kernels
 * (src/cuda/deform_conv2d.cu).
 *
 * Output pixel (oy, ox), kernel tap (i, j) and offset group g sample the
 * input at
 *     y = oy * stride_h - pad_h + i * dilation_h + offset[n, g*2*K + 2*(i*kw + j), oy, ox]
 *     x = ox * stride_w - pad_w + j * dilation_w + offset[n, g*2*K + 2*(i*kw + j) + 1, oy, ox]
 * (K = kh * kw) by bilinear interpolation with zeros outside the map (a
 * position outside (-1, H) x (-1, W) reads 0; a NaN position reads NaN),
 * times mask[n, g*K + i*kw + j, oy, ox] when there is a mask, for every
 * input channel of offset group g (channels split evenly over the groups);
 * the output is the grouped convolution of those samples with the weight,
 * plus the bias. T, the compute type, is float or double. */
#ifndef MMDISPATCH_OPS_DEFORM_CONV2D_H
#define MMDISPATCH_OPS_DEFORM_CONV2D_H

#include <math.h>

#include "mmdispatch/bilinear.h"
#include "mmdispatch/checks.h"

/* The convolution's shape: from the input and the weight, checked. */
struct mmd_dcn_shape {
    int64_t batch, in_channels, height, width;
    int64_t out_channels, kernel_h, kernel_w, out_h, out_w;
    int64_t stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w;
    int64_t groups, offset_groups;

    MMD_HOSTDEV int64_t taps() const { return kernel_h * kernel_w; }
    MMD_HOSTDEV int64_t pixels() const { return out_h * out_w; }
    MMD_HOSTDEV int64_t channels_per_offset_group() const { return in_channels / offset_groups; }
};

/* Each of a pair of int parameters (stride, padding, dilation) in
 * [low, 2**31). */
inline int mmd_dcn_check_pair(int64_t h, int64_t w, const char *names, int64_t low) {
    if (h < low || w < low || h > INT32_MAX || w > INT32_MAX)
        return mmd_error(MMD_ERR_VALUE, "%s must be >= %lld and < 2**31, got %lld and %lld",
                         names, (long long)low, (long long)h, (long long)w);
    return MMD_OK;
}

/* The scalars, the input and the weight, and the output size they give.
 * `input` and `input_name` are input or grad_input (its shape is the
 * input's); every other array is checked against these. */
inline int mmd_dcn_check_core(const mmd_tensor *input, const char *input_name,
                              const mmd_tensor *weight, const char *weight_name,
                              int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                              int64_t dilation_h, int64_t dilation_w, int64_t groups,
                              int64_t offset_groups, unsigned float_mask, mmd_dcn_shape *d) {
    int s = mmd_dcn_check_pair(stride_h, stride_w, "stride_h and stride_w", 1);
    if (!s) s = mmd_dcn_check_pair(pad_h, pad_w, "pad_h and pad_w", 0);
    if (!s) s = mmd_dcn_check_pair(dilation_h, dilation_w, "dilation_h and dilation_w", 1);
    if (s) return s;
    if (groups < 1 || offset_groups < 1)
        return mmd_error(MMD_ERR_VALUE, "groups and offset_groups must be >= 1, got %lld and %lld",
                         (long long)groups, (long long)offset_groups);
    const int64_t any4[4] = {MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM};
    s = mmd_check_shape(input, input_name, 4, any4);
    if (!s) s = mmd_check_dtype(input, input_name, float_mask);
    if (!s) s = mmd_check_contiguous(input, input_name);
    if (!s) s = mmd_check_like(weight, weight_name, 4, any4, input, input_name);
    if (s) return s;
    const int64_t c_in = input->shape[1], c_out = weight->shape[0];
    if (c_in % groups != 0 || c_out % groups != 0)
        return mmd_error(MMD_ERR_VALUE,
                         "groups (%lld) must divide the input's channels (%lld) and the "
                         "output's (%s's first dimension, %lld)",
                         (long long)groups, (long long)c_in, weight_name, (long long)c_out);
    if (weight->shape[1] * groups != c_in)
        return mmd_error(MMD_ERR_VALUE,
                         "%s has %lld input channels per group, but %s has %lld channels in "
                         "%lld groups (%lld per group)",
                         weight_name, (long long)weight->shape[1], input_name, (long long)c_in,
                         (long long)groups, (long long)(c_in / groups));
    if (c_in % offset_groups != 0)
        return mmd_error(MMD_ERR_VALUE,
                         "offset_groups (%lld) must divide the input's channels (%lld)",
                         (long long)offset_groups, (long long)c_in);
    const int64_t kh = weight->shape[2], kw = weight->shape[3];
    if (kh < 1 || kw < 1)
        return mmd_error(MMD_ERR_VALUE, "%s's kernel must be at least 1 x 1, got %lld x %lld",
                         weight_name, (long long)kh, (long long)kw);
    const int64_t span_h = dilation_h * (kh - 1) + 1, span_w = dilation_w * (kw - 1) + 1;
    const int64_t out_h = (input->shape[2] + 2 * pad_h - span_h) / stride_h + 1;
    const int64_t out_w = (input->shape[3] + 2 * pad_w - span_w) / stride_w + 1;
    if (input->shape[2] + 2 * pad_h < span_h || input->shape[3] + 2 * pad_w < span_w)
        return mmd_error(MMD_ERR_VALUE,
                         "the padded %s (%lld x %lld) is smaller than the dilated kernel "
                         "(%lld x %lld): no output pixel",
                         input_name, (long long)(input->shape[2] + 2 * pad_h),
                         (long long)(input->shape[3] + 2 * pad_w), (long long)span_h,
                         (long long)span_w);
    *d = mmd_dcn_shape{input->shape[0], c_in, input->shape[2], input->shape[3], c_out, kh, kw,
                       out_h, out_w, stride_h, stride_w, pad_h, pad_w, dilation_h, dilation_w,
                       groups, offset_groups};
    return MMD_OK;
}

/* offset (N, 2 * offset_groups * K, out_h, out_w), mask (N, offset_groups * K,
 * out_h, out_w) or absent, like `ref`. */
inline int mmd_dcn_check_offset_mask(const mmd_tensor *offset, const char *offset_name,
                                     const mmd_tensor *mask, const char *mask_name,
                                     const mmd_tensor *ref, const char *ref_name,
                                     const mmd_dcn_shape &d) {
    const int64_t taps = d.offset_groups * d.taps();
    const int64_t offset_shape[4] = {d.batch, 2 * taps, d.out_h, d.out_w};
    int s = mmd_check_like(offset, offset_name, 4, offset_shape, ref, ref_name);
    if (!s && mask != nullptr) {
        const int64_t mask_shape[4] = {d.batch, taps, d.out_h, d.out_w};
        s = mmd_check_like(mask, mask_name, 4, mask_shape, ref, ref_name);
    }
    return s;
}

inline int mmd_deform_conv2d_forward_check(const mmd_tensor *input, const mmd_tensor *offset,
                                           const mmd_tensor *mask, const mmd_tensor *weight,
                                           const mmd_tensor *bias, const mmd_tensor *output,
                                           int64_t stride_h, int64_t stride_w, int64_t pad_h,
                                           int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
                                           int64_t groups, int64_t offset_groups,
                                           unsigned float_mask, mmd_dcn_shape *d) {
    int s = mmd_dcn_check_core(input, "input", weight, "weight", stride_h, stride_w, pad_h, pad_w,
                               dilation_h, dilation_w, groups, offset_groups, float_mask, d);
    if (!s) s = mmd_dcn_check_offset_mask(offset, "offset", mask, "mask", input, "input", *d);
    if (!s && bias != nullptr) {
        const int64_t bias_shape[1] = {d->out_channels};
        s = mmd_check_like(bias, "bias", 1, bias_shape, input, "input");
    }
    if (!s) {
        const int64_t output_shape[4] = {d->batch, d->out_channels, d->out_h, d->out_w};
        s = mmd_check_like(output, "output", 4, output_shape, input, "input");
    }
    return s;
}

inline int mmd_deform_conv2d_backward_check(
    const mmd_tensor *grad_output, const mmd_tensor *input, const mmd_tensor *offset,
    const mmd_tensor *mask, const mmd_tensor *weight, const mmd_tensor *grad_input,
    const mmd_tensor *grad_offset, const mmd_tensor *grad_mask, const mmd_tensor *grad_weight,
    const mmd_tensor *grad_bias, int64_t stride_h, int64_t stride_w, int64_t pad_h,
    int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
    int64_t offset_groups, unsigned float_mask, mmd_dcn_shape *d) {
    int s = mmd_dcn_check_core(input, "input", weight, "weight", stride_h, stride_w, pad_h, pad_w,
                               dilation_h, dilation_w, groups, offset_groups, float_mask, d);
    if (!s) s = mmd_dcn_check_offset_mask(offset, "offset", mask, "mask", input, "input", *d);
    if (s) return s;
    const int64_t output_shape[4] = {d->batch, d->out_channels, d->out_h, d->out_w};
    const int64_t mask_shape[4] = {d->batch, d->offset_groups * d->taps(), d->out_h, d->out_w};
    const int64_t bias_shape[1] = {d->out_channels};
    s = mmd_check_like(grad_output, "grad_output", 4, output_shape, input, "input");
    if (!s) s = mmd_check_like(grad_input, "grad_input", 4, input->shape, input, "input");
    if (!s) s = mmd_check_like(grad_offset, "grad_offset", 4, offset->shape, input, "input");
    if (!s) s = mmd_check_like(grad_mask, "grad_mask", 4, mask_shape, input, "input");
    if (!s) s = mmd_check_like(grad_weight, "grad_weight", 4, weight->shape, input, "input");
    if (!s) s = mmd_check_like(grad_bias, "grad_bias", 1, bias_shape, input, "input");
    return s;
}

/* Where tap (i, j) of output pixel (oy, ox) samples, before its offset. */
template <typename T>
MMD_HOSTDEV inline T mmd_dcn_base(int64_t out, int64_t tap, int64_t stride, int64_t pad,
                                  int64_t dilation) {
    return (T)(out * stride - pad + tap * dilation);
}

#endif
