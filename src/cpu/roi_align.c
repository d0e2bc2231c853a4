/* roi_align on CPU: argument checks shared with CUDA, a `reference` backend (plain scalar
 * loops, one sample at a time, single thread) and a `default` backend (per-roi interpolation
 * weights computed once per axis, worker threads; backward parallel over channels, so it is
 * race-free and deterministic). The typed kernels (after #else, with T / TFN naming the type
 * and the name suffix) are instantiated for float and double through mmdispatch/typed.h. */
#ifndef MMD_REAL

#include <stdlib.h>
#include <string.h>

#include "mmdispatch/ops/roi_align.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"

/* Room for `need` items of `item` bytes in *buf; the old contents are not
 * kept (every roi recomputes its weights). `fixed` is storage that is not
 * the heap's (a stack buffer) and is never freed. */
static int grow(void **buf, size_t *cap, size_t need, size_t item, const void *fixed) {
    if (need <= *cap) return 1;
    void *grown = malloc(need * item);
    if (!grown) return 0;
    if (*buf != fixed) free(*buf);
    *buf = grown;
    *cap = need;
    return 1;
}

/* A loop over channels: channel(job, c) for each, 0 when out of memory. */
struct channel_loop {
    int (*channel)(const void *, int64_t);
    const void *job;
};

static int channel_range(const void *loop, int64_t begin, int64_t end) {
    const struct channel_loop *l = (const struct channel_loop *)loop;
    for (int64_t c = begin; c < end; ++c)
        if (!l->channel(l->job, c))
            return mmd_error(MMD_ERR_MEMORY, "out of memory for interpolation weights");
    return MMD_OK;
}

/* Runs channel(job, c) for every channel, on the worker pool when
 * `parallel` (a channel at a time: rois make channels uneven). */
static int for_each_channel(int (*channel)(const void *, int64_t), const void *job,
                            int64_t channels, int parallel) {
    const struct channel_loop loop = {channel, job};
    return parallel ? mmd_parallel_for(channels, 1, 1, channel_range, &loop)
                    : channel_range(&loop, 0, channels);
}

#define MMD_TYPED_FILE "roi_align.c"
#include "mmdispatch/typed.h"

static int check_scalars(int64_t aligned_height, int64_t aligned_width, double spatial_scale,
                         int64_t sampling_ratio, int64_t pool_mode) {
    if (aligned_height < 1 || aligned_width < 1)
        return mmd_error(MMD_ERR_VALUE,
                         "aligned_height and aligned_width must be >= 1, got %lld and %lld",
                         (long long)aligned_height, (long long)aligned_width);
    if (!(isfinite(spatial_scale) && spatial_scale > 0))
        return mmd_error(MMD_ERR_VALUE, "spatial_scale must be finite and > 0, got %g",
                         spatial_scale);
    if (sampling_ratio > MMD_ROI_ALIGN_MAX_GRID)
        return mmd_error(MMD_ERR_VALUE, "sampling_ratio must be <= %d, got %lld",
                         MMD_ROI_ALIGN_MAX_GRID, (long long)sampling_ratio);
    if (pool_mode != MMD_POOL_MAX && pool_mode != MMD_POOL_AVG)
        return mmd_error(MMD_ERR_VALUE, "pool_mode must be 0 (max) or 1 (avg), got %lld",
                         (long long)pool_mode);
    return MMD_OK;
}

/* Checks a float tensor of exactly `shape` (ndim 4 or 2) with the reference
 * dtype, densely laid out. */
static int check_like(const mmd_tensor *t, const char *name, int ndim, const int64_t *shape,
                      const mmd_tensor *ref, const char *ref_name) {
    int s = mmd_check_shape(t, name, ndim, shape);
    if (!s) s = mmd_check_same_dtype(t, name, ref, ref_name);
    if (!s) s = mmd_check_contiguous(t, name);
    return s;
}

/* argmax_y/argmax_x: pooled-shaped in max mode; in avg mode they are unused
 * and may also be empty. */
static int check_argmax(const mmd_tensor *t, const char *name, const int64_t *pooled_shape,
                        int64_t pool_mode, const mmd_tensor *ref, const char *ref_name) {
    if (pool_mode == MMD_POOL_AVG && mmd_numel(t) == 0) return MMD_OK;
    return check_like(t, name, 4, pooled_shape, ref, ref_name);
}

/* Forward and backward take the same arrays under different names: a
 * feature map (input / grad_input), the rois, a pooled array (output /
 * grad_output) and the argmax pair. */
static int check_arrays(const mmd_tensor *feature, const char *feature_name,
                        const mmd_tensor *rois, const mmd_tensor *pooled,
                        const char *pooled_name, const mmd_tensor *argmax_y,
                        const mmd_tensor *argmax_x, int64_t aligned_height,
                        int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,
                        int64_t pool_mode, unsigned float_mask) {
    int s = check_scalars(aligned_height, aligned_width, spatial_scale, sampling_ratio, pool_mode);
    const int64_t any4[4] = {MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM, MMD_ANY_DIM};
    const int64_t roi_shape[2] = {MMD_ANY_DIM, 5};
    if (!s) s = mmd_check_shape(feature, feature_name, 4, any4);
    if (!s) s = mmd_check_dtype(feature, feature_name, float_mask);
    if (!s) s = mmd_check_contiguous(feature, feature_name);
    if (!s) s = check_like(rois, "rois", 2, roi_shape, feature, feature_name);
    if (s) return s;
    const int64_t pooled_shape[4] = {rois->shape[0], feature->shape[1], aligned_height,
                                     aligned_width};
    s = check_like(pooled, pooled_name, 4, pooled_shape, feature, feature_name);
    if (!s) s = check_argmax(argmax_y, "argmax_y", pooled_shape, pool_mode, feature, feature_name);
    if (!s) s = check_argmax(argmax_x, "argmax_x", pooled_shape, pool_mode, feature, feature_name);
    return s;
}

int mmd_roi_align_forward_check(const mmd_tensor *input, const mmd_tensor *rois,
                                const mmd_tensor *output, const mmd_tensor *argmax_y,
                                const mmd_tensor *argmax_x, int64_t aligned_height,
                                int64_t aligned_width, double spatial_scale,
                                int64_t sampling_ratio, int64_t pool_mode, unsigned float_mask) {
    return check_arrays(input, "input", rois, output, "output", argmax_y, argmax_x,
                        aligned_height, aligned_width, spatial_scale, sampling_ratio, pool_mode,
                        float_mask);
}

