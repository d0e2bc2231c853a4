/* roi_align on CPU, shared by its forward (roi_align_forward.cpp) and
 * backward (roi_align_backward.cpp): the call's parameters, roi validation,
 * and each roi's interpolation weights, computed once per axis (bilinear
 * weights are products of a row's and a column's), kept in a per-worker
 * scratch, in a table shared by the workers, or folded into dense per-pixel
 * weights; and the pieces of the channel groups (channel_groups.h) that
 * are roi_align's: a roi's bins of a group, and its bins' samples. */
#ifndef MMDISPATCH_CPU_ROI_ALIGN_WEIGHTS_H
#define MMDISPATCH_CPU_ROI_ALIGN_WEIGHTS_H

#include <stdlib.h>
#include <string.h>

#include <type_traits>

#include "mmdispatch/ops/roi_align.h"
#include "mmdispatch/parallel.h"
#include "channel_groups.h"
#include "heap_array.h"
#include "vec16.h"

namespace mmd_roi_align_cpu {

template <typename T> using Geometry = mmd_roi_geometry<T>;
template <typename T> using Axis = mmd_interp_axis<T>;

/* One call's arrays' shapes and scalars. The map is (batch, channels,
 * height, width); the pooled arrays (num_rois, channels, pooled_h,
 * pooled_w). `reference`: the definition, sample by sample, on one thread
 * (the reference backend). */
template <typename T> struct Call {
    typedef T value_type;
    static constexpr const char *op = "roi_align", *scratch = "interpolation weights";
    static constexpr bool bin_scratch = true;   /* channel groups: a roi's bins' sums */
    const T *rois;
    int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w;
    T spatial_scale;
    int64_t sampling_ratio, pool_mode;
    int aligned;
    bool reference;

    int64_t bins() const { return pooled_h * pooled_w; }
    const T *roi(int64_t k) const { return rois + 5 * k; }
    /* Roi k's geometry; MMD_ROI_OK or why the roi is rejected. */
    int geometry(int64_t k, Geometry<T> *g) const {
        return mmd_roi_align_geometry(roi(k), batch, spatial_scale, pooled_h, pooled_w,
                                      sampling_ratio, aligned, g);
    }
    /* Roi k's image and the cells it reads, 4 a sample (channel groups'
     * ImageRois: whether an image's interleaved planes pay); roi k valid. */
    double roi_reads(int64_t k, int64_t *image) const {
        Geometry<T> g{};
        geometry(k, &g);
        *image = g.batch;
        return 4.0 * (double)(bins() * g.grid_h * g.grid_w);
    }
    /* The cells every roi reads. */
    double all_reads() const {
        if (sampling_ratio > 0)
            return 4.0 * (double)num_rois * (double)(bins() * sampling_ratio * sampling_ratio);
        double reads = 0;
        int64_t image;
        for (int64_t k = 0; k < num_rois; ++k) reads += roi_reads(k, &image);
        return reads;
    }
};

/* Room for `need` items in *buf; the old contents are not kept (every roi
 * recomputes its weights). `fixed` is storage that is not the heap's (a
 * stack buffer) and is never freed. */
template <typename U> bool grow(U **buf, size_t *cap, size_t need, const U *fixed = nullptr) {
    if (need <= *cap) return true;
    U *grown = (U *)malloc(need * sizeof(U));
    if (!grown) return false;
    if (*buf != fixed) free(*buf);
    *buf = grown;
    *cap = need;
    return true;
}

/* Runs channel(c) for every channel, on the worker pool when `parallel`
 * (a channel at a time: rois make channels uneven); channel(c) returns
 * false when out of memory. */
template <typename F> int for_each_channel(int64_t channels, bool parallel, const F &channel) {
    const auto range = [&](int64_t begin, int64_t end) -> int {
        for (int64_t c = begin; c < end; ++c)
            if (!channel(c))
                return mmd_error(MMD_ERR_MEMORY, "out of memory for interpolation weights");
        return MMD_OK;
    };
    return parallel ? mmd_parallel_for(channels, 1, 1, range) : range(0, channels);
}

/* Per-worker room for one roi's axis weights: on the stack for the usual
 * sizes (7x7 bins of up to 9 samples a side fit), on the heap beyond. */
template <typename T> struct Scratch {
    static constexpr size_t kInline = 64;
    Axis<T> rows_inline[kInline], cols_inline[kInline];
    Axis<T> *rows = rows_inline, *cols = cols_inline;
    size_t rows_cap = kInline, cols_cap = kInline;

    Scratch() = default;
    Scratch(const Scratch &) = delete;
    Scratch &operator=(const Scratch &) = delete;
    ~Scratch() {
        if (rows != rows_inline) free(rows);
        if (cols != cols_inline) free(cols);
    }
};

/* Interpolation weights of every sample row (ph, iy) and column (pw, ix) of
 * one roi; bilinear weights are their products. */
template <typename T>
void axis_weights(const Geometry<T> &g, const Call<T> &call, Axis<T> *rows, Axis<T> *cols) {
    for (int64_t ph = 0; ph < call.pooled_h; ++ph)
        for (int64_t iy = 0; iy < g.grid_h; ++iy)
            mmd_interp(mmd_roi_align_sample(g.start_h, g.bin_h, ph, iy, g.grid_h), call.height,
                       &rows[ph * g.grid_h + iy]);
    for (int64_t pw = 0; pw < call.pooled_w; ++pw)
        for (int64_t ix = 0; ix < g.grid_w; ++ix)
            mmd_interp(mmd_roi_align_sample(g.start_w, g.bin_w, pw, ix, g.grid_w), call.width,
                       &cols[pw * g.grid_w + ix]);
}

/* Every roi's geometry and axis weights, computed once per call and shared
 * read-only by the channel workers (which would otherwise recompute them
 * for every channel). Only for a fixed sampling_ratio, where every roi has
 * the same number of samples, and only when it is small: no larger than the
 * output (a roi's entries, 936 bytes for float 7x7 at sampling_ratio 2,
 * against its C * 7 * 7 outputs: 2% of the output at 256 channels) and
 * than kMaxBytes. Without it (weights == nullptr) workers compute each
 * roi's weights themselves. */
template <typename T> struct RoiTable {
    static constexpr size_t kMaxBytes = (size_t)32 << 20;
    Geometry<T> *geometry = nullptr;
    Axis<T> *weights = nullptr;   /* roi k: rows at k * stride, then its columns */
    int64_t stride = 0;

    /* `sampling_ratio`: the call's, or 0 where no table is wanted. */
    RoiTable(const Call<T> &call, int64_t sampling_ratio) {
        if (sampling_ratio <= 0 || call.channels < 2) return;
        stride = (call.pooled_h + call.pooled_w) * sampling_ratio;
        const size_t per_roi = sizeof(Geometry<T>) + (size_t)stride * sizeof(Axis<T>);
        if (per_roi > (size_t)(call.channels * call.bins()) * sizeof(T) ||
            (size_t)call.num_rois > kMaxBytes / per_roi)
            return;
        geometry = (Geometry<T> *)malloc((size_t)call.num_rois * sizeof(Geometry<T>) + 1);
        weights = (Axis<T> *)malloc((size_t)(call.num_rois * stride) * sizeof(Axis<T>) + 1);
        if (!geometry || !weights) {
            release();
            return;
        }
        for (int64_t k = 0; k < call.num_rois; ++k) {
            Axis<T> *rows = weights + k * stride;
            call.geometry(k, &geometry[k]);
            axis_weights(geometry[k], call, rows, rows + call.pooled_h * sampling_ratio);
        }
    }
    RoiTable(const RoiTable &) = delete;
    RoiTable &operator=(const RoiTable &) = delete;
    ~RoiTable() { release(); }

    void release() {
        free(geometry);
        free(weights);
        geometry = nullptr;
        weights = nullptr;
    }
};

/* Roi k's geometry and weights (`need_weights`: else only its geometry and
 * room for them): from the table when there is one, else computed into the
 * worker's scratch; false when out of memory. */
template <typename T>
bool roi_weights(const RoiTable<T> &table, const Call<T> &call, int64_t k, bool need_weights,
                 Geometry<T> *g, Scratch<T> *s, const Axis<T> **rows, const Axis<T> **cols) {
    if (table.weights) {
        *g = table.geometry[k];
        *rows = table.weights + k * table.stride;
        *cols = *rows + call.pooled_h * g->grid_h;
        return true;
    }
    call.geometry(k, g);
    if (!grow(&s->rows, &s->rows_cap, (size_t)(call.pooled_h * g->grid_h + 1), s->rows_inline) ||
        !grow(&s->cols, &s->cols_cap, (size_t)(call.pooled_w * g->grid_w + 1), s->cols_inline))
        return false;
    if (need_weights) axis_weights(*g, call, s->rows, s->cols);
    *rows = s->rows;
    *cols = s->cols;
    return true;
}

/* An axis's samples folded into dense per-pixel weights, one span per bin:
 * bin p reads pixels [lo, lo + len) with weights w[off .. off + len). With
 * adaptive sampling (sampling_ratio <= 0) samples are at most one pixel
 * apart, so the pixels a bin's samples read are exactly such a span: a pixel
 * inside it is read by some sample, and NaN or inf there propagates as in
 * the sample-by-sample sum. */
struct Span {
    int64_t lo, len, off;
};

template <typename T> struct DenseAxis {
    Span *spans = nullptr;
    T *w = nullptr;
    size_t spans_cap = 0, w_cap = 0;

    DenseAxis() = default;
    DenseAxis(const DenseAxis &) = delete;
    DenseAxis &operator=(const DenseAxis &) = delete;
    ~DenseAxis() {
        free(spans);
        free(w);
    }

    /* Folds `pooled` bins of `grid` samples each (from axis_weights). */
    bool fold(const Axis<T> *samples, int64_t pooled, int64_t grid) {
        if (!grow(&spans, &spans_cap, (size_t)pooled)) return false;
        int64_t total = 0;
        for (int64_t p = 0; p < pooled; ++p) {
            int64_t lo = INT64_MAX, hi = -1;
            for (int64_t i = 0; i < grid; ++i) {
                const Axis<T> *a = &samples[p * grid + i];
                if (!a->valid) continue;
                if (a->low < lo) lo = a->low;
                if (a->high > hi) hi = a->high;
            }
            spans[p].lo = hi >= 0 ? lo : 0;
            spans[p].len = hi >= 0 ? hi - lo + 1 : 0;
            spans[p].off = total;
            total += spans[p].len;
        }
        if (!grow(&w, &w_cap, (size_t)total + 1)) return false;
        memset(w, 0, (size_t)total * sizeof *w);
        for (int64_t p = 0; p < pooled; ++p) {
            T *wp = w + spans[p].off - spans[p].lo;
            for (int64_t i = 0; i < grid; ++i) {
                const Axis<T> *a = &samples[p * grid + i];
                if (!a->valid) continue;
                wp[a->low] += a->w_low;
                wp[a->high] += a->w_high;
            }
        }
        return true;
    }
};

/* One roi's dense weights along both axes, the columns [x0, x1) its bins
 * read, and a row accumulator over them; reused from roi to roi. */
template <typename T> struct Dense {
    DenseAxis<T> rows, cols;
    T *acc = nullptr;
    size_t acc_cap = 0;
    int64_t x0 = 0, x1 = 0;

    Dense() = default;
    Dense(const Dense &) = delete;
    Dense &operator=(const Dense &) = delete;
    ~Dense() { free(acc); }

    bool prepare(const Axis<T> *row_samples, const Axis<T> *col_samples, const Geometry<T> &g,
                 int64_t pooled_h, int64_t pooled_w) {
        if (!rows.fold(row_samples, pooled_h, g.grid_h) ||
            !cols.fold(col_samples, pooled_w, g.grid_w))
            return false;
        x0 = INT64_MAX;
        x1 = 0;
        for (int64_t p = 0; p < pooled_w; ++p) {
            const Span cs = cols.spans[p];
            if (!cs.len) continue;
            if (cs.lo < x0) x0 = cs.lo;
            if (cs.lo + cs.len > x1) x1 = cs.lo + cs.len;
        }
        if (x1 == 0) x0 = 0;
        return grow(&acc, &acc_cap, (size_t)(x1 - x0) + 1);
    }
};

/* Whether all of `n` values are finite. The dense passes fold the samples
 * reading a pixel into one weight, so a sample whose weight is exactly 0
 * no longer multiplies the pixel: 0 * inf = NaN of the sample-by-sample sum
 * would be lost. Planes or gradients holding inf take the sample path. */
template <typename T> bool all_finite(const T *v, int64_t n) {
    int finite = 1;
    for (int64_t i = 0; i < n; ++i) finite &= isfinite(v[i]) != 0;
    return finite;
}

/* Whether a roi's avg pooling goes through dense weights: adaptive sampling
 * (so samples are at most a pixel apart) with enough samples per bin that
 * reading each pixel once beats reading four per sample. */
template <typename T> bool use_dense(const Geometry<T> &g, const Call<T> &call) {
    return !call.reference && call.pool_mode == MMD_POOL_AVG && call.sampling_ratio <= 0 &&
           g.grid_h * g.grid_w >= 4;
}

/* Whether all of a roi's samples lie on the map (rows, then columns). */
template <typename T>
bool all_valid(const Axis<T> *rows, int64_t n_rows, const Axis<T> *cols, int64_t n_cols) {
    int valid = 1;
    for (int64_t i = 0; i < n_rows; ++i) valid &= rows[i].valid;
    for (int64_t i = 0; i < n_cols; ++i) valid &= cols[i].valid;
    return valid;
}

/* An avg bin's division by its sample count (at least 1), as a multiply
 * by the inverse where the count is a power of 2: x / 2^k and x * 2^-k are
 * the same real number, so they round to the same value, and the multiply
 * is much cheaper. For T or vectors of T. */
template <typename T> struct BinDivisor {
    T divisor, inverse;
    bool pow2;
    explicit BinDivisor(int64_t samples)
        : divisor((T)(samples > 1 ? samples : 1)), inverse((T)1 / divisor),
          pow2((samples & (samples - 1)) == 0) {}
    template <typename V> MMD_INLINE V operator()(V sum) const {
        return pow2 ? sum * inverse : sum / divisor;
    }
};

/* The divisor of an avg bin's sum: its sample count, at least 1. */
template <typename T> T sample_count(const Geometry<T> &g) {
    const int64_t count = g.grid_h * g.grid_w;
    return (T)(count > 1 ? count : 1);
}

/* Channel groups (channel_groups.h) of avg pooling but for the reference
 * backend. */
using mmd_channel_groups::GroupItem;
using mmd_channel_groups::GroupVec;
using mmd_channel_groups::interleave;
using mmd_channel_groups::deinterleave;
using mmd_channel_groups::kGroup;
template <typename T> using ImageRois = mmd_channel_groups::ImageRois<Call<T>>;

/* A roi's [bins][kGroup] values of the group's `count` channels to their
 * runs of `out` (channel c0's bins at out, the next channel's after them),
 * and back (lanes past count: 0). */
template <typename T> void store_bins(const T *values, int64_t bins, int64_t count, T *out) {
    for (int64_t l = 0; l < count; ++l)
        for (int64_t b = 0; b < bins; ++b) out[l * bins + b] = values[b * kGroup<T> + l];
}
template <typename T> void load_bins(const T *in, int64_t bins, int64_t count, T *values) {
    for (int64_t b = 0; b < bins; ++b)
        for (int64_t l = 0; l < kGroup<T>; ++l)
            values[b * kGroup<T> + l] = l < count ? in[l * bins + b] : (T)0;
}

/* f(b, bin_rows, bin_cols, CHECK, GW) for every bin b of a roi, row-major
 * (the scalar paths' order), its samples' rows and columns, with CHECK
 * and GW as std::integral_constant: validity tests where `check`, else a
 * grid width of 2 unrolled (GW 2; else 0: the grid's own). */
template <typename T, typename F>
MMD_INLINE void for_each_group_bin(const Geometry<T> &g, const Axis<T> *rows, const Axis<T> *cols,
                                   int64_t pooled_h, int64_t pooled_w, bool check, const F &f) {
    typedef std::integral_constant<int64_t, 0> Any;
    typedef std::integral_constant<int64_t, 2> Two;
    for (int64_t ph = 0; ph < pooled_h; ++ph)
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const int64_t b = ph * pooled_w + pw;
            const Axis<T> *bin_rows = &rows[ph * g.grid_h], *bin_cols = &cols[pw * g.grid_w];
            if (check)
                f(b, bin_rows, bin_cols, std::true_type{}, Any{});
            else if (g.grid_w == 2)
                f(b, bin_rows, bin_cols, std::false_type{}, Two{});
            else
                f(b, bin_rows, bin_cols, std::false_type{}, Any{});
        }
}

/* Forward and backward kernels of one compute type (T float or double) on
 * arrays that passed mmd_roi_align_*_check. */
template <typename T>
int forward(const Call<T> &call, const T *input, T *output, T *argmax_y, T *argmax_x);
template <typename T>
int backward(const Call<T> &call, const T *grad_output, const T *argmax_y, const T *argmax_x,
             T *grad_input);

}  // namespace mmd_roi_align_cpu

#endif
