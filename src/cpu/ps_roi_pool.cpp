/* ps_roi_pool on CPU. Forward shares (roi, output channel) planes out over
 * the worker pool. Backward shares out input channels: input channel c_in
 * receives only bin (ph, pw) of output channel c_out (the three that name
 * it, ps_rois.h), from every roi in order, so its sums are race-free and
 * deterministic. */
#include "mmdispatch/ops/ps_roi_pool.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

template <typename T> using Geometry = mmd_pool_geometry<T>;

/* The call's shapes and scalars; `map` is input (forward) or grad_input
 * (backward). */
template <typename T> struct Call {
    const T *rois;
    int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w;
    T scale;

    int geometry(int64_t k, Geometry<T> *g) const {
        return mmd_ps_roi_pool_geometry(rois + 5 * k, batch, scale, pooled_h, pooled_w, g);
    }
    int64_t out_channels() const { return channels / (pooled_h * pooled_w); }

    /* The cells [h0, h1) x [w0, w1) of bin (ph, pw) of roi geometry g. */
    void bin(const Geometry<T> &g, int64_t ph, int64_t pw, int64_t *h0, int64_t *h1,
             int64_t *w0, int64_t *w1) const {
        mmd_ps_roi_pool_bin(g.start_h, g.bin_h, ph, height, h0, h1);
        mmd_ps_roi_pool_bin(g.start_w, g.bin_w, pw, width, w0, w1);
    }
};

template <typename T>
Call<T> make_call(const mmd_tensor *map, const mmd_tensor *rois, int64_t pooled_h,
                  int64_t pooled_w, double spatial_scale) {
    return Call<T>{(const T *)rois->data, rois->shape[0], map->shape[0], map->shape[1],
                   map->shape[2], map->shape[3], pooled_h, pooled_w, (T)spatial_scale};
}

template <typename T> int forward(const Call<T> &call, const T *input, T *output) {
    int s = mmd_ps_check_rois<Geometry<T>>(call);
    const int64_t c_out = call.out_channels(), bins = call.pooled_h * call.pooled_w;
    const int64_t planes = call.num_rois * c_out;
    if (s || planes * bins == 0) return s;
    const int64_t plane_size = call.height * call.width;
    return mmd_parallel_for(planes, mmd_even_chunk(planes),
                            mmd_worth_threads(planes, planes * bins * 4),
                            [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const int64_t k = p / c_out, co = p % c_out;
            Geometry<T> g{};
            call.geometry(k, &g);
            T *out = output + p * bins;
            for (int64_t ph = 0; ph < call.pooled_h; ++ph)
                for (int64_t pw = 0; pw < call.pooled_w; ++pw) {
                    int64_t h0, h1, w0, w1;
                    call.bin(g, ph, pw, &h0, &h1, &w0, &w1);
                    const int64_t c_in = mmd_ps_channel(co, ph, pw, call.pooled_h, call.pooled_w);
                    const T *plane = input + (g.batch * call.channels + c_in) * plane_size;
                    T sum = 0;
                    for (int64_t h = h0; h < h1; ++h)
                        for (int64_t w = w0; w < w1; ++w) sum += plane[h * call.width + w];
                    const bool empty = h1 <= h0 || w1 <= w0;
                    out[ph * call.pooled_w + pw] = empty ? (T)0 : sum / (T)((h1 - h0) * (w1 - w0));
                }
        }
        return (int)MMD_OK;
    });
}

/* Adds into grad_input (the caller passes it initialised, zeros for a plain
 * gradient): each cell of a bin gets the bin's gradient over its area. */
template <typename T> int backward(const Call<T> &call, const T *grad_output, T *grad_input) {
    int s = mmd_ps_check_rois<Geometry<T>>(call);
    const int64_t bins = call.pooled_h * call.pooled_w, c_out = call.out_channels();
    if (s || call.num_rois * c_out * bins == 0 || call.height * call.width == 0) return s;
    const int64_t plane_size = call.height * call.width, channels = call.channels;
    return mmd_parallel_for(channels, mmd_even_chunk(channels),
                            mmd_worth_threads(channels, call.num_rois * channels * 4),
                            [&](int64_t begin, int64_t end) {
        for (int64_t c_in = begin; c_in < end; ++c_in) {
            const int64_t co = c_in / bins, ph = (c_in % bins) / call.pooled_w,
                          pw = c_in % call.pooled_w;
            for (int64_t k = 0; k < call.num_rois; ++k) {
                Geometry<T> g{};
                call.geometry(k, &g);
                int64_t h0, h1, w0, w1;
                call.bin(g, ph, pw, &h0, &h1, &w0, &w1);
                if (h1 <= h0 || w1 <= w0) continue;
                const T grad = grad_output[(k * c_out + co) * bins + ph * call.pooled_w + pw] /
                               (T)((h1 - h0) * (w1 - w0));
                T *plane = grad_input + (g.batch * channels + c_in) * plane_size;
                for (int64_t h = h0; h < h1; ++h)
                    for (int64_t w = w0; w < w1; ++w) plane[h * call.width + w] += grad;
            }
        }
        return (int)MMD_OK;
    });
}

int ps_roi_pool_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                            const mmd_tensor *output, int64_t pooled_height, int64_t pooled_width,
                            double spatial_scale, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_forward_check(input, rois, output, pooled_height, pooled_width,
                                     spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return forward(make_call<float>(input, rois, pooled_height, pooled_width, spatial_scale),
                       (const float *)input->data, (float *)output->data);
    return forward(make_call<double>(input, rois, pooled_height, pooled_width, spatial_scale),
                   (const double *)input->data, (double *)output->data);
}

int ps_roi_pool_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                             const mmd_tensor *grad_input, int64_t pooled_height,
                             int64_t pooled_width, double spatial_scale, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_backward_check(grad_output, rois, grad_input, pooled_height, pooled_width,
                                      spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (grad_input->dtype == MMD_FLOAT32)
        return backward(make_call<float>(grad_input, rois, pooled_height, pooled_width,
                                         spatial_scale),
                        (const float *)grad_output->data, (float *)grad_input->data);
    return backward(make_call<double>(grad_input, rois, pooled_height, pooled_width,
                                      spatial_scale),
                    (const double *)grad_output->data, (double *)grad_input->data);
}

}  // namespace

MMD_REGISTRATIONS(cpu, ps_roi_pool) {
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_forward_impl, CPU, DEFAULT, ps_roi_pool_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_backward_impl, CPU, DEFAULT, ps_roi_pool_backward_cpu);
}
