/* roi_pool on CPU. Forward takes the channels a group at a time
 * (channel_groups.h) where an image's rois read its cells often enough: a
 * bin's cells from the image's planes of the group interleaved, one vector
 * load a cell for the group's channels (pool_group_roi); else it splits
 * (channel, roi) planes over the worker pool, channel-major, and reduces
 * each row of bins column by column first, in vector registers
 * (pool_plane). Both give every bin the definition's maximum and argmax.
 * Backward gives each worker whole channels and visits rois in order, so
 * it is race-free and deterministic. */
#include <stdint.h>
#include <string.h>

#include <limits>
#include <type_traits>

#include "mmdispatch/ops/roi_pool.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "channel_groups.h"
#include "heap_array.h"
#include "vec16.h"

namespace {

/* A call's rois and shapes (height and width: the map's), which the
 * forward's channel groups take as their call type (channel_groups.h). */
template <typename T> struct PoolCall {
    typedef T value_type;
    static constexpr const char *op = "roi_pool", *scratch = "column maxima";
    static constexpr bool bin_scratch = false;   /* its group kernels keep no bins */
    const T *rois;
    int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w, convention;
    T spatial_scale;

    int64_t bins() const { return pooled_h * pooled_w; }
    /* Roi k's geometry into *g, and its MMD_ROI_* code (mmd_check_rois). */
    int geometry(int64_t k, mmd_pool_geometry<T> *g) const {
        return mmd_roi_pool_geometry(rois + 5 * k, batch, spatial_scale, pooled_h, pooled_w,
                                     convention, g);
    }
    /* Roi k's geometry (valid: mmd_check_rois passed). */
    mmd_pool_geometry<T> geometry(int64_t k) const {
        mmd_pool_geometry<T> g{};
        geometry(k, &g);
        return g;
    }
    /* Roi k's image and the cells its bins read. */
    double roi_reads(int64_t k, int64_t *image) const {
        const mmd_pool_geometry<T> g = geometry(k);
        int64_t rows = 0, cols = 0, lo, hi;
        for (int64_t ph = 0; ph < pooled_h; ++ph) {
            mmd_roi_pool_bin(g.start_h, g.bin_h, g.mmcv, ph, height, &lo, &hi);
            rows += hi > lo ? hi - lo : 0;
        }
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            mmd_roi_pool_bin(g.start_w, g.bin_w, g.mmcv, pw, width, &lo, &hi);
            cols += hi > lo ? hi - lo : 0;
        }
        *image = g.batch;
        return (double)rows * (double)cols;
    }
    double all_reads() const {
        double reads = 0;
        int64_t image;
        for (int64_t k = 0; k < num_rois; ++k) reads += roi_reads(k, &image);
        return reads;
    }
};

/* f(Row()) with pool_plane's row type (below): int32_t where the height
 * fits it and T is float, so that the vector blends of values and rows
 * have one width. */
template <typename T, typename F> auto with_pool_rows(int64_t height, const F &f) {
    if (sizeof(T) == 4 && height <= INT32_MAX) return f(int32_t());
    return f(int64_t());
}

/* The column of [w0, w1) whose (col_max, col_row) ranks first (pool_plane
 * below): the largest value, then the smallest row, then the first column.
 * -1 for an empty bin. */
template <typename T, typename Row>
MMD_INLINE int64_t best_column(const T *col_max, const Row *col_row, int64_t w0, int64_t w1) {
    T best = -(T)INFINITY;
    Row best_h = std::numeric_limits<Row>::max();
    int64_t best_w = w0 < w1 ? w0 : -1;
    for (int64_t w = w0; w < w1; ++w) {
        const T v = col_max[w];
        const Row r = col_row[w];
        const bool take = (v > best) | ((v == best) & (r < best_h));
        best = take ? v : best;
        best_h = take ? r : best_h;
        best_w = take ? w : best_w;
    }
    return best_w;
}

