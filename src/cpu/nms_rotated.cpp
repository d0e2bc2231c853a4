/* nms_rotated / batched_nms_rotated on CPU. Boxes are sorted once by
 * (score key desc, index asc); each kept box then tests the later boxes
 * of its class not yet removed, shared out over the worker pool when many
 * are left (each later box is marked by one thread only: the same
 * decisions whatever the threads). For thresholds >= 0, boxes farther
 * apart than their half diagonals have IoU 0 and are skipped without the
 * polygon. */
#include "mmdispatch/ops/nms_rotated.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "score_order.h"

namespace {

template <typename T>
int nms_rotated(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                bool clockwise) {
    const int64_t n = boxes->shape[0];
    const T *b = (const T *)boxes->data;
    const int64_t *cls_in = idxs ? (const int64_t *)idxs->data : nullptr;
    HeapArray<ScoredIndex> order(n);
    HeapArray<mmd_rbox> sorted(n);
    HeapArray<double> reach(n);   /* half diagonal */
    HeapArray<int64_t> cls(n, true);
    HeapArray<unsigned char> removed(n, true);
    if (!order || !sorted || !reach || !cls || !removed)
        return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)n);
    score_order((const T *)scores->data, n, order.get());
    for (int64_t k = 0; k < n; ++k) {
        const T *box = b + 5 * order[k].index;
        sorted[k] = mmd_rbox{(double)box[0], (double)box[1], (double)box[2], (double)box[3],
                             (double)box[4]};
        reach[k] = 0.5 * sqrt(sorted[k].w * sorted[k].w + sorted[k].h * sorted[k].h);
        if (cls_in) cls[k] = cls_in[order[k].index];
    }
    const T threshold = mmd_threshold_below<T>(iou_threshold);
    const bool far_is_kept = iou_threshold >= 0;   /* IoU 0 suppresses nothing */
    int64_t *out = (int64_t *)keep->data, kept = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (removed[i]) continue;
        out[kept++] = order[i].index;
        const int64_t later = n - i - 1;
        mmd_parallel_for(later, mmd_even_chunk(later), mmd_worth_threads(later, 16 * later),
                         [&](int64_t begin, int64_t end) {
            const mmd_rbox &a = sorted[i];
            for (int64_t j = i + 1 + begin; j < i + 1 + end; ++j) {
                if (removed[j] || cls[j] != cls[i]) continue;
                if (far_is_kept) {
                    const double dx = sorted[j].cx - a.cx, dy = sorted[j].cy - a.cy;
                    const double r = reach[i] + reach[j];
                    if (dx * dx + dy * dy > r * r) continue;
                }
                if (mmd_rotated_suppresses(a, sorted[j], clockwise, threshold)) removed[j] = 1;
            }
            return (int)MMD_OK;
        });
    }
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
