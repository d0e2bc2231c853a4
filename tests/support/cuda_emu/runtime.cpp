/* The CUDA emulator's runtime (tests/support/cuda_emu): fibers for the
 * threads of a block, the scheduler that runs them between synchronisation
 * points, the runtime API over host memory, and the list of kernels the
 * emulated CUDA files register, read by the tests through ctypes. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "cuda_runtime.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
/* a pool's freed blocks are poisoned, so that a kernel using scratch after
 * its free is still caught although the memory stays allocated */
#define MMD_EMU_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define MMD_EMU_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define MMD_EMU_POISON(p, n) ((void)(p), (void)(n))
#define MMD_EMU_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

/* A stream-ordered memory pool: the blocks freed into it, kept for reuse
 * until a synchronisation trims them to the release threshold. */
struct mmd_emu_pool {
    size_t threshold = 0;
    std::multimap<size_t, void *> free_blocks;   /* size -> block */
    size_t free_bytes = 0;
};

namespace mmd_emu {

namespace {

enum FiberState { RUNNABLE, WAITING, DONE };
constexpr size_t kStackBytes = 256 * 1024;

}  // namespace

struct Fiber {
    ucontext_t context;
    uint3 index;
    FiberState state;
    SyncKind kind;
    unsigned mask;
    uint64_t value, result;
    int src_lane;
};

Fiber *current = nullptr;
Block *block = nullptr;

uint3 current_thread_idx(void) { return current->index; }

namespace {

std::mutex g_launch_lock;   /* one launch at a time, whichever thread asks */
ucontext_t g_scheduler;
std::vector<Fiber> g_fibers;
std::vector<char *> g_stacks;
const std::function<void()> *g_body = nullptr;
/* what cudaFuncSetAttribute allowed each (kernel, device): a kernel's
 * attribute, as on a GPU, kept until set again (our launchers set it once
 * per kernel and device) */
std::mutex g_allowed_lock;
std::map<std::pair<const void *, int>, int> g_allowed_shared;
thread_local cudaError_t t_last_error = cudaSuccess;
thread_local int t_device = 0;

/* counters the tests read */
long long g_launches = 0, g_host_waits = 0;
std::mutex g_memory_lock;
std::set<void *> g_allocations;
/* pool allocations in use: block -> (pool, size); and every pool */
std::map<void *, std::pair<mmd_emu_pool *, size_t>> g_pool_blocks;
std::set<mmd_emu_pool *> g_pools;
/* pool allocations that found no freed block to reuse (on a GPU: memory
 * the pool had to map) */
long long g_pool_maps = 0;

/* Releases a pool's freed blocks until it keeps at most `keep` bytes
 * (g_memory_lock held). */
void trim_pool(mmd_emu_pool *pool, size_t keep) {
    while (pool->free_bytes > keep && !pool->free_blocks.empty()) {
        auto largest = std::prev(pool->free_blocks.end());
        MMD_EMU_UNPOISON(largest->second, largest->first);
        free(largest->second);
        pool->free_bytes -= largest->first;
        pool->free_blocks.erase(largest);
    }
}

/* A synchronisation: every pool keeps at most its release threshold. */
void trim_pools_at_synchronisation() {
    std::lock_guard<std::mutex> lock(g_memory_lock);
    for (mmd_emu_pool *pool : g_pools) trim_pool(pool, pool->threshold);
}

void fiber_main() {
    (*g_body)();
    current->state = DONE;   /* uc_link returns to the scheduler */
}

void fail(cudaError_t err, const char *why) {
    fprintf(stderr, "mmdispatch CUDA emulator: %s (block %u,%u,%u)\n", why,
            block ? block->block_idx.x : 0, block ? block->block_idx.y : 0,
            block ? block->block_idx.z : 0);
    t_last_error = err;
}

bool is_warp_kind(SyncKind kind) { return kind != SYNC_BLOCK_OR; }

/* The order in which the emulator runs things a GPU runs at once
 * (MMD_EMU_ORDER, read at each launch): "" or "forward": blocks, and a
 * block's runnable fibers between synchronisation points, in index order,
 * every warp waiting at a warp operation released together; "reverse":
 * blocks and fibers in reverse index order, and only the last warp that
 * can go on released at a time, so that it runs ahead of the others
 * through its warp operations up to the next block barrier; "shuffle:<seed>":
 * blocks in an order drawn for the launch, fibers in an order drawn anew
 * for each round, and each warp that can go on released with odds 1/2 (one
 * at least), all drawn from the seed and the launch's number. A kernel whose
 * results change with the order has a race a GPU can show: a read of
 * memory another thread writes with no barrier between them (the rounding
 * of float atomics aside). */
enum Order { ORDER_FORWARD, ORDER_REVERSE, ORDER_SHUFFLE };
Order g_order = ORDER_FORWARD;
std::mt19937_64 g_rng;
std::vector<int> g_sequence, g_warp_sequence;   /* this round's fibers and warps */

void read_order(void) {
    const char *env = getenv("MMD_EMU_ORDER");
    g_order = ORDER_FORWARD;
    if (!env || !*env || !strcmp(env, "forward")) return;
    if (!strcmp(env, "reverse")) {
        g_order = ORDER_REVERSE;
    } else if (!strncmp(env, "shuffle:", 8)) {
        g_order = ORDER_SHUFFLE;
        g_rng.seed(strtoull(env + 8, nullptr, 0));
    } else {
        static bool warned = false;
        if (!warned)
            fprintf(stderr, "mmdispatch CUDA emulator: MMD_EMU_ORDER=%s is not forward, "
                            "reverse or shuffle:<seed>; running forward\n", env);
        warned = true;
    }
}

/* 0..count-1 in the order's order: as they are, reversed or shuffled */
void in_order(std::vector<int> &sequence, int count) {
    sequence.resize(count);
    for (int i = 0; i < count; ++i) sequence[i] = g_order == ORDER_REVERSE ? count - 1 - i : i;
    if (g_order == ORDER_SHUFFLE) std::shuffle(sequence.begin(), sequence.end(), g_rng);
}

/* Releases the lanes of warp `w` waiting at one warp operation once every
 * lane of its mask is there; false where none could be released, and
 * *broken where the mask names a lane that exited or waits elsewhere. */
bool release_warp(int w, int threads, bool *broken) {
    const int first = w * 32, last = first + 32 < threads ? first + 32 : threads;
    Fiber *lead = nullptr;
    for (int i = first; i < last && !lead; ++i)
        if (g_fibers[i].state == WAITING && is_warp_kind(g_fibers[i].kind)) lead = &g_fibers[i];
    if (!lead) return false;
    const unsigned mask = lead->mask;
    for (int lane = 0; lane < 32; ++lane) {
        if (!((mask >> lane) & 1u) || first + lane >= last) continue;
        const Fiber &f = g_fibers[first + lane];
        if (f.state == RUNNABLE) return false;
        if (f.state == DONE || !is_warp_kind(f.kind) || f.kind != lead->kind || f.mask != mask) {
            *broken = true;
            return false;
        }
    }
    unsigned ballot = 0;
    for (int lane = 0; lane < 32 && first + lane < last; ++lane)
        if ((mask >> lane) & 1u && g_fibers[first + lane].value) ballot |= 1u << lane;
    for (int lane = 0; lane < 32 && first + lane < last; ++lane) {
        if (!((mask >> lane) & 1u)) continue;
        Fiber &f = g_fibers[first + lane];
        switch (lead->kind) {
        case SYNC_SHFL: {
            const int src = f.src_lane;
            f.result = first + src < last ? g_fibers[first + src].value : f.value;
            break;
        }
        case SYNC_MATCH_ANY: {
            unsigned same = 0;
            for (int other = 0; other < 32 && first + other < last; ++other)
                if ((mask >> other) & 1u && g_fibers[first + other].value == f.value)
                    same |= 1u << other;
            f.result = same;
            break;
        }
        case SYNC_BALLOT:
            f.result = ballot;
            break;
        default:
            f.result = 0;
        }
    }
    for (int lane = 0; lane < 32 && first + lane < last; ++lane)
        if ((mask >> lane) & 1u) g_fibers[first + lane].state = RUNNABLE;
    return true;
}

/* Runs one block to its end; false when its threads cannot go on. */
bool run_block(int threads) {
    for (int i = 0; i < threads; ++i) {
        Fiber &f = g_fibers[i];
        f.state = RUNNABLE;
        getcontext(&f.context);
        f.context.uc_stack.ss_sp = g_stacks[i];
        f.context.uc_stack.ss_size = kStackBytes;
        f.context.uc_link = &g_scheduler;
        makecontext(&f.context, fiber_main, 0);
    }
    for (;;) {
        in_order(g_sequence, threads);
        for (int i : g_sequence) {
            if (g_fibers[i].state != RUNNABLE) continue;
            current = &g_fibers[i];
            swapcontext(&g_scheduler, &g_fibers[i].context);
        }
        int live = 0, at_barrier = 0;
        uint64_t any = 0;
        for (int i = 0; i < threads; ++i) {
            if (g_fibers[i].state == DONE) continue;
            ++live;
            if (g_fibers[i].kind == SYNC_BLOCK_OR) {
                ++at_barrier;
                any |= g_fibers[i].value;
            }
        }
        if (live == 0) return true;
        if (at_barrier == live) {   /* exited threads do not hold a barrier up */
            for (int i = 0; i < threads; ++i) {
                if (g_fibers[i].state == DONE) continue;
                g_fibers[i].result = any;
                g_fibers[i].state = RUNNABLE;
            }
            continue;
        }
        bool released = false, broken = false;
        /* forward: every ready warp; reverse: only the last ready one;
         * shuffle: each ready one with odds 1/2, at least one */
        in_order(g_warp_sequence, (threads + 31) / 32);
        for (int w : g_warp_sequence) {
            if (released && g_order != ORDER_FORWARD && (g_order == ORDER_REVERSE || (g_rng() & 1)))
                continue;
            released |= release_warp(w, threads, &broken);
        }
        if (broken) {
            fail(cudaErrorIllegalInstruction,
                 "a warp operation's mask names a lane that exited or waits elsewhere");
            return false;
        }
        if (!released) {
            fail(cudaErrorLaunchFailure, "deadlock: threads wait at different barriers");
            return false;
        }
    }
}

}  // namespace

int current_lane(void) { return (int)(current - g_fibers.data()) % 32; }

uint64_t sync(SyncKind kind, unsigned mask, uint64_t value, int src_lane) {
    Fiber *f = current;
    f->kind = kind;
    f->mask = mask;
    f->value = value;
    f->src_lane = src_lane;
    f->state = WAITING;
    swapcontext(&f->context, &g_scheduler);
    return f->result;
}

void allow_dynamic_shared(const void *kernel, int bytes) {
    std::lock_guard<std::mutex> lock(g_allowed_lock);
    g_allowed_shared[{kernel, t_device}] = bytes;
}

bool launch(dim3 grid, dim3 block_dim, size_t shared, const void *kernel,
            const std::function<void()> &body) {
    int allowed = MMD_EMU_SHARED_PER_BLOCK;
    {
        std::lock_guard<std::mutex> lock(g_allowed_lock);
        const auto found = g_allowed_shared.find({kernel, t_device});
        if (found != g_allowed_shared.end()) allowed = found->second;
    }
    const unsigned long long threads =
        (unsigned long long)block_dim.x * block_dim.y * block_dim.z;
    if (threads == 0 || threads > MMD_EMU_MAX_THREADS || block_dim.z > 64 || grid.x == 0 ||
        grid.y == 0 || grid.z == 0 || grid.x > 2147483647u || grid.y > 65535 ||
        grid.z > 65535) {
        fail(cudaErrorInvalidConfiguration, "a launch CUDA refuses (grid or block size)");
        return false;
    }
    if (shared > (size_t)(allowed > MMD_EMU_SHARED_PER_BLOCK ? allowed
                                                             : MMD_EMU_SHARED_PER_BLOCK)) {
        fail(cudaErrorInvalidValue, "more dynamic shared memory than the kernel may have");
        return false;
    }
    std::lock_guard<std::mutex> lock(g_launch_lock);
    ++g_launches;
    while (g_stacks.size() < threads) {
        void *stack = mmap(nullptr, kStackBytes, PROT_READ | PROT_WRITE,
                           MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (stack == MAP_FAILED) {
            fail(cudaErrorMemoryAllocation, "no memory for the threads' stacks");
            return false;
        }
        g_stacks.push_back((char *)stack);
    }
    g_fibers.resize(threads);
    read_order();
    if (g_order == ORDER_SHUFFLE) g_rng.seed(g_rng() ^ (uint64_t)g_launches * 0x9e3779b97f4a7c15ull);
    std::vector<unsigned char> dynamic(shared + 16);
    Block state;
    state.block_dim = block_dim;
    state.grid_dim = grid;
    state.dynamic_shared = dynamic.data();
    g_body = &body;
    block = &state;
    bool ok = true;
    /* the blocks in order, reversed, or (shuffle) in an order drawn for the
     * launch (reversed past 2^24 blocks): a GPU runs them at once */
    const unsigned long long blocks = (unsigned long long)grid.x * grid.y * grid.z;
    std::vector<unsigned long long> block_order;
    if (g_order == ORDER_SHUFFLE && blocks <= (1ull << 24)) {
        block_order.resize(blocks);
        for (unsigned long long b = 0; b < blocks; ++b) block_order[b] = b;
        std::shuffle(block_order.begin(), block_order.end(), g_rng);
    }
    for (unsigned long long b = 0; b < blocks && ok; ++b) {
        const unsigned long long at = !block_order.empty() ? block_order[b]
                                      : g_order == ORDER_FORWARD ? b : blocks - 1 - b;
        const unsigned x = (unsigned)(at % grid.x), y = (unsigned)(at / grid.x % grid.y),
                       z = (unsigned)(at / grid.x / grid.y);
        state.block_idx = dim3(x, y, z);
        /* not zeros: a kernel that reads shared memory before writing it
         * reads NaN-like bytes, as it would read garbage on a GPU */
        memset(dynamic.data(), 0xff, dynamic.size());
        state.static_shared.clear();
        unsigned i = 0;
        for (unsigned tz = 0; tz < block_dim.z; ++tz)
            for (unsigned ty = 0; ty < block_dim.y; ++ty)
                for (unsigned tx = 0; tx < block_dim.x; ++tx)
                    g_fibers[i++].index = dim3(tx, ty, tz);
        ok = run_block((int)threads);
    }
    block = nullptr;
    current = nullptr;
    g_body = nullptr;
    return ok;
}

void misaligned(const char *what) { fail(cudaErrorMisalignedAddress, what); }

void shared_region(void *address, size_t size) {
    std::vector<const void *> &seen = block->static_shared;
    if (std::find(seen.begin(), seen.end(), address) != seen.end()) return;
    seen.push_back(address);
    memset(address, 0xff, size);
}

}  // namespace mmd_emu

using namespace mmd_emu;

cudaError_t cudaGetLastError(void) {
    const cudaError_t err = t_last_error;
    t_last_error = cudaSuccess;
    return err;
}

cudaError_t cudaPeekAtLastError(void) { return t_last_error; }

const char *cudaGetErrorName(cudaError_t err) {
    switch (err) {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInsufficientDriver: return "cudaErrorInsufficientDriver";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorIllegalInstruction: return "cudaErrorIllegalInstruction";
    case cudaErrorMisalignedAddress: return "cudaErrorMisalignedAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    }
    return "cudaErrorUnknown";
}

const char *cudaGetErrorString(cudaError_t err) {
    return err == cudaSuccess ? "no error" : cudaGetErrorName(err);
}

cudaError_t cudaGetDeviceCount(int *count) {
    *count = 1;
    return cudaSuccess;
}

cudaError_t cudaGetDevice(int *device) {
    *device = t_device;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device) {
    if (device != 0) return t_last_error = cudaErrorInvalidDevice;
    t_device = device;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int *version) {
    *version = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaRuntimeGetVersion(int *version) {
    *version = CUDART_VERSION;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp *prop, int device) {
    if (device != 0) return cudaErrorInvalidDevice;
    memset(prop, 0, sizeof *prop);
    snprintf(prop->name, sizeof prop->name, "mmdispatch CUDA emulator");
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = 132;
    prop->sharedMemPerBlock = MMD_EMU_SHARED_PER_BLOCK;
    prop->maxThreadsPerBlock = MMD_EMU_MAX_THREADS;
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int *value, cudaDeviceAttr attr, int device) {
    if (device != 0) return cudaErrorInvalidDevice;
    switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock: *value = MMD_EMU_MAX_THREADS; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = MMD_EMU_SHARED_PER_BLOCK; break;
    case cudaDevAttrMultiProcessorCount: *value = 132; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = MMD_EMU_SHARED_OPTIN; break;
    case cudaDevAttrMemoryPoolsSupported: *value = 1; break;
    default: return cudaErrorInvalidValue;
    }
    return cudaSuccess;
}

/* The capture mode (mmd_emu_capture): every stream capturing; the calls
 * a capture forbids (they synchronise, or allocate or copy outside stream
 * order) fail with cudaErrorStreamCaptureUnsupported, as CUDA's global
 * capture mode has them fail from any thread, and are counted. */
std::atomic<int> g_capturing{0};
std::atomic<long long> g_capture_violations{0};

bool capture_forbids(void) {
    if (!g_capturing.load()) return false;
    ++g_capture_violations;
    t_last_error = cudaErrorStreamCaptureUnsupported;
    return true;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus *status) {
    *status = g_capturing.load() ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
    return cudaSuccess;
}

/* Launches finish before they return: waiting is only counted. */
cudaError_t cudaDeviceSynchronize(void) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    ++g_host_waits;
    trim_pools_at_synchronisation();
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    ++g_host_waits;
    trim_pools_at_synchronisation();
    return cudaSuccess;
}

namespace {
/* cudaMalloc's and cudaMallocAsync's allocation (stream order is moot:
 * launches run at once) */
cudaError_t allocate(void **ptr, size_t size) {
    *ptr = aligned_alloc(256, ((size ? size : 1) + 255) / 256 * 256);
    if (!*ptr) return t_last_error = cudaErrorMemoryAllocation;
    std::lock_guard<std::mutex> lock(g_memory_lock);
    g_allocations.insert(*ptr);
    return cudaSuccess;
}
}  // namespace

cudaError_t cudaMalloc(void **ptr, size_t size) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    return allocate(ptr, size);
}

