/* roi_align on CUDA (MMCV semantics, math shared with the CPU kernels via
 * mmdispatch/ops/roi_align.h).
 *
 * avg pooling: a thread per bin and group of kChannelGroup channels. Bilinear
 * weights are products of a row's and a column's, so the thread walks the
 * rows and the columns its bin's samples read, each with the weights of
 * every sample that reads it summed (samples a cell apart or closer, as
 * adaptive sampling places them, share rows and columns): a bin of g x g
 * samples then reads (g + 1)^2 cells per channel instead of 4 g^2, and the
 * backward makes as many atomic adds. The walk keeps at most two cells of
 * an axis in registers (no list in local memory), once for the group: each
 * cell it reaches serves the 8 channels (a walk per channel would redo a
 * row's column interpolations 8 times, for bins of many samples more than
 * the atomics). The roi's geometry is worked out once per group. Forwards
 * whose bins read the map's cells twice over or more, on 16 channels or
 * more, take the transposed kernels instead (avg_forward_transposed_kernel:
 * the map 32 channels at a time transposed into scratch, a warp per bin and
 * a lane per channel, each cell one coalesced load of its 32 channels, the
 * cells and weights of a roi's rows and columns of bins listed once per roi
 * in shared memory, BinAxes);
 * the default backward likewise adds into scratch of that layout
 * (avg_backward_transposed_kernel), then into grad_input. max
 * pooling: a thread per output element (channel-major, common.cuh's
 * PooledElement), sample by sample.
 *
 * The `default` backward adds into grad_input with atomics (float avg on
 * devices with vector atomics: a row's cells in windows of 4, common.cuh's
 * CellWindow, one float4 atomic per window and channel), the
 * `deterministic` one gives each tile of an image's cells and 32 channels
 * (avg on 16 channels or more), each band of rows of an (image, channel)
 * plane (avg on fewer) or each plane (max) of grad_input to one block,
 * which adds the rois into it in order (the same sums in the same order on
 * every run).
 * float16 and bfloat16 inputs compute in float32. Launches on ctx->stream,
 * on ctx->device_id.
 *
 * Bad rois never cause an out-of-bounds access. By default each thread
 * validates its roi: a bad roi's bins are NaN (argmax -1) in forward and
 * add nothing in backward, and the roi is reported as a deferred error
 * (raised by the next call on the device). In strict mode a check kernel
 * validates every roi first and the call raises, writing nothing. */
#include <limits.h>

#include <type_traits>

#include "mmdispatch/cuda/chunks.cuh"
#include "mmdispatch/cuda/rois.cuh"
#include "mmdispatch/ops/roi_align.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

/* The shared math's types (mmdispatch/ops/roi_align.h) of compute type A. */
template <typename A> using Geometry = mmd_roi_geometry<A>;
template <typename A> using Axis = mmd_interp_axis<A>;

template <typename T, typename A>
__device__ inline void load_roi(const T *rois, int64_t k, A roi[5]) {
    for (int i = 0; i < 5; ++i) roi[i] = to_compute(rois[5 * k + i]);
}

/* Roi k's MMD_ROI_* code, for check_rois (mmdispatch/cuda/rois.cuh). */
template <typename T> struct RoiCheck {
    typedef typename Compute<T>::type A;
    const T *rois;
    int64_t batch;
    A scale;
    int64_t pooled_h, pooled_w, sampling_ratio;
    int aligned;

    __device__ int operator()(int64_t k) const {
        A roi[5];
        load_roi(rois, k, roi);
        Geometry<A> g;
        return mmd_roi_align_geometry(roi, batch, scale, pooled_h, pooled_w, sampling_ratio,
                                      aligned, &g);
    }
};

template <typename T, typename A>
__device__ inline A bilinear(const T *plane, int64_t width, const Axis<A> &ay,
                             const Axis<A> &ax) {
    const T *lo = plane + ay.low * width;
    const T *hi = plane + ay.high * width;
    return ay.w_low * (ax.w_low * to_compute(lo[ax.low]) + ax.w_high * to_compute(lo[ax.high])) +
           ay.w_high * (ax.w_low * to_compute(hi[ax.low]) + ax.w_high * to_compute(hi[ax.high]));
}

/* The avg kernels walk cells with int indices, on maps no wider or taller
 * than this; larger maps are summed sample by sample (the emulator's build
 * lowers the limit to test that path). */
#ifndef MMD_CUDA_CELL_WALK_MAX
#define MMD_CUDA_CELL_WALK_MAX INT_MAX
#endif

/* f(cell, weight) for each cell one axis of a bin reads (its `grid` samples
 * along an axis of `size` cells, from `bin_start`), in increasing order, each
 * with the summed weight of the samples that read it (samples a cell apart
 * or closer, as adaptive sampling places them, share cells), the sums in
 * the samples' order. Samples come in increasing order and read cells
 * `low` <= `high` <= low + 1, so a cell below a sample's `low` is read by
 * no later sample and is handed on, and at most two cells wait: the walk
 * lives in registers, with no list in local memory, and f has one call
 * site (it is inlined once). */
template <typename A, typename F>
__device__ inline void for_each_cell(A bin_start, A bin_size, int grid, int size, F f) {
    int cell0 = 0, cell1 = 0;   /* the waiting cells, cell0 < cell1 */
    A weight0 = 0, weight1 = 0;
    int waiting = 0;
    const auto add = [&](int cell, A w) {
        if (waiting > 0 && cell0 == cell) {
            weight0 += w;
        } else if (waiting > 1 && cell1 == cell) {
            weight1 += w;
        } else if (waiting == 0) {
            cell0 = cell;
            weight0 = w;
            waiting = 1;
        } else {   /* the cells waiting are a subset of {low, low + 1} */
            cell1 = cell;
            weight1 = w;
            waiting = 2;
        }
    };
    for (int i = 0; i <= grid; ++i) {   /* i == grid: hand on what waits */
        Axis<A> a;
        if (i < grid) {
            mmd_interp(mmd_roi_align_bin_sample(bin_start, bin_size, i, grid), size, &a);
            if (!a.valid) continue;
        }
        while (waiting > 0 && (i == grid || cell0 < (int)a.low)) {
            f(cell0, weight0);
            cell0 = cell1;
            weight0 = weight1;
            --waiting;
        }
        if (i == grid) break;
        add((int)a.low, a.w_low);
        add((int)a.high, a.w_high);
    }
}

/* Roi k's geometry in *g; false for a bad roi, which the thread reports
 * when it is the roi's `reporter` (one thread per roi in the grid). */
template <typename T, typename A>
__device__ inline bool geometry_of(const T *rois, int64_t k, int64_t batch, A scale,
                                   int64_t pooled_h, int64_t pooled_w, int64_t sampling_ratio,
                                   int aligned, bool reporter, const ErrorSink &sink,
                                   Geometry<A> *g) {
    A roi[5];
    load_roi(rois, k, roi);
    const int code =
        mmd_roi_align_geometry(roi, batch, scale, pooled_h, pooled_w, sampling_ratio, aligned, g);
    if (code == MMD_ROI_OK) return true;
    if (reporter) sink.report(k, code);
    return false;
}

/* A thread of the avg kernels: a bin of roi k for a group of channels
 * (common.cuh: channel-major); false for a bad roi, which the roi's first
 * thread reports. */
template <typename T, typename A>
__device__ inline bool locate_avg_work(int64_t index, const T *rois, int64_t num_rois,
                                       int64_t channels, int64_t pooled_h, int64_t pooled_w,
                                       int64_t batch, A scale, int64_t sampling_ratio,
                                       int aligned, const ErrorSink &sink, BinGroup *w,
                                       Geometry<A> *g) {
    *w = locate_bin_group(index, num_rois, channels, pooled_h, pooled_w);
    return geometry_of(rois, w->k, batch, scale, pooled_h, pooled_w, sampling_ratio, aligned,
                       w->first, sink, g);
}

/* f(ay, ax) for each sample of bin (ph, pw) that lies on the map, in the
 * definition's order (rows of samples, then columns). */
template <typename A, typename F>
__device__ inline void for_each_sample(int64_t height, int64_t width, const Geometry<A> &g,
                                       int64_t ph, int64_t pw, F f) {
    for (int64_t iy = 0; iy < g.grid_h; ++iy) {
        Axis<A> ay;
        mmd_interp(mmd_roi_align_sample(g.start_h, g.bin_h, ph, iy, g.grid_h), height, &ay);
        if (!ay.valid) continue;
        for (int64_t ix = 0; ix < g.grid_w; ++ix) {
            Axis<A> ax;
            mmd_interp(mmd_roi_align_sample(g.start_w, g.bin_w, pw, ix, g.grid_w), width, &ax);
            if (ax.valid) f(ay, ax);
        }
    }
}

/* The sum of bin (ph, pw)'s samples of one plane, sample by sample. */
template <typename T, typename A>
__device__ inline A sum_samples(const T *plane, int64_t height, int64_t width,
                                const Geometry<A> &g, int64_t ph, int64_t pw) {
    A sum = 0;
    for_each_sample(height, width, g, ph, pw, [&](const Axis<A> &ay, const Axis<A> &ax) {
        sum += bilinear<T, A>(plane, width, ay, ax);
    });
    return sum;
}

template <typename T>
__global__ void avg_forward_kernel(const T *input, const T *rois, T *output, int64_t total,
                                   int64_t num_rois, int64_t channels, int64_t height,
                                   int64_t width, int64_t pooled_h, int64_t pooled_w,
                                   int64_t batch, typename Compute<T>::type scale,
                                   int64_t sampling_ratio, int aligned, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t bins = pooled_h * pooled_w, plane_size = height * width;
    const bool walk = height <= MMD_CUDA_CELL_WALK_MAX && width <= MMD_CUDA_CELL_WALK_MAX;
    MMD_GRID_STRIDE_LOOP(index, total) {
        BinGroup w;
        Geometry<A> g;
        const bool good = locate_avg_work<T, A>(index, rois, num_rois, channels, pooled_h,
                                                pooled_w, batch, scale, sampling_ratio, aligned,
                                                sink, &w, &g);
        T *out = output + ((w.k * channels + w.c0) * pooled_h + w.ph) * pooled_w + w.pw;
        if (!good) {
            for (int64_t c = 0; c < w.count; ++c) out[c * bins] = from_compute<T>((A)NAN);
            continue;
        }
        const T *planes = input + (g.batch * channels + w.c0) * plane_size;
        const int64_t count = g.grid_h * g.grid_w;
        const A divisor = (A)(count > 1 ? count : 1);
        unsigned by_sample = (1u << w.count) - 1;   /* channels summed sample by sample */
        if (walk) {
            const A row_start = mmd_roi_align_bin_start(g.start_h, g.bin_h, w.ph);
            const A col_start = mmd_roi_align_bin_start(g.start_w, g.bin_w, w.pw);
            A sum[kChannelGroup] = {};
            for_each_cell(row_start, g.bin_h, (int)g.grid_h, (int)height, [&](int y, A wy) {
                const T *row = planes + (int64_t)y * width;
                A dot[kChannelGroup] = {};
                for_each_cell(col_start, g.bin_w, (int)g.grid_w, (int)width, [&](int x, A wx) {
                    const T *cell = row + x;
#pragma unroll   /* a column's weight serves the group */
                    for (int c = 0; c < kChannelGroup; ++c) {
                        if (c < w.count) dot[c] += wx * to_compute(*cell);
                        if (c + 1 < w.count) cell += plane_size;   /* never past the map */
                    }
                });
#pragma unroll
                for (int c = 0; c < kChannelGroup; ++c) sum[c] += wy * dot[c];
            });
#pragma unroll
            for (int c = 0; c < kChannelGroup; ++c) {   /* unrolled: sum[] stays in registers */
                if (c >= w.count) break;
                if (isfinite(sum[c])) {
                    out[c * bins] = from_compute<T>(sum[c] / divisor);
                    by_sample &= ~(1u << c);
                }
            }
        }
        /* an inf or NaN cell: the definition, sample by sample, where a
         * sample's zero weight on it gives NaN that a merged weight hides */
        for (; by_sample; by_sample &= by_sample - 1) {
            const int c = __ffs((int)by_sample) - 1;
            out[c * bins] = from_compute<T>(
                sum_samples<T, A>(planes + c * plane_size, height, width, g, w.ph, w.pw) /
                divisor);
        }
    }
}

