/* ps_roi_align on CPU. Forward shares (roi, output channel) planes out over
 * the worker pool; a worker computes a roi's interpolation weights once per
 * sample row and column and applies them to the roi's channels. Backward
 * shares out input channels: input channel c_in receives only bin (ph, pw)
 * of output channel c_out (the three that name it, ps_rois.h), from every
 * roi in order, so its sums are race-free and deterministic. */
#include <stdlib.h>

#include "mmdispatch/ops/ps_roi_align.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

template <typename T> using Geometry = mmd_roi_geometry<T>;
template <typename T> using Axis = mmd_interp_axis<T>;

/* The call's shapes and scalars; `map` is input (forward) or grad_input
 * (backward). */
template <typename T> struct Call {
    const T *rois;
    int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w;
    T scale;
    int64_t sampling_ratio;

    int geometry(int64_t k, Geometry<T> *g) const {
        return mmd_ps_roi_align_geometry(rois + 5 * k, batch, scale, pooled_h, pooled_w,
                                         sampling_ratio, g);
    }
    int64_t out_channels() const { return channels / (pooled_h * pooled_w); }
};

template <typename T>
Call<T> make_call(const mmd_tensor *map, const mmd_tensor *rois, int64_t pooled_h,
                  int64_t pooled_w, double spatial_scale, int64_t sampling_ratio) {
    return Call<T>{(const T *)rois->data, rois->shape[0], map->shape[0], map->shape[1],
                   map->shape[2], map->shape[3], pooled_h, pooled_w, (T)spatial_scale,
                   sampling_ratio};
}

/* One roi's geometry and the interpolation of every sample row (ph, iy)
 * and column (pw, ix); a sample's bilinear weights are their products. The
 * arrays grow as needed and are freed with the worker's loop. */
template <typename T> struct RoiWeights {
    Geometry<T> g{};
    Axis<T> *rows = nullptr, *cols = nullptr;
    size_t rows_cap = 0, cols_cap = 0;

    RoiWeights() = default;
    RoiWeights(const RoiWeights &) = delete;
    RoiWeights &operator=(const RoiWeights &) = delete;
    ~RoiWeights() {
        free(rows);
        free(cols);
    }

    static bool grow(Axis<T> **a, size_t *cap, size_t n) {
        if (n <= *cap) return true;
        Axis<T> *p = (Axis<T> *)realloc(*a, n * sizeof(Axis<T>));
        if (!p) return false;
        *a = p;
        *cap = n;
        return true;
    }

    /* The weights of roi k's bin rows [ph0, ph1) and columns [pw0, pw1),
     * from rows[0] and cols[0]; false when out of memory. */
    bool compute(const Call<T> &call, int64_t k, int64_t ph0, int64_t ph1, int64_t pw0,
                 int64_t pw1) {
        call.geometry(k, &g);
        if (!grow(&rows, &rows_cap, (size_t)((ph1 - ph0) * g.grid_h + 1)) ||
            !grow(&cols, &cols_cap, (size_t)((pw1 - pw0) * g.grid_w + 1)))
            return false;
        for (int64_t ph = ph0; ph < ph1; ++ph)
            for (int64_t iy = 0; iy < g.grid_h; ++iy)
                mmd_interp(mmd_roi_align_sample(g.start_h, g.bin_h, ph, iy, g.grid_h),
                           call.height, &rows[(ph - ph0) * g.grid_h + iy]);
        for (int64_t pw = pw0; pw < pw1; ++pw)
            for (int64_t ix = 0; ix < g.grid_w; ++ix)
                mmd_interp(mmd_roi_align_sample(g.start_w, g.bin_w, pw, ix, g.grid_w),
                           call.width, &cols[(pw - pw0) * g.grid_w + ix]);
        return true;
    }

    T divisor() const {
        const int64_t count = g.grid_h * g.grid_w;
        return (T)(count > 1 ? count : 1);
    }
};

int out_of_memory(int64_t k) {
    return mmd_error(MMD_ERR_MEMORY, "out of memory for the sample weights of roi %lld",
                     (long long)k);
}