cudaError_t cudaMallocAsync(void **ptr, size_t size, cudaStream_t) { return allocate(ptr, size); }

namespace {
/* cudaFree's and cudaFreeAsync's release */
cudaError_t release(void *ptr) {
    if (!ptr) return cudaSuccess;
    {
        std::lock_guard<std::mutex> lock(g_memory_lock);
        if (g_allocations.erase(ptr) == 0) return t_last_error = cudaErrorInvalidValue;
        auto block = g_pool_blocks.find(ptr);
        if (block != g_pool_blocks.end()) {   /* back to its pool */
            mmd_emu_pool *pool = block->second.first;
            const size_t size = block->second.second;
            g_pool_blocks.erase(block);
            MMD_EMU_POISON(ptr, size);
            pool->free_blocks.emplace(size, ptr);
            pool->free_bytes += size;
            return cudaSuccess;
        }
    }
    free(ptr);
    return cudaSuccess;
}
}  // namespace

cudaError_t cudaFree(void *ptr) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    return release(ptr);
}

cudaError_t cudaFreeAsync(void *ptr, cudaStream_t) { return release(ptr); }

cudaError_t cudaMemPoolCreate(cudaMemPool_t *pool, const cudaMemPoolProps *props) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    if (props->allocType != cudaMemAllocationTypePinned ||
        props->location.type != cudaMemLocationTypeDevice || props->location.id != 0)
        return t_last_error = cudaErrorInvalidValue;
    std::lock_guard<std::mutex> lock(g_memory_lock);
    *pool = new mmd_emu_pool;
    g_pools.insert(*pool);
    return cudaSuccess;
}

