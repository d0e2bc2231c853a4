/* Helpers shared by the CUDA kernel files (src/cuda/*.cu): CUDA error
 * messages, making the array's device current, launch sizing, the dtype
 * switch, storage -> compute types, and the "validate on the device, then
 * one sync" step that data-dependent checks (rois, class targets, argmax
 * indices) run before any output is written. */
#ifndef MMDISPATCH_CUDA_COMMON_CUH
#define MMDISPATCH_CUDA_COMMON_CUH

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mmdispatch/tensor.h"

namespace mmd_cuda {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 65535;

inline int cuda_error(cudaError_t err, const char *what) {
    return mmd_error(MMD_ERR_RUNTIME, "CUDA error in %s: %s (%s)", what, cudaGetErrorString(err),
                     cudaGetErrorName(err));
}

/* Makes ctx's device current for the call and restores the caller's. */
class DeviceGuard {
  public:
    explicit DeviceGuard(int device) {
        err_ = cudaGetDevice(&previous_);
        if (err_ == cudaSuccess && previous_ != device) err_ = cudaSetDevice(device);
        switched_ = err_ == cudaSuccess && previous_ != device;
    }
    ~DeviceGuard() {
        if (switched_) cudaSetDevice(previous_);
    }
    DeviceGuard(const DeviceGuard &) = delete;
    DeviceGuard &operator=(const DeviceGuard &) = delete;
    cudaError_t error() const { return err_; }

  private:
    int previous_ = 0;
    bool switched_ = false;
    cudaError_t err_;
};

/* Grid size for a grid-stride loop over `total` items. */
inline unsigned blocks_for(int64_t total) {
    int64_t blocks = (total + kThreads - 1) / kThreads;
    if (blocks < 1) blocks = 1;
    return (unsigned)(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

#define MMD_GRID_STRIDE_LOOP(i, total)                                                  \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (total);       \
         i += (int64_t)blockDim.x * gridDim.x)

/* Calls f with a value of the storage type matching `dtype`, which the
 * caller has already checked to be float32, float64 or (when kWithHalf)
 * float16; ops without float16 kernels instantiate no half code. */
template <bool kWithHalf = true, typename F> int by_dtype(int dtype, F f) {
    if constexpr (kWithHalf)
        if (dtype == MMD_FLOAT16) return f(__half());
    return dtype == MMD_FLOAT32 ? f(float()) : f(double());
}

/* Runs f on ctx's device (current device switched for the call). */
template <typename F> int on_device(const mmd_context *ctx, F f) {
    DeviceGuard guard(ctx->device_id);
    if (guard.error() != cudaSuccess) return cuda_error(guard.error(), "cudaSetDevice");
    return f((cudaStream_t)ctx->stream);
}

/* Storage type -> compute type: half computes in float. */
template <typename T> struct Compute { typedef T type; };
template <> struct Compute<__half> { typedef float type; };

__device__ inline float to_compute(__half v) { return __half2float(v); }
__device__ inline float to_compute(float v) { return v; }
__device__ inline double to_compute(double v) { return v; }
template <typename T> __device__ inline T from_compute(float v);
template <> __device__ inline __half from_compute<__half>(float v) { return __float2half(v); }
template <> __device__ inline float from_compute<float>(float v) { return v; }
template <typename T> __device__ inline T from_compute(double v) { return v; }

/* A failed device-side check is recorded as (index << 8 | code); the lowest
 * index wins, so the message names the first bad item. */
constexpr unsigned long long kNoError = ~0ull;

__device__ inline void report_error(unsigned long long *flag, int64_t index, int code) {
    atomicMin(flag, ((unsigned long long)index << 8) | (unsigned long long)(code & 0xff));
}

/* launch(flag) enqueues a check kernel on `stream` that calls report_error;
 * then waits for its verdict (one small sync) and returns MMD_OK, or
 * on_error(index, code) for the first bad item. */
template <typename Launch, typename OnError>
int check_on_device(cudaStream_t stream, const char *what, Launch launch, OnError on_error) {
    unsigned long long *flag = nullptr, result = kNoError;
    cudaError_t err = cudaMallocAsync((void **)&flag, sizeof *flag, stream);
    if (err != cudaSuccess) return cuda_error(err, what);
    err = cudaMemsetAsync(flag, 0xff, sizeof *flag, stream);
    if (err == cudaSuccess) {
        launch(flag);
        err = cudaGetLastError();
    }
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(&result, flag, sizeof result, cudaMemcpyDeviceToHost, stream);
    cudaError_t free_err = cudaFreeAsync(flag, stream);
    if (err == cudaSuccess) err = free_err;
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return cuda_error(err, what);
    if (result == kNoError) return MMD_OK;
    return on_error((int64_t)(result >> 8), (int)(result & 0xff));
}

/* Temporary device memory, allocated and freed in stream order. */
class StreamBuffer {
  public:
    explicit StreamBuffer(cudaStream_t stream) : stream_(stream) {}
    ~StreamBuffer() {
        if (ptr_) cudaFreeAsync(ptr_, stream_);
    }
    StreamBuffer(const StreamBuffer &) = delete;
    StreamBuffer &operator=(const StreamBuffer &) = delete;
    cudaError_t allocate(size_t bytes) {
        return cudaMallocAsync(&ptr_, bytes ? bytes : 1, stream_);
    }
    template <typename T> T *as() const { return static_cast<T *>(ptr_); }

  private:
    cudaStream_t stream_;
    void *ptr_ = nullptr;
};

inline int launch_status(const char *what) {
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? MMD_OK : cuda_error(err, what);
}

}  // namespace mmd_cuda

#endif
