/* Helpers shared by the CUDA kernel files (src/cuda/*.cu): CUDA error
 * messages, making the array's device current, launch sizing, the dtype
 * switch, storage -> compute types, and the two ways data-dependent checks
 * (rois, class targets, argmax indices) run:
 *   - by default, inside the op's own kernel, which makes a bad item
 *     harmless and reports it through an ErrorSink as a deferred error
 *     (mmdispatch/deferred.h): no host-device synchronisation;
 *   - in strict mode (MMD_CONTEXT_STRICT), before the op's kernel, by a
 *     check kernel and one synchronisation (check_on_device), so the call
 *     itself raises and writes nothing. */
#ifndef MMDISPATCH_CUDA_COMMON_CUH
#define MMDISPATCH_CUDA_COMMON_CUH

#include <atomic>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "mmdispatch/deferred.h"
#include "mmdispatch/tensor.h"

namespace mmd_cuda {

/* Devices with deferred-error state (src/cuda/device.cu). */
constexpr int kMaxDevices = 128;

constexpr int kThreads = 256;
/* The most blocks a grid-stride kernel launches (the emulator's build
 * lowers it, so that every grid-stride loop in the tests runs more than
 * once). */
#ifndef MMD_CUDA_MAX_BLOCKS
#define MMD_CUDA_MAX_BLOCKS 65535
#endif
constexpr int64_t kMaxBlocks = MMD_CUDA_MAX_BLOCKS;

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

/* The grid height a kernel that loops over what its grid does not cover
 * launches at most (CUDA's limit is 65535; the CUDA emulator's tests build
 * with a small one, so that those loops run). */
#ifndef MMD_CUDA_MAX_GRID_Y
#define MMD_CUDA_MAX_GRID_Y 65535
#endif

/* Grid size for a kernel that loops over `blocks` blocks' work (grid-stride):
 * at most kMaxBlocks. */
inline unsigned grid_of(int64_t blocks) {
    return (unsigned)(blocks < kMaxBlocks ? blocks : kMaxBlocks);
}

/* Grid size for a grid-stride loop over `total` items. */
inline unsigned blocks_for(int64_t total) {
    const int64_t blocks = (total + kThreads - 1) / kThreads;
    return grid_of(blocks < 1 ? 1 : blocks);
}

#define MMD_GRID_STRIDE_LOOP(i, total)                                                  \
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (total);       \
         i += (int64_t)blockDim.x * gridDim.x)

/* Pooling kernels that give a thread one bin of a roi for a group of
 * kChannelGroup channels: the roi's geometry and the bin's cells are worked
 * out once for the group, and the group's loads are independent. */
constexpr int kChannelGroup = 8;

struct BinGroup {
    int64_t k, c0, count, ph, pw;   /* roi k, bin (ph, pw), channels [c0, c0 + count) */
    bool first;                     /* the roi's first bin and group (reports a bad roi) */
};

/* Threads of such a kernel for `num_rois` rois. */
inline int64_t bin_groups(int64_t num_rois, int64_t channels, int64_t pooled_h,
                          int64_t pooled_w) {
    return num_rois * ((channels + kChannelGroup - 1) / kChannelGroup) * pooled_h * pooled_w;
}

/* The work of thread `index` of such a kernel: channel-major (every roi's
 * bins for one channel group, then the next group), which keeps the few
 * MB of the group's planes in L2 while all the rois read them (or add into
 * them), where roi-major order (a roi's groups and bins together, as the
 * output lies) has the rois in flight touch every plane of the map at once
 * and a map larger than L2 comes from DRAM many times over. */
__device__ inline BinGroup locate_bin_group(int64_t index, int64_t num_rois, int64_t channels,
                                            int64_t pooled_h, int64_t pooled_w) {
    BinGroup w;
    w.pw = index % pooled_w;
    w.ph = (index / pooled_w) % pooled_h;
    const int64_t outer = index / pooled_w / pooled_h;
    const int64_t group = outer / num_rois;
    w.k = outer % num_rois;
    w.c0 = group * kChannelGroup;
    w.count = channels - w.c0 < kChannelGroup ? channels - w.c0 : kChannelGroup;
    w.first = group == 0 && w.ph == 0 && w.pw == 0;
    return w;
}