/* The transposed avg forward, for calls whose bins read the map's cells
 * many times over: the map a chunk of kLanes channels at a time, first
 * transposed into scratch as (batch, height, width, kLanes), so that a
 * cell's channels of the chunk lie in one line (a group of chunks a launch:
 * chunks.cuh); then a block per (chunk, roi), a warp per bin (8 bins at a
 * time), a lane per channel. The warp walks its
 * bin's cells once, the walk's arithmetic the same in every lane (one issue
 * serves the chunk's channels), and reads each cell's channels with one
 * coalesced load, where avg_forward_kernel's lanes are 32 bins, each load a
 * sector of its own (on an H100 at sr=2 that forward moved about 3 GB
 * between L2 and the SMs for a 124 MB map). The bins' sums collect in
 * shared memory and leave as the chunk's contiguous block of output
 * (mmdispatch/cuda/chunks.cuh: the chunks and their transposition). */
/* Blocks of the transposed kernels an SM keeps resident at least (their
 * registers capped to fit: 24 warps, for the gathers' latency) */
constexpr int kTransposedBlocks = 3;

/* A thread of the transposed kernels: its lane (the chunk's channel c0 +
 * lane) and warp; the bins and the map's cells; whether the map is walked;
 * the block's [channel][bin] values of the chunk in shared memory. */
struct ChunkThread {
    int lane, warp, warps;
    int64_t bins, plane_size;
    bool walk;
    __device__ ChunkThread(int64_t height, int64_t width, int64_t pooled_h, int64_t pooled_w)
        : lane(threadIdx.x % kLanes), warp(threadIdx.x / kLanes), warps(blockDim.x / kLanes),
          bins(pooled_h * pooled_w), plane_size(height * width),
          walk(height <= MMD_CUDA_CELL_WALK_MAX && width <= MMD_CUDA_CELL_WALK_MAX) {}
    template <typename A> __device__ A *shared() const {
        extern __shared__ unsigned char shared_bytes[];
        return reinterpret_cast<A *>(shared_bytes);
    }
};

/* f(k, good, geometry, chunk) for each roi and Chunk of the group of
 * `count` channels from c0 that the block takes (for_each_roi_of_chunks;
 * uniform in the block); the first chunk's first thread reports a bad roi
 * (once per call). */
template <typename T, typename A, typename F>
__device__ inline void for_each_block_roi(const T *rois, int64_t num_rois, int64_t batch, A scale,
                                          int64_t pooled_h, int64_t pooled_w,
                                          int64_t sampling_ratio, int aligned, int64_t c0,
                                          int64_t count, const ErrorSink &sink, F f) {
    for_each_roi_of_chunks(num_rois, c0, count, [&](int64_t k, const Chunk &part) {
        Geometry<A> g;
        const bool good = geometry_of(rois, k, batch, scale, pooled_h, pooled_w, sampling_ratio,
                                      aligned, part.c0 == 0 && threadIdx.x == 0, sink, &g);
        f(k, good, g, part);
    });
}

/* f(y, wy, columns) for each row bin (ph, pw)'s walk reaches (for_each_cell),
 * where columns(h) calls h(x, wx) for each column of the bin. */
template <typename A, typename F>
__device__ inline void walk_bin(const Geometry<A> &g, int64_t ph, int64_t pw, int64_t height,
                                int64_t width, F f) {
    const A col_start = mmd_roi_align_bin_start(g.start_w, g.bin_w, pw);
    for_each_cell(mmd_roi_align_bin_start(g.start_h, g.bin_h, ph), g.bin_h, (int)g.grid_h,
                  (int)height, [&](int y, A wy) {
        f(y, wy, [&](auto h) { for_each_cell(col_start, g.bin_w, (int)g.grid_w, (int)width, h); });
    });
}

/* The cells, and their summed weights, that each row of bins (ph) and each
 * column of bins (pw) of a roi reads: for_each_cell's walk of that axis, in
 * its order, worked out once per roi by pooled_h + pooled_w threads into
 * shared memory, where the transposed kernels' warps read them (a
 * broadcast) instead of each walking its bin, a walk that redid the
 * columns' interpolations (a division each) for every row: about 2,000
 * instructions a bin and chunk of 32 channels, where the loads are 16
 * (ncu on the H200, 2026-11-27: the forward issue-bound, 4.6 % of memory
 * throughput). An axis of more than `cap` cells (a bin of many samples, at
 * adaptive sampling of a large roi) leaves the roi to the walk. Entry e of
 * list i (rows 0 .. pooled_h - 1, then columns) is cells[i * cap + e]. */
#ifndef MMD_CUDA_AXIS_CAP   /* odd: the lists' fills (a thread each) hit distinct banks */
#define MMD_CUDA_AXIS_CAP 63
#endif
template <typename A> struct BinAxes {
    int cap;      /* entries a list holds; 0: none (every roi walks) */
    A *weights;   /* [(pooled_h + pooled_w) * cap] */
    int *cells;   /* [(pooled_h + pooled_w) * cap] */
    int *counts;  /* [pooled_h + pooled_w]: a list's cells */

    /* The lists' shared memory after `offset` bytes (a multiple of
     * sizeof(A)): weights, cells, counts. */
    __device__ BinAxes(unsigned char *shared, size_t offset, int cap_, int64_t lists)
        : cap(cap_), weights(reinterpret_cast<A *>(shared + offset)),
          cells(reinterpret_cast<int *>(weights + lists * cap_)), counts(cells + lists * cap_) {}

    /* Bin (ph, pw)'s row list (ys, wys; rows entries) and column list. */
    struct Bin {
        int rows, columns;
        const int *ys, *xs;
        const A *wys, *wxs;
    };
    __device__ Bin of_bin(int64_t ph, int64_t pw, int64_t pooled_h) const {
        const int64_t column = pooled_h + pw;
        return {counts[ph], counts[column], cells + ph * cap, cells + column * cap,
                weights + ph * cap, weights + column * cap};
    }

    /* Bytes of the lists of `lists` axes of `cap` entries (none for 0). */
    static size_t bytes(int64_t lists, int cap) {
        return cap ? (size_t)lists * ((size_t)cap * (sizeof(A) + sizeof(int)) + sizeof(int)) : 0;
    }

    /* Fills the lists for roi geometry g where `use` (uniform in the block);
     * whether they hold every axis of the roi. A barrier of the block:
     * every thread calls it. */
    __device__ bool fill(bool use, const Geometry<A> &g, int64_t pooled_h, int64_t pooled_w,
                         int64_t height, int64_t width) const {
        int missing = !use || cap == 0;
        if (!missing)
            for (int64_t i = threadIdx.x; i < pooled_h + pooled_w; i += blockDim.x) {
                const bool row = i < pooled_h;
                const int64_t bin = row ? i : i - pooled_h;
                const A start = row ? mmd_roi_align_bin_start(g.start_h, g.bin_h, bin)
                                    : mmd_roi_align_bin_start(g.start_w, g.bin_w, bin);
                int *to = cells + i * cap;
                A *weight = weights + i * cap;
                int n = 0;
                for_each_cell(start, row ? g.bin_h : g.bin_w, (int)(row ? g.grid_h : g.grid_w),
                              (int)(row ? height : width), [&](int cell, A w) {
                    if (n < cap) to[n] = cell, weight[n] = w;
                    ++n;
                });
                counts[i] = n;
                if (n > cap) missing = 1;
            }
        return !__syncthreads_or(missing);
    }
};

template <typename T>
__global__ void __launch_bounds__(kThreads, kTransposedBlocks) avg_forward_transposed_kernel(
    const T *input, const T *chunk, const T *rois, T *output, int64_t num_rois,
    int64_t channels, int64_t group_c0, int64_t group_count, int64_t height, int64_t width,
    int64_t pooled_h, int64_t pooled_w, int64_t batch, typename Compute<T>::type scale,
    int64_t sampling_ratio, int aligned, int axis_cap, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const ChunkThread t(height, width, pooled_h, pooled_w);
    const int64_t bins = t.bins, plane_size = t.plane_size;
    const bool walk = t.walk;
    A *sums = t.shared<A>();
    const BinAxes<A> axes(t.shared<unsigned char>(), sizeof(A) * kLanes * bins, axis_cap,
                          pooled_h + pooled_w);
    for_each_block_roi(rois, num_rois, batch, scale, pooled_h, pooled_w, sampling_ratio, aligned,
                       group_c0, group_count, sink,
                       [&](int64_t k, bool good, const Geometry<A> &g, const Chunk &part) {
        const int64_t c0 = part.c0, count = part.count;
        const bool listed = axes.fill(good && walk, g, pooled_h, pooled_w, height, width);
        if (good) {
            const T *cells =
                chunk + (part.index * batch + g.batch) * plane_size * kLanes + t.lane;
            /* the lane's channel's plane (lanes past the chunk's channels read none) */
            const T *plane =
                t.lane < count ? input + (g.batch * channels + c0 + t.lane) * plane_size : input;
            const int64_t samples = g.grid_h * g.grid_w;
            const A divisor = (A)(samples > 1 ? samples : 1);
            for (int64_t b = t.warp; b < bins; b += t.warps) {
                const int64_t ph = bin_row(b, pooled_w), pw = b - ph * pooled_w;
                A sum = 0;
                const auto load = [&](const T *row, int x) {
                    return to_compute(row[(int64_t)x * kLanes]);
                };
                if (listed) {
                    /* the walk's cells and sums, from the lists: per row, its
                     * columns 4 at a time (their loads in flight together),
                     * the terms in the walk's order */
                    const auto lists = axes.of_bin(ph, pw, pooled_h);
                    const int *xs = lists.xs;
                    const A *wxs = lists.wxs;
                    for (int r = 0; r < lists.rows; ++r) {
                        const T *row = cells + (int64_t)lists.ys[r] * width * kLanes;
                        A dot = 0;
                        int c = 0;
                        for (; c + 4 <= lists.columns; c += 4) {
                            const A v0 = load(row, xs[c]), v1 = load(row, xs[c + 1]);
                            const A v2 = load(row, xs[c + 2]), v3 = load(row, xs[c + 3]);
                            dot += wxs[c] * v0;
                            dot += wxs[c + 1] * v1;
                            dot += wxs[c + 2] * v2;
                            dot += wxs[c + 3] * v3;
                        }
                        for (; c < lists.columns; ++c) dot += wxs[c] * load(row, xs[c]);
                        sum += lists.wys[r] * dot;
                    }
                } else if (walk)
                    walk_bin(g, ph, pw, height, width, [&](int y, A wy, auto columns) {
                        const T *row = cells + (int64_t)y * width * kLanes;
                        A dot = 0;
                        /* a row's columns 4 at a time (in registers: no
                         * arrays), their loads in flight together (a warp's
                         * walk is otherwise one chain of loads), then their
                         * terms in the walk's order */
                        int x0 = 0, x1 = 0, x2 = 0, x3 = 0, n = 0;
                        A w0 = 0, w1 = 0, w2 = 0, w3 = 0;
                        const auto drain = [&]() {
                            const A v0 = load(row, x0), v1 = n > 1 ? load(row, x1) : (A)0;
                            const A v2 = n > 2 ? load(row, x2) : (A)0;
                            const A v3 = n > 3 ? load(row, x3) : (A)0;
                            dot += w0 * v0;
                            if (n > 1) dot += w1 * v1;
                            if (n > 2) dot += w2 * v2;
                            if (n > 3) dot += w3 * v3;
                            n = 0;
                        };
                        columns([&](int x, A wx) {
                            if (n == 0) x0 = x, w0 = wx;
                            else if (n == 1) x1 = x, w1 = wx;
                            else if (n == 2) x2 = x, w2 = wx;
                            else x3 = x, w3 = wx;
                            if (++n == 4) drain();
                        });
                        if (n > 0) drain();
                        sum += wy * dot;
                    });
                /* an inf or NaN cell (or a map past the walk's limit): the
                 * definition, sample by sample, from the map itself */
                if ((!walk || !isfinite(sum)) && t.lane < count)
                    sum = sum_samples<T, A>(plane, height, width, g, ph, pw);
                sums[t.lane * bins + b] = sum / divisor;
            }
        }
        __syncthreads();
        T *out = output + (k * channels + c0) * bins;   /* the chunk's channels, contiguous */
        for (int64_t i = threadIdx.x; i < count * bins; i += blockDim.x)
            out[i] = from_compute<T>(good ? sums[i] : (A)NAN);
        __syncthreads();
    });
}

