/* Matrix products for the CPU kernels (src/core/gemm.c), as BLAS's gemm:
 *     C = alpha * op(A) op(B) + beta * C,
 * all row-major, op(X) = X or its transpose (trans_x nonzero), op(A) m x k,
 * op(B) k x n, C m x n with leading dimension ldc; beta == 0 overwrites C
 * without reading it.
 *
 * They call the BLAS already loaded into the process (numpy's OpenBLAS, or
 * any library exporting cblas_sgemm/cblas_dgemm, 64-bit or 32-bit indices),
 * found once, on the first call, the way threadpoolctl finds it; where none
 * is found, or MMDISPATCH_BLAS=none is set, a blocked product of our own on
 * the worker pool. Both are deterministic for a given thread count. */
#ifndef MMDISPATCH_GEMM_H
#define MMDISPATCH_GEMM_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

void mmd_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c,
               int64_t ldc);
void mmd_dgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, double alpha,
               const double *a, int64_t lda, const double *b, int64_t ldb, double beta,
               double *c, int64_t ldc);

/* The library the products call ("scipy_openblas64_ (ILP64)", ...), or
 * "mmdispatch's own" when none was found. */
const char *mmd_gemm_provider(void);

#ifdef __cplusplus
}

/* The product in T (float or double). */
inline void mmd_gemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                     const float *a, int64_t lda, const float *b, int64_t ldb, float beta,
                     float *c, int64_t ldc) {
    mmd_sgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
inline void mmd_gemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k, double alpha,
                     const double *a, int64_t lda, const double *b, int64_t ldb, double beta,
                     double *c, int64_t ldc) {
    mmd_dgemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}
#endif
#endif
