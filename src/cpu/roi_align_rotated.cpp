/* roi_align_rotated on CPU. Every roi is validated (and its geometry kept)
 * before anything is written. Forward shares out the rois: a sample's
 * interpolation weights serve all channels. Backward shares out the
 * channels: each thread alone adds into its channels' planes, rois and
 * samples in order, so the sums are race-free and deterministic. */
#include <string.h>

#include "mmdispatch/ops/roi_align_rotated.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "heap_array.h"

namespace {

struct Params {
    int64_t pooled_h, pooled_w, sampling_ratio;
    double spatial_scale;
    int aligned, clockwise;
};

/* The geometry of every roi, or the error of the first bad one. */
template <typename T>
int geometries(const mmd_tensor *rois, int64_t batch, const Params &p,
               mmd_rotated_roi<T> *out) {
    const T *r = (const T *)rois->data;
    for (int64_t k = 0; k < rois->shape[0]; ++k) {
        const int code = mmd_roi_align_rotated_geometry(r + 6 * k, batch, (T)p.spatial_scale,
                                                        p.pooled_h, p.pooled_w,
                                                        p.sampling_ratio, p.aligned,
                                                        p.clockwise, &out[k]);
        if (code != MMD_ROI_OK) return mmd_roi_error(code, k, batch);
    }
    return MMD_OK;
}

/* Calls f(offset of the cell, weight) for the (up to) four cells of the
 * sample at (y, x) of an H x W plane. */
template <typename T, typename F>
inline void for_cells(T y, T x, int64_t height, int64_t width, const F &f) {
    mmd_interp_axis<T> ay, ax;
    mmd_interp(y, height, &ay);
    mmd_interp(x, width, &ax);
    if (!(ay.valid && ax.valid)) return;
    f(ay.low * width + ax.low, ay.w_low * ax.w_low);
    f(ay.low * width + ax.high, ay.w_low * ax.w_high);
    f(ay.high * width + ax.low, ay.w_high * ax.w_low);
    f(ay.high * width + ax.high, ay.w_high * ax.w_high);
}

template <typename T>
int forward(const mmd_tensor *input, const mmd_tensor *rois, const mmd_tensor *output,
            const Params &p) {
    const int64_t num_rois = rois->shape[0], channels = input->shape[1];
    const int64_t height = input->shape[2], width = input->shape[3], plane = height * width;
    const int64_t bins = p.pooled_h * p.pooled_w;
    HeapArray<mmd_rotated_roi<T>> g(num_rois);
    if (!g) return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld rois", (long long)num_rois);
    int s = geometries(rois, input->shape[0], p, g.get());
    if (s || num_rois * channels * bins == 0) return s;   /* no output: no samples to walk */
    const T *in = (const T *)input->data;
    T *out = (T *)output->data;
    mmd_parallel_for(num_rois, 1, mmd_worth_threads(num_rois, num_rois * channels * bins * 4),
                     [&](int64_t begin, int64_t end) {
        for (int64_t k = begin; k < end; ++k) {
            const mmd_rotated_roi<T> &r = g[k];
            const T *image = in + r.batch * channels * plane;
            T *roi_out = out + k * channels * bins;
            for (int64_t c = 0; c < channels * bins; ++c) roi_out[c] = 0;
            for (int64_t ph = 0; ph < p.pooled_h; ++ph)
                for (int64_t pw = 0; pw < p.pooled_w; ++pw) {
                    const int64_t bin = ph * p.pooled_w + pw;
                    for (int64_t iy = 0; iy < r.grid_h; ++iy)
                        for (int64_t ix = 0; ix < r.grid_w; ++ix) {
                            T y, x;
                            r.sample(ph, pw, iy, ix, &y, &x);
                            for_cells(y, x, height, width, [&](int64_t cell, T w) {
                                for (int64_t c = 0; c < channels; ++c)
                                    roi_out[c * bins + bin] += w * image[c * plane + cell];
                            });
                        }
                    for (int64_t c = 0; c < channels; ++c)
                        roi_out[c * bins + bin] /= (T)r.count();
                }
        }
        return (int)MMD_OK;
    });
    return MMD_OK;
}

template <typename T>
int backward(const mmd_tensor *grad_output, const mmd_tensor *rois,
             const mmd_tensor *grad_input, const Params &p) {
    const int64_t num_rois = rois->shape[0], channels = grad_input->shape[1];
    const int64_t height = grad_input->shape[2], width = grad_input->shape[3];
    const int64_t plane = height * width, bins = p.pooled_h * p.pooled_w;
    HeapArray<mmd_rotated_roi<T>> g(num_rois);
    if (!g) return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld rois", (long long)num_rois);
    int s = geometries(rois, grad_input->shape[0], p, g.get());
    if (s) return s;
    const T *grad = (const T *)grad_output->data;
    T *into = (T *)grad_input->data;
    mmd_parallel_for(channels, 1, mmd_worth_threads(channels, channels * num_rois * bins * 4),
                     [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c)
            for (int64_t k = 0; k < num_rois; ++k) {
                const mmd_rotated_roi<T> &r = g[k];
                T *dst = into + (r.batch * channels + c) * plane;
                const T *src = grad + (k * channels + c) * bins;
                for (int64_t ph = 0; ph < p.pooled_h; ++ph)
                    for (int64_t pw = 0; pw < p.pooled_w; ++pw) {
                        const T share = src[ph * p.pooled_w + pw] / (T)r.count();
                        for (int64_t iy = 0; iy < r.grid_h; ++iy)
                            for (int64_t ix = 0; ix < r.grid_w; ++ix) {
                                T y, x;
                                r.sample(ph, pw, iy, ix, &y, &x);
                                for_cells(y, x, height, width,
                                          [&](int64_t cell, T w) { dst[cell] += share * w; });
                            }
                    }
            }
        return (int)MMD_OK;
    });
    return MMD_OK;
}

