/* Matrix products for the CPU kernels (mmdispatch/gemm.h): the process's
 * BLAS when one is loaded, else our own tile products on the worker pool;
 * and those tile products, per instruction set. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <limits.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mmdispatch/gemm.h"
#include "mmdispatch/loaded_library.h"
#include "mmdispatch/parallel.h"
#include "heap_array.h"

namespace {

enum { kRowMajor = 101, kNoTrans = 111, kTrans = 112 };

/* cblas_?gemm with 64-bit (ILP64) or 32-bit (LP64) indices */
template <typename T>
using Gemm64 = void (*)(int, int, int, int64_t, int64_t, int64_t, T, const T *, int64_t,
                        const T *, int64_t, T, T *, int64_t);
template <typename T>
using Gemm32 = void (*)(int, int, int, int, int, int, T, const T *, int, const T *, int, T, T *,
                        int);

struct Blas {
    Gemm64<float> s64 = nullptr;
    Gemm64<double> d64 = nullptr;
    Gemm32<float> s32 = nullptr;
    Gemm32<double> d32 = nullptr;
    char name[256] = "mmdispatch's own";
};

Blas g_blas;
pthread_once_t g_blas_once = PTHREAD_ONCE_INIT;

/* (single, double, 64-bit indices): the names BLAS libraries export */
struct Names {
    const char *s, *d;
    bool ilp64;
};
const Names kNames[] = {
    {"scipy_cblas_sgemm64_", "scipy_cblas_dgemm64_", true},   /* numpy's and scipy's wheels */
    {"cblas_sgemm64_", "cblas_dgemm64_", true},
    {"cblas_sgemm", "cblas_dgemm", false},
};

bool take_from(void *handle, const char *library) {
    for (const Names &n : kNames) {
        void *s = dlsym(handle, n.s), *d = dlsym(handle, n.d);
        if (s == nullptr || d == nullptr) continue;
        if (n.ilp64) {
            g_blas.s64 = (Gemm64<float>)s;
            g_blas.d64 = (Gemm64<double>)d;
        } else {
            g_blas.s32 = (Gemm32<float>)s;
            g_blas.d32 = (Gemm32<double>)d;
        }
        const char *base = strrchr(library, '/');
        snprintf(g_blas.name, sizeof g_blas.name, "%s (%s, %s indices)", n.s,
                 base ? base + 1 : library, n.ilp64 ? "64-bit" : "32-bit");
        return true;
    }
    return false;
}

void find_blas() {
    const char *setting = getenv("MMDISPATCH_BLAS");
    if (setting != nullptr && strcmp(setting, "none") == 0) return;
    if (take_from(RTLD_DEFAULT, "the process")) return;
    /* a loaded library whose file name says BLAS: gemm from it */
    mmd_loaded::take_from_loaded(
        [](const char *name) {
            return strstr(name, "blas") != nullptr || strstr(name, "mkl_rt") != nullptr;
        },
        take_from);
}

const Blas &blas() {
    pthread_once(&g_blas_once, find_blas);
    return g_blas;
}

/* ---- Tile products (gemm.h) ----
 * A tile is P pixels x NV vectors of outs, P * NV accumulators in vector
 * registers; each step j loads the strip's NV vectors of w[.][j] and
 * broadcasts each pixel's x[p][j]. Shapes per instruction set: AVX-512 12
 * pixels x 2 zmm (24 of 32 registers), AVX2 and the baseline 6 pixels x 2
 * (12 of 16). */
constexpr int64_t kBlockBytes = int64_t(1) << 19;   /* a block's rows: half of a 1 MB L2 */
constexpr int kMaxBlockTiles = 8;

