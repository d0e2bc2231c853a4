/* The CUDA emulator's view of mmdispatch/registry.h (tests/support/cuda_emu):
 * the real header, but MMD_REGISTER_DEVICE_IMPL records each kernel in the
 * emulator's own list (runtime.cpp), which the tests register through
 * mmdispatch.register_impl, instead of writing the dispatcher's tables. */
#include_next "mmdispatch/registry.h"

#ifndef MMD_EMU_REGISTRY_H
#define MMD_EMU_REGISTRY_H

#ifdef __cplusplus
extern "C"
#endif
    void
    mmd_emu_record(const char *op, int device_type, int backend, void *fn, const char *origin);

#undef MMD_REGISTER_DEVICE_IMPL
#define MMD_REGISTER_DEVICE_IMPL(op, device, backend, fn)                                 \
    do {                                                                                  \
        mmd_##op##_fn typed_ = fn; /* the op's signature, checked as the real macro does */ \
        mmd_emu_record(#op, MMD_DEVICE_##device, MMD_BACKEND_##backend, (void *)typed_,    \
                       #fn);                                                              \
    } while (0)

#endif
