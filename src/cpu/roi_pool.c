/* roi_pool on CPU. Forward splits (roi, channel) planes over worker threads; backward gives
 * each thread whole channels and visits rois in order, so it is race-free and deterministic.
 * The typed kernels (after #else, with T / TFN naming the type and the name suffix) are
 * instantiated for float and double through mmdispatch/typed.h. */
#ifndef MMD_REAL

#include "mmdispatch/ops/roi_pool.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"

#define MMD_TYPED_FILE "roi_pool.c"
#include "mmdispatch/typed.h"

/* Forward and backward take the same arrays under different names: a
 * feature map (input / grad_input), the rois, a pooled array (output /
 * grad_output) and argmax. */
static int check_arrays(const mmd_tensor *feature, const char *feature_name,
                        const mmd_tensor *rois, const mmd_tensor *pooled,
                        const char *pooled_name, const mmd_tensor *argmax,
                        int64_t pooled_height, int64_t pooled_width, double spatial_scale,
                        unsigned float_mask) {
    if (pooled_height < 1 || pooled_width < 1)
        return mmd_error(MMD_ERR_VALUE,
                         "pooled_height and pooled_width must be >= 1, got %lld and %lld",
                         (long long)pooled_height, (long long)pooled_width);
    if (!(isfinite(spatial_scale) && spatial_scale > 0))
        return mmd_error(MMD_ERR_VALUE, "spatial_scale must be finite and > 0, got %g",
                         spatial_scale);
    const int64_t any4[4] = {MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM};
    const int64_t roi_shape[2] = {MMD_ANY_DIM, 5};
    int s = mmd_check_shape(feature, feature_name, 4, any4);
    if (!s) s = mmd_check_dtype(feature, feature_name, float_mask);
    if (!s) s = mmd_check_contiguous(feature, feature_name);
    if (!s) s = mmd_check_shape(rois, "rois", 2, roi_shape);
    if (!s) s = mmd_check_same_dtype(rois, "rois", feature, feature_name);
    if (!s) s = mmd_check_contiguous(rois, "rois");
    if (s) return s;
    const int64_t pooled_shape[4] = {rois->shape[0], feature->shape[1], pooled_height,
                                     pooled_width};
    s = mmd_check_shape(pooled, pooled_name, 4, pooled_shape);
    if (!s) s = mmd_check_same_dtype(pooled, pooled_name, feature, feature_name);
    if (!s) s = mmd_check_contiguous(pooled, pooled_name);
    if (!s) s = mmd_check_shape(argmax, "argmax", 4, pooled_shape);
    if (!s) s = mmd_check_dtype(argmax, "argmax", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(argmax, "argmax");
    return s;
}

int mmd_roi_pool_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                               const mmd_tensor *output, const mmd_tensor *argmax,
                               int64_t pooled_height, int64_t pooled_width,
                               double spatial_scale, unsigned float_mask) {
    return check_arrays(input, "input", rois, output, "output", argmax, pooled_height,
                        pooled_width, spatial_scale, float_mask);
}

int mmd_roi_pool_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                const mmd_tensor *argmax, const mmd_tensor *grad_input,
                                int64_t pooled_height, int64_t pooled_width,
                                double spatial_scale, unsigned float_mask) {
    /* dtypes are reported against grad_output, which the user passed (the op
     * layer allocates grad_input like it) */
    int s = mmd_check_dtype(grad_output, "grad_output", float_mask);
    if (!s) s = mmd_check_same_dtype(rois, "rois", grad_output, "grad_output");
    if (!s) s = check_arrays(grad_input, "grad_input", rois, grad_output, "grad_output", argmax,
                             pooled_height, pooled_width, spatial_scale, float_mask);
    return s;
}

int mmd_roi_pool_argmax_error(int64_t flat_index, int64_t value, int64_t plane_size) {
    return mmd_error(MMD_ERR_VALUE,
                     "argmax holds %lld at flat index %lld; entries must be -1 or in [0, %lld) "
                     "(H * W of grad_input)",
                     (long long)value, (long long)flat_index, (long long)plane_size);
}

