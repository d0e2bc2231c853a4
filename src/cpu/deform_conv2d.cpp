/* deform_conv2d on CPU: deformable im2col + matrix products (gemm.h).
 *
 * Per image, the output pixels go in chunks whose column buffer holds at
 * most kColumnBudget values, so memory stays bounded on large maps. For a
 * chunk, a table holds each (offset group, kernel tap, pixel)'s bilinear
 * sample (cells, weights, mask), computed once and shared by the group's
 * channels; the columns (C_in * K rows, one per channel and tap) are the
 * masked samples, and each weight group's output is one product with its
 * weight.
 *
 * Backward recomputes the columns, adds grad_output x columns^T into
 * grad_weight, turns the columns into their gradient (weight^T x
 * grad_output), and from it gets grad_offset and grad_mask (per group and
 * tap, summed over the group's channels) and grad_input (per channel, so the
 * scattered sums are race-free and deterministic). */
#include <stdlib.h>
#include <string.h>

#include "mmdispatch/gemm.h"
#include "mmdispatch/ops/deform_conv2d.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "heap_array.h"

namespace {

constexpr int64_t kColumnBudget = int64_t(1) << 22;   /* values in a column buffer */
constexpr int64_t kMaxChunk = 65536;                  /* pixels in a chunk */
constexpr int64_t kChannelBlock = 16;                 /* channels sharing a sample block */
constexpr int64_t kPixelBlock = 64;                   /* pixels in a sample block */

template <typename T> struct Sample : mmd_bilinear_sample<T> {
    T mask;
    bool full;   /* all four cells on the map (and the position defined) */
};

/* The four cells' values: on the map, from the first cell's index. */
template <typename T>
inline void corners_of(const Sample<T> &s, const T *plane, int64_t width, T v[4]) {
    if (s.full) {
        const T *p = plane + s.index[0];
        v[0] = p[0], v[1] = p[1], v[2] = p[width], v[3] = p[width + 1];
    } else {
        mmd_bilinear_corners(s, plane, v);
    }
}

/* The arrays of a call, and its shape. */
template <typename T> struct Call {
    mmd_dcn_shape d;
    const T *input, *offset, *mask, *weight;

    int64_t chunk() const {
        const int64_t rows = d.in_channels * d.taps();
        int64_t pixels = rows > 0 ? kColumnBudget / rows : kMaxChunk;
        if (pixels < 1) pixels = 1;
        if (pixels > kMaxChunk) pixels = kMaxChunk;
        return pixels < d.pixels() ? pixels : d.pixels();
    }

    /* The samples of image n's pixels [p0, p0 + count), (group, tap) major. */
    void locate(int64_t n, int64_t p0, int64_t count, Sample<T> *table) const {
        const int64_t taps = d.taps(), rows = d.offset_groups * taps, pixels = d.pixels();
        mmd_parallel_for(rows, 1, mmd_worth_threads(rows, rows * count * 8),
                         [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const int64_t g = r / taps, t = r % taps, i = t / d.kernel_w, j = t % d.kernel_w;
                const T *dy = offset + ((n * d.offset_groups + g) * 2 * taps + 2 * t) * pixels;
                const T *dx = dy + pixels;
                const T *m = mask ? mask + ((n * d.offset_groups + g) * taps + t) * pixels : nullptr;
                Sample<T> *row = table + r * count;
                for (int64_t q = 0; q < count; ++q) {
                    const int64_t p = p0 + q, oy = p / d.out_w, ox = p % d.out_w;
                    const T y = mmd_dcn_base<T>(oy, i, d.stride_h, d.pad_h, d.dilation_h) + dy[p];
                    const T x = mmd_dcn_base<T>(ox, j, d.stride_w, d.pad_w, d.dilation_w) + dx[p];
                    Sample<T> &s = row[q];
                    mmd_bilinear_locate(y, x, d.height, d.width, &s);
                    s.mask = m ? m[p] : (T)1;
                    s.full = !s.undefined && s.index[0] >= 0 && s.index[1] >= 0 &&
                             s.index[2] >= 0 && s.index[3] >= 0;
                }
            }
            return (int)MMD_OK;
        });
    }

