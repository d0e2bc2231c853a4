/* The CUDA emulator's 16-bit float types (tests/support/cuda_emu): __half
 * and __nv_bfloat16 as their bits, converted with round-to-nearest-even as
 * the GPU's conversions round. */
#ifndef MMD_EMU_CUDA_FP16_H
#define MMD_EMU_CUDA_FP16_H

#include <stdint.h>
#include <string.h>

#include <type_traits>

namespace mmd_emu {

inline uint32_t float_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

inline float bits_float(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

inline uint16_t float_to_half_bits(float f) {
    const uint32_t u = float_bits(f);
    const uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    const uint32_t exponent = (u >> 23) & 0xffu, mantissa = u & 0x7fffffu;
    if (exponent == 0xff) return mantissa ? (uint16_t)0x7fffu : (uint16_t)(sign | 0x7c00u);   /* CUDA's NaN */
    const int e = (int)exponent - 127 + 15;
    if (e >= 31) return (uint16_t)(sign | 0x7c00u);   /* overflow: inf */
    if (e <= 0) {                                      /* subnormal or zero */
        if (e < -10) return sign;
        const uint32_t m = mantissa | 0x800000u;
        const int shift = 14 - e;
        uint32_t half = m >> shift;
        const uint32_t rest = m & ((1u << shift) - 1), midpoint = 1u << (shift - 1);
        if (rest > midpoint || (rest == midpoint && (half & 1u))) ++half;
        return (uint16_t)(sign | half);
    }
    uint32_t half = ((uint32_t)e << 10) | (mantissa >> 13);
    const uint32_t rest = mantissa & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) ++half;   /* may carry into inf */
    return (uint16_t)(sign | half);
}

inline float half_bits_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu, mantissa = h & 0x3ffu;
    if (exponent == 0x1f) return bits_float(sign | 0x7f800000u | (mantissa << 13));
    if (exponent == 0) {
        const float value = (float)mantissa * (1.0f / 16777216.0f);   /* 2^-24 */
        return sign ? -value : value;
    }
    return bits_float(sign | ((exponent - 15 + 127) << 23) | (mantissa << 13));
}

inline uint16_t float_to_bfloat16_bits(float f) {
    const uint32_t u = float_bits(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)0x7fffu;   /* CUDA's NaN */
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace mmd_emu

struct __half {
    uint16_t x;
    __half() = default;
    template <typename V, typename = typename std::enable_if<std::is_arithmetic<V>::value>::type>
    __half(V v) : x(mmd_emu::float_to_half_bits((float)v)) {}
    operator float() const { return mmd_emu::half_bits_to_float(x); }
};

inline float __half2float(__half h) { return (float)h; }
inline __half __float2half(float f) { return __half(f); }
inline __half __float2half_rn(float f) { return __half(f); }
inline __half __double2half(double d) { return __half(d); }
inline bool __hisnan(__half h) { return (h.x & 0x7fffu) > 0x7c00u; }

inline __half atomicAdd(__half *address, __half value) {
    const __half old = *address;
    *address = __half((float)old + (float)value);
    return old;
}

#endif