int mmd_roi_align_backward_check(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                 const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
                                 const mmd_tensor *grad_input, int64_t aligned_height,
                                 int64_t aligned_width, double spatial_scale,
                                 int64_t sampling_ratio, int64_t pool_mode, unsigned float_mask) {
    /* dtypes are reported against grad_output, which the user passed (the op
     * layer allocates grad_input like it) */
    int s = mmd_check_dtype(grad_output, "grad_output", float_mask);
    if (!s) s = mmd_check_same_dtype(rois, "rois", grad_output, "grad_output");
    if (!s) s = check_arrays(grad_input, "grad_input", rois, grad_output, "grad_output", argmax_y,
                             argmax_x, aligned_height, aligned_width, spatial_scale,
                             sampling_ratio, pool_mode, float_mask);
    return s;
}

typedef enum { RUN_DEFAULT, RUN_REFERENCE } run_kind;

static int roi_align_forward_run(run_kind kind, const mmd_tensor *input, const mmd_tensor *rois,
                                 const mmd_tensor *output, const mmd_tensor *argmax_y,
                                 const mmd_tensor *argmax_x, int64_t aligned_height,
                                 int64_t aligned_width, double spatial_scale,
                                 int64_t sampling_ratio, int64_t pool_mode, int aligned) {
    int s = mmd_roi_align_forward_check(input, rois, output, argmax_y, argmax_x, aligned_height,
                                        aligned_width, spatial_scale, sampling_ratio, pool_mode,
                                        MMD_FLOAT32_64);
    if (s) return s;
    const int ref = kind == RUN_REFERENCE;
    if (input->dtype == MMD_FLOAT32)
        return roi_align_forward_f32(ref, input, rois, output, argmax_y, argmax_x,
                                     aligned_height, aligned_width, (float)spatial_scale,
                                     sampling_ratio, pool_mode, aligned);
    return roi_align_forward_f64(ref, input, rois, output, argmax_y, argmax_x, aligned_height,
                                 aligned_width, spatial_scale, sampling_ratio, pool_mode, aligned);
}

static int roi_align_backward_run(run_kind kind, const mmd_tensor *grad_output,
                                  const mmd_tensor *rois, const mmd_tensor *argmax_y,
                                  const mmd_tensor *argmax_x, const mmd_tensor *grad_input,
                                  int64_t aligned_height, int64_t aligned_width,
                                  double spatial_scale, int64_t sampling_ratio, int64_t pool_mode,
                                  int aligned) {
    int s = mmd_roi_align_backward_check(grad_output, rois, argmax_y, argmax_x, grad_input,
                                         aligned_height, aligned_width, spatial_scale,
                                         sampling_ratio, pool_mode, MMD_FLOAT32_64);
    if (s) return s;
    const int ref = kind == RUN_REFERENCE;
    if (grad_input->dtype == MMD_FLOAT32)
        return roi_align_backward_f32(ref, grad_output, rois, argmax_y, argmax_x, grad_input,
                                      aligned_height, aligned_width, (float)spatial_scale,
                                      sampling_ratio, pool_mode, aligned);
    return roi_align_backward_f64(ref, grad_output, rois, argmax_y, argmax_x, grad_input,
                                  aligned_height, aligned_width, spatial_scale, sampling_ratio,
                                  pool_mode, aligned);
}

/* The registered entry points: one per backend, all with the generated
 * mmd_roi_align_forward_impl_fn / _backward_impl_fn signatures. */
#define DEFINE_ENTRY_POINTS(suffix, kind)                                                     \
    static int roi_align_forward_cpu##suffix(                                                 \
        const mmd_tensor *input, const mmd_tensor *rois, const mmd_tensor *output,            \
        const mmd_tensor *argmax_y, const mmd_tensor *argmax_x, int64_t aligned_height,       \
        int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,                  \
        int64_t pool_mode, int aligned, const mmd_context *ctx) {                             \
        (void)ctx;                                                                            \
        return roi_align_forward_run(kind, input, rois, output, argmax_y, argmax_x,           \
                                     aligned_height, aligned_width, spatial_scale,            \
                                     sampling_ratio, pool_mode, aligned);                     \
    }                                                                                         \
    static int roi_align_backward_cpu##suffix(                                                \
        const mmd_tensor *grad_output, const mmd_tensor *rois, const mmd_tensor *argmax_y,    \
        const mmd_tensor *argmax_x, const mmd_tensor *grad_input, int64_t aligned_height,     \
        int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,                  \
        int64_t pool_mode, int aligned, const mmd_context *ctx) {                             \
        (void)ctx;                                                                            \
        return roi_align_backward_run(kind, grad_output, rois, argmax_y, argmax_x,            \
                                      grad_input, aligned_height, aligned_width,              \
                                      spatial_scale, sampling_ratio, pool_mode, aligned);     \
    }
DEFINE_ENTRY_POINTS(, RUN_DEFAULT)
DEFINE_ENTRY_POINTS(_reference, RUN_REFERENCE)

#include "mmdispatch_generated.h"

MMD_REGISTRATIONS(cpu, roi_align) {
    MMD_REGISTER_DEVICE_IMPL(roi_align_forward_impl, CPU, DEFAULT, roi_align_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_align_forward_impl, CPU, REFERENCE,
                             roi_align_forward_cpu_reference);
    MMD_REGISTER_DEVICE_IMPL(roi_align_backward_impl, CPU, DEFAULT, roi_align_backward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_align_backward_impl, CPU, REFERENCE,
                             roi_align_backward_cpu_reference);
}

#else /* typed kernels, instantiated above for float and double */
#define T MMD_REAL
#define TFN MMD_FN

typedef TFN(mmd_roi_geometry) TFN(geometry);
typedef TFN(mmd_interp_axis) TFN(axis);

/* Validates every roi (the map is on the host here) and reports the first
 * bad one; kernels then only see valid geometry. */
