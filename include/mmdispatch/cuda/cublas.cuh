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

/* For each of `batches` products j: C_j (m x n, row-major, leading
 * dimension ldc) = a_j x b_j + beta * C_j on `stream` of the current
 * device, where a_j (m x k) and b_j (k x n) are views (element (i, l) of
 * a_j at a[j * a_batch + i * a_row + l * a_col]) with one unit stride each,
 * and C_j starts at c + j * c_batch (a stride of 0 shares an operand; the
 * C_j must not overlap). One call (cuBLAS's strided batched product where
 * batches > 1). True when cuBLAS did it; false, having written nothing,
 * where the process has no cuBLAS (or none with batched products, for
 * batches > 1) or cuBLAS cannot take these operands (sizes past 32 bits,
 * a view with no unit stride): the caller then computes it itself. tf32:
 * float products may take cuBLAS's TF32 tensor-op math (on devices with
 * TF32, as torch's products do under its float32 matmul precision "high";
 * else cuBLAS's default math, IEEE float32); double products ignore it. */
bool cublas_gemm(cudaStream_t stream, int64_t batches, int64_t m, int64_t n, int64_t k,
                 const float *a, int64_t a_row, int64_t a_col, int64_t a_batch, const float *b,
                 int64_t b_row, int64_t b_col, int64_t b_batch, float beta, float *c,
                 int64_t ldc, int64_t c_batch, bool tf32);
bool cublas_gemm(cudaStream_t stream, int64_t batches, int64_t m, int64_t n, int64_t k,
                 const double *a, int64_t a_row, int64_t a_col, int64_t a_batch,
                 const double *b, int64_t b_row, int64_t b_col, int64_t b_batch, double beta,
                 double *c, int64_t ldc, int64_t c_batch, bool tf32);

}  // namespace mmd_cuda

#endif
