/* Instantiates the file named by MMD_TYPED_FILE once per floating compute
 * type, so C code (which has no templates) is written once:
 *     #define MMD_TYPED_FILE "mmdispatch/ops/boxes_math.inc"
 *     #include "mmdispatch/typed.h"
 * Inside that file MMD_REAL is the type, MMD_FN(name) suffixes a name with
 * _f32 / _f64 and MMD_MATH(name) is the libm function of that type (expf /
 * exp). float16 on CUDA computes with the float instance. No include guard:
 * every inclusion instantiates again. */
#ifndef MMD_TYPED_FILE
#error "define MMD_TYPED_FILE before including mmdispatch/typed.h"
#endif

#define MMD_REAL float
#define MMD_FN(name) name##_f32
#define MMD_MATH(name) name##f
#include MMD_TYPED_FILE
#undef MMD_REAL
#undef MMD_FN
#undef MMD_MATH

#define MMD_REAL double
#define MMD_FN(name) name##_f64
#define MMD_MATH(name) name
#include MMD_TYPED_FILE
#undef MMD_REAL
#undef MMD_FN
#undef MMD_MATH

#undef MMD_TYPED_FILE