/* Whether an avg forward or default backward takes the transposed kernels
 * (chunks_pay): the bins' samples (sampling_ratio 0 counted as 2 x 2 a
 * bin) read 4 cells each, and a chunk's sums fit in 48 KB. */
inline bool transposed_pays(int64_t num_rois, int64_t channels, int64_t batch, int64_t height,
                            int64_t width, int64_t pooled_h, int64_t pooled_w,
                            int64_t sampling_ratio, size_t compute_size) {
    const int64_t grid = sampling_ratio > 0 ? sampling_ratio : 2;
    return chunks_pay(num_rois, channels, batch, height, width, pooled_h * pooled_w,
                      (double)(grid * grid) * 4, kLanes * compute_size);
}

/* max: a thread per output element (common.cuh, PooledElement: channel-major),
 * sample by sample. */
template <typename T, typename I>
__global__ void max_forward_kernel(const T *input, const T *rois, T *output, T *argmax_y,
                                   T *argmax_x, int64_t total, int64_t num_rois,
                                   int64_t channels, int64_t height, int64_t width,
                                   int64_t pooled_h, int64_t pooled_w, int64_t batch,
                                   typename Compute<T>::type scale, int64_t sampling_ratio,
                                   int aligned, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(index, total) {
        const PooledElement<I> e(index, num_rois, channels, pooled_h, pooled_w);
        const int64_t ph = e.ph, pw = e.pw;
        Geometry<A> g;
        if (!geometry_of(rois, (int64_t)e.k, batch, scale, pooled_h, pooled_w, sampling_ratio,
                         aligned, e.first, sink, &g)) {
            output[e.at] = from_compute<T>((A)NAN);
            argmax_y[e.at] = argmax_x[e.at] = from_compute<T>((A)-1);
            continue;
        }
        const T *plane = input + (g.batch * channels + e.c) * height * width;
        mmd_max_state<A> m;
        mmd_max_init(&m);
        for (int64_t iy = 0; iy < g.grid_h; ++iy) {
            const A y = mmd_roi_align_sample(g.start_h, g.bin_h, ph, iy, g.grid_h);
            Axis<A> ay;
            mmd_interp(y, height, &ay);
            for (int64_t ix = 0; ix < g.grid_w; ++ix) {
                const A x = mmd_roi_align_sample(g.start_w, g.bin_w, pw, ix, g.grid_w);
                Axis<A> ax;
                mmd_interp(x, width, &ax);
                const A v = (ay.valid && ax.valid) ? bilinear<T, A>(plane, width, ay, ax) : (A)0;
                mmd_max_update(&m, v, y, x);
            }
        }
        output[e.at] = from_compute<T>(mmd_max_value(&m));
        argmax_y[e.at] = from_compute<T>(m.y);
        argmax_x[e.at] = from_compute<T>(m.x);
    }
}

template <typename T, typename A>
__device__ inline void scatter(T *plane, int64_t width, const Axis<A> &ay,
                               const Axis<A> &ax, A grad) {
    atomicAdd(plane + ay.low * width + ax.low, from_compute<T>(grad * ay.w_low * ax.w_low));
    atomicAdd(plane + ay.low * width + ax.high, from_compute<T>(grad * ay.w_low * ax.w_high));
    atomicAdd(plane + ay.high * width + ax.low, from_compute<T>(grad * ay.w_high * ax.w_low));
    atomicAdd(plane + ay.high * width + ax.high, from_compute<T>(grad * ay.w_high * ax.w_high));
}

/* Adds `share` times bin (ph, pw)'s interpolation weights into a plane,
 * sample by sample. */
template <typename T, typename A>
__device__ inline void scatter_samples(T *plane, int64_t height, int64_t width,
                                       const Geometry<A> &g, int64_t ph, int64_t pw, A share) {
    for_each_sample(height, width, g, ph, pw, [&](const Axis<A> &ay, const Axis<A> &ax) {
        scatter<T, A>(plane, width, ay, ax, share);
    });
}

/* avg: the forward's rows and columns, one atomic add per cell they cross.
 * A bin gradient that is not finite is added sample by sample, so that
 * 0 * inf gives NaN where the definition gives it. */
template <typename T>
__global__ void avg_backward_kernel(const T *grad_output, const T *rois, T *grad_input,
                                    int64_t total, int64_t num_rois, int64_t channels,
                                    int64_t height, int64_t width, int64_t pooled_h,
                                    int64_t pooled_w, int64_t batch,
                                    typename Compute<T>::type scale,
                                    int64_t sampling_ratio, int aligned, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t bins = pooled_h * pooled_w, plane_size = height * width;
    const bool walk = height <= MMD_CUDA_CELL_WALK_MAX && width <= MMD_CUDA_CELL_WALK_MAX;
    MMD_GRID_STRIDE_LOOP(index, total) {
        BinGroup w;
        Geometry<A> g;
        if (!locate_avg_work<T, A>(index, rois, num_rois, channels, pooled_h, pooled_w, batch,
                                   scale, sampling_ratio, aligned, sink, &w, &g))
            continue;   /* a bad roi adds nothing */
        const T *grads = grad_output + ((w.k * channels + w.c0) * pooled_h + w.ph) * pooled_w + w.pw;
        T *planes = grad_input + (g.batch * channels + w.c0) * plane_size;
        const int64_t count = g.grid_h * g.grid_w;
        const A divisor = (A)(count > 1 ? count : 1);
        const A row_start = mmd_roi_align_bin_start(g.start_h, g.bin_h, w.ph);
        const A col_start = mmd_roi_align_bin_start(g.start_w, g.bin_w, w.pw);
        A share[kChannelGroup] = {};
        unsigned walked = 0;   /* channels added through the walk; the others sample by sample */
#pragma unroll   /* unrolled: share[] stays in registers */
        for (int c = 0; c < kChannelGroup; ++c) {
            if (c >= w.count) break;
            share[c] = to_compute(grads[c * bins]) / divisor;
            if (walk && isfinite(share[c])) walked |= 1u << c;
        }
        for (unsigned rest = ((1u << w.count) - 1) & ~walked; rest; rest &= rest - 1) {
            const int c = __ffs((int)rest) - 1;
            scatter_samples<T, A>(planes + c * plane_size, height, width, g, w.ph, w.pw,
                                  to_compute(grads[c * bins]) / divisor);
        }
        if (!walked) continue;
#if MMD_CUDA_VECTOR_ATOMICS
        /* float planes a multiple of 4 cells apart (cells in the same place
         * of their aligned 4 in every plane): a row's columns in windows
         * of 4, a vector atomic per window and channel */
        if constexpr (std::is_same<T, float>::value) {
            if (plane_size % 4 == 0 || w.count == 1) {
                for_each_cell(row_start, g.bin_h, (int)g.grid_h, (int)height, [&](int y, A wy) {
                    float *row = planes + (int64_t)y * width;
                    const auto put = [&](int first, unsigned touched, Float4 weight) {
                        float *target = row;
#pragma unroll   /* a window serves the group: (share * wy) * wx, as the cells do */
                        for (int c = 0; c < kChannelGroup; ++c) {
                            if (walked >> c & 1u)
                                add_window(target, (int)width, first, touched, weight,
                                           share[c] * wy);
                            if (c + 1 < w.count) target += plane_size;   /* never past the map */
                        }
                    };
                    CellWindow window(row);
                    for_each_cell(col_start, g.bin_w, (int)g.grid_w, (int)width,
                                  [&](int x, A wx) { window.add(x, wx, put); });
                    window.flush(put);
                });
                continue;
            }
        }
#endif
        for_each_cell(row_start, g.bin_h, (int)g.grid_h, (int)height, [&](int y, A wy) {
            T *row = planes + (int64_t)y * width;
            for_each_cell(col_start, g.bin_w, (int)g.grid_w, (int)width, [&](int x, A wx) {
                T *cell = row + x;
#pragma unroll   /* a cell serves the group: (share * wy) * wx, as a walk per channel */
                for (int c = 0; c < kChannelGroup; ++c) {
                    if (walked >> c & 1u) atomicAdd(cell, from_compute<T>(share[c] * wy * wx));
                    if (c + 1 < w.count) cell += plane_size;   /* never past the map */
                }
            });
        });
    }
}

/* The transposed avg backward (the `default` backend, where
 * transposed_pays): per chunk of kLanes channels, the bins' gradients are
 * added into scratch laid out (batch, h, w, kLanes) in the compute
 * type (a group of chunks a launch), by a block per (chunk, roi), a warp
 * per bin, a lane per channel, so that a
 * warp's atomic adds to a cell are 32 neighbouring values in one line (the
 * per-bin kernel's lanes add to 32 cells far apart, a request each); the
 * chunk's bin gradients are staged in shared memory (read coalesced). Then
 * transpose_add_kernel adds the scratch into grad_input. A bin gradient
 * that is not finite, and maps past the walk's limit, are added sample by
 * sample straight into grad_input, as the per-bin kernel adds them. */
