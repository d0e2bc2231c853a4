/* nms / batched_nms on CPU. Boxes are sorted once by (score key desc, index
 * asc) and copied into per-coordinate arrays in that order; then each box
 * meets only the kept boxes near it (nms_grid.h), or, in the reference
 * backend, each kept box suppresses the later boxes of its class in one
 * branch-free pass. */
#include <stdlib.h>

#include "mmdispatch/ops/nms.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "nms_grid.h"
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

    /* the box with the offset added to its far sides; a box whose overlap
     * with itself is 0 (x2 - x1 + offset <= 0 in T, or NaN) has none with
     * any box (the overlap computed in T can only shrink as the other box
     * moves its sides inward), so it meets nothing */
    bool extent(int64_t i, double *ax, double *ay, double *bx, double *by) const {
        *ax = x1[i];
        *ay = y1[i];
        *bx = (double)x2[i] + offset;
        *by = (double)y2[i] + offset;
        return mmd_overlap_1d(x1[i], x2[i], x1[i], x2[i], offset) > 0 &&
               mmd_overlap_1d(y1[i], y2[i], y1[i], y2[i], offset) > 0;
    }
};

/* steps a pair test costs (SortedBoxes::suppresses) */
constexpr int64_t kBoxPairWork = 16;

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
                   : suppress_grid(s, kept_rank.get(), kBoxPairWork);
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