cudaError_t cudaMemPoolDestroy(cudaMemPool_t pool) {
    std::lock_guard<std::mutex> lock(g_memory_lock);
    if (g_pools.erase(pool) == 0) return t_last_error = cudaErrorInvalidValue;
    trim_pool(pool, 0);
    delete pool;
    return cudaSuccess;
}

cudaError_t cudaMemPoolSetAttribute(cudaMemPool_t pool, cudaMemPoolAttr attr, void *value) {
    std::lock_guard<std::mutex> lock(g_memory_lock);
    if (g_pools.count(pool) == 0 || attr != cudaMemPoolAttrReleaseThreshold)
        return t_last_error = cudaErrorInvalidValue;
    pool->threshold = (size_t)*(unsigned long long *)value;
    return cudaSuccess;
}

cudaError_t cudaMemPoolTrimTo(cudaMemPool_t pool, size_t min_bytes_to_keep) {
    std::lock_guard<std::mutex> lock(g_memory_lock);
    if (g_pools.count(pool) == 0) return t_last_error = cudaErrorInvalidValue;
    trim_pool(pool, min_bytes_to_keep);
    return cudaSuccess;
}

/* Scratch allocations larger than this fail as a full device's would (0:
 * no limit; mmd_emu_limit_scratch). */
size_t g_scratch_limit = 0;

