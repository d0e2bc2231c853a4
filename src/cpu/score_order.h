/* What the CPU nms kernels (nms.cpp, nms_rotated.cpp) share: the visiting
 * order (descending score key, then ascending index). */
#ifndef MMDISPATCH_CPU_SCORE_ORDER_H
#define MMDISPATCH_CPU_SCORE_ORDER_H

#include <stdint.h>
#include <stdlib.h>

#include "heap_array.h"
#include "mmdispatch/ops/boxes.h"

namespace {

struct ScoredIndex {
    uint64_t key;
    int64_t index;
};

/* Descending key, then ascending index: a strict total order, so the
 * (unstable) qsort gives the stable order nms promises. */
int compare_scored(const void *a, const void *b) {
    const ScoredIndex *x = (const ScoredIndex *)a, *y = (const ScoredIndex *)b;
    if (x->key != y->key) return x->key < y->key ? 1 : -1;
    return (x->index > y->index) - (x->index < y->index);
}

/* order[0:n]: the indices of `scores` in visiting order. */
template <typename T> void score_order(const T *scores, int64_t n, ScoredIndex *order) {
    for (int64_t i = 0; i < n; ++i) {
        order[i].key = mmd_score_key(scores[i]);
        order[i].index = i;
    }
    qsort(order, (size_t)n, sizeof(ScoredIndex), compare_scored);
}

}  // namespace

#endif
