/* soft_nms / batched_soft_nms on CPU (the definition is in
 * mmdispatch/ops/soft_nms.h), on one thread (each step depends on the one
 * before). A step changes only the boxes of the selected box's class: of
 * those, a box that does not overlap it has IoU 0, weight 1, and keeps its
 * score's bits, and the min_score test of a box whose score did not change
 * gives, after the first step, what it gave before. The boxes are sorted
 * by (class, index) once; then
 *  - the grid path (classes large enough that the sum of their squared
 *    sizes passes kGridCost * n):
 *    every remaining box in an indexed binary heap (highest score key, then
 *    lowest index, on top) and in a uniform grid over the boxes' extents
 *    (nms_grid.h's layout), each list sorted by class. A step pops the top
 *    box and decays only the boxes of its class sharing a cell with it
 *    (boxes spanning many cells are met on every step; a class of at most
 *    kSmallClass boxes, or a big box, reads its whole class instead),
 *    moving each in the heap or dropping it below min_score. The first
 *    step also drops every other box below min_score, as the definition
 *    does. O(n log n + overlaps * log n).
 *  - the grouped path (small classes; and the naive method with
 *    iou_threshold <= 0, which zeroes boxes that do not overlap too): each
 *    class's boxes packed, the classes' best boxes in a heap, and per step
 *    one pass over the selected box's class: O(n log n + class * selected).
 */
#include <stdlib.h>

#include "mmdispatch/ops/soft_nms.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "heap_array.h"
#include "nms_grid.h"

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

/* The grouped path (see the top of the file), over the boxes sorted by
 * (class, index); -1 when out of memory. */