/* A freed block of the pool at least `size` bytes and at most twice that,
 * else new memory (counted); filled either way with bytes 0x41, so that a
 * kernel reading scratch it has not written reads garbage that is finite
 * (12.08 as a float, 8.0e5 as a double): a NaN would pass unseen through a
 * kernel that recomputes non-finite results another way. */
#define MMD_EMU_SCRATCH_FILL 0x41
cudaError_t cudaMallocFromPoolAsync(void **ptr, size_t size, cudaMemPool_t pool, cudaStream_t) {
    const size_t rounded = ((size ? size : 1) + 255) / 256 * 256;
    if (g_scratch_limit && size > g_scratch_limit) return t_last_error = cudaErrorMemoryAllocation;
    {
        std::lock_guard<std::mutex> lock(g_memory_lock);
        if (g_pools.count(pool) == 0) return t_last_error = cudaErrorInvalidValue;
        auto fit = pool->free_blocks.lower_bound(rounded);
        if (fit != pool->free_blocks.end() && fit->first <= 2 * rounded) {
            *ptr = fit->second;
            const size_t block = fit->first;
            pool->free_bytes -= block;
            pool->free_blocks.erase(fit);
            MMD_EMU_UNPOISON(*ptr, block);
            g_pool_blocks[*ptr] = {pool, block};
            g_allocations.insert(*ptr);
            memset(*ptr, MMD_EMU_SCRATCH_FILL, block);
            return cudaSuccess;
        }
    }
    *ptr = aligned_alloc(256, rounded);
    if (!*ptr) return t_last_error = cudaErrorMemoryAllocation;
    memset(*ptr, MMD_EMU_SCRATCH_FILL, rounded);
    std::lock_guard<std::mutex> lock(g_memory_lock);
    ++g_pool_maps;
    g_pool_blocks[*ptr] = {pool, rounded};
    g_allocations.insert(*ptr);
    return cudaSuccess;
}