template <typename T>
__global__ void __launch_bounds__(kThreads, kTransposedBlocks) avg_backward_transposed_kernel(
    const T *grad_output, const T *rois, T *grad_input, typename Compute<T>::type *chunk,
    int64_t num_rois, int64_t channels, int64_t group_c0, int64_t group_count, int64_t height,
    int64_t width, int64_t pooled_h, int64_t pooled_w, int64_t batch,
    typename Compute<T>::type scale, int64_t sampling_ratio, int aligned, int axis_cap,
    ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const ChunkThread t(height, width, pooled_h, pooled_w);
    const int64_t bins = t.bins, plane_size = t.plane_size;
    const bool walk = t.walk;
    A *shares = t.shared<A>();
    const BinAxes<A> axes(t.shared<unsigned char>(), sizeof(A) * kLanes * bins, axis_cap,
                          pooled_h + pooled_w);
    for_each_block_roi(rois, num_rois, batch, scale, pooled_h, pooled_w, sampling_ratio, aligned,
                       group_c0, group_count, sink,
                       [&](int64_t k, bool good, const Geometry<A> &g, const Chunk &part) {
        const int64_t c0 = part.c0, count = part.count;
        if (good) {   /* a bad roi adds nothing */
            const T *grads = grad_output + (k * channels + c0) * bins;   /* contiguous */
            for (int64_t i = threadIdx.x; i < kLanes * bins; i += blockDim.x)
                shares[i] = i < count * bins ? to_compute(grads[i]) : (A)0;
        }
        /* (a barrier: the shares are staged too) */
        const bool listed = axes.fill(good && walk, g, pooled_h, pooled_w, height, width);
        if (good) {
            A *cells = chunk + (part.index * batch + g.batch) * plane_size * kLanes + t.lane;
            /* the lane's channel's plane (lanes past the chunk's channels add none) */
            T *plane = t.lane < count ? grad_input + (g.batch * channels + c0 + t.lane) * plane_size
                                      : grad_input;
            const int64_t samples = g.grid_h * g.grid_w;
            const A divisor = (A)(samples > 1 ? samples : 1);
            for (int64_t b = t.warp; b < bins; b += t.warps) {
                const int64_t ph = bin_row(b, pooled_w), pw = b - ph * pooled_w;
                const A share = shares[t.lane * bins + b] / divisor;
                const bool mine = t.lane < count, walked = walk && isfinite(share);
                if (mine && !walked)
                    scatter_samples<T, A>(plane, height, width, g, ph, pw, share);
                if (listed) {   /* the walk's adds, from the lists */
                    const auto lists = axes.of_bin(ph, pw, pooled_h);
                    const int *xs = lists.xs;
                    const A *wxs = lists.wxs;
                    for (int r = 0; r < lists.rows; ++r) {
                        A *row = cells + (int64_t)lists.ys[r] * width * kLanes;
                        const A row_share = share * lists.wys[r];
                        for (int c = 0; c < lists.columns; ++c)
                            if (mine && walked) atomicAdd(row + (int64_t)xs[c] * kLanes,
                                                          row_share * wxs[c]);
                    }
                    continue;
                }
                if (!walk) continue;   /* uniform: the walk is the warp's */
                walk_bin(g, ph, pw, height, width, [&](int y, A wy, auto columns) {
                    A *row = cells + (int64_t)y * width * kLanes;
                    columns([&](int x, A wx) {   /* (share * wy) * wx, as the per-bin kernel's */
                        if (mine && walked) atomicAdd(row + (int64_t)x * kLanes, share * wy * wx);
                    });
                });
            }
        }
        __syncthreads();
    });
}

/* The scratch's "nothing added": -0.0, which adding any value turns into
 * that value (+0.0 turns -0.0 into +0.0), so that a sum still -0.0 is a
 * cell no bin reached, and one that is +0.0 had adds (a zero gradient's),
 * which the CPU and the per-bin kernel add too. */
template <typename A> __global__ void fill_untouched_kernel(A *chunk, int64_t size) {
    MMD_GRID_STRIDE_LOOP(i, size) chunk[i] = -(A)0;
}

/* grad_input[n, c0 + g * kLanes + c, i] += chunk[((g * batch + n) * cells
 * + i) * kLanes + c] for each chunk g of the group of `count` channels
 * from c0, where a bin added anything (a cell no bin
 * reached keeps its bits, -0.0 and a signalling NaN included, and is not
 * read); the scratch is left -0.0 again for the next group:
 * transpose_chunk_kernel's tiles the other way round. */
template <typename T, typename A>
__global__ void __launch_bounds__(kLanes * kTransposeRows)
    transpose_add_kernel(A *chunk, T *grad_input, int64_t batch, int64_t channels,
                         int64_t cells, int64_t c0, int64_t count) {
    __shared__ A tile[kTileCells][kLanes + 1];   /* [cell][channel] */
    for_each_tile(chunks_in(count) * batch, cells, [&](int64_t plane, int64_t cell0) {
        const Chunk part(c0, count, plane / batch);
        A *from = chunk + (plane * cells + cell0) * kLanes + threadIdx.x;
        A v[kCellsPerRow];
        for_each_cell_place([&](int i, int j) {
            v[i] = cell0 + j < cells ? from[j * kLanes] : -(A)0;
        });
        for_each_cell_place([&](int i, int j) {
            if (cell0 + j < cells) from[j * kLanes] = -(A)0;
            tile[j][threadIdx.x] = v[i];
        });
        __syncthreads();
        T *to = grad_input + (plane % batch * channels + part.c0) * cells + cell0;
        A add[kChannelsPerRow][kTileSpans];
        T old[kChannelsPerRow][kTileSpans];
        const auto touched = [&](A add, int cell) {
            return !(add == (A)0 && signbit(add)) && cell0 + cell < cells;
        };
        for_each_place([&](int i, int s, int c, int cell) {
            add[i][s] = c < part.count ? tile[cell][c] : -(A)0;
            if (touched(add[i][s], cell)) old[i][s] = to[c * cells + cell];
        });
        for_each_place([&](int i, int s, int c, int cell) {
            if (touched(add[i][s], cell))
                to[c * cells + cell] = from_compute<T>(to_compute(old[i][s]) + add[i][s]);
        });
        __syncthreads();
    });
}

/* max: the 4 cells around each bin's argmax, a thread per grad_output
 * element in the forward's order. */
template <typename T, typename I>
__global__ void max_backward_kernel(const T *grad_output, const T *rois, const T *argmax_y,
                                    const T *argmax_x, T *grad_input, int64_t total,
                                    int64_t num_rois, int64_t channels, int64_t height,
                                    int64_t width, int64_t pooled_h, int64_t pooled_w,
                                    int64_t batch, typename Compute<T>::type scale,
                                    int64_t sampling_ratio, int aligned, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    MMD_GRID_STRIDE_LOOP(index, total) {
        const PooledElement<I> e(index, num_rois, channels, pooled_h, pooled_w);
        Geometry<A> g;
        if (!geometry_of(rois, (int64_t)e.k, batch, scale, pooled_h, pooled_w, sampling_ratio,
                         aligned, e.first, sink, &g))
            continue;   /* a bad roi adds nothing */
        const A y = to_compute(argmax_y[e.at]);
        if (y == (A)-1) continue;
        Axis<A> ay, ax;
        mmd_interp(y, height, &ay);
        mmd_interp(to_compute(argmax_x[e.at]), width, &ax);
        if (ay.valid && ax.valid)
            scatter<T, A>(grad_input + (g.batch * channels + e.c) * height * width, width, ay,
                          ax, to_compute(grad_output[e.at]));
    }
}

/* The deterministic backward. Every element of grad_input is a sum in a
 * fixed order, rois in order, without atomics.
 *
 * avg on fewer than 16 channels (or bins too many for the tiled kernel's
 * shared memory; on more, deterministic_avg_backward_tiled_kernel below
 * gives the same bits): block b owns a band of rows of plane (n, c) of grad_input, held in
 * shared memory from start to end (loaded once, written back once; the
 * rois' adds read and write shared memory, where a block per whole plane
 * read and wrote the plane in global memory once per roi). The block visits
 * the rois in order, their geometry computed a chunk at a time, a roi per
 * thread, into shared memory (not by every thread for every roi), and adds
 * the gradient of each roi on image n whose window meets the band. MMCV's
 * bilinear weights are products of a row weight and a column weight, so
 * roi k's gradient at (y, x) is
 *     sum_ph Wy[ph][y] * sum_pw G[ph][pw] * Wx[pw][x]
 * with G the bin gradients over the sample count, Wy[ph][y] the sum of the
 * weights bin row ph's samples give row y (Wx likewise): a thread per bin
 * row (column) sums its samples in order, then T = G Wx, then a thread per
 * element of the roi's window in the band, summing over the bin rows from
 * the first to the last whose weight on its row is not 0 (at most a few of
 * them where bins are a cell or more tall: the zero terms before and after
 * add nothing to a finite sum). Its cost does not grow with the samples
 * per bin. Where a bin gradient is not finite the product would spread
 * 0 * inf = NaN over the whole window, so such a roi is added sample by
 * sample instead (one thread, in order), as the atomic kernel adds it.
 * Each element sees the same additions in the same order, rounded to T
 * after each roi, whatever the bands and the timing: the same bits on
 * every run (the CPU's sums to their rounding). */
struct Window {
    int64_t y0, y1, x0, x1;   /* rows and columns the roi's samples can touch */
};

template <typename A>
__device__ inline int64_t window_edge(A start, A length, int64_t size, int64_t *hi) {
    /* samples lie in [start, start + length]; interpolation reads floor(v)
     * and floor(v) + 1, clamped to the map, with v in [-1, 0] taken as 0 (so
     * that a roi ending in [-1, 0) reads cell 1 too, with weight 0: 0 * inf
     * is NaN there), and nothing for v < -1 */
    const A end = start + length;
    const A lo_v = floor(start), hi_v = end < (A)-1 ? (A)-1 : floor(end < 0 ? (A)0 : end) + 1;
    const int64_t lo = lo_v < 0 ? 0 : (lo_v > (A)(size - 1) ? size - 1 : (int64_t)lo_v);
    *hi = hi_v < 0 ? -1 : (hi_v > (A)(size - 1) ? size - 1 : (int64_t)hi_v);
    return lo;
}

/* The window of a roi of geometry g on a height x width map. */
template <typename A>
__device__ inline Window window_of(const Geometry<A> &g, int64_t pooled_h, int64_t pooled_w,
                                   int64_t height, int64_t width) {
    Window w;
    w.y0 = window_edge(g.start_h, g.bin_h * (A)pooled_h, height, &w.y1);
    w.x0 = window_edge(g.start_w, g.bin_w * (A)pooled_w, width, &w.x1);
    return w;
}

/* The first and last of weights[0], weights[step], ... weights[(count - 1)
 * * step] that are not 0 in *first and *last (count and -1 where none is):
 * the bin rows (columns) a row's (column's) sum takes, from the first to
 * the last (the deterministic kernels). */
template <typename A>
__device__ inline void nonzero_range(const A *weights, int count, int step, int *first,
                                     int *last) {
    int lo = count, hi = -1;
    for (int b = 0; b < count; ++b)
        if (weights[b * step] != 0) {
            lo = lo < b ? lo : b;
            hi = b;
        }
    *first = lo;
    *last = hi;
}

/* Whether roi k adds into a plane of image n, with its geometry in *g; a
 * bad roi is reported once, by the grid's first thread. The same answer in
 * every thread of a block, so a block's barriers match. */
template <typename T, typename A>
__device__ inline bool roi_in_plane(const T *rois, int64_t k, int64_t n, int64_t batch, A scale,
                                    int64_t pooled_h, int64_t pooled_w, int64_t sampling_ratio,
                                    int aligned, const ErrorSink &sink,
                                    Geometry<A> *g) {
    return geometry_of(rois, k, batch, scale, pooled_h, pooled_w, sampling_ratio, aligned,
                       blockIdx.x == 0 && threadIdx.x == 0, sink, g) &&
           g->batch == n;
}

