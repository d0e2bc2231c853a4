/* deform_conv2d on CUDA (torchvision semantics, sampling math shared with
 * the CPU kernels through mmdispatch/ops/deform_conv2d.h): deformable im2col
 * + matrix products, in passes over a few whole images at a time (their
 * columns within kImagesBudget values), or over an image's output pixels in
 * chunks whose columns hold at most kColumnBudget values. The products of
 * float and double operands go to the process's cuBLAS where one is loaded
 * (mmdispatch/cuda/cublas.cuh: torch's, for torch users), as torchvision's
 * do, a pass's images in one strided batched product; the others, and all of
 * the deterministic backend's, to register-tiled products of our own (k
 * split in slices where the product has few tiles).
 *
 * Forward: a thread per (image, 4 channels, pixel) writes its taps' column
 * values (a thread per channel where 4 does not divide an offset group's
 * channels), then per weight group one product with the weight per image, the
 * bias added as it is written (cuBLAS: the bias written first, the product
 * added to it). Backward: the columns again; grad_weight += grad_output x
 * columns^T; the columns' gradient weight^T x grad_output; a thread per
 * (image, offset group, tap, pixel) sums grad_offset and grad_mask over the
 * group's channels; grad_input gets the columns' gradient at each sample's
 * four cells, with atomics (`default`: a thread per (image, channel, pixel)
 * through the taps, as im2col; float on sm_90+ adds a sample's cells that
 * share an aligned 4 in one float4 atomic) or a warp per (image, input
 * channel) plane adding its samples 32 at a time, summed in lane order
 * (`deterministic`: the same bits on every run). In the deterministic
 * backend every product and sum has a fixed order.
 *
 * float16 and bfloat16 compute in float32: the columns, grad_weight,
 * grad_bias and grad_input are summed in float32 buffers and written once.
 * Launches on ctx->stream, on ctx->device_id. No data-dependent checks: any
 * offset value is valid (a NaN one gives NaN). */
#include <limits.h>

#include <type_traits>

#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/cuda/cublas.cuh"
#include "mmdispatch/ops/deform_conv2d.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

/* Values in a column buffer of one image's pixels (the emulator's build
 * lowers both budgets, so that its tests take several passes). */
#ifndef MMD_DCN_COLUMN_BUDGET
#define MMD_DCN_COLUMN_BUDGET (int64_t(1) << 24)
#endif
#ifndef MMD_DCN_IMAGES_BUDGET
#define MMD_DCN_IMAGES_BUDGET (int64_t(1) << 25)
#endif
constexpr int64_t kColumnBudget = MMD_DCN_COLUMN_BUDGET;
/* Whole images whose columns fit in kImagesBudget values in all go through
 * im2col, col2im and their products together (one strided batched cuBLAS
 * product per weight group where the process's cuBLAS has them, and one
 * launch of each kernel): the bench's workload (2304 rows of columns by
 * 4096 pixels an image) then takes both images in one product of 2 x 64
 * tiles of 128 x 128, where an image alone has 64 tiles for an H100's 132
 * SMs. */
constexpr int64_t kImagesBudget = MMD_DCN_IMAGES_BUDGET;

template <typename A> using Sample = mmd_bilinear_sample<A>;

int64_t chunk_of(const mmd_dcn_shape &d) {
    const int64_t rows = d.in_channels * d.taps();
    int64_t pixels = rows > 0 ? kColumnBudget / rows : d.pixels();
    if (pixels < 1) pixels = 1;
    return pixels < d.pixels() ? pixels : d.pixels();
}

/* What one pass of im2col takes: images [n0, n0 + images) and pixels
 * [p0, p0 + count) of each, their columns one image after another (rows x
 * count each, rows = in_channels * taps). Several images only when each
 * is whole (p0 0, count all pixels). */
struct Span {
    int64_t n0, images, p0, count;
};

/* Images a pass takes at most: cuBLAS's strided batched products of more
 * than 65535 went wrong on Volta GPUs (PyTorch issue 45724, which PyTorch
 * works around in chunks). */
constexpr int64_t kMaxPassImages = 65535;

/* The images and pixels a pass takes at most: whole images, as many as
 * kImagesBudget values of columns hold (at most kMaxPassImages), where one
 * image's columns fit in kColumnBudget; else one image's pixels in chunks
 * of kColumnBudget (of one pixel where a pixel's columns alone exceed it). */
Span pass_of(const mmd_dcn_shape &d) {
    const int64_t rows = d.in_channels * d.taps(), pixels = d.pixels(), count = chunk_of(d);
    int64_t images = 1;
    /* rows * pixels <= kColumnBudget, except for one pixel of more rows */
    if (count == pixels && rows > 0 && pixels > 0 && rows * pixels <= kColumnBudget) {
        images = kImagesBudget / (rows * pixels);
        if (images > kMaxPassImages) images = kMaxPassImages;
        if (images > d.batch) images = d.batch;
        if (images < 1) images = 1;
    }
    return Span{0, images, 0, count};
}

/* f(span) for each pass over the batch's images and pixels, in order (a
 * nonzero return stops the walk and is returned). */
template <typename F> int for_each_pass(const mmd_dcn_shape &d, const Span &most, F f) {
    const int64_t pixels = d.pixels();
    for (int64_t n0 = 0; n0 < d.batch; n0 += most.images)
        for (int64_t p0 = 0; p0 < pixels; p0 += most.count) {
            const Span span{n0, d.batch - n0 < most.images ? d.batch - n0 : most.images, p0,
                            pixels - p0 < most.count ? pixels - p0 : most.count};
            const int s = f(span);
            if (s) return s;
        }
    return MMD_OK;
}

/* Where tap (ki, kj) of output pixel (oy, ox) samples; dy points at the
 * tap's y offset for the pixel, its x offset `pixels` further. `edge` not
 * 0: at mmd_bilinear_edge_shift's position instead. */
