/* nms / batched_nms on CPU. Boxes are sorted once by (score key desc, index asc), copied into
 * per-coordinate arrays in that order, and each kept box suppresses the later boxes of its
 * class in one branch-free, vectorisable pass. The typed kernels (after #else, with T / TFN
 * naming the type and the name suffix) are instantiated for float and double through
 * mmdispatch/typed.h. */
#ifndef MMD_REAL

#include <stdlib.h>

#include "mmdispatch/ops/nms.h"
#include "mmdispatch/registry.h"

typedef struct {
    uint64_t key;
    int64_t index;
} scored_index;

/* Descending key, then ascending index: a strict total order, so the
 * (unstable) qsort gives the stable order nms promises. */
static int compare_scored(const void *a, const void *b) {
    const scored_index *x = (const scored_index *)a, *y = (const scored_index *)b;
    if (x->key != y->key) return x->key < y->key ? 1 : -1;
    return (x->index > y->index) - (x->index < y->index);
}

#define MMD_TYPED_FILE "nms.c"
#include "mmdispatch/typed.h"

int mmd_nms_check(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                  const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                  int64_t offset, unsigned float_mask) {
    if (iou_threshold != iou_threshold)
        return mmd_error(MMD_ERR_VALUE, "iou_threshold must not be NaN");
    if (offset != 0 && offset != 1)
        return mmd_error(MMD_ERR_VALUE, "offset must be 0 or 1, got %lld", (long long)offset);
    const int64_t box_shape[2] = {MMD_ANY_DIM, 4};
    int s = mmd_check_shape(boxes, "boxes", 2, box_shape);
    if (!s) s = mmd_check_dtype(boxes, "boxes", float_mask);
    if (!s) s = mmd_check_contiguous(boxes, "boxes");
    if (s) return s;
    const int64_t n[1] = {boxes->shape[0]}, one[1] = {1};
    s = mmd_check_shape(scores, "scores", 1, n);
    if (!s) s = mmd_check_same_dtype(scores, "scores", boxes, "boxes");
    if (!s) s = mmd_check_contiguous(scores, "scores");
    if (!s && idxs) s = mmd_check_shape(idxs, "idxs", 1, n);
    if (!s && idxs) s = mmd_check_dtype(idxs, "idxs", MMD_DTYPE_BIT(MMD_INT64));
    if (!s && idxs) s = mmd_check_contiguous(idxs, "idxs");
    if (!s) s = mmd_check_shape(keep, "keep", 1, n);
    if (!s) s = mmd_check_dtype(keep, "keep", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(keep, "keep");
    if (!s) s = mmd_check_shape(num_kept, "num_kept", 1, one);
    if (!s) s = mmd_check_dtype(num_kept, "num_kept", MMD_DTYPE_BIT(MMD_INT64));
    return s;
}

static int nms_run(int reference, const mmd_tensor *boxes, const mmd_tensor *scores,
                   const mmd_tensor *idxs, const mmd_tensor *keep, const mmd_tensor *num_kept,
                   double iou_threshold, int64_t offset) {
    int s = mmd_nms_check(boxes, scores, idxs, keep, num_kept, iou_threshold, offset,
                          MMD_FLOAT32_64);
    if (s) return s;
    if (boxes->dtype == MMD_FLOAT32)
        return nms_f32(reference, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
    return nms_f64(reference, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
}

/* default: a grid of kept boxes (for thresholds >= 0); reference: the
 * O(kept * n) definition. */
static int nms_cpu(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                   const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                   int64_t offset, const mmd_context *ctx) {
    (void)ctx;
    return nms_run(0, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
}

static int nms_cpu_reference(const mmd_tensor *boxes, const mmd_tensor *scores,
                             const mmd_tensor *idxs, const mmd_tensor *keep,
                             const mmd_tensor *num_kept, double iou_threshold, int64_t offset,
                             const mmd_context *ctx) {
    (void)ctx;
    return nms_run(1, boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
}

#include "mmdispatch_generated.h"

MMD_REGISTRATIONS(cpu, nms) {
    MMD_REGISTER_DEVICE_IMPL(nms_impl, CPU, DEFAULT, nms_cpu);
    MMD_REGISTER_DEVICE_IMPL(nms_impl, CPU, REFERENCE, nms_cpu_reference);
}

#else /* typed kernel, instantiated above for float and double */
#define T MMD_REAL
#define TFN MMD_FN

/* Boxes in visiting order, one array per coordinate. */
typedef struct {
    int64_t n;
    T *x1, *y1, *x2, *y2, *area;
    int64_t *cls;   /* class of each box; all 0 for plain nms */
    T offset, threshold;
} TFN(sorted_boxes);

static inline int TFN(suppresses)(const TFN(sorted_boxes) *s, int64_t k, int64_t j) {
    const T inter = TFN(mmd_overlap_1d)(s->x1[k], s->x2[k], s->x1[j], s->x2[j], s->offset) *
                    TFN(mmd_overlap_1d)(s->y1[k], s->y2[k], s->y1[j], s->y2[j], s->offset);
    const T iou = TFN(mmd_box_ratio)(inter, s->area[k] + s->area[j] - inter);
    return (iou > s->threshold) & (s->cls[k] == s->cls[j]);
}

/* The definition: each kept box suppresses every later box it overlaps,
 * one branch-free pass per kept box. O(kept * n); any threshold. */
static int64_t TFN(suppress_linear)(const TFN(sorted_boxes) *s, int64_t *kept_rank) {
    unsigned char *removed = (unsigned char *)calloc((size_t)(s->n > 0 ? s->n : 1), 1);
    if (!removed) return -1;
    int64_t kept = 0;
    for (int64_t i = 0; i < s->n; ++i) {
        if (removed[i]) continue;
        kept_rank[kept++] = i;
        for (int64_t j = i + 1; j < s->n; ++j) removed[j] |= (unsigned char)TFN(suppresses)(s, i, j);
    }
    free(removed);
    return kept;
}

/* Grid cells [c0, c1] x [r0, r1] a box may overlap; c0 < 0: the box has an
 * empty extent (x2 + offset <= x1, y2 + offset <= y1, or NaN), so its
 * intersection with any box is 0 and, for a threshold >= 0, it neither
 * suppresses nor is suppressed. */
typedef struct {
    int32_t c0, c1, r0, r1;
    int big; /* covers more than kBigCells cells: kept out of the grid */
} TFN(cells);

static inline int32_t TFN(cell_of)(double v, double lo, double size, int32_t count) {
    const double c = floor((v - lo) / size);
    /* NaN (inf - inf, when no box is finite and the grid is one cell) goes
     * to cell 0: converting it to an integer would be undefined */
    return c >= count ? count - 1 : (c >= 0 ? (int32_t)c : 0);
}

/* Same decisions as suppress_linear for thresholds >= 0, where only boxes
 * with a positive intersection can suppress each other: kept boxes are
 * entered in a uniform grid, and each box is tested only against the kept
 * boxes sharing a cell with it (boxes covering many cells, e.g. with
 * infinite coordinates, are tested against every kept box). O(n * local). */
static int64_t TFN(suppress_grid)(const TFN(sorted_boxes) *s, int64_t *kept_rank) {
    enum { kBigCells = 64, kMaxSide = 1024 };
    const int64_t n = s->n;
    const size_t count = (size_t)(n > 0 ? n : 1);
    TFN(cells) *cells = (TFN(cells) *)malloc(count * sizeof *cells);
    int64_t *big = (int64_t *)malloc(count * sizeof *big);      /* kept big boxes */
    int64_t kept = -1, num_big = 0;
    /* a box enters up to kBigCells cells, so the entry count can pass 2^31
     * long before n does: offsets are 64-bit, entries (box ranks) 32-bit,
     * which the caller guarantees by taking this path only for n <= INT32_MAX */
    int64_t *cell_start = NULL;
    int32_t *cell_fill = NULL, *entries = NULL;
    if (!cells || !big) goto done;

    /* grid over the finite extents, cells about the mean box size */
    double lo_x = INFINITY, hi_x = -INFINITY, lo_y = INFINITY, hi_y = -INFINITY;
    double sum_w = 0, sum_h = 0;
    int64_t finite = 0;
    for (int64_t i = 0; i < n; ++i) {
        const double ax = s->x1[i], bx = (double)s->x2[i] + s->offset;
        const double ay = s->y1[i], by = (double)s->y2[i] + s->offset;
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
    int32_t cols = 1, rows = 1;
    double cell_w = 1, cell_h = 1;
    if (finite > 0) {
        const double mean_w = sum_w / (double)finite, mean_h = sum_h / (double)finite;
        const double span_x = hi_x - lo_x, span_y = hi_y - lo_y;
        double want_x = mean_w > 0 ? ceil(span_x / mean_w) : 1;
        double want_y = mean_h > 0 ? ceil(span_y / mean_h) : 1;
        want_x = want_x < 1 ? 1 : (want_x > kMaxSide ? kMaxSide : want_x);
        want_y = want_y < 1 ? 1 : (want_y > kMaxSide ? kMaxSide : want_y);
        cols = (int32_t)want_x;
        rows = (int32_t)want_y;
        if (isfinite(span_x) && span_x > 0) cell_w = span_x / cols; else cols = 1;
        if (isfinite(span_y) && span_y > 0) cell_h = span_y / rows; else rows = 1;
    }
    const int64_t num_cells = (int64_t)cols * rows;
    cell_start = (int64_t *)calloc((size_t)num_cells + 1, sizeof *cell_start);
    cell_fill = (int32_t *)calloc((size_t)num_cells, sizeof *cell_fill);
    if (!cell_start || !cell_fill) goto done;
    int64_t total = 0;
    for (int64_t i = 0; i < n; ++i) {
        TFN(cells) *c = &cells[i];
        if (c->c0 < 0) continue;
        c->c0 = TFN(cell_of)(s->x1[i], lo_x, cell_w, cols);
        c->c1 = TFN(cell_of)((double)s->x2[i] + s->offset, lo_x, cell_w, cols);
        c->r0 = TFN(cell_of)(s->y1[i], lo_y, cell_h, rows);
        c->r1 = TFN(cell_of)((double)s->y2[i] + s->offset, lo_y, cell_h, rows);
        const int64_t covered = (int64_t)(c->c1 - c->c0 + 1) * (c->r1 - c->r0 + 1);
        c->big = covered > kBigCells;
        if (c->big) continue;
        for (int32_t r = c->r0; r <= c->r1; ++r)
            for (int32_t q = c->c0; q <= c->c1; ++q) ++cell_start[(int64_t)r * cols + q + 1];
        total += covered;
    }
    for (int64_t k = 0; k < num_cells; ++k) cell_start[k + 1] += cell_start[k];
    entries = (int32_t *)malloc((size_t)(total > 0 ? total : 1) * sizeof *entries);
    if (!entries) goto done;

    kept = 0;
    for (int64_t j = 0; j < n; ++j) {
        const TFN(cells) *c = &cells[j];
        int suppressed = 0;
        if (c->c0 >= 0) {
            if (c->big) {
                for (int64_t k = 0; k < kept && !suppressed; ++k)
                    suppressed = cells[kept_rank[k]].c0 >= 0 && TFN(suppresses)(s, kept_rank[k], j);
            } else {
                for (int64_t k = 0; k < num_big && !suppressed; ++k)
                    suppressed = TFN(suppresses)(s, big[k], j);
                for (int32_t r = c->r0; r <= c->r1 && !suppressed; ++r)
                    for (int32_t q = c->c0; q <= c->c1 && !suppressed; ++q) {
                        const int64_t cell = (int64_t)r * cols + q;
                        const int32_t *list = entries + cell_start[cell];
                        for (int32_t e = 0; e < cell_fill[cell] && !suppressed; ++e)
                            suppressed = TFN(suppresses)(s, list[e], j);
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
done:
    free(cells);
    free(big);
    free(cell_start);
    free(cell_fill);
    free(entries);
    return kept;
}

static int TFN(nms)(int reference, const mmd_tensor *boxes, const mmd_tensor *scores,
                    const mmd_tensor *idxs, const mmd_tensor *keep, const mmd_tensor *num_kept,
                    double iou_threshold, int64_t offset) {
    const int64_t n = boxes->shape[0];
    const T *b = (const T *)boxes->data;
    const T *sc = (const T *)scores->data;
    const int64_t *cls_in = idxs ? (const int64_t *)idxs->data : NULL;
    int64_t *out = (int64_t *)keep->data;
    const size_t count = (size_t)(n > 0 ? n : 1);
    scored_index *order = (scored_index *)malloc(count * sizeof *order);
    T *coords = (T *)malloc(5 * count * sizeof *coords);
    int64_t *cls = (int64_t *)calloc(count, sizeof *cls);
    int64_t *kept_rank = (int64_t *)malloc(count * sizeof *kept_rank);
    int64_t kept = -1;
    if (order && coords && cls && kept_rank) {
        for (int64_t i = 0; i < n; ++i) {
            order[i].key = TFN(mmd_score_key)(sc[i]);
            order[i].index = i;
        }
        qsort(order, (size_t)n, sizeof *order, compare_scored);
        TFN(sorted_boxes) s = {n, coords, coords + count, coords + 2 * count, coords + 3 * count,
                               coords + 4 * count, cls, (T)offset,
                               TFN(mmd_threshold_below)(iou_threshold)};
        for (int64_t i = 0; i < n; ++i) {
            const T *box = b + 4 * order[i].index;
            s.x1[i] = box[0];
            s.y1[i] = box[1];
            s.x2[i] = box[2];
            s.y2[i] = box[3];
            s.area[i] = TFN(mmd_box_area)(box, s.offset);
            if (cls_in) cls[i] = cls_in[order[i].index];
        }
        kept = (reference || !(iou_threshold >= 0) || n > INT32_MAX)
                   ? TFN(suppress_linear)(&s, kept_rank)
                   : TFN(suppress_grid)(&s, kept_rank);
        for (int64_t k = 0; k < kept; ++k) out[k] = order[kept_rank[k]].index;
    }
    free(order);
    free(coords);
    free(cls);
    free(kept_rank);
    if (kept < 0) return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)n);
    *(int64_t *)num_kept->data = kept;
    return MMD_OK;
}

#undef T
#undef TFN
#endif
