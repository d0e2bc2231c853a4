/* What the CPU nms kernels (nms.cpp, nms_rotated.cpp) share after the sort:
 * the greedy suppression, over boxes already in visiting order.
 *
 * A box set S provides
 *   int64_t n;
 *   bool extent(int64_t i, double *x0, double *y0, double *x1, double *y1) const;
 *   int suppresses(int64_t k, int64_t j) const;   (kept box k, later box j)
 * where extent() gives a rectangle around box i such that two boxes whose
 * rectangles do not overlap never suppress each other at a threshold >= 0,
 * or returns false for a box that, at such a threshold, neither suppresses
 * nor is suppressed (an empty or undefined box). */
#ifndef MMDISPATCH_CPU_NMS_GRID_H
#define MMDISPATCH_CPU_NMS_GRID_H

#include <math.h>
#include <stdint.h>

#include "heap_array.h"
#include "mmdispatch/parallel.h"

namespace {

/* The definition: each kept box suppresses every later box it overlaps,
 * one pass per kept box. O(kept * n); any threshold. Returns the kept
 * count (kept_rank[0:kept] their positions), -1 when out of memory. */
template <typename S> int64_t suppress_linear(const S &s, int64_t *kept_rank) {
    HeapArray<unsigned char> removed(s.n, true);
    if (!removed) return -1;
    int64_t kept = 0;
    for (int64_t i = 0; i < s.n; ++i) {
        if (removed[i]) continue;
        kept_rank[kept++] = i;
        for (int64_t j = i + 1; j < s.n; ++j) removed[j] |= (unsigned char)s.suppresses(i, j);
    }
    return kept;
}

/* Grid cells [c0, c1] x [r0, r1] a box may overlap; c0 < 0: the box has no
 * extent (S::extent returned false). */
struct Cells {
    int32_t c0, c1, r0, r1;
    int big; /* covers more than kBigCells cells: kept out of the grid */
};

/* A uniform grid over the finite box extents, cells about the mean extent,
 * at most kMaxSide a side. */
struct GridLayout {
    double lo_x = 0, lo_y = 0, cell_w = 1, cell_h = 1;
    int32_t cols = 1, rows = 1;

