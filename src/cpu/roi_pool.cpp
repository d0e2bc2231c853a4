/* roi_pool on CPU. Forward splits (roi, channel) planes over the worker
 * pool; backward gives each worker whole channels and visits rois in order,
 * so it is race-free and deterministic. */
#include "mmdispatch/ops/roi_pool.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

/* Validates every roi before anything is written. */
template <typename T>
int check_rois(const mmd_tensor *rois, int64_t batch, T spatial_scale, int64_t pooled_h,
               int64_t pooled_w) {
    const T *r = (const T *)rois->data;
    for (int64_t k = 0; k < rois->shape[0]; ++k) {
        mmd_pool_geometry<T> g{};
        int code = mmd_roi_pool_geometry(r + 5 * k, batch, spatial_scale, pooled_h, pooled_w, &g);
        if (code != MMD_ROI_OK) return mmd_roi_error(code, k, batch);
    }
    return MMD_OK;
}

/* Max of every bin of one (roi, channel) plane: `plane` is the roi's image
 * and channel, `out` and `argmax` its pooled_h * pooled_w bins. */
template <typename T>
void pool_plane(const T *plane, int64_t height, int64_t width, const mmd_pool_geometry<T> &g,
                int64_t pooled_h, int64_t pooled_w, T *out, int64_t *argmax) {
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        int64_t h0, h1;
        mmd_roi_pool_bin(g.start_h, g.bin_h, ph, height, &h0, &h1);
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            int64_t w0, w1;
            mmd_roi_pool_bin(g.start_w, g.bin_w, pw, width, &w0, &w1);
            T best = 0;
            int64_t best_index = -1;
            bool saw_nan = false;
            for (int64_t h = h0; h < h1; ++h)
                for (int64_t w = w0; w < w1; ++w) {
                    const T v = plane[h * width + w];
                    if (v != v) {
                        saw_nan = true;
                    } else if (best_index < 0 || v > best) {
                        best = v;
                        best_index = h * width + w;
                    }
                }
            out[ph * pooled_w + pw] = best_index >= 0 ? best : (saw_nan ? (T)NAN : (T)0);
            argmax[ph * pooled_w + pw] = best_index;
        }
    }
}

template <typename T>
int roi_pool_forward(const mmd_tensor *input, const mmd_tensor *rois, const mmd_tensor *output,
                     const mmd_tensor *argmax, T spatial_scale) {
    const int64_t batch = input->shape[0], channels = input->shape[1];
    const int64_t height = input->shape[2], width = input->shape[3];
    const int64_t pooled_h = output->shape[2], pooled_w = output->shape[3];
    const int64_t bins = pooled_h * pooled_w;
    int s = check_rois(rois, batch, spatial_scale, pooled_h, pooled_w);
    if (s || mmd_numel(output) == 0) return s;
    const T *in = (const T *)input->data, *r = (const T *)rois->data;
    T *out = (T *)output->data;
    int64_t *am = (int64_t *)argmax->data;
    const int64_t planes = rois->shape[0] * channels;
    return mmd_parallel_for(planes, 16, mmd_worth_threads(planes, planes * bins),
                            [&](int64_t begin, int64_t end) {
                                for (int64_t p = begin; p < end; ++p) {
                                    const int64_t k = p / channels, c = p % channels;
                                    mmd_pool_geometry<T> g{};
                                    mmd_roi_pool_geometry(r + 5 * k, batch, spatial_scale,
                                                          pooled_h, pooled_w, &g);
                                    pool_plane(in + (g.batch * channels + c) * height * width,
                                               height, width, g, pooled_h, pooled_w,
                                               out + p * bins, am + p * bins);
                                }
                                return (int)MMD_OK;
                            });
}

/* Accumulates into grad_input (the caller passes zeros, as in MMCV). A
 * channel's gradients come from its rois in order, so each sum has one
 * order (deterministic, race-free). */
template <typename T>
int roi_pool_backward(const mmd_tensor *grad_output, const mmd_tensor *rois,
                      const mmd_tensor *argmax, const mmd_tensor *grad_input, T spatial_scale) {
    const int64_t batch = grad_input->shape[0], channels = grad_input->shape[1];
    const int64_t plane_size = grad_input->shape[2] * grad_input->shape[3];
    const int64_t pooled_h = grad_output->shape[2], pooled_w = grad_output->shape[3];
    const int64_t bins = pooled_h * pooled_w, num_rois = rois->shape[0];
    int s = check_rois(rois, batch, spatial_scale, pooled_h, pooled_w);
    if (s) return s;
    const int64_t *am = (const int64_t *)argmax->data;
    const int64_t total = mmd_numel(argmax);
    for (int64_t i = 0; i < total; ++i)
        if (am[i] < -1 || am[i] >= plane_size)
            return mmd_roi_pool_argmax_error(i, am[i], plane_size);
    if (total == 0 || mmd_numel(grad_input) == 0) return MMD_OK;
    const T *go = (const T *)grad_output->data, *r = (const T *)rois->data;
    T *gi = (T *)grad_input->data;
    return mmd_parallel_for(channels, 1, mmd_worth_threads(channels, total),
                            [&](int64_t begin, int64_t end) {
                                for (int64_t c = begin; c < end; ++c)
                                    for (int64_t k = 0; k < num_rois; ++k) {
                                        mmd_pool_geometry<T> g{};
                                        mmd_roi_pool_geometry(r + 5 * k, batch, spatial_scale,
                                                              pooled_h, pooled_w, &g);
                                        T *plane = gi + (g.batch * channels + c) * plane_size;
                                        const int64_t base = (k * channels + c) * bins;
                                        for (int64_t b = 0; b < bins; ++b)
                                            if (am[base + b] >= 0)
                                                plane[am[base + b]] += go[base + b];
                                    }
                                return (int)MMD_OK;
                            });
}

int roi_pool_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                         const mmd_tensor *output, const mmd_tensor *argmax,
                         int64_t pooled_height, int64_t pooled_width, double spatial_scale,
                         const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_pool_forward_check(input, rois, output, argmax, pooled_height, pooled_width,
                                       spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return roi_pool_forward<float>(input, rois, output, argmax, (float)spatial_scale);
    return roi_pool_forward<double>(input, rois, output, argmax, spatial_scale);
}

int roi_pool_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                          const mmd_tensor *argmax, const mmd_tensor *grad_input,
                          int64_t pooled_height, int64_t pooled_width, double spatial_scale,
                          const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_pool_backward_check(grad_output, rois, argmax, grad_input, pooled_height,
                                        pooled_width, spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (grad_input->dtype == MMD_FLOAT32)
        return roi_pool_backward<float>(grad_output, rois, argmax, grad_input,
                                        (float)spatial_scale);
    return roi_pool_backward<double>(grad_output, rois, argmax, grad_input, spatial_scale);
}

}  // namespace

MMD_REGISTRATIONS(cpu, roi_pool) {
    MMD_REGISTER_DEVICE_IMPL(roi_pool_forward_impl, CPU, DEFAULT, roi_pool_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_pool_backward_impl, CPU, DEFAULT, roi_pool_backward_cpu);
}