/* The same for float: each column's (value, row) becomes one integer whose
 * order is that ranking, the value's bits made monotonic (-0 counted as +0,
 * which compares equal) above the row's complement, so the loop carries
 * one integer maximum. Every key is above 0. */
template <>
MMD_INLINE int64_t best_column(const float *col_max, const int32_t *col_row, int64_t w0,
                           int64_t w1) {
    uint64_t best = 0;
    int64_t best_w = -1;
    for (int64_t w = w0; w < w1; ++w) {
        uint32_t bits;
        memcpy(&bits, &col_max[w], sizeof bits);
        bits = (bits << 1) == 0 ? 0 : bits;   /* -0 as +0, in any rounding mode */
        bits ^= (uint32_t)((int32_t)bits >> 31) | 0x80000000u;
        const uint64_t key = (uint64_t)bits << 32 | (uint32_t)~col_row[w];
        const bool take = key > best;
        best = take ? key : best;
        best_w = take ? w : best_w;
    }
    return best_w;
}

/* The vectors of the column reduction: 32 bytes, one AVX2 register (the
 * SSE clones split each in two). */
constexpr int kPoolBytes = 32;

/* The column reduction below (pool_plane) for the NV * lanes columns from
 * `start` over rows [h0, h1), with each column's maximum and row in vector
 * registers over the rows. Row has T's width, so the two vectors have the
 * same lanes. */
template <int NV, typename T, typename Row>
MMD_INLINE void max_columns(const T *plane, int64_t width, int64_t h0, int64_t h1,
                            int64_t start, T *col_max, Row *col_row) {
    typedef typename Vec<T, kPoolBytes>::type V;
    typedef typename Vec<Row, kPoolBytes>::type R;
    constexpr int L = Vec<T, kPoolBytes>::lanes;
    static_assert(Vec<Row, kPoolBytes>::lanes == L, "rows and values in the same lanes");
    V best[NV];
    R at[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
        best[j] = V{} - (T)INFINITY;
        at[j] = R{} + std::numeric_limits<Row>::max();
    }
    const T *row = plane + h0 * width + start;
    for (int64_t h = h0; h < h1; ++h, row += width) {
        const R here = R{} + (Row)h;
#pragma GCC unroll 4
        for (int j = 0; j < NV; ++j) {
            const V v = Vec<T, kPoolBytes>::load(row + j * L);
            const auto take = v > best[j];
            best[j] = take ? v : best[j];
            at[j] = take ? here : at[j];
        }
    }
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) {
        Vec<T, kPoolBytes>::store(col_max + start + j * L, best[j]);
        Vec<Row, kPoolBytes>::store(col_row + start + j * L, at[j]);
    }
}

/* The column reduction one column at a time, in a loop the compiler
 * vectorises (written as one select on v > m, it branches instead). */
template <typename T, typename Row>
MMD_INLINE void column_by_column(const T *plane, int64_t width, int64_t h0, int64_t h1,
                                 int64_t lo, int64_t hi, T *__restrict col_max,
                                 Row *__restrict col_row) {
    for (int64_t w = lo; w < hi; ++w) {
        col_max[w] = -(T)INFINITY;
        col_row[w] = std::numeric_limits<Row>::max();
    }
    for (int64_t h = h0; h < h1; ++h) {
        const T *__restrict row = plane + h * width;
        for (int64_t w = lo; w < hi; ++w) {
            const T v = row[w], m = col_max[w];
            const Row take = -(Row)(v > m);
            col_max[w] = v > m ? v : m;
            col_row[w] = (col_row[w] & ~take) | ((Row)h & take);
        }
    }
}

/* col_max and col_row over rows [h0, h1) for the columns [lo, hi): in
 * chunks of up to 4 vectors (max_columns) where Row has T's width and the
 * map's row holds a vector, else column_by_column. Each column is reduced
 * on its own, so chunks may overlap, and a chunk may take columns on either
 * side of [lo, hi) inside the map's row (col_max and col_row have `width`
 * entries). */
