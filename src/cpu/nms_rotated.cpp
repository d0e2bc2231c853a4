/* nms_rotated / batched_nms_rotated on CPU. Boxes are sorted once by
 * (score key desc, index asc) and made ready for the polygon once each
 * (corners, diagonal, area: mmd_rbox_prepare). For thresholds >= 0 each box
 * then meets only the kept boxes whose bounding rectangles overlap its own
 * (nms_grid.h), and a pair whose area ratio is below the threshold is
 * decided without its polygon; otherwise every kept box tests every later
 * box. The decisions are those of box_iou_rotated's values either way. */
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
    const double *bounds;   /* x0, y0, x1, y1 per box; NaN x0: no extent */
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

/* The rectangle around box b's corners, widened by far more than the
 * polygon's rounding; x0 = NaN for a box whose intersection with any box
 * is 0 or undefined (zero area, NaN, infinite, a negative side), which at
 * a threshold >= 0 neither suppresses nor is suppressed. */
void rotated_bounds(const mmd_rbox &b, const mmd_rbox_shape &shape, double *out) {
    if (!shape.defined || !(shape.area > 0)) {
        out[0] = out[1] = out[2] = out[3] = NAN;
        return;
    }
    double half_w = 0, half_h = 0;
    for (int i = 0; i < 4; ++i) {
        half_w = fmax(half_w, fabs(shape.corner_x[i]));
        half_h = fmax(half_h, fabs(shape.corner_y[i]));
    }
    const double margin = 0x1p-30 * (fabs(b.cx) + fabs(b.cy) + shape.diagonal);
    out[0] = b.cx - half_w - margin;
    out[1] = b.cy - half_h - margin;
    out[2] = b.cx + half_w + margin;
    out[3] = b.cy + half_h + margin;
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
            const T *box = b + 5 * order[k].index;
            const mmd_rbox rbox = {(double)box[0], (double)box[1], (double)box[2],
                                   (double)box[3], (double)box[4]};
            shape[k] = mmd_rbox_prepare(rbox, clockwise);
            rotated_bounds(rbox, shape[k], bounds.get() + 4 * k);
            if (cls_in) cls[k] = cls_in[order[k].index];
        }
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
