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

static int nms_cpu(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                   const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                   int64_t offset, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_nms_check(boxes, scores, idxs, keep, num_kept, iou_threshold, offset,
                          MMD_FLOAT32_64);
    if (s) return s;
    if (boxes->dtype == MMD_FLOAT32)
        return nms_f32(boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
    return nms_f64(boxes, scores, idxs, keep, num_kept, iou_threshold, offset);
}

#include "mmdispatch_generated.h"

MMD_REGISTRATIONS(cpu, nms) { MMD_REGISTER_DEVICE_IMPL(nms_impl, CPU, DEFAULT, nms_cpu); }

#else /* typed kernel, instantiated above for float and double */
#define T MMD_REAL
#define TFN MMD_FN

static int TFN(nms)(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                    const mmd_tensor *keep, const mmd_tensor *num_kept, double iou_threshold,
                    int64_t offset) {
    const int64_t n = boxes->shape[0];
    const T *b = (const T *)boxes->data;
    const T *sc = (const T *)scores->data;
    const int64_t *cls_in = idxs ? (const int64_t *)idxs->data : NULL;
    int64_t *out = (int64_t *)keep->data;
    const size_t count = (size_t)(n > 0 ? n : 1);
    scored_index *order = (scored_index *)malloc(count * sizeof *order);
    T *coords = (T *)malloc(5 * count * sizeof *coords);
    int64_t *cls = (int64_t *)calloc(count, sizeof *cls);
    unsigned char *removed = (unsigned char *)calloc(count, 1);
    if (!order || !coords || !cls || !removed) {
        free(order);
        free(coords);
        free(cls);
        free(removed);
        return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)n);
    }
    for (int64_t i = 0; i < n; ++i) {
        order[i].key = TFN(mmd_score_key)(sc[i]);
        order[i].index = i;
    }
    qsort(order, (size_t)n, sizeof *order, compare_scored);
    T *x1 = coords, *y1 = coords + count, *x2 = coords + 2 * count, *y2 = coords + 3 * count;
    T *area = coords + 4 * count;
    const T off = (T)offset;
    for (int64_t i = 0; i < n; ++i) {
        const T *box = b + 4 * order[i].index;
        x1[i] = box[0];
        y1[i] = box[1];
        x2[i] = box[2];
        y2[i] = box[3];
        area[i] = TFN(mmd_box_area)(box, off);
        if (cls_in) cls[i] = cls_in[order[i].index];
    }
    const T threshold = TFN(mmd_threshold_below)(iou_threshold);
    int64_t kept = 0;
    for (int64_t i = 0; i < n; ++i) {
        if (removed[i]) continue;
        out[kept++] = order[i].index;
        const T bx1 = x1[i], by1 = y1[i], bx2 = x2[i], by2 = y2[i], barea = area[i];
        const int64_t bcls = cls[i];
        for (int64_t j = i + 1; j < n; ++j) {
            const T inter = TFN(mmd_overlap_1d)(bx1, bx2, x1[j], x2[j], off) *
                            TFN(mmd_overlap_1d)(by1, by2, y1[j], y2[j], off);
            const T iou = TFN(mmd_box_ratio)(inter, barea + area[j] - inter);
            removed[j] |= (unsigned char)((iou > threshold) & (cls[j] == bcls));
        }
    }
    *(int64_t *)num_kept->data = kept;
    free(order);
    free(coords);
    free(cls);
    free(removed);
    return MMD_OK;
}

#undef T
#undef TFN
#endif