template <typename T, typename A>
__device__ inline void locate_at(const T *dy, const mmd_dcn_shape &d, int64_t oy, int64_t ox,
                                 int64_t ki, int64_t kj, Sample<A> *s,
                                 unsigned char edge = 0) {
    A y = mmd_dcn_base<A>(oy, ki, d.stride_h, d.pad_h, d.dilation_h) + to_compute(dy[0]);
    A x = mmd_dcn_base<A>(ox, kj, d.stride_w, d.pad_w, d.dilation_w) +
          to_compute(dy[d.pixels()]);
    mmd_bilinear_edge_shift(edge, &y, &x);
    mmd_bilinear_locate(y, x, d.height, d.width, s);
}

/* Where tap t of pixel p (of image n, offset group g) samples. */
template <typename T, typename A>
__device__ inline void locate(const T *offset, const mmd_dcn_shape &d, int64_t n, int64_t g,
                              int64_t t, int64_t p, Sample<A> *s, unsigned char edge = 0) {
    const int64_t pixels = d.pixels();
    const T *dy = offset + ((n * d.offset_groups + g) * 2 * d.taps() + 2 * t) * pixels + p;
    locate_at(dy, d, p / d.out_w, p % d.out_w, t / d.kernel_w, t % d.kernel_w, s, edge);
}

template <typename T>
__device__ inline typename Compute<T>::type mask_at(const T *mask, const mmd_dcn_shape &d,
                                                   int64_t n, int64_t g, int64_t t, int64_t p) {
    typedef typename Compute<T>::type A;
    return mask ? to_compute(mask[((n * d.offset_groups + g) * d.taps() + t) * d.pixels() + p])
                : (A)1;
}

/* A thread of im2col and col2im: image n (the span's j-th), channel c,
 * pixel p0 + q, through the K taps (the index split once, not per tap: a
 * thread per column value took 199 us per image for im2col on the bench's
 * workload, twice torchvision's per image, ncu on an H100, 2026-11-26);
 * `column` is its tap 0's place in the span's columns. */
template <typename T> struct TapWalk {
    typedef typename Compute<T>::type A;
    int64_t n, c, oy, ox, column;
    const T *dy, *m;   /* tap 0's y offset and mask of the pixel (m null: no mask) */

    /* (a thread of `group` channels, from c, where group divides the
     * channels of an offset group: i counts (image, channel group, pixel)) */
    __device__ TapWalk(const T *offset, const T *mask, const mmd_dcn_shape &d, const Span &span,
                       int64_t i, int group = 1) {
        const int64_t taps = d.taps(), pixels = d.pixels(), count = span.count;
        const int64_t q = i % count, rest = i / count, groups = d.in_channels / group;
        c = rest % groups * group;
        const int64_t j = rest / groups;
        n = span.n0 + j;
        column = (j * d.in_channels + c) * taps * count + q;
        const int64_t p = span.p0 + q;
        const int64_t pair = n * d.offset_groups + c / d.channels_per_offset_group();
        oy = p / d.out_w;
        ox = p - oy * d.out_w;
        dy = offset + pair * 2 * taps * pixels + p;
        m = mask ? mask + pair * taps * pixels + p : nullptr;
    }
    /* f(t, sample, mask) for each tap t, in order */
    template <typename F> __device__ void each(const mmd_dcn_shape &d, F f) const {
        const int64_t pixels = d.pixels();
        int64_t t = 0;
        for (int64_t ki = 0; ki < d.kernel_h; ++ki)
            for (int64_t kj = 0; kj < d.kernel_w; ++kj, ++t) {
                Sample<A> s;
                locate_at(dy + 2 * t * pixels, d, oy, ox, ki, kj, &s);
                f(t, s, m ? to_compute(m[t * pixels]) : (A)1);
            }
    }
};

/* columns[((j * C + c) * K + t) * count + q] = mask * sample of image
 * n0 + j, channel c, pixel p0 + q, tap t: a thread per (image, group of G
 * channels, pixel), pixels fastest. The G channels of an offset group
 * sample the same places: a tap's offsets, mask and corners are worked out
 * once for them (ncu on the H200, 2026-11-27: a thread per channel, this
 * kernel took 168 us of the bench's forward, issue-bound, where
 * torchvision's took 81 us). */
template <typename T, int G>
__global__ void __launch_bounds__(kThreads, 3)   /* 3 blocks an SM: 80 registers */
im2col_kernel(const T *input, const T *offset, const T *mask, mmd_dcn_shape d, Span span,
              typename Compute<T>::type *columns) {
    typedef typename Compute<T>::type A;
    const int64_t plane = d.height * d.width, count = span.count, step = d.taps() * count;
    MMD_GRID_STRIDE_LOOP(i, span.images * (d.in_channels / G) * count) {
        const TapWalk<T> w(offset, mask, d, span, i, G);
        const T *x = input + (w.n * d.in_channels + w.c) * plane;
        A *out = columns + w.column;
        w.each(d, [&](int64_t t, const Sample<A> &s, A weight) {
            A v[G][4];
#pragma unroll   /* the G channels' corner loads in flight together */
            for (int g = 0; g < G; ++g) mmd_bilinear_corners(s, x + g * plane, v[g]);
#pragma unroll
            for (int g = 0; g < G; ++g)
                out[g * step + t * count] = weight * mmd_bilinear_value(s, v[g]);
        });
    }
}

/* im2col_kernel over a span: 4 channels a thread where they divide the
 * channels of an offset group, else one. */
template <typename T>
int im2col(const mmd_dcn_shape &d, const Span &span, const T *input, const T *offset,
           const T *mask, typename Compute<T>::type *columns, cudaStream_t stream) {
    const int64_t items = span.images * d.in_channels * span.count;
    if (d.channels_per_offset_group() % 4 == 0)
        im2col_kernel<T, 4><<<blocks_for(items / 4), kThreads, 0, stream>>>(input, offset, mask,
                                                                          d, span, columns);
    else
        im2col_kernel<T, 1><<<blocks_for(items), kThreads, 0, stream>>>(input, offset, mask, d,
                                                                       span, columns);
    return launch_status("deform_conv2d im2col launch");
}

/* A row-major matrix view: element (i, j) at data[i * row + j * col]. */
template <typename E> struct View {
    const E *data;
    int64_t row, col;
    __device__ E at(int64_t i, int64_t j) const { return data[i * row + j * col]; }
};

