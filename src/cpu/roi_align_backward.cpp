/* roi_align backward on CPU: accumulates into grad_input (MMCV semantics:
 * the caller passes zeros). Each plane of grad_input is owned by one
 * worker and visits its rois in order, so the result is race-free and
 * does not depend on the thread count. Each roi takes the reverse of the
 * forward's path (roi_align_forward.cpp): dense weights, the path without
 * validity tests, or sample by sample; avg pooling (but for the reference
 * backend) a group of channels of an image at a time, into their planes
 * interleaved where the image's rois read them often enough
 * (backward_group; the same bits as a plane at a time). */
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
    const BinDivisor<T> divide(count);
    for (int64_t ph = 0; ph < pooled_h; ++ph)
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const T g = grad[ph * pooled_w + pw];
            avg_bin_scatter<false>(plane, width, &rows[ph * grid_h], &cols[pw * gw], grid_h, gw,
                                   divide(g));
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

/* The backward of pool_plane_avg (roi_align_forward.cpp): one roi's avg
 * gradients into one plane, without the group: scatter_valid_roi where
 * every sample lies on the map, else backward_bin's tests. */
template <typename T>
void scatter_plane_avg(T *plane, const Call<T> &call, const Geometry<T> &g, const Axis<T> *rows,
                       const Axis<T> *cols, bool valid, const T *grad) {
    if (valid) {
        scatter_valid_roi(plane, call.width, g, rows, cols, call.pooled_h, call.pooled_w, grad);
        return;
    }
    for (int64_t ph = 0; ph < call.pooled_h; ++ph)
        for (int64_t pw = 0; pw < call.pooled_w; ++pw)
            backward_bin(plane, call.height, call.width, g, rows, cols, ph, pw,
                         (int64_t)MMD_POOL_AVG, grad[ph * call.pooled_w + pw], (T)0, (T)0);
}

/* Adds every roi's gradient into channel c of grad_input, rois in order:
 * sample by sample (max mode, the reference backend), or for a fixed
 * sampling_ratio's avg that cannot pay for the groups
 * (ImageRois::few_reads) as backward_group does a plane at a time; false
 * when out of memory. */
