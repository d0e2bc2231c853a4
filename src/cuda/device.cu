/* The CUDA device module: the CUDA slots are filled only when the runtime
 * finds a driver and at least one device (asked the first time CUDA is
 * needed, never at import). The runtime is linked statically, so a machine
 * without a GPU or toolkit still imports the extension.
 *
 * Also each device's deferred-error state (mmdispatch/deferred.h): an error
 * word in device memory, which kernels fold the keys of bad items into,
 * and a flag in mapped host memory, which they set, so that every call can
 * test for a pending error with one host load and no synchronisation.
 *
 * And each device's scratch pool (scratch_pool): the temporary memory of
 * the kernels (nms masks, deform_conv2d columns, sort scratch) comes from
 * a stream-ordered pool of mmdispatch's own that keeps up to
 * kScratchKeepBytes of freed memory across synchronisations, so a call
 * after a synchronisation reuses it instead of mapping it again (CUDA's
 * default pool keeps nothing: its release threshold is 0). It holds no
 * memory before the first call that needs scratch; mmd_cuda_empty_cache
 * (mmdispatch.empty_cache) returns what it keeps. */
#include <cuda_runtime.h>
#include <stdio.h>
#include <string.h>

#include <mutex>

#include "mmdispatch/cuda/common.cuh"

extern "C" int mmd_cuda_init(char *status, size_t size, int *device_count) {
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    *device_count = err == cudaSuccess ? count : 0;
    if (err == cudaErrorInsufficientDriver) {
        int driver = 0;
        cudaDriverGetVersion(&driver);
        if (driver == 0)   /* no libcuda at all: most often a machine without a GPU */
            snprintf(status, size,
                     "no NVIDIA driver is installed (no GPU on this machine?); the CUDA "
                     "kernels need a GPU and a driver supporting CUDA %d.%d or newer",
                     CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10);
        else
            snprintf(status, size,
                     "the NVIDIA driver supports CUDA %d.%d, older than the CUDA %d.%d these "
                     "kernels were built with: update the driver",
                     driver / 1000, (driver % 1000) / 10, CUDART_VERSION / 1000,
                     (CUDART_VERSION % 1000) / 10);
        cudaGetLastError();
        return 1;
    }
    if (err == cudaErrorNoDevice || (err == cudaSuccess && count == 0)) {
        snprintf(status, size, "no CUDA device is visible (check the GPU and CUDA_VISIBLE_DEVICES)");
        cudaGetLastError();
        return 1;
    }
    if (err != cudaSuccess) {
        snprintf(status, size, "the CUDA runtime failed to start: %s (%s)",
                 cudaGetErrorString(err), cudaGetErrorName(err));
        cudaGetLastError();
        return 1;
    }
    int driver = 0;
    cudaDriverGetVersion(&driver);
    size_t used = (size_t)snprintf(status, size, "available; %d device(s), driver CUDA %d.%d:",
                                   count, driver / 1000, (driver % 1000) / 10);
    for (int d = 0; d < count && used < size; ++d) {
        cudaDeviceProp prop;
        if (cudaGetDeviceProperties(&prop, d) != cudaSuccess) continue;
        used += (size_t)snprintf(status + used, size - used, " cuda:%d %s (sm_%d%d)", d,
                                 prop.name, prop.major, prop.minor);
    }
    return 0;
}

