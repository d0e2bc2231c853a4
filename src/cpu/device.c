/* The CPU device module: always available; its kernels finish before the
 * call returns, so there is nothing to wait for, and they keep no memory
 * between calls, so there is nothing to release. */
#include <stdio.h>

#include "mmdispatch/parallel.h"

int mmd_cpu_init(char *status, size_t size, int *device_count) {
    *device_count = 1;
    const int threads = mmd_max_threads();
    snprintf(status, size, "available; up to %d thread%s (OMP_NUM_THREADS or the CPUs "
             "available)", threads, threads == 1 ? "" : "s");
    return 0;
}

int mmd_cpu_synchronize(int device_id) {
    (void)device_id;
    return 0;
}

int mmd_cpu_empty_cache(int device_id) {
    (void)device_id;
    return 0;
}