static int TFN(check_rois)(const mmd_tensor *rois, int64_t batch_size, T spatial_scale,
                           int64_t pooled_h, int64_t pooled_w, int64_t sampling_ratio,
                           int aligned) {
    const T *r = (const T *)rois->data;
    for (int64_t k = 0; k < rois->shape[0]; ++k) {
        TFN(geometry) g = {0};
        int code = TFN(mmd_roi_align_geometry)(r + 5 * k, batch_size, spatial_scale, pooled_h,
                                               pooled_w, sampling_ratio, aligned, &g);
        if (code != MMD_ROI_OK) return mmd_roi_error(code, k, batch_size);
    }
    return MMD_OK;
}

/* One bilinear sample from a (H, W) plane given both axes' weights. */
static inline T TFN(sample)(const T *plane, int64_t width, const TFN(axis) *ay,
                            const TFN(axis) *ax) {
    const T *row_low = plane + ay->low * width;
    const T *row_high = plane + ay->high * width;
    return ay->w_low * (ax->w_low * row_low[ax->low] + ax->w_high * row_low[ax->high]) +
           ay->w_high * (ax->w_low * row_high[ax->low] + ax->w_high * row_high[ax->high]);
}

static inline void TFN(scatter)(T *plane, int64_t width, const TFN(axis) *ay,
                                const TFN(axis) *ax, T g) {
    T *row_low = plane + ay->low * width;
    T *row_high = plane + ay->high * width;
    row_low[ax->low] += g * ay->w_low * ax->w_low;
    row_low[ax->high] += g * ay->w_low * ax->w_high;
    row_high[ax->low] += g * ay->w_high * ax->w_low;
    row_high[ax->high] += g * ay->w_high * ax->w_high;
}

/* Per-thread room for one roi's axis weights: on the stack for the usual
 * sizes (7x7 bins of up to 9 samples a side fit), on the heap beyond. */
#define SCRATCH_INLINE 64
typedef struct {
    TFN(axis) *rows, *cols;
    size_t rows_cap, cols_cap;
    TFN(axis) rows_inline[SCRATCH_INLINE], cols_inline[SCRATCH_INLINE];
} TFN(scratch);

static void TFN(scratch_init)(TFN(scratch) *s) {
    s->rows = s->rows_inline;
    s->cols = s->cols_inline;
    s->rows_cap = s->cols_cap = SCRATCH_INLINE;
}


/* Geometry of roi `roi` (already validated) and room for its weights in
 * `s`; 0 when out of memory (s stays valid for TFN(scratch_free)). */
static int TFN(prepare_roi)(const T *roi, int64_t batch, T spatial_scale, int64_t pooled_h,
                            int64_t pooled_w, int64_t sampling_ratio, int aligned,
                            TFN(geometry) *g, TFN(scratch) *s) {
    TFN(mmd_roi_align_geometry)(roi, batch, spatial_scale, pooled_h, pooled_w, sampling_ratio,
                                aligned, g);
    return grow((void **)&s->rows, &s->rows_cap, (size_t)(pooled_h * g->grid_h + 1),
                sizeof *s->rows, s->rows_inline) &&
           grow((void **)&s->cols, &s->cols_cap, (size_t)(pooled_w * g->grid_w + 1),
                sizeof *s->cols, s->cols_inline);
}

static void TFN(scratch_free)(TFN(scratch) *s) {
    if (s->rows != s->rows_inline) free(s->rows);
    if (s->cols != s->cols_inline) free(s->cols);
}

/* Interpolation weights of every sample row (ph, iy) and column (pw, ix) of
 * one roi; bilinear weights are their products. */
static void TFN(axis_weights)(const TFN(geometry) *g, int64_t height, int64_t width,
                              int64_t pooled_h, int64_t pooled_w, TFN(axis) *rows,
                              TFN(axis) *cols) {
    for (int64_t ph = 0; ph < pooled_h; ++ph)
        for (int64_t iy = 0; iy < g->grid_h; ++iy)
            TFN(mmd_interp)(TFN(mmd_roi_align_sample)(g->start_h, g->bin_h, ph, iy, g->grid_h),
                            height, &rows[ph * g->grid_h + iy]);
    for (int64_t pw = 0; pw < pooled_w; ++pw)
        for (int64_t ix = 0; ix < g->grid_w; ++ix)
            TFN(mmd_interp)(TFN(mmd_roi_align_sample)(g->start_w, g->bin_w, pw, ix, g->grid_w),
                            width, &cols[pw * g->grid_w + ix]);
}

/* Every roi's geometry and axis weights, computed once per call and shared
 * read-only by the channel workers (which would otherwise recompute them
 * for every channel). Only for a fixed sampling_ratio, where every roi has
 * the same number of samples, and only when it is small: no larger than the
 * output (a roi's entries, 936 bytes for float 7x7 at sampling_ratio 2,
 * against its C * 7 * 7 outputs: 2% of the output at 256 channels) and
 * than ROI_TABLE_MAX_BYTES. Without it (weights == NULL) workers compute
 * each roi's weights themselves. */
#define ROI_TABLE_MAX_BYTES ((size_t)32 << 20)
typedef struct {
    TFN(geometry) *geometry;
    TFN(axis) *weights;   /* roi k: rows at k * stride, then its columns */
    int64_t stride;
} TFN(roi_table);

static void TFN(roi_table_build)(TFN(roi_table) *t, const T *rois, int64_t num_rois,
                                 int64_t batch, int64_t height, int64_t width,
                                 T spatial_scale, int64_t pooled_h, int64_t pooled_w,
                                 int64_t sampling_ratio, int aligned, int64_t channels) {
    t->geometry = NULL;
    t->weights = NULL;
    if (sampling_ratio <= 0 || channels < 2) return;
    t->stride = (pooled_h + pooled_w) * sampling_ratio;
    const size_t per_roi = sizeof *t->geometry + (size_t)t->stride * sizeof *t->weights;
    if (per_roi > (size_t)(channels * pooled_h * pooled_w) * sizeof(T) ||
        (size_t)num_rois > ROI_TABLE_MAX_BYTES / per_roi)
        return;
    t->geometry = malloc((size_t)num_rois * sizeof *t->geometry + 1);
    t->weights = malloc((size_t)(num_rois * t->stride) * sizeof *t->weights + 1);
    if (!t->geometry || !t->weights) {
        free(t->geometry);
        free(t->weights);
        t->geometry = NULL;
        t->weights = NULL;
        return;
    }
    for (int64_t k = 0; k < num_rois; ++k) {
        TFN(axis) *rows = t->weights + k * t->stride;
        TFN(mmd_roi_align_geometry)(rois + 5 * k, batch, spatial_scale, pooled_h, pooled_w,
                                    sampling_ratio, aligned, &t->geometry[k]);
        TFN(axis_weights)(&t->geometry[k], height, width, pooled_h, pooled_w, rows,
                          rows + pooled_h * sampling_ratio);
    }
}