cudaError_t cudaHostAlloc(void **ptr, size_t size, unsigned) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    *ptr = calloc(1, size ? size : 1);
    return *ptr ? cudaSuccess : cudaErrorMemoryAllocation;
}

cudaError_t cudaFreeHost(void *ptr) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    free(ptr);
    return cudaSuccess;
}

cudaError_t cudaHostGetDevicePointer(void **device, void *host, unsigned) {
    *device = host;
    return cudaSuccess;
}

cudaError_t cudaMemset(void *ptr, int value, size_t size) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    memset(ptr, value, size);
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void *ptr, int value, size_t size, cudaStream_t) {
    memset(ptr, value, size);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void *dst, const void *src, size_t size, cudaMemcpyKind) {
    if (capture_forbids()) return cudaErrorStreamCaptureUnsupported;
    ++g_host_waits;   /* a synchronous copy waits for the device */
    memmove(dst, src, size);
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void *dst, const void *src, size_t size, cudaMemcpyKind kind,
                            cudaStream_t) {
    /* a copy to the host in a capture is legal into pinned memory only;
     * ours (strict mode's verdict) goes to pageable memory */
    if (kind == cudaMemcpyDeviceToHost && capture_forbids())
        return cudaErrorStreamCaptureUnsupported;
    memmove(dst, src, size);
    return cudaSuccess;
}

