/* nms / batched_nms on CPU. Boxes are sorted once by (score key desc, index
 * asc), copied into per-coordinate arrays in that order, and each kept box
 * suppresses the later boxes of its class in one branch-free, vectorisable
 * pass. */
#include <stdlib.h>

#include "mmdispatch/ops/nms.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "score_order.h"

namespace {

/* Boxes in visiting order, one array per coordinate. */
template <typename T> struct SortedBoxes {
    int64_t n;
    T *x1, *y1, *x2, *y2, *area;
    int64_t *cls;   /* class of each box; all 0 for plain nms */
    T offset, threshold;

    int suppresses(int64_t k, int64_t j) const {
        const T inter = mmd_overlap_1d(x1[k], x2[k], x1[j], x2[j], offset) *
                        mmd_overlap_1d(y1[k], y2[k], y1[j], y2[j], offset);
        const T iou = mmd_box_ratio(inter, area[k] + area[j] - inter);
        return (iou > threshold) & (cls[k] == cls[j]);
    }
};

/* The definition: each kept box suppresses every later box it overlaps,
 * one branch-free pass per kept box. O(kept * n); any threshold. Returns
 * the kept count, -1 when out of memory. */
template <typename T> int64_t suppress_linear(const SortedBoxes<T> &s, int64_t *kept_rank) {
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

/* Grid cells [c0, c1] x [r0, r1] a box may overlap; c0 < 0: the box has an
 * empty extent (x2 + offset <= x1, y2 + offset <= y1, or NaN), so its
 * intersection with any box is 0 and, for a threshold >= 0, it neither
 * suppresses nor is suppressed. */
struct Cells {
    int32_t c0, c1, r0, r1;
    int big; /* covers more than kBigCells cells: kept out of the grid */
};

/* A uniform grid over the finite box extents, cells about the mean box
 * size, at most kMaxSide a side. */
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

/* Marks the boxes with an empty extent (c0 = -1) and lays the grid over
 * the others. */
template <typename T> GridLayout grid_layout(const SortedBoxes<T> &s, Cells *cells) {
    double lo_x = INFINITY, hi_x = -INFINITY, lo_y = INFINITY, hi_y = -INFINITY;
    double sum_w = 0, sum_h = 0;
    int64_t finite = 0;
    for (int64_t i = 0; i < s.n; ++i) {
        const double ax = s.x1[i], bx = (double)s.x2[i] + s.offset;
        const double ay = s.y1[i], by = (double)s.y2[i] + s.offset;
        cells[i].c0 = (bx > ax && by > ay) ? 0 : -1;
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
    want_x = want_x < 1 ? 1 : (want_x > kMaxSide ? kMaxSide : want_x);
    want_y = want_y < 1 ? 1 : (want_y > kMaxSide ? kMaxSide : want_y);
    grid.cols = (int32_t)want_x;
    grid.rows = (int32_t)want_y;
    if (isfinite(span_x) && span_x > 0) grid.cell_w = span_x / grid.cols; else grid.cols = 1;
    if (isfinite(span_y) && span_y > 0) grid.cell_h = span_y / grid.rows; else grid.rows = 1;
    return grid;
}

/* Same decisions as suppress_linear for thresholds >= 0, where only boxes
 * with a positive intersection can suppress each other: kept boxes are
 * entered in a uniform grid, and each box is tested only against the kept
 * boxes sharing a cell with it (boxes covering many cells, e.g. with
 * infinite coordinates, are tested against every kept box). O(n * local).
 * Returns the kept count, -1 when out of memory. */
template <typename T> int64_t suppress_grid(const SortedBoxes<T> &s, int64_t *kept_rank) {
    const int64_t n = s.n;
    HeapArray<Cells> cells(n);
    HeapArray<int64_t> big(n);   /* kept big boxes */
    if (!cells || !big) return -1;
    const GridLayout grid = grid_layout(s, cells.get());
    const int32_t cols = grid.cols;
    const int64_t num_cells = (int64_t)cols * grid.rows;
    /* a box enters up to kBigCells cells, so the entry count can pass 2^31
     * long before n does: offsets are 64-bit, entries (box ranks) 32-bit,
     * which the caller guarantees by taking this path only for n <= INT32_MAX */
    HeapArray<int64_t> cell_start(num_cells + 1, true);
    HeapArray<int32_t> cell_fill(num_cells, true);
    if (!cell_start || !cell_fill) return -1;
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        Cells *c = &cells[i];
        if (c->c0 < 0) continue;
        c->c0 = grid.cell_of(s.x1[i], grid.lo_x, grid.cell_w, cols);
        c->c1 = grid.cell_of((double)s.x2[i] + s.offset, grid.lo_x, grid.cell_w, cols);
        c->r0 = grid.cell_of(s.y1[i], grid.lo_y, grid.cell_h, grid.rows);
        c->r1 = grid.cell_of((double)s.y2[i] + s.offset, grid.lo_y, grid.cell_h, grid.rows);
        const int64_t covered = (int64_t)(c->c1 - c->c0 + 1) * (c->r1 - c->r0 + 1);
        c->big = covered > kBigCells;
        if (c->big) continue;
        for (int32_t r = c->r0; r <= c->r1; ++r)
            for (int32_t q = c->c0; q <= c->c1; ++q) ++cell_start[(int64_t)r * cols + q + 1];
        total += covered;
    }
    for (int64_t k = 0; k < num_cells; ++k) cell_start[k + 1] += cell_start[k];
    HeapArray<int32_t> entries(total);
    if (!entries) return -1;

    int64_t kept = 0, num_big = 0;
    for (int64_t j = 0; j < n; ++j) {
        const Cells *c = &cells[j];
        int suppressed = 0;
        if (c->c0 >= 0) {
            if (c->big) {
                for (int64_t k = 0; k < kept && !suppressed; ++k)
                    suppressed = cells[kept_rank[k]].c0 >= 0 && s.suppresses(kept_rank[k], j);
            } else {
                for (int64_t k = 0; k < num_big && !suppressed; ++k)
                    suppressed = s.suppresses(big[k], j);
                for (int32_t r = c->r0; r <= c->r1 && !suppressed; ++r)
                    for (int32_t q = c->c0; q <= c->c1 && !suppressed; ++q) {
                        const int64_t cell = (int64_t)r * cols + q;
                        const int32_t *list = entries.get() + cell_start[cell];
                        for (int32_t e = 0; e < cell_fill[cell] && !suppressed; ++e)
                            suppressed = s.suppresses(list[e], j);
                    }
            }
        }
        if (suppressed) continue;
        kept_rank[kept++] = j;
        if (c->c0 < 0) continue;
        if (c->big) {
            big[num_big++] = j;
            continue;
        }
        for (int32_t r = c->r0; r <= c->r1; ++r)
            for (int32_t q = c->c0; q <= c->c1; ++q) {
                const int64_t cell = (int64_t)r * cols + q;
                entries[cell_start[cell] + cell_fill[cell]++] = (int32_t)j;
            }
    }
    return kept;
}

template <typename T>
int nms(bool reference, const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
        const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
        int64_t offset) {
    const int64_t n = boxes->shape[0];
    const T *b = (const T *)boxes->data;
    const T *sc = (const T *)scores->data;
    const int64_t *cls_in = idxs ? (const int64_t *)idxs->data : nullptr;
    int64_t *out = (int64_t *)keep->data;
    const int64_t count = n > 0 ? n : 1;
    HeapArray<ScoredIndex> order(n);
    HeapArray<T> coords(5 * count);
    HeapArray<int64_t> cls(n, true);
    HeapArray<int64_t> kept_rank(n);
    int64_t kept = -1;
    if (order && coords && cls && kept_rank) {
        score_order(sc, n, order.get());
        T *c = coords.get();
        const SortedBoxes<T> s = {n,         c,         c + count,
                                  c + 2 * count, c + 3 * count, c + 4 * count,
                                  cls.get(), (T)offset, mmd_threshold_below<T>(iou_threshold)};
        for (int64_t i = 0; i < n; ++i) {
            const T *box = b + 4 * order[i].index;
            s.x1[i] = box[0];
            s.y1[i] = box[1];
            s.x2[i] = box[2];
            s.y2[i] = box[3];
            s.area[i] = mmd_box_area(box, s.offset);
            if (cls_in) s.cls[i] = cls_in[order[i].index];
        }
        kept = (reference || !(iou_threshold >= 0) || n > INT32_MAX)
                   ? suppress_linear(s, kept_rank.get())
                   : suppress_grid(s, kept_rank.get());
        for (int64_t k = 0; k < kept; ++k) out[k] = order[kept_rank[k]].index;
    }
    if (kept < 0) return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)n);
    *(int64_t *)num_kept->data = kept;
    return MMD_OK;
}

int nms_run(bool reference, const mmd_tensor *boxes, const mmd_tensor *scores,
            const mmd_tensor *idxs, const mmd_tensor *keep, const mmd_tensor *num_kept,
            double iou_threshold, int64_t offset) {
    int s = mmd_nms_check(boxes, scores, idxs, keep, num_kept, iou_threshold, offset,
                          MMD_FLOAT32_64);
    if (s) return s;
    if (boxes->dtype == MMD_FLOAT32)
        return nms<float>(reference, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
    return nms<double>(reference, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
}

/* default: a grid of kept boxes (for thresholds >= 0); reference: the
 * O(kept * n) definition. */
int nms_cpu(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
            const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
            int64_t offset, const mmd_context *ctx) {
    (void)ctx;
    return nms_run(false, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
}

int nms_cpu_reference(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                      const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                      int64_t offset, const mmd_context *ctx) {
    (void)ctx;
    return nms_run(true, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
}

}  // namespace

MMD_REGISTRATIONS(cpu, nms) {
    MMD_REGISTER_DEVICE_IMPL(nms_impl, CPU, DEFAULT, nms_cpu);
    MMD_REGISTER_DEVICE_IMPL(nms_impl, CPU, REFERENCE, nms_cpu_reference);
}