static void TFN(roi_table_free)(TFN(roi_table) *t) {
    free(t->geometry);
    free(t->weights);
}

/* Roi k's geometry and weights: from the table when there is one, else
 * computed into the worker's scratch; 0 when out of memory. */
static int TFN(roi_weights)(const TFN(roi_table) *t, const T *rois, int64_t k, int64_t batch,
                            int64_t height, int64_t width, T spatial_scale, int64_t pooled_h,
                            int64_t pooled_w, int64_t sampling_ratio, int aligned,
                            int need_weights, TFN(geometry) *g, TFN(scratch) *s,
                            const TFN(axis) **rows, const TFN(axis) **cols) {
    if (t && t->weights) {
        *g = t->geometry[k];
        *rows = t->weights + k * t->stride;
        *cols = *rows + pooled_h * g->grid_h;
        return 1;
    }
    if (!TFN(prepare_roi)(rois + 5 * k, batch, spatial_scale, pooled_h, pooled_w,
                          sampling_ratio, aligned, g, s))
        return 0;
    if (need_weights) TFN(axis_weights)(g, height, width, pooled_h, pooled_w, s->rows, s->cols);
    *rows = s->rows;
    *cols = s->cols;
    return 1;
}

/* An axis's samples folded into dense per-pixel weights, one span per bin:
 * bin p reads pixels [lo, lo + len) with weights w[off .. off + len). With
 * adaptive sampling (sampling_ratio <= 0) samples are at most one pixel
 * apart, so the pixels a bin's samples read are exactly such a span: a pixel
 * inside it is read by some sample, and NaN or inf there propagates as in
 * the sample-by-sample sum. */
typedef struct {
    int64_t lo, len, off;
} TFN(span);

typedef struct {
    TFN(span) *spans;
    T *w;
    size_t spans_cap, w_cap;
} TFN(dense_axis);

/* Folds `pooled` bins of `grid` samples each (from axis_weights) into d. */
static int TFN(dense_weights)(const TFN(axis) *samples, int64_t pooled, int64_t grid,
                              TFN(dense_axis) *d) {
    if (!grow((void **)&d->spans, &d->spans_cap, (size_t)pooled, sizeof *d->spans, NULL))
        return 0;
    int64_t total = 0;
    for (int64_t p = 0; p < pooled; ++p) {
        int64_t lo = INT64_MAX, hi = -1;
        for (int64_t i = 0; i < grid; ++i) {
            const TFN(axis) *a = &samples[p * grid + i];
            if (!a->valid) continue;
            if (a->low < lo) lo = a->low;
            if (a->high > hi) hi = a->high;
        }
        d->spans[p].lo = hi >= 0 ? lo : 0;
        d->spans[p].len = hi >= 0 ? hi - lo + 1 : 0;
        d->spans[p].off = total;
        total += d->spans[p].len;
    }
    if (!grow((void **)&d->w, &d->w_cap, (size_t)total + 1, sizeof *d->w, NULL)) return 0;
    memset(d->w, 0, (size_t)total * sizeof *d->w);
    for (int64_t p = 0; p < pooled; ++p) {
        T *w = d->w + d->spans[p].off - d->spans[p].lo;
        for (int64_t i = 0; i < grid; ++i) {
            const TFN(axis) *a = &samples[p * grid + i];
            if (!a->valid) continue;
            w[a->low] += a->w_low;
            w[a->high] += a->w_high;
        }
    }
    return 1;
}

static void TFN(dense_free)(TFN(dense_axis) *d) {
    free(d->spans);
    free(d->w);
}

/* One roi's dense weights along both axes, the columns [x0, x1) its bins
 * read, and a row accumulator over them; reused from roi to roi. */
typedef struct {
    TFN(dense_axis) rows, cols;
    T *acc;
    size_t acc_cap;
    int64_t x0, x1;
} TFN(dense);

static int TFN(dense_prepare)(TFN(dense) *d, const TFN(axis) *rows, const TFN(axis) *cols,
                              const TFN(geometry) *g, int64_t pooled_h, int64_t pooled_w) {
    if (!TFN(dense_weights)(rows, pooled_h, g->grid_h, &d->rows) ||
        !TFN(dense_weights)(cols, pooled_w, g->grid_w, &d->cols))
        return 0;
    d->x0 = INT64_MAX;
    d->x1 = 0;
    for (int64_t p = 0; p < pooled_w; ++p) {
        const TFN(span) cs = d->cols.spans[p];
        if (!cs.len) continue;
        if (cs.lo < d->x0) d->x0 = cs.lo;
        if (cs.lo + cs.len > d->x1) d->x1 = cs.lo + cs.len;
    }
    if (d->x1 == 0) d->x0 = 0;
    return grow((void **)&d->acc, &d->acc_cap, (size_t)(d->x1 - d->x0) + 1, sizeof *d->acc,
                NULL);
}

static void TFN(dense_release)(TFN(dense) *d) {
    TFN(dense_free)(&d->rows);
    TFN(dense_free)(&d->cols);
    free(d->acc);
}

/* Avg pooling of every bin of one roi and channel from dense weights, in two
 * passes per bin row: the weighted source rows are summed over the columns
 * the roi reads (an axpy, vectorisable), then each bin takes the dot product
 * of that sum with its column weights. */
