/* Boxed C fallbacks (mmdispatch/boxed.h): the call of the fallback the
 * dispatcher chose (ctx->fallback, held alive by the dispatcher for the
 * call), with a message buffer of the call's own. */
#include "mmdispatch/boxed.h"

#include <stdio.h>

#include "mmdispatch/registry.h"

typedef struct {
    char message[1024];
    int set;
} mmd_boxed_state;

static int mmd_boxed_error(const mmd_boxed_call *call, int status, const char *message) {
    mmd_boxed_state *state = (mmd_boxed_state *)call->state;
    snprintf(state->message, sizeof state->message, "%s", message ? message : "");
    state->set = 1;
    return status;
}

int mmd_boxed_dispatch(const char *op, int num_args, const mmd_boxed_arg *args,
                       const mmd_context *ctx) {
    int device_type = -1;
    for (int i = 0; i < num_args && device_type < 0; ++i)
        if (args[i].kind == MMD_BOXED_ARRAY && args[i].array)
            device_type = args[i].array->device_type;
    if (!ctx->fallback)
        return mmd_error(MMD_ERR_RUNTIME, "%s's boxing function was called without a C "
                         "fallback", op);
    mmd_boxed_state state;
    state.set = 0;
    const mmd_boxed_call call = {op,   device_type,     ctx->device_id, num_args,
                                 args, ctx,             mmd_boxed_error, &state};
    int *guard = mmd_thread_hook_guard();
    ++*guard;   /* the calls the fallback makes are not shown to hooks */
    const int status = ((mmd_boxed_fn)ctx->fallback)(&call);
    --*guard;
    if (status == 0) return 0;
    if (state.set) return mmd_error(status, "%s", state.message);
    return mmd_error(status, "the C fallback returned status %d without a message (call "
                     "call->error(call, status, message) before returning it)", status);
}