/* Pooling kernels that give a thread one output element (roi_pool,
 * roi_align's max mode): element `index`'s place, bins fastest (a warp reads
 * neighbouring bins of one channel plane), then rois, then channels:
 * channel-major, as locate_bin_group, so that the planes being read
 * (forward) or added into (backward's atomics) stay in L2 while all rois
 * visit them. The index is split in I: int32_t where the output has fewer
 * than 2^31 elements (64-bit divisions cost tens of instructions each). */
template <typename I> struct PooledElement {
    I k, c, ph, pw;
    int64_t at;   /* its place in output, argmax and grad_output */
    bool first;   /* the roi's first element (reports a bad roi) */

    __device__ PooledElement(int64_t index, int64_t num_rois, int64_t channels,
                             int64_t pooled_h, int64_t pooled_w) {
        const I i = (I)index, bins_w = (I)pooled_w, bins_h = (I)pooled_h, rest = i / bins_w;
        pw = i % bins_w;
        ph = rest % bins_h;
        k = (rest / bins_h) % (I)num_rois;
        c = rest / bins_h / (I)num_rois;
        at = (((int64_t)k * (I)channels + c) * bins_h + ph) * bins_w + pw;
        first = c == 0 && ph == 0 && pw == 0;
    }
};

/* Calls f with a value of the storage type matching `dtype`, which the
 * caller has already checked to be float16, bfloat16, float32 or float64. */
template <typename F> int by_dtype(int dtype, F f) {
    if (dtype == MMD_FLOAT16) return f(__half());
    if (dtype == MMD_BFLOAT16) return f(__nv_bfloat16());
    return dtype == MMD_FLOAT32 ? f(float()) : f(double());
}

/* Where a kernel reports the bad items it meets (deferred errors): the
 * device's error word, which keeps the smallest key, and a flag in mapped
 * host memory that lets the host see, without synchronising, that the word
 * holds something. Passed to kernels by value. */
struct ErrorSink {
    unsigned long long *word;
    int *flag;
    uint32_t seq;

    __device__ void report(int64_t index, int code) const {
        atomicMin(word, (unsigned long long)mmd_deferred_key(seq, index, code));
        *(volatile int *)flag = 1;
    }
};

/* Per device (src/cuda/device.cu): the host address of its flag once its
 * error word exists, else null; which devices calls have run on. */
extern std::atomic<int *> g_error_flags[kMaxDevices];
extern std::atomic<bool> g_device_used[kMaxDevices];

/* Whether `stream` is capturing a CUDA graph (the legacy stream counts as
 * capturing while a blocking stream does). */
bool capturing(cudaStream_t stream);
/* The device's state made on the first call on it (its error word, which
 * waits for the device, and its scratch pool), so that a warm-up call of
 * any op readies a device for graph capture; a first call in a capture is
 * an error saying so, and a failure is not kept (a later call tries
 * again). The current device must be `device`. */
int prepare_device(int device, cudaStream_t stream);
/* A sink for a call recorded with mmd_deferred_begin(seq) (the device
 * prepared on its first use; the current device must be `device`). */
int error_sink(int device, uint32_t seq, ErrorSink *sink);
/* Waits for the device, takes its error word and returns the deferred
 * error it holds (MMD_ERR_DEFERRED), or MMD_OK. `raised_by`: the entry
 * point whose call found it pending (MMD_OK, the error left pending,
 * where that call's stream is capturing: a capture forbids the wait), or
 * null for synchronize. */
int take_pending(int device, cudaStream_t stream, const char *raised_by);