static void TFN(pool_dense)(const T *plane, int64_t width, const TFN(geometry) *g,
                            const TFN(dense) *d, int64_t pooled_h, int64_t pooled_w, T *out) {
    const int64_t count = g->grid_h * g->grid_w;
    const int64_t n = d->x1 - d->x0;
    T *restrict acc = d->acc;
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        const TFN(span) rs = d->rows.spans[ph];
        for (int64_t x = 0; x < n; ++x) acc[x] = 0;
        for (int64_t yy = 0; yy < rs.len; ++yy) {
            const T wy = d->rows.w[rs.off + yy];
            const T *restrict src = plane + (rs.lo + yy) * width + d->x0;
            for (int64_t x = 0; x < n; ++x) acc[x] += wy * src[x];
        }
        T *o = out + ph * pooled_w;
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const TFN(span) cs = d->cols.spans[pw];
            const T *wx = d->cols.w + cs.off, *a = acc + (cs.lo - d->x0);
            T sum = 0;
            for (int64_t xx = 0; xx < cs.len; ++xx) sum += wx[xx] * a[xx];
            o[pw] = sum / (T)(count > 1 ? count : 1);
        }
    }
}

/* Backward of pool_dense for one roi and channel: per bin row, the bins'
 * shares spread over their columns (acc), then added to each source row with
 * its row weight (an axpy). */
static void TFN(scatter_dense)(T *plane, int64_t width, const TFN(geometry) *g,
                               const TFN(dense) *d, int64_t pooled_h, int64_t pooled_w,
                               const T *grad) {
    const int64_t count = g->grid_h * g->grid_w;
    const int64_t n = d->x1 - d->x0;
    T *restrict acc = d->acc;
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        const TFN(span) rs = d->rows.spans[ph];
        if (!rs.len) continue;
        for (int64_t x = 0; x < n; ++x) acc[x] = 0;
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const TFN(span) cs = d->cols.spans[pw];
            const T share = grad[ph * pooled_w + pw] / (T)(count > 1 ? count : 1);
            const T *wx = d->cols.w + cs.off;
            T *a = acc + (cs.lo - d->x0);
            for (int64_t xx = 0; xx < cs.len; ++xx) a[xx] += share * wx[xx];
        }
        for (int64_t yy = 0; yy < rs.len; ++yy) {
            const T wy = d->rows.w[rs.off + yy];
            T *restrict dst = plane + (rs.lo + yy) * width + d->x0;
            for (int64_t x = 0; x < n; ++x) dst[x] += wy * acc[x];
        }
    }
}

/* Whether all of `n` values are finite. The dense passes fold the samples
 * reading a pixel into one weight, so a sample whose weight is exactly 0
 * no longer multiplies the pixel: 0 * inf = NaN of the sample-by-sample sum
 * would be lost. Planes or gradients holding inf take the sample path. */
static int TFN(all_finite)(const T *v, int64_t n) {
    int finite = 1;
    for (int64_t i = 0; i < n; ++i) finite &= isfinite(v[i]) != 0;
    return finite;
}

/* Whether a roi's avg pooling goes through dense weights: adaptive sampling
 * (so samples are at most a pixel apart) with enough samples per bin that
 * reading each pixel once beats reading four per sample. */
static inline int TFN(use_dense)(const TFN(geometry) *g, int64_t sampling_ratio,
                                 int64_t pool_mode) {
    return pool_mode == MMD_POOL_AVG && sampling_ratio <= 0 && g->grid_h * g->grid_w >= 4;
}

/* The avg sum of one bin (its sample rows `bin_rows`, its sample columns
 * `bin_cols`), before the division. Bilinear weights factor by axis: each
 * sample row's two source rows are summed over the bin's columns first, then
 * weighted once. CHECK (a constant at every call) skips samples off the map;
 * without it every sample must be on the map. */
static inline T TFN(avg_bin_sum)(const T *plane, int64_t width, const TFN(axis) *bin_rows,
                                 const TFN(axis) *bin_cols, int64_t grid_h, int64_t grid_w,
                                 const int CHECK) {
    T sum = 0;
    for (int64_t iy = 0; iy < grid_h; ++iy) {
        const TFN(axis) *ay = &bin_rows[iy];
        if (CHECK && !ay->valid) continue;
        const T *row_low = plane + ay->low * width, *row_high = plane + ay->high * width;
        T sum_low = 0, sum_high = 0;
        for (int64_t ix = 0; ix < grid_w; ++ix) {
            const TFN(axis) *ax = &bin_cols[ix];
            if (CHECK && !ax->valid) continue;
            sum_low += ax->w_low * row_low[ax->low] + ax->w_high * row_low[ax->high];
            sum_high += ax->w_low * row_high[ax->low] + ax->w_high * row_high[ax->high];
        }
        sum += ay->w_low * sum_low + ay->w_high * sum_high;
    }
    return sum;
}

/* Pools one bin from precomputed axis weights. Max mode records the sample
 * coordinates of the maximum (MMCV's argmax_y/argmax_x) for backward. */
static inline void TFN(pool_bin)(const T *plane, int64_t width, const TFN(geometry) *g,
                                 const TFN(axis) *rows, const TFN(axis) *cols, int64_t ph,
                                 int64_t pw, int64_t pool_mode, T *out, T *arg_y, T *arg_x) {
    const int64_t count = g->grid_h * g->grid_w;
    if (pool_mode == MMD_POOL_AVG) {
        *out = TFN(avg_bin_sum)(plane, width, &rows[ph * g->grid_h], &cols[pw * g->grid_w],
                                g->grid_h, g->grid_w, 1) /
               (T)(count > 1 ? count : 1);
        return;
    }
    TFN(mmd_max_state) m;
    TFN(mmd_max_init)(&m);
    for (int64_t iy = 0; iy < g->grid_h; ++iy) {
        const TFN(axis) *ay = &rows[ph * g->grid_h + iy];
        for (int64_t ix = 0; ix < g->grid_w; ++ix) {
            const TFN(axis) *ax = &cols[pw * g->grid_w + ix];
            T v = (ay->valid && ax->valid) ? TFN(sample)(plane, width, ay, ax) : (T)0;
            TFN(mmd_max_update)(&m, v,
                                TFN(mmd_roi_align_sample)(g->start_h, g->bin_h, ph, iy, g->grid_h),
                                TFN(mmd_roi_align_sample)(g->start_w, g->bin_w, pw, ix, g->grid_w));
        }
    }
    *out = TFN(mmd_max_value)(&m);
    *arg_y = m.y;
    *arg_x = m.x;
}

/* Whether all of a roi's samples lie on the map (rows, then columns). */
static int TFN(all_valid)(const TFN(axis) *rows, int64_t n_rows, const TFN(axis) *cols,
                          int64_t n_cols) {
    int valid = 1;
    for (int64_t i = 0; i < n_rows; ++i) valid &= rows[i].valid;
    for (int64_t i = 0; i < n_cols; ++i) valid &= cols[i].valid;
    return valid;
}

