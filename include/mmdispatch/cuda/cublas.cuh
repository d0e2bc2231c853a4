/* Matrix products through the process's cuBLAS (src/cuda/cublas.cu), as
 * the CPU kernels use the process's BLAS (src/cpu/gemm.cpp): cuBLAS is
 * taken when a library the process has already loaded exports it (torch
 * loads it with its CUDA libraries, CuPy with its first product, which
 * mmdispatch.ops.deform_conv2d asks for before a CuPy call), never loaded
 * by the kernels themselves; MMDISPATCH_CUBLAS=none leaves it alone.
 * Without it the kernels use their own products. */
#ifndef MMDISPATCH_CUDA_CUBLAS_CUH
#define MMDISPATCH_CUDA_CUBLAS_CUH

#include <stdint.h>

#include <cuda_runtime.h>

namespace mmd_cuda {

/* C (m x n, row-major, leading dimension ldc) = a x b + beta * C on
 * `stream` of the current device, where a (m x k) and b (k x n) are
 * views (element (i, j) of a at a[i * a_row + j * a_col]) with one unit
 * stride each. True when cuBLAS did it; false, having written nothing,
 * where the process has no cuBLAS or cuBLAS cannot take these operands
 * (sizes past 32 bits, a view with no unit stride): the caller then
 * computes it itself. */
bool cublas_gemm(cudaStream_t stream, int64_t m, int64_t n, int64_t k, const float *a,
                 int64_t a_row, int64_t a_col, const float *b, int64_t b_row, int64_t b_col,
                 float beta, float *c, int64_t ldc);
bool cublas_gemm(cudaStream_t stream, int64_t m, int64_t n, int64_t k, const double *a,
                 int64_t a_row, int64_t a_col, const double *b, int64_t b_row, int64_t b_col,
                 double beta, double *c, int64_t ldc);

}  // namespace mmd_cuda

#endif