/* C (m x n, leading dimension ldc) = a x b + beta * C (+ bias[i] per row),
 * summed in Acc. A block of 256 threads makes a BM x BN tile of C, each
 * thread TM x TN elements of it (in runs of 4 neighbours, BM / (TM / 4)
 * rows and BN / (TN / 4) columns apart, so that a warp's vector reads of
 * shared memory and its stores are contiguous), from kBK-deep slices of a
 * and b staged in shared memory (loaded along whichever of a's or b's
 * dimensions is contiguous, so that the reads coalesce). Every element is
 * one thread's chain of fused multiply-adds in the order of k: the same bits
 * on every run. Two shapes: 128 x 128 of 8 x 8 (four times the work per
 * shared-memory read) for float products of 128 rows and columns or more,
 * 64 x 64 of 4 x 4 otherwise (and for double, whose 8 x 8 sums would not
 * fit in registers). On an H100 the 64 x 64 shape ran the forward's
 * products at about a quarter of the FP32 peak (ncu, 2026-11-26); the
 * 16 x 16 tile of one element per thread before it took 2.3 ms of the
 * forward's workload, where torchvision took 0.4 ms. */
template <int BM_, int BN_, int TM_, int TN_> struct TileShape {
    static constexpr int BM = BM_, BN = BN_, TM = TM_, TN = TN_;
    static constexpr int kColumnsOfThreads = BN / TN;
    static_assert((BM / TM) * (BN / TN) == 256 && TM % 4 == 0 && TN % 4 == 0, "tile shape");
};
typedef TileShape<64, 64, 4, 4> SmallTile;
typedef TileShape<128, 128, 8, 8> LargeTile;
constexpr int kBK = 16, kGemmThreads = 256;
constexpr int kPad = 4;   /* keeps rows 16-byte aligned, spreads stores over banks */

