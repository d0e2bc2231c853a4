/* The host half of deferred errors (src/core/deferred.c), exercised the way
 * the CUDA device module uses it: calls record themselves, "kernels" fold
 * keys into an error word with an atomic minimum (here host threads, as
 * device threads do on the GPU), and the word becomes one message.
 * Built and run by tests/test_deferred.py; prints "ok" or fails an assert. */
#include <assert.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

#include "mmdispatch/deferred.h"
#include "mmdispatch/ops/rois.h"

#define CHECK_CONTAINS(text, part)                                                  \
    do {                                                                            \
        if (!strstr((text), (part))) {                                              \
            fprintf(stderr, "missing %s in: %s\n", (part), (text));                 \
            return 1;                                                               \
        }                                                                           \
    } while (0)

static int format_target(const mmd_deferred_call *call, int64_t index, int code) {
    return mmd_error(MMD_ERR_VALUE, "target[%lld] bad (code %d, %lld classes)",
                     (long long)index, code, (long long)call->args[0]);
}

static uint64_t word = MMD_DEFERRED_NONE;

static void fold(uint64_t key) {   /* the device's atomicMin, on the host */
    uint64_t seen = __atomic_load_n(&word, __ATOMIC_RELAXED);
    while (key < seen &&
           !__atomic_compare_exchange_n(&word, &seen, key, 0, __ATOMIC_RELAXED,
                                        __ATOMIC_RELAXED)) {
    }
}

typedef struct {
    uint32_t seq;
    int64_t first_bad;
} reporter;

static void *report_items(void *arg) {   /* one "kernel": reports items first_bad.. */
    const reporter *r = (const reporter *)arg;
    for (int64_t item = r->first_bad + 999; item >= r->first_bad; --item)
        fold(mmd_deferred_key(r->seq, item, MMD_ROI_NONFINITE));
    return NULL;
}

static void *begin_many(void *arg) {
    uint32_t *seqs = (uint32_t *)arg;
    for (int i = 0; i < 1000; ++i) seqs[i] = mmd_deferred_begin("op", format_target, i, 0, 0);
    return NULL;
}

int main(void) {
    /* keys order by call, then item; the item is capped, the code kept */
    assert(mmd_deferred_key(3, 1000, 1) < mmd_deferred_key(4, 0, 1));
    assert(mmd_deferred_key(3, 5, 9) < mmd_deferred_key(3, 6, 1));
    assert(mmd_deferred_key(3, INT64_C(1) << 50, 2) ==
           mmd_deferred_key(3, MMD_DEFERRED_MAX_INDEX, 2));
    assert((mmd_deferred_key(3, 5, 0x80) & 0xff) == 0x80);
    assert(mmd_deferred_key((1u << MMD_DEFERRED_SEQ_BITS) - 1, MMD_DEFERRED_MAX_INDEX, 0xff) ==
           MMD_DEFERRED_NONE);   /* only the all-ones key equals "nothing" */

    /* two calls' kernels race; the word ends with the earlier call's first bad roi */
    const uint32_t first = mmd_deferred_begin("roi_align_forward_impl", mmd_roi_deferred_error,
                                              2, 0, 0);
    const uint32_t second = mmd_deferred_begin("roi_pool_forward_impl", mmd_roi_deferred_error,
                                               2, 0, 0);
    reporter reporters[2] = {{second, 0}, {first, 17}};
    pthread_t threads[2];
    for (int i = 0; i < 2; ++i) pthread_create(&threads[i], NULL, report_items, &reporters[i]);
    for (int i = 0; i < 2; ++i) pthread_join(threads[i], NULL);
    assert(mmd_deferred_raise(word, "cuda:0", "nms_impl") == MMD_ERR_DEFERRED);
    const char *message = mmd_last_error();
    CHECK_CONTAINS(message, "roi_align_forward_impl: rois[17] contains NaN or inf");
    CHECK_CONTAINS(message, "found on cuda:0 by the kernel of an earlier roi_align_forward_impl");
    CHECK_CONTAINS(message, "raised by the next call on cuda:0, nms_impl, which did not run");
    CHECK_CONTAINS(message, "mmdispatch.strict()");

    /* the op's own formatter gets the call's numbers; synchronize has its own wording */
    const uint32_t focal = mmd_deferred_begin("sigmoid_focal_loss_forward_impl", format_target,
                                              80, 0, 0);
    mmd_deferred_raise(mmd_deferred_key(focal, 3, 1), "cuda:1", NULL);
    message = mmd_last_error();
    CHECK_CONTAINS(message, "sigmoid_focal_loss_forward_impl: target[3] bad (code 1, 80 classes)");
    CHECK_CONTAINS(message, "raised by mmdispatch.synchronize()");

    /* a record overwritten by later calls: the message says so, from the key alone */
    const uint32_t old = mmd_deferred_begin("roi_align_backward_impl", mmd_roi_deferred_error, 2,
                                            0, 0);
    for (int i = 0; i < MMD_DEFERRED_RECORDS; ++i)
        mmd_deferred_begin("bbox_overlaps_impl", format_target, 0, 0, 0);
    mmd_deferred_raise(mmd_deferred_key(old, 7, MMD_ROI_BAD_BATCH), "cuda:0", "nms_impl");
    message = mmd_last_error();
    CHECK_CONTAINS(message, "mmdispatch: bad input item 7 (error code 2) in a call more than");

    /* concurrent calls get distinct sequence numbers and keep their own records */
    static uint32_t seqs[4][1000];
    pthread_t many[4];
    for (int t = 0; t < 4; ++t) pthread_create(&many[t], NULL, begin_many, seqs[t]);
    for (int t = 0; t < 4; ++t) pthread_join(many[t], NULL);
    for (int t = 0; t < 4; ++t)
        for (int u = 0; u < t; ++u)
            for (int i = 0; i < 1000; ++i)
                for (int j = 0; j < 1000; ++j) assert(seqs[t][i] != seqs[u][j]);
    /* 4 x 1000 < MMD_DEFERRED_RECORDS: every one of those records is intact */
    for (int t = 0; t < 4; ++t)
        for (int i = 0; i < 1000; ++i) {
            char expected[64];
            mmd_deferred_raise(mmd_deferred_key(seqs[t][i], 0, 1), "cuda:0", "x");
            snprintf(expected, sizeof expected, "op: target[0] bad (code 1, %d classes)", i);
            CHECK_CONTAINS(mmd_last_error(), expected);
        }
    const uint32_t last = mmd_deferred_begin("op", format_target, 4242, 0, 0);
    mmd_deferred_raise(mmd_deferred_key(last, 0, 1), "cuda:0", "x");
    CHECK_CONTAINS(mmd_last_error(), "4242 classes");
    puts("ok");
    return 0;
}
