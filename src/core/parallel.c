/* The worker pool behind mmd_parallel_for (mmdispatch/parallel.h).
 *
 * One loop at a time runs on the pool (a caller that finds it taken runs
 * its loop alone). The caller publishes the loop and wakes the workers,
 * then runs chunks itself. A worker that wakes takes the pool lock, and
 * only while the loop is open claims a chunk and counts itself running;
 * the caller closes the loop under that lock once it finds no chunk left
 * and waits for the running count alone. A worker the scheduler has not
 * run by then finds the loop closed and goes back to sleep. After a loop,
 * workers and the caller poll for kPollNanoseconds before they block, so
 * back-to-back calls skip the futex round trips. Workers are started on the
 * first parallel loop, and again in a child after fork. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "mmdispatch/parallel.h"
#include "mmdispatch/tensor.h"

static struct {
    pthread_mutex_t lock;        /* guards everything below but `next` and `status` */
    pthread_cond_t wake;         /* workers: a new loop was published */
    pthread_cond_t finished;     /* the caller: no worker is running any more */
    pthread_mutex_t owner;       /* held by the thread whose loop uses the pool */
    int workers;                 /* worker threads started */
    _Atomic unsigned long generation;   /* loops published so far (changed under the lock) */
    int open;                    /* workers may still join the current loop */
    _Atomic int running;         /* workers inside it (changed under the lock) */
    mmd_range_fn fn;
    const void *loop;
    int64_t items, chunk;
    _Atomic int64_t next;        /* first item not yet claimed */
    _Atomic int status;          /* the loop's first error */
    char message[1024];          /* its message (mmd_error's text is per thread) */
} pool = {.lock = PTHREAD_MUTEX_INITIALIZER,
          .wake = PTHREAD_COND_INITIALIZER,
          .finished = PTHREAD_COND_INITIALIZER,
          .owner = PTHREAD_MUTEX_INITIALIZER};

static int max_threads;
static pthread_once_t max_threads_once = PTHREAD_ONCE_INIT;
static pthread_once_t atfork_once = PTHREAD_ONCE_INIT;

static void read_max_threads(void) {
    const char *env = getenv("OMP_NUM_THREADS");
    long n = env ? strtol(env, NULL, 10) : 0;   /* "4,2" (nested levels): the first */
    if (n < 1) {
        cpu_set_t cpus;
        n = sched_getaffinity(0, sizeof cpus, &cpus) == 0 ? CPU_COUNT(&cpus) : 1;
    }
    max_threads = n < 1 ? 1 : (n > 1024 ? 1024 : (int)n);
}

int mmd_max_threads(void) {
    pthread_once(&max_threads_once, read_max_threads);
    return max_threads;
}

/* Runs the chunk at `begin` (already claimed), then claims and runs more
 * until none is left or a chunk failed. */
static void run_chunks(int64_t begin) {
    const int64_t items = pool.items, chunk = pool.chunk;
    for (; begin < items; begin = atomic_fetch_add(&pool.next, chunk)) {
        if (atomic_load_explicit(&pool.status, memory_order_relaxed)) return;
        const int64_t end = items - begin > chunk ? begin + chunk : items;
        const int s = pool.fn(pool.loop, begin, end);
        if (s) {
            int expected = MMD_OK;
            if (atomic_compare_exchange_strong(&pool.status, &expected, s))
                snprintf(pool.message, sizeof pool.message, "%s", mmd_last_error());
            return;
        }
    }
}

/* How long a thread polls before it sleeps: about a mid-size call. */
enum { kPollNanoseconds = 50000 };

static int64_t nanoseconds_since(const struct timespec *start) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (now.tv_sec - start->tv_sec) * 1000000000L + (now.tv_nsec - start->tv_nsec);
}

static int generation_is(unsigned long seen) {
    return atomic_load_explicit(&pool.generation, memory_order_acquire) == seen;
}

static int workers_running(unsigned long unused) {
    (void)unused;
    return atomic_load_explicit(&pool.running, memory_order_acquire) > 0;
}

/* Polls while waiting(arg), for at most kPollNanoseconds. */
static void poll_briefly(int (*waiting)(unsigned long), unsigned long arg) {
    struct timespec start;
    clock_gettime(CLOCK_MONOTONIC, &start);
    for (unsigned i = 1; waiting(arg); ++i)
        if (i % 64 == 0 && nanoseconds_since(&start) > kPollNanoseconds) return;
}