namespace mmd_cuda {

std::atomic<int *> g_error_flags[kMaxDevices];
std::atomic<bool> g_device_used[kMaxDevices];

namespace {

struct DeviceErrors {
    std::mutex init_lock;
    std::atomic<bool> ready{false};        /* the state below is allocated */
    unsigned long long *word = nullptr;    /* device memory; MMD_DEFERRED_NONE when clear */
    unsigned long long *taken = nullptr;   /* mapped host memory: take_kernel's answer */
    unsigned long long *taken_dev = nullptr;
    int *flag = nullptr;                   /* mapped host memory, right after `taken` */
    int *flag_dev = nullptr;
    std::mutex take_lock;
};

DeviceErrors g_errors[kMaxDevices];

__global__ void take_kernel(unsigned long long *word, unsigned long long *out) {
    *out = atomicExch(word, (unsigned long long)MMD_DEFERRED_NONE);
}

cudaError_t allocate_state(int device, DeviceErrors &e) {
    void *host = nullptr, *mapped = nullptr;
    unsigned long long *word = nullptr;
    cudaError_t err = cudaMalloc((void **)&word, sizeof *word);
    if (err == cudaSuccess) err = cudaMemset(word, 0xff, sizeof *word);
    if (err == cudaSuccess) err = cudaHostAlloc(&host, 2 * sizeof *e.taken, cudaHostAllocMapped);
    if (err == cudaSuccess) err = cudaHostGetDevicePointer(&mapped, host, 0);
    /* the word must be clear before any stream, non-blocking ones too, uses it */
    if (err == cudaSuccess) err = cudaDeviceSynchronize();
    if (err != cudaSuccess) {   /* nothing kept: a later call tries again */
        cudaGetLastError();
        if (host) cudaFreeHost(host);
        if (word) cudaFree(word);
        cudaGetLastError();
        return err;
    }
    e.word = word;
    e.taken = (unsigned long long *)host;
    e.taken_dev = (unsigned long long *)mapped;
    e.flag = (int *)(e.taken + 1);
    e.flag_dev = (int *)(e.taken_dev + 1);
    *(volatile int *)e.flag = 0;
    g_error_flags[device].store(e.flag, std::memory_order_release);
    return cudaSuccess;
}

}  // namespace

bool capturing(cudaStream_t stream) {
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    const cudaError_t err = cudaStreamIsCapturing(stream, &status);
    if (err == cudaSuccess) return status != cudaStreamCaptureStatusNone;
    cudaGetLastError();
    /* the legacy stream, asked while a blocking stream captures */
    return err == cudaErrorStreamCaptureImplicit;
}

int prepare_device(int device, cudaStream_t stream) {
    if (device < 0 || device >= kMaxDevices)
        return mmd_error(MMD_ERR_RUNTIME, "cuda:%d: mmdispatch supports CUDA devices 0 to %d",
                         device, kMaxDevices - 1);
    DeviceErrors &e = g_errors[device];
    if (e.ready.load(std::memory_order_acquire)) return MMD_OK;
    std::lock_guard<std::mutex> lock(e.init_lock);
    if (e.ready.load(std::memory_order_relaxed)) return MMD_OK;
    /* allocating and clearing the word waits for the device, which a
     * capture forbids (from any thread, in its global mode) */
    if (capturing(stream))
        return mmd_error(MMD_ERR_RUNTIME,
                         "the first mmdispatch call on cuda:%d cannot be captured into a CUDA "
                         "graph (it allocates the device's state and waits for the device): "
                         "make one call of any mmdispatch op on the device before capturing",
                         device);
    const cudaError_t err = allocate_state(device, e);
    if (err != cudaSuccess)
        return cuda_error(err, "allocating the device's deferred-error word");
    scratch_pool(device);   /* outside a capture: the calls' scratch comes later */
    e.ready.store(true, std::memory_order_release);
    return MMD_OK;
}

int error_sink(int device, uint32_t seq, ErrorSink *sink) {
    const int s = prepare_device(device, nullptr);
    if (s) return s;
    const DeviceErrors &e = g_errors[device];
    *sink = ErrorSink{e.word, e.flag_dev, seq};
    return MMD_OK;
}

int take_pending(int device, cudaStream_t stream, const char *raised_by) {
    DeviceErrors &e = g_errors[device];
    if (g_error_flags[device].load(std::memory_order_acquire) == nullptr) return MMD_OK;
    /* taking it waits for the device, which a capture forbids: it stays
     * pending for a call outside the capture (or synchronize()) */
    if (raised_by != nullptr && capturing(stream)) return MMD_OK;
    std::lock_guard<std::mutex> lock(e.take_lock);
    if (*(volatile int *)e.flag == 0) return MMD_OK;   /* another thread took it */
    /* Every kernel that may still report must finish first, so that the
     * word holds the earliest call's lowest bad item. */
    cudaError_t err = cudaDeviceSynchronize();
    if (err != cudaSuccess) return cuda_error(err, "waiting for the device's kernels");
    *(volatile int *)e.flag = 0;   /* a report from now on sets it again */
    take_kernel<<<1, 1, 0, stream>>>(e.word, e.taken_dev);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaStreamSynchronize(stream);
    if (err != cudaSuccess) return cuda_error(err, "reading the deferred-error word");
    const unsigned long long key = *(volatile unsigned long long *)e.taken;
    if (key == MMD_DEFERRED_NONE) return MMD_OK;
    char name[32];
    snprintf(name, sizeof name, "cuda:%d", device);
    return mmd_deferred_raise(key, name, raised_by);
}

namespace {

struct Scratch {
    std::once_flag once;
    std::atomic<cudaMemPool_t> pool{nullptr};
};

Scratch g_scratch[kMaxDevices];

/* A pool of device memory that keeps kScratchKeepBytes across
 * synchronisations, or null where the device has no memory pools. */
cudaMemPool_t create_scratch_pool(int device) {
    int supported = 0;
    cudaError_t err = cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device);
    cudaMemPool_t pool = nullptr;
    if (err == cudaSuccess && supported) {
        cudaMemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = device;
        err = cudaMemPoolCreate(&pool, &props);
        if (err == cudaSuccess) {
            unsigned long long keep = kScratchKeepBytes;
            err = cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &keep);
            if (err != cudaSuccess) {   /* a pool that keeps nothing gains nothing */
                cudaMemPoolDestroy(pool);
                pool = nullptr;
            }
        } else {
            pool = nullptr;
        }
    }
    if (err != cudaSuccess) cudaGetLastError();   /* no pool is not an error of the call */
    return pool;
}

}  // namespace

