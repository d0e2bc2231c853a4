/* The CPU device module: always available; its kernels finish before the
 * call returns, so there is nothing to wait for. */
#include <stdio.h>

#ifdef _OPENMP
#include <omp.h>
#endif

int mmd_cpu_init(char *status, size_t size, int *device_count) {
    *device_count = 1;
#ifdef _OPENMP
    snprintf(status, size, "available; OpenMP, up to %d threads", omp_get_max_threads());
#else
    snprintf(status, size, "available; single-threaded (built without OpenMP)");
#endif
    return 0;
}

int mmd_cpu_synchronize(int device_id) {
    (void)device_id;
    return 0;
}