/* `first_unseen`: the generation before the loop that started the worker,
 * so that it joins that loop too. */
static void *worker(void *first_unseen) {
    unsigned long seen = (unsigned long)(uintptr_t)first_unseen;
    pthread_mutex_lock(&pool.lock);
    for (;;) {
        if (pool.generation == seen) {
            /* back-to-back calls: a worker still awake joins the next one
             * without a futex wake-up */
            pthread_mutex_unlock(&pool.lock);
            poll_briefly(generation_is, seen);
            pthread_mutex_lock(&pool.lock);
        }
        while (pool.generation == seen) pthread_cond_wait(&pool.wake, &pool.lock);
        seen = pool.generation;
        if (!pool.open) continue;   /* woken too late: the caller has finished it */
        const int64_t begin = atomic_fetch_add(&pool.next, pool.chunk);
        if (begin >= pool.items) continue;
        pool.running++;
        pthread_mutex_unlock(&pool.lock);
        run_chunks(begin);
        pthread_mutex_lock(&pool.lock);
        if (--pool.running == 0 && !pool.open) pthread_cond_signal(&pool.finished);
    }
    return NULL;
}

/* In a child after fork only the forking thread exists: the pool starts over. */
static void reset_in_child(void) {
    pthread_mutex_init(&pool.lock, NULL);
    pthread_mutex_init(&pool.owner, NULL);
    pthread_cond_init(&pool.wake, NULL);
    pthread_cond_init(&pool.finished, NULL);
    pool.workers = 0;
    pool.open = 0;
    pool.running = 0;
}

static void register_atfork(void) { pthread_atfork(NULL, NULL, reset_in_child); }

/* Starts the workers (mmd_max_threads() - 1) not started yet; call with
 * pool.lock held. Workers block every signal, so that signals reach the
 * interpreter's threads. Returns how many there are. */
static int start_workers(void) {
    pthread_once(&atfork_once, register_atfork);
    const int wanted = mmd_max_threads() - 1;
    if (pool.workers >= wanted) return pool.workers;
    sigset_t all, previous;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &previous);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
    while (pool.workers < wanted) {
        pthread_t thread;
        if (pthread_create(&thread, &attr, worker, (void *)(uintptr_t)pool.generation) != 0)
            break;
        pool.workers++;
    }
    pthread_attr_destroy(&attr);
    pthread_sigmask(SIG_SETMASK, &previous, NULL);
    return pool.workers;
}


static int run_alone(int64_t items, int64_t chunk, mmd_range_fn fn, const void *loop) {
    for (int64_t begin = 0; begin < items; begin += chunk) {
        const int s = fn(loop, begin, items - begin > chunk ? begin + chunk : items);
        if (s) return s;
    }
    return MMD_OK;
}

int mmd_parallel_for(int64_t items, int64_t chunk, int parallel, mmd_range_fn fn,
                     const void *loop) {
    if (chunk < 1) chunk = 1;
    if (!parallel || items <= chunk || mmd_max_threads() < 2 ||
        pthread_mutex_trylock(&pool.owner) != 0)
        return run_alone(items, chunk, fn, loop);
    pthread_mutex_lock(&pool.lock);
    if (start_workers() == 0) {
        pthread_mutex_unlock(&pool.lock);
        pthread_mutex_unlock(&pool.owner);
        return run_alone(items, chunk, fn, loop);
    }
    pool.fn = fn;
    pool.loop = loop;
    pool.items = items;
    pool.chunk = chunk;
    atomic_store(&pool.next, chunk);   /* the caller takes the first chunk */
    atomic_store(&pool.status, MMD_OK);
    pool.open = 1;
    pool.running = 0;
    pool.generation++;
    pthread_cond_broadcast(&pool.wake);
    pthread_mutex_unlock(&pool.lock);

    run_chunks(0);

    pthread_mutex_lock(&pool.lock);
    pool.open = 0;
    if (pool.running > 0) {
        /* workers are finishing their last chunks: a short wait for them
         * is cheaper spent awake than in a futex round trip */
        pthread_mutex_unlock(&pool.lock);
        poll_briefly(workers_running, 0);
        pthread_mutex_lock(&pool.lock);
    }
    while (pool.running > 0) pthread_cond_wait(&pool.finished, &pool.lock);
    const int s = atomic_load(&pool.status);
    pthread_mutex_unlock(&pool.lock);
    if (s) mmd_error(s, "%s", pool.message);
    pthread_mutex_unlock(&pool.owner);
    return s;
}