int roi_align_rotated_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                                  const mmd_tensor *output, int64_t pooled_height,
                                  int64_t pooled_width, double spatial_scale,
                                  int64_t sampling_ratio, int aligned, int clockwise,
                                  const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_align_rotated_check(input, "input", rois, output, "output", pooled_height,
                                        pooled_width, spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    const Params p{pooled_height, pooled_width, sampling_ratio, spatial_scale, aligned,
                   clockwise};
    return input->dtype == MMD_FLOAT32 ? forward<float>(input, rois, output, p)
                                       : forward<double>(input, rois, output, p);
}

int roi_align_rotated_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                   const mmd_tensor *grad_input, int64_t pooled_height,
                                   int64_t pooled_width, double spatial_scale,
                                   int64_t sampling_ratio, int aligned, int clockwise,
                                   const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_check_dtype(grad_output, "grad_output", MMD_FLOAT32_64);
    /* rois against grad_output first: the op's wrappers allocate grad_input */
    if (!s) s = mmd_check_same_dtype(rois, "rois", grad_output, "grad_output");
    if (!s) s = mmd_roi_align_rotated_check(grad_input, "grad_input", rois, grad_output,
                                            "grad_output", pooled_height, pooled_width,
                                            spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    const Params p{pooled_height, pooled_width, sampling_ratio, spatial_scale, aligned,
                   clockwise};
    return grad_output->dtype == MMD_FLOAT32
               ? backward<float>(grad_output, rois, grad_input, p)
               : backward<double>(grad_output, rois, grad_input, p);
}

}  // namespace

MMD_REGISTRATIONS(cpu, roi_align_rotated) {
    MMD_REGISTER_DEVICE_IMPL(roi_align_rotated_forward_impl, CPU, DEFAULT,
                             roi_align_rotated_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_align_rotated_backward_impl, CPU, DEFAULT,
                             roi_align_rotated_backward_cpu);
}
