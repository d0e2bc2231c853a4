/* roi_align forward on CPU. Workers own channels and visit every roi, so a
 * worker keeps reading the same (H, W) planes from cache instead of
 * streaming the whole map once per roi. Each roi and channel takes the
 * first of these that applies:
 *   - dense weights (avg, adaptive sampling, finite planes): each pixel
 *     read once per bin row (pool_dense);
 *   - every sample on the map (avg): sums without validity tests
 *     (pool_valid_roi);
 *   - sample by sample (max mode, the reference backend, the rest):
 *     pool_bin. */
#include "roi_align_weights.h"

namespace mmd_roi_align_cpu {
namespace {

/* One bilinear sample from a (H, W) plane given both axes' weights. */
template <typename T>
inline T sample(const T *plane, int64_t width, const Axis<T> &ay, const Axis<T> &ax) {
    const T *row_low = plane + ay.low * width;
    const T *row_high = plane + ay.high * width;
    return ay.w_low * (ax.w_low * row_low[ax.low] + ax.w_high * row_low[ax.high]) +
           ay.w_high * (ax.w_low * row_high[ax.low] + ax.w_high * row_high[ax.high]);
}

/* The avg sum of one bin (its sample rows `bin_rows`, its sample columns
 * `bin_cols`), before the division. Bilinear weights factor by axis: each
 * sample row's two source rows are summed over the bin's columns first, then
 * weighted once. CHECK skips samples off the map; without it every sample
 * must be on the map. */
template <bool CHECK, typename T>
inline T avg_bin_sum(const T *plane, int64_t width, const Axis<T> *bin_rows,
                     const Axis<T> *bin_cols, int64_t grid_h, int64_t grid_w) {
    T sum = 0;
    for (int64_t iy = 0; iy < grid_h; ++iy) {
        const Axis<T> &ay = bin_rows[iy];
        if (CHECK && !ay.valid) continue;
        const T *row_low = plane + ay.low * width, *row_high = plane + ay.high * width;
        T sum_low = 0, sum_high = 0;
        for (int64_t ix = 0; ix < grid_w; ++ix) {
            const Axis<T> &ax = bin_cols[ix];
            if (CHECK && !ax.valid) continue;
            sum_low += ax.w_low * row_low[ax.low] + ax.w_high * row_low[ax.high];
            sum_high += ax.w_low * row_high[ax.low] + ax.w_high * row_high[ax.high];
        }
        sum += ay.w_low * sum_low + ay.w_high * sum_high;
    }
    return sum;
}

/* Pools one bin from precomputed axis weights. Max mode records the sample
 * coordinates of the maximum (MMCV's argmax_y/argmax_x) for backward. */
template <typename T>
inline void pool_bin(const T *plane, int64_t width, const Geometry<T> &g, const Axis<T> *rows,
                     const Axis<T> *cols, int64_t ph, int64_t pw, int64_t pool_mode, T *out,
                     T *arg_y, T *arg_x) {
    if (pool_mode == MMD_POOL_AVG) {
        *out = avg_bin_sum<true>(plane, width, &rows[ph * g.grid_h], &cols[pw * g.grid_w],
                                 g.grid_h, g.grid_w) /
               sample_count(g);
        return;
    }
    mmd_max_state<T> m;
    mmd_max_init(&m);
    for (int64_t iy = 0; iy < g.grid_h; ++iy) {
        const Axis<T> &ay = rows[ph * g.grid_h + iy];
        for (int64_t ix = 0; ix < g.grid_w; ++ix) {
            const Axis<T> &ax = cols[pw * g.grid_w + ix];
            const T v = (ay.valid && ax.valid) ? sample(plane, width, ay, ax) : (T)0;
            mmd_max_update(&m, v, mmd_roi_align_sample(g.start_h, g.bin_h, ph, iy, g.grid_h),
                           mmd_roi_align_sample(g.start_w, g.bin_w, pw, ix, g.grid_w));
        }
    }
    *out = mmd_max_value(&m);
    *arg_y = m.y;
    *arg_x = m.x;
}

/* Avg pooling of every bin of one roi and channel whose samples all lie on
 * the map: pool_bin's sums (avg_bin_sum, so the results are the same to the
 * bit) without its validity tests, a column of bins at a time. `GW` is the
 * grid width when it is known when compiling (the loop over a bin's columns
 * unrolls), else 0. */
template <int64_t GW, typename T>
void pool_valid_roi_grid(const T *plane, int64_t width, int64_t grid_h, int64_t grid_w,
                         const Axis<T> *rows, const Axis<T> *cols, int64_t pooled_h,
                         int64_t pooled_w, T *out) {
    const int64_t gw = GW ? GW : grid_w;
    const int64_t count = grid_h * gw;
    const T divisor = (T)(count > 1 ? count : 1);
    /* x / 2^k and x * 2^-k are the same real number, so they round to the
     * same float; the multiply is much cheaper than the divide */
    const bool pow2 = (count & (count - 1)) == 0;
    const T scale = (T)1 / divisor;
    for (int64_t pw = 0; pw < pooled_w; ++pw)
        for (int64_t ph = 0; ph < pooled_h; ++ph) {
            const T sum =
                avg_bin_sum<false>(plane, width, &rows[ph * grid_h], &cols[pw * gw], grid_h, gw);
            out[ph * pooled_w + pw] = pow2 ? sum * scale : sum / divisor;
        }
}

template <typename T>
void pool_valid_roi(const T *plane, int64_t width, const Geometry<T> &g, const Axis<T> *rows,
                    const Axis<T> *cols, int64_t pooled_h, int64_t pooled_w, T *out) {
    if (g.grid_w == 2)
        pool_valid_roi_grid<2>(plane, width, g.grid_h, 2, rows, cols, pooled_h, pooled_w, out);
    else
        pool_valid_roi_grid<0>(plane, width, g.grid_h, g.grid_w, rows, cols, pooled_h, pooled_w,
                               out);
}

/* Avg pooling of every bin of one roi and channel from dense weights, in two
 * passes per bin row: the weighted source rows are summed over the columns
 * the roi reads (an axpy, vectorisable), then each bin takes the dot product
 * of that sum with its column weights. */
template <typename T>
void pool_dense(const T *plane, int64_t width, const Geometry<T> &g, const Dense<T> &d,
                int64_t pooled_h, int64_t pooled_w, T *out) {
    const int64_t n = d.x1 - d.x0;
    T *__restrict__ acc = d.acc;
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        const Span rs = d.rows.spans[ph];
        for (int64_t x = 0; x < n; ++x) acc[x] = 0;
        for (int64_t yy = 0; yy < rs.len; ++yy) {
            const T wy = d.rows.w[rs.off + yy];
            const T *__restrict__ src = plane + (rs.lo + yy) * width + d.x0;
            for (int64_t x = 0; x < n; ++x) acc[x] += wy * src[x];
        }
        T *o = out + ph * pooled_w;
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const Span cs = d.cols.spans[pw];
            const T *wx = d.cols.w + cs.off, *a = acc + (cs.lo - d.x0);
            T sum = 0;
            for (int64_t xx = 0; xx < cs.len; ++xx) sum += wx[xx] * a[xx];
            o[pw] = sum / sample_count(g);
        }
    }
}

