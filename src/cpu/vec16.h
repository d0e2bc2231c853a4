/* 16-byte vectors of the CPU kernels' element types, for the loops the
 * compiler does not vectorise as wanted on its own. */
#ifndef MMDISPATCH_CPU_VEC16_H
#define MMDISPATCH_CPU_VEC16_H

namespace {

/* 16-byte vectors of T (GCC and clang vector extensions: SSE2 on x86-64,
 * or what MMD_X86_CLONES compiles for, and NEON on arm64), loaded and
 * stored anywhere. */
template <typename T> struct Vec {
    static constexpr int lanes = 16 / sizeof(T);
    typedef T type __attribute__((vector_size(16)));
    static type load(const T *p) {
        type v;
        __builtin_memcpy(&v, p, sizeof v);
        return v;
    }
    static void store(T *p, type v) { __builtin_memcpy(p, &v, sizeof v); }
};

}  // namespace

#endif