static int roi_pool_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                                const mmd_tensor *output, const mmd_tensor *argmax,
                                int64_t pooled_height, int64_t pooled_width,
                                double spatial_scale, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_pool_forward_check(input, rois, output, argmax, pooled_height, pooled_width,
                                       spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return roi_pool_forward_f32(input, rois, output, argmax, (float)spatial_scale);
    return roi_pool_forward_f64(input, rois, output, argmax, spatial_scale);
}

static int roi_pool_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                 const mmd_tensor *argmax, const mmd_tensor *grad_input,
                                 int64_t pooled_height, int64_t pooled_width,
                                 double spatial_scale, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_pool_backward_check(grad_output, rois, argmax, grad_input, pooled_height,
                                        pooled_width, spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (grad_input->dtype == MMD_FLOAT32)
        return roi_pool_backward_f32(grad_output, rois, argmax, grad_input, (float)spatial_scale);
    return roi_pool_backward_f64(grad_output, rois, argmax, grad_input, spatial_scale);
}

#include "mmdispatch_generated.h"

MMD_REGISTRATIONS(cpu, roi_pool) {
    MMD_REGISTER_DEVICE_IMPL(roi_pool_forward_impl, CPU, DEFAULT, roi_pool_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_pool_backward_impl, CPU, DEFAULT, roi_pool_backward_cpu);
}

#else /* typed kernels, instantiated above for float and double */
#define T MMD_REAL
#define TFN MMD_FN

typedef TFN(mmd_pool_geometry) TFN(geometry);

/* Validates every roi before anything is written. */
static int TFN(check_rois)(const mmd_tensor *rois, int64_t batch, T spatial_scale,
                           int64_t pooled_h, int64_t pooled_w) {
    const T *r = (const T *)rois->data;
    for (int64_t k = 0; k < rois->shape[0]; ++k) {
        TFN(geometry) g = {0};
        int code = TFN(mmd_roi_pool_geometry)(r + 5 * k, batch, spatial_scale, pooled_h,
                                              pooled_w, &g);
        if (code != MMD_ROI_OK) return mmd_roi_error(code, k, batch);
    }
    return MMD_OK;
}

/* The forward's loop over (roi, channel) planes. */
struct TFN(forward_loop) {
    const T *in, *rois;
    T *out;
    int64_t *argmax;
    int64_t batch, channels, height, width, pooled_h, pooled_w;
    T spatial_scale;
};

static int TFN(forward_planes)(const void *loop, int64_t begin, int64_t end) {
    const struct TFN(forward_loop) *l = (const struct TFN(forward_loop) *)loop;
    const int64_t channels = l->channels, height = l->height, width = l->width;
    const int64_t pooled_h = l->pooled_h, pooled_w = l->pooled_w, bins = pooled_h * pooled_w;
    for (int64_t p = begin; p < end; ++p) {
        const int64_t k = p / channels, c = p % channels;
        TFN(geometry) g = {0};
        TFN(mmd_roi_pool_geometry)(l->rois + 5 * k, l->batch, l->spatial_scale, pooled_h,
                                   pooled_w, &g);
        const T *plane = l->in + (g.batch * channels + c) * height * width;
        for (int64_t ph = 0; ph < pooled_h; ++ph) {
            int64_t h0, h1;
            TFN(mmd_roi_pool_bin)(g.start_h, g.bin_h, ph, height, &h0, &h1);
            for (int64_t pw = 0; pw < pooled_w; ++pw) {
                int64_t w0, w1;
                TFN(mmd_roi_pool_bin)(g.start_w, g.bin_w, pw, width, &w0, &w1);
                T best = 0;
                int64_t best_index = -1;
                int saw_nan = 0;
                for (int64_t h = h0; h < h1; ++h)
                    for (int64_t w = w0; w < w1; ++w) {
                        const T v = plane[h * width + w];
                        if (v != v)
                            saw_nan = 1;
                        else if (best_index < 0 || v > best) {
                            best = v;
                            best_index = h * width + w;
                        }
                    }
                const int64_t o = p * bins + ph * pooled_w + pw;
                l->out[o] = best_index >= 0 ? best : (saw_nan ? (T)NAN : (T)0);
                l->argmax[o] = best_index;
            }
        }
    }
    return MMD_OK;
}