template <typename T> int forward(const Call<T> &call, const T *input, T *output) {
    int s = mmd_ps_check_rois<Geometry<T>>(call);
    const int64_t c_out = call.out_channels(), bins = call.pooled_h * call.pooled_w;
    const int64_t planes = call.num_rois * c_out;
    if (s || planes * bins == 0) return s;
    const int64_t plane_size = call.height * call.width;
    return mmd_parallel_for(planes, mmd_even_chunk(planes), mmd_worth_threads(planes, planes * bins * 4),
                            [&](int64_t begin, int64_t end) {
        RoiWeights<T> w;
        int64_t have = -1;   /* the roi whose weights w holds */
        for (int64_t p = begin; p < end; ++p) {
            const int64_t k = p / c_out, co = p % c_out;
            if (k != have) {
                if (!w.compute(call, k, 0, call.pooled_h, 0, call.pooled_w))
                    return out_of_memory(k);
                have = k;
            }
            const Geometry<T> &g = w.g;
            const T divisor = w.divisor();
            T *out = output + p * bins;
            for (int64_t ph = 0; ph < call.pooled_h; ++ph)
                for (int64_t pw = 0; pw < call.pooled_w; ++pw) {
                    const int64_t c_in = mmd_ps_channel(co, ph, pw, call.pooled_h, call.pooled_w);
                    const T *plane = input + (g.batch * call.channels + c_in) * plane_size;
                    T sum = 0;
                    for (int64_t iy = 0; iy < g.grid_h; ++iy) {
                        const Axis<T> &ay = w.rows[ph * g.grid_h + iy];
                        for (int64_t ix = 0; ix < g.grid_w; ++ix) {
                            const Axis<T> &ax = w.cols[pw * g.grid_w + ix];
                            /* a sample outside the map adds 0 (its weights) */
                            if (ay.valid && ax.valid)
                                sum += mmd_ps_roi_align_bilinear(plane, call.width, ay, ax);
                        }
                    }
                    out[ph * call.pooled_w + pw] = sum / divisor;
                }
        }
        return (int)MMD_OK;
    });
}

/* Adds into grad_input (the caller passes it initialised, zeros for a plain
 * gradient). */
template <typename T> int backward(const Call<T> &call, const T *grad_output, T *grad_input) {
    int s = mmd_ps_check_rois<Geometry<T>>(call);
    const int64_t bins = call.pooled_h * call.pooled_w, c_out = call.out_channels();
    if (s || call.num_rois * c_out * bins == 0 || call.height * call.width == 0) return s;
    const int64_t plane_size = call.height * call.width;
    const int64_t channels = call.channels;
    return mmd_parallel_for(channels, mmd_even_chunk(channels),
                            mmd_worth_threads(channels, call.num_rois * channels * 4),
                            [&](int64_t begin, int64_t end) {
        RoiWeights<T> w;
        for (int64_t c_in = begin; c_in < end; ++c_in) {
            const int64_t co = c_in / bins, ph = (c_in % bins) / call.pooled_w,
                          pw = c_in % call.pooled_w;
            for (int64_t k = 0; k < call.num_rois; ++k) {
                if (!w.compute(call, k, ph, ph + 1, pw, pw + 1)) return out_of_memory(k);
                const Geometry<T> &g = w.g;
                const T grad = grad_output[(k * c_out + co) * bins + ph * call.pooled_w + pw] /
                               w.divisor();
                T *plane = grad_input + (g.batch * channels + c_in) * plane_size;
                for (int64_t iy = 0; iy < g.grid_h; ++iy) {
                    const Axis<T> &ay = w.rows[iy];
                    if (!ay.valid) continue;
                    for (int64_t ix = 0; ix < g.grid_w; ++ix) {
                        const Axis<T> &ax = w.cols[ix];
                        if (!ax.valid) continue;
                        plane[ay.low * call.width + ax.low] += grad * ay.w_low * ax.w_low;
                        plane[ay.low * call.width + ax.high] += grad * ay.w_low * ax.w_high;
                        plane[ay.high * call.width + ax.low] += grad * ay.w_high * ax.w_low;
                        plane[ay.high * call.width + ax.high] += grad * ay.w_high * ax.w_high;
                    }
                }
            }
        }
        return (int)MMD_OK;
    });
}

int ps_roi_align_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                             const mmd_tensor *output, int64_t pooled_height,
                             int64_t pooled_width, double spatial_scale, int64_t sampling_ratio,
                             const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_align_forward_check(input, rois, output, pooled_height, pooled_width,
                                           spatial_scale, sampling_ratio, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return forward(make_call<float>(input, rois, pooled_height, pooled_width, spatial_scale,
                                        sampling_ratio),
                       (const float *)input->data, (float *)output->data);
    return forward(make_call<double>(input, rois, pooled_height, pooled_width, spatial_scale,
                                     sampling_ratio),
                   (const double *)input->data, (double *)output->data);
}

int ps_roi_align_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                              const mmd_tensor *grad_input, int64_t pooled_height,
                              int64_t pooled_width, double spatial_scale, int64_t sampling_ratio,
                              const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_align_backward_check(grad_output, rois, grad_input, pooled_height,
                                            pooled_width, spatial_scale, sampling_ratio,
                                            MMD_FLOAT32_64);
    if (s) return s;
    if (grad_input->dtype == MMD_FLOAT32)
        return backward(make_call<float>(grad_input, rois, pooled_height, pooled_width,
                                         spatial_scale, sampling_ratio),
                        (const float *)grad_output->data, (float *)grad_input->data);
    return backward(make_call<double>(grad_input, rois, pooled_height, pooled_width,
                                      spatial_scale, sampling_ratio),
                    (const double *)grad_output->data, (double *)grad_input->data);
}

}  // namespace

MMD_REGISTRATIONS(cpu, ps_roi_align) {
    MMD_REGISTER_DEVICE_IMPL(ps_roi_align_forward_impl, CPU, DEFAULT, ps_roi_align_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(ps_roi_align_backward_impl, CPU, DEFAULT, ps_roi_align_backward_cpu);
}