template <typename T>
int64_t soft_nms_grouped(const T *b, const T *sc, const ClassIndex *order, int64_t n, T *det,
                         int64_t *out, const MmdSoftNmsDecay<T> &decay, double min_score) {
    const int64_t count = n > 0 ? n : 1;
    HeapArray<T> values(6 * count);
    HeapArray<int64_t> ints(4 * count);   /* index, group start, group size, heap */
    HeapArray<Best> bests(n);
    if (!values || !ints || !bests) return -1;
    T *v = values.get();
    Packed<T> p = {v,         v + count,     v + 2 * count, v + 3 * count,
                   v + 4 * count, v + 5 * count, ints.get()};
    int64_t *start = ints.get() + count, *size = start + count, *heap = size + count;

    /* pack by (class, index); the first step's box is the best of all */
    int64_t groups = 0, first_group = -1;
    Best first = {0, -1, -1};
    for (int64_t k = 0; k < n; ++k) {
        const int64_t i = order[k].index;
        if (k == 0 || order[k].cls != order[k - 1].cls) {
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
    return kept;
}

/* The default path's boxes, renumbered in (class, index) order, so that a
 * class is a run of ids and every id-ordered list is sorted by class. */
template <typename T> struct Boxes {
    int64_t n;
    T *box, *area, *score;   /* 4 per id; 1 per id; 1 per id */
    int64_t *index, *cls;    /* input index and class of each id */
    MmdSoftNmsDecay<T> decay;

    /* nms_grid.h's box set: the rectangle a box's overlaps lie in (with
     * the offset added to its far sides); false for a box whose overlap
     * with itself is 0 (empty, or NaN): its IoU with every box is 0 or
     * NaN, so it neither decays nor is decayed */
    bool extent(int64_t i, double *ax, double *ay, double *bx, double *by) const {
        const T *x = box + 4 * i;
        *ax = x[0];
        *ay = x[1];
        *bx = (double)x[2] + decay.offset;
        *by = (double)x[3] + decay.offset;
        return mmd_overlap_1d(x[0], x[2], x[0], x[2], decay.offset) > 0 &&
               mmd_overlap_1d(x[1], x[3], x[1], x[3], decay.offset) > 0;
    }

    /* [lo, hi): the part of the ids list[begin:end) (null list: the ids
     * begin..end-1), sorted by class, whose class is c */
    void class_range(const int64_t *list, int64_t begin, int64_t end, int64_t c, int64_t *lo,
                     int64_t *hi) const {
        int64_t a = begin, z = end;
        while (a < z) {   /* the first of class >= c */
            const int64_t m = a + (z - a) / 2;
            if (cls[list ? list[m] : m] < c) a = m + 1; else z = m;
        }
        *lo = a;
        z = end;
        while (a < z) {   /* the first of class > c */
            const int64_t m = a + (z - a) / 2;
            if (cls[list ? list[m] : m] <= c) a = m + 1; else z = m;
        }
        *hi = a;
    }
};

/* An indexed binary heap of ids: the highest score key, then the lowest
 * input index, on top; pos[i] is id i's place, -1 when it is out. */
class BoxHeap {
  public:
    BoxHeap(int64_t n, const int64_t *index) : heap_(n), pos_(n), key_(n), index_(index) {}
    explicit operator bool() const { return heap_ && pos_ && key_; }
    int64_t size() const { return size_; }
    int64_t top() const { return heap_[0]; }
    bool contains(int64_t i) const { return pos_[i] >= 0; }

    /* the ids order[0:count] with their keys; every other id out */
    void build(const int64_t *order, int64_t count, int64_t n, const uint64_t *keys) {
        for (int64_t i = 0; i < n; ++i) pos_[i] = -1;
        for (int64_t k = 0; k < count; ++k) {
            heap_[k] = order[k];
            pos_[order[k]] = k;
            key_[order[k]] = keys[k];
        }
        size_ = count;
        for (int64_t k = size_ / 2 - 1; k >= 0; --k) down(k);
    }
    void remove(int64_t i) {
        const int64_t k = pos_[i];
        pos_[i] = -1;
        if (k == --size_) return;
        place(k, heap_[size_]);
        up(k);
        down(pos_[heap_[k]]);
    }
    void update(int64_t i, uint64_t key) {
        key_[i] = key;
        up(pos_[i]);
        down(pos_[i]);
    }

  private:
    bool above(int64_t i, int64_t j) const {
        return key_[i] > key_[j] || (key_[i] == key_[j] && index_[i] < index_[j]);
    }
    void place(int64_t k, int64_t i) {
        heap_[k] = i;
        pos_[i] = k;
    }
    void up(int64_t k) {
        const int64_t i = heap_[k];
        while (k > 0 && above(i, heap_[(k - 1) / 2])) {
            place(k, heap_[(k - 1) / 2]);
            k = (k - 1) / 2;
        }
        place(k, i);
    }
    void down(int64_t k) {
        const int64_t i = heap_[k];
        for (;;) {
            int64_t c = 2 * k + 1;
            if (c >= size_) break;
            if (c + 1 < size_ && above(heap_[c + 1], heap_[c])) ++c;
            if (!above(heap_[c], i)) break;
            place(k, heap_[c]);
            k = c;
        }
        place(k, i);
    }
    HeapArray<int64_t> heap_, pos_;
    HeapArray<uint64_t> key_;
    const int64_t *index_;
    int64_t size_ = 0;
};

/* Classes of at most this many boxes are read whole rather than through
 * the grid (fewer boxes than the selected box's cells would give). */
constexpr int64_t kSmallClass = 64;
/* What the grid path costs a box, in grouped-path box visits (measured:
 * 80 classes of 62 boxes, 2.0 ms grouped and 4.1 ms through the grid; one
 * class of 1,000 boxes, 3.8 and 1.4 ms). */
constexpr int64_t kGridCost = 128;

/* The grid path (see the top of the file), over the boxes sorted by
 * (class, index); -1 when out of memory. */
template <typename T>
int64_t soft_nms_grid(const T *b, const T *sc, const ClassIndex *sorted, int64_t n, T *det,
                      int64_t *out, const MmdSoftNmsDecay<T> &decay, double min_score) {
    HeapArray<T> values(6 * n);
    HeapArray<int64_t> ids(2 * n), order(n), stamp(n), big(n);
    HeapArray<Cells> cells(n);
    HeapArray<uint64_t> keys(n);
    if (!values || !ids || !order || !stamp || !big || !cells || !keys) return -1;
    Boxes<T> s = {n, values.get(), values.get() + 4 * n, values.get() + 5 * n,
                  ids.get(), ids.get() + n, decay};
    BoxHeap heap(n, s.index);
    if (!heap) return -1;
    Best first = {0, -1, -1};
    for (int64_t id = 0; id < n; ++id) {
        const int64_t i = sorted[id].index;
        for (int c = 0; c < 4; ++c) s.box[4 * id + c] = b[4 * i + c];
        s.area[id] = mmd_box_area(b + 4 * i, decay.offset);
        s.score[id] = sc[i];
        s.index[id] = i;
        s.cls[id] = sorted[id].cls;
        stamp[id] = -1;
        first.offer(mmd_score_key(sc[i]), i, id);
    }
    /* the grid: each box in the cells its extent covers, a big one in a
     * list of its own, one without extent in neither; ids in order, so
     * each list is sorted by class */
    const GridLayout grid = grid_layout(s, cells.get());
    const int64_t num_cells = (int64_t)grid.cols * grid.rows;
    HeapArray<int64_t> cell_start(num_cells + 1, true);
    if (!cell_start) return -1;
    HeapArray<int64_t> entries(place_in_cells(s, grid, cells.get(), cell_start.get()));
    HeapArray<int64_t> fill(num_cells, true);
    if (!entries || !fill) return -1;
    int64_t num_big = 0;
    for (int64_t id = 0; id < n; ++id) {
        const Cells *c = &cells[id];
        if (c->c0 < 0) continue;
        if (c->big) {
            big[num_big++] = id;
            continue;
        }
        enter_in_cells(*c, grid.cols, cell_start.get(), fill.get(), entries.get(), id);
    }

    int64_t kept = 0;
    for (int64_t step = 0, sel = first.slot; sel >= 0; ++step) {
        const T *a = s.box + 4 * sel;
        for (int c = 0; c < 4; ++c) det[5 * kept + c] = a[c];
        det[5 * kept + 4] = s.score[sel];
        out[kept++] = s.index[sel];
        if (step > 0) heap.remove(sel);
        const int64_t cls_a = s.cls[sel];
        /* each remaining box of the selected box's class among the ids
         * list[begin:end) (null: begin..end-1) decayed by it; after the
         * first step, moved in the heap or dropped */
        auto meet = [&](const int64_t *list, int64_t begin, int64_t end) {
            int64_t lo, hi;
            s.class_range(list, begin, end, cls_a, &lo, &hi);
            for (int64_t e = lo; e < hi; ++e) {
                const int64_t j = list ? list[e] : e;
                if (stamp[j] == step || j == sel) continue;
                stamp[j] = step;
                if (step > 0 && !heap.contains(j)) continue;
                const T before = s.score[j];
                const T after = decay.decayed(before, a, s.area[sel], s.box + 4 * j, s.area[j]);
                s.score[j] = after;
                if (step == 0) continue;
                if ((double)after < min_score)
                    heap.remove(j);
                else if (mmd_score_key(after) != mmd_score_key(before))
                    heap.update(j, mmd_score_key(after));
            }
        };
        const Cells *c = &cells[sel];
        int64_t class_lo, class_hi;
        s.class_range(nullptr, 0, n, cls_a, &class_lo, &class_hi);
        if (c->c0 >= 0 && (c->big || class_hi - class_lo <= kSmallClass)) {
            /* a big box, or a small class: every box of the class */
            meet(nullptr, class_lo, class_hi);
        } else if (c->c0 >= 0) {
            for (int32_t r = c->r0; r <= c->r1; ++r)
                for (int32_t q = c->c0; q <= c->c1; ++q) {
                    const int64_t cell = (int64_t)r * grid.cols + q;
                    meet(entries.get(), cell_start[cell], cell_start[cell + 1]);
                }
            meet(big.get(), 0, num_big);
        }
        if (step == 0) {
            /* the definition's first min_score test, of every other box */
            int64_t count = 0;
            for (int64_t j = 0; j < n; ++j)
                if (j != sel && !((double)s.score[j] < min_score)) {
                    order[count] = j;
                    keys[count++] = mmd_score_key(s.score[j]);
                }
            heap.build(order.get(), count, n, keys.get());
        }
        sel = heap.size() > 0 ? heap.top() : -1;
    }
    return kept;
}

template <typename T>
int soft_nms(const mmd_tensor *boxes, const mmd_tensor *scores, const mmd_tensor *idxs,
             const mmd_tensor *dets, const mmd_tensor *keep, const mmd_tensor *num_kept,
             double iou_threshold, double sigma, double min_score, int64_t method,
             int64_t offset) {
    const int64_t n = boxes->shape[0];
    const MmdSoftNmsDecay<T> decay = {(int)method, mmd_threshold_at_or_above<T>(iou_threshold),
                                      (T)sigma, (T)offset};
    const T *b = (const T *)boxes->data, *sc = (const T *)scores->data;
    const int64_t *cls = idxs ? (const int64_t *)idxs->data : nullptr;
    T *det = (T *)dets->data;
    int64_t *out = (int64_t *)keep->data;
    int64_t kept = -1;
    HeapArray<ClassIndex> sorted(n);
    if (sorted) {
        for (int64_t i = 0; i < n; ++i) sorted[i] = {cls ? cls[i] : 0, i};
        if (cls) qsort(sorted.get(), (size_t)n, sizeof(ClassIndex), compare_class_index);
        /* the grouped path visits about sum(class size^2) boxes, the grid
         * path costs about as much as 128 visits a box (its heap and cells):
         * small classes go quicker grouped, a large one (even among many
         * tiny ones) through the grid. The naive method zeroes boxes it does
         * not overlap when 0 >= the threshold: grouped. */
        double visits = 0;
        for (int64_t k = 0, run = 0; k < n; ++k) {
            run = k > 0 && sorted[k].cls == sorted[k - 1].cls ? run + 1 : 1;
            visits += 2.0 * (double)run - 1.0;   /* run^2 - (run - 1)^2 */
        }
        const bool grouped = (method == MMD_SOFT_NMS_NAIVE && decay.threshold <= 0) ||
                             visits <= (double)kGridCost * (double)n;
        kept = grouped ? soft_nms_grouped(b, sc, sorted.get(), n, det, out, decay, min_score)
                       : soft_nms_grid(b, sc, sorted.get(), n, det, out, decay, min_score);
    }
    if (kept < 0) return mmd_error(MMD_ERR_MEMORY, "out of memory for %lld boxes", (long long)n);
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
