/* The CPU kernels' parallel loops (src/core/parallel.c).
 *
 * mmd_parallel_for runs a loop on the calling thread and on a pool of worker
 * threads that take its items in chunks. Unlike an OpenMP region, whose end
 * waits for every thread of the team, the caller never waits for a worker
 * that has not started: a worker joins a loop only by claiming a chunk of
 * it, and the caller, once no chunk is left, waits only for the chunks
 * being run. On a machine whose cores are busy, a worker the scheduler has
 * not run yet leaves its share to the threads that are running, instead of
 * stalling the call by a scheduler time slice (milliseconds). Idle workers
 * sleep (after polling for 50 microseconds). */
#ifndef MMDISPATCH_PARALLEL_H
#define MMDISPATCH_PARALLEL_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Runs items [begin, end) of a loop; returns MMD_OK or an error status (set
 * with mmd_error), which stops the loop from starting further chunks. */
typedef int (*mmd_range_fn)(const void *loop, int64_t begin, int64_t end);

/* Runs fn over [0, items) in chunks of `chunk` items (the last shorter):
 * on the pool when `parallel` and it has workers, else in order on the
 * calling thread (also when another thread's loop holds the pool). Returns
 * MMD_OK or the first error a chunk returned, its message set for the
 * caller's thread. */
int mmd_parallel_for(int64_t items, int64_t chunk, int parallel, mmd_range_fn fn,
                     const void *loop);

/* Threads a loop may use, the caller's included: OMP_NUM_THREADS when set
 * (as OpenMP programs take it), else the CPUs this process may run on. */
int mmd_max_threads(void);

/* Whether `items` independent items of `work` elementary steps in all are
 * worth sharing out: waking a worker costs about as much as a few thousand
 * steps, and a single item cannot be shared. */
static inline int mmd_worth_threads(int64_t items, int64_t work) {
    return items > 1 && work >= 4096;
}

/* A hint that the 64-byte line at `address` will be read soon; loops that
 * read a block at scattered places issue it for the next block. */
static inline void mmd_prefetch(const void *address) {
#if defined(__GNUC__) || defined(__clang__)
    __builtin_prefetch(address);
#else
    (void)address;
#endif
}

/* Prefetches every 64-byte line of [start, start + bytes). */
static inline void mmd_prefetch_bytes(const void *start, int64_t bytes) {
    const uintptr_t first = (uintptr_t)start & ~(uintptr_t)63;
    for (uintptr_t line = first; line < (uintptr_t)start + (uintptr_t)bytes; line += 64)
        mmd_prefetch((const void *)line);
}

/* In the body of a loop over `index`, keeps the compiler from vectorising
 * it (the index becomes opaque to it): for loops of a few iterations,
 * whose vector prologue and epilogue cost more than they save, and for
 * read-modify-write loops whose next run loads, as a vector, cells that
 * the last run stored one at a time, a load the CPU cannot take from its
 * store buffer. GCC and clang; elsewhere nothing. */
#if defined(__GNUC__) || defined(__clang__)
#define MMD_SCALAR_LOOP(index) __asm__("" : "+r"(index))
#else
#define MMD_SCALAR_LOOP(index) ((void)0)
#endif

/* Before a hot kernel function: it is compiled for AVX2, for SSE4.2 and
 * for baseline x86-64 (SSE2), and the first of these the CPU has is chosen
 * when the library loads (target_clones, an ifunc: GCC 8+ or clang 14+,
 * glibc, x86-64). The versions run the same source; the newer sets do its
 * selects and blends in fewer instructions (SSE2 has no blend and only
 * two-operand forms). None of them enables FMA, so results are the same
 * bits. What the function calls is compiled into each version only where
 * it is inlined: declare its helpers MMD_INLINE. Elsewhere nothing. */
#if defined(__x86_64__) && defined(__linux__) && defined(__GLIBC__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define MMD_X86_CLONES __attribute__((target_clones("avx2", "sse4.2", "default")))
#endif
#endif
#ifndef MMD_X86_CLONES
#define MMD_X86_CLONES
#endif
#if defined(__GNUC__) || defined(__clang__)
#define MMD_INLINE inline __attribute__((always_inline))
#else
#define MMD_INLINE inline
#endif

/* A chunk size for `items` even items: about 8 chunks per thread, so that
 * a thread that starts late or runs slow holds up little. */
static inline int64_t mmd_even_chunk(int64_t items) {
    const int64_t chunk = items / (8 * (int64_t)mmd_max_threads());
    return chunk > 0 ? chunk : 1;
}

#ifdef __cplusplus
}

/* mmd_parallel_for over a callable: range(begin, end) returns MMD_OK or an
 * error status, as an mmd_range_fn does. */
template <typename Range>
inline int mmd_parallel_for(int64_t items, int64_t chunk, int parallel, const Range &range) {
    const mmd_range_fn run = [](const void *loop, int64_t begin, int64_t end) -> int {
        return (*static_cast<const Range *>(loop))(begin, end);
    };
    return mmd_parallel_for(items, chunk, parallel, run, &range);
}

/* Prefetches the `bytes` from `block` one 64-byte line per step(), and the
 * rest at finish(): a loop that reads one block at scattered places, which
 * the hardware does not prefetch, steps it through the next block. With
 * `blocks` blocks `stride` bytes apart, a step takes the same line of each. */
struct mmd_block_prefetch {
    const char *block;
    int64_t line, lines, blocks, stride;

    mmd_block_prefetch(const void *start, int64_t bytes, int64_t count = 1, int64_t step_bytes = 0)
        : block((const char *)start), line(0), lines((bytes + 63) / 64), blocks(count),
          stride(step_bytes) {}
    void step() {
        if (line >= lines) return;
        for (int64_t b = 0; b < blocks; ++b) mmd_prefetch(block + b * stride + 64 * line);
        ++line;
    }
    void finish() {
        while (line < lines) step();
    }
};
#endif

#endif
