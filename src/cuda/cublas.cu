/* The process's cuBLAS for the CUDA kernels' matrix products
 * (mmdispatch/cuda/cublas.cuh). Looked up once, at the first product:
 * exported by the process itself, or by a loaded library named
 * libcublas.* (torch loads libcublas with its CUDA libraries; CuPy with its
 * first product). Nothing is loaded, so a process without cuBLAS keeps
 * the kernels' own products and pays nothing. A handle per device, made
 * at its first product and used under that device's lock (a handle takes
 * one thread at a time); its float products use cuBLAS's default math
 * (IEEE float32, as torch's products by default), or its TF32 tensor-op
 * math where the call allows it (as torch's under its float32 matmul
 * precision "high"; NVIDIA_TF32_OVERRIDE=0 still turns TF32 off), set on
 * the handle when it changes (cublasSetMathMode, cuBLAS 11 and later;
 * an older cuBLAS keeps IEEE float32). The CUDA emulator's build takes
 * the emulator's stand-in instead (switched on and off by the tests). */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE   /* RTLD_DEFAULT */
#endif
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include <mutex>

#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/cuda/cublas.cuh"
#include "mmdispatch/loaded_library.h"

namespace mmd_cuda {

namespace {

/* cuBLAS's C API: the functions used (cublas_api.h, unchanged since
 * CUDA 10; the handle is opaque, the stream a CUDA runtime stream). */
typedef void *Handle;
typedef int (*CreateFn)(Handle *);
typedef int (*SetStreamFn)(Handle, cudaStream_t);
typedef int (*SetMathModeFn)(Handle, int);
template <typename T>
using GemmFn = int (*)(Handle, int, int, int, int, int, const T *, const T *, int, const T *,
                       int, const T *, T *, int);
/* ...StridedBatched (cuBLAS 8 and later): each operand with its stride
 * between batches, then the batch count */
template <typename T>
using BatchedFn = int (*)(Handle, int, int, int, int, int, const T *, const T *, int,
                          long long, const T *, int, long long, const T *, T *, int, long long,
                          int);
enum { kOpN = 0, kOpT = 1, kStatusSuccess = 0 };
/* cublasMath_t: CUBLAS_DEFAULT_MATH, CUBLAS_TF32_TENSOR_OP_MATH */
enum { kDefaultMath = 0, kTf32Math = 3 };

struct Api {
    CreateFn create = nullptr;
    SetStreamFn set_stream = nullptr;
    SetMathModeFn set_math_mode = nullptr;   /* null: IEEE float32 products only */
    GemmFn<float> sgemm = nullptr;
    GemmFn<double> dgemm = nullptr;
    BatchedFn<float> sgemm_batched = nullptr;   /* null: products one at a time */
    BatchedFn<double> dgemm_batched = nullptr;

