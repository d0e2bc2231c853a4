/* roi_align forward on CPU. Workers own channels and visit every roi, so a
 * worker keeps reading the same (H, W) planes from cache instead of
 * streaming the whole map once per roi. Avg pooling (but for the reference
 * backend) takes the channels a group at a time (roi_align_weights.h:
 * channel groups; forward_group): where an image's rois read its cells
 * often enough, from its planes of the group interleaved, so that a
 * vector load reads a cell of every channel of the group and a bin's
 * arithmetic runs once for them, each lane the scalar code's operations in
 * its order (the same bits as a plane at a time). Each roi takes the
 * first of these that applies:
 *   - dense weights (avg, adaptive sampling, the group's planes finite):
 *     each pixel read once per bin row (pool_dense, pool_dense_group);
 *   - avg, the rest: the samples' weights, without validity tests where
 *     every sample lies on the map (pool_group_roi, or a plane at a time
 *     pool_valid_roi and pool_bin);
 *   - sample by sample (max mode, the reference backend): pool_bin. */
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
    const BinDivisor<T> divide(count);
    for (int64_t pw = 0; pw < pooled_w; ++pw)
        for (int64_t ph = 0; ph < pooled_h; ++ph) {
            const T sum =
                avg_bin_sum<false>(plane, width, &rows[ph * grid_h], &cols[pw * gw], grid_h, gw);
            out[ph * pooled_w + pw] = divide(sum);
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

/* Avg pooling of one roi on one plane, without the group: pool_valid_roi
 * where every sample lies on the map, else pool_bin's tests. */
template <typename T>
void pool_plane_avg(const T *plane, const Call<T> &call, const Geometry<T> &g,
                    const Axis<T> *rows, const Axis<T> *cols, bool valid, T *out) {
    if (valid) {
        pool_valid_roi(plane, call.width, g, rows, cols, call.pooled_h, call.pooled_w, out);
        return;
    }
    for (int64_t ph = 0; ph < call.pooled_h; ++ph)
        for (int64_t pw = 0; pw < call.pooled_w; ++pw)
            pool_bin(plane, call.width, g, rows, cols, ph, pw, (int64_t)MMD_POOL_AVG,
                     &out[ph * call.pooled_w + pw], (T *)nullptr, (T *)nullptr);
}

/* Pools channel c of every roi: sample by sample (max mode, the reference
 * backend), or for a fixed sampling_ratio's avg that cannot pay for the
 * groups (ImageRois::few_reads) a plane at a time as forward_group does;
 * false when out of memory. */
template <typename T>
bool forward_channel(const Call<T> &call, const RoiTable<T> &table, const T *input, T *output,
                     T *argmax_y, T *argmax_x, int64_t c) {
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    const bool avg = !call.reference && call.pool_mode == MMD_POOL_AVG;
    Scratch<T> scratch;
    for (int64_t k = 0; k < call.num_rois; ++k) {
        Geometry<T> g{};
        const Axis<T> *rows, *cols;
        if (!roi_weights(table, call, k, true, &g, &scratch, &rows, &cols)) return false;
        const T *plane = input + (g.batch * call.channels + c) * plane_size;
        if (avg) {
            const bool valid =
                all_valid(rows, call.pooled_h * g.grid_h, cols, call.pooled_w * g.grid_w);
            pool_plane_avg(plane, call, g, rows, cols, valid,
                           output + (k * call.channels + c) * bins);
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

/* avg_bin_sum of a group's channels at once, from their interleaved
 * planes (roi_align_weights.h: channel groups). `GW` as in
 * pool_valid_roi_grid. */
template <bool CHECK, int64_t GW, typename T>
MMD_INLINE typename GroupVec<T>::type group_bin_sum(const T *cells, int64_t width,
                                                    const Axis<T> *bin_rows,
                                                    const Axis<T> *bin_cols, int64_t grid_h,
                                                    int64_t grid_w) {
    typedef GroupVec<T> V;
    constexpr int64_t L = V::lanes;
    const int64_t gw = GW ? GW : grid_w;
    typename V::type sum = {};
    for (int64_t iy = 0; iy < grid_h; ++iy) {
        const Axis<T> &ay = bin_rows[iy];
        if (CHECK && !ay.valid) continue;
        const T *row_low = cells + ay.low * width * L, *row_high = cells + ay.high * width * L;
        typename V::type sum_low = {}, sum_high = {};
        for (int64_t ix = 0; ix < gw; ++ix) {
            const Axis<T> &ax = bin_cols[ix];
            if (CHECK && !ax.valid) continue;
            sum_low += ax.w_low * V::load(row_low + ax.low * L) +
                       ax.w_high * V::load(row_low + ax.high * L);
            sum_high += ax.w_low * V::load(row_high + ax.low * L) +
                        ax.w_high * V::load(row_high + ax.high * L);
        }
        sum += ay.w_low * sum_low + ay.w_high * sum_high;
    }
    return sum;
}

/* Avg pooling of every bin of one roi for a group's channels from their
 * interleaved planes into `values` ([bins][kGroup]): pool_bin's sums and
 * division (with validity tests where `check`) or pool_valid_roi's
 * (without), lane by lane the same bits. */
template <typename T>
MMD_X86_CLONES void pool_group_roi(const T *cells, int64_t width, const Geometry<T> &g,
                                   const Axis<T> *rows, const Axis<T> *cols, int64_t pooled_h,
                                   int64_t pooled_w, bool check, T *values) {
    typedef GroupVec<T> V;
    constexpr int64_t L = V::lanes;
    const BinDivisor<T> divide(g.grid_h * g.grid_w);
    for_each_group_bin(g, rows, cols, pooled_h, pooled_w, check,
                       [&](int64_t b, const Axis<T> *bin_rows, const Axis<T> *bin_cols,
                           auto check_, auto gw) {
        const auto sum = group_bin_sum<decltype(check_)::value, decltype(gw)::value>(
            cells, width, bin_rows, bin_cols, g.grid_h, g.grid_w);
        /* pool_bin's division: pool_valid_roi's (BinDivisor), the same bits */
        V::store(values + b * L, divide(sum));
    });
}

/* pool_dense of a group's channels at once, from their interleaved planes
 * into `values` ([bins][kGroup]); `acc` has room for the roi's columns'
 * kGroup lanes. */
template <typename T>
MMD_X86_CLONES void pool_dense_group(const T *cells, int64_t width, const Geometry<T> &g,
                                     const Dense<T> &d, int64_t pooled_h, int64_t pooled_w,
                                     T *acc, T *values) {
    typedef GroupVec<T> V;
    constexpr int64_t L = V::lanes;
    const int64_t n = d.x1 - d.x0;
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        const Span rs = d.rows.spans[ph];
        for (int64_t x = 0; x < n; ++x) V::store(acc + x * L, typename V::type{});
        for (int64_t yy = 0; yy < rs.len; ++yy) {
            const T wy = d.rows.w[rs.off + yy];
            const T *src = cells + ((rs.lo + yy) * width + d.x0) * L;
            for (int64_t x = 0; x < n; ++x)
                V::store(acc + x * L, V::load(acc + x * L) + wy * V::load(src + x * L));
        }
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            const Span cs = d.cols.spans[pw];
            const T *wx = d.cols.w + cs.off, *a = acc + (cs.lo - d.x0) * L;
            typename V::type sum = {};
            for (int64_t xx = 0; xx < cs.len; ++xx) sum += wx[xx] * V::load(a + xx * L);
            V::store(values + (ph * pooled_w + pw) * L, sum / sample_count(g));
        }
    }
}

/* Avg pooling of a GroupItem's channels of its rois: a roi takes dense
 * weights where use_dense and the group's planes of its image are all
 * finite (the group's, not each plane's: the interleaved and the plane by
 * plane ways give the same bits), else the samples. From the interleaved
 * planes where the slice's rois read them often enough (ImageRois), else
 * a plane at a time. False when out of memory. */
template <typename T>
bool forward_group(const Call<T> &call, const RoiTable<T> &table, const ImageRois<T> &images,
                   const T *input, T *output, const GroupItem<T> &it) {
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    const bool interleaved = it.interleaved;
    if (interleaved)
        interleave(input + (it.image * call.channels + it.c0) * plane_size, plane_size, it.count,
                   it.cells);
    Scratch<T> scratch;
    Dense<T> dense;
    int finite = -1;   /* the group's planes of the image are finite; -1: not checked yet */
    for (int64_t i = it.first; i < it.last; ++i) {
        const int64_t k = images.roi(i);
        Geometry<T> g{};
        const Axis<T> *rows, *cols;
        if (!roi_weights(table, call, k, true, &g, &scratch, &rows, &cols)) return false;
        const T *planes = input + (g.batch * call.channels + it.c0) * plane_size;
        T *out = output + (k * call.channels + it.c0) * bins;
        const bool valid =
            all_valid(rows, call.pooled_h * g.grid_h, cols, call.pooled_w * g.grid_w);
        bool dense_roi = use_dense(g, call);
        /* a slice's rois are one image's (ImageRois), so its planes' test holds */
        if (dense_roi && finite < 0) finite = all_finite(planes, it.count * plane_size);
        dense_roi = dense_roi && finite;
        if (dense_roi && !dense.prepare(rows, cols, g, call.pooled_h, call.pooled_w))
            return false;
        if (interleaved) {
            if (dense_roi) {
                if (!grow(it.wide, it.wide_cap, (size_t)((dense.x1 - dense.x0 + 1) * kGroup<T>)))
                    return false;
                pool_dense_group(it.cells, call.width, g, dense, call.pooled_h, call.pooled_w,
                                 *it.wide, it.bins);
            } else {
                pool_group_roi(it.cells, call.width, g, rows, cols, call.pooled_h,
                               call.pooled_w, !valid, it.bins);
            }
            store_bins(it.bins, bins, it.count, out);
            continue;
        }
        for (int64_t l = 0; l < it.count; ++l) {
            if (dense_roi)
                pool_dense(planes + l * plane_size, call.width, g, dense, call.pooled_h,
                           call.pooled_w, out + l * bins);
            else
                pool_plane_avg(planes + l * plane_size, call, g, rows, cols, valid,
                               out + l * bins);
        }
    }
    return true;
}

}  // namespace

/* argmax_y/argmax_x: null in avg mode. */
template <typename T>
int forward(const Call<T> &call, const T *input, T *output, T *argmax_y, T *argmax_x) {
    int s = mmd_check_rois<Geometry<T>>(call);   /* kernels then see valid geometry */
    if (s || call.num_rois * call.channels * call.bins() == 0) return s;
    /* Per-roi weights come from the shared table, or are recomputed per
     * channel without one (O(pooled * grid) against O(pooled^2 * grid^2)
     * samples). The reference backend computes every roi's weights itself. */
    const RoiTable<T> table(call, call.reference ? 0 : call.sampling_ratio);
    double reads = -1;   /* all_reads(), where few_reads() found it */
    if (!call.reference && call.pool_mode == MMD_POOL_AVG &&
        !(call.sampling_ratio > 0 && ImageRois<T>::few_reads(call, &reads))) {
        const ImageRois<T> images(call, reads);
        return for_each_group_item(call, images, true, [&](const GroupItem<T> &it) {
            return forward_group(call, table, images, input, output, it);
        });
    }
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