template <typename T, typename Row>
MMD_INLINE void column_maxima(const T *plane, int64_t width, int64_t h0, int64_t h1,
                              int64_t lo, int64_t hi, T *__restrict col_max,
                              Row *__restrict col_row) {
    constexpr int L = Vec<T, kPoolBytes>::lanes, C = 4 * L;
    if constexpr (sizeof(Row) != sizeof(T)) {
        column_by_column(plane, width, h0, h1, lo, hi, col_max, col_row);
    } else if (width < L) {
        column_by_column(plane, width, h0, h1, lo, hi, col_max, col_row);
    } else if (hi - lo > C) {
        for (int64_t w = lo;; w += C) {
            const int64_t s = w < hi - C ? w : hi - C;
            max_columns<4>(plane, width, h0, h1, s, col_max, col_row);
            if (s + C >= hi) break;
        }
    } else {
        const int64_t vectors = (hi - lo + L - 1) / L;
        const int64_t s = lo < width - vectors * L ? lo : width - vectors * L;
        if (s < 0) {  /* the row holds fewer than `vectors`: overlapping single ones */
            for (int64_t w = lo; w < hi; w += L)
                max_columns<1>(plane, width, h0, h1, w < hi - L ? w : hi - L, col_max, col_row);
        } else if (vectors == 1) {
            max_columns<1>(plane, width, h0, h1, s, col_max, col_row);
        } else if (vectors == 2) {
            max_columns<2>(plane, width, h0, h1, s, col_max, col_row);
        } else if (vectors == 3) {
            max_columns<3>(plane, width, h0, h1, s, col_max, col_row);
        } else {
            max_columns<4>(plane, width, h0, h1, s, col_max, col_row);
        }
    }
}

/* A bin's maximum and argmax by the definition: the first maximum of a
 * row-major scan with a strict >, NaN skipped, NaN for a bin of only NaN.
 * The bin is not empty. */
template <typename T>
void scan_bin(const T *plane, int64_t width, int64_t h0, int64_t h1, int64_t w0, int64_t w1,
              T *out, int64_t *argmax) {
    T best = 0;
    int64_t at = -1;
    for (int64_t h = h0; h < h1; ++h)
        for (int64_t w = w0; w < w1; ++w) {
            const T v = plane[h * width + w];
            if (v == v && (at < 0 || v > best)) {
                best = v;
                at = h * width + w;
            }
        }
    *out = at >= 0 ? best : (T)NAN;
    *argmax = at;
}

/* Max of every bin of one (roi, channel) plane: `plane` is the roi's image
 * and channel, `out` and `argmax` its pooled_h * pooled_w bins.
 *
 * A row of bins shares its map rows, so the rows are reduced first, column
 * by column, in vector registers (column_maxima): `col_max[w]` is the largest
 * value above -inf of column w over the bins' rows and `col_row[w]` the
 * first row holding it; -inf and `none` where there is none (only NaN and
 * -inf). Each bin then takes, over its columns, the largest value and,
 * between equal ones, the smallest row, then the smallest column: the
 * first maximum in row-major order, which a row-major scan with a strict >
 * finds. A bin whose best column has `none` holds no value above -inf;
 * scan_bin finds its first -inf, or NaN. `col_max` and `col_row` have
 * `width` entries. Row is int32_t where the height fits it, so that for
 * float the vector blends of values and rows have one width.
 *
 * Compiled for AVX2, SSE4.2 and SSE2 (MMD_X86_CLONES): SSE2 has no blend,
 * and its blends of values and rows (and, andnot, or, and the copies its
 * two-operand forms need) take a third more time than the whole forward
 * does with SSE4.2's. */