/* Avg pooling of every bin of one roi and channel whose samples all lie on
 * the map: pool_bin's sums (avg_bin_sum, so the results are the same to the
 * bit) without its validity tests, a column of bins at a time. `GW` is the
 * grid width when it is known when compiling (the loop over a bin's columns
 * unrolls), else 0. */
static inline void TFN(pool_valid_roi_grid)(const T *plane, int64_t width, int64_t grid_h,
                                            int64_t grid_w, const TFN(axis) *rows,
                                            const TFN(axis) *cols, int64_t pooled_h,
                                            int64_t pooled_w, T *out, const int64_t GW) {
    const int64_t gw = GW ? GW : grid_w;
    const int64_t count = grid_h * gw;
    const T divisor = (T)(count > 1 ? count : 1);
    /* x / 2^k and x * 2^-k are the same real number, so they round to the
     * same float; the multiply is much cheaper than the divide */
    const int pow2 = (count & (count - 1)) == 0;
    const T scale = (T)1 / divisor;
    for (int64_t pw = 0; pw < pooled_w; ++pw)
        for (int64_t ph = 0; ph < pooled_h; ++ph) {
            const T sum = TFN(avg_bin_sum)(plane, width, &rows[ph * grid_h], &cols[pw * gw],
                                           grid_h, gw, 0);
            out[ph * pooled_w + pw] = pow2 ? sum * scale : sum / divisor;
        }
}

static void TFN(pool_valid_roi)(const T *plane, int64_t width, const TFN(geometry) *g,
                                const TFN(axis) *rows, const TFN(axis) *cols, int64_t pooled_h,
                                int64_t pooled_w, T *out) {
    if (g->grid_w == 2)
        TFN(pool_valid_roi_grid)(plane, width, g->grid_h, 2, rows, cols, pooled_h, pooled_w, out,
                                 2);
    else
        TFN(pool_valid_roi_grid)(plane, width, g->grid_h, g->grid_w, rows, cols, pooled_h,
                                 pooled_w, out, 0);
}

/* Everything a worker needs to pool one channel of every roi. */
typedef struct {
    const T *in, *rois;
    T *out, *am_y, *am_x;
    int64_t batch, channels, height, width, num_rois, pooled_h, pooled_w;
    T spatial_scale;
    int64_t sampling_ratio, pool_mode;
    int aligned;
    const TFN(roi_table) *table;
} TFN(forward_job);

/* Pools channel c of every roi; 0 when out of memory. */
static int TFN(forward_channel)(const TFN(forward_job) *j, int64_t c) {
    const int64_t bins = j->pooled_h * j->pooled_w;
    const int64_t plane_size = j->height * j->width;
    TFN(scratch) sc;
    TFN(scratch_init)(&sc);
    TFN(dense) dense = {0};
    int finite = -1;  /* channel c of every image is finite; -1: not checked yet */
    int ok = 1;
    for (int64_t k = 0; k < j->num_rois && ok; ++k) {
        TFN(geometry) g = {0};
        const TFN(axis) *rows, *cols;
        ok = TFN(roi_weights)(j->table, j->rois, k, j->batch, j->height, j->width,
                              j->spatial_scale, j->pooled_h, j->pooled_w, j->sampling_ratio,
                              j->aligned, 1, &g, &sc, &rows, &cols);
        if (!ok) break;
        const T *plane = j->in + (g.batch * j->channels + c) * j->height * j->width;
        const int use_dense = TFN(use_dense)(&g, j->sampling_ratio, j->pool_mode);
        if (use_dense && finite < 0) {
            finite = 1;
            for (int64_t n = 0; n < j->batch; ++n)
                finite &= TFN(all_finite)(j->in + (n * j->channels + c) * plane_size,
                                          plane_size);
        }
        if (use_dense && finite) {
            ok = TFN(dense_prepare)(&dense, rows, cols, &g, j->pooled_h, j->pooled_w);
            if (!ok) break;
            TFN(pool_dense)(plane, j->width, &g, &dense, j->pooled_h, j->pooled_w,
                            j->out + (k * j->channels + c) * bins);
            continue;
        }
        if (j->pool_mode == MMD_POOL_AVG &&
            TFN(all_valid)(rows, j->pooled_h * g.grid_h, cols, j->pooled_w * g.grid_w)) {
            TFN(pool_valid_roi)(plane, j->width, &g, rows, cols, j->pooled_h, j->pooled_w,
                                j->out + (k * j->channels + c) * bins);
            continue;
        }
        for (int64_t ph = 0; ph < j->pooled_h; ++ph)
            for (int64_t pw = 0; pw < j->pooled_w; ++pw) {
                const int64_t o = (k * j->channels + c) * bins + ph * j->pooled_w + pw;
                TFN(pool_bin)(plane, j->width, &g, rows, cols, ph, pw, j->pool_mode,
                              &j->out[o], j->am_y ? &j->am_y[o] : NULL,
                              j->am_x ? &j->am_x[o] : NULL);
            }
    }
    TFN(scratch_free)(&sc);
    TFN(dense_release)(&dense);
    return ok;
}

static int TFN(forward_channel_cb)(const void *job, int64_t c) {
    return TFN(forward_channel)((const TFN(forward_job) *)job, c);
}

