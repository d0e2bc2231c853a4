/* Matrix products for the CPU kernels (src/cpu/gemm.cpp), as BLAS's gemm:
 *     C = alpha * op(A) op(B) + beta * C,
 * all row-major, op(X) = X or its transpose (trans_x nonzero), op(A) m x k,
 * op(B) k x n, C m x n with leading dimension ldc; beta == 0 overwrites C
 * without reading it.
 *
 * They call the BLAS already loaded into the process (numpy's OpenBLAS, or
 * any library exporting cblas_sgemm/cblas_dgemm, 64-bit or 32-bit indices),
 * found once, on the first call, the way threadpoolctl finds it; where none
 * is found, or MMDISPATCH_BLAS=none is set, our own tile products (below)
 * on the worker pool. Both are deterministic for a given thread count. */
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

/* Tile products, for kernels that make the rows of one operand a block at a
 * time on their own threads (deform_conv2d's columns) and for our own gemm:
 *
 *     out[o * ldo + p * ldp] = sum_j w[o][j] * x[p * ldx + j]   (+ bias[o])
 *
 * for o < outs and p < pixels, summed in j order (with fused multiply-adds
 * in the AVX2 and AVX-512 tiles, which GCC and clang contract by default;
 * not in the baseline's), in register tiles of pixels x
 * strip outs (mmd_tile_strip). w (w[o][j] at o * row_step + j * column_step)
 * is first packed (mmd_pack_strips) into ceil(outs / strip) strips of k rows
 * of `strip` values, zero beyond outs.
 * With `accumulate`, out += the sums instead (bias then unused). Each out
 * value is one sum, so the result does not depend on how callers share
 * pixels out over threads. The call itself is single-threaded.
 *
 * The tiles are compiled for AVX-512, AVX2+FMA and the baseline vector
 * unit; the best the CPU has is used, capped by MMDISPATCH_CPU_ISA
 * ("avx512", "avx2" or "baseline", read once; other values are ignored),
 * which tests use to run each. mmd_tiles_beat_blas() says whether the
 * chosen one is as fast as a BLAS's gemm (AVX2 and up: 78 and 107 GFLOP/s
 * a core on a Zen 4 EPYC, against OpenBLAS's 91 on one thread). */
const char *mmd_tile_isa_name(void);   /* "avx512", "avx2" or "baseline" */
int mmd_tiles_beat_blas(void);
int64_t mmd_tile_strip(int64_t elem_size);   /* sizeof(float) or sizeof(double) */
/* Pixels per call whose rows of k values stay in a core's cache while
 * every strip passes over them: a multiple of the tile's pixels. */
int64_t mmd_tile_block(int64_t k, int64_t elem_size);
void mmd_spack_strips(int64_t outs, int64_t k, float scale, const float *w, int64_t row_step,
                      int64_t column_step, float *packed);
void mmd_dpack_strips(int64_t outs, int64_t k, double scale, const double *w,
                      int64_t row_step, int64_t column_step, double *packed);
void mmd_stile_product(int64_t outs, int64_t pixels, int64_t k, const float *packed,
                       const float *x, int64_t ldx, const float *bias, int accumulate, float *out,
                       int64_t ldo, int64_t ldp);
void mmd_dtile_product(int64_t outs, int64_t pixels, int64_t k, const double *packed,
                       const double *x, int64_t ldx, const double *bias, int accumulate,
                       double *out, int64_t ldo, int64_t ldp);

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
/* The packed size of w (values) and the tile products, in T. */
template <typename T> inline int64_t mmd_packed_size(int64_t outs, int64_t k) {
    const int64_t strip = mmd_tile_strip((int64_t)sizeof(T));
    return (outs + strip - 1) / strip * strip * k;
}
inline void mmd_pack_strips(int64_t outs, int64_t k, float scale, const float *w,
                            int64_t row_step, int64_t column_step, float *packed) {
    mmd_spack_strips(outs, k, scale, w, row_step, column_step, packed);
}
inline void mmd_pack_strips(int64_t outs, int64_t k, double scale, const double *w,
                            int64_t row_step, int64_t column_step, double *packed) {
    mmd_dpack_strips(outs, k, scale, w, row_step, column_step, packed);
}
inline void mmd_tile_product(int64_t outs, int64_t pixels, int64_t k, const float *packed,
                             const float *x, int64_t ldx, const float *bias, int accumulate,
                             float *out, int64_t ldo, int64_t ldp) {
    mmd_stile_product(outs, pixels, k, packed, x, ldx, bias, accumulate, out, ldo, ldp);
}
inline void mmd_tile_product(int64_t outs, int64_t pixels, int64_t k, const double *packed,
                             const double *x, int64_t ldx, const double *bias, int accumulate,
                             double *out, int64_t ldo, int64_t ldp) {
    mmd_dtile_product(outs, pixels, k, packed, x, ldx, bias, accumulate, out, ldo, ldp);
}
#endif
#endif