template <typename T, typename Row>
MMD_X86_CLONES void pool_plane(const T *plane, int64_t height, int64_t width,
                               const mmd_pool_geometry<T> &g, int64_t pooled_h,
                               int64_t pooled_w, T *out, int64_t *argmax,
                               T *__restrict col_max, Row *__restrict col_row) {
    const Row none = std::numeric_limits<Row>::max();
    int64_t lo, hi, last;
    mmd_roi_pool_bin(g.start_w, g.bin_w, g.mmcv, 0, width, &lo, &last);
    mmd_roi_pool_bin(g.start_w, g.bin_w, g.mmcv, pooled_w - 1, width, &last, &hi);
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        int64_t h0, h1;
        mmd_roi_pool_bin(g.start_h, g.bin_h, g.mmcv, ph, height, &h0, &h1);
        T *bin_out = out + ph * pooled_w;
        int64_t *bin_arg = argmax + ph * pooled_w;
        if (h0 >= h1 || lo >= hi) {  /* the whole row of bins is off the map */
            for (int64_t pw = 0; pw < pooled_w; ++pw) {
                bin_out[pw] = 0;
                bin_arg[pw] = -1;
            }
            continue;
        }
        column_maxima(plane, width, h0, h1, lo, hi, col_max, col_row);
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            int64_t w0, w1;
            mmd_roi_pool_bin(g.start_w, g.bin_w, g.mmcv, pw, width, &w0, &w1);
            const int64_t w = best_column(col_max, col_row, w0, w1);
            if (w < 0) {  /* an empty bin */
                bin_out[pw] = 0;
                bin_arg[pw] = -1;
            } else if (col_row[w] == none) {
                scan_bin(plane, width, h0, h1, w0, w1, bin_out + pw, bin_arg + pw);
            } else {
                bin_out[pw] = col_max[w];
                bin_arg[pw] = (int64_t)col_row[w] * width + w;
            }
        }
    }
}

/* pool_plane over items [begin, end): item i is channel i / num_rois of roi
 * i % num_rois. Channel-major, so the rois of one channel follow each other
 * and read its map planes from cache: rois overlap (a cell of the standard
 * workload lies in about 30), and roi-major order read the whole map from
 * memory once per overlapping roi. */
template <typename T, typename Row>
int pool_planes(int64_t begin, int64_t end, const T *in, const PoolCall<T> &call, T *out,
                int64_t *argmax) {
    const HeapArray<T> col_max(call.width);
    const HeapArray<Row> col_row(call.width);
    if (!col_max || !col_row)
        return mmd_error(MMD_ERR_MEMORY, "out of memory for a row of %lld cells",
                         (long long)call.width);
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    for (int64_t i = begin; i < end; ++i) {
        const int64_t c = i / call.num_rois, k = i % call.num_rois, p = k * call.channels + c;
        const mmd_pool_geometry<T> g = call.geometry(k);
        pool_plane(in + (g.batch * call.channels + c) * plane_size, call.height, call.width, g,
                   call.pooled_h, call.pooled_w, out + p * bins, argmax + p * bins,
                   col_max.get(), col_row.get());
    }
    return MMD_OK;
}

using mmd_channel_groups::GroupItem;
using mmd_channel_groups::kGroup;

template <typename T> using PoolRois = mmd_channel_groups::ImageRois<PoolCall<T>>;

/* The maxima and argmaxima of one roi's bins for a group's `count`
 * channels, from their interleaved planes `cells`, into the roi's runs of
 * `out` and `argmax` (channel c0's bins first); `planes` are the group's
 * planes of the image, for a bin whose lane holds no value above -inf
 * (scan_bin finds its first -inf or NaN). A bin's cells go round-robin by
 * column into 4 accumulators (independent chains), each the first
 * maximum in row-major order of its cells with a strict > (NaN never
 * taken); the accumulators' merge takes the larger value, and between
 * equal ones the smaller flat index: the first maximum in row-major
 * order, as pool_plane's. */
