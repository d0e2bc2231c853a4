/* The CUDA emulator's cuda_runtime.h: what src/cuda/*.cu use of CUDA C++ and
 * of the runtime API, for a host compiler, so that the CUDA kernels run on
 * the CPU in the tests (tests/support/cuda_emu). Each CUDA thread of a block
 * is a fiber; a block runs its threads in turns on the launching thread,
 * switching at barriers and warp operations, and blocks run one after the
 * other. Launches finish before they return; device memory is host memory.
 *
 * It checks what a GPU would refuse (launch sizes, shared memory, device
 * numbers, warp operations not every lane of the mask reaches) and fails
 * the launch with the error CUDA would give; it does not check memory
 * accesses or the timing of a real GPU. */
#ifndef MMD_EMU_CUDA_RUNTIME_H
#define MMD_EMU_CUDA_RUNTIME_H

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <functional>
#include <type_traits>
#include <utility>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__
/* function-local statics are shared by every fiber of the block, as CUDA's
 * __shared__ variables are; blocks run one at a time (the emulator's
 * translate() also has each block find them filled with 0xff bytes) */
#define __shared__ static
#define __restrict__ __restrict
#define __launch_bounds__(...)
#define CUDART_VERSION 13000

struct dim3 {
    unsigned x, y, z;
    dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
typedef dim3 uint3;

struct mmd_emu_stream;
typedef mmd_emu_stream *cudaStream_t;
typedef void *cudaEvent_t;

enum cudaError_t {
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInsufficientDriver = 35,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorStreamCaptureUnsupported = 900,
    cudaErrorStreamCaptureImplicit = 906,
    cudaErrorIllegalInstruction = 715,
    cudaErrorMisalignedAddress = 716,
    cudaErrorLaunchFailure = 719
};
typedef cudaError_t cudaError;

enum cudaMemcpyKind {
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

/* Stream capture (CUDA graphs): the emulator's capture mode is a switch
 * the tests turn (mmd_emu_capture), which puts every stream in an active
 * capture; launches still run at once (nothing is recorded or replayed),
 * and the calls a capture forbids fail and are counted (runtime.cpp). */
enum cudaStreamCaptureStatus {
    cudaStreamCaptureStatusNone = 0,
    cudaStreamCaptureStatusActive = 1,
    cudaStreamCaptureStatusInvalidated = 2
};

enum cudaDeviceAttr {
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrMemoryPoolsSupported = 115
};

/* Stream-ordered memory pools (runtime.cpp models what the kernels rely
 * on: freed blocks kept for reuse, trimmed to the release threshold at
 * every synchronisation, as CUDA does) */
struct mmd_emu_pool;
typedef mmd_emu_pool *cudaMemPool_t;
enum cudaMemAllocationType { cudaMemAllocationTypeInvalid = 0, cudaMemAllocationTypePinned = 1 };
enum cudaMemAllocationHandleType { cudaMemHandleTypeNone = 0 };
enum cudaMemLocationType { cudaMemLocationTypeInvalid = 0, cudaMemLocationTypeDevice = 1 };
struct cudaMemLocation {
    cudaMemLocationType type;
    int id;
};
struct cudaMemPoolProps {
    cudaMemAllocationType allocType;
    cudaMemAllocationHandleType handleTypes;
    cudaMemLocation location;
    void *win32SecurityAttributes;
    size_t maxSize;
    unsigned short usage;
    unsigned char reserved[54];
};
enum cudaMemPoolAttr { cudaMemPoolAttrReleaseThreshold = 4 };

enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };

#define cudaHostAllocDefault 0
#define cudaHostAllocMapped 2

struct cudaDeviceProp {
    char name[256];
    int major, minor;
    int multiProcessorCount;
    size_t sharedMemPerBlock;
    int maxThreadsPerBlock;
};

/* The emulated device's limits (an H100's). */
#define MMD_EMU_SHARED_PER_BLOCK (48 * 1024)
#define MMD_EMU_SHARED_OPTIN (227 * 1024)
#define MMD_EMU_MAX_THREADS 1024

namespace mmd_emu {

struct Fiber;
struct Block {
    dim3 block_idx, block_dim, grid_dim;
    unsigned char *dynamic_shared;
    /* the static __shared__ variables this block's threads have passed */
    std::vector<const void *> static_shared;
};
/* the fiber running now and its block (set by the scheduler) */
extern Fiber *current;
extern Block *block;
extern uint3 current_thread_idx(void);
/* the calling thread's lane: its linear index in the block, mod 32 */
extern int current_lane(void);
/* A static __shared__ variable, called after its declaration (translate()):
 * the first of a block's threads to pass it fills it with 0xff bytes, as
 * the dynamic shared memory is filled, so that a kernel reading it before
 * writing it reads NaN-like bytes, as it would read garbage on a GPU (a
 * function-local static would keep the previous block's values). */
void shared_region(void *address, size_t size);

/* Synchronisation points; each returns when every thread it waits for has
 * arrived. value: this lane's contribution; returns its result. */
enum SyncKind { SYNC_BLOCK_OR, SYNC_WARP, SYNC_SHFL, SYNC_MATCH_ANY, SYNC_BALLOT };
uint64_t sync(SyncKind kind, unsigned mask, uint64_t value, int src_lane);

/* A launch: runs kernel(args...) for every thread of the grid; false (and
 * cudaGetLastError set) for a configuration CUDA refuses. */
bool launch(dim3 grid, dim3 block, size_t shared, const void *kernel,
            const std::function<void()> &body);
/* A kernel's identity: its address (a kernel named, or a pointer to one). */
template <typename K> inline const void *kernel_id(K kernel) {
    return reinterpret_cast<const void *>(kernel);
}
/* cudaFuncSetAttribute's dynamic shared memory allowance of `kernel` on the
 * calling thread's current device: it holds for every later launch of that
 * kernel there, from any thread, as on a GPU (runtime.cpp) */
void allow_dynamic_shared(const void *kernel, int bytes);

struct Launch {
    dim3 grid, block;
    size_t shared;
    Launch(dim3 grid_, dim3 block_, size_t shared_ = 0, cudaStream_t = nullptr)
        : grid(grid_), block(block_), shared(shared_) {}
    /* kernel: kernel_id of the kernel launched; body: a closure calling it
     * with the launch's arguments (cuda_emu/__init__.py's translation of
     * kernel<<<...>>>(args)) */
    template <typename F> void operator()(const void *kernel, F body) const {
        launch(grid, block, shared, kernel, std::function<void()>(body));
    }
};

}  // namespace mmd_emu

#define threadIdx (mmd_emu::current_thread_idx())
#define blockIdx (mmd_emu::block->block_idx)
#define blockDim (mmd_emu::block->block_dim)
#define gridDim (mmd_emu::block->grid_dim)
#define warpSize 32

/* barriers and warp operations */
inline void __syncthreads() { mmd_emu::sync(mmd_emu::SYNC_BLOCK_OR, 0, 0, 0); }
inline int __syncthreads_or(int predicate) {
    return (int)mmd_emu::sync(mmd_emu::SYNC_BLOCK_OR, 0, predicate != 0, 0);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { mmd_emu::sync(mmd_emu::SYNC_WARP, mask, 0, 0); }
inline unsigned __ballot_sync(unsigned mask, int predicate) {
    return (unsigned)mmd_emu::sync(mmd_emu::SYNC_BALLOT, mask, predicate != 0, 0);
}
inline unsigned __match_any_sync(unsigned mask, unsigned long long value) {
    return (unsigned)mmd_emu::sync(mmd_emu::SYNC_MATCH_ANY, mask, value, 0);
}
template <typename T> inline T __shfl_sync(unsigned mask, T value, int src, int width = 32) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable<T>::value, "shuffle of a word");
    uint64_t bits = 0;
    memcpy(&bits, &value, sizeof value);
    const int lane = mmd_emu::current_lane();
    const int base = lane - lane % width;
    bits = mmd_emu::sync(mmd_emu::SYNC_SHFL, mask, bits, base + (src % width + width) % width);
    memcpy(&value, &bits, sizeof value);
    return value;
}
template <typename T> inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    const int lane = mmd_emu::current_lane();
    return __shfl_sync(mask, value, (lane ^ lane_mask) % width, width);
}
template <typename T> inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    const int lane = mmd_emu::current_lane() % width;
    return __shfl_sync(mask, value, lane + (int)delta < width ? lane + (int)delta : lane, width);
}
template <typename T> inline T __shfl_up_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    const int lane = mmd_emu::current_lane() % width;
    return __shfl_sync(mask, value, lane >= (int)delta ? lane - (int)delta : lane, width);
}

