/* 16-byte vectors of the CPU kernels' element types, for the loops the
 * compiler does not vectorise as wanted on its own. */
#ifndef MMDISPATCH_CPU_VEC16_H
#define MMDISPATCH_CPU_VEC16_H

namespace {

/* Vectors of T, 16 bytes unless asked (GCC and clang vector extensions:
 * SSE2 on x86-64, or what MMD_X86_CLONES compiles for, and NEON on arm64;
 * a wider vector is split where the target has no registers that wide),
 * loaded and stored anywhere. */
template <typename T, int Bytes = 16> struct Vec {
    static constexpr int lanes = Bytes / sizeof(T);
    typedef T type __attribute__((vector_size(Bytes)));
    static type load(const T *p) {
        type v;
        __builtin_memcpy(&v, p, sizeof v);
        return v;
    }
    static void store(T *p, type v) { __builtin_memcpy(p, &v, sizeof v); }
};

}  // namespace

#endif
