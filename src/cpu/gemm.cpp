/* Matrix products for the CPU kernels (mmdispatch/gemm.h): the process's
 * BLAS when one is loaded, else a blocked product on the worker pool. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <limits.h>
#include <link.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mmdispatch/gemm.h"
#include "mmdispatch/parallel.h"

namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };

/* cblas_?gemm with 64-bit (ILP64) or 32-bit (LP64) indices */
template <typename T>
using Gemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, T, const T *, int64_t,
                        const T *, int64_t, T, T *, int64_t);
template <typename T>
using Gemm32 = void (*)(int, int, int, int, int, int, T, const T *, int, const T *, int, T, T *,
                        int);

struct Blas {
    Gemm64<float> s64 = nullptr;
    Gemm64<double> d64 = nullptr;
    Gemm32<float> s32 = nullptr;
    Gemm32<double> d32 = nullptr;
    char name[256] = "mmdispatch's own";
};

Blas g_blas;
pthread_once_t g_blas_once = PTHREAD_ONCE_INIT;

/* (single, double, 64-bit indices): the names BLAS libraries export */
struct Names {
    const char *s, *d;
    bool ilp64;
};
const Names kNames[] = {
    {"scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", true},   /* numpy's and scipy's wheels */
    {"cblas_sgemm64_", "cblas_dgemm64_", true},
    {"cblas_sgemm", "cblas_dgemm", false},
};

bool take_from(void *handle, const char *library) {
    for (const Names &n : kNames) {
        void *s = dlsym(handle, n.s), *d = dlsym(handle, n.d);
        if (s == nullptr || d == nullptr) continue;
        if (n.ilp64) {
            g_blas.s64 = (Gemm64<float>)s;
            g_blas.d64 = (Gemm64<double>)d;
        } else {
            g_blas.s32 = (Gemm32<float>)s;
            g_blas.d32 = (Gemm32<double>)d;
        }
        const char *base = strrchr(library, '/');
        snprintf(g_blas.name, sizeof g_blas.name, "%s (%s, %s indices)", n.s,
                 base ? base + 1 : library, n.ilp64 ? "64-bit" : "32-bit");
        return true;
    }
    return false;
}

/* A loaded library whose file name says BLAS: look for gemm in it. */
int visit(struct dl_phdr_info *info, size_t, void *found) {
    const char *path = info->dlpi_name;
    if (path == nullptr || *path == '\0') return 0;
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    if (strstr(base, "blas") == nullptr && strstr(base, "mkl_rt") == nullptr) return 0;
    void *handle = dlopen(path, RTLD_LAZY | RTLD_NOLOAD);
    if (handle == nullptr) return 0;
    const bool ok = take_from(handle, path);
    dlclose(handle);   /* still loaded by whoever loaded it */
    *(bool *)found = ok;
    return ok;
}

void find_blas() {
    const char *setting = getenv("MMDISPATCH_BLAS");
    if (setting != nullptr && strcmp(setting, "none") == 0) return;
    if (take_from(RTLD_DEFAULT, "the process")) return;
    bool found = false;
    dl_iterate_phdr(visit, &found);
}

const Blas &blas() {
    pthread_once(&g_blas_once, find_blas);
    return g_blas;
}

/* op(X)[i][j] of a row-major X with leading dimension ld */
template <typename T>
inline T at(const T *x, int64_t ld, bool trans, int64_t i, int64_t j) {
    return trans ? x[j * ld + i] : x[i * ld + j];
}

/* The fallback: op(A) and op(B) copied row-major (when transposed), then
 * rows of C shared out; each row block adds k-slices of B a column block at
 * a time, so its part of C stays in cache. */