template <typename Tile, typename Acc, typename EA, typename EB, typename EC>
__global__ void __launch_bounds__(kGemmThreads)
gemm_kernel(int64_t m, int64_t n, int64_t k, View<EA> a, View<EB> b, EC *c, int64_t ldc,
            Acc beta, const EC *bias, int64_t span, int64_t slice_stride) {
    constexpr int BM = Tile::BM, BN = Tile::BN, TM = Tile::TM, TN = Tile::TN;
    constexpr int RUN_M = BM / (TM / 4), RUN_N = BN / (TN / 4);   /* between runs of 4 */
    /* split k: block z sums k in [z * span, (z + 1) * span) into slice z of c */
    const int64_t k_begin = (int64_t)blockIdx.z * span;
    k = k - k_begin < span ? k : k_begin + span;
    c += (int64_t)blockIdx.z * slice_stride;
    alignas(16) __shared__ Acc tile_a[kBK][BM + kPad];   /* a^T: [depth][row] */
    alignas(16) __shared__ Acc tile_b[kBK][BN + kPad];   /* b: [depth][column] */
    const int tid = threadIdx.x, tx = tid % Tile::kColumnsOfThreads;
    const int ty = tid / Tile::kColumnsOfThreads;
    const int64_t row0 = (int64_t)blockIdx.y * BM, col0 = (int64_t)blockIdx.x * BN;
    const bool a_along_k = a.col == 1, b_along_n = b.col == 1;
    Acc sum[TM][TN];
    for (int i = 0; i < TM; ++i)
        for (int j = 0; j < TN; ++j) sum[i][j] = 0;
    for (int64_t p0 = k_begin; p0 < k; p0 += kBK) {
        for (int e = tid; e < BM * kBK; e += kGemmThreads) {
            const int ii = a_along_k ? e / kBK : e % BM, kk = a_along_k ? e % kBK : e / BM;
            const int64_t i = row0 + ii, q = p0 + kk;
            tile_a[kk][ii] = i < m && q < k ? (Acc)to_compute(a.at(i, q)) : (Acc)0;
        }
        for (int e = tid; e < BN * kBK; e += kGemmThreads) {
            const int jj = b_along_n ? e % BN : e / kBK, kk = b_along_n ? e / BN : e % kBK;
            const int64_t j = col0 + jj, q = p0 + kk;
            tile_b[kk][jj] = q < k && j < n ? (Acc)to_compute(b.at(q, j)) : (Acc)0;
        }
        __syncthreads();
        const int depth = k - p0 < kBK ? (int)(k - p0) : kBK;
        for (int q = 0; q < depth; ++q) {
            Acc av[TM], bv[TN];
            for (int i = 0; i < TM; ++i) av[i] = tile_a[q][(i / 4) * RUN_M + ty * 4 + i % 4];
            for (int j = 0; j < TN; ++j) bv[j] = tile_b[q][(j / 4) * RUN_N + tx * 4 + j % 4];
            for (int i = 0; i < TM; ++i)
                for (int j = 0; j < TN; ++j) sum[i][j] = fma(av[i], bv[j], sum[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < TM; ++i) {
        const int64_t row = row0 + (i / 4) * RUN_M + ty * 4 + i % 4;
        if (row >= m) continue;
        const Acc add = bias != nullptr ? (Acc)to_compute(bias[row]) : (Acc)0;
        for (int j = 0; j < TN; ++j) {
            const int64_t col = col0 + (j / 4) * RUN_N + tx * 4 + j % 4;
            if (col >= n) continue;
            EC *out = c + row * ldc + col;
            Acc value = sum[i][j];
            if (beta != 0) value += beta * (Acc)to_compute(*out);
            if (bias != nullptr) value += add;
            *out = from_compute<EC>(value);
        }
    }
}

/* c = beta * c + the sum of the `slices` partial products in part (each
 * m x n, in slice order: the same bits on every run) (+ bias[i] per row). */
template <typename Acc, typename EC>
__global__ void sum_slices_kernel(const Acc *part, int slices, int64_t m, int64_t n, EC *c,
                                  int64_t ldc, Acc beta, const EC *bias) {
    MMD_GRID_STRIDE_LOOP(e, m * n) {
        const int64_t i = e / n;
        Acc value = 0;
        for (int z = 0; z < slices; ++z) value += part[z * m * n + e];
        EC *out = c + i * ldc + (e - i * n);
        if (beta != 0) value += beta * (Acc)to_compute(*out);
        if (bias != nullptr) value += (Acc)to_compute(bias[i]);
        *out = from_compute<EC>(value);
    }
}

/* Products with fewer tiles than keep the GPU busy (grad_weight's: 256 x
 * 2304 over 4096 pixels is 144 tiles, which took 665 us on an H100 at a
 * third of its compute throughput) split k into up to kMaxSlices slices of
 * at least kMinSpan, summed by sum_slices_kernel. */
constexpr int64_t kTargetBlocks = 512, kMinSpan = 256, kMaxSlices = 16;

template <typename Tile, typename Acc, typename EA, typename EB, typename EC>
int gemm_in(cudaStream_t stream, int64_t m, int64_t n, int64_t k, View<EA> a, View<EB> b,
            EC *c, int64_t ldc, Acc beta, const EC *bias) {
    constexpr int BM = Tile::BM, BN = Tile::BN;
    /* rows in slabs: a grid has at most 65535 blocks along y */
    const int64_t slab = int64_t(65535) * BM;
    for (int64_t r0 = 0; r0 < m; r0 += slab) {
        const int64_t rows = m - r0 < slab ? m - r0 : slab;
        const int64_t tiles = ((n + BN - 1) / BN) * ((rows + BM - 1) / BM);
        int64_t slices = tiles > 0 ? (kTargetBlocks + tiles - 1) / tiles : 1;
        if (slices > k / kMinSpan) slices = k / kMinSpan;   /* k = 0 too: one slice */
        if (slices > kMaxSlices) slices = kMaxSlices;
        if (slices < 1) slices = 1;
        const int64_t span = (k + slices - 1) / slices;
        if (slices > 1) slices = (k + span - 1) / span;   /* no empty slice */
        const dim3 grid((unsigned)((n + BN - 1) / BN), (unsigned)((rows + BM - 1) / BM),
                        (unsigned)slices);
        const View<EA> a_slab{a.data + r0 * a.row, a.row, a.col};
        const EC *bias_slab = bias ? bias + r0 : nullptr;
        if (slices == 1) {
            gemm_kernel<Tile, Acc><<<grid, kGemmThreads, 0, stream>>>(
                rows, n, k, a_slab, b, c + r0 * ldc, ldc, beta, bias_slab, k, (int64_t)0);
        } else {
            StreamBuffer part(stream);
            const cudaError_t err = part.allocate(sizeof(Acc) * slices * rows * n);
            if (err != cudaSuccess) return cuda_error(err, "deform_conv2d product slices");
            gemm_kernel<Tile, Acc><<<grid, kGemmThreads, 0, stream>>>(
                rows, n, k, a_slab, b, part.as<Acc>(), n, (Acc)0, (const Acc *)nullptr, span,
                rows * n);
            int s = launch_status("deform_conv2d product launch");
            if (s) return s;
            sum_slices_kernel<<<blocks_for(rows * n), kThreads, 0, stream>>>(
                part.as<Acc>(), (int)slices, rows, n, c + r0 * ldc, ldc, beta, bias_slab);
        }
        const int s = launch_status("deform_conv2d product launch");
        if (s) return s;
    }
    return MMD_OK;
}

/* c[b * c_batch + i * ldc + j] = bias[i] for the elements of `batches`
 * m x n products. */
template <typename E>
__global__ void fill_rows_kernel(E *c, int64_t ldc, int64_t c_batch, int64_t batches, int64_t m,
                                 int64_t n, const E *bias) {
    MMD_GRID_STRIDE_LOOP(e, batches * m * n) {
        const int64_t b = e / (m * n), r = e % (m * n);
        c[b * c_batch + (r / n) * ldc + r % n] = bias[r / n];
    }
}

/* The products gemm() may take: only our own (the deterministic backend:
 * cuBLAS keeps its bits only while one stream is active), or the process's
 * cuBLAS where it can, with float products in IEEE float32 or, where the
 * call allows it (MMD_CONTEXT_TF32: mmdispatch.set_float32_matmul_precision,
 * or torch's setting in mmdispatch.torch), in TF32 on devices that have it,
 * as torch's own products (torchvision's deform_conv2d's) take it. */
enum class Products { kOwn, kLibrary, kLibraryTf32 };

Products products_for(bool deterministic, const mmd_context *ctx) {
    if (deterministic) return Products::kOwn;
    return tf32(ctx) ? Products::kLibraryTf32 : Products::kLibrary;
}

/* `batches` products (gemm_in's contract each; product j's operands and
 * result a_batch, b_batch and c_batch elements past product 0's, a stride
 * of 0 sharing one) in one call to the process's cuBLAS
 * (mmdispatch/cuda/cublas.cuh), where it has one (with strided batched
 * products, for batches > 1) and the operands are all of the compute
 * type: the bias first written into c, then added to by the product.
 * False, with c unwritten or to be overwritten (beta 0), where it did not. */
template <typename Acc, typename EA, typename EB, typename EC>
bool library_gemm(cudaStream_t stream, int64_t batches, int64_t m, int64_t n, int64_t k,
                  View<EA> a, int64_t a_batch, View<EB> b, int64_t b_batch, EC *c, int64_t ldc,
                  int64_t c_batch, Acc beta, const EC *bias, bool tf32) {
    if constexpr (std::is_same<EA, Acc>::value && std::is_same<EB, Acc>::value &&
                  std::is_same<EC, Acc>::value) {
        if (bias != nullptr && beta != 0) return false;
        if (bias != nullptr && batches > 0 && m > 0 && n > 0 && k > 0) {
            fill_rows_kernel<<<blocks_for(batches * m * n), kThreads, 0, stream>>>(
                c, ldc, c_batch, batches, m, n, bias);
            if (cudaGetLastError() != cudaSuccess) return false;
            beta = 1;
        }
        return cublas_gemm(stream, batches, m, n, k, a.data, a.row, a.col, a_batch, b.data,
                           b.row, b.col, b_batch, beta, c, ldc, c_batch, tf32);
    }
    return false;
}

/* One product (gemm_in's contract) in the own tiles: 128 x 128 for float
 * products of 128 rows and columns or more, else 64 x 64. */
template <typename Acc, typename EA, typename EB, typename EC>
int own_gemm(cudaStream_t stream, int64_t m, int64_t n, int64_t k, View<EA> a, View<EB> b,
             EC *c, int64_t ldc, Acc beta, const EC *bias) {
    if constexpr (sizeof(Acc) == 4) {
        if (m >= LargeTile::BM && n >= LargeTile::BN)
            return gemm_in<LargeTile>(stream, m, n, k, a, b, c, ldc, beta, bias);
    }
    return gemm_in<SmallTile>(stream, m, n, k, a, b, c, ldc, beta, bias);
}

/* `batches` products c_j = a_j x b_j + beta * c_j (+ bias per row), at
 * library_gemm's strides: in one call to the process's cuBLAS where
 * `products` allows it and it can, else one at a time, each through cuBLAS
 * as above or the own tiles. */
template <typename Acc, typename EA, typename EB, typename EC>
int gemm(cudaStream_t stream, int64_t batches, int64_t m, int64_t n, int64_t k, View<EA> a,
         int64_t a_batch, View<EB> b, int64_t b_batch, EC *c, int64_t ldc, int64_t c_batch,
         Acc beta, const EC *bias, Products products) {
    const bool library = products != Products::kOwn;
    const bool tf32 = products == Products::kLibraryTf32;
    if (library && library_gemm(stream, batches, m, n, k, a, a_batch, b, b_batch, c, ldc,
                                c_batch, beta, bias, tf32))
        return launch_status("deform_conv2d product (cuBLAS)");
    for (int64_t j = 0; j < batches; ++j) {
        const View<EA> aj{a.data + j * a_batch, a.row, a.col};
        const View<EB> bj{b.data + j * b_batch, b.row, b.col};
        EC *cj = c + j * c_batch;
        const int s =
            batches > 1 && library &&
                    library_gemm(stream, 1, m, n, k, aj, 0, bj, 0, cj, ldc, 0, beta, bias,
                                 tf32)
                ? launch_status("deform_conv2d product (cuBLAS)")
                : own_gemm(stream, m, n, k, aj, bj, cj, ldc, beta, bias);
        if (s) return s;
    }
    return MMD_OK;
}

/* grad_offset and grad_mask of the span's images and pixels. An item is
 * (image, offset group, tap, pixel), its sums over the group's channels.
 * A block takes 32 consecutive items (a lane each: a warp's loads are the
 * neighbouring pixels' of one channel) and splits each item's channels
 * over its kOffsetWarps warps, warp w summing channels w, w + kOffsetWarps,
 * ... in order; the first warp then adds the warps' sums in warp order (the
 * same bits on every run, the deterministic backend's too). A thread per
 * item through all of the group's channels made the bench's 73,728 items
 * 288 blocks, 1.1 waves of an H200 at 2 blocks an SM, each thread 256
 * channels long (145 us, ncu 2026-11-27). */
constexpr int kOffsetWarps = kThreads / 32;

template <typename T>
__global__ void __launch_bounds__(kThreads, 3)   /* 3 blocks an SM: 80 registers */
    offset_mask_grad_kernel(const T *input, const T *offset, const T *mask, mmd_dcn_shape d,
                            Span span, const typename Compute<T>::type *grad_columns,
                            T *grad_offset, T *grad_mask) {
    typedef typename Compute<T>::type A;
    __shared__ A partial[4][kOffsetWarps][32];   /* (gy, gx, gm, edge's) [warp][lane] */
    const int64_t taps = d.taps(), per_group = d.channels_per_offset_group();
    const int64_t plane = d.height * d.width, pixels = d.pixels(), count = span.count;
    const int64_t items = span.images * d.offset_groups * taps * count;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int64_t tile = blockIdx.x; tile < (items + 31) / 32; tile += gridDim.x) {
        const int64_t i = tile * 32 + lane;
        const int64_t q = i % count, t = (i / count) % taps, rest = i / count / taps;
        const int64_t g = rest % d.offset_groups, j = rest / d.offset_groups;
        const int64_t n = span.n0 + j, p = span.p0 + q;
        Sample<A> s;
        s.edge = 0;
        A gy = 0, gx = 0, gm = 0, ge = 0;
        if (i < items) {
            /* the image's columns' gradient */
            const A *image_grads = grad_columns + j * d.in_channels * taps * count;
            locate(offset, d, n, g, t, p, &s);
            const A m = mask_at(mask, d, n, g, t, p);
            for (int64_t c = g * per_group + warp; c < (g + 1) * per_group; c += kOffsetWarps) {
                A v[4];
                mmd_bilinear_corners(s, input + (n * d.in_channels + c) * plane, v);
                const A gc = image_grads[(c * taps + t) * count + q];
                gm += gc * mmd_bilinear_value(s, v);
                /* the mask in each channel's term, as the CPU kernel has it */
                gy += gc * m * mmd_bilinear_dvalue_dy(s, v);
                gx += gc * m * mmd_bilinear_dvalue_dx(s, v);
            }
            if (s.edge) {   /* its one derivative that is not 0 (mmdispatch/bilinear.h) */
                Sample<A> at;
                locate(offset, d, n, g, t, p, &at, s.edge);
                for (int64_t c = g * per_group + warp; c < (g + 1) * per_group;
                     c += kOffsetWarps) {
                    A v[4];
                    mmd_bilinear_corners(at, input + (n * d.in_channels + c) * plane, v);
                    ge += image_grads[(c * taps + t) * count + q] * m *
                          mmd_bilinear_edge_derivative(s.edge, at, v);
                }
            }
        }
        partial[0][warp][lane] = gy;
        partial[1][warp][lane] = gx;
        partial[2][warp][lane] = gm;
        partial[3][warp][lane] = ge;
        __syncthreads();
        if (warp == 0 && i < items) {
            A sy = 0, sx = 0, sm = 0, se = 0;
            for (int w = 0; w < kOffsetWarps; ++w) {
                sy += partial[0][w][lane];
                sx += partial[1][w][lane];
                sm += partial[2][w][lane];
                se += partial[3][w][lane];
            }
            if (s.edge) (s.edge == MMD_BILINEAR_EDGE_Y ? sy : sx) = se;
            T *out = grad_offset + ((n * d.offset_groups + g) * 2 * taps + 2 * t) * pixels + p;
            out[0] = from_compute<T>(sy);
            out[pixels] = from_compute<T>(sx);
            grad_mask[((n * d.offset_groups + g) * taps + t) * pixels + p] = from_compute<T>(sm);
        }
        __syncthreads();
    }
}

/* Adds grad times a sample's bilinear weights into its cells of `plane`
 * (plane_size cells): float on devices with vector atomics, the cells that
 * share the 4 of an aligned address (a row's two, 3 times in 4) in one
 * float4 atomic (common.cuh's CellWindow; the window's other cells, of the
 * same plane, get -0.0, the identity); else an atomic per cell. */
template <typename A>
__device__ inline void add_sample(A *plane, int64_t plane_size, const Sample<A> &s, A grad) {
#if MMD_CUDA_VECTOR_ATOMICS
    if constexpr (std::is_same<A, float>::value) {
        if (plane_size <= INT_MAX) {
            CellWindow window(plane);
            const auto put = [&](int first, unsigned touched, Float4 weight) {
                add_window(plane, (int)plane_size, first, touched, weight, grad);
            };
            for (int k = 0; k < 4; ++k)   /* the cells come in increasing order */
                if (s.index[k] >= 0) window.add((int)s.index[k], s.weight[k], put);
            window.flush(put);
            return;
        }
    }
#endif
    for (int k = 0; k < 4; ++k)
        if (s.index[k] >= 0) atomicAdd(plane + s.index[k], grad * s.weight[k]);
}

/* grad_input (in A) += the columns' gradient at each sample's cells, with
 * atomics: a thread per (channel, pixel) through the K taps, as im2col. */
template <typename T>
__global__ void col2im_atomic_kernel(const T *offset, const T *mask, mmd_dcn_shape d, Span span,
                                     const typename Compute<T>::type *grad_columns,
                                     typename Compute<T>::type *grad_input) {
    typedef typename Compute<T>::type A;
    const int64_t plane_size = d.height * d.width, count = span.count;
    MMD_GRID_STRIDE_LOOP(i, span.images * d.in_channels * count) {
        const TapWalk<T> w(offset, mask, d, span, i);
        A *plane = grad_input + (w.n * d.in_channels + w.c) * plane_size;
        const A *grads = grad_columns + w.column;
        w.each(d, [&](int64_t t, const Sample<A> &s, A weight) {
            add_sample(plane, plane_size, s, grads[t * count] * weight);
        });
    }
}

/* The same, a warp per (image, input channel) plane (blocks of one warp,
 * a grid-stride loop over the planes): its (tap, pixel) items 32 at a
 * time, each of the 4 cells added with warp_ordered_add. */
template <typename T>
__global__ void col2im_deterministic_kernel(const T *offset, const T *mask, mmd_dcn_shape d,
                                            Span span,
                                            const typename Compute<T>::type *grad_columns,
                                            typename Compute<T>::type *grad_input) {
    typedef typename Compute<T>::type A;
    const int64_t taps = d.taps(), count = span.count, items = taps * count;
    for (int64_t b = blockIdx.x; b < span.images * d.in_channels; b += gridDim.x) {
        const int64_t c = b % d.in_channels, j = b / d.in_channels, n = span.n0 + j;
        const int64_t g = c / d.channels_per_offset_group();
        A *plane = grad_input + (n * d.in_channels + c) * d.height * d.width;
        const A *grads = grad_columns + (j * d.in_channels + c) * items;
        for (int64_t i0 = 0; i0 < items; i0 += 32) {
            const int64_t i = i0 + threadIdx.x;
            Sample<A> s;
            A grad = 0;
            for (int k = 0; k < 4; ++k) s.index[k] = -1, s.weight[k] = 0;
            if (i < items) {
                const int64_t t = i / count, q = i % count;
                locate(offset, d, n, g, t, span.p0 + q, &s);
                grad = grads[i] * mask_at(mask, d, n, g, t, span.p0 + q);
            }
            for (int k = 0; k < 4; ++k)
                warp_ordered_add(plane, s.index[k], grad * s.weight[k]);
        }
    }
}

/* grad_bias[o] = sum of grad_output over images and pixels: a block per
 * channel, strided partial sums then a tree, in a fixed order. */
template <typename T>
__global__ void bias_grad_kernel(const T *grad_output, mmd_dcn_shape d, T *grad_bias) {
    typedef typename Compute<T>::type A;
    __shared__ A partial[kThreads];
    const int64_t o = blockIdx.x, pixels = d.pixels();
    A sum = 0;
    for (int64_t i = threadIdx.x; i < d.batch * pixels; i += blockDim.x)
        sum += to_compute(grad_output[((i / pixels) * d.out_channels + o) * pixels + i % pixels]);
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int half = kThreads / 2; half > 0; half /= 2) {
        if ((int)threadIdx.x < half) partial[threadIdx.x] += partial[threadIdx.x + half];
        __syncthreads();
    }
    if (threadIdx.x == 0) grad_bias[o] = from_compute<T>(partial[0]);
}

template <typename T, typename A>
__global__ void store_kernel(const A *from, T *to, int64_t total) {
    MMD_GRID_STRIDE_LOOP(i, total) to[i] = from_compute<T>(from[i]);
}

template <typename T>
int forward(const mmd_dcn_shape &d, const T *input, const T *offset, const T *mask,
            const T *weight, const T *bias, T *output, Products products,
            cudaStream_t stream) {
    typedef typename Compute<T>::type A;
    const int64_t pixels = d.pixels(), rows = d.in_channels * d.taps();
    if (d.batch * d.out_channels * pixels == 0) return MMD_OK;
    const Span most = pass_of(d);
    const int64_t out_per_group = d.out_channels / d.groups, k = rows / d.groups;
    StreamBuffer columns(stream);
    cudaError_t err = columns.allocate(sizeof(A) * rows * most.count * most.images);
    if (err != cudaSuccess) return cuda_error(err, "deform_conv2d column buffer");
    return for_each_pass(d, most, [&](const Span &span) -> int {
        const int64_t count = span.count;
        if (rows > 0) {
            const int s = im2col<T>(d, span, input, offset, mask, columns.as<A>(), stream);
            if (s) return s;
        }
        /* per weight group, one product per image (batched) */
        for (int64_t g = 0; g < d.groups; ++g) {
            const View<T> w{weight + g * out_per_group * k, k, 1};
            const View<A> cols{columns.as<A>() + g * k * count, count, 1};
            T *out = output + (span.n0 * d.out_channels + g * out_per_group) * pixels + span.p0;
            int s = gemm<A>(stream, span.images, out_per_group, count, k, w, 0, cols,
                            rows * count, out, pixels, d.out_channels * pixels, (A)0,
                            bias ? bias + g * out_per_group : nullptr, products);
            if (s) return s;
        }
        return MMD_OK;
    });
}

/* Where backward sums a gradient: the output itself when T computes in T,
 * else a buffer in A, stored into it at the end. */
template <typename T> struct Sum {
    typedef typename Compute<T>::type A;
    StreamBuffer buffer;
    A *data = nullptr;
    T *target;
    int64_t size;

    Sum(cudaStream_t stream, T *target_, int64_t size_)
        : buffer(stream), target(target_), size(size_) {}
    int start(cudaStream_t stream) {
        if (std::is_same<T, A>::value) {
            data = (A *)target;
        } else {
            const cudaError_t err = buffer.allocate(sizeof(A) * size);
            if (err != cudaSuccess) return cuda_error(err, "deform_conv2d gradient buffer");
            data = buffer.as<A>();
        }
        if (size == 0) return MMD_OK;
        const cudaError_t err = cudaMemsetAsync(data, 0, sizeof(A) * size, stream);
        return err == cudaSuccess ? MMD_OK : cuda_error(err, "deform_conv2d gradient zeroing");
    }
    int finish(cudaStream_t stream) {
        if (std::is_same<T, A>::value || size == 0) return MMD_OK;
        store_kernel<T, A><<<blocks_for(size), kThreads, 0, stream>>>(data, target, size);
        return launch_status("deform_conv2d gradient store launch");
    }
};

template <typename T> struct Grads {
    T *input, *offset, *mask, *weight, *bias;
};

template <typename T>
int backward(const mmd_dcn_shape &d, const T *grad_output, const T *input, const T *offset,
             const T *mask, const T *weight, const Grads<T> &grads, bool deterministic,
             Products products, cudaStream_t stream) {
    typedef typename Compute<T>::type A;
    const int64_t pixels = d.pixels(), rows = d.in_channels * d.taps();
    const int64_t out_per_group = d.out_channels / d.groups, k = rows / d.groups;
    if (deterministic && d.in_channels > INT32_MAX)   /* before anything is written */
        return mmd_error(MMD_ERR_VALUE, "the deterministic backend takes at most %d input "
                         "channels, got %lld", INT32_MAX, (long long)d.in_channels);
    if (d.out_channels > 0) {
        bias_grad_kernel<T><<<(unsigned)d.out_channels, kThreads, 0, stream>>>(grad_output, d,
                                                                               grads.bias);
        int s = launch_status("deform_conv2d bias gradient launch");
        if (s) return s;
    }
    Sum<T> grad_input(stream, grads.input, d.batch * d.in_channels * d.height * d.width);
    Sum<T> grad_weight(stream, grads.weight, d.out_channels * k);
    int s = grad_input.start(stream);
    if (!s) s = grad_weight.start(stream);
    if (s) return s;
    const int64_t offset_size = d.batch * 2 * d.offset_groups * d.taps() * pixels;
    if (d.batch * pixels == 0 || rows == 0) {
        cudaError_t err = cudaSuccess;
        if (offset_size > 0) {
            err = cudaMemsetAsync(grads.offset, 0, sizeof(T) * offset_size, stream);
            if (err == cudaSuccess)
                err = cudaMemsetAsync(grads.mask, 0, sizeof(T) * offset_size / 2, stream);
        }
        if (err != cudaSuccess) return cuda_error(err, "deform_conv2d gradient zeroing");
        s = grad_input.finish(stream);
        return s ? s : grad_weight.finish(stream);
    }
    const Span most = pass_of(d);
    StreamBuffer columns(stream);
    cudaError_t err = columns.allocate(sizeof(A) * rows * most.count * most.images);
    if (err != cudaSuccess) return cuda_error(err, "deform_conv2d column buffer");
    s = for_each_pass(d, most, [&](const Span &span) -> int {
        const int64_t count = span.count, items = span.images * d.in_channels;
        int s = im2col<T>(d, span, input, offset, mask, columns.as<A>(), stream);
        for (int64_t g = 0; g < d.groups && !s; ++g) {
            const T *grad_g =
                grad_output + (span.n0 * d.out_channels + g * out_per_group) * pixels + span.p0;
            A *cols = columns.as<A>() + g * k * count;
            /* grad_weight += grad_output x columns^T, image by image in order */
            for (int64_t j = 0; j < span.images && !s; ++j)
                s = gemm<A>(stream, 1, out_per_group, k, count,
                            View<T>{grad_g + j * d.out_channels * pixels, pixels, 1}, 0,
                            View<A>{cols + j * rows * count, 1, count}, 0,
                            grad_weight.data + g * out_per_group * k, k, 0, (A)1,
                            (const A *)nullptr, products);
            /* the columns' gradient: weight^T x grad_output, per image (batched) */
            if (!s)
                s = gemm<A>(stream, span.images, k, count, out_per_group,
                            View<T>{weight + g * out_per_group * k, 1, k}, 0,
                            View<T>{grad_g, pixels, 1}, d.out_channels * pixels, cols, count,
                            rows * count, (A)0, (const A *)nullptr, products);
        }
        if (s) return s;
        const int64_t tiles = (span.images * d.offset_groups * d.taps() * count + 31) / 32;
        offset_mask_grad_kernel<T><<<grid_of(tiles), kThreads, 0, stream>>>(
            input, offset, mask, d, span, columns.as<A>(), grads.offset, grads.mask);
        if (deterministic)
            col2im_deterministic_kernel<T><<<grid_of(items), 32, 0, stream>>>(
                offset, mask, d, span, columns.as<A>(), grad_input.data);
        else
            col2im_atomic_kernel<T><<<blocks_for(items * count), kThreads, 0, stream>>>(
                offset, mask, d, span, columns.as<A>(), grad_input.data);
        return launch_status("deform_conv2d backward launch");
    });
    if (s) return s;
    s = grad_input.finish(stream);
    return s ? s : grad_weight.finish(stream);
}

template <typename T> const T *data_of(const mmd_tensor *t) {
    return t ? (const T *)t->data : nullptr;
}

int forward_cuda(const mmd_tensor *input, const mmd_tensor *offset, const mmd_tensor *mask,
                 const mmd_tensor *weight, const mmd_tensor *bias, const mmd_tensor *output,
                 int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                 int64_t dilation_h, int64_t dilation_w, int64_t groups, int64_t offset_groups,
                 bool deterministic, const mmd_context *ctx) {
    mmd_dcn_shape d;
    int s = mmd_deform_conv2d_forward_check(input, offset, mask, weight, bias, output, stride_h,
                                            stride_w, pad_h, pad_w, dilation_h, dilation_w,
                                            groups, offset_groups, MMD_FLOAT16_BF16_32_64, &d);
    if (s) return s;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            return forward<T>(d, data_of<T>(input), data_of<T>(offset), data_of<T>(mask),
                              data_of<T>(weight), data_of<T>(bias), (T *)output->data,
                              products_for(deterministic, ctx), stream);
        });
    });
}

