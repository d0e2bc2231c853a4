/* How the position-sensitive ops (ps_roi_align, ps_roi_pool) share out
 * their work on the CPU. Plane (n, c_in) of the feature map is bin
 * b = ph * pooled_w + pw of output channel co, c_in = co * bins + b
 * (ps_rois.h), and only that bin of each roi on image n reads (or adds
 * into) it. So the planes of one image and one bin, a run of up to
 * kPsGroup output channels, share every roi's bin: one item walks the
 * image's rois once and does each bin in all its planes together. The
 * loop and its branches (bins are a few cells, of varying shape) are then
 * shared by the planes, and each plane's sum is an independent chain the
 * CPU overlaps with the others. Each plane still gets its rois in order
 * and each bin its cells in order, so results are those of one plane at a
 * time, bit for bit, except which NaN a NaN result is (x86 keeps the first
 * operand's NaN of an add, and a vectorised loop may swap the operands). */
#ifndef MMDISPATCH_CPU_PS_PLANE_GROUPS_H
#define MMDISPATCH_CPU_PS_PLANE_GROUPS_H

#include <stdint.h>

#include <type_traits>

#include "heap_array.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/tensor.h"

namespace {

/* The most planes an item takes: enough independent sums to keep the
 * adders busy, few enough for their accumulators to stay in registers. */
constexpr int kPsGroup = 8;

/* Item i: image n, bin b, output channels [co, co + count), and part
 * `part` of `parts` of the rois; its planes are first_plane + j * bins for
 * j < count. */
struct PsItem {
    int64_t n, b, co, count, part, parts;

    /* The item's part of the rois [lo, hi) it would take whole. */
    void rois(int64_t lo, int64_t hi, int64_t *first, int64_t *last) const {
        *first = lo + (hi - lo) * part / parts;
        *last = lo + (hi - lo) * (part + 1) / parts;
    }
};

/* The fewest rois of a forward's part (PsPlaneGroups): each part's items
 * read their planes again (and prefetch the next item's whole), which
 * pays only where a part's rois read them often. Measured on the R-FCN
 * workload's map with 32 and 64 rois an image (2026-12-02, 2 threads),
 * parts of 16 rois took ps_roi_pool's forward 0.17 -> 0.27 ms and
 * ps_roi_align's 0.35 -> 0.56 ms against ranges of bins; parts of 64 or
 * more lost nothing at 512 rois an image. */
constexpr int64_t kPsPartRois = 64;

struct PsPlaneGroups {
    int64_t batch, channels, bins, c_out, runs, parts;
    bool split;   /* a range of `bins` items is an (image, run, part)'s every bin */

    /* Runs of at most kPsGroup output channels. `split_rois` (a forward,
     * whose items write the outputs of their rois) on more than one
     * thread: each (image, run, part of the rois) a worker's range of
     * items (its every bin), so that no two threads write a roi's output
     * bins of one run, which share cache lines (a roi's runs, over
     * kPsGroup output channels, meet in one line); the rois in parts of
     * kPsPartRois or more where that makes 4 triples a thread or more,
     * unless the ranges are still fewer than the threads (one image and
     * one run with under 2 * kPsPartRois rois, on 2 threads). Else
     * (a backward, whose items add into their planes: the rois whole, or
     * such a forward) shorter runs where the call has too few images and
     * bins to give each thread 4 items. */
    PsPlaneGroups(int64_t batch_, int64_t channels_, int64_t bins_, bool split_rois = false,
                  int64_t num_rois = 0)
        : batch(batch_), channels(channels_), bins(bins_), c_out(channels_ / bins_),
          runs((channels_ / bins_ + kPsGroup - 1) / kPsGroup), parts(1), split(false) {
        const int64_t threads = mmd_max_threads();
        if (split_rois && threads > 1) {
            split = true;
            const int64_t triples = batch * runs;
            const int64_t most = batch > 0 ? num_rois / (kPsPartRois * batch) : 0;
            if (triples > 0 && triples < 4 * threads)
                parts = (4 * threads + triples - 1) / triples;
            if (parts > most) parts = most > 1 ? most : 1;
            if (triples * parts >= threads) return;
            split = false;   /* fewer ranges than threads: ranges of bins, as a backward's */
            parts = 1;
        }
        const int64_t wanted = 4 * threads, per_run = batch * bins;
        if (per_run > 0 && runs * per_run < wanted) {
            const int64_t more = (wanted + per_run - 1) / per_run;
            runs = more < c_out ? more : c_out;
        }
    }

