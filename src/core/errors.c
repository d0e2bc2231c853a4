/* Thread-local error message, backend selection, strict mode, float32
 * product precision and hook guard,
 * plus dtype metadata. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "mmdispatch/checks.h"
#include "mmdispatch/registry.h"

static _Thread_local char mmd_error_message[1024];
static _Thread_local unsigned char mmd_backends[MMD_MAX_DEVICE_TYPES];
static _Thread_local unsigned char mmd_strict;
static _Thread_local unsigned char mmd_tf32;
static _Thread_local int mmd_hook_guard;

int mmd_error(int status, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    vsnprintf(mmd_error_message, sizeof mmd_error_message, fmt, args);
    va_end(args);
    return status;
}

const char *mmd_last_error(void) { return mmd_error_message; }

unsigned char *mmd_thread_backends(void) { return mmd_backends; }

unsigned char *mmd_thread_strict(void) { return &mmd_strict; }

unsigned char *mmd_thread_tf32(void) { return &mmd_tf32; }

int *mmd_thread_hook_guard(void) { return &mmd_hook_guard; }

static const struct {
    const char *name;
    size_t size;
} mmd_dtype_info[MMD_NUM_DTYPES] = {
    [MMD_DTYPE_UNKNOWN] = {"unknown", 0}, [MMD_BOOL] = {"bool", 1},
    [MMD_INT8] = {"int8", 1},             [MMD_INT16] = {"int16", 2},
    [MMD_INT32] = {"int32", 4},           [MMD_INT64] = {"int64", 8},
    [MMD_UINT8] = {"uint8", 1},           [MMD_UINT16] = {"uint16", 2},
    [MMD_UINT32] = {"uint32", 4},         [MMD_UINT64] = {"uint64", 8},
    [MMD_FLOAT16] = {"float16", 2},       [MMD_BFLOAT16] = {"bfloat16", 2},
    [MMD_FLOAT32] = {"float32", 4},       [MMD_FLOAT64] = {"float64", 8},
};

const char *mmd_dtype_name(int dtype) {
    return (dtype > 0 && dtype < MMD_NUM_DTYPES) ? mmd_dtype_info[dtype].name : "unknown";
}

size_t mmd_dtype_size(int dtype) {
    return (dtype > 0 && dtype < MMD_NUM_DTYPES) ? mmd_dtype_info[dtype].size : 0;
}

void mmd_format_shape(const mmd_tensor *t, char *buf, size_t size) {
    size_t used = (size_t)snprintf(buf, size, "(");
    for (int i = 0; i < t->ndim && used < size; ++i)
        used += (size_t)snprintf(buf + used, size - used, "%s%lld", i ? ", " : "",
                                 (long long)t->shape[i]);
    if (used < size) snprintf(buf + used, size - used, t->ndim == 1 ? ",)" : ")");
}

int mmd_shape_error(const mmd_tensor *t, const char *name, int ndim, const int64_t *expected) {
    char got[256], want[256];
    mmd_format_shape(t, got, sizeof got);
    size_t used = (size_t)snprintf(want, sizeof want, "(");
    for (int i = 0; i < ndim && used < sizeof want; ++i) {
        if (expected[i] == MMD_ANY_DIM)
            used += (size_t)snprintf(want + used, sizeof want - used, "%s*", i ? ", " : "");
        else
            used += (size_t)snprintf(want + used, sizeof want - used, "%s%lld", i ? ", " : "",
                                     (long long)expected[i]);
    }
    if (used < sizeof want) snprintf(want + used, sizeof want - used, ndim == 1 ? ",)" : ")");
    return mmd_error(MMD_ERR_VALUE, "%s must have shape %s, got %s", name, want, got);
}

int mmd_dtype_error(const mmd_tensor *t, const char *name, unsigned allowed_mask) {
    char allowed[256];
    size_t used = 0;
    allowed[0] = '\0';
    for (int d = 1; d < MMD_NUM_DTYPES && used < sizeof allowed; ++d)
        if (allowed_mask & MMD_DTYPE_BIT(d))
            used += (size_t)snprintf(allowed + used, sizeof allowed - used, "%s%s",
                                     used ? ", " : "", mmd_dtype_name(d));
    return mmd_error(MMD_ERR_TYPE, "%s has dtype %s on this device; supported: %s", name,
                     mmd_dtype_name(t->dtype), allowed);
}

int mmd_same_dtype_error(const mmd_tensor *t, const char *name, const mmd_tensor *ref,
                         const char *ref_name) {
    return mmd_error(MMD_ERR_TYPE, "%s has dtype %s but %s has dtype %s; they must match", name,
                     mmd_dtype_name(t->dtype), ref_name, mmd_dtype_name(ref->dtype));
}

int mmd_contiguous_error(const mmd_tensor *t, const char *name) {
    (void)t;
    return mmd_error(MMD_ERR_VALUE,
                     "%s must be C-contiguous (got a strided view); make a contiguous copy first",
                     name);
}