    /* Runs f(c, t, row, q0, q1) for every input channel c, tap t and block
     * [q0, q1) of a chunk's pixels, row the samples of c's offset group and
     * tap t. Blocks of channels (of one offset group) are shared out, each
     * whole to one thread; within one, a block of pixels' samples serves
     * all its channels while in cache. Each channel's calls come in (t, q0)
     * order. */
    template <typename F>
    int for_channels(int64_t count, const Sample<T> *table, const F &f) const {
        const int64_t taps = d.taps(), per_group = d.channels_per_offset_group();
        const int64_t blocks = (per_group + kChannelBlock - 1) / kChannelBlock;
        const int64_t items = d.offset_groups * blocks;
        return mmd_parallel_for(items, 1,
                                mmd_worth_threads(items, d.in_channels * taps * count * 4),
                                [&](int64_t begin, int64_t end) {
            for (int64_t item = begin; item < end; ++item) {
                const int64_t g = item / blocks, c0 = g * per_group + item % blocks * kChannelBlock;
                const int64_t c1 = c0 + kChannelBlock < (g + 1) * per_group ? c0 + kChannelBlock
                                                                            : (g + 1) * per_group;
                for (int64_t t = 0; t < taps; ++t) {
                    const Sample<T> *row = table + (g * taps + t) * count;
                    for (int64_t q0 = 0; q0 < count; q0 += kPixelBlock) {
                        const int64_t q1 = q0 + kPixelBlock < count ? q0 + kPixelBlock : count;
                        for (int64_t c = c0; c < c1; ++c) f(c, t, row, q0, q1);
                    }
                }
            }
            return (int)MMD_OK;
        });
    }

    /* columns[c * K + t][q] = mask * sample of input channel c. */
    void im2col(int64_t n, int64_t count, const Sample<T> *table, T *columns) const {
        const int64_t taps = d.taps(), plane = d.height * d.width;
        for_channels(count, table, [&](int64_t c, int64_t t, const Sample<T> *row, int64_t q0,
                                       int64_t q1) {
            const T *__restrict src = input + (n * d.in_channels + c) * plane;
            T *__restrict out = columns + (c * taps + t) * count;
            const int64_t width = d.width;
            for (int64_t q = q0; q < q1; ++q) {
                const Sample<T> &s = row[q];
                T v[4];
                if (s.full) {   /* the same sums as mmd_bilinear_value's, read from one index */
                    const T *p = src + s.index[0];
                    out[q] = s.mask * (s.weight[0] * p[0] + s.weight[1] * p[1] +
                                       s.weight[2] * p[width] + s.weight[3] * p[width + 1]);
                    continue;
                }
                mmd_bilinear_corners(s, src, v);
                out[q] = s.mask * mmd_bilinear_value(s, v);
            }
        });
    }
};

/* A chunk's columns and sample table. */
template <typename T> struct Workspace {
    int64_t bytes;
    HeapArray<T> columns;
    HeapArray<Sample<T>> table;

    Workspace(const mmd_dcn_shape &d, int64_t chunk)
        : bytes((int64_t)(sizeof(T) * d.in_channels + sizeof(Sample<T>) * d.offset_groups) *
                d.taps() * chunk),
          columns(d.in_channels * d.taps() * chunk), table(d.offset_groups * d.taps() * chunk) {}
    bool ok() const { return columns.get() != nullptr && table.get() != nullptr; }
    int no_memory() const {
        return mmd_error(MMD_ERR_MEMORY, "cannot allocate %lld bytes for deform_conv2d's columns",
                         (long long)bytes);
    }
};

template <typename T> int forward(const Call<T> &call, const T *bias, T *output) {
    const mmd_dcn_shape &d = call.d;
    const int64_t pixels = d.pixels(), chunk = call.chunk();
    if (d.batch * d.out_channels * pixels == 0) return MMD_OK;
    const int64_t rows = d.in_channels * d.taps();
    Workspace<T> work(d, chunk);
    if (!work.ok()) return work.no_memory();
    HeapArray<T> &columns = work.columns;
    HeapArray<Sample<T>> &table = work.table;
    const int64_t out_per_group = d.out_channels / d.groups, k = rows / d.groups;
    for (int64_t n = 0; n < d.batch; ++n) {
        T *out = output + n * d.out_channels * pixels;
        for (int64_t p0 = 0; p0 < pixels; p0 += chunk) {
            const int64_t count = p0 + chunk < pixels ? chunk : pixels - p0;
            call.locate(n, p0, count, table.get());
            call.im2col(n, count, table.get(), columns.get());
            for (int64_t g = 0; g < d.groups; ++g)
                mmd_gemm(0, 0, out_per_group, count, k, (T)1, call.weight + g * out_per_group * k,
                         k, columns.get() + g * k * count, count, (T)0,
                         out + g * out_per_group * pixels + p0, pixels);
        }
        if (bias != nullptr)
            for (int64_t o = 0; o < d.out_channels; ++o)
                for (int64_t p = 0; p < pixels; ++p) out[o * pixels + p] += bias[o];
    }
    return MMD_OK;
}

/* The arrays backward writes. */
template <typename T> struct Grads {
    T *input, *offset, *mask, *weight, *bias;
};

/* grad_offset and grad_mask of image n's pixels [p0, p0 + count), from the
 * columns' gradient. */