/* atomics: fibers switch only at synchronisation points, so a plain
 * read-modify-write is atomic */
template <typename T> inline T atomicAdd(T *address, T value) {
    const T old = *address;
    *address = (T)(old + value);
    return old;
}
/* sm_90's vector atomicAdd: atomic element by element, at an address a
 * GPU requires 16-byte aligned (else the launch fails, as it would there) */
struct alignas(16) float4 {
    float x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return float4{x, y, z, w}; }
namespace mmd_emu {
void misaligned(const char *what);
}
inline float4 atomicAdd(float4 *address, float4 value) {
    if ((uintptr_t)address % 16 != 0) {
        mmd_emu::misaligned("a vector atomicAdd at an address not 16-byte aligned");
        return float4{};
    }
    const float4 old = *address;
    address->x += value.x;
    address->y += value.y;
    address->z += value.z;
    address->w += value.w;
    return old;
}
template <typename T> inline T atomicMin(T *address, T value) {
    const T old = *address;
    if (value < old) *address = value;
    return old;
}
template <typename T> inline T atomicMax(T *address, T value) {
    const T old = *address;
    if (value > old) *address = value;
    return old;
}
template <typename T> inline T atomicExch(T *address, T value) {
    const T old = *address;
    *address = value;
    return old;
}
template <typename T> inline T atomicCAS(T *address, T compare, T value) {
    const T old = *address;
    if (old == compare) *address = value;
    return old;
}
template <typename T> inline T atomicOr(T *address, T value) {
    const T old = *address;
    *address = old | value;
    return old;
}
template <typename T> inline T atomicAnd(T *address, T value) {
    const T old = *address;
    *address = old & value;
    return old;
}

