/* When a CPU kernel forks OpenMP threads. */
#ifndef MMDISPATCH_PARALLEL_H
#define MMDISPATCH_PARALLEL_H

#include <stdint.h>

/* Whether `items` independent items of `work` elementary steps in all are
 * worth a parallel region: forking and joining the team costs about as much
 * as a few thousand steps, and a single item cannot be shared. Small calls
 * then run serially without entering the OpenMP runtime at all. */
static inline int mmd_worth_threads(int64_t items, int64_t work) {
    return items > 1 && work >= 4096;
}

#endif
