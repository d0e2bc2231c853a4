/* Channel groups of the CPU roi kernels (roi_align's avg pooling,
 * roi_pool's forward): an image's planes of a group of channels
 * interleaved in a worker's scratch, the rois by image, and the work
 * items that share a call's (group, image) pairs out over the workers. A
 * call type C gives them its shapes (batch, num_rois, channels, height,
 * width, bins()), `value_type`, `op` and `scratch` (names for the errors:
 * the op, and what its kernels' scratch holds), `bin_scratch` (whether
 * its items use GroupItem::bins), `roi_reads(k, &image)` (roi k's image
 * and the cells it reads; its roi valid) and `all_reads()` (the cells all
 * rois read). */
#ifndef MMDISPATCH_CPU_CHANNEL_GROUPS_H
#define MMDISPATCH_CPU_CHANNEL_GROUPS_H

#include <stdint.h>
#include <stdlib.h>

#include "mmdispatch/parallel.h"
#include "heap_array.h"
#include "vec16.h"

namespace mmd_channel_groups {

/* Channel groups: an op's channels a
 * group of kGroup<T> at a time, one 32-byte vector of T (8 float, 4 double;
 * split in two where a clone has no such registers), from an image's
 * planes of the group interleaved in a worker's scratch, a cell's channels
 * side by side (cell i of lane l at i * kGroup + l), so that one vector
 * load or store serves the group's channels at a cell and a bin's
 * arithmetic runs once for all of them. Each lane runs the scalar code's
 * operations in its order, so it gets the scalar code's bits (no FMA:
 * MMD_X86_CLONES enables none). */
template <typename T> using GroupVec = Vec<T, 32>;
template <typename T> constexpr int64_t kGroup = GroupVec<T>::lanes;

/* N x N blocks of T (N = 16 / sizeof(T)) transposed in 16-byte registers:
 * r[j] holds row j's N values, and then column j's. */
#if defined(__clang__)   /* a shuffle of a and b by constant lane indices */
#define MMD_SHUFFLE(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define MMD_SHUFFLE(a, b, ...) __builtin_shuffle(a, b, (I){__VA_ARGS__})
#endif
template <typename T> MMD_INLINE void transpose_block(typename Vec<T, 16>::type *r) {
    typedef typename Vec<T, 16>::type half;
    if constexpr (Vec<T, 16>::lanes == 4) {   /* 4 x 4 floats: unpack pairs, then halves */
        typedef int32_t I __attribute__((vector_size(16)));
        const half a = MMD_SHUFFLE(r[0], r[1], 0, 4, 1, 5);
        const half b = MMD_SHUFFLE(r[2], r[3], 0, 4, 1, 5);
        const half c = MMD_SHUFFLE(r[0], r[1], 2, 6, 3, 7);
        const half d = MMD_SHUFFLE(r[2], r[3], 2, 6, 3, 7);
        r[0] = MMD_SHUFFLE(a, b, 0, 1, 4, 5);
        r[1] = MMD_SHUFFLE(a, b, 2, 3, 6, 7);
        r[2] = MMD_SHUFFLE(c, d, 0, 1, 4, 5);
        r[3] = MMD_SHUFFLE(c, d, 2, 3, 6, 7);
    } else {   /* 2 x 2 doubles */
        typedef int64_t I __attribute__((vector_size(16)));
        const half a = MMD_SHUFFLE(r[0], r[1], 0, 2);
        r[1] = MMD_SHUFFLE(r[0], r[1], 1, 3);
        r[0] = a;
    }
}
#undef MMD_SHUFFLE

/* cells[i * kGroup + l] = planes[l * plane_size + i] for `count` planes
 * (lanes past them repeat the last plane: they are never stored back), or
 * back (TO_PLANES: lanes below count only), by blocks of N cells x N lanes
 * (transpose_block), the last cells one at a time. */
template <bool TO_PLANES, typename T>
MMD_INLINE void move_lanes(T *planes, int64_t plane_size, int64_t count, T *cells) {
    typedef Vec<T, 16> H;
    constexpr int64_t L = kGroup<T>, N = H::lanes;
    T *plane[L];
    for (int64_t l = 0; l < L; ++l) plane[l] = planes + (l < count ? l : count - 1) * plane_size;
    const int64_t whole = TO_PLANES ? count / N * N : L;   /* lanes moved by blocks */
    int64_t i = 0;
    for (; i + N <= plane_size; i += N) {
        for (int64_t h = 0; h < whole; h += N) {
            typename H::type r[N];
            for (int64_t j = 0; j < N; ++j)
                r[j] = TO_PLANES ? H::load(cells + (i + j) * L + h) : H::load(plane[h + j] + i);
            transpose_block<T>(r);
            for (int64_t j = 0; j < N; ++j) {
                if (TO_PLANES)
                    H::store(plane[h + j] + i, r[j]);
                else
                    H::store(cells + (i + j) * L + h, r[j]);
            }
        }
        for (int64_t l = whole; l < (TO_PLANES ? count : 0); ++l)
            for (int64_t j = 0; j < N; ++j) plane[l][i + j] = cells[(i + j) * L + l];
    }
    for (; i < plane_size; ++i)
        for (int64_t l = 0; l < (TO_PLANES ? count : L); ++l) {
            if (TO_PLANES)
                plane[l][i] = cells[i * L + l];
            else
                cells[i * L + l] = plane[l][i];
        }
}
template <typename T>
MMD_X86_CLONES void interleave(const T *planes, int64_t plane_size, int64_t count, T *cells) {
    move_lanes<false>(const_cast<T *>(planes), plane_size, count, cells);   /* only read */
}
template <typename T>
MMD_X86_CLONES void deinterleave(const T *cells, int64_t plane_size, int64_t count, T *planes) {
    move_lanes<true>(planes, plane_size, count, const_cast<T *>(cells));    /* only read */
}

/* bytes of a worker's interleaved planes (every worker holds its own): a
 * map of up to 512 x 512 cells in float (the bench's 200 x 304: 1.9 MB) */
constexpr int64_t kMaxInterleaved = (int64_t)8 << 20;

/* Reads of an image's cells (C::roi_reads) that pay for interleaving its
 * planes of a group: as many as it has cells. Measured on one 200 x 304
 * image of 256 channels (2026-12-02, 2 threads): roi_align's sr=2 forward
 * gained from about 0.7 reads a cell, roi_pool's forward below 0.5, the
 * backward by 1. */
constexpr double kInterleaveReads = 1.0;

/* The rois by image: slice n's rois are roi(start[n] .. start[n + 1] - 1),
 * of image images[n], and interleave[n] says whether they read its cells
 * often enough (kInterleaveReads a cell) to pay for interleaving its planes
 * of a group, where they fit kMaxInterleaved: a slice per image that has
 * rois (a stable counting sort by batch index), or for one image a slice
 * of every roi in order. `all_reads`: call.all_reads() where the caller
 * has it (few_reads), else below 0. */
template <typename C> struct ImageRois {
    typedef typename C::value_type T;
    bool sorted;
    int64_t slices;
    /* in the holder for up to 16 images and 64 rois (a small call allocates nothing) */
    SmallArray<int64_t, 64> order, image_of;
    SmallArray<int64_t, 17> start;
    SmallArray<int64_t, 16> next, images;   /* images[n]: slice n's image */
    SmallArray<unsigned char, 16> interleave;
    SmallArray<double, 16> reads;      /* the cells slice n's rois read */

    explicit ImageRois(const C &call, double all_reads = -1)
        : sorted(call.batch > 1), slices(sorted ? call.batch : 1),
          order(sorted ? call.num_rois : 0), image_of(sorted ? call.num_rois : 0),
          start(slices + 1), next(slices), images(slices), interleave(slices), reads(slices) {
        if (!ok()) return;
        const int64_t cells = call.height * call.width;
        const bool fits = cells <= kMaxInterleaved / (int64_t)sizeof(T) / kGroup<T>;
        for (int64_t n = 0; n <= slices; ++n) start[n] = 0;
        for (int64_t n = 0; n < slices; ++n) reads[n] = 0;
        if (!sorted) {
            start[1] = call.num_rois;
            images[0] = 0;
            reads[0] = !fits ? 0 : all_reads >= 0 ? all_reads : call.all_reads();
            interleave[0] = reads[0] >= kInterleaveReads * (double)cells;
            return;
        }
        for (int64_t k = 0; k < call.num_rois; ++k) {
            int64_t image = 0;
            const double roi_reads = call.roi_reads(k, &image);   /* valid: checked before */
            image_of[k] = image;
            ++start[image + 1];
            reads[image] += roi_reads;
        }
        /* a slice for each image with rois, in order (in place: slice s <= image n, and
         * start[n + 1], image n's count, is read before start[s] is written) */
        int64_t s = 0, total = 0;
        for (int64_t n = 0; n < call.batch; ++n) {
            const int64_t count = start[n + 1];
            if (!count) continue;
            images[s] = n;
            reads[s] = reads[n];
            interleave[s] = fits && reads[s] >= kInterleaveReads * (double)cells;
            next[n] = start[s] = total;   /* next: by image, the next roi's slot */
            total += count;
            ++s;
        }
        start[s] = total;
        slices = s;
        for (int64_t k = 0; k < call.num_rois; ++k) order[next[image_of[k]]++] = k;
    }
    bool ok() const {
        return order && image_of && start && next && images && interleave && reads;
    }
    int64_t roi(int64_t i) const { return sorted ? order[i] : i; }
    bool any_interleaved() const {
        for (int64_t n = 0; n < slices; ++n)
            if (interleave[n]) return true;
        return false;
    }

    /* Whether the rois read fewer cells in all than kInterleaveReads a
     * map's cell (no image can pay for interleaving), or its planes pass
     * kMaxInterleaved:
     * such a call takes its channels one at a time (without this struct's
     * cost, for a small call; the same bits). roi_align asks only for a
     * fixed sampling_ratio, whose all_reads() is arithmetic. `*reads`, if
     * given: all_reads(), where it was needed, for the constructor. */
    static bool few_reads(const C &call, double *reads = nullptr) {
        const int64_t cells = call.height * call.width;
        if (cells > kMaxInterleaved / (int64_t)sizeof(T) / kGroup<T>) return true;
        const double all = call.all_reads();
        if (reads) *reads = all;
        return all < kInterleaveReads * (double)cells;
    }
};

/* One work item of the group kernels: channels [c0, c0 + count) of a
 * slice's rois roi(first .. last - 1) (ImageRois), all of `image`, with a
 * worker's scratch:
 * `cells` (room for an image's interleaved planes where any slice is
 * interleaved), `bins` (a roi's [bins][kGroup] values, where
 * C::bin_scratch) and `wide` (a dense
 * roi's row accumulator of kGroup lanes a cell, grown with grow()). */
template <typename T> struct GroupItem {
    int64_t c0, count, image, first, last;
    bool interleaved;   /* from the image's planes interleaved in `cells` */
    T *cells, *bins;
    T **wide;
    size_t *wide_cap;
};

/* f(item) for every (group, slice, part of the slice's rois), shared out
 * as ranges of items, each with its scratch; `parts_allowed`: whether a
 * slice's rois may be split (the forward, whose items write disjoint
 * outputs; the backward's items add into their slice's planes), which is
 * done only where groups and slices are fewer than twice the threads (each
 * part interleaves the planes again), into parts of 32 rois at least. f
 * returns false when out of memory. */
template <typename C, typename F>
int for_each_group_item(const C &call, const ImageRois<C> &images, bool parts_allowed,
                        const F &f) {
    typedef typename C::value_type T;
    if (!images.ok()) return mmd_error(MMD_ERR_MEMORY, "out of memory for %s's rois", C::op);
    const int64_t L = kGroup<T>, groups = (call.channels + L - 1) / L;
    const int64_t threads = mmd_max_threads(), slices = groups * images.slices;
    int64_t parts = 1;
    if (parts_allowed && slices < 2 * threads) {
        parts = (2 * threads + slices - 1) / slices;
        const int64_t most = call.num_rois / (32 * images.slices);
        if (parts > most) parts = most > 1 ? most : 1;
    }
    const int64_t items = slices * parts, per_range = (items + 2 * threads - 1) / (2 * threads);
    const int64_t plane = call.height * call.width;
    const int64_t cells = images.any_interleaved() ? plane * L : 1;
    return mmd_parallel_for(
        items, per_range, mmd_worth_threads(items, call.channels * call.num_rois * call.bins()),
        [&](int64_t begin, int64_t end) -> int {
            /* a small call's in the holder: 7 x 7 bins of 8 lanes, no planes */
            SmallArray<T, 1> planes(cells);
            SmallArray<T, 49 * 8> bins(C::bin_scratch ? call.bins() * L : 0);
            T *wide = nullptr;
            size_t wide_cap = 0;
            int status = planes && bins ? (int)MMD_OK
                                        : mmd_error(MMD_ERR_MEMORY,
                                                    "out of memory for %s's planes", C::op);
            for (int64_t item = begin; item < end && status == MMD_OK; ++item) {
                const int64_t c0 = item / (images.slices * parts) * L;
                const int64_t n = item / parts % images.slices;
                const int64_t part = item % parts, s = images.start[n];
                const int64_t len = images.start[n + 1] - s;
                /* a part interleaves where its share of the slice's reads pays */
                const bool interleaved = images.interleave[n] && len > 0 &&
                                         images.reads[n] / (double)parts >=
                                             kInterleaveReads * (double)plane;
                const GroupItem<T> it{c0,
                                      call.channels - c0 < L ? call.channels - c0 : L,
                                      images.images[n],
                                      s + len * part / parts,
                                      s + len * (part + 1) / parts,
                                      interleaved,
                                      planes.get(),
                                      bins.get(),
                                      &wide,
                                      &wide_cap};
                if (!f(it))
                    status = mmd_error(MMD_ERR_MEMORY, "out of memory for %s's %s", C::op,
                                       C::scratch);
            }
            free(wide);
            return status;
        });
}

}  // namespace mmd_channel_groups

#endif