    int64_t items() const { return batch * runs * parts * bins; }
    /* Runs of output channels as even as kPsGroup allows (10 = 5 + 5). Not
     * split: runs fastest, then bins and images (neighbours share their
     * bin's cells). Split: bins fastest, then parts, runs and images. */
    PsItem item(int64_t i) const {
        int64_t b, run, part = 0, n;
        if (!split) {
            run = i % runs;
            b = (i / runs) % bins;
            n = i / runs / bins;
        } else {
            b = i % bins;
            part = (i / bins) % parts;
            run = (i / bins / parts) % runs;
            n = i / bins / parts / runs;
        }
        const int64_t co = run * c_out / runs, co_end = (run + 1) * c_out / runs;
        return PsItem{n, b, co, co_end - co, part, parts};
    }
    int64_t first_plane(const PsItem &it) const { return it.n * channels + it.co * bins + it.b; }
};

/* f(std::integral_constant<int, count>()), for 1 <= count <= kPsGroup: the
 * item's loops get their plane count at compile time. */
template <typename F> void ps_with_group_size(int64_t count, const F &f) {
    switch (count) {
    case 1: f(std::integral_constant<int, 1>()); break;
    case 2: f(std::integral_constant<int, 2>()); break;
    case 3: f(std::integral_constant<int, 3>()); break;
    case 4: f(std::integral_constant<int, 4>()); break;
    case 5: f(std::integral_constant<int, 5>()); break;
    case 6: f(std::integral_constant<int, 6>()); break;
    case 7: f(std::integral_constant<int, 7>()); break;
    default: f(std::integral_constant<int, 8>()); break;
    }
}
static_assert(kPsGroup == 8, "ps_with_group_size covers 1 to kPsGroup planes");

/* The rois of each image, in order: order[start[n]] .. order[start[n+1] - 1]. */
struct RoisByImage {
    HeapArray<int64_t> order, start;

    RoisByImage(int64_t num_rois, int64_t batch) : order(num_rois), start(batch + 1) {}

    /* batch_of(k) is roi k's image, checked to lie in [0, batch). */
    template <typename BatchOf>
    int build(int64_t num_rois, int64_t batch, const BatchOf &batch_of) {
        if (!order || !start)
            return mmd_error(MMD_ERR_MEMORY, "out of memory to order %lld rois by image",
                             (long long)num_rois);
        for (int64_t n = 0; n <= batch; ++n) start[n] = 0;
        for (int64_t k = 0; k < num_rois; ++k) ++start[batch_of(k) + 1];
        for (int64_t n = 0; n < batch; ++n) start[n + 1] += start[n];
        HeapArray<int64_t> next(batch);
        if (!next)
            return mmd_error(MMD_ERR_MEMORY, "out of memory to order %lld rois by image",
                             (long long)num_rois);
        for (int64_t n = 0; n < batch; ++n) next[n] = start[n];
        for (int64_t k = 0; k < num_rois; ++k) order[next[batch_of(k)]++] = k;
        return MMD_OK;
    }
};

/* Shares out the items of `groups` over threads: for each, f(size, item,
 * next), with size a std::integral_constant of the item's plane count and
 * `next` a prefetcher of the next item's planes of `map` (input or
 * grad_input), which f steps once per roi: rois read a plane at scattered
 * cells, which the hardware does not prefetch. `work` is the call's
 * elementary steps in all. */
template <typename T, typename F>
int ps_for_plane_groups(const PsPlaneGroups &groups, const T *map, int64_t plane_size,
                        int64_t work, const F &f) {
    const int64_t items = groups.items(), plane_bytes = plane_size * (int64_t)sizeof(T);
    const int64_t chunk = groups.split ? groups.bins : mmd_even_chunk(items);
    return mmd_parallel_for(items, chunk, mmd_worth_threads(items, work),
                            [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const PsItem it = groups.item(i), after = groups.item(i + 1 < end ? i + 1 : i);
            mmd_block_prefetch next(map + groups.first_plane(after) * plane_size, plane_bytes,
                                    after.count, groups.bins * plane_bytes);
            ps_with_group_size(it.count, [&](auto size) { f(size, it, next); });
            next.finish();
        }
        return (int)MMD_OK;
    });
}

}  // namespace

#endif
