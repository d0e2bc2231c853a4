/* nms_rotated / batched_nms_rotated on CPU. Boxes are sorted once by
 * (score key desc, index asc) and made ready for the polygon once each
 * (corners, diagonal, area: mmd_rbox_prepare). For thresholds >= 0 each box
 * then meets only the kept boxes whose bounding rectangles meet its own
 * (rotated_bounds, nms_grid.h), and a pair whose area ratio is below the
 * threshold is decided without its polygon; otherwise every kept box tests
 * every later box. The decisions are those of box_iou_rotated's values
 * either way. */
#include "mmdispatch/ops/nms_rotated.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "nms_grid.h"
#include "score_order.h"

namespace {

/* Boxes in visiting order, for nms_grid.h. */
template <typename T> struct SortedRotatedBoxes {
    int64_t n;
    const mmd_rbox_shape *shape;
    const double *bounds;   /* x0, y0, x1, y1 per box (rotated_bounds) */
    const int64_t *cls;     /* class of each box; all 0 for plain nms_rotated */
    T threshold;

    int suppresses(int64_t k, int64_t j) const {
        return cls[k] == cls[j] && mmd_rotated_suppresses(shape[k], shape[j], threshold);
    }

    bool extent(int64_t i, double *x0, double *y0, double *x1, double *y1) const {
        const double *b = bounds + 4 * i;
        *x0 = b[0];
        *y0 = b[1];
        *x1 = b[2];
        *y1 = b[3];
        return *x0 == *x0;
    }
};

/* How a box may meet others (an extent for nms_grid.h). */
enum class Reach { none, everywhere, bounded };

/* none: the box's intersection with any box is 0 or undefined (zero area,
 * NaN, infinite, a negative side), so at a threshold >= 0 it neither
 * suppresses nor is suppressed; everywhere: so large or so far out that
 * squared distances could overflow; else bounded. */
Reach reach_of(const mmd_rbox_shape &shape) {
    if (!shape.defined || !(shape.area > 0)) return Reach::none;
    if (!(shape.diagonal < 0x1p500 && fabs(shape.cx) < 0x1p500 && fabs(shape.cy) < 0x1p500))
        return Reach::everywhere;
    return Reach::bounded;
}

/* Rectangles around the boxes (x0, y0, x1, y1 each; x0 = NaN: Reach::none)
 * such that boxes whose rectangles do not meet cannot suppress each other.
 * Two boxes within reach (their centres no farther apart than their half
 * diagonals, the test that begins mmd_rbox_intersection) have their corners
 * computed to within a few ulps of the largest diagonal D. When every
 * bounded box's sides are at least 2^-30 D, the polygons are then true to
 * the boxes, and boxes whose bounding rectangles, widened by 2^-30 D, do
 * not meet have an intersection of 0. Otherwise a corner may vanish in the
 * rounding and a polygon be anything: then each box gets the square around
 * its circumscribed circle, outside which the distance test alone gives 0. */
void rotated_bounds(const mmd_rbox_shape *shapes, int64_t n, double *out) {
    double largest = 0;
    for (int64_t i = 0; i < n; ++i)
        if (reach_of(shapes[i]) == Reach::bounded && shapes[i].diagonal > largest)
            largest = shapes[i].diagonal;
    bool true_polygons = true;
    for (int64_t i = 0; i < n && true_polygons; ++i)
        true_polygons = reach_of(shapes[i]) != Reach::bounded ||
                        shapes[i].area >= 0x1p-30 * largest * shapes[i].diagonal;
    for (int64_t i = 0; i < n; ++i) {
        const mmd_rbox_shape &shape = shapes[i];
        double *o = out + 4 * i;
        switch (reach_of(shape)) {
        case Reach::none:
            o[0] = o[1] = o[2] = o[3] = NAN;
            continue;
        case Reach::everywhere:
            o[0] = o[1] = -INFINITY;
            o[2] = o[3] = INFINITY;
            continue;
        case Reach::bounded:
            break;
        }
        double half_w = 0.5 * shape.diagonal, half_h = half_w;
        if (true_polygons) {
            half_w = half_h = 0;
            for (int k = 0; k < 4; ++k) {
                half_w = fmax(half_w, fabs(shape.corner_x[k]));
                half_h = fmax(half_h, fabs(shape.corner_y[k]));
            }
        }
        const double margin = 0x1p-30 * (fabs(shape.cx) + fabs(shape.cy) + largest);
        o[0] = shape.cx - half_w - margin;
        o[1] = shape.cy - half_h - margin;
        o[2] = shape.cx + half_w + margin;
        o[3] = shape.cy + half_h + margin;
    }
}

/* steps a pair test costs: most pairs whose rectangles meet are decided by
 * their areas, the others take a polygon of a few hundred */
constexpr int64_t kRotatedPairWork = 128;

template <typename T>
int nms_rotated(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                bool clockwise) {
    const int64_t n = boxes->shape[0];
    const T *b = (const T *)boxes->data;
    const int64_t *cls_in = idxs ? (const int64_t *)idxs->data : nullptr;
    HeapArray<ScoredIndex> order(n);
    HeapArray<mmd_rbox_shape> shape(n);
    HeapArray<double> bounds(4 * (n > 0 ? n : 1));
    HeapArray<int64_t> cls(n, true);
    HeapArray<int64_t> kept_rank(n);
    int64_t kept = -1;
    if (order && shape && bounds && cls && kept_rank) {
        score_order((const T *)scores->data, n, order.get());
        for (int64_t k = 0; k < n; ++k) {
            shape[k] = mmd_rbox_shape_at(b, order[k].index, clockwise);
            if (cls_in) cls[k] = cls_in[order[k].index];
        }
        rotated_bounds(shape.get(), n, bounds.get());
        const SortedRotatedBoxes<T> s = {n, shape.get(), bounds.get(), cls.get(),
                                         mmd_threshold_below<T>(iou_threshold)};
        kept = (!(iou_threshold >= 0) || n > INT32_MAX)
                   ? suppress_linear(s, kept_rank.get())
                   : suppress_grid(s, kept_rank.get(), kRotatedPairWork);
        int64_t *out = (int64_t *)keep->data;
        for (int64_t k = 0; k < kept; ++k) out[k] = order[kept_rank[k]].index;
    }
    if (kept < 0) return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)n);
    *(int64_t *)num_kept->data = kept;
    return MMD_OK;
}

int nms_rotated_cpu(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                    const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                    int clockwise, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_nms_rotated_check(boxes, scores, idxs, keep, num_kept, iou_threshold,
                                  MMD_FLOAT32_64);
    if (s) return s;
    if (boxes->dtype == MMD_FLOAT32)
        return nms_rotated<float>(boxes, scores, idxs, keep, num_kept, iou_threshold,
                                  clockwise != 0);
    return nms_rotated<double>(boxes, scores, idxs, keep, num_kept, iou_threshold,
                               clockwise != 0);
}

}  // namespace

MMD_REGISTRATIONS(cpu, nms_rotated) {
    MMD_REGISTER_DEVICE_IMPL(nms_rotated_impl, CPU, DEFAULT, nms_rotated_cpu);
}
