/* soft_nms / batched_soft_nms on CPU (the definition is in
 * mmdispatch/ops/soft_nms.h). A selected box changes only the boxes of its
 * class, so the boxes are grouped by class (sorted by class, then index),
 * each group packed one array per coordinate, and the groups' best boxes
 * kept in a heap. The first step is the definition's: the best box of all
 * is selected, its group decayed, and every other box below min_score
 * dropped. After that a step takes the group at the top of the heap,
 * outputs its best box and makes one pass over the rest of that group
 * (decay, drop below min_score, find its next best); the
 * other groups' boxes keep their scores, so the definition's min_score test
 * of them gives what it gave before. A call costs O(n log n) for the
 * grouping, then per step the selected box's group plus O(log classes), on
 * one thread (each step depends on the one before). */
#include <stdlib.h>

#include "mmdispatch/ops/soft_nms.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "heap_array.h"

namespace {

/* A box to select: the highest score key, then the lowest index (a strict
 * order, so no result depends on the order boxes are visited in). */
struct Best {
    uint64_t key;
    int64_t index;   /* input index; -1: none */
    int64_t slot;    /* its place in the packed arrays */

    bool before(const Best &o) const {
        return o.index < 0 || (index >= 0 && (key > o.key || (key == o.key && index < o.index)));
    }
    void offer(uint64_t k, int64_t i, int64_t s) {
        const Best candidate = {k, i, s};
        if (candidate.before(*this)) *this = candidate;
    }
};

struct ClassIndex {
    int64_t cls, index;
};

int compare_class_index(const void *a, const void *b) {
    const ClassIndex *x = (const ClassIndex *)a, *y = (const ClassIndex *)b;
    if (x->cls != y->cls) return x->cls < y->cls ? -1 : 1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The boxes packed group by group; group g holds slots [start[g], start[g]
 * + size[g]), its remaining boxes. */
template <typename T> struct Packed {
    T *x1, *y1, *x2, *y2, *area, *score;
    int64_t *index;

    void move(int64_t to, int64_t from) {
        x1[to] = x1[from];
        y1[to] = y1[from];
        x2[to] = x2[from];
        y2[to] = y2[from];
        area[to] = area[from];
        score[to] = score[from];
        index[to] = index[from];
    }
};

/* Group g after box `s` (a slot of g, or -1) is selected: s removed, each
 * other box decayed by it (when `decay_by` is set) and removed when below
 * min_score (a removed box's slot takes the group's last box: the order in
 * a group does not matter, ties go by index); returns the next best. */
template <typename T>
Best pass(Packed<T> &p, int64_t start, int64_t *size, int64_t s, bool decay_by,
          const MmdSoftNmsDecay<T> &decay, double min_score) {
    T a[4] = {0, 0, 0, 0}, area_a = 0;
    int64_t end = start + *size;
    if (decay_by) {
        a[0] = p.x1[s], a[1] = p.y1[s], a[2] = p.x2[s], a[3] = p.y2[s];
        area_a = p.area[s];
    }
    if (s >= 0) p.move(s, --end);
    Best best = {0, -1, -1};
    for (int64_t j = start; j < end;) {
        T score = p.score[j];
        if (decay_by) {
            const T b[4] = {p.x1[j], p.y1[j], p.x2[j], p.y2[j]};
            score = decay.decayed(score, a, area_a, b, p.area[j]);
        }
        if ((double)score < min_score) {
            p.move(j, --end);   /* j now holds a box not yet visited */
            continue;
        }
        p.score[j] = score;
        best.offer(mmd_score_key(score), p.index[j], j);
        ++j;
    }
    *size = end - start;
    return best;
}

/* A binary heap of groups by their best box (the top: the next to select). */
struct GroupHeap {
    int64_t *heap, count;
    const Best *best;

    bool above(int64_t a, int64_t b) const { return best[heap[a]].before(best[heap[b]]); }
    void swap(int64_t a, int64_t b) {
        const int64_t t = heap[a];
        heap[a] = heap[b];
        heap[b] = t;
    }
    void down(int64_t i) {
        for (;;) {
            int64_t top = i;
            const int64_t l = 2 * i + 1, r = l + 1;
            if (l < count && above(l, top)) top = l;
            if (r < count && above(r, top)) top = r;
            if (top == i) return;
            swap(i, top);
            i = top;
        }
    }
};

template <typename T>
int soft_nms(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
             const mmd_tensor *dets, const mmd_tensor *keep, const mmd_tensor *num_kept,
             double iou_threshold, double sigma, double min_score, int64_t method,
             int64_t offset) {
    const int64_t n = boxes->shape[0];
    const T *b = (const T *)boxes->data;
    const T *sc = (const T *)scores->data;
    const int64_t *cls_in = idxs ? (const int64_t *)idxs->data : nullptr;
    T *det = (T *)dets->data;
    int64_t *out = (int64_t *)keep->data;
    const int64_t count = n > 0 ? n : 1;
    HeapArray<T> values(6 * count);
    HeapArray<int64_t> ints(4 * count);   /* index, group start, group size, heap */
    HeapArray<ClassIndex> order(idxs ? n : 0);
    HeapArray<Best> bests(n);
    if (!values || !ints || !order || !bests)
        return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)n);
    T *v = values.get();
    Packed<T> p = {v,         v + count,     v + 2 * count, v + 3 * count,
                   v + 4 * count, v + 5 * count, ints.get()};
    int64_t *start = ints.get() + count, *size = start + count, *heap = size + count;
    const MmdSoftNmsDecay<T> decay = {(int)method, mmd_threshold_at_or_above<T>(iou_threshold),
                                      (T)sigma, (T)offset};

