/* roi_align backward on CPU: accumulates into grad_input (MMCV semantics:
 * the caller passes zeros). Each channel is owned by one worker and visits
 * rois in order, so the result is race-free and does not depend on the
 * thread count. Each roi and channel takes the reverse of the forward's
 * path (roi_align_forward.cpp): dense weights, the path without validity
 * tests, or sample by sample. */
#include "roi_align_weights.h"

namespace mmd_roi_align_cpu {
namespace {

/* Adds g times the bilinear weights of one sample into the plane. */
template <typename T>
inline void scatter(T *plane, int64_t width, const Axis<T> &ay, const Axis<T> &ax, T g) {
    T *row_low = plane + ay.low * width;
    T *row_high = plane + ay.high * width;
    row_low[ax.low] += g * ay.w_low * ax.w_low;
    row_low[ax.high] += g * ay.w_low * ax.w_high;
    row_high[ax.low] += g * ay.w_high * ax.w_low;
    row_high[ax.high] += g * ay.w_high * ax.w_high;
}

/* Adds `share` (a bin's gradient over its sample count) times each
 * sample's bilinear weights into the plane: the forward's avg_bin_sum in
 * reverse, CHECK as there. */
template <bool CHECK, typename T>
inline void avg_bin_scatter(T *plane, int64_t width, const Axis<T> *bin_rows,
                            const Axis<T> *bin_cols, int64_t grid_h, int64_t grid_w, T share) {
    for (int64_t iy = 0; iy < grid_h; ++iy) {
        const Axis<T> &ay = bin_rows[iy];
        if (CHECK && !ay.valid) continue;
        /* (share * w_y) * w_x: the products scatter() forms, hoisted */
        T *row_low = plane + ay.low * width, *row_high = plane + ay.high * width;
        const T g_low = share * ay.w_low, g_high = share * ay.w_high;
        for (int64_t ix = 0; ix < grid_w; ++ix) {
            const Axis<T> &ax = bin_cols[ix];
            if (CHECK && !ax.valid) continue;
            row_low[ax.low] += g_low * ax.w_low;
            row_low[ax.high] += g_low * ax.w_high;
            row_high[ax.low] += g_high * ax.w_low;
            row_high[ax.high] += g_high * ax.w_high;
        }
    }
}

/* Adds one bin's gradient into its (H, W) plane. */
template <typename T>
inline void backward_bin(T *plane, int64_t height, int64_t width, const Geometry<T> &g,
                         const Axis<T> *rows, const Axis<T> *cols, int64_t ph, int64_t pw,
                         int64_t pool_mode, T grad, T arg_y, T arg_x) {
    if (pool_mode == MMD_POOL_MAX) {
        if (arg_y == (T)-1) return; /* no sample was taken in forward */
        Axis<T> ay, ax;
        mmd_interp(arg_y, height, &ay);
        mmd_interp(arg_x, width, &ax);
        if (ay.valid && ax.valid) scatter(plane, width, ay, ax, grad);
        return;
    }
    avg_bin_scatter<true>(plane, width, &rows[ph * g.grid_h], &cols[pw * g.grid_w], g.grid_h,
                          g.grid_w, grad / sample_count(g));
}

/* Backward of pool_valid_roi: backward_bin's avg scatter (avg_bin_scatter)
 * for every bin of one roi and channel, bins in the same order, so each
 * pixel's additions come in the same order and the results are the same to
 * the bit, without the validity tests. `GW` as in pool_valid_roi_grid. */
template <int64_t GW, typename T>
void scatter_valid_roi_grid(T *plane, int64_t width, int64_t grid_h, int64_t grid_w,
                            const Axis<T> *rows, const Axis<T> *cols, int64_t pooled_h,
                            int64_t pooled_w, const T *grad) {
    const int64_t gw = GW ? GW : grid_w;
    const int64_t count = grid_h * gw;
    const T divisor = (T)(count > 1 ? count : 1);
    const bool pow2 = (count & (count - 1)) == 0;   /* as in pool_valid_roi_grid */
    const T scale = (T)1 / divisor;
    for (int64_t ph = 0; ph < pooled_h; ++ph)
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const T g = grad[ph * pooled_w + pw];
            avg_bin_scatter<false>(plane, width, &rows[ph * grid_h], &cols[pw * gw], grid_h, gw,
                                   pow2 ? g * scale : g / divisor);
        }
}

template <typename T>
void scatter_valid_roi(T *plane, int64_t width, const Geometry<T> &g, const Axis<T> *rows,
                       const Axis<T> *cols, int64_t pooled_h, int64_t pooled_w, const T *grad) {
    if (g.grid_w == 2)
        scatter_valid_roi_grid<2>(plane, width, g.grid_h, 2, rows, cols, pooled_h, pooled_w,
                                  grad);
    else
        scatter_valid_roi_grid<0>(plane, width, g.grid_h, g.grid_w, rows, cols, pooled_h,
                                  pooled_w, grad);
}

/* Backward of pool_dense for one roi and channel: per bin row, the bins'
 * shares spread over their columns (acc), then added to each source row with
 * its row weight (an axpy). */
template <typename T>
void scatter_dense(T *plane, int64_t width, const Geometry<T> &g, const Dense<T> &d,
                   int64_t pooled_h, int64_t pooled_w, const T *grad) {
    const int64_t n = d.x1 - d.x0;
    T *__restrict__ acc = d.acc;
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        const Span rs = d.rows.spans[ph];
        if (!rs.len) continue;
        for (int64_t x = 0; x < n; ++x) acc[x] = 0;
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const Span cs = d.cols.spans[pw];
            const T share = grad[ph * pooled_w + pw] / sample_count(g);
            const T *wx = d.cols.w + cs.off;
            T *a = acc + (cs.lo - d.x0);
            for (int64_t xx = 0; xx < cs.len; ++xx) a[xx] += share * wx[xx];
        }
        for (int64_t yy = 0; yy < rs.len; ++yy) {
            const T wy = d.rows.w[rs.off + yy];
            T *__restrict__ dst = plane + (rs.lo + yy) * width + d.x0;
            for (int64_t x = 0; x < n; ++x) dst[x] += wy * acc[x];
        }
    }
}

