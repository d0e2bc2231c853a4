/* The CUDA emulator's bfloat16 (tests/support/cuda_emu; see cuda_fp16.h). */
#ifndef MMD_EMU_CUDA_BF16_H
#define MMD_EMU_CUDA_BF16_H

#include "cuda_fp16.h"

struct __nv_bfloat16 {
    uint16_t x;
    __nv_bfloat16() = default;
    template <typename V, typename = typename std::enable_if<std::is_arithmetic<V>::value>::type>
    __nv_bfloat16(V v) : x(mmd_emu::float_to_bfloat16_bits((float)v)) {}
    operator float() const { return mmd_emu::bits_float((uint32_t)x << 16); }
};

inline float __bfloat162float(__nv_bfloat16 h) { return (float)h; }
inline __nv_bfloat16 __float2bfloat16(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __float2bfloat16_rn(float f) { return __nv_bfloat16(f); }
inline __nv_bfloat16 __double2bfloat16(double d) { return __nv_bfloat16(d); }

inline __nv_bfloat16 atomicAdd(__nv_bfloat16 *address, __nv_bfloat16 value) {
    const __nv_bfloat16 old = *address;
    *address = __nv_bfloat16((float)old + (float)value);
    return old;
}

#endif