/* integer and float intrinsics */
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __popcll(unsigned long long v) { return __builtin_popcountll(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline int __ffsll(long long v) { return __builtin_ffsll(v); }
inline int __clz(int v) { return v ? __builtin_clz((unsigned)v) : 32; }
inline int __clzll(long long v) { return v ? __builtin_clzll((unsigned long long)v) : 64; }
template <typename T> inline T __ldg(const T *p) { return *p; }
inline float __int_as_float(int v) { float f; memcpy(&f, &v, 4); return f; }
inline int __float_as_int(float f) { int v; memcpy(&v, &f, 4); return v; }
inline unsigned __float_as_uint(float f) { unsigned v; memcpy(&v, &f, 4); return v; }
inline float __uint_as_float(unsigned v) { float f; memcpy(&f, &v, 4); return f; }
inline double __longlong_as_double(long long v) { double d; memcpy(&d, &v, 8); return d; }
inline long long __double_as_longlong(double d) { long long v; memcpy(&v, &d, 8); return v; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float v) { return expf(v); }
inline float __logf(float v) { return logf(v); }
inline float __saturatef(float v) { return v < 0.f ? 0.f : (v > 1.f ? 1.f : v); }
inline float rsqrtf(float v) { return 1.f / sqrtf(v); }
/* CUDA's global min/max overloads */
#define MMD_EMU_MINMAX(T)                                   \
    inline T min(T a, T b) { return b < a ? b : a; }        \
    inline T max(T a, T b) { return a < b ? b : a; }
MMD_EMU_MINMAX(int)
MMD_EMU_MINMAX(unsigned)
MMD_EMU_MINMAX(long)
MMD_EMU_MINMAX(unsigned long)
MMD_EMU_MINMAX(long long)
MMD_EMU_MINMAX(unsigned long long)
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
inline double min(double a, double b) { return fmin(a, b); }
inline double max(double a, double b) { return fmax(a, b); }
#undef MMD_EMU_MINMAX

/* the runtime API (runtime.cpp) */
cudaError_t cudaGetLastError(void);
cudaError_t cudaPeekAtLastError(void);
const char *cudaGetErrorString(cudaError_t err);
const char *cudaGetErrorName(cudaError_t err);
cudaError_t cudaGetDeviceCount(int *count);
cudaError_t cudaGetDevice(int *device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaDriverGetVersion(int *version);
cudaError_t cudaRuntimeGetVersion(int *version);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device);
cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus *status);
cudaError_t cudaDeviceSynchronize(void);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaMalloc(void **ptr, size_t size);
cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t stream);
cudaError_t cudaFree(void *ptr);
cudaError_t cudaFreeAsync(void *ptr, cudaStream_t stream);
cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const cudaMemPoolProps *props);
cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool);
cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value);
cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep);
cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool,
                                    cudaStream_t stream);
cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned flags);
cudaError_t cudaFreeHost(void *ptr);
cudaError_t cudaHostGetDevicePointer(void **device, void *host, unsigned flags);
cudaError_t cudaMemset(void *ptr, int value, size_t size);
cudaError_t cudaMemsetAsync(void *ptr, int value, size_t size, cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy(void *dst, const void *src, size_t size, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t size, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
template <typename T> inline cudaError_t cudaMalloc(T **ptr, size_t size) {
    return cudaMalloc((void **)ptr, size);
}
template <typename T> inline cudaError_t cudaMallocAsync(T **ptr, size_t size, cudaStream_t s) {
    return cudaMallocAsync((void **)ptr, size, s);
}
template <typename F>
inline cudaError_t cudaFuncSetAttribute(F kernel, cudaFuncAttribute attr, int value) {
    if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize &&
        (value < 0 || value > MMD_EMU_SHARED_OPTIN))
        return cudaErrorInvalidValue;
    mmd_emu::allow_dynamic_shared(mmd_emu::kernel_id(kernel), value);
    return cudaSuccess;
}

#endif