template <typename T>
int offset_and_mask_grads(const Call<T> &call, int64_t n, int64_t p0, int64_t count,
                          const Sample<T> *table, const T *grad_columns, const Grads<T> &grads) {
    const mmd_dcn_shape &d = call.d;
    const int64_t taps = d.taps(), rows = d.offset_groups * taps, pixels = d.pixels();
    const int64_t plane = d.height * d.width, per_group = d.channels_per_offset_group();
    return mmd_parallel_for(rows, 1, mmd_worth_threads(rows, rows * per_group * count * 8),
                            [&](int64_t begin, int64_t end) {
        HeapArray<T> sums(3 * count);
        if (!sums.get())
            return mmd_error(MMD_ERR_MEMORY, "cannot allocate %lld bytes for deform_conv2d's "
                             "offset gradient", (long long)(3 * count * sizeof(T)));
        T *gy = sums.get(), *gx = gy + count, *gm = gx + count;
        for (int64_t r = begin; r < end; ++r) {
            const int64_t g = r / taps, t = r % taps;
            const Sample<T> *row = table + r * count;
            memset(sums.get(), 0, sizeof(T) * 3 * count);
            for (int64_t c = g * per_group; c < (g + 1) * per_group; ++c) {
                const T *src = call.input + (n * d.in_channels + c) * plane;
                const T *gc = grad_columns + (c * taps + t) * count;
                for (int64_t q = 0; q < count; ++q) {
                    const Sample<T> &s = row[q];
                    T v[4];
                    corners_of(s, src, d.width, v);
                    gm[q] += gc[q] * mmd_bilinear_value(s, v);
                    gy[q] += gc[q] * mmd_bilinear_dvalue_dy(s, v);
                    gx[q] += gc[q] * mmd_bilinear_dvalue_dx(s, v);
                }
            }
            T *out_y = grads.offset + ((n * d.offset_groups + g) * 2 * taps + 2 * t) * pixels + p0;
            T *out_x = out_y + pixels;
            T *out_m = grads.mask + ((n * d.offset_groups + g) * taps + t) * pixels + p0;
            for (int64_t q = 0; q < count; ++q) {
                out_y[q] = row[q].mask * gy[q];
                out_x[q] = row[q].mask * gx[q];
                out_m[q] = gm[q];
            }
        }
        return (int)MMD_OK;
    });
}

/* Adds the columns' gradient of image n into grad_input: a channel's
 * samples in (tap, pixel) order, each channel on one thread. */
template <typename T>
void col2im(const Call<T> &call, int64_t n, int64_t count, const Sample<T> *table,
            const T *grad_columns, T *grad_input) {
    const mmd_dcn_shape &d = call.d;
    const int64_t taps = d.taps(), plane = d.height * d.width;
    call.for_channels(count, table, [&](int64_t c, int64_t t, const Sample<T> *row, int64_t q0,
                                        int64_t q1) {
        T *dst = grad_input + (n * d.in_channels + c) * plane;
        const T *gc = grad_columns + (c * taps + t) * count;
        for (int64_t q = q0; q < q1; ++q) {
            const Sample<T> &s = row[q];
            const T grad = gc[q] * s.mask;
            if (s.full) {
                T *p = dst + s.index[0];
                p[0] += grad * s.weight[0];
                p[1] += grad * s.weight[1];
                p[d.width] += grad * s.weight[2];
                p[d.width + 1] += grad * s.weight[3];
            } else {
                for (int k = 0; k < 4; ++k)
                    if (s.index[k] >= 0) dst[s.index[k]] += grad * s.weight[k];
            }
        }
    });
}