/* Rows of a band: at most MMD_CUDA_BAND_BYTES of grad_input's storage
 * (64 KB: with the weights and geometry about 100 KB of shared memory a
 * block for the bench's 200 x 304 map, two blocks to an H100 SM); the
 * emulated tests set it small, so that their maps take several bands. */
#ifndef MMD_CUDA_BAND_BYTES
#define MMD_CUDA_BAND_BYTES (64 * 1024)
#endif

/* Byte offset of the geometry array in the avg kernel's shared memory,
 * after the weight arrays (A) and the rows' bin ranges (int), aligned for
 * its int64_t fields. */
inline size_t geometry_offset(size_t weight_bytes) { return (weight_bytes + 15) / 16 * 16; }

/* (q, r) = (i / n, i % n) for i = start, start + step, ... (all of them
 * ints), a division only at the start. */
struct DivStep {
    int q, r, n, dq, dr;
    __device__ DivStep(int start, int step, int n_)
        : q(start / n_), r(start % n_), n(n_), dq(step / n_), dr(step % n_) {}
    __device__ void next() {
        q += dq;
        r += dr;
        if (r >= n) r -= n, ++q;
    }
};

/* f(a) for each sample of bin row `bin` (is_row) or bin column `bin` of a
 * roi of geometry g that lies on the map, in order: the cells it reads
 * along that axis and their weights (the deterministic kernels' Wy, Wx). */
template <typename A, typename F>
__device__ inline void for_each_axis_sample(const Geometry<A> &g, bool is_row, int64_t bin,
                                            int64_t height, int64_t width, F f) {
    const int64_t grid = is_row ? g.grid_h : g.grid_w;
    for (int64_t i = 0; i < grid; ++i) {
        Axis<A> a;
        mmd_interp(is_row ? mmd_roi_align_sample(g.start_h, g.bin_h, bin, i, grid)
                          : mmd_roi_align_sample(g.start_w, g.bin_w, bin, i, grid),
                   is_row ? height : width, &a);
        if (a.valid) f(a);
    }
}

/* f(b, y, x, weight) for each bin b of a roi of geometry g, each of the
 * bin's samples on the map and each of the sample's 4 cells, in the atomic
 * kernel's order: the deterministic kernels' adds, sample by sample, of a
 * roi whose bin gradients are not all finite. */
template <typename A, typename F>
__device__ inline void for_each_corner(int64_t height, int64_t width, const Geometry<A> &g,
                                       int64_t pooled_w, int64_t bins, F f) {
    for (int64_t b = 0; b < bins; ++b)
        for_each_sample(height, width, g, b / pooled_w, b % pooled_w,
                        [&](const Axis<A> &ay, const Axis<A> &ax) {
            f(b, ay.low, ax.low, ay.w_low * ax.w_low);
            f(b, ay.low, ax.high, ay.w_low * ax.w_high);
            f(b, ay.high, ax.low, ay.w_high * ax.w_low);
            f(b, ay.high, ax.high, ay.w_high * ax.w_high);
        });
}

template <typename T>
__global__ void deterministic_avg_backward_kernel(
    const T *grad_output, const T *rois, T *grad_input, int64_t num_rois, int64_t channels,
    int64_t height, int64_t width, int64_t pooled_h, int64_t pooled_w, int64_t batch,
    typename Compute<T>::type scale, int64_t sampling_ratio, int aligned, int64_t band_rows,
    int64_t bands, size_t geo_offset, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    extern __shared__ unsigned char shared_bytes[];
    A *grad = (A *)shared_bytes;              /* pooled_h * pooled_w */
    A *wy = grad + pooled_h * pooled_w;       /* pooled_h * height */
    A *wx = wy + pooled_h * height;           /* pooled_w * width */
    A *t = wx + pooled_w * width;             /* pooled_h * width */
    int *first_bin = (int *)(t + pooled_h * width);   /* height: row y's first bin row */
    int *last_bin = first_bin + height;               /* height: and its last */
    Geometry<A> *geo = (Geometry<A> *)(shared_bytes + geo_offset);   /* blockDim.x */
    T *acc = (T *)(geo + blockDim.x);         /* the band: band_rows * width */
    const int64_t plane_index = blockIdx.x / bands, band = blockIdx.x % bands;
    const int64_t n = plane_index / channels, c = plane_index % channels;
    const int64_t top = band * band_rows;
    const int64_t bottom = top + band_rows < height ? top + band_rows : height;   /* exclusive */
    const int tid = threadIdx.x, threads = blockDim.x;
    const int64_t bins = pooled_h * pooled_w;
    T *rows_of_band = grad_input + (plane_index * height + top) * width;
    const int64_t band_size = (bottom - top) * width;
    for (int64_t i = tid; i < band_size; i += threads) acc[i] = rows_of_band[i];
    for (int64_t first = 0; first < num_rois; first += threads) {
        __syncthreads();   /* the band is loaded, and the last chunk's geometry read */
        if (first + tid < num_rois) {
            Geometry<A> g;
            if (!geometry_of(rois, first + tid, batch, scale, pooled_h, pooled_w,
                             sampling_ratio, aligned, blockIdx.x == 0, sink, &g))
                g.batch = -1;   /* on no image: adds nothing */
            geo[tid] = g;
        }
        __syncthreads();
        const int64_t chunk = num_rois - first < threads ? num_rois - first : threads;
        for (int64_t j = 0; j < chunk; ++j) {
            const Geometry<A> g = geo[j];   /* the same roi and answers in every thread */
            if (g.batch != n) continue;
            const int64_t k = first + j;
            const Window w = window_of(g, pooled_h, pooled_w, height, width);
            const int64_t y_lo = w.y0 > top ? w.y0 : top;
            const int64_t y_hi = w.y1 < bottom - 1 ? w.y1 : bottom - 1;
            if (y_hi < y_lo || w.x1 < w.x0) continue;
            const int64_t rows = w.y1 - w.y0 + 1, cols = w.x1 - w.x0 + 1;
            const int64_t count = g.grid_h * g.grid_w;
            const A divisor = (A)(count > 1 ? count : 1);
            const T *g_out = grad_output + (k * channels + c) * bins;
            int nonfinite = 0;
            for (int64_t i = tid; i < bins; i += threads) {
                grad[i] = to_compute(g_out[i]) / divisor;
                nonfinite |= !isfinite(grad[i]);
            }
            /* (the window's loops below step their (row, column) pairs
             * without a division, DivStep: a 64-bit division per element
             * took tens of instructions) */
            const int n_rows = (int)rows, n_cols = (int)cols;
            DivStep at(tid, threads, n_rows);
            for (int i = tid; i < (int)pooled_h * n_rows; i += threads, at.next())
                wy[at.q * height + w.y0 + at.r] = 0;
            at = DivStep(tid, threads, n_cols);
            for (int i = tid; i < (int)pooled_w * n_cols; i += threads, at.next())
                wx[at.q * width + w.x0 + at.r] = 0;
            if (__syncthreads_or(nonfinite)) {
                if (tid == 0)
                    for_each_corner(height, width, g, pooled_w, bins,
                                    [&](int64_t b, int64_t y, int64_t x, A weight) {
                        if (y < top || y >= bottom) return;
                        T *cell = acc + (y - top) * width + x;
                        *cell = from_compute<T>(to_compute(*cell) + grad[b] * weight);
                    });
                __syncthreads();
                continue;
            }
            /* row weights: a thread per bin row, its samples in order (then columns) */
            for (int64_t r = tid; r < pooled_h + pooled_w; r += threads) {
                const bool is_row = r < pooled_h;
                const int64_t bin = is_row ? r : r - pooled_h;
                A *weights = is_row ? wy + bin * height : wx + bin * width;
                for_each_axis_sample(g, is_row, bin, height, width, [&](const Axis<A> &a) {
                    weights[a.low] += a.w_low;
                    weights[a.high] += a.w_high;
                });
            }
            __syncthreads();
            at = DivStep(tid, threads, n_cols);
            for (int i = tid; i < (int)pooled_h * n_cols; i += threads, at.next()) {
                const int64_t ph = at.q, x = w.x0 + at.r;
                A sum = 0;
                for (int64_t pw = 0; pw < pooled_w; ++pw)
                    sum += grad[ph * pooled_w + pw] * wx[pw * width + x];
                t[ph * width + x] = sum;
            }
            for (int r = tid; r < n_rows; r += threads) {   /* each row's bin rows */
                const int64_t y = w.y0 + r;
                nonzero_range(wy + y, (int)pooled_h, (int)height, &first_bin[y], &last_bin[y]);
            }
            __syncthreads();
            const int band_cells = (int)(y_hi - y_lo + 1) * n_cols;
            at = DivStep(tid, threads, n_cols);
            for (int i = tid; i < band_cells; i += threads, at.next()) {
                const int64_t y = y_lo + at.q, x = w.x0 + at.r;
                A sum = 0;
                for (int64_t ph = first_bin[y]; ph <= last_bin[y]; ++ph)
                    sum += wy[ph * height + y] * t[ph * width + x];
                if (sum != 0) {
                    T *cell = acc + (y - top) * width + x;
                    *cell = from_compute<T>(to_compute(*cell) + sum);
                }
            }
            __syncthreads();
        }
    }
    __syncthreads();
    for (int64_t i = tid; i < band_size; i += threads) rows_of_band[i] = acc[i];
}

/* The deterministic avg backward in tiles, for 16 channels or more: a block
 * owns a tile of kTileRows x Tiles::cols cells of one image and a chunk of
 * kLanes channels of grad_input, held in shared memory as [cell][channel]
 * from start to end, and adds into it the rois that meet it, in order, a
 * lane per channel. Each roi's geometry, weights and their ranges are
 * worked out once for the chunk's 32 channels (deterministic_avg_backward_
 * kernel works them out per plane), over the tile alone, and only the
 * cells they weigh are visited: the rois whose windows miss the tile are
 * dropped as the block lists each round of kThreads rois (the plane's
 * block visits every roi of its image that meets its band), and a row's
 * cells are the tile's columns with a weight on them (the per-plane kernel
 * visits the roi's whole window). The terms are the per-plane kernel's,
 * in its order, so that each element gets its bits: Wy and Wx summed sample
 * by sample, a row's bin rows from the first to the last whose weight on
 * the row is not 0, and T = G Wx's terms of a column from its first to its
 * last bin column whose weight on it is not 0 (the zero terms around them,
 * which add nothing but a sign of zero to a finite G, left out; a cell's
 * sum of 0 is not added either way). A channel whose bin gradients are not
 * all finite (nonfinite_channels_kernel's flags) adds its roi sample by
 * sample (warp 0's lane of that channel, over the tile), as the per-plane
 * kernel adds it. */
constexpr int kTileRows = kThreads / kLanes;   /* a warp per row of the tile */
constexpr int kTileStride = kLanes + 1;        /* a cell's channels, padded: the loads'
                                                * and stores' lanes hit distinct banks */
/* Blocks of the tiled kernel an SM keeps resident (its float shared memory,
 * about 55 KB for 7 x 7 bins, allows 3 on an H100; registers capped to fit:
 * the spills are outside the rois' loop) */
constexpr int kTiledBlocks = 3;

/* Bit c % kLanes of flags[k * chunks + c / kLanes]: whether a bin gradient
 * of roi k in channel c is not finite (then neither is G there, G =
 * gradient / samples with samples >= 1, and the other way round). */