    int32_t cell_of(double v, double lo, double size, int32_t count) const {
        const double c = floor((v - lo) / size);
        /* NaN (inf - inf, when no box is finite and the grid is one cell)
         * goes to cell 0: converting it to an integer would be undefined */
        return c >= count ? count - 1 : (c >= 0 ? (int32_t)c : 0);
    }
};

constexpr int kBigCells = 64;
constexpr int kMaxSide = 1024;

/* Marks the boxes without an extent (c0 = -1) and lays the grid over the
 * others. */
template <typename S> GridLayout grid_layout(const S &s, Cells *cells) {
    double lo_x = INFINITY, hi_x = -INFINITY, lo_y = INFINITY, hi_y = -INFINITY;
    double sum_w = 0, sum_h = 0;
    int64_t finite = 0;
    for (int64_t i = 0; i < s.n; ++i) {
        double ax, ay, bx, by;
        cells[i].c0 = s.extent(i, &ax, &ay, &bx, &by) ? 0 : -1;
        if (cells[i].c0 < 0 || !(isfinite(ax) && isfinite(bx) && isfinite(ay) && isfinite(by)))
            continue;
        lo_x = ax < lo_x ? ax : lo_x;
        hi_x = bx > hi_x ? bx : hi_x;
        lo_y = ay < lo_y ? ay : lo_y;
        hi_y = by > hi_y ? by : hi_y;
        sum_w += bx - ax;
        sum_h += by - ay;
        ++finite;
    }
    GridLayout grid;
    grid.lo_x = lo_x;
    grid.lo_y = lo_y;
    if (finite == 0) return grid;
    const double mean_w = sum_w / (double)finite, mean_h = sum_h / (double)finite;
    const double span_x = hi_x - lo_x, span_y = hi_y - lo_y;
    double want_x = mean_w > 0 ? ceil(span_x / mean_w) : 1;
    double want_y = mean_h > 0 ? ceil(span_y / mean_h) : 1;
    /* NaN (inf / inf: extents near the double range) counts as 1 */
    want_x = want_x >= 1 ? (want_x > kMaxSide ? kMaxSide : want_x) : 1;
    want_y = want_y >= 1 ? (want_y > kMaxSide ? kMaxSide : want_y) : 1;
    grid.cols = (int32_t)want_x;
    grid.rows = (int32_t)want_y;
    if (isfinite(span_x) && span_x > 0) grid.cell_w = span_x / grid.cols; else grid.cols = 1;
    if (isfinite(span_y) && span_y > 0) grid.cell_h = span_y / grid.rows; else grid.rows = 1;
    return grid;
}

/* The cells of every box with an extent (a box covering more than
 * kBigCells is marked big and enters none); cell_start (num_cells + 1
 * entries, zeroed) becomes each cell's first entry in a list of the other
 * boxes' entries, cell by cell. Returns the entries in all. */
template <typename S>
int64_t place_in_cells(const S &s, const GridLayout &grid, Cells *cells, int64_t *cell_start) {
    const int64_t num_cells = (int64_t)grid.cols * grid.rows;
    int64_t total = 0;
    for (int64_t i = 0; i < s.n; ++i) {
        Cells *c = &cells[i];
        if (c->c0 < 0) continue;
        double ax, ay, bx, by;
        s.extent(i, &ax, &ay, &bx, &by);
        c->c0 = grid.cell_of(ax, grid.lo_x, grid.cell_w, grid.cols);
        c->c1 = grid.cell_of(bx, grid.lo_x, grid.cell_w, grid.cols);
        c->r0 = grid.cell_of(ay, grid.lo_y, grid.cell_h, grid.rows);
        c->r1 = grid.cell_of(by, grid.lo_y, grid.cell_h, grid.rows);
        const int64_t covered = (int64_t)(c->c1 - c->c0 + 1) * (c->r1 - c->r0 + 1);
        c->big = covered > kBigCells;
        if (c->big) continue;
        for (int32_t r = c->r0; r <= c->r1; ++r)
            for (int32_t q = c->c0; q <= c->c1; ++q) ++cell_start[(int64_t)r * grid.cols + q + 1];
        total += covered;
    }
    for (int64_t k = 0; k < num_cells; ++k) cell_start[k + 1] += cell_start[k];
    return total;
}

/* Enters id in the list of each of c's cells (a box place_in_cells gave
 * cells, not a big one): at cell_start[cell] + fill[cell], fill counting
 * what each list holds so far. */
template <typename F, typename E>
inline void enter_in_cells(const Cells &c, int32_t cols, const int64_t *cell_start, F *fill,
                           E *entries, E id) {
    for (int32_t r = c.r0; r <= c.r1; ++r)
        for (int32_t q = c.c0; q <= c.c1; ++q) {
            const int64_t cell = (int64_t)r * cols + q;
            entries[cell_start[cell] + fill[cell]++] = id;
        }
}

/* Kept boxes entered in a uniform grid, for suppress_grid. */
template <typename S> class KeptGrid {
  public:
    KeptGrid(const S &s, int64_t *kept_rank) : s_(s), kept_rank_(kept_rank) {}

    /* Lays out the grid and its cell lists; false when out of memory. */
    bool build() {
        if (!cells_ || !big_) return false;
        grid_ = grid_layout(s_, cells_.get());
        cols_ = grid_.cols;
        const int64_t num_cells = (int64_t)cols_ * grid_.rows;
        /* a box enters up to kBigCells cells, so the entry count can pass
         * 2^31 long before n does: offsets are 64-bit, entries (box ranks)
         * 32-bit */
        cell_start_.reset(num_cells + 1, true);
        cell_fill_.reset(num_cells, true);
        if (!cell_start_ || !cell_fill_) return false;
        entries_.reset(place_in_cells(s_, grid_, cells_.get(), cell_start_.get()));
        return (bool)entries_;
    }

    int64_t kept() const { return kept_; }

    /* Starts a block of boxes from rank `first` on (every box below it is
     * decided). */
    void begin_block(int64_t first) {
        block_first_ = first;
        kept_before_ = kept_;
        big_before_ = num_big_;
    }

    /* Whether a box kept before the block suppresses box j. Only reads the
     * grid: calls for the block's boxes may run in parallel. */
    int suppressed_before_block(int64_t j) const {
        return suppressed(j, 0, 0, kept_before_, 0, big_before_);
    }

    /* Whether a box the block has kept so far suppresses box j. */
    int suppressed_in_block(int64_t j) const {
        return suppressed(j, block_first_, kept_before_, kept_, big_before_, num_big_);
    }

    /* Keeps box j (every box of lower rank is decided). */
    void keep(int64_t j) {
        kept_rank_[kept_++] = j;
        const Cells *c = &cells_[j];
        if (c->c0 < 0) return;
        if (c->big) {
            big_[num_big_++] = j;
            return;
        }
        enter_in_cells(*c, cols_, cell_start_.get(), cell_fill_.get(), entries_.get(), (int32_t)j);
    }

  private:
    /* Whether a kept box of rank `from` or more suppresses box j, each such
     * pair tested once: in the first cell (lowest row, then column) the two
     * share; [kept_from, kept_to) and [big_from, big_to) are the ranges of
     * kept_rank_ and big_ to test. */
    int suppressed(int64_t j, int64_t from, int64_t kept_from, int64_t kept_to, int64_t big_from,
                   int64_t big_to) const {
        const Cells *c = &cells_[j];
        if (c->c0 < 0) return 0;
        if (c->big) {
            for (int64_t k = kept_from; k < kept_to; ++k)
                if (cells_[kept_rank_[k]].c0 >= 0 && s_.suppresses(kept_rank_[k], j)) return 1;
            return 0;
        }
        for (int64_t k = big_from; k < big_to; ++k)
            if (s_.suppresses(big_[k], j)) return 1;
        for (int32_t r = c->r0; r <= c->r1; ++r)
            for (int32_t q = c->c0; q <= c->c1; ++q) {
                const int64_t cell = (int64_t)r * cols_ + q;
                const int32_t *list = entries_.get() + cell_start_[cell];
                const int32_t end = cell_fill_[cell];
                int32_t e = 0;
                if (from > 0)   /* a cell's list is in rank order: from its end */
                    for (e = end; e > 0 && list[e - 1] >= from; --e) {}
                for (; e < end; ++e) {
                    const Cells &other = cells_[list[e]];
                    if ((r == c->r0 || r == other.r0) && (q == c->c0 || q == other.c0) &&
                        s_.suppresses(list[e], j))
                        return 1;
                }
            }
        return 0;
    }

    const S &s_;
    int64_t *kept_rank_;
    HeapArray<Cells> cells_{s_.n};
    HeapArray<int64_t> big_{s_.n};   /* kept big boxes, in rank order */
    HeapArray<int64_t> cell_start_{0};
    HeapArray<int32_t> cell_fill_{0};
    HeapArray<int32_t> entries_{0};
    GridLayout grid_;
    int32_t cols_ = 1;
    int64_t kept_ = 0, num_big_ = 0;
    int64_t block_first_ = 0, kept_before_ = 0, big_before_ = 0;   /* begin_block */
};

/* With threads, boxes are decided a block at a time: first each box of the
 * block against the boxes kept before the block (in parallel: the grid is
 * only read), then, in order, the survivors against the boxes the block
 * keeps. */
constexpr int64_t kDecideBlock = 1024;

/* Same decisions as suppress_linear for thresholds >= 0, where only boxes
 * whose extents overlap can suppress each other: each box is tested only
 * against the kept boxes sharing a grid cell with it (boxes covering many
 * cells, e.g. with infinite coordinates, against every kept box).
 * O(n * local). Only for n <= INT32_MAX (entries are 32-bit). Returns the
 * kept count, -1 when out of memory. `pair_work`: elementary steps a pair
 * test costs, for the threading decision. */
template <typename S>
int64_t suppress_grid(const S &s, int64_t *kept_rank, int64_t pair_work) {
    /* one thread: one block, every box in order */
    const int64_t block = mmd_max_threads() > 1 ? kDecideBlock : s.n;
    KeptGrid<S> grid(s, kept_rank);
    HeapArray<unsigned char> earlier(block);
    if (!grid.build() || !earlier) return -1;
    for (int64_t first = 0; first < s.n; first += block) {
        const int64_t width = s.n - first < block ? s.n - first : block;
        grid.begin_block(first);
        (void)mmd_parallel_for(width, mmd_even_chunk(width),
                               mmd_worth_threads(width, 8 * width * pair_work),
                               [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i)
                earlier[i] = (unsigned char)grid.suppressed_before_block(first + i);
            return (int)MMD_OK;
        });
        for (int64_t i = 0; i < width; ++i)
            if (!earlier[i] && !grid.suppressed_in_block(first + i)) grid.keep(first + i);
    }
    return grid.kept();
}

}  // namespace

#endif