/* A stand-in for cuBLAS (src/cuda/cublas.cu takes it in the emulator's
 * build while the tests switch it on): reference column-major products
 * that refuse what cuBLAS refuses (leading dimensions below the rows of
 * what they describe, a batch count below 0) and read c only where beta
 * is not 0, as BLAS defines them; the strided batched ones, one product
 * per batch at its strides, unless the tests leave them out. Under TF32
 * math (cublasSetMathMode) float products round their operands to TF32's
 * 10 mantissa bits (to nearest) first, and are counted. */
namespace {
int g_cublas_on = 0;   /* 0 off, 1 on, 2 on without the strided batched products */
long long g_cublas_calls = 0;
long long g_cublas_tf32_calls = 0;   /* float products under TF32 math */
int g_cublas_math = 0;               /* the one handle's math mode */

int emu_cublas_create(void **handle) {
    static int one_handle;
    *handle = &one_handle;
    return 0;
}

int emu_cublas_set_stream(void *, cudaStream_t) { return 0; }

int emu_cublas_set_math_mode(void *, int mode) {
    if (mode != 0 && mode != 3) return 7;   /* CUBLAS_STATUS_INVALID_VALUE: not a mode used */
    g_cublas_math = mode;
    return 0;
}

template <typename T> T emu_operand(T value) { return value; }
template <> float emu_operand(float value) {
    if (g_cublas_math != 3 || !isfinite(value)) return value;
    uint32_t bits;
    memcpy(&bits, &value, 4);
    bits = (bits + 0xfffu + ((bits >> 13) & 1u)) & ~0x1fffu;   /* to nearest, ties to even */
    memcpy(&value, &bits, 4);
    return value;
}

template <typename T>
void emu_product(int trans_a, int trans_b, int m, int n, int k, const T *alpha, const T *a,
                 int lda, const T *b, int ldb, const T *beta, T *c, int ldc) {
    for (int j = 0; j < n; ++j)
        for (int i = 0; i < m; ++i) {
            T sum = 0;
            for (int l = 0; l < k; ++l)
                sum += emu_operand(trans_a ? a[l + (size_t)i * lda] : a[i + (size_t)l * lda]) *
                       emu_operand(trans_b ? b[j + (size_t)l * ldb] : b[l + (size_t)j * ldb]);
            T *out = c + i + (size_t)j * ldc;
            *out = *alpha * sum + (*beta == 0 ? (T)0 : *beta * *out);
        }
}

bool emu_refuses(int trans_a, int trans_b, int m, int n, int k, int lda, int ldb, int ldc) {
    const int rows_a = trans_a ? k : m, rows_b = trans_b ? n : k;
    return m < 0 || n < 0 || k < 0 || lda < (rows_a > 1 ? rows_a : 1) ||
           ldb < (rows_b > 1 ? rows_b : 1) || ldc < (m > 1 ? m : 1);
}

template <typename T>
int emu_gemm(void *, int trans_a, int trans_b, int m, int n, int k, const T *alpha, const T *a,
             int lda, const T *b, int ldb, const T *beta, T *c, int ldc) {
    if (emu_refuses(trans_a, trans_b, m, n, k, lda, ldb, ldc))
        return 7;   /* CUBLAS_STATUS_INVALID_VALUE */
    ++g_cublas_calls;
    g_cublas_tf32_calls += sizeof(T) == 4 && g_cublas_math == 3;
    emu_product(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    return 0;
}

template <typename T>
int emu_gemm_batched(void *, int trans_a, int trans_b, int m, int n, int k, const T *alpha,
                     const T *a, int lda, long long stride_a, const T *b, int ldb,
                     long long stride_b, const T *beta, T *c, int ldc, long long stride_c,
                     int batches) {
    if (batches < 0 || emu_refuses(trans_a, trans_b, m, n, k, lda, ldb, ldc)) return 7;
    ++g_cublas_calls;
    g_cublas_tf32_calls += sizeof(T) == 4 && g_cublas_math == 3;
    for (int i = 0; i < batches; ++i)
        emu_product(trans_a, trans_b, m, n, k, alpha, a + i * stride_a, lda, b + i * stride_b, ldb,
                    beta, c + i * stride_c, ldc);
    return 0;
}
}  // namespace

/* What the tests read (tests/support/cuda_emu/__init__.py). */
namespace {
struct Recorded {
    std::string op, origin;
    int device_type, backend;
    void *fn;
};
std::vector<Recorded> g_recorded;
}  // namespace

extern "C" {

int mmd_error(int status, const char *fmt, ...);   /* src/core/errors.c, this library's copy */

/* Empties this thread's error message, so that a message after a failed
 * call is known to come from a kernel of this library. */
void mmd_emu_clear_error(void) { mmd_error(0, "%s", ""); }

void mmd_emu_record(const char *op, int device_type, int backend, void *fn, const char *origin) {
    g_recorded.push_back(Recorded{op, origin, device_type, backend, fn});
}

int mmd_emu_kernel_count(void) { return (int)g_recorded.size(); }
const char *mmd_emu_kernel_op(int i) { return g_recorded[i].op.c_str(); }
const char *mmd_emu_kernel_origin(int i) { return g_recorded[i].origin.c_str(); }
int mmd_emu_kernel_backend(int i) { return g_recorded[i].backend; }
void *mmd_emu_kernel_fn(int i) { return g_recorded[i].fn; }

long long mmd_emu_launches(void) { return g_launches; }
void mmd_emu_capture(int on) { g_capturing.store(on); }
long long mmd_emu_capture_violations(void) { return g_capture_violations.load(); }
long long mmd_emu_host_waits(void) { return g_host_waits; }
int mmd_emu_cublas_functions(void **create, void **set_stream, void **sgemm, void **dgemm,
                             void **sgemm_batched, void **dgemm_batched, void **set_math_mode) {
    if (!g_cublas_on) return 0;
    *set_math_mode = (void *)emu_cublas_set_math_mode;
    *create = (void *)emu_cublas_create;
    *set_stream = (void *)emu_cublas_set_stream;
    *sgemm = (void *)emu_gemm<float>;
    *dgemm = (void *)emu_gemm<double>;
    const bool batched = g_cublas_on == 1;
    *sgemm_batched = batched ? (void *)emu_gemm_batched<float> : nullptr;
    *dgemm_batched = batched ? (void *)emu_gemm_batched<double> : nullptr;
    return 1;
}
void mmd_emu_use_cublas(int on) { g_cublas_on = on; }
void mmd_emu_limit_scratch(long long bytes) { g_scratch_limit = (size_t)bytes; }
long long mmd_emu_cublas_calls(void) { return g_cublas_calls; }
long long mmd_emu_cublas_tf32_calls(void) { return g_cublas_tf32_calls; }

long long mmd_emu_pool_maps(void) {
    std::lock_guard<std::mutex> lock(g_memory_lock);
    return g_pool_maps;
}
long long mmd_emu_pool_kept_bytes(void) {
    std::lock_guard<std::mutex> lock(g_memory_lock);
    long long kept = 0;
    for (mmd_emu_pool *pool : g_pools) kept += (long long)pool->free_bytes;
    return kept;
}
long long mmd_emu_live_allocations(void) {
    std::lock_guard<std::mutex> lock(g_memory_lock);
    return (long long)g_allocations.size();
}

}