template <typename T>
__global__ void nonfinite_channels_kernel(const T *grad_output, unsigned *flags, int64_t total,
                                          int64_t channels, int64_t bins, int64_t chunks) {
    MMD_GRID_STRIDE_LOOP(i, total) {
        if (isfinite(to_compute(grad_output[i]))) continue;
        const int64_t row = i / bins, k = row / channels, c = row % channels;
        atomicOr(flags + k * chunks + c / kLanes, 1u << (c % kLanes));
    }
}

/* The tiles of a call and the bytes of a block's shared memory, in order:
 * the listed rois, the bin gradients G [bin][kTileStride], the tile's
 * weights Wy [bin row][kTileRows] and Wx [bin column][cols], the tile
 * [cell][kTileStride], then ints: the rows' first and last bin rows, the
 * listed columns (column, first and last bin column), the counts, the
 * rois' list. */
template <typename T> struct Tiles {
    typedef typename Compute<T>::type A;
    struct Roi {
        Geometry<A> g;
        unsigned sampled;     /* its channels of the chunk added sample by sample */
    };
    /* cells of a tile's row: 32 (16 of 8-byte T), a row's 128 bytes of T at most */
    static constexpr int cols = sizeof(T) > 4 ? 16 : kLanes;
    int64_t tiles_y, tiles_x, chunks, items;
    size_t grads, wy, wx, tile, ints, bytes;

    Tiles(int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t pooled_h,
          int64_t pooled_w) {
        tiles_y = (height + kTileRows - 1) / kTileRows;
        tiles_x = (width + cols - 1) / cols;
        chunks = chunks_in(channels);
        items = batch * chunks * tiles_y * tiles_x;
        const auto align = [](size_t n) { return (n + 15) / 16 * 16; };
        grads = align(sizeof(Roi) * kThreads);
        wy = align(grads + sizeof(A) * (size_t)(pooled_h * pooled_w) * kTileStride);
        wx = wy + sizeof(A) * (size_t)pooled_h * kTileRows;
        tile = align(wx + sizeof(A) * (size_t)pooled_w * (size_t)cols);
        ints = align(tile + sizeof(T) * (size_t)(kTileRows * cols) * kTileStride);
        bytes = ints + sizeof(int) * (2 * kTileRows + 3 * cols + 3 + kThreads + kTileRows);
    }
};

template <typename T>
__global__ void __launch_bounds__(kThreads, kTiledBlocks) deterministic_avg_backward_tiled_kernel(
    const T *grad_output, const T *rois, const unsigned *flags, T *grad_input, int64_t num_rois,
    int64_t channels, int64_t height, int64_t width, int64_t pooled_h, int64_t pooled_w,
    int64_t batch, typename Compute<T>::type scale, int64_t sampling_ratio, int aligned,
    Tiles<T> tiles, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    typedef typename Tiles<T>::Roi Roi;
    constexpr int cols = Tiles<T>::cols, cells = kTileRows * cols;
    extern __shared__ unsigned char shared_bytes[];
    Roi *listed = (Roi *)shared_bytes;                  /* the round's rois meeting the tile */
    A *grads = (A *)(shared_bytes + tiles.grads);       /* [bin][kTileStride] */
    A *wy = (A *)(shared_bytes + tiles.wy);             /* [bin row][kTileRows] */
    A *wx = (A *)(shared_bytes + tiles.wx);             /* [bin column][cols] */
    T *acc = (T *)(shared_bytes + tiles.tile);          /* [cell][kTileStride] */
    int *row_first = (int *)(shared_bytes + tiles.ints), *row_last = row_first + kTileRows;
    int *column = row_last + kTileRows;                 /* the columns with a weight */
    int *col_first = column + cols, *col_last = col_first + cols;
    int *counts = col_last + cols;       /* the columns listed; the first and last bin row */
    int *index = counts + 3;             /* listed[i] is roi first + index[i] */
    int *warp_count = index + kThreads;
    const int tid = threadIdx.x, lane = tid % kLanes, warp = tid / kLanes;
    const int pw_count = (int)pooled_w;
    const int64_t bins = pooled_h * pooled_w;
    for (int64_t item = blockIdx.x; item < tiles.items; item += gridDim.x) {
        const int64_t tx = item % tiles.tiles_x, ty = item / tiles.tiles_x % tiles.tiles_y;
        const int64_t chunk = item / (tiles.tiles_x * tiles.tiles_y) % tiles.chunks;
        const int64_t n = item / (tiles.tiles_x * tiles.tiles_y * tiles.chunks);
        const Chunk part(0, channels, chunk);
        const int64_t c0 = part.c0, top = ty * kTileRows, left = tx * cols;
        const int count = (int)part.count;
        const int rows_in = (int)(height - top < kTileRows ? height - top : kTileRows);
        const int cols_in = (int)(width - left < cols ? width - left : cols);
        /* element (c, cell) of the tile, for i = c * cells + cell */
        const auto element = [&](int i) {
            const int c = i / cells, cell = i % cells;
            return grad_input + ((n * channels + c0 + c) * height + top + cell / cols) * width +
                   left + cell % cols;
        };
        __syncthreads();   /* the last item's tile written back */
        for (int i = tid; i < count * cells; i += kThreads)
            if (i % cells / cols < rows_in && i % cols < cols_in)
                acc[i % cells * kTileStride + i / cells] = *element(i);
        for (int64_t first = 0; first < num_rois; first += kThreads) {
            /* list the round's rois whose window meets the tile, in order */
            Roi r;
            bool meets = false;
            const int64_t k = first + tid;
            if (k < num_rois &&
                geometry_of(rois, k, batch, scale, pooled_h, pooled_w, sampling_ratio, aligned,
                            item == 0, sink, &r.g) &&
                r.g.batch == n) {
                const Window w = window_of(r.g, pooled_h, pooled_w, height, width);
                meets = w.y0 <= w.y1 && w.x0 <= w.x1 && w.y0 < top + rows_in && w.y1 >= top &&
                        w.x0 < left + cols_in && w.x1 >= left;
                if (meets) r.sampled = flags[k * tiles.chunks + chunk];
            }
            const unsigned ballot = __ballot_sync(0xffffffffu, meets);
            __syncthreads();   /* the last round's list and counts read */
            if (lane == 0) warp_count[warp] = __popc(ballot);
            __syncthreads();
            int at = __popc(ballot & ((1u << lane) - 1)), listed_count = 0;
            for (int w = 0; w < kTileRows; ++w) {
                at += w < warp ? warp_count[w] : 0;
                listed_count += warp_count[w];
            }
            if (meets) {
                listed[at] = r;
                index[at] = tid;
            }
            __syncthreads();
            for (int j = 0; j < listed_count; ++j) {
                const Geometry<A> g = listed[j].g;
                const unsigned sampled = listed[j].sampled;
                /* the tile's Wy and Wx: a thread per bin row, then column, its
                 * samples in order */
                for (int64_t a = tid; a < pooled_h + pooled_w; a += kThreads) {
                    const bool is_row = a < pooled_h;
                    const int64_t bin = is_row ? a : a - pooled_h;
                    const int extent = is_row ? rows_in : cols_in;
                    const int64_t origin = is_row ? top : left;
                    A *weights = is_row ? wy + bin * kTileRows : wx + bin * cols;
                    for (int e = 0; e < (is_row ? kTileRows : cols); ++e) weights[e] = 0;
                    for_each_axis_sample(g, is_row, bin, height, width, [&](const Axis<A> &s) {
                        if (s.low - origin >= 0 && s.low - origin < extent)
                            weights[s.low - origin] += s.w_low;
                        if (s.high - origin >= 0 && s.high - origin < extent)
                            weights[s.high - origin] += s.w_high;
                    });
                }
                __syncthreads();
                /* warp 0: the columns with a weight on them, listed in order
                 * with their first and last bin column; warp 1: each row's
                 * first and last bin row, and the first and last of all */
                if (warp < 2) {
                    const bool is_row = warp == 1;
                    const int extent = is_row ? (int)pooled_h : pw_count;
                    const int step = is_row ? kTileRows : cols;
                    int lo = extent, hi = -1;
                    if (lane < (is_row ? rows_in : cols_in))
                        nonzero_range((is_row ? wy : wx) + lane, extent, step, &lo, &hi);
                    const unsigned weighed = __ballot_sync(0xffffffffu, lo <= hi);
                    if (is_row) {
                        if (lane < kTileRows) row_first[lane] = lo, row_last[lane] = hi;
                        for (int d = 1; d < kLanes; d *= 2) {
                            const int other_lo = __shfl_xor_sync(0xffffffffu, lo, d);
                            const int other_hi = __shfl_xor_sync(0xffffffffu, hi, d);
                            lo = other_lo < lo ? other_lo : lo;
                            hi = other_hi > hi ? other_hi : hi;
                        }
                        if (lane == 0) counts[1] = lo, counts[2] = hi;
                    } else {
                        if (lo <= hi) {
                            const int e = __popc(weighed & ((1u << lane) - 1));
                            column[e] = lane;
                            col_first[e] = lo;
                            col_last[e] = hi;
                        }
                        if (lane == 0) counts[0] = __popc(weighed);
                    }
                }
                __syncthreads();
                /* G of the bin rows that weigh on the tile's rows, a channel's
                 * run of them at a time (each roi's channels contiguous) */
                const int64_t k = first + index[j];
                const int64_t samples = g.grid_h * g.grid_w;
                const A divisor = (A)(samples > 1 ? samples : 1);
                const int bin_lo = counts[1] * pw_count, run = (counts[2] + 1) * pw_count - bin_lo;
                const T *g_out = grad_output + (k * channels + c0) * bins + bin_lo;
                if (run > 0) {
                    DivStep cb(tid, kThreads, run);   /* (channel, bin - bin_lo) */
                    for (int i = tid; i < count * run; i += kThreads, cb.next())
                        grads[(bin_lo + cb.r) * kTileStride + cb.q] =
                            to_compute(g_out[(int64_t)cb.q * bins + cb.r]) / divisor;
                }
                __syncthreads();
                const bool mine = lane < count && !((sampled >> lane) & 1u);
                if (mine && warp < rows_in && row_first[warp] <= row_last[warp]) {
                    const int ph_first = row_first[warp], ph_last = row_last[warp];
                    const int listed_cols = counts[0];
                    for (int e = 0; e < listed_cols; ++e) {
                        const int x = column[e], pw_first = col_first[e], pw_last = col_last[e];
                        A sum = 0;
#pragma unroll 1
                        for (int ph = ph_first; ph <= ph_last; ++ph) {
                            const A *row = grads + ph * pw_count * kTileStride + lane;
                            A t = 0;
#pragma unroll 1
                            for (int pw = pw_first; pw <= pw_last; ++pw)
                                t += row[pw * kTileStride] * wx[pw * cols + x];
                            sum += wy[ph * kTileRows + warp] * t;
                        }
                        if (sum != 0) {
                            T *cell = acc + (warp * cols + x) * kTileStride + lane;
                            *cell = from_compute<T>(to_compute(*cell) + sum);
                        }
                    }
                }
                if (warp == 0 && lane < count && !mine) {
                    const T *mine_out = grad_output + ((k * channels + c0) + lane) * bins;
                    for_each_corner(height, width, g, pooled_w, bins,
                                    [&](int64_t b, int64_t y, int64_t x, A weight) {
                        const int64_t r_in = y - top, x_in = x - left;
                        if (r_in < 0 || r_in >= rows_in || x_in < 0 || x_in >= cols_in) return;
                        T *cell = acc + (r_in * cols + x_in) * kTileStride + lane;
                        const A grad = to_compute(mine_out[b]) / divisor;
                        *cell = from_compute<T>(to_compute(*cell) + grad * weight);
                    });
                }
                __syncthreads();   /* the weights, ranges and G read */
            }
        }
        __syncthreads();
        for (int i = tid; i < count * cells; i += kThreads)
            if (i % cells / cols < rows_in && i % cols < cols_in)
                *element(i) = acc[i % cells * kTileStride + i / cells];
    }
}