template <typename T>
MMD_X86_CLONES void pool_group_roi(const T *cells, const T *planes, int64_t height,
                                   int64_t width, const mmd_pool_geometry<T> &g,
                                   int64_t pooled_h, int64_t pooled_w, int64_t count, T *out,
                                   int64_t *argmax) {
    typedef mmd_channel_groups::GroupVec<T> V;
    typedef typename std::conditional<sizeof(T) == 4, int32_t, int64_t>::type Lane;
    typedef Vec<Lane, 32> R;
    constexpr int64_t L = V::lanes;
    static_assert(R::lanes == L, "indices and values in the same lanes");
    constexpr Lane none = std::numeric_limits<Lane>::max();
    const int64_t bins = pooled_h * pooled_w, plane_size = height * width;
    for (int64_t ph = 0; ph < pooled_h; ++ph) {
        int64_t h0, h1;
        mmd_roi_pool_bin(g.start_h, g.bin_h, g.mmcv, ph, height, &h0, &h1);
        for (int64_t pw = 0; pw < pooled_w; ++pw) {
            int64_t w0, w1;
            mmd_roi_pool_bin(g.start_w, g.bin_w, g.mmcv, pw, width, &w0, &w1);
            const int64_t b = ph * pooled_w + pw;
            if (h0 >= h1 || w0 >= w1) {   /* an empty bin */
                for (int64_t l = 0; l < count; ++l) {
                    out[l * bins + b] = 0;
                    argmax[l * bins + b] = -1;
                }
                continue;
            }
            typename V::type best[4];
            typename R::type at[4];
            for (int j = 0; j < 4; ++j) {
                best[j] = typename V::type{} - (T)INFINITY;
                at[j] = typename R::type{} + none;
            }
            const int64_t n = w1 - w0, whole = n / 4 * 4;
            for (int64_t h = h0; h < h1; ++h) {
                const T *row = cells + (h * width + w0) * L;
                typename R::type index = typename R::type{} + (Lane)(h * width + w0);
                int64_t x = 0;
                for (; x < whole; x += 4, index += 4) {
#pragma GCC unroll 4
                    for (int j = 0; j < 4; ++j) {
                        const typename V::type v = V::load(row + (x + j) * L);
                        const auto take = v > best[j];
                        best[j] = take ? v : best[j];
                        at[j] = take ? index : at[j];
                    }
                }
                for (int j = 0; x < n; ++x, ++j) {
                    const typename V::type v = V::load(row + x * L);
                    const auto take = v > best[j];
                    best[j] = take ? v : best[j];
                    at[j] = take ? index : at[j];
                }
            }
            /* accumulator j kept the flat index of its cells' column x, not x + j */
            for (int j = 1; j < 4; ++j) at[j] = at[j] != none ? at[j] + (Lane)j : at[j];
            for (int j = 1; j < 4; ++j) {
                const auto take =
                    (best[j] > best[0]) | ((best[j] == best[0]) & (at[j] < at[0]));
                best[0] = take ? best[j] : best[0];
                at[0] = take ? at[j] : at[0];
            }
            T value[L];
            Lane where[L];
            V::store(value, best[0]);
            R::store(where, at[0]);
            for (int64_t l = 0; l < count; ++l) {
                if (where[l] == none)
                    scan_bin(planes + l * plane_size, width, h0, h1, w0, w1, &out[l * bins + b],
                             &argmax[l * bins + b]);
                else {
                    out[l * bins + b] = value[l];
                    argmax[l * bins + b] = (int64_t)where[l];
                }
            }
        }
    }
}

/* The forward of a GroupItem: its channels of its slice's rois, from the
 * image's planes of the group interleaved where the slice's rois read them
 * often enough (PoolRois), else pool_plane a channel at a time. False when
 * out of memory. */