static int TFN(roi_align_forward)(int reference, const mmd_tensor *input, const mmd_tensor *rois,
                                  const mmd_tensor *output, const mmd_tensor *argmax_y,
                                  const mmd_tensor *argmax_x, int64_t pooled_h, int64_t pooled_w,
                                  T spatial_scale, int64_t sampling_ratio, int64_t pool_mode,
                                  int aligned) {
    const int64_t batch = input->shape[0], channels = input->shape[1];
    const int64_t height = input->shape[2], width = input->shape[3];
    const int64_t num_rois = rois->shape[0];
    int s = TFN(check_rois)(rois, batch, spatial_scale, pooled_h, pooled_w, sampling_ratio,
                            aligned);
    if (s || mmd_numel(output) == 0) return s;
    const T *in = (const T *)input->data;
    const T *r = (const T *)rois->data;
    T *out = (T *)output->data;
    T *am_y = pool_mode == MMD_POOL_MAX ? (T *)argmax_y->data : NULL;
    T *am_x = pool_mode == MMD_POOL_MAX ? (T *)argmax_x->data : NULL;
    const int64_t bins = pooled_h * pooled_w;
    int failed = 0;

    if (reference) {
        /* one roi, channel and sample at a time, straight from the definition */
        for (int64_t k = 0; k < num_rois && !failed; ++k) {
            TFN(geometry) g = {0};
            TFN(scratch) sc;
            TFN(scratch_init)(&sc);
            failed = !TFN(prepare_roi)(r + 5 * k, batch, spatial_scale, pooled_h, pooled_w,
                                       sampling_ratio, aligned, &g, &sc);
            TFN(axis) *rows = sc.rows, *cols = sc.cols;
            for (int64_t c = 0; c < channels && !failed; ++c) {
                const T *plane = in + (g.batch * channels + c) * height * width;
                for (int64_t ph = 0; ph < pooled_h; ++ph)
                    for (int64_t pw = 0; pw < pooled_w; ++pw) {
                        const int64_t o = (k * channels + c) * bins + ph * pooled_w + pw;
                        for (int64_t iy = 0; iy < g.grid_h; ++iy)
                            TFN(mmd_interp)(TFN(mmd_roi_align_sample)(g.start_h, g.bin_h, ph,
                                                                      iy, g.grid_h),
                                            height, &rows[ph * g.grid_h + iy]);
                        for (int64_t ix = 0; ix < g.grid_w; ++ix)
                            TFN(mmd_interp)(TFN(mmd_roi_align_sample)(g.start_w, g.bin_w, pw,
                                                                      ix, g.grid_w),
                                            width, &cols[pw * g.grid_w + ix]);
                        TFN(pool_bin)(plane, width, &g, rows, cols, ph, pw, pool_mode, &out[o],
                                      am_y ? &am_y[o] : NULL, am_x ? &am_x[o] : NULL);
                    }
            }
            TFN(scratch_free)(&sc);
        }
        return failed ? mmd_error(MMD_ERR_MEMORY, "out of memory for interpolation weights")
                      : MMD_OK;
    }

    /* Threads own channels and visit every roi, so a thread keeps reading
     * the same (H, W) planes from cache instead of streaming the whole map
     * once per roi. Per-roi weights come from the shared table, or are
     * recomputed per channel without one (O(pooled * grid) against
     * O(pooled^2 * grid^2) samples). */
    TFN(roi_table) table;
    TFN(roi_table_build)(&table, r, num_rois, batch, height, width, spatial_scale, pooled_h,
                         pooled_w, sampling_ratio, aligned, channels);
    const TFN(forward_job) job = {in, r, out, am_y, am_x, batch, channels, height, width, num_rois,
                             pooled_h, pooled_w, spatial_scale, sampling_ratio, pool_mode,
                             aligned, &table};
    s = for_each_channel(TFN(forward_channel_cb), &job, channels,
                         mmd_worth_threads(channels, channels * num_rois * bins));
    TFN(roi_table_free)(&table);
    return s;
}

/* Adds `share` (a bin's gradient over its sample count) times each
 * sample's bilinear weights into the plane: avg_bin_sum in reverse, CHECK as
 * there. */
static inline void TFN(avg_bin_scatter)(T *plane, int64_t width, const TFN(axis) *bin_rows,
                                        const TFN(axis) *bin_cols, int64_t grid_h,
                                        int64_t grid_w, T share, const int CHECK) {
    for (int64_t iy = 0; iy < grid_h; ++iy) {
        const TFN(axis) *ay = &bin_rows[iy];
        if (CHECK && !ay->valid) continue;
        /* (share * w_y) * w_x: the products scatter() forms, hoisted */
        T *row_low = plane + ay->low * width, *row_high = plane + ay->high * width;
        const T g_low = share * ay->w_low, g_high = share * ay->w_high;
        for (int64_t ix = 0; ix < grid_w; ++ix) {
            const TFN(axis) *ax = &bin_cols[ix];
            if (CHECK && !ax->valid) continue;
            row_low[ax->low] += g_low * ax->w_low;
            row_low[ax->high] += g_low * ax->w_high;
            row_high[ax->low] += g_high * ax->w_low;
            row_high[ax->high] += g_high * ax->w_high;
        }
    }
}

/* Adds one bin's gradient into its (H, W) plane. */
static inline void TFN(backward_bin)(T *plane, int64_t height, int64_t width,
                                     const TFN(geometry) *g, const TFN(axis) *rows,
                                     const TFN(axis) *cols, int64_t ph, int64_t pw,
                                     int64_t pool_mode, T grad, T arg_y, T arg_x) {
    if (pool_mode == MMD_POOL_MAX) {
        if (arg_y == (T)-1) return; /* no sample was taken in forward */
        TFN(axis) ay, ax;
        TFN(mmd_interp)(arg_y, height, &ay);
        TFN(mmd_interp)(arg_x, width, &ax);
        if (ay.valid && ax.valid) TFN(scatter)(plane, width, &ay, &ax, grad);
        return;
    }
    const int64_t count = g->grid_h * g->grid_w;
    TFN(avg_bin_scatter)(plane, width, &rows[ph * g->grid_h], &cols[pw * g->grid_w], g->grid_h,
                         g->grid_w, grad / (T)(count > 1 ? count : 1), 1);
}

/* Backward of pool_valid_roi: backward_bin's avg scatter (avg_bin_scatter)
 * for every bin of one roi and channel, bins in the same order, so each
 * pixel's additions come in the same order and the results are the same to
 * the bit, without the validity tests. `GW` as in pool_valid_roi_grid. */
static inline void TFN(scatter_valid_roi_grid)(T *plane, int64_t width, int64_t grid_h,
                                               int64_t grid_w, const TFN(axis) *rows,
                                               const TFN(axis) *cols, int64_t pooled_h,
                                               int64_t pooled_w, const T *grad, const int64_t GW) {
    const int64_t gw = GW ? GW : grid_w;
    const int64_t count = grid_h * gw;
    const T divisor = (T)(count > 1 ? count : 1);
    const int pow2 = (count & (count - 1)) == 0;   /* as in pool_valid_roi_grid */
    const T scale = (T)1 / divisor;
    for (int64_t ph = 0; ph < pooled_h; ++ph)
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const T g = grad[ph * pooled_w + pw];
            TFN(avg_bin_scatter)(plane, width, &rows[ph * grid_h], &cols[pw * gw], grid_h, gw,
                                 pow2 ? g * scale : g / divisor, 0);
        }
}