    template <typename T> GemmFn<T> gemm() const;
    template <typename T> BatchedFn<T> batched() const;
};
template <> GemmFn<float> Api::gemm<float>() const { return sgemm; }
template <> GemmFn<double> Api::gemm<double>() const { return dgemm; }
template <> BatchedFn<float> Api::batched<float>() const { return sgemm_batched; }
template <> BatchedFn<double> Api::batched<double>() const { return dgemm_batched; }

bool take_from(void *library, Api *api) {
    Api found;
    found.create = (CreateFn)dlsym(library, "cublasCreate_v2");
    found.set_stream = (SetStreamFn)dlsym(library, "cublasSetStream_v2");
    found.sgemm = (GemmFn<float>)dlsym(library, "cublasSgemm_v2");
    found.dgemm = (GemmFn<double>)dlsym(library, "cublasDgemm_v2");
    if (!found.create || !found.set_stream || !found.sgemm || !found.dgemm) return false;
    found.sgemm_batched = (BatchedFn<float>)dlsym(library, "cublasSgemmStridedBatched");
    found.dgemm_batched = (BatchedFn<double>)dlsym(library, "cublasDgemmStridedBatched");
    if (!found.sgemm_batched || !found.dgemm_batched)
        found.sgemm_batched = nullptr, found.dgemm_batched = nullptr;
    found.set_math_mode = (SetMathModeFn)dlsym(library, "cublasSetMathMode");
    *api = found;
    return true;
}

#ifdef MMD_CUDA_EMULATOR
extern "C" int mmd_emu_cublas_functions(void **create, void **set_stream, void **sgemm,
                                        void **dgemm, void **sgemm_batched,
                                        void **dgemm_batched, void **set_math_mode);

/* The emulator's stand-in, while the tests have it switched on (its
 * batched products null when they switch those off). */
Api api() {
    Api a;
    void *f[7];
    if (mmd_emu_cublas_functions(&f[0], &f[1], &f[2], &f[3], &f[4], &f[5], &f[6])) {
        a.create = (CreateFn)f[0];
        a.set_stream = (SetStreamFn)f[1];
        a.sgemm = (GemmFn<float>)f[2];
        a.dgemm = (GemmFn<double>)f[3];
        a.sgemm_batched = (BatchedFn<float>)f[4];
        a.dgemm_batched = (BatchedFn<double>)f[5];
        a.set_math_mode = (SetMathModeFn)f[6];
    }
    return a;
}
#else
Api g_api;
pthread_once_t g_api_once = PTHREAD_ONCE_INIT;

void find_api() {
    const char *setting = getenv("MMDISPATCH_CUBLAS");
    if (setting != nullptr && strcmp(setting, "none") == 0) return;
    if (take_from(RTLD_DEFAULT, &g_api)) return;
    /* a loaded libcublas.* (not libcublasLt.*) */
    mmd_loaded::take_from_loaded(
        [](const char *name) { return strncmp(name, "libcublas.", 10) == 0; },
        [](void *library, const char *) { return take_from(library, &g_api); });
}

Api api() {
    pthread_once(&g_api_once, find_api);
    return g_api;
}
#endif

/* Per device: its handle (made at its first product) and the lock that
 * gives it to one thread at a time; `failed` once making it failed;
 * `math` the handle's math mode (cuBLAS's default on a new handle). */
struct Device {
    std::mutex lock;
    Handle handle = nullptr;
    bool failed = false;
    int math = kDefaultMath;
};
Device g_devices[kMaxDevices];

/* How cuBLAS (column-major) reads the transpose (cols x rows) of a
 * row-major view of rows x cols with strides (row, col): its op and
 * leading dimension; false where it cannot. */
bool transpose_operand(int64_t rows, int64_t cols, int64_t row, int64_t col, int *op,
                       int64_t *ld) {
    if (col == 1 && (rows == 1 || row >= cols)) {   /* the view is the transpose's layout */
        *op = kOpN;
        *ld = rows == 1 ? (cols > 1 ? cols : 1) : row;
        return true;
    }
    if (row == 1 && (cols == 1 || col >= rows)) {   /* the view itself, column-major */
        *op = kOpT;
        *ld = cols == 1 ? (rows > 1 ? rows : 1) : col;
        return true;
    }
    return false;
}

template <typename T>
bool gemm_with(cudaStream_t stream, int64_t batches, int64_t m, int64_t n, int64_t k,
               const T *a, int64_t a_row, int64_t a_col, int64_t a_batch, const T *b,
               int64_t b_row, int64_t b_col, int64_t b_batch, T beta, T *c, int64_t ldc,
               int64_t c_batch, bool tf32) {
    if (batches <= 0 || m <= 0 || n <= 0 || k <= 0 || batches > INT_MAX) return false;
    const Api functions = api();
    const GemmFn<T> gemm = functions.gemm<T>();
    const BatchedFn<T> batched = functions.batched<T>();
    if (gemm == nullptr || (batches > 1 && batched == nullptr)) return false;
    int op_a, op_b;
    int64_t lda, ldb;
    /* C^T (n x m, column-major with leading dimension ldc) = b^T a^T */
    if (!transpose_operand(k, n, b_row, b_col, &op_b, &ldb) ||
        !transpose_operand(m, k, a_row, a_col, &op_a, &lda))
        return false;
    if (m == 1 && ldc < n) ldc = n;
    if (ldc < n || m > INT_MAX || n > INT_MAX || k > INT_MAX || lda > INT_MAX ||
        ldb > INT_MAX || ldc > INT_MAX)
        return false;
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) {
        cudaGetLastError();
        return false;
    }
    Device &d = g_devices[device];
    std::lock_guard<std::mutex> lock(d.lock);
    if (d.handle == nullptr && !d.failed) {
        /* a handle made in a graph capture may be refused (it allocates):
         * the call takes our own products, and a later call makes it */
        if (capturing(stream)) return false;
        d.failed = functions.create(&d.handle) != kStatusSuccess;
    }
    if (d.failed || functions.set_stream(d.handle, stream) != kStatusSuccess) return false;
    /* the math mode this product takes: where it cannot be set, TF32 is not
     * taken, and a handle that could not be set back to the default math
     * computes nothing more (our own products, IEEE float32, instead) */
    const int math = tf32 && sizeof(T) == 4 && functions.set_math_mode ? kTf32Math : kDefaultMath;
    if (math != d.math) {
        if (functions.set_math_mode && functions.set_math_mode(d.handle, math) == kStatusSuccess)
            d.math = math;
        else if (math == kDefaultMath)
            return false;
    }
    const T one = 1;
    if (batches == 1)
        return gemm(d.handle, op_b, op_a, (int)n, (int)m, (int)k, &one, b, (int)ldb, a,
                    (int)lda, &beta, c, (int)ldc) == kStatusSuccess;
    return batched(d.handle, op_b, op_a, (int)n, (int)m, (int)k, &one, b, (int)ldb, b_batch, a,
                   (int)lda, a_batch, &beta, c, (int)ldc, c_batch,
                   (int)batches) == kStatusSuccess;
}

}  // namespace

bool cublas_gemm(cudaStream_t stream, int64_t batches, int64_t m, int64_t n, int64_t k,
                 const float *a, int64_t a_row, int64_t a_col, int64_t a_batch, const float *b,
                 int64_t b_row, int64_t b_col, int64_t b_batch, float beta, float *c,
                 int64_t ldc, int64_t c_batch, bool tf32) {
    return gemm_with(stream, batches, m, n, k, a, a_row, a_col, a_batch, b, b_row, b_col,
                     b_batch, beta, c, ldc, c_batch, tf32);
}

bool cublas_gemm(cudaStream_t stream, int64_t batches, int64_t m, int64_t n, int64_t k,
                 const double *a, int64_t a_row, int64_t a_col, int64_t a_batch,
                 const double *b, int64_t b_row, int64_t b_col, int64_t b_batch, double beta,
                 double *c, int64_t ldc, int64_t c_batch, bool tf32) {
    return gemm_with(stream, batches, m, n, k, a, a_row, a_col, a_batch, b, b_row, b_col,
                     b_batch, beta, c, ldc, c_batch, tf32);
}

}  // namespace mmd_cuda
