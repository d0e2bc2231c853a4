/* Registry layout and the registration macro used by kernel modules.
 *
 * Each op has a generated table (see mmdispatch/_codegen.py):
 *     mmd_<op>_fn mmd_<op>_table[MMD_TABLE_SIZE];
 *     const char *mmd_<op>_origin[MMD_TABLE_SIZE];
 * indexed by slot = device_type * MMD_MAX_BACKENDS + backend. Nothing is
 * hashed on the dispatch path. */
#ifndef MMDISPATCH_REGISTRY_H
#define MMDISPATCH_REGISTRY_H

#include "mmdispatch/tensor.h"

#ifdef __cplusplus
extern "C" {
#endif

#define MMD_MAX_BACKENDS 8
#define MMD_TABLE_SIZE (MMD_MAX_DEVICE_TYPES * MMD_MAX_BACKENDS)
#define MMD_SLOT(device_type, backend) ((device_type) * MMD_MAX_BACKENDS + (backend))

/* Built-in backend indices; names live in _core.pyx, more can be added from
 * Python up to MMD_MAX_BACKENDS. */
enum {
    MMD_BACKEND_DEFAULT = 0,
    MMD_BACKEND_REFERENCE = 1,
    MMD_BACKEND_DETERMINISTIC = 2
};

/* MMCV's REGISTER_DEVICE_IMPL: fills one slot of an op's table and records
 * who filled it. Used inside MMD_REGISTRATIONS blocks. */
#define MMD_REGISTER_DEVICE_IMPL(op, device, backend, fn)                          \
    do {                                                                           \
        mmd_##op##_table[MMD_SLOT(MMD_DEVICE_##device, MMD_BACKEND_##backend)] = fn; \
        mmd_##op##_origin[MMD_SLOT(MMD_DEVICE_##device, MMD_BACKEND_##backend)] =   \
            __FILE__ ":" #fn;                                                      \
    } while (0)

/* Kernel files in src/<device>/ define their registrations with
 *     MMD_REGISTRATIONS(cpu, roi_align) { MMD_REGISTER_DEVICE_IMPL(...); }
 * The build finds every such block (the name is the block's, unique per
 * device, whatever the file is called) and calls them all from
 * mmd_register_<device>(). */
#ifdef __cplusplus
#define MMD_REGISTRATIONS(device, name) extern "C" void mmd_register_##device##__##name(void)
#else
#define MMD_REGISTRATIONS(device, name) void mmd_register_##device##__##name(void)
#endif

/* Thread-local backend selection, one entry per device type. */
unsigned char *mmd_thread_backends(void);

/* Thread-local strict mode (mmdispatch.strict()): MMD_STRICT_UNSET follows
 * the process default (MMDISPATCH_STRICT), the others override it. */
enum { MMD_STRICT_UNSET = 0, MMD_STRICT_OFF = 1, MMD_STRICT_ON = 2 };
unsigned char *mmd_thread_strict(void);

/* Thread-local float32 product precision (MMD_CONTEXT_TF32), in the same
 * states: MMD_STRICT_UNSET follows the process's setting
 * (mmdispatch.set_float32_matmul_precision), ON allows TF32, OFF does not
 * (mmdispatch.torch sets it for its calls, from torch's setting). */
unsigned char *mmd_thread_tf32(void);

/* Thread-local exclusion guard of the dispatch hooks (mmdispatch.add_hook):
 * while it is above 0 (a hook or a fallback is running in this thread), the
 * thread's calls are not shown to hooks. */
int *mmd_thread_hook_guard(void);

#ifdef __cplusplus
}
#endif
#endif