template <typename T>
bool backward_channel(const Call<T> &call, const RoiTable<T> &table, const T *grad_output,
                      const T *argmax_y, const T *argmax_x, T *grad_input, int64_t c) {
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    const bool avg = !call.reference && call.pool_mode == MMD_POOL_AVG;
    Scratch<T> scratch;
    for (int64_t k = 0; k < call.num_rois; ++k) {
        Geometry<T> g{};
        const Axis<T> *rows, *cols;
        if (!roi_weights(table, call, k, call.pool_mode == MMD_POOL_AVG, &g, &scratch, &rows,
                         &cols))
            return false;
        T *plane = grad_input + (g.batch * call.channels + c) * plane_size;
        const int64_t base = (k * call.channels + c) * bins;
        if (avg) {
            scatter_plane_avg(plane, call, g, rows, cols,
                              all_valid(rows, call.pooled_h * g.grid_h, cols,
                                        call.pooled_w * g.grid_w),
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

/* avg_bin_scatter of a group's channels at once, into their interleaved
 * planes (roi_align_weights.h: channel groups): `share` their bin's
 * shares. `GW` as in pool_valid_roi_grid. */
template <bool CHECK, int64_t GW, typename T>
MMD_INLINE void group_bin_scatter(T *cells, int64_t width, const Axis<T> *bin_rows,
                                  const Axis<T> *bin_cols, int64_t grid_h, int64_t grid_w,
                                  typename GroupVec<T>::type share) {
    typedef GroupVec<T> V;
    constexpr int64_t L = V::lanes;
    const int64_t gw = GW ? GW : grid_w;
    const auto add = [](T *cell, typename V::type v) { V::store(cell, V::load(cell) + v); };
    for (int64_t iy = 0; iy < grid_h; ++iy) {
        const Axis<T> &ay = bin_rows[iy];
        if (CHECK && !ay.valid) continue;
        T *row_low = cells + ay.low * width * L, *row_high = cells + ay.high * width * L;
        const typename V::type g_low = share * ay.w_low, g_high = share * ay.w_high;
        for (int64_t ix = 0; ix < gw; ++ix) {
            const Axis<T> &ax = bin_cols[ix];
            if (CHECK && !ax.valid) continue;
            add(row_low + ax.low * L, g_low * ax.w_low);
            add(row_low + ax.high * L, g_low * ax.w_high);
            add(row_high + ax.low * L, g_high * ax.w_low);
            add(row_high + ax.high * L, g_high * ax.w_high);
        }
    }
}

/* The backward of pool_group_roi: every bin of one roi adds its group's
 * `values` ([bins][kGroup] gradients) into the interleaved planes, bins in
 * backward_bin's and scatter_valid_roi's order and with their shares
 * (validity tests where `check`), lane by lane the same bits. */
template <typename T>
MMD_X86_CLONES void scatter_group_roi(T *cells, int64_t width, const Geometry<T> &g,
                                      const Axis<T> *rows, const Axis<T> *cols,
                                      int64_t pooled_h, int64_t pooled_w, bool check,
                                      const T *values) {
    typedef GroupVec<T> V;
    constexpr int64_t L = V::lanes;
    const BinDivisor<T> divide(g.grid_h * g.grid_w);
    for_each_group_bin(g, rows, cols, pooled_h, pooled_w, check,
                       [&](int64_t b, const Axis<T> *bin_rows, const Axis<T> *bin_cols,
                           auto check_, auto gw) {
        group_bin_scatter<decltype(check_)::value, decltype(gw)::value>(
            cells, width, bin_rows, bin_cols, g.grid_h, g.grid_w, divide(V::load(values + b * L)));
    });
}

/* scatter_dense of a group's channels at once, into their interleaved
 * planes, from `values` ([bins][kGroup] gradients); `acc` has room for
 * the roi's columns' kGroup lanes. */
template <typename T>
MMD_X86_CLONES void scatter_dense_group(T *cells, int64_t width, const Geometry<T> &g,
                                        const Dense<T> &d, int64_t pooled_h, int64_t pooled_w,
                                        const T *values, T *acc) {
    typedef GroupVec<T> V;
    constexpr int64_t L = V::lanes;
    const int64_t n = d.x1 - d.x0;
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        const Span rs = d.rows.spans[ph];
        if (!rs.len) continue;
        for (int64_t x = 0; x < n; ++x) V::store(acc + x * L, typename V::type{});
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const Span cs = d.cols.spans[pw];
            const typename V::type share =
                V::load(values + (ph * pooled_w + pw) * L) / sample_count(g);
            const T *wx = d.cols.w + cs.off;
            T *a = acc + (cs.lo - d.x0) * L;
            for (int64_t xx = 0; xx < cs.len; ++xx)
                V::store(a + xx * L, V::load(a + xx * L) + share * wx[xx]);
        }
        for (int64_t yy = 0; yy < rs.len; ++yy) {
            const T wy = d.rows.w[rs.off + yy];
            T *dst = cells + ((rs.lo + yy) * width + d.x0) * L;
            for (int64_t x = 0; x < n; ++x)
                V::store(dst + x * L, V::load(dst + x * L) + wy * V::load(acc + x * L));
        }
    }
}

/* The avg backward of a GroupItem (a whole slice's rois: items add into
 * their slice's planes): each roi adds into the group's planes of its
 * image, rois in order, through dense weights where use_dense and the
 * roi's gradients of the group are all finite (the group's, not each
 * channel's: the interleaved and the plane by plane ways give the same
 * bits), else sample by sample; into the interleaved planes (read from
 * grad_input first and written back after: the same sums as adding into
 * grad_input) where the slice's rois read them often enough (ImageRois),
 * else a plane at a time. False when out of memory. */
template <typename T>
bool backward_group(const Call<T> &call, const RoiTable<T> &table, const ImageRois<T> &images,
                    const T *grad_output, T *grad_input, const GroupItem<T> &it) {
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    const bool interleaved = it.interleaved;
    T *image = grad_input + (it.image * call.channels + it.c0) * plane_size;
    if (interleaved) interleave(image, plane_size, it.count, it.cells);
    Scratch<T> scratch;
    Dense<T> dense;
    for (int64_t i = it.first; i < it.last; ++i) {
        const int64_t k = images.roi(i);
        Geometry<T> g{};
        const Axis<T> *rows, *cols;
        if (!roi_weights(table, call, k, true, &g, &scratch, &rows, &cols)) return false;
        T *planes = grad_input + (g.batch * call.channels + it.c0) * plane_size;
        const T *grad = grad_output + (k * call.channels + it.c0) * bins;
        const bool valid =
            all_valid(rows, call.pooled_h * g.grid_h, cols, call.pooled_w * g.grid_w);
        const bool dense_roi = use_dense(g, call) && all_finite(grad, it.count * bins);
        if (dense_roi && !dense.prepare(rows, cols, g, call.pooled_h, call.pooled_w))
            return false;
        if (interleaved) {
            load_bins(grad, bins, it.count, it.bins);
            if (dense_roi) {
                if (!grow(it.wide, it.wide_cap, (size_t)((dense.x1 - dense.x0 + 1) * kGroup<T>)))
                    return false;
                scatter_dense_group(it.cells, call.width, g, dense, call.pooled_h,
                                    call.pooled_w, it.bins, *it.wide);
            } else {
                scatter_group_roi(it.cells, call.width, g, rows, cols, call.pooled_h,
                                  call.pooled_w, !valid, it.bins);
            }
            continue;
        }
        for (int64_t l = 0; l < it.count; ++l) {
            T *plane = planes + l * plane_size;
            const T *grad_l = grad + l * bins;
            if (dense_roi)
                scatter_dense(plane, call.width, g, dense, call.pooled_h, call.pooled_w, grad_l);
            else
                scatter_plane_avg(plane, call, g, rows, cols, valid, grad_l);
        }
    }
    if (interleaved) deinterleave(it.cells, plane_size, it.count, image);
    return true;
}

}  // namespace

/* argmax_y/argmax_x: null in avg mode. */
template <typename T>
int backward(const Call<T> &call, const T *grad_output, const T *argmax_y, const T *argmax_x,
             T *grad_input) {
    int s = mmd_check_rois<Geometry<T>>(call);   /* kernels then see valid geometry */
    if (s || call.num_rois * call.channels * call.bins() == 0 ||
        call.batch * call.channels * call.height * call.width == 0)
        return s;
    /* max mode reads no weights but the argmax pair's */
    const RoiTable<T> table(call, call.reference || call.pool_mode != MMD_POOL_AVG
                                      ? 0
                                      : call.sampling_ratio);
    double reads = -1;   /* all_reads(), where few_reads() found it */
    if (!call.reference && call.pool_mode == MMD_POOL_AVG &&
        !(call.sampling_ratio > 0 && ImageRois<T>::few_reads(call, &reads))) {
        const ImageRois<T> images(call, reads);
        return for_each_group_item(call, images, false, [&](const GroupItem<T> &it) {
            return backward_group(call, table, images, grad_output, grad_input, it);
        });
    }
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