template <typename T, int Bytes, int P, int NV> struct Tiles {
    typedef T V __attribute__((vector_size(Bytes)));
    typedef T Unaligned __attribute__((vector_size(Bytes), aligned(sizeof(T)), may_alias));
    static constexpr int kLanes = Bytes / (int)sizeof(T);
    static constexpr int64_t kStrip = (int64_t)NV * kLanes;

    static MMD_INLINE void tile(int64_t k, const T *__restrict w, const T *x, int64_t ldx,
                                int pixels, T *out, int64_t ldo, int64_t ldp, int64_t outs,
                                const T *bias, int accumulate) {
        V acc[P][NV];
        for (int i = 0; i < P; ++i)
            for (int v = 0; v < NV; ++v) acc[i][v] = V{};
        const T *row[P];
        for (int i = 0; i < P; ++i) row[i] = x + (i < pixels ? i : pixels - 1) * ldx;
        for (int64_t j = 0; j < k; ++j) {
            V wv[NV];
            for (int v = 0; v < NV; ++v) wv[v] = *(const Unaligned *)(w + j * kStrip + v * kLanes);
            for (int i = 0; i < P; ++i) {
                const V xi = row[i][j] - V{};   /* a splat; x - 0 is x, -0 too */
                for (int v = 0; v < NV; ++v) acc[i][v] += xi * wv[v];
            }
        }
        /* out of the registers by constant indices (a variable one would
         * keep acc in memory through the loop above) */
        T sums[P][kStrip];
        for (int i = 0; i < P; ++i)
            for (int v = 0; v < NV; ++v) memcpy(&sums[i][v * kLanes], &acc[i][v], sizeof(V));
        for (int i = 0; i < pixels; ++i) {
            T *dst = out + i * ldp;
            if (ldo == 1 && accumulate)   /* a pixel's outs in a row: vector loops */
                for (int64_t o = 0; o < outs; ++o) dst[o] += sums[i][o];
            else if (ldo == 1 && !bias)
                for (int64_t o = 0; o < outs; ++o) dst[o] = sums[i][o];
            else
                for (int64_t o = 0; o < outs; ++o)
                    dst[o * ldo] = accumulate ? dst[o * ldo] + sums[i][o]
                                   : bias    ? sums[i][o] + bias[o]
                                             : sums[i][o];
        }
    }

    static MMD_INLINE void product(int64_t outs, int64_t pixels, int64_t k, const T *packed,
                                   const T *x, int64_t ldx, const T *bias, int accumulate,
                                   T *out, int64_t ldo, int64_t ldp) {
        for (int64_t o0 = 0; o0 < outs; o0 += kStrip) {
            const int64_t n = outs - o0 < kStrip ? outs - o0 : kStrip;
            for (int64_t p0 = 0; p0 < pixels; p0 += P)
                tile(k, packed + o0 * k, x + p0 * ldx, ldx,
                     (int)(pixels - p0 < P ? pixels - p0 : P), out + o0 * ldo + p0 * ldp, ldo,
                     ldp, n, bias ? bias + o0 : nullptr, accumulate);
        }
    }
};

template <typename T> using BaselineTiles = Tiles<T, 16, 6, 2>;
template <typename T> using Avx2Tiles = Tiles<T, 32, 6, 2>;
template <typename T> using Avx512Tiles = Tiles<T, 64, 12, 2>;

#define MMD_TILE_ARGS(T)                                                                        \
    int64_t outs, int64_t pixels, int64_t k, const T *packed, const T *x, int64_t ldx,          \
        const T *bias, int accumulate, T *out, int64_t ldo, int64_t ldp
#define MMD_TILE_PASS outs, pixels, k, packed, x, ldx, bias, accumulate, out, ldo, ldp

template <typename T> void baseline_product(MMD_TILE_ARGS(T)) {
    BaselineTiles<T>::product(MMD_TILE_PASS);
}

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MMD_TILES_X86 1
template <typename T> __attribute__((target("avx2,fma"))) void avx2_product(MMD_TILE_ARGS(T)) {
    Avx2Tiles<T>::product(MMD_TILE_PASS);
}
template <typename T> __attribute__((target("avx512f"))) void avx512_product(MMD_TILE_ARGS(T)) {
    Avx512Tiles<T>::product(MMD_TILE_PASS);
}
#endif