static void TFN(scatter_valid_roi)(T *plane, int64_t width, const TFN(geometry) *g,
                                   const TFN(axis) *rows, const TFN(axis) *cols,
                                   int64_t pooled_h, int64_t pooled_w, const T *grad) {
    if (g->grid_w == 2)
        TFN(scatter_valid_roi_grid)(plane, width, g->grid_h, 2, rows, cols, pooled_h, pooled_w,
                                    grad, 2);
    else
        TFN(scatter_valid_roi_grid)(plane, width, g->grid_h, g->grid_w, rows, cols, pooled_h,
                                    pooled_w, grad, 0);
}

/* Accumulates into grad_input (MMCV semantics: the caller passes zeros).
 * Each channel is owned by one thread and visits rois in order, so the
 * result does not depend on the thread count. */
typedef struct {
    const T *grad_output, *rois, *am_y, *am_x;
    T *grad_input;
    int64_t batch, channels, height, width, num_rois, pooled_h, pooled_w;
    T spatial_scale;
    int64_t sampling_ratio, pool_mode;
    int aligned;
    int reference;  /* the definition, sample by sample (the reference backend) */
    const TFN(roi_table) *table;
} TFN(backward_job);

/* Adds every roi's gradient into channel c of grad_input, rois in order;
 * 0 when out of memory. */
static int TFN(backward_channel)(const TFN(backward_job) *j, int64_t c) {
    const int64_t bins = j->pooled_h * j->pooled_w;
    TFN(scratch) sc;
    TFN(scratch_init)(&sc);
    TFN(dense) dense = {0};
    int ok = 1;
    for (int64_t k = 0; k < j->num_rois && ok; ++k) {
        TFN(geometry) g = {0};
        const TFN(axis) *rows, *cols;
        ok = TFN(roi_weights)(j->table, j->rois, k, j->batch, j->height, j->width,
                              j->spatial_scale, j->pooled_h, j->pooled_w, j->sampling_ratio,
                              j->aligned, j->pool_mode == MMD_POOL_AVG, &g, &sc, &rows, &cols);
        if (!ok) break;
        T *plane = j->grad_input + (g.batch * j->channels + c) * j->height * j->width;
        const int64_t base = (k * j->channels + c) * bins;
        if (!j->reference && TFN(use_dense)(&g, j->sampling_ratio, j->pool_mode) &&
            TFN(all_finite)(j->grad_output + base, bins)) {
            ok = TFN(dense_prepare)(&dense, rows, cols, &g, j->pooled_h, j->pooled_w);
            if (!ok) break;
            TFN(scatter_dense)(plane, j->width, &g, &dense, j->pooled_h, j->pooled_w,
                               j->grad_output + base);
            continue;
        }
        if (!j->reference && j->pool_mode == MMD_POOL_AVG &&
            TFN(all_valid)(rows, j->pooled_h * g.grid_h, cols, j->pooled_w * g.grid_w)) {
            TFN(scatter_valid_roi)(plane, j->width, &g, rows, cols, j->pooled_h, j->pooled_w,
                                   j->grad_output + base);
            continue;
        }
        for (int64_t ph = 0; ph < j->pooled_h; ++ph)
            for (int64_t pw = 0; pw < j->pooled_w; ++pw) {
                const int64_t o = base + ph * j->pooled_w + pw;
                TFN(backward_bin)(plane, j->height, j->width, &g, rows, cols, ph, pw,
                                  j->pool_mode, j->grad_output[o],
                                  j->am_y ? j->am_y[o] : (T)0, j->am_x ? j->am_x[o] : (T)0);
            }
    }
    TFN(scratch_free)(&sc);
    TFN(dense_release)(&dense);
    return ok;
}

static int TFN(backward_channel_cb)(const void *job, int64_t c) {
    return TFN(backward_channel)((const TFN(backward_job) *)job, c);
}

static int TFN(roi_align_backward)(int reference, const mmd_tensor *grad_output,
                                   const mmd_tensor *rois, const mmd_tensor *argmax_y,
                                   const mmd_tensor *argmax_x, const mmd_tensor *grad_input,
                                   int64_t pooled_h, int64_t pooled_w, T spatial_scale,
                                   int64_t sampling_ratio, int64_t pool_mode, int aligned) {
    const int64_t batch = grad_input->shape[0], channels = grad_input->shape[1];
    const int64_t height = grad_input->shape[2], width = grad_input->shape[3];
    const int64_t num_rois = rois->shape[0];
    int s = TFN(check_rois)(rois, batch, spatial_scale, pooled_h, pooled_w, sampling_ratio,
                            aligned);
    if (s || mmd_numel(grad_output) == 0 || mmd_numel(grad_input) == 0) return s;
    const T *go = (const T *)grad_output->data;
    const T *r = (const T *)rois->data;
    const T *am_y = pool_mode == MMD_POOL_MAX ? (const T *)argmax_y->data : NULL;
    const T *am_x = pool_mode == MMD_POOL_MAX ? (const T *)argmax_x->data : NULL;
    T *gi = (T *)grad_input->data;
    const int64_t bins = pooled_h * pooled_w;
    /* the reference backend computes every roi's weights itself */
    TFN(roi_table) table;
    TFN(roi_table_build)(&table, r, num_rois, batch, height, width, spatial_scale, pooled_h,
                         pooled_w, reference || pool_mode != MMD_POOL_AVG ? 0 : sampling_ratio,
                         aligned, channels);
    const TFN(backward_job) job = {go, r, am_y, am_x, gi, batch, channels, height, width,
                                   num_rois, pooled_h, pooled_w, spatial_scale,
                                   sampling_ratio, pool_mode, aligned, reference, &table};
    s = for_each_channel(TFN(backward_channel_cb), &job, channels,
                         !reference && mmd_worth_threads(channels, channels * num_rois * bins));
    TFN(roi_table_free)(&table);
    return s;
}

#undef T
#undef TFN
#endif