/* Scratch memory (src/cuda/device.cu): each device's own stream-ordered
 * pool, which keeps up to kScratchKeepBytes of freed memory across
 * synchronisations (CUDA's default pool returns all of it to the driver at
 * every synchronisation, so the next call maps its scratch again), or null
 * where the device has no memory pools (then cudaMallocAsync's default
 * pool). Made by prepare_device, before any call's scratch (so never in
 * a graph capture). The current device must be `device`. */
constexpr unsigned long long kScratchKeepBytes = 256ull << 20;
cudaMemPool_t scratch_pool(int device);

/* Allocates `bytes` (at least 1) of scratch on the current device, in
 * stream order; freed with cudaFreeAsync. */
inline cudaError_t scratch_allocate(void **ptr, size_t bytes, cudaStream_t stream) {
    int device = 0;
    cudaError_t err = cudaGetDevice(&device);
    if (err != cudaSuccess) return err;
    const cudaMemPool_t pool = scratch_pool(device);
    if (bytes == 0) bytes = 1;
    return pool ? cudaMallocFromPoolAsync(ptr, bytes, pool, stream)
                : cudaMallocAsync(ptr, bytes, stream);
}

/* The per-call test for a pending deferred error: one load of a host flag. */
inline int raise_pending(int device, cudaStream_t stream, const char *raised_by) {
    if ((unsigned)device >= (unsigned)kMaxDevices) return MMD_OK;
    const int *flag = g_error_flags[device].load(std::memory_order_acquire);
    if (flag == nullptr || *(const volatile int *)flag == 0) return MMD_OK;
    return take_pending(device, stream, raised_by);
}

inline bool strict(const mmd_context *ctx) { return (ctx->flags & MMD_CONTEXT_STRICT) != 0; }
/* Whether the call's float32 products may take TF32 (MMD_CONTEXT_TF32). */
inline bool tf32(const mmd_context *ctx) { return (ctx->flags & MMD_CONTEXT_TF32) != 0; }

/* Records a call whose kernel may report bad items (mmd_deferred_begin)
 * and fills its sink. */
inline int begin_deferred(const mmd_context *ctx, mmd_deferred_format format, int64_t arg0,
                          int64_t arg1, int64_t arg2, ErrorSink *sink) {
    const uint32_t seq = mmd_deferred_begin(ctx->op ? ctx->op : "mmdispatch", format, arg0,
                                            arg1, arg2);
    return error_sink(ctx->device_id, seq, sink);
}

/* Runs f(stream) on ctx's device (current device switched for the call),
 * after raising a deferred error an earlier call left on that device. In
 * strict mode it then waits for the stream, so that a failed kernel is
 * reported by this call. */
template <typename F> int on_device(const mmd_context *ctx, F f) {
    DeviceGuard guard(ctx->device_id);
    if (guard.error() != cudaSuccess) return cuda_error(guard.error(), "cudaSetDevice");
    const int device = ctx->device_id;
    const cudaStream_t stream = (cudaStream_t)ctx->stream;
    if ((unsigned)device < (unsigned)kMaxDevices &&
        !g_device_used[device].load(std::memory_order_acquire)) {
        const int s = prepare_device(device, stream);
        if (s) return s;
        g_device_used[device].store(true, std::memory_order_release);
    }
    int s = raise_pending(device, stream, ctx->op ? ctx->op : "an mmdispatch call");
    if (s) return s;
    if (strict(ctx) && capturing(stream))
        return mmd_error(MMD_ERR_RUNTIME,
                         "strict mode waits for the device, so a call in it cannot be "
                         "captured into a CUDA graph: leave mmdispatch.strict() (or unset "
                         "MMDISPATCH_STRICT) for the capture");
    s = f(stream);
    if (s == MMD_OK && strict(ctx)) {
        const cudaError_t err = cudaStreamSynchronize(stream);
        if (err != cudaSuccess) s = cuda_error(err, ctx->op ? ctx->op : "kernel");
    }
    return s;
}