/* The CPU's best, capped by MMDISPATCH_CPU_ISA. */
int detect_isa() {
    int best = 0;
#ifdef MMD_TILES_X86
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f"))
        best = 2;
    else if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        best = 1;
#endif
    const char *cap = getenv("MMDISPATCH_CPU_ISA");
    if (cap != nullptr) {
        const int most = strcmp(cap, "avx512") == 0 ? 2 : strcmp(cap, "avx2") == 0 ? 1
                         : strcmp(cap, "baseline") == 0 ? 0 : best;
        if (most < best) best = most;
    }
    return best;
}

int isa() {
    static const int value = detect_isa();
    return value;
}

/* The tile shape of the chosen instruction set. */
template <typename T> int64_t strip_of() {
    switch (isa()) {
    case 2: return Avx512Tiles<T>::kStrip;
    case 1: return Avx2Tiles<T>::kStrip;
    default: return BaselineTiles<T>::kStrip;
    }
}
int tile_pixels() { return isa() == 2 ? 12 : 6; }

template <typename T> void tile_product(MMD_TILE_ARGS(T)) {
    if (outs <= 0 || pixels <= 0) return;
#ifdef MMD_TILES_X86
    if (isa() == 2) return avx512_product<T>(MMD_TILE_PASS);
    if (isa() == 1) return avx2_product<T>(MMD_TILE_PASS);
#endif
    baseline_product<T>(MMD_TILE_PASS);
}

/* w[o * row_step + j * column_step] * scale into strips. */
template <typename T>
void pack(int64_t outs, int64_t k, T scale, const T *w, int64_t row_step, int64_t column_step,
          T *packed) {
    const int64_t strip = strip_of<T>();
    for (int64_t o0 = 0; o0 < outs; o0 += strip) {
        T *to = packed + o0 * k;
        if (row_step == 1 && scale == 1 && outs - o0 >= strip) {   /* a strip's rows: copies */
            for (int64_t j = 0; j < k; ++j)
                memcpy(to + j * strip, w + o0 + j * column_step, sizeof(T) * strip);
            continue;
        }
        for (int64_t j = 0; j < k; ++j)
            for (int64_t l = 0; l < strip; ++l) {
                const int64_t o = o0 + l;
                to[j * strip + l] = o < outs ? scale * w[o * row_step + j * column_step] : (T)0;
            }
    }
}

/* The fallback gemm: op(A) * alpha packed into strips, op(B)'s columns as
 * the tiles' rows (B itself when transposed, else a transposed copy), C's
 * columns shared out over the threads a block at a time. Without memory
 * for the copies, a plain loop. */
template <typename T>
void own_gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, T alpha, const T *a,
              int64_t lda, const T *b, int64_t ldb, T beta, T *c, int64_t ldc) {
    HeapArray<T> packed(mmd_packed_size<T>(m, k)), rows(trans_b ? 0 : n * k);
    if (!packed || !rows) {
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
                T sum = 0;
                for (int64_t p = 0; p < k; ++p)
                    sum += (trans_a ? a[p * lda + i] : a[i * lda + p]) *
                           (trans_b ? b[j * ldb + p] : b[p * ldb + j]);
                c[i * ldc + j] = alpha * sum + (beta == 0 ? (T)0 : beta * c[i * ldc + j]);
            }
        return;
    }
    pack(m, k, alpha, a, trans_a ? 1 : lda, trans_a ? lda : 1, packed.get());
    const T *x = b;
    int64_t ldx = ldb;
    if (!trans_b) {
        for (int64_t p = 0; p < k; ++p)
            for (int64_t j = 0; j < n; ++j) rows[j * k + p] = b[p * ldb + j];
        x = rows.get(), ldx = k;
    }
    const int accumulate = beta != 0;
    if (accumulate && beta != 1)
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) c[i * ldc + j] *= beta;
    const int64_t block = mmd_tile_block(k, (int64_t)sizeof(T));
    const int64_t blocks = (n + block - 1) / block;
    mmd_parallel_for(blocks, 1, mmd_worth_threads(blocks, m * n * (k + 1)),
                     [&](int64_t begin, int64_t end) {
        for (int64_t blk = begin; blk < end; ++blk) {
            const int64_t p0 = blk * block, count = n - p0 < block ? n - p0 : block;
            tile_product<T>(m, count, k, packed.get(), x + p0 * ldx, ldx, nullptr, accumulate,
                            c + p0, ldc, 1);
        }
        return 0;
    });
}

