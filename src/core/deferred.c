/* Deferred errors, the host's half (mmdispatch/deferred.h): the records of
 * recent calls that may report one, and the message of a reported key. */
#include <stdatomic.h>
#include <stdio.h>

#include "mmdispatch/deferred.h"

#define SEQ_MASK ((1u << MMD_DEFERRED_SEQ_BITS) - 1)
_Static_assert(((SEQ_MASK + 1) % MMD_DEFERRED_RECORDS) == 0,
               "a record's slot must not move when the sequence number wraps");

/* One slot per sequence number modulo MMD_DEFERRED_RECORDS. `stamp` is
 * seq + 1 once the slot holds that call, 0 while it is being written: a
 * reader that sees the same stamp before and after copying has a whole
 * record (a seqlock with one writer per slot and stamp). */
typedef struct {
    _Atomic uint32_t stamp;
    mmd_deferred_call call;
} record;

static record records[MMD_DEFERRED_RECORDS];
static _Atomic uint32_t next_seq;

uint32_t mmd_deferred_begin(const char *op, mmd_deferred_format format, int64_t arg0,
                            int64_t arg1, int64_t arg2) {
    const uint32_t seq = atomic_fetch_add_explicit(&next_seq, 1, memory_order_relaxed) & SEQ_MASK;
    record *r = &records[seq % MMD_DEFERRED_RECORDS];
    atomic_store_explicit(&r->stamp, 0, memory_order_relaxed);
    atomic_thread_fence(memory_order_release);
    r->call.seq = seq;
    r->call.op = op;
    r->call.format = format;
    r->call.args[0] = arg0;
    r->call.args[1] = arg1;
    r->call.args[2] = arg2;
    atomic_store_explicit(&r->stamp, seq + 1, memory_order_release);
    return seq;
}

static int find_call(uint32_t seq, mmd_deferred_call *out) {
    record *r = &records[seq % MMD_DEFERRED_RECORDS];
    const uint32_t before = atomic_load_explicit(&r->stamp, memory_order_acquire);
    if (before != seq + 1) return 0;
    *out = r->call;
    atomic_thread_fence(memory_order_acquire);
    return atomic_load_explicit(&r->stamp, memory_order_relaxed) == before;
}

int mmd_deferred_raise(uint64_t key, const char *device, const char *raised_by) {
    const uint32_t seq = (uint32_t)(key >> (64 - MMD_DEFERRED_SEQ_BITS));
    const int64_t index = (int64_t)((key >> 8) & (uint64_t)MMD_DEFERRED_MAX_INDEX);
    const int code = (int)(key & 0xff);
    char detail[768];
    mmd_deferred_call call;
    const char *op = "mmdispatch";
    if (find_call(seq, &call) && call.format != NULL) {
        call.format(&call, index, code);
        snprintf(detail, sizeof detail, "%s", mmd_last_error());
        op = call.op;
    } else {
        snprintf(detail, sizeof detail,
                 "bad input item %lld (error code %d) in a call more than %d calls back, whose "
                 "record is gone",
                 (long long)index, code, MMD_DEFERRED_RECORDS);
    }
    if (raised_by == NULL)
        return mmd_error(MMD_ERR_DEFERRED,
                         "%s: %s (deferred error: found on %s by the kernel of an earlier %s "
                         "call after that call had returned; raised by mmdispatch.synchronize(); "
                         "run under mmdispatch.strict() to raise such errors at the call)",
                         op, detail, device, op);
    return mmd_error(MMD_ERR_DEFERRED,
                     "%s: %s (deferred error: found on %s by the kernel of an earlier %s call "
                     "after that call had returned; raised by the next call on %s, %s, which did "
                     "not run; run under mmdispatch.strict() to raise such errors at the call)",
                     op, detail, device, op, device, raised_by);
}