template <typename T>
void own_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T *a,
              int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc) {
    T *a_copy = nullptr, *b_copy = nullptr;
    if (trans_a && m * k > 0) {
        a_copy = (T *)malloc(sizeof(T) * m * k);
        if (a_copy != nullptr) {
            for (int64_t i = 0; i < m; ++i)
                for (int64_t p = 0; p < k; ++p) a_copy[i * k + p] = at(a, lda, true, i, p);
            a = a_copy, lda = k, trans_a = false;
        }
    }
    if (trans_b && k * n > 0) {
        b_copy = (T *)malloc(sizeof(T) * k * n);
        if (b_copy != nullptr) {
            for (int64_t p = 0; p < k; ++p)
                for (int64_t j = 0; j < n; ++j) b_copy[p * n + j] = at(b, ldb, true, p, j);
            b = b_copy, ldb = n, trans_b = false;
        }
    }
    const int64_t rows = 16, cols = 512, depth = 256;
    const int64_t row_blocks = (m + rows - 1) / rows;
    mmd_parallel_for(row_blocks, 1, mmd_worth_threads(row_blocks, m * n * (k + 1)),
                     [&](int64_t begin, int64_t end) {
        for (int64_t rb = begin; rb < end; ++rb) {
            const int64_t i0 = rb * rows, i1 = i0 + rows < m ? i0 + rows : m;
            for (int64_t i = i0; i < i1; ++i) {
                T *row = c + i * ldc;
                for (int64_t j = 0; j < n; ++j) row[j] = beta == 0 ? (T)0 : beta * row[j];
            }
            for (int64_t j0 = 0; j0 < n; j0 += cols) {
                const int64_t j1 = j0 + cols < n ? j0 + cols : n;
                for (int64_t p0 = 0; p0 < k; p0 += depth) {
                    const int64_t p1 = p0 + depth < k ? p0 + depth : k;
                    for (int64_t i = i0; i < i1; ++i) {
                        T *__restrict row = c + i * ldc;
                        for (int64_t p = p0; p < p1; ++p) {
                            const T scale = alpha * at(a, lda, trans_a, i, p);
                            if (!trans_b) {
                                const T *__restrict brow = b + p * ldb;
                                for (int64_t j = j0; j < j1; ++j) row[j] += scale * brow[j];
                            } else {
                                for (int64_t j = j0; j < j1; ++j)
                                    row[j] += scale * at(b, ldb, true, p, j);
                            }
                        }
                    }
                }
            }
        }
        return 0;
    });
    free(a_copy);
    free(b_copy);
}

template <typename T>
void gemm(Gemm64<T> g64, Gemm32<T> g32, int trans_a, int trans_b, int64_t m, int64_t n,
          int64_t k, T alpha, const T *a, int64_t lda, const T *b, int64_t ldb, T beta, T *c,
          int64_t ldc) {
    if (m == 0 || n == 0) return;
    if (k == 0) {   /* C = beta * C; a BLAS may skip this */
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? (T)0 : beta * c[i * ldc + j];
        return;
    }
    const int ta = trans_a ? kTrans : kNoTrans, tb = trans_b ? kTrans : kNoTrans;
    if (g64 != nullptr) {
        g64(kRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    const int64_t most = m > n ? (m > k ? m : k) : (n > k ? n : k);
    const int64_t lds = lda > ldb ? (lda > ldc ? lda : ldc) : (ldb > ldc ? ldb : ldc);
    if (g32 != nullptr && most <= INT_MAX && lds <= INT_MAX) {
        g32(kRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c,
            (int)ldc);
        return;
    }
    own_gemm<T>(trans_a != 0, trans_b != 0, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace

extern "C" void mmd_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                          float beta, float *c, int64_t ldc) {
    const Blas &lib = blas();
    gemm<float>(lib.s64, lib.s32, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                ldc);
}

extern "C" void mmd_dgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                          double alpha, const double *a, int64_t lda, const double *b,
                          int64_t ldb, double beta, double *c, int64_t ldc) {
    const Blas &lib = blas();
    gemm<double>(lib.d64, lib.d32, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                 ldc);
}

extern "C" const char *mmd_gemm_provider(void) { return blas().name; }