cudaMemPool_t scratch_pool(int device) {
    if ((unsigned)device >= (unsigned)kMaxDevices) return nullptr;
    Scratch &s = g_scratch[device];
    std::call_once(s.once, [&] { s.pool.store(create_scratch_pool(device)); });
    return s.pool.load(std::memory_order_relaxed);
}

}  // namespace mmd_cuda

namespace {

/* Runs f(d) with device d current and synchronised, for `device_id`, or,
 * when negative, for every device `wanted(d)` names; the first failure's
 * status. */
template <typename Wanted, typename F> int on_each_device(int device_id, Wanted wanted, F f) {
    using namespace mmd_cuda;
    int count = 0;
    cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
        cudaGetLastError();
        return cuda_error(err, "cudaGetDeviceCount");
    }
    if (device_id >= count)
        return mmd_error(MMD_ERR_VALUE, "cuda:%d does not exist: this machine has %d CUDA "
                         "device(s)", device_id, count);
    for (int d = device_id < 0 ? 0 : device_id; d < (device_id < 0 ? count : device_id + 1); ++d) {
        if (device_id < 0 && !wanted(d)) continue;
        DeviceGuard guard(d);
        if (guard.error() != cudaSuccess) return cuda_error(guard.error(), "cudaSetDevice");
        err = cudaDeviceSynchronize();
        if (err != cudaSuccess) return cuda_error(err, "cudaDeviceSynchronize");
        const int s = f(d);
        if (s) return s;
    }
    return MMD_OK;
}

}  // namespace

/* mmdispatch.empty_cache() on CUDA: waits for `device_id` (every device
 * mmdispatch has made a scratch pool on, when negative), so that every
 * stream-ordered free has happened, then returns the memory its scratch
 * pool keeps to the driver. */
extern "C" int mmd_cuda_empty_cache(int device_id) {
    using namespace mmd_cuda;
    auto pool_of = [](int d) {
        return d < kMaxDevices ? g_scratch[d].pool.load() : (cudaMemPool_t) nullptr;
    };
    return on_each_device(device_id, [&](int d) { return pool_of(d) != nullptr; }, [&](int d) {
        const cudaMemPool_t pool = pool_of(d);
        const cudaError_t err = pool ? cudaMemPoolTrimTo(pool, 0) : cudaSuccess;
        return err == cudaSuccess ? MMD_OK : cuda_error(err, "releasing the scratch pool");
    });
}

/* mmdispatch.synchronize() on CUDA: waits for every kernel queued on
 * `device_id` (every device mmdispatch has run on, when negative), then
 * raises the deferred error any of them left. */
extern "C" int mmd_cuda_synchronize(int device_id) {
    using namespace mmd_cuda;
    return on_each_device(
        device_id, [](int d) { return d < kMaxDevices && g_device_used[d].load(); },
        [](int d) {
            if (d < kMaxDevices && g_error_flags[d].load() != nullptr)
                return take_pending(d, 0, nullptr);
            return (int)MMD_OK;
        });
}
