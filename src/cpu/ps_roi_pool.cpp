/* ps_roi_pool on CPU. Forward and backward share out the (image, input
 * channel) planes: plane c_in is read (or added into) only by bin (ph, pw)
 * of output channel c_out (the three that name it, ps_rois.h) of each roi,
 * so a plane stays in cache while every roi uses it, and backward's sums,
 * the rois in order, are race-free and deterministic. */
#include <stdlib.h>

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
};

template <typename T>
Call<T> make_call(const mmd_tensor *map, const mmd_tensor *rois, int64_t pooled_h,
                  int64_t pooled_w, double spatial_scale) {
    return Call<T>{(const T *)rois->data, rois->shape[0], map->shape[0], map->shape[1],
                   map->shape[2], map->shape[3], pooled_h, pooled_w, (T)spatial_scale};
}

/* Every roi's image and the cells of each of its bin rows and columns:
 * rows [row_lo, row_hi)[k * pooled_h + ph], columns likewise, computed once
 * per call. */
struct Cells {
    int64_t *batch = nullptr, *row_lo = nullptr, *row_hi = nullptr, *col_lo = nullptr,
            *col_hi = nullptr;

    Cells() = default;
    Cells(const Cells &) = delete;
    Cells &operator=(const Cells &) = delete;
    ~Cells() { free(batch), free(row_lo), free(row_hi), free(col_lo), free(col_hi); }

    template <typename T> int build(const Call<T> &call) {
        const size_t k = (size_t)call.num_rois + 1;
        batch = (int64_t *)malloc(sizeof(int64_t) * k);
        row_lo = (int64_t *)malloc(sizeof(int64_t) * k * call.pooled_h);
        row_hi = (int64_t *)malloc(sizeof(int64_t) * k * call.pooled_h);
        col_lo = (int64_t *)malloc(sizeof(int64_t) * k * call.pooled_w);
        col_hi = (int64_t *)malloc(sizeof(int64_t) * k * call.pooled_w);
        if (!batch || !row_lo || !row_hi || !col_lo || !col_hi)
            return mmd_error(MMD_ERR_MEMORY, "out of memory for the bins of %lld rois",
                             (long long)call.num_rois);
        for (int64_t r = 0; r < call.num_rois; ++r) {
            Geometry<T> g{};
            call.geometry(r, &g);
            batch[r] = g.batch;
            for (int64_t ph = 0; ph < call.pooled_h; ++ph)
                mmd_ps_roi_pool_bin(g.start_h, g.bin_h, ph, call.height,
                                    &row_lo[r * call.pooled_h + ph],
                                    &row_hi[r * call.pooled_h + ph]);
            for (int64_t pw = 0; pw < call.pooled_w; ++pw)
                mmd_ps_roi_pool_bin(g.start_w, g.bin_w, pw, call.width,
                                    &col_lo[r * call.pooled_w + pw],
                                    &col_hi[r * call.pooled_w + pw]);
        }
        return MMD_OK;
    }
};

/* Shares out the (image, input channel) planes of `map` (input or
 * grad_input): for plane (n, c_in), which is bin (ph, pw) of output
 * channel co (ps_rois.h), f(p, out, h0, h1, w0, w1) for every roi k on
 * image n, in order, with `out` its output (or grad_output) element and
 * [h0, h1) x [w0, w1) its bin's cells; a plane stays in cache while every
 * roi reads (or adds into) it. The rois read a plane at scattered cells,
 * which the hardware does not prefetch, so each roi's step prefetches one
 * line of the next plane (the rest after the last roi). */
template <typename T, typename F>
int for_planes_and_rois(const Call<T> &call, const T *map, const F &f) {
    Cells cells;
    int s = cells.build(call);
    if (s) return s;
    const int64_t planes = call.batch * call.channels, bins = call.pooled_h * call.pooled_w;
    const int64_t c_out = call.out_channels(), plane_size = call.height * call.width;
    const int64_t plane_bytes = plane_size * (int64_t)sizeof(T);
    return mmd_parallel_for(planes, mmd_even_chunk(planes),
                            mmd_worth_threads(planes, planes * call.num_rois * 4),
                            [&](int64_t begin, int64_t end) {
        for (int64_t p = begin; p < end; ++p) {
            const int64_t n = p / call.channels, c_in = p % call.channels;
            const int64_t co = c_in / bins, ph = (c_in % bins) / call.pooled_w,
                          pw = c_in % call.pooled_w;
            mmd_block_prefetch next(map + (p + 1 < end ? p + 1 : p) * plane_size, plane_bytes);
            for (int64_t k = 0; k < call.num_rois; ++k) {
                if (cells.batch[k] != n) continue;
                next.step();
                f(p, (k * c_out + co) * bins + ph * call.pooled_w + pw,
                  cells.row_lo[k * call.pooled_h + ph], cells.row_hi[k * call.pooled_h + ph],
                  cells.col_lo[k * call.pooled_w + pw], cells.col_hi[k * call.pooled_w + pw]);
            }
            next.finish();
        }
        return (int)MMD_OK;
    });
}

template <typename T> int forward(const Call<T> &call, const T *input, T *output) {
    int s = mmd_ps_check_rois<Geometry<T>>(call);
    const int64_t c_out = call.out_channels(), bins = call.pooled_h * call.pooled_w;
    if (s || call.num_rois * c_out * bins == 0) return s;
    const int64_t plane_size = call.height * call.width, width = call.width;
    return for_planes_and_rois(call, input, [&](int64_t p, int64_t out, int64_t h0,
                                                int64_t h1, int64_t w0, int64_t w1) {
        const T *plane = input + p * plane_size;
        T sum = 0;
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) sum += plane[h * width + w];
        const bool empty = h1 <= h0 || w1 <= w0;
        output[out] = empty ? (T)0 : sum / (T)((h1 - h0) * (w1 - w0));
    });
}

/* Adds into grad_input (the caller passes it initialised, zeros for a plain
 * gradient): each cell of a bin gets the bin's gradient over its area, the
 * rois in order. */
template <typename T> int backward(const Call<T> &call, const T *grad_output, T *grad_input) {
    int s = mmd_ps_check_rois<Geometry<T>>(call);
    const int64_t bins = call.pooled_h * call.pooled_w, c_out = call.out_channels();
    if (s || call.num_rois * c_out * bins == 0 || call.height * call.width == 0) return s;
    const int64_t plane_size = call.height * call.width, width = call.width;
    return for_planes_and_rois(call, grad_input, [&](int64_t p, int64_t out, int64_t h0,
                                                     int64_t h1, int64_t w0, int64_t w1) {
        if (h1 <= h0 || w1 <= w0) return;
        const T grad = grad_output[out] / (T)((h1 - h0) * (w1 - w0));
        T *plane = grad_input + p * plane_size;
        for (int64_t h = h0; h < h1; ++h)
            for (int64_t w = w0; w < w1; ++w) plane[h * width + w] += grad;
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