template <typename T> int backward(const Call<T> &call, const T *grad_output, const Grads<T> &grads) {
    const mmd_dcn_shape &d = call.d;
    const int64_t pixels = d.pixels(), rows = d.in_channels * d.taps();
    memset(grads.input, 0, sizeof(T) * d.batch * d.in_channels * d.height * d.width);
    memset(grads.weight, 0, sizeof(T) * d.out_channels * rows / d.groups);
    for (int64_t o = 0; o < d.out_channels; ++o) {
        T sum = 0;
        for (int64_t n = 0; n < d.batch; ++n)
            for (int64_t p = 0; p < pixels; ++p)
                sum += grad_output[(n * d.out_channels + o) * pixels + p];
        grads.bias[o] = sum;
    }
    if (d.batch * pixels == 0 || rows == 0) {
        memset(grads.offset, 0, sizeof(T) * d.batch * 2 * d.offset_groups * d.taps() * pixels);
        memset(grads.mask, 0, sizeof(T) * d.batch * d.offset_groups * d.taps() * pixels);
        return MMD_OK;
    }
    const int64_t chunk = call.chunk();
    Workspace<T> work(d, chunk);
    if (!work.ok()) return work.no_memory();
    HeapArray<T> &columns = work.columns;
    HeapArray<Sample<T>> &table = work.table;
    const int64_t out_per_group = d.out_channels / d.groups, k = rows / d.groups;
    for (int64_t n = 0; n < d.batch; ++n) {
        const T *grad_out = grad_output + n * d.out_channels * pixels;
        for (int64_t p0 = 0; p0 < pixels; p0 += chunk) {
            const int64_t count = p0 + chunk < pixels ? chunk : pixels - p0;
            call.locate(n, p0, count, table.get());
            call.im2col(n, count, table.get(), columns.get());
            for (int64_t g = 0; g < d.groups; ++g) {
                const T *grad_g = grad_out + g * out_per_group * pixels + p0;
                T *columns_g = columns.get() + g * k * count;
                /* grad_weight += grad_output x columns^T */
                mmd_gemm(0, 1, out_per_group, k, count, (T)1, grad_g, pixels, columns_g, count,
                         (T)1, grads.weight + g * out_per_group * k, k);
                /* the columns' gradient: weight^T x grad_output */
                mmd_gemm(1, 0, k, count, out_per_group, (T)1,
                         call.weight + g * out_per_group * k, k, grad_g, pixels, (T)0, columns_g,
                         count);
            }
            int s = offset_and_mask_grads(call, n, p0, count, table.get(), columns.get(), grads);
            if (s) return s;
            col2im(call, n, count, table.get(), columns.get(), grads.input);
        }
    }
    return MMD_OK;
}

template <typename T>
Call<T> make_call(const mmd_dcn_shape &d, const mmd_tensor *input, const mmd_tensor *offset,
                  const mmd_tensor *mask, const mmd_tensor *weight) {
    return Call<T>{d, (const T *)input->data, (const T *)offset->data,
                   mask ? (const T *)mask->data : nullptr, (const T *)weight->data};
}

int deform_conv2d_forward_cpu(const mmd_tensor *input, const mmd_tensor *offset,
                              const mmd_tensor *mask, const mmd_tensor *weight,
                              const mmd_tensor *bias, const mmd_tensor *output, int64_t stride_h,
                              int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                              int64_t dilation_w, int64_t groups, int64_t offset_groups,
                              const mmd_context *ctx) {
    (void)ctx;
    mmd_dcn_shape d;
    int s = mmd_deform_conv2d_forward_check(input, offset, mask, weight, bias, output, stride_h,
                                            stride_w, pad_h, pad_w, dilation_h, dilation_w,
                                            groups, offset_groups, MMD_FLOAT32_64, &d);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return forward(make_call<float>(d, input, offset, mask, weight),
                       bias ? (const float *)bias->data : nullptr, (float *)output->data);
    return forward(make_call<double>(d, input, offset, mask, weight),
                   bias ? (const double *)bias->data : nullptr, (double *)output->data);
}

template <typename T>
Grads<T> grads_of(const mmd_tensor *grad_input, const mmd_tensor *grad_offset,
                  const mmd_tensor *grad_mask, const mmd_tensor *grad_weight,
                  const mmd_tensor *grad_bias) {
    return Grads<T>{(T *)grad_input->data, (T *)grad_offset->data, (T *)grad_mask->data,
                    (T *)grad_weight->data, (T *)grad_bias->data};
}

int deform_conv2d_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *input,
                               const mmd_tensor *offset, const mmd_tensor *mask,
                               const mmd_tensor *weight, const mmd_tensor *grad_input,
                               const mmd_tensor *grad_offset, const mmd_tensor *grad_mask,
                               const mmd_tensor *grad_weight, const mmd_tensor *grad_bias,
                               int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                               int64_t dilation_h, int64_t dilation_w, int64_t groups,
                               int64_t offset_groups, const mmd_context *ctx) {
    (void)ctx;
    mmd_dcn_shape d;
    int s = mmd_deform_conv2d_backward_check(grad_output, input, offset, mask, weight,
                                             grad_input, grad_offset, grad_mask, grad_weight,
                                             grad_bias, stride_h, stride_w, pad_h, pad_w,
                                             dilation_h, dilation_w, groups, offset_groups,
                                             MMD_FLOAT32_64, &d);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return backward(make_call<float>(d, input, offset, mask, weight),
                        (const float *)grad_output->data,
                        grads_of<float>(grad_input, grad_offset, grad_mask, grad_weight,
                                        grad_bias));
    return backward(make_call<double>(d, input, offset, mask, weight),
                    (const double *)grad_output->data,
                    grads_of<double>(grad_input, grad_offset, grad_mask, grad_weight, grad_bias));
}

}  // namespace

MMD_REGISTRATIONS(cpu, deform_conv2d) {
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_forward_impl, CPU, DEFAULT, deform_conv2d_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_backward_impl, CPU, DEFAULT,
                             deform_conv2d_backward_cpu);
}