/* Storage type -> compute type: float16 and bfloat16 compute in float. */
template <typename T> struct Compute { typedef T type; };
template <> struct Compute<__half> { typedef float type; };
template <> struct Compute<__nv_bfloat16> { typedef float type; };

__device__ inline float to_compute(__half v) { return __half2float(v); }
__device__ inline float to_compute(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float to_compute(float v) { return v; }
__device__ inline double to_compute(double v) { return v; }
template <typename T> __device__ inline T from_compute(float v);
template <> __device__ inline __half from_compute<__half>(float v) { return __float2half(v); }
template <> __device__ inline __nv_bfloat16 from_compute<__nv_bfloat16>(float v) {
    return __float2bfloat16(v);
}
template <> __device__ inline float from_compute<float>(float v) { return v; }
template <typename T> __device__ inline T from_compute(double v) { return v; }

/* Strict mode's check: launch(sink) enqueues a check kernel on `stream`
 * that reports bad items into a sink of its own (a fresh word, a null
 * flag); then waits for its verdict (one small sync) and returns MMD_OK,
 * or on_error(index, code) for the first bad item. */
template <typename Launch, typename OnError>
int check_on_device(cudaStream_t stream, const char *what, Launch launch, OnError on_error) {
    unsigned long long *word = nullptr, result = MMD_DEFERRED_NONE;
    cudaError_t err = scratch_allocate((void **)&word, 2 * sizeof *word, stream);
    if (err != cudaSuccess) return cuda_error(err, what);
    err = cudaMemsetAsync(word, 0xff, sizeof *word, stream);
    if (err == cudaSuccess) {
        /* the sink's flag: device memory the host never reads */
        launch(ErrorSink{word, (int *)(word + 1), 0});
        err = cudaGetLastError();
    }
    if (err == cudaSuccess)
        err = cudaMemcpyAsync(&result, word, sizeof result, cudaMemcpyDeviceToHost, stream);
    cudaError_t free_err = cudaFreeAsync(word, stream);
    if (err == cudaSuccess) err = free_err;
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return cuda_error(err, what);
    if (result == MMD_DEFERRED_NONE) return MMD_OK;
    return on_error((int64_t)((result >> 8) & (uint64_t)MMD_DEFERRED_MAX_INDEX),
                    (int)(result & 0xff));
}

/* Temporary device memory, allocated (scratch_allocate) and freed in
 * stream order. */
class StreamBuffer {
  public:
    explicit StreamBuffer(cudaStream_t stream) : stream_(stream) {}
    ~StreamBuffer() {
        if (ptr_) cudaFreeAsync(ptr_, stream_);
    }
    StreamBuffer(const StreamBuffer &) = delete;
    StreamBuffer &operator=(const StreamBuffer &) = delete;
    cudaError_t allocate(size_t bytes) { return scratch_allocate(&ptr_, bytes, stream_); }
    template <typename T> T *as() const { return static_cast<T *>(ptr_); }

  private:
    cudaStream_t stream_;
    void *ptr_ = nullptr;
};

/* Adds, for the 32 lanes of a warp (all active), `value` at `element` of
 * `plane` (-1: none): lanes naming the same element are summed in lane
 * order by the lowest of them, which alone writes, so the sum comes in a
 * fixed order whatever the timing (the deterministic backward kernels). */
template <typename T, typename A>
__device__ inline void warp_ordered_add(T *plane, int64_t element, A value) {
    const unsigned group = __match_any_sync(0xffffffffu, (unsigned long long)element);
    A sum = 0;
    for (int src = 0; src < 32; ++src) {
        const A other = __shfl_sync(0xffffffffu, value, src);
        if ((group >> src) & 1u) sum += other;
    }
    if (element >= 0 && (int)(threadIdx.x % 32) == __ffs(group) - 1)
        plane[element] = from_compute<T>(to_compute(plane[element]) + sum);
    __syncwarp();
}

/* Whether this device code has vector atomics (atomicAdd of a float4 in
 * global memory: sm_90 and later). The emulator has them too: it adds the
 * elements one by one and fails the launch on an address that is not 16-byte
 * aligned, as a GPU would. Device code only (the host pass sees 0). A build
 * may switch them off (-DMMD_CUDA_VECTOR_ATOMICS=0: the single atomics
 * everywhere, to time one against the other or to compare their bits). */
#ifndef MMD_CUDA_VECTOR_ATOMICS
#if defined(MMD_CUDA_EMULATOR) || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define MMD_CUDA_VECTOR_ATOMICS 1
#else
#define MMD_CUDA_VECTOR_ATOMICS 0
#endif
#endif

/* Four floats by value (a window's weights), kept in registers. */
struct Float4 {
    float v0, v1, v2, v3;
    __device__ float operator[](int j) const {
        return j == 0 ? v0 : j == 1 ? v1 : j == 2 ? v2 : v3;
    }
    __device__ void set(int j, float x) {
        v0 = j == 0 ? x : v0;
        v1 = j == 1 ? x : v1;
        v2 = j == 2 ? x : v2;
        v3 = j == 3 ? x : v3;
    }
};

/* Cells of a row of floats, handed over in increasing order with a weight
 * each, gathered into windows of the 4 cells of a 16-byte-aligned address,
 * so that each window takes one vector atomic per target row where single
 * atomics took one per cell. The phase is where cell 0 falls within its 4
 * (the same for every row whose address differs by a multiple of 16 bytes).
 * A cell handed over twice in a row has its weights summed; cells out of
 * order cost a window each, and add the same. Cells below 2^31 - 4. */
struct CellWindow {
    int phase, first = 0;   /* the window's first cell (negative before the row) */
    unsigned touched = 0;   /* bit j: cell first + j was handed over */
    Float4 weight{0.f, 0.f, 0.f, 0.f};

    __device__ explicit CellWindow(const float *row)
        : phase((int)(((unsigned long long)(size_t)row >> 2) & 3u)) {}

    /* Cell x's weight; the window before it goes to put(first, touched,
     * weight) once x lies beyond it. */
    template <typename Put> __device__ void add(int x, float w, Put put) {
        const int start = (int)(((unsigned)x + (unsigned)phase) & ~3u) - phase;
        if (touched != 0 && start != first) flush(put);
        if (touched == 0) {
            first = start;
            weight = Float4{0.f, 0.f, 0.f, 0.f};
        }
        const unsigned bit = 1u << (x - start);
        weight.set(x - start, (touched & bit) ? weight[x - start] + w : w);
        touched |= bit;
    }
    template <typename Put> __device__ void flush(Put put) {
        if (touched != 0) put(first, touched, weight);
        touched = 0;
    }
};

/* row[first + j] += scale * weight[j] for each bit j of `touched` (a
 * CellWindow's window): one vector atomic where the device has them, the
 * window lies within the row's `width` cells and more than one cell is
 * touched; else an atomic per touched cell. The vector adds -0.0 to the
 * untouched cells of the window, which leaves their values as they were,
 * -0.0 included, but for what a GPU's float atomic add does to any operand:
 * a subnormal flushed to zero (atom.add.f32 flushes), a NaN made quiet. */
__device__ inline void add_window(float *row, int width, int first, unsigned touched,
                                  Float4 weight, float scale) {
#if MMD_CUDA_VECTOR_ATOMICS
    if ((touched & (touched - 1)) != 0 && first >= 0 && first <= width - 4) {
        const auto term = [&](int j) { return (touched >> j & 1u) ? scale * weight[j] : -0.f; };
        atomicAdd(reinterpret_cast<float4 *>(row + first),
                  make_float4(term(0), term(1), term(2), term(3)));
        return;
    }
#endif
#pragma unroll
    for (int j = 0; j < 4; ++j)
        if (touched >> j & 1u) atomicAdd(row + first + j, scale * weight[j]);
}

inline int launch_status(const char *what) {
    cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? MMD_OK : cuda_error(err, what);
}

}  // namespace mmd_cuda

#endif