template <typename T>
void gemm(Gemm64<T> g64, Gemm32<T> g32, int trans_a, int trans_b, int64_t m, int64_t n,
          int64_t k, T alpha, const T *a, int64_t lda, const T *b, int64_t ldb, T beta, T *c,
          int64_t ldc) {
    if (m == 0 || n == 0) return;
    if (k == 0) {   /* C = beta * C; a BLAS may skip this */
        for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) c[i * ldc + j] = beta == 0 ? (T)0 : beta * c[i * ldc + j];
        return;
    }
    const int ta = trans_a ? kTrans : kNoTrans, tb = trans_b ? kTrans : kNoTrans;
    if (g64 != nullptr) {
        g64(kRowMajor, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
        return;
    }
    const int64_t most = m > n ? (m > k ? m : k) : (n > k ? n : k);
    const int64_t lds = lda > ldb ? (lda > ldc ? lda : ldc) : (ldb > ldc ? ldb : ldc);
    if (g32 != nullptr && most <= INT_MAX && lds <= INT_MAX) {
        g32(kRowMajor, ta, tb, (int)m, (int)n, (int)k, alpha, a, (int)lda, b, (int)ldb, beta, c,
            (int)ldc);
        return;
    }
    own_gemm<T>(trans_a != 0, trans_b != 0, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // namespace

extern "C" void mmd_sgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                          float alpha, const float *a, int64_t lda, const float *b, int64_t ldb,
                          float beta, float *c, int64_t ldc) {
    const Blas &lib = blas();
    gemm<float>(lib.s64, lib.s32, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                ldc);
}

extern "C" void mmd_dgemm(int trans_a, int trans_b, int64_t m, int64_t n, int64_t k,
                          double alpha, const double *a, int64_t lda, const double *b,
                          int64_t ldb, double beta, double *c, int64_t ldc) {
    const Blas &lib = blas();
    gemm<double>(lib.d64, lib.d32, trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c,
                 ldc);
}

extern "C" const char *mmd_gemm_provider(void) { return blas().name; }

extern "C" const char *mmd_tile_isa_name(void) {
    return isa() == 2 ? "avx512" : isa() == 1 ? "avx2" : "baseline";
}

extern "C" int mmd_tiles_beat_blas(void) { return isa() >= 1; }

extern "C" int64_t mmd_tile_strip(int64_t elem_size) {
    return elem_size == (int64_t)sizeof(double) ? strip_of<double>() : strip_of<float>();
}

extern "C" int64_t mmd_tile_block(int64_t k, int64_t elem_size) {
    const int64_t p = tile_pixels(), bytes = p * (k > 0 ? k : 1) * elem_size;
    int64_t tiles = kBlockBytes / bytes;
    if (tiles < 1) tiles = 1;
    if (tiles > kMaxBlockTiles) tiles = kMaxBlockTiles;
    return tiles * p;
}

extern "C" void mmd_spack_strips(int64_t outs, int64_t k, float scale, const float *w,
                                 int64_t row_step, int64_t column_step, float *packed) {
    pack<float>(outs, k, scale, w, row_step, column_step, packed);
}

extern "C" void mmd_dpack_strips(int64_t outs, int64_t k, double scale, const double *w,
                                 int64_t row_step, int64_t column_step, double *packed) {
    pack<double>(outs, k, scale, w, row_step, column_step, packed);
}

extern "C" void mmd_stile_product(MMD_TILE_ARGS(float)) { tile_product<float>(MMD_TILE_PASS); }

extern "C" void mmd_dtile_product(MMD_TILE_ARGS(double)) { tile_product<double>(MMD_TILE_PASS); }
