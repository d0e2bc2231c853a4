/* Boxed C fallbacks (mmdispatch/boxed.h): one function pointer per device
 * type, set by register_fallback, read by every boxed call. */
#include "mmdispatch/boxed.h"

#include "mmdispatch/registry.h"

static mmd_boxed_fn mmd_boxed_fallbacks[MMD_MAX_DEVICE_TYPES];

void mmd_set_boxed_fallback(int device_type, mmd_boxed_fn fn) {
    if (device_type >= 0 && device_type < MMD_MAX_DEVICE_TYPES)
        __atomic_store_n(&mmd_boxed_fallbacks[device_type], fn, __ATOMIC_RELEASE);
}

static int mmd_boxed_error(int status, const char *message) {
    return mmd_error(status, "%s", message ? message : "");
}

int mmd_boxed_dispatch(const char *op, int num_args, const mmd_boxed_arg *args,
                       const mmd_context *ctx) {
    int device_type = -1;
    for (int i = 0; i < num_args && device_type < 0; ++i)
        if (args[i].kind == MMD_BOXED_ARRAY && args[i].array)
            device_type = args[i].array->device_type;
    const mmd_boxed_fn fn = device_type >= 0 && device_type < MMD_MAX_DEVICE_TYPES
        ? __atomic_load_n(&mmd_boxed_fallbacks[device_type], __ATOMIC_ACQUIRE) : NULL;
    if (!fn)
        return mmd_error(MMD_ERR_RUNTIME, "the C fallback of the arrays' device was removed "
                         "while the call was being dispatched");
    const mmd_boxed_call call = {op, device_type, ctx->device_id, num_args, args, ctx,
                                 mmd_boxed_error};
    mmd_error(0, "%s", "");
    int *guard = mmd_thread_hook_guard();
    ++*guard;   /* the calls the fallback makes are not shown to hooks */
    const int status = fn(&call);
    --*guard;
    if (status != 0 && mmd_last_error()[0] == '\0')
        mmd_error(status, "the C fallback returned status %d without a message (call "
                  "call->error(status, message) before returning it)", status);
    return status;
}