/* max: a warp per plane; each roi's bins, 32 at a time, add their gradient
 * at the 4 pixels around their argmax, conflicts summed in lane order. */
template <typename T>
__global__ void deterministic_max_backward_kernel(
    const T *grad_output, const T *rois, const T *argmax_y, const T *argmax_x, T *grad_input,
    int64_t num_rois, int64_t channels, int64_t height, int64_t width, int64_t pooled_h,
    int64_t pooled_w, int64_t batch, typename Compute<T>::type scale, int64_t sampling_ratio,
    int aligned, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t n = blockIdx.x / channels, c = blockIdx.x % channels;
    const int lane = threadIdx.x;
    const int64_t bins = pooled_h * pooled_w;
    T *plane = grad_input + (int64_t)blockIdx.x * height * width;
    for (int64_t k = 0; k < num_rois; ++k) {
        Geometry<A> g;
        if (!roi_in_plane(rois, k, n, batch, scale, pooled_h, pooled_w, sampling_ratio, aligned,
                          sink, &g))
            continue;
        const int64_t base = (k * channels + c) * bins;
        for (int64_t b0 = 0; b0 < bins; b0 += 32) {
            const int64_t b = b0 + lane;
            Axis<A> ay = {}, ax = {};   /* invalid, zero weights */
            A grad = 0;
            if (b < bins) {
                const A y = to_compute(argmax_y[base + b]);
                if (y != (A)-1) {
                    mmd_interp(y, height, &ay);
                    mmd_interp(to_compute(argmax_x[base + b]), width, &ax);
                }
                grad = to_compute(grad_output[base + b]);
            }
            const bool valid = ay.valid && ax.valid;
            warp_ordered_add(plane, valid ? ay.low * width + ax.low : -1, grad * ay.w_low * ax.w_low);
            warp_ordered_add(plane, valid ? ay.low * width + ax.high : -1, grad * ay.w_low * ax.w_high);
            warp_ordered_add(plane, valid ? ay.high * width + ax.low : -1, grad * ay.w_high * ax.w_low);
            warp_ordered_add(plane, valid ? ay.high * width + ax.high : -1, grad * ay.w_high * ax.w_high);
        }
    }
}

/* The transposed kernels' launches (Chunks) for rois of pooled_h x
 * pooled_w bins, and their shared memory. */
template <typename A> struct ChunkPlan : Chunks {
    int axis_cap;    /* entries of a BinAxes list (0: none) */
    size_t shared;   /* the [channel][bin] values of a chunk, in the compute type, then the
                        BinAxes lists */

    ChunkPlan(int64_t batch, int64_t channels, int64_t height, int64_t width, int64_t num_rois,
              int64_t pooled_h, int64_t pooled_w, int64_t sampling_ratio, size_t element_size)
        : Chunks(batch, channels, height, width, num_rois, element_size) {
        shared = sizeof(A) * kLanes * (size_t)(pooled_h * pooled_w);
        /* the longest lists that fit the 48 KB a launch gets without opting
         * in (transposed_pays bounds the sums to 48 KB), at most
         * MMD_CUDA_AXIS_CAP entries, and at most the 2 cells a sample of
         * a fixed sampling_ratio's reads (the rest of the shared memory
         * left to L1 for the gathers) */
        const int64_t lists = pooled_h + pooled_w;
        const size_t room = shared < kChunkShared ? kChunkShared - shared : 0;
        int64_t cap = (int64_t)(room / (size_t)lists) - (int64_t)sizeof(int);
        cap = cap > 0 ? cap / (int64_t)(sizeof(A) + sizeof(int)) : 0;
        cap = cap < MMD_CUDA_AXIS_CAP ? cap : MMD_CUDA_AXIS_CAP;
        if (sampling_ratio > 0 && sampling_ratio < cap / 2) cap = 2 * sampling_ratio;
        axis_cap = (int)cap;
        shared += BinAxes<A>::bytes(lists, axis_cap);
    }
};

/* One group's transposed forward: its chunks of the map into scratch,
 * then their bins. */
template <typename T>
int forward_chunk(const ChunkPlan<typename Compute<T>::type> &plan, T *chunk, int64_t c0,
                  int64_t count, const mmd_tensor *input, const mmd_tensor *rois,
                  const mmd_tensor *output, int64_t pooled_h, int64_t pooled_w,
                  typename Compute<T>::type scale, int64_t sampling_ratio, int aligned,
                  const ErrorSink &sink, cudaStream_t stream) {
    const int s = plan.transpose((const T *)input->data, chunk, c0, count,
                                 "roi_align transpose launch", stream);
    if (s) return s;
    avg_forward_transposed_kernel<T><<<plan.roi_blocks, kThreads, plan.shared, stream>>>(
        (const T *)input->data, chunk, (const T *)rois->data, (T *)output->data, rois->shape[0],
        plan.channels, c0, count, input->shape[2], input->shape[3], pooled_h, pooled_w, plan.batch,
        scale, sampling_ratio, aligned, plan.axis_cap, sink);
    return launch_status("roi_align forward launch");
}

/* One group's transposed backward: its chunks' bins into the scratch
 * (all -0.0, fill_untouched_kernel), then the scratch into grad_input,
 * which leaves it -0.0 again. */
template <typename T>
int backward_chunk(const ChunkPlan<typename Compute<T>::type> &plan,
                   typename Compute<T>::type *chunk, int64_t c0,
                   int64_t count, const mmd_tensor *grad_output, const mmd_tensor *rois,
                   const mmd_tensor *grad_input, int64_t pooled_h, int64_t pooled_w,
                   typename Compute<T>::type scale, int64_t sampling_ratio, int aligned,
                   const ErrorSink &sink, cudaStream_t stream) {
    typedef typename Compute<T>::type A;
    avg_backward_transposed_kernel<T><<<plan.roi_blocks, kThreads, plan.shared, stream>>>(
        (const T *)grad_output->data, (const T *)rois->data, (T *)grad_input->data, chunk,
        rois->shape[0], plan.channels, c0, count, grad_input->shape[2], grad_input->shape[3],
        pooled_h, pooled_w, plan.batch, scale, sampling_ratio, aligned, plan.axis_cap, sink);
    const int s = launch_status("roi_align backward launch");
    if (s) return s;
    transpose_add_kernel<T, A><<<plan.transpose_blocks, dim3(kLanes, kTransposeRows), 0,
                                 stream>>>(chunk, (T *)grad_input->data, plan.batch,
                                           plan.channels, plan.cells, c0, count);
    return launch_status("roi_align transpose launch");
}

template <typename T>
int forward(const mmd_context *ctx, const mmd_tensor *input, const mmd_tensor *rois,
            const mmd_tensor *output, const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
            int64_t pooled_h, int64_t pooled_w, double spatial_scale, int64_t sampling_ratio,
            int64_t pool_mode, int aligned, cudaStream_t stream) {
    typedef typename Compute<T>::type A;
    const int64_t batch = input->shape[0];
    const int64_t total = mmd_numel(output);
    ErrorSink sink;
    const RoiCheck<T> check{(const T *)rois->data, batch, (A)spatial_scale, pooled_h, pooled_w,
                             sampling_ratio, aligned};
    int s = check_rois(ctx, "roi_align roi check", check, rois->shape[0], batch, stream, total > 0,
                       &sink);
    if (s || total == 0) return s;
    if (pool_mode == MMD_POOL_MAX) {
        auto kernel = total <= INT32_MAX ? max_forward_kernel<T, int32_t>
                                         : max_forward_kernel<T, int64_t>;
        kernel<<<blocks_for(total), kThreads, 0, stream>>>(
            (const T *)input->data, (const T *)rois->data, (T *)output->data,
            (T *)argmax_y->data, (T *)argmax_x->data, total, rois->shape[0], input->shape[1],
            input->shape[2], input->shape[3], pooled_h, pooled_w, batch, (A)spatial_scale,
            sampling_ratio, aligned, sink);
    } else {
        ChunkPlan<A> plan(batch, input->shape[1], input->shape[2], input->shape[3],
                          rois->shape[0], pooled_h, pooled_w, sampling_ratio, sizeof(T));
        StreamBuffer chunk(stream);
        if (transposed_pays(rois->shape[0], input->shape[1], batch, input->shape[2],
                            input->shape[3], pooled_h, pooled_w, sampling_ratio, sizeof(A)) &&
            plan.allocate(&chunk))
            return plan.each([&](int64_t c0, int64_t count) {
                return forward_chunk<T>(plan, chunk.as<T>(), c0, count, input, rois, output,
                                        pooled_h, pooled_w, (A)spatial_scale, sampling_ratio,
                                        aligned, sink, stream);
            });
        const int64_t threads = bin_groups(rois->shape[0], input->shape[1], pooled_h, pooled_w);
        avg_forward_kernel<T><<<blocks_for(threads), kThreads, 0, stream>>>(
            (const T *)input->data, (const T *)rois->data, (T *)output->data, threads,
            rois->shape[0], input->shape[1], input->shape[2], input->shape[3], pooled_h,
            pooled_w, batch, (A)spatial_scale, sampling_ratio, aligned, sink);
    }
    return launch_status("roi_align forward launch");
}

/* A kernel's dynamic shared memory allowed up to the device's opt-in
 * limit: the attribute belongs to the kernel (on each device), not to a
 * call, so each call setting its own size would let another thread's
 * smaller size, set between this call's set and its launch, fail this
 * launch; every caller sets the same value, once per kernel and device
 * (`allowed`, the caller's record for that kernel: a driver call saved on
 * every later call; threads that race there set the same value twice). */
template <typename Kernel>
int allow_shared_up_to(Kernel kernel, int device, int limit, std::atomic<int> *allowed) {
    const bool recorded = device >= 0 && device < kMaxDevices;
    if (recorded && allowed[device].load(std::memory_order_acquire) == limit) return 0;
    const cudaError_t err =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, limit);
    if (err != cudaSuccess) return cuda_error(err, "cudaFuncSetAttribute");
    if (recorded) allowed[device].store(limit, std::memory_order_release);
    return 0;
}

/* The tiled deterministic avg backward: the rois' channels whose bin
 * gradients are not all finite, flagged, then the tiles. */