int deform_conv2d_forward_cuda(const mmd_tensor *input, const mmd_tensor *offset,
                               const mmd_tensor *mask, const mmd_tensor *weight,
                               const mmd_tensor *bias, const mmd_tensor *output,
                               int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                               int64_t dilation_h, int64_t dilation_w, int64_t groups,
                               int64_t offset_groups, const mmd_context *ctx) {
    return forward_cuda(input, offset, mask, weight, bias, output, stride_h, stride_w, pad_h,
                        pad_w, dilation_h, dilation_w, groups, offset_groups, false, ctx);
}

int deform_conv2d_forward_cuda_deterministic(
    const mmd_tensor *input, const mmd_tensor *offset, const mmd_tensor *mask,
    const mmd_tensor *weight, const mmd_tensor *bias, const mmd_tensor *output, int64_t stride_h,
    int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h, int64_t dilation_w,
    int64_t groups, int64_t offset_groups, const mmd_context *ctx) {
    return forward_cuda(input, offset, mask, weight, bias, output, stride_h, stride_w, pad_h,
                        pad_w, dilation_h, dilation_w, groups, offset_groups, true, ctx);
}

int backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *input,
                  const mmd_tensor *offset, const mmd_tensor *mask, const mmd_tensor *weight,
                  const mmd_tensor *grad_input, const mmd_tensor *grad_offset,
                  const mmd_tensor *grad_mask, const mmd_tensor *grad_weight,
                  const mmd_tensor *grad_bias, int64_t stride_h, int64_t stride_w, int64_t pad_h,
                  int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
                  int64_t offset_groups, bool deterministic, const mmd_context *ctx) {
    mmd_dcn_shape d;
    int s = mmd_deform_conv2d_backward_check(grad_output, input, offset, mask, weight,
                                             grad_input, grad_offset, grad_mask, grad_weight,
                                             grad_bias, stride_h, stride_w, pad_h, pad_w,
                                             dilation_h, dilation_w, groups, offset_groups,
                                             MMD_FLOAT16_BF16_32_64, &d);
    if (s) return s;
    return on_device(ctx, [&](cudaStream_t stream) {
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            const Grads<T> grads{(T *)grad_input->data, (T *)grad_offset->data,
                                 (T *)grad_mask->data, (T *)grad_weight->data,
                                 (T *)grad_bias->data};
            return backward<T>(d, data_of<T>(grad_output), data_of<T>(input), data_of<T>(offset),
                               data_of<T>(mask), data_of<T>(weight), grads, deterministic,
                               products_for(deterministic, ctx), stream);
        });
    });
}

