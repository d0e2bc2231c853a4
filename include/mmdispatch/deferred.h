/* Deferred errors: bad data found by a kernel that runs after its call has
 * returned (CUDA kernels are queued, and the default path never waits for
 * them), reported by a later call instead of at that call.
 *
 * A call whose kernel may find bad data (a roi, an argmax entry, a class
 * target) first records who it is with mmd_deferred_begin: the entry point,
 * the op's message formatter and up to three numbers the message needs (a
 * batch size, a class count). That returns the call's sequence number. A
 * kernel thread that meets a bad item leaves the item harmless (it reads
 * and writes nothing out of bounds; what it writes instead is the op's
 * documented placeholder) and folds mmd_deferred_key(seq, item, code) into
 * its device's error word with an atomic minimum, so the word ends holding
 * the earliest call's lowest bad item. The device module then tells the
 * host, which turns the word into a message with mmd_deferred_raise at the
 * next call on that device (or at an explicit synchronize).
 *
 * Key layout, most significant first: 20 bits of sequence number (it wraps;
 * only the order of calls that are pending together matters), 36 bits of
 * item index (larger indices are capped), 8 bits of error code. */
#ifndef MMDISPATCH_DEFERRED_H
#define MMDISPATCH_DEFERRED_H

#include "mmdispatch/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MMD_DEFERRED_NONE UINT64_MAX   /* an error word that holds nothing */
#define MMD_DEFERRED_SEQ_BITS 20
#define MMD_DEFERRED_INDEX_BITS 36
#define MMD_DEFERRED_MAX_INDEX ((INT64_C(1) << MMD_DEFERRED_INDEX_BITS) - 1)
/* Calls whose records are kept: an error raised after this many later
 * calls has lost its record and is reported with what the key says. */
#define MMD_DEFERRED_RECORDS 4096

typedef struct mmd_deferred_call mmd_deferred_call;

/* Writes the message of bad item `index` (error `code`) with mmd_error,
 * without the op name, and returns its status (the op's own wording: the
 * same as its synchronous check's, less the offending value, which the key
 * cannot carry). */
typedef int (*mmd_deferred_format)(const mmd_deferred_call *call, int64_t index, int code);

struct mmd_deferred_call {
    uint32_t seq;
    const char *op;               /* the entry point, e.g. "roi_align_forward_impl" */
    mmd_deferred_format format;
    int64_t args[3];              /* what `format` needs, op-defined */
};

static inline MMD_HOSTDEV uint64_t mmd_deferred_key(uint32_t seq, int64_t index, int code) {
    const uint64_t item = (uint64_t)(index < MMD_DEFERRED_MAX_INDEX ? index
                                                                     : MMD_DEFERRED_MAX_INDEX);
    return ((uint64_t)(seq & ((1u << MMD_DEFERRED_SEQ_BITS) - 1)) << (64 - MMD_DEFERRED_SEQ_BITS)) |
           (item << 8) | (uint64_t)(code & 0xff);
}

/* Records a call that may report deferred errors; returns its sequence
 * number. Thread-safe and lock-free. */
uint32_t mmd_deferred_begin(const char *op, mmd_deferred_format format, int64_t arg0,
                            int64_t arg1, int64_t arg2);

/* The message for error word `key` (not MMD_DEFERRED_NONE) found on
 * `device` (e.g. "cuda:0") and raised by `raised_by` (the entry point whose
 * call found it pending, or "synchronize"): returns MMD_ERR_DEFERRED with
 * the whole message, op name included, in mmd_last_error(). */
int mmd_deferred_raise(uint64_t key, const char *device, const char *raised_by);

#ifdef __cplusplus
}
#endif
#endif