/* Pools channel c of every roi; false when out of memory. */
template <typename T>
bool forward_channel(const Call<T> &call, const RoiTable<T> &table, const T *input, T *output,
                     T *argmax_y, T *argmax_x, int64_t c) {
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    Scratch<T> scratch;
    Dense<T> dense;
    int finite = -1;  /* channel c of every image is finite; -1: not checked yet */
    for (int64_t k = 0; k < call.num_rois; ++k) {
        Geometry<T> g{};
        const Axis<T> *rows, *cols;
        if (!roi_weights(table, call, k, true, &g, &scratch, &rows, &cols)) return false;
        const T *plane = input + (g.batch * call.channels + c) * plane_size;
        T *out = output + (k * call.channels + c) * bins;
        const bool dense_roi = use_dense(g, call);
        if (dense_roi && finite < 0) {
            finite = 1;
            for (int64_t n = 0; n < call.batch; ++n)
                finite &= all_finite(input + (n * call.channels + c) * plane_size, plane_size);
        }
        if (dense_roi && finite) {
            if (!dense.prepare(rows, cols, g, call.pooled_h, call.pooled_w)) return false;
            pool_dense(plane, call.width, g, dense, call.pooled_h, call.pooled_w, out);
            continue;
        }
        if (use_valid_path(g, call, rows, cols)) {
            pool_valid_roi(plane, call.width, g, rows, cols, call.pooled_h, call.pooled_w, out);
            continue;
        }
        for (int64_t ph = 0; ph < call.pooled_h; ++ph)
            for (int64_t pw = 0; pw < call.pooled_w; ++pw) {
                const int64_t o = (k * call.channels + c) * bins + ph * call.pooled_w + pw;
                pool_bin(plane, call.width, g, rows, cols, ph, pw, call.pool_mode, &output[o],
                         argmax_y ? &argmax_y[o] : nullptr, argmax_x ? &argmax_x[o] : nullptr);
            }
    }
    return true;
}

}  // namespace

/* argmax_y/argmax_x: null in avg mode. */
template <typename T>
int forward(const Call<T> &call, const T *input, T *output, T *argmax_y, T *argmax_x) {
    int s = check_rois(call);
    if (s || call.num_rois * call.channels * call.bins() == 0) return s;
    /* Per-roi weights come from the shared table, or are recomputed per
     * channel without one (O(pooled * grid) against O(pooled^2 * grid^2)
     * samples). The reference backend computes every roi's weights itself. */
    const RoiTable<T> table(call, call.reference ? 0 : call.sampling_ratio);
    const int64_t work = call.channels * call.num_rois * call.bins();
    return for_each_channel(call.channels,
                            !call.reference && mmd_worth_threads(call.channels, work),
                            [&](int64_t c) {
                                return forward_channel(call, table, input, output, argmax_y,
                                                       argmax_x, c);
                            });
}

template int forward(const Call<float> &, const float *, float *, float *, float *);
template int forward(const Call<double> &, const double *, double *, double *, double *);

}  // namespace mmd_roi_align_cpu