template <typename T>
int deterministic_tiled(const Tiles<T> &tiles, int device, int shared_limit,
                        const mmd_tensor *grad_output, const mmd_tensor *rois,
                        const mmd_tensor *grad_input, int64_t pooled_h, int64_t pooled_w,
                        typename Compute<T>::type scale, int64_t sampling_ratio, int aligned,
                        const ErrorSink &sink, cudaStream_t stream) {
    const int64_t num_rois = rois->shape[0], channels = grad_input->shape[1];
    const int64_t total = mmd_numel(grad_output), flag_count = num_rois * tiles.chunks;
    StreamBuffer flags(stream);
    cudaError_t err = flags.allocate(sizeof(unsigned) * flag_count);
    if (err == cudaSuccess)
        err = cudaMemsetAsync(flags.as<void>(), 0, sizeof(unsigned) * flag_count, stream);
    if (err != cudaSuccess) return cuda_error(err, "roi_align deterministic backward flags");
    nonfinite_channels_kernel<T><<<blocks_for(total), kThreads, 0, stream>>>(
        (const T *)grad_output->data, flags.as<unsigned>(), total, channels, pooled_h * pooled_w,
        tiles.chunks);
    int s = launch_status("roi_align deterministic backward flags launch");
    if (s) return s;
    static std::atomic<int> allowed[kMaxDevices];   /* this kernel's (per T) */
    s = allow_shared_up_to(deterministic_avg_backward_tiled_kernel<T>, device, shared_limit,
                           allowed);
    if (s) return s;
    deterministic_avg_backward_tiled_kernel<T><<<grid_of(tiles.items), kThreads, tiles.bytes,
                                                 stream>>>(
        (const T *)grad_output->data, (const T *)rois->data, flags.as<unsigned>(),
        (T *)grad_input->data, num_rois, channels, grad_input->shape[2], grad_input->shape[3],
        pooled_h, pooled_w, grad_input->shape[0], scale, sampling_ratio, aligned, tiles, sink);
    return launch_status("roi_align deterministic backward launch");
}

template <typename T>
int backward(const mmd_context *ctx, const mmd_tensor *grad_output, const mmd_tensor *rois,
             const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
             const mmd_tensor *grad_input, int64_t pooled_h, int64_t pooled_w,
             double spatial_scale, int64_t sampling_ratio, int64_t pool_mode, int aligned,
             bool deterministic, cudaStream_t stream) {
    typedef typename Compute<T>::type A;
    const int64_t batch = grad_input->shape[0];
    const int64_t total = mmd_numel(grad_output);
    const bool work = total > 0 && mmd_numel(grad_input) > 0;
    ErrorSink sink;
    const RoiCheck<T> check{(const T *)rois->data, batch, (A)spatial_scale, pooled_h, pooled_w,
                             sampling_ratio, aligned};
    int s = check_rois(ctx, "roi_align roi check", check, rois->shape[0], batch, stream, work,
                       &sink);
    if (s || !work) return s;
    const bool max_mode = pool_mode == MMD_POOL_MAX;
    if (deterministic) {
        const int64_t planes = grad_input->shape[0] * grad_input->shape[1];
        const int64_t height = grad_input->shape[2], width = grad_input->shape[3];
        if (planes > INT32_MAX)
            return mmd_error(MMD_ERR_VALUE, "the deterministic backend takes at most %d "
                             "(image, channel) planes, got %lld", INT32_MAX, (long long)planes);
        if (max_mode) {
            deterministic_max_backward_kernel<T><<<(unsigned)planes, 32, 0, stream>>>(
                (const T *)grad_output->data, (const T *)rois->data, (const T *)argmax_y->data,
                (const T *)argmax_x->data, (T *)grad_input->data, rois->shape[0],
                grad_input->shape[1], height, width, pooled_h, pooled_w, batch, (A)spatial_scale,
                sampling_ratio, aligned, sink);
            return launch_status("roi_align deterministic backward launch");
        }
        int limit = 0;
        cudaError_t err = cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin,
                                                 ctx->device_id);
        if (err != cudaSuccess) return cuda_error(err, "cudaDeviceGetAttribute");
        const int64_t channels = grad_input->shape[1];
        if (channels >= kLanes / 2 && height < INT_MAX && width < INT_MAX &&
            pooled_h * pooled_w <= INT_MAX / kLanes) {
            const Tiles<T> tiles(batch, channels, height, width, pooled_h, pooled_w);
            if (tiles.bytes <= (size_t)limit)
                return deterministic_tiled<T>(tiles, ctx->device_id, limit, grad_output, rois,
                                              grad_input, pooled_h, pooled_w, (A)spatial_scale,
                                              sampling_ratio, aligned, sink, stream);
        }
        const size_t geo_offset = geometry_offset(
            sizeof(A) * (size_t)(pooled_h * pooled_w + pooled_h * height + pooled_w * width +
                                 pooled_h * width) +
            sizeof(int) * 2 * (size_t)height);
        const size_t fixed = geo_offset + sizeof(Geometry<A>) * kThreads;
        const size_t row = sizeof(T) * (size_t)width;
        if (fixed + row > (size_t)limit)
            return mmd_error(MMD_ERR_VALUE,
                             "the deterministic backend needs %zu bytes of shared memory for a "
                             "%lld x %lld map and %lld x %lld bins; this GPU has %d",
                             fixed + row, (long long)height, (long long)width, (long long)pooled_h,
                             (long long)pooled_w, limit);
        int64_t band_rows = (int64_t)(MMD_CUDA_BAND_BYTES / row);
        const int64_t room = (int64_t)(((size_t)limit - fixed) / row);
        band_rows = band_rows < room ? band_rows : room;
        band_rows = band_rows < 1 ? 1 : (band_rows > height ? height : band_rows);
        const int64_t bands = (height + band_rows - 1) / band_rows;
        if (planes > INT32_MAX / bands)
            return mmd_error(MMD_ERR_VALUE, "the deterministic backend takes at most %d "
                             "blocks of (image, channel, band of %lld rows), got %lld x %lld",
                             INT32_MAX, (long long)band_rows, (long long)planes, (long long)bands);
        const size_t shared = fixed + row * (size_t)band_rows;
        static std::atomic<int> allowed[kMaxDevices];   /* this kernel's (per T) */
        const int s = allow_shared_up_to(deterministic_avg_backward_kernel<T>, ctx->device_id,
                                         limit, allowed);
        if (s) return s;
        deterministic_avg_backward_kernel<T><<<(unsigned)(planes * bands), kThreads, shared,
                                               stream>>>(
            (const T *)grad_output->data, (const T *)rois->data, (T *)grad_input->data,
            rois->shape[0], grad_input->shape[1], height, width, pooled_h, pooled_w, batch,
            (A)spatial_scale, sampling_ratio, aligned, band_rows, bands, geo_offset, sink);
        return launch_status("roi_align deterministic backward launch");
    }
    const int64_t channels = grad_input->shape[1];
    if (max_mode) {
        auto kernel = total <= INT32_MAX ? max_backward_kernel<T, int32_t>
                                         : max_backward_kernel<T, int64_t>;
        kernel<<<blocks_for(total), kThreads, 0, stream>>>(
            (const T *)grad_output->data, (const T *)rois->data, (const T *)argmax_y->data,
            (const T *)argmax_x->data, (T *)grad_input->data, total, rois->shape[0], channels,
            grad_input->shape[2], grad_input->shape[3], pooled_h, pooled_w, batch,
            (A)spatial_scale, sampling_ratio, aligned, sink);
    } else {
        ChunkPlan<A> plan(batch, channels, grad_input->shape[2], grad_input->shape[3],
                          rois->shape[0], pooled_h, pooled_w, sampling_ratio, sizeof(A));
        StreamBuffer chunk(stream);
        if (transposed_pays(rois->shape[0], channels, batch, grad_input->shape[2],
                            grad_input->shape[3], pooled_h, pooled_w, sampling_ratio,
                            sizeof(A)) &&
            plan.allocate(&chunk)) {
            const int64_t size = plan.scratch_size();
            fill_untouched_kernel<A><<<blocks_for(size), kThreads, 0, stream>>>(chunk.as<A>(),
                                                                            size);
            s = launch_status("roi_align transposed chunk fill");
            if (s) return s;
            return plan.each([&](int64_t c0, int64_t count) {
                return backward_chunk<T>(plan, chunk.as<A>(), c0, count, grad_output, rois,
                                         grad_input, pooled_h, pooled_w, (A)spatial_scale,
                                         sampling_ratio, aligned, sink, stream);
            });
        }
        const int64_t threads = bin_groups(rois->shape[0], channels, pooled_h, pooled_w);
        avg_backward_kernel<T><<<blocks_for(threads), kThreads, 0, stream>>>(
            (const T *)grad_output->data, (const T *)rois->data, (T *)grad_input->data, threads,
            rois->shape[0], channels, grad_input->shape[2], grad_input->shape[3], pooled_h,
            pooled_w, batch, (A)spatial_scale, sampling_ratio, aligned, sink);
    }
    return launch_status("roi_align backward launch");
}

int roi_align_forward_cuda(const mmd_tensor *input, const mmd_tensor *rois,
                           const mmd_tensor *output, const mmd_tensor *argmax_y,
                           const mmd_tensor *argmax_x, int64_t aligned_height,
                           int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,
                           int64_t pool_mode, int aligned, const mmd_context *ctx) {
    int s = mmd_roi_align_forward_check(input, rois, output, argmax_y, argmax_x, aligned_height,
                                        aligned_width, spatial_scale, sampling_ratio, pool_mode,
                                        MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(input->dtype, [&](auto tag) {
            return forward<decltype(tag)>(ctx, input, rois, output, argmax_y, argmax_x,
                                          aligned_height, aligned_width, spatial_scale,
                                          sampling_ratio, pool_mode, aligned, stream);
        });
    });
}

int backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *rois,
                  const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
                  const mmd_tensor *grad_input, int64_t aligned_height, int64_t aligned_width,
                  double spatial_scale, int64_t sampling_ratio, int64_t pool_mode, int aligned,
                  bool deterministic, const mmd_context *ctx) {
    int s = mmd_roi_align_backward_check(grad_output, rois, argmax_y, argmax_x, grad_input,
                                         aligned_height, aligned_width, spatial_scale,
                                         sampling_ratio, pool_mode, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(grad_input->dtype, [&](auto tag) {
            return backward<decltype(tag)>(ctx, grad_output, rois, argmax_y, argmax_x,
                                           grad_input, aligned_height, aligned_width,
                                           spatial_scale, sampling_ratio, pool_mode, aligned,
                                           deterministic, stream);
        });
    });
}

int roi_align_backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *rois,
                            const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
                            const mmd_tensor *grad_input, int64_t aligned_height,
                            int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,
                            int64_t pool_mode, int aligned, const mmd_context *ctx) {
    return backward_cuda(grad_output, rois, argmax_y, argmax_x, grad_input, aligned_height,
                         aligned_width, spatial_scale, sampling_ratio, pool_mode, aligned, false,
                         ctx);
}

int roi_align_backward_cuda_deterministic(const mmd_tensor *grad_output, const mmd_tensor *rois,
                                          const mmd_tensor *argmax_y, const mmd_tensor *argmax_x,
                                          const mmd_tensor *grad_input, int64_t aligned_height,
                                          int64_t aligned_width, double spatial_scale,
                                          int64_t sampling_ratio, int64_t pool_mode, int aligned,
                                          const mmd_context *ctx) {
    return backward_cuda(grad_output, rois, argmax_y, argmax_x, grad_input, aligned_height,
                         aligned_width, spatial_scale, sampling_ratio, pool_mode, aligned, true,
                         ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, roi_align) {
    MMD_REGISTER_DEVICE_IMPL(roi_align_forward_impl, CUDA, DEFAULT, roi_align_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(roi_align_backward_impl, CUDA, DEFAULT, roi_align_backward_cuda);
    /* the forward is deterministic as it is (one thread per output element) */
    MMD_REGISTER_DEVICE_IMPL(roi_align_forward_impl, CUDA, DETERMINISTIC, roi_align_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(roi_align_backward_impl, CUDA, DETERMINISTIC,
                             roi_align_backward_cuda_deterministic);
}