static int TFN(roi_pool_forward)(const mmd_tensor *input, const mmd_tensor *rois,
                                 const mmd_tensor *output, const mmd_tensor *argmax,
                                 T spatial_scale) {
    const int64_t batch = input->shape[0], channels = input->shape[1];
    const int64_t pooled_h = output->shape[2], pooled_w = output->shape[3];
    int s = TFN(check_rois)(rois, batch, spatial_scale, pooled_h, pooled_w);
    if (s || mmd_numel(output) == 0) return s;
    const struct TFN(forward_loop) loop = {
        (const T *)input->data, (const T *)rois->data, (T *)output->data,
        (int64_t *)argmax->data, batch, channels, input->shape[2], input->shape[3], pooled_h,
        pooled_w, spatial_scale};
    const int64_t planes = rois->shape[0] * channels;
    return mmd_parallel_for(planes, 16, mmd_worth_threads(planes, planes * pooled_h * pooled_w),
                            TFN(forward_planes), &loop);
}

/* The backward's loop over channels: a channel's gradients come from its
 * rois in order, so each sum has one order (deterministic, race-free). */
struct TFN(backward_loop) {
    const T *grad_output, *rois;
    const int64_t *argmax;
    T *grad_input;
    int64_t batch, channels, plane_size, num_rois, pooled_h, pooled_w;
    T spatial_scale;
};

static int TFN(backward_channels)(const void *loop, int64_t begin, int64_t end) {
    const struct TFN(backward_loop) *l = (const struct TFN(backward_loop) *)loop;
    const int64_t channels = l->channels, bins = l->pooled_h * l->pooled_w;
    for (int64_t c = begin; c < end; ++c)
        for (int64_t k = 0; k < l->num_rois; ++k) {
            TFN(geometry) g = {0};
            TFN(mmd_roi_pool_geometry)(l->rois + 5 * k, l->batch, l->spatial_scale, l->pooled_h,
                                       l->pooled_w, &g);
            T *plane = l->grad_input + (g.batch * channels + c) * l->plane_size;
            const int64_t base = (k * channels + c) * bins;
            for (int64_t b = 0; b < bins; ++b)
                if (l->argmax[base + b] >= 0) plane[l->argmax[base + b]] += l->grad_output[base + b];
        }
    return MMD_OK;
}

/* Accumulates into grad_input (the caller passes zeros, as in MMCV). */
static int TFN(roi_pool_backward)(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                  const mmd_tensor *argmax, const mmd_tensor *grad_input,
                                  T spatial_scale) {
    const int64_t batch = grad_input->shape[0], channels = grad_input->shape[1];
    const int64_t plane_size = grad_input->shape[2] * grad_input->shape[3];
    const int64_t pooled_h = grad_output->shape[2], pooled_w = grad_output->shape[3];
    const int64_t num_rois = rois->shape[0];
    int s = TFN(check_rois)(rois, batch, spatial_scale, pooled_h, pooled_w);
    if (s) return s;
    const int64_t *am = (const int64_t *)argmax->data;
    const int64_t total = mmd_numel(argmax);
    for (int64_t i = 0; i < total; ++i)
        if (am[i] < -1 || am[i] >= plane_size)
            return mmd_roi_pool_argmax_error(i, am[i], plane_size);
    if (total == 0 || mmd_numel(grad_input) == 0) return MMD_OK;
    const struct TFN(backward_loop) loop = {
        (const T *)grad_output->data, (const T *)rois->data, am, (T *)grad_input->data, batch,
        channels, plane_size, num_rois, pooled_h, pooled_w, spatial_scale};
    return mmd_parallel_for(channels, 1, mmd_worth_threads(channels, total), TFN(backward_channels),
                            &loop);
}

#undef T
#undef TFN
#endif