int deform_conv2d_backward_cuda(const mmd_tensor *grad_output, const mmd_tensor *input,
                                const mmd_tensor *offset, const mmd_tensor *mask,
                                const mmd_tensor *weight, const mmd_tensor *grad_input,
                                const mmd_tensor *grad_offset, const mmd_tensor *grad_mask,
                                const mmd_tensor *grad_weight, const mmd_tensor *grad_bias,
                                int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                                int64_t dilation_h, int64_t dilation_w, int64_t groups,
                                int64_t offset_groups, const mmd_context *ctx) {
    return backward_cuda(grad_output, input, offset, mask, weight, grad_input, grad_offset,
                         grad_mask, grad_weight, grad_bias, stride_h, stride_w, pad_h, pad_w,
                         dilation_h, dilation_w, groups, offset_groups, false, ctx);
}

int deform_conv2d_backward_cuda_deterministic(
    const mmd_tensor *grad_output, const mmd_tensor *input, const mmd_tensor *offset,
    const mmd_tensor *mask, const mmd_tensor *weight, const mmd_tensor *grad_input,
    const mmd_tensor *grad_offset, const mmd_tensor *grad_mask, const mmd_tensor *grad_weight,
    const mmd_tensor *grad_bias, int64_t stride_h, int64_t stride_w, int64_t pad_h,
    int64_t pad_w, int64_t dilation_h, int64_t dilation_w, int64_t groups,
    int64_t offset_groups, const mmd_context *ctx) {
    return backward_cuda(grad_output, input, offset, mask, weight, grad_input, grad_offset,
                         grad_mask, grad_weight, grad_bias, stride_h, stride_w, pad_h, pad_w,
                         dilation_h, dilation_w, groups, offset_groups, true, ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, deform_conv2d) {
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_forward_impl, CUDA, DEFAULT,
                             deform_conv2d_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_backward_impl, CUDA, DEFAULT,
                             deform_conv2d_backward_cuda);
    /* the own products only: every sum in a fixed order */
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_forward_impl, CUDA, DETERMINISTIC,
                             deform_conv2d_forward_cuda_deterministic);
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_backward_impl, CUDA, DETERMINISTIC,
                             deform_conv2d_backward_cuda_deterministic);
}