template <typename T>
bool pool_group(const PoolCall<T> &call, const PoolRois<T> &images, const T *input, T *output,
                int64_t *argmax, const GroupItem<T> &it) {
    const int64_t bins = call.bins(), plane_size = call.height * call.width;
    const T *planes = input + (it.image * call.channels + it.c0) * plane_size;
    if (it.interleaved) {
        mmd_channel_groups::interleave(planes, plane_size, it.count, it.cells);
        for (int64_t i = it.first; i < it.last; ++i) {
            const int64_t k = images.roi(i), p = (k * call.channels + it.c0) * bins;
            pool_group_roi(it.cells, planes, call.height, call.width, call.geometry(k),
                           call.pooled_h, call.pooled_w, it.count, output + p, argmax + p);
        }
        return true;
    }
    return with_pool_rows<T>(call.height, [&](auto row) {
        const HeapArray<T> col_max(call.width);
        const HeapArray<decltype(row)> col_row(call.width);
        if (!col_max || !col_row) return false;
        for (int64_t l = 0; l < it.count; ++l)
            for (int64_t i = it.first; i < it.last; ++i) {
                const int64_t k = images.roi(i), p = (k * call.channels + it.c0 + l) * bins;
                pool_plane(planes + l * plane_size, call.height, call.width, call.geometry(k),
                           call.pooled_h, call.pooled_w, output + p, argmax + p, col_max.get(),
                           col_row.get());
            }
        return true;
    });
}

template <typename T>
int roi_pool_forward(const mmd_tensor *input, const mmd_tensor *rois, const mmd_tensor *output,
                     const mmd_tensor *argmax, T spatial_scale, int64_t convention) {
    const int64_t batch = input->shape[0], channels = input->shape[1];
    const int64_t height = input->shape[2], width = input->shape[3];
    const int64_t pooled_h = output->shape[2], pooled_w = output->shape[3];
    const int64_t num_rois = rois->shape[0], planes = num_rois * channels;
    const PoolCall<T> call{(const T *)rois->data, num_rois, batch,    channels,
                           height,                width,    pooled_h, pooled_w,
                           convention,            spatial_scale};
    int s = mmd_check_rois<mmd_pool_geometry<T>>(call);
    if (s || mmd_numel(output) == 0) return s;
    const T *in = (const T *)input->data;
    T *out = (T *)output->data;
    int64_t *am = (int64_t *)argmax->data;
    double reads = -1;   /* all_reads(), where few_reads() found it */
    if (channels >= kGroup<T> && !PoolRois<T>::few_reads(call, &reads)) {
        const PoolRois<T> images(call, reads);
        return mmd_channel_groups::for_each_group_item(
            call, images, true,
            [&](const GroupItem<T> &it) { return pool_group(call, images, in, out, am, it); });
    }
    return with_pool_rows<T>(height, [&](auto row) {
        return mmd_parallel_for(planes, 16, mmd_worth_threads(planes, planes * call.bins()),
                                [&](int64_t begin, int64_t end) {
            return pool_planes<T, decltype(row)>(begin, end, in, call, out, am);
        });
    });
}

/* Rois ahead of the one being added whose argmax and grad_output rows, and
 * whose grad_input cells, are prefetched (the cells from the argmax rows
 * fetched before): a roi's 49 cells lie anywhere in its channel's plane,
 * mostly out of cache, and waiting for them took a third of the time. */
constexpr int64_t kRowsAhead = 8, kCellsAhead = 2;

/* Accumulates into grad_input (the caller passes zeros, as in MMCV). A
 * channel's gradients come from its rois in order, so each sum has one
 * order (deterministic, race-free). */