    /* pack by (class, index); the first step's box is the best of all */
    if (idxs) {
        for (int64_t i = 0; i < n; ++i) order[i] = {cls_in[i], i};
        qsort(order.get(), (size_t)n, sizeof(ClassIndex), compare_class_index);
    }
    int64_t groups = 0, first_group = -1;
    Best first = {0, -1, -1};
    for (int64_t k = 0; k < n; ++k) {
        const int64_t i = idxs ? order[k].index : k;
        if (k == 0 || (idxs && order[k].cls != order[k - 1].cls)) {
            start[groups] = k;
            size[groups++] = 0;
        }
        ++size[groups - 1];
        const T *box = b + 4 * i;
        p.x1[k] = box[0];
        p.y1[k] = box[1];
        p.x2[k] = box[2];
        p.y2[k] = box[3];
        p.area[k] = mmd_box_area(box, decay.offset);
        p.score[k] = sc[i];
        p.index[k] = i;
        const Best before = first;
        first.offer(mmd_score_key(sc[i]), i, k);
        if (first.index != before.index) first_group = groups - 1;
    }
    int64_t kept = 0;
    Best selected = first;
    int64_t group = first_group;
    GroupHeap h = {heap, 0, bests.get()};
    while (selected.index >= 0) {
        const int64_t s = selected.slot;
        det[5 * kept] = p.x1[s];
        det[5 * kept + 1] = p.y1[s];
        det[5 * kept + 2] = p.x2[s];
        det[5 * kept + 3] = p.y2[s];
        det[5 * kept + 4] = p.score[s];
        out[kept++] = selected.index;
        bests[group] = pass(p, start[group], &size[group], s, true, decay, min_score);
        if (kept == 1) {
            /* the other groups' boxes meet min_score once, now */
            for (int64_t g = 0; g < groups; ++g) {
                if (g != group)
                    bests[g] = pass(p, start[g], &size[g], -1, false, decay, min_score);
                if (bests[g].index >= 0) heap[h.count++] = g;
            }
            for (int64_t i = h.count / 2 - 1; i >= 0; --i) h.down(i);
        } else if (bests[group].index < 0) {
            heap[0] = heap[--h.count];   /* the group is done */
            h.down(0);
        } else {
            h.down(0);
        }
        if (h.count == 0) break;
        group = heap[0];
        selected = bests[group];
    }
    *(int64_t *)num_kept->data = kept;
    return MMD_OK;
}

int soft_nms_cpu(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
                 const mmd_tensor *dets, const mmd_tensor *keep, const mmd_tensor *num_kept,
                 double iou_threshold, double sigma, double min_score, int64_t method,
                 int64_t offset, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_soft_nms_check(boxes, scores, idxs, dets, keep, num_kept, iou_threshold, sigma,
                               min_score, method, offset, MMD_FLOAT32_64);
    if (s) return s;
    if (boxes->dtype == MMD_FLOAT32)
        return soft_nms<float>(boxes, scores, idxs, dets, keep, num_kept, iou_threshold, sigma,
                               min_score, method, offset);
    return soft_nms<double>(boxes, scores, idxs, dets, keep, num_kept, iou_threshold, sigma,
                            min_score, method, offset);
}

}  // namespace

MMD_REGISTRATIONS(cpu, soft_nms) {
    MMD_REGISTER_DEVICE_IMPL(soft_nms_impl, CPU, DEFAULT, soft_nms_cpu);
}
