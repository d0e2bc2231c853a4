/* The CPU device module: always available. */
#include <stdio.h>

#ifdef _OPENMP
#include <omp.h>
#endif

int mmd_cpu_init(char *status, size_t size) {
#ifdef _OPENMP
    snprintf(status, size, "available; OpenMP, up to %d threads", omp_get_max_threads());
#else
    snprintf(status, size, "available; single-threaded (built without OpenMP)");
#endif
    return 0;
}