template <typename T>
int roi_pool_backward(const mmd_tensor *grad_output, const mmd_tensor *rois,
                      const mmd_tensor *argmax, const mmd_tensor *grad_input, T spatial_scale,
                      int64_t convention) {
    const int64_t batch = grad_input->shape[0], channels = grad_input->shape[1];
    const int64_t plane_size = grad_input->shape[2] * grad_input->shape[3];
    const int64_t pooled_h = grad_output->shape[2], pooled_w = grad_output->shape[3];
    const int64_t bins = pooled_h * pooled_w, num_rois = rois->shape[0];
    const PoolCall<T> call{(const T *)rois->data,  num_rois, batch,    channels,
                           grad_input->shape[2],   grad_input->shape[3], pooled_h, pooled_w,
                           convention,             spatial_scale};
    int s = mmd_check_rois<mmd_pool_geometry<T>>(call);
    if (s) return s;
    const int64_t *am = (const int64_t *)argmax->data;
    const int64_t total = mmd_numel(argmax);
    for (int64_t i = 0; i < total; ++i)
        if (am[i] < -1 || am[i] >= plane_size)
            return mmd_roi_pool_argmax_error(i, am[i], plane_size);
    if (total == 0 || mmd_numel(grad_input) == 0) return MMD_OK;
    const T *go = (const T *)grad_output->data;
    T *gi = (T *)grad_input->data;
    /* each roi's image, found once rather than per channel and per use */
    const HeapArray<int64_t> image_of(num_rois);
    if (!image_of)
        return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld rois", (long long)num_rois);
    for (int64_t k = 0; k < num_rois; ++k) image_of[k] = call.geometry(k).batch;
    /* roi k's grad_input plane of channel c */
    auto plane_of = [&](int64_t k, int64_t c) {
        return gi + (image_of[k] * channels + c) * plane_size;
    };
    return mmd_parallel_for(
        channels, 1, mmd_worth_threads(channels, total), [&](int64_t begin, int64_t end) {
            for (int64_t c = begin; c < end; ++c)
                for (int64_t k = 0; k < num_rois; ++k) {
                    if (k + kRowsAhead < num_rois) {
                        const int64_t ahead = ((k + kRowsAhead) * channels + c) * bins;
                        mmd_prefetch_bytes(go + ahead, bins * (int64_t)sizeof(T));
                        mmd_prefetch_bytes(am + ahead, bins * (int64_t)sizeof(int64_t));
                    }
                    if (k + kCellsAhead < num_rois) {
                        const int64_t ahead = ((k + kCellsAhead) * channels + c) * bins;
                        const T *plane = plane_of(k + kCellsAhead, c);
                        for (int64_t b = 0; b < bins; ++b)
                            if (am[ahead + b] >= 0) mmd_prefetch(plane + am[ahead + b]);
                    }
                    T *plane = plane_of(k, c);
                    const int64_t base = (k * channels + c) * bins;
                    for (int64_t b = 0; b < bins; ++b)
                        if (am[base + b] >= 0) plane[am[base + b]] += go[base + b];
                }
            return (int)MMD_OK;
        });
}

int roi_pool_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                         const mmd_tensor *output, const mmd_tensor *argmax,
                         int64_t pooled_height, int64_t pooled_width, double spatial_scale,
                         int64_t convention, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_pool_forward_check(input, rois, output, argmax, pooled_height, pooled_width,
                                       spatial_scale, convention, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return roi_pool_forward<float>(input, rois, output, argmax, (float)spatial_scale,
                                       convention);
    return roi_pool_forward<double>(input, rois, output, argmax, spatial_scale, convention);
}

int roi_pool_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                          const mmd_tensor *argmax, const mmd_tensor *grad_input,
                          int64_t pooled_height, int64_t pooled_width, double spatial_scale,
                          int64_t convention, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_roi_pool_backward_check(grad_output, rois, argmax, grad_input, pooled_height,
                                        pooled_width, spatial_scale, convention,
                                        MMD_FLOAT32_64);
    if (s) return s;
    if (grad_input->dtype == MMD_FLOAT32)
        return roi_pool_backward<float>(grad_output, rois, argmax, grad_input,
                                        (float)spatial_scale, convention);
    return roi_pool_backward<double>(grad_output, rois, argmax, grad_input, spatial_scale,
                                     convention);
}

}  // namespace

MMD_REGISTRATIONS(cpu, roi_pool) {
    MMD_REGISTER_DEVICE_IMPL(roi_pool_forward_impl, CPU, DEFAULT, roi_pool_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(roi_pool_backward_impl, CPU, DEFAULT, roi_pool_backward_cpu);
}