/* Adds every roi's gradient into channel c of grad_input, rois in order;
 * false when out of memory. */
template <typename T>
bool backward_channel(const Call<T> &call, const RoiTable<T> &table, const T *grad_output,
                      const T *argmax_y, const T *argmax_x, T *grad_input, int64_t c) {
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    Scratch<T> scratch;
    Dense<T> dense;
    for (int64_t k = 0; k < call.num_rois; ++k) {
        Geometry<T> g{};
        const Axis<T> *rows, *cols;
        if (!roi_weights(table, call, k, call.pool_mode == MMD_POOL_AVG, &g, &scratch, &rows,
                         &cols))
            return false;
        T *plane = grad_input + (g.batch * call.channels + c) * plane_size;
        const int64_t base = (k * call.channels + c) * bins;
        if (use_dense(g, call) && all_finite(grad_output + base, bins)) {
            if (!dense.prepare(rows, cols, g, call.pooled_h, call.pooled_w)) return false;
            scatter_dense(plane, call.width, g, dense, call.pooled_h, call.pooled_w,
                          grad_output + base);
            continue;
        }
        if (use_valid_path(g, call, rows, cols)) {
            scatter_valid_roi(plane, call.width, g, rows, cols, call.pooled_h, call.pooled_w,
                              grad_output + base);
            continue;
        }
        for (int64_t ph = 0; ph < call.pooled_h; ++ph)
            for (int64_t pw = 0; pw < call.pooled_w; ++pw) {
                const int64_t o = base + ph * call.pooled_w + pw;
                backward_bin(plane, call.height, call.width, g, rows, cols, ph, pw,
                             call.pool_mode, grad_output[o], argmax_y ? argmax_y[o] : (T)0,
                             argmax_x ? argmax_x[o] : (T)0);
            }
    }
    return true;
}

}  // namespace

/* argmax_y/argmax_x: null in avg mode. */
template <typename T>
int backward(const Call<T> &call, const T *grad_output, const T *argmax_y, const T *argmax_x,
             T *grad_input) {
    int s = check_rois(call);
    if (s || call.num_rois * call.channels * call.bins() == 0 ||
        call.batch * call.channels * call.height * call.width == 0)
        return s;
    /* max mode reads no weights but the argmax pair's */
    const RoiTable<T> table(call, call.reference || call.pool_mode != MMD_POOL_AVG
                                      ? 0
                                      : call.sampling_ratio);
    const int64_t work = call.channels * call.num_rois * call.bins();
    return for_each_channel(call.channels,
                            !call.reference && mmd_worth_threads(call.channels, work),
                            [&](int64_t c) {
                                return backward_channel(call, table, grad_output, argmax_y,
                                                        argmax_x, grad_input, c);
                            });
}

template int backward(const Call<float> &, const float *, const float *, const float *, float *);
template int backward(const Call<double> &, const double *, const double *, const double *,
                      double *);

}  // namespace mmd_roi_align_cpu
