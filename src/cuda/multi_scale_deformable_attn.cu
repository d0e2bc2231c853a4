/* multi_scale_deformable_attn on CUDA, the math shared with the CPU kernels
 * (mmdispatch/ops/multi_scale_deformable_attn.h); float16 and bfloat16
 * compute in float32. Launches on ctx->stream, on ctx->device_id.
 *
 * - Forward: one thread per output element (image, query, head, channel),
 *   so a warp reads a cell's channels together; each sample's location is
 *   loaded while the previous sample's cells are.
 * - Backward: one warp per (image, query, head); its lanes share the
 *   channels, and the sums over channels for the location and attention
 *   gradients are warp reductions in a fixed order (four at once,
 *   warp_sum4). grad_value is added with atomics (default backend), or
 *   (deterministic backend) by a second kernel with one warp per (image,
 *   head, channel) plane that takes every sample 32 at a time in order,
 *   adding with warp_ordered_add: the same sums in the same order on every
 *   run.
 * - The levels (spatial_shapes, level_start_index) are on the device. By
 *   default the first thread of the op's kernel checks them and reports a
 *   fault as a deferred error, and every thread reads only a level that
 *   lies within value's keys (others give NaN); in strict mode a check
 *   kernel and one sync come first, so the call raises and writes nothing. */
#include <vector>

#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/ops/multi_scale_deformable_attn.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

struct Levels {
    const int64_t *shapes, *starts;
    int64_t count, keys;

    /* the first thread of a kernel checks them all */
    __device__ void check(ErrorSink sink) const {
        int64_t level;
        const int fault = mmd_msda_levels_fault(shapes, starts, count, keys, &level);
        if (fault) sink.report(level, fault);
    }
};

__global__ void check_levels_kernel(Levels levels, ErrorSink sink) {
    if (blockIdx.x == 0 && threadIdx.x == 0) levels.check(sink);
}

/* Deferred messages; args[0] is value's number of keys. */
int format_error(const mmd_deferred_call *call, int64_t level, int code) {
    return mmd_msda_level_error(code, level, nullptr, nullptr, call->args[0]);
}

/* Level l's size and start, and whether it lies within the keys. */
struct Level {
    int64_t h, w, start;
    bool inside;

    __device__ Level(const Levels &levels, int64_t l)
        : h(levels.shapes[2 * l]), w(levels.shapes[2 * l + 1]), start(levels.starts[l]),
          inside(mmd_msda_level_inside(h, w, start, levels.keys)) {}
};

template <typename T> struct Arrays {
    const T *value, *locations, *weights;
};

template <typename T>
__global__ void forward_kernel(Arrays<T> in, Levels levels, mmd_msda_shape d, T *output,
                               ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t total = d.batch * d.queries * d.heads * d.dims;
    if (blockIdx.x == 0 && threadIdx.x == 0) levels.check(sink);
    MMD_GRID_STRIDE_LOOP(i, total) {
        const int64_t k = i % d.dims, m = i / d.dims % d.heads;
        const int64_t q = i / (d.dims * d.heads) % d.queries;
        const int64_t n = i / (d.dims * d.heads * d.queries);
        const int64_t samples = d.levels * d.points;
        const int64_t first = ((n * d.queries + q) * d.heads + m) * samples;
        const int64_t stride = d.heads * d.dims;
        /* sample `local`'s location and weight, loaded a sample ahead: their
         * loads overlap the previous sample's cell loads, where each
         * sample's were a chain (its location, then its cells) */
        A next_x = 0, next_y = 0, next_weight = 0;
        const auto prefetch = [&](int64_t local) {
            if (local >= samples) return;
            const int64_t j = first + local;
            next_x = to_compute(in.locations[2 * j]);
            next_y = to_compute(in.locations[2 * j + 1]);
            next_weight = to_compute(in.weights[j]);
        };
        prefetch(0);
        A sum = 0;
        for (int64_t l = 0; l < d.levels; ++l) {
            const Level level(levels, l);
            if (!level.inside) {
                sum = (A)NAN;
                prefetch((l + 1) * d.points);   /* the next level's first sample */
                continue;
            }
            const T *cells = in.value + ((n * d.keys + level.start) * d.heads + m) * d.dims + k;
            for (int64_t p = 0; p < d.points; ++p) {
                const A x = next_x, y = next_y, weight = next_weight;
                prefetch(l * d.points + p + 1);
                mmd_bilinear_sample<A> s;
                mmd_msda_locate(x, y, level.h, level.w, &s);
                A v[4];
                for (int c = 0; c < 4; ++c)
                    v[c] = s.index[c] >= 0 ? to_compute(cells[s.index[c] * stride]) : (A)0;
                sum += weight * mmd_bilinear_value(s, v);
            }
        }
        output[i] = from_compute<T>(sum);
    }
}

constexpr int kWarp = 32;

/* Each of v[0..3] summed over the warp, into every lane, in a fixed order:
 * halves of the lanes trade the values they will not keep (lanes 16 apart
 * trade two, then lanes 8 apart one), so that lane L sums value
 * 2 * (L & 16 ? 1 : 0) + (L & 8 ? 1 : 0) over the rest of the butterfly, and
 * the four totals are read back from lanes 0, 8, 16 and 24: 10 shuffles
 * where four warp-wide sums take 20. */
template <typename A> __device__ inline void warp_sum4(A v[4]) {
    constexpr unsigned kAll = 0xffffffffu;
    const int lane = threadIdx.x % kWarp;
    const bool upper = lane & 16, odd = lane & 8;
    A keep0 = upper ? v[2] : v[0], keep1 = upper ? v[3] : v[1];
    keep0 += __shfl_xor_sync(kAll, upper ? v[0] : v[2], 16);
    keep1 += __shfl_xor_sync(kAll, upper ? v[1] : v[3], 16);
    A keep = odd ? keep1 : keep0;
    keep += __shfl_xor_sync(kAll, odd ? keep0 : keep1, 8);
    for (int delta = 4; delta > 0; delta /= 2) keep += __shfl_xor_sync(kAll, keep, delta);
    for (int c = 0; c < 4; ++c) v[c] = __shfl_sync(kAll, keep, 8 * c);
}

/* Lanes keep grad_output's channels lane, lane + 32, ... in registers for
 * up to kHeld of them (Deformable DETR's 32 dims per head take one), not
 * read again for every sample. More would cost registers: 4 took the
 * double kernel from 118 to 144 (half the warps per SM); 1 keeps every
 * variant's occupancy. */
constexpr int kHeld = 1;

template <typename T> struct Grads {
    const T *output;   /* grad_output */
    T *value, *locations, *weights;
};

/* One warp per (image, query, head): the location and attention weight
 * gradients, and (`atomics`) grad_value. The warp's samples' locations and
 * attention weights are loaded 32 at a time, one sample per lane, and
 * handed to every lane by shuffles as the samples come: each sample's
 * value loads then wait for no load of its own location (the samples'
 * loads were a chain, one location's latency then its cells', per sample). */
template <typename T>
__global__ void backward_kernel(Arrays<T> in, Levels levels, mmd_msda_shape d, Grads<T> g,
                                bool atomics, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t warps = d.batch * d.queries * d.heads;
    const int lane = threadIdx.x % kWarp;
    if (blockIdx.x == 0 && threadIdx.x == 0) levels.check(sink);
    const int64_t step = (int64_t)gridDim.x * blockDim.x / kWarp;
    for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp; w < warps;
         w += step) {
        const int64_t m = w % d.heads, n = w / (d.heads * d.queries);
        const int64_t samples = d.levels * d.points, stride = d.heads * d.dims;
        const int64_t first = w * samples;
        A lane_x = 0, lane_y = 0, lane_attn = 0;   /* sample (chunk + lane)'s */
        const T *grad = g.output + w * d.dims;
        A held[kHeld];
#pragma unroll
        for (int r = 0; r < kHeld; ++r) {
            const int64_t k = lane + r * kWarp;
            held[r] = k < d.dims ? to_compute(grad[k]) : (A)0;
        }
        for (int64_t l = 0; l < d.levels; ++l) {
            const Level level(levels, l);
            const int64_t offset = ((n * d.keys + (level.inside ? level.start : 0)) * d.heads + m) *
                                   d.dims;
            for (int64_t p = 0; p < d.points; ++p) {
                const int64_t local = l * d.points + p, j = first + local;
                const int src = (int)(local % kWarp);   /* the same in every lane */
                if (src == 0 && local + lane < samples) {   /* the next 32 samples */
                    const int64_t mine = j + lane;
                    lane_x = to_compute(in.locations[2 * mine]);
                    lane_y = to_compute(in.locations[2 * mine + 1]);
                    lane_attn = to_compute(in.weights[mine]);
                }
                constexpr unsigned kAll = 0xffffffffu;
                const A loc_x = __shfl_sync(kAll, lane_x, src);
                const A loc_y = __shfl_sync(kAll, lane_y, src);
                const A attn = __shfl_sync(kAll, lane_attn, src);
                mmd_bilinear_sample<A> s;
                mmd_msda_locate(loc_x, loc_y, level.h, level.w, &s);
                if (!level.inside || s.undefined) {   /* NaN gradients, none for value */
                    if (lane == 0) {
                        const T nan = from_compute<T>((A)NAN);
                        g.locations[2 * j] = g.locations[2 * j + 1] = g.weights[j] = nan;
                    }
                    continue;
                }
                /* grad's dot products with the four corners, from which those with
                 * the sample and its derivatives follow (as on the CPU) */
                A dots[4] = {0, 0, 0, 0};
                auto channel = [&](int64_t k, A gk) {
                    for (int c = 0; c < 4; ++c) {
                        if (s.index[c] < 0) continue;
                        T *cell = g.value + offset + s.index[c] * stride + k;
                        dots[c] += gk * to_compute(in.value[offset + s.index[c] * stride + k]);
                        if (atomics) atomicAdd(cell, from_compute<T>(attn * s.weight[c] * gk));
                    }
                };
#pragma unroll
                for (int r = 0; r < kHeld; ++r)
                    if (lane + r * kWarp < d.dims) channel(lane + r * kWarp, held[r]);
                for (int64_t k = lane + kHeld * kWarp; k < d.dims; k += kWarp)
                    channel(k, to_compute(grad[k]));
                warp_sum4(dots);
                const A sum_value = mmd_bilinear_value(s, dots);
                const A sum_dy = mmd_bilinear_dvalue_dy(s, dots);
                const A sum_dx = mmd_bilinear_dvalue_dx(s, dots);
                if (lane == 0) {
                    g.weights[j] = from_compute<T>(sum_value);
                    g.locations[2 * j] = from_compute<T>(attn * sum_dx * (A)level.w);
                    g.locations[2 * j + 1] = from_compute<T>(attn * sum_dy * (A)level.h);
                }
            }
        }
    }
}

/* The deterministic backend's grad_value: one warp per (image, head,
 * channel) plane, which alone writes it; its lanes take the samples
 * (query, level, point) 32 at a time, in order. */
template <typename T>
__global__ void value_grad_kernel(Arrays<T> in, Levels levels, mmd_msda_shape d, Grads<T> g) {
    typedef typename Compute<T>::type A;
    const int64_t planes = d.batch * d.heads * d.dims, samples = d.queries * d.levels * d.points;
    const int lane = threadIdx.x % kWarp;
    const int64_t step = (int64_t)gridDim.x * blockDim.x / kWarp;
    for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp; w < planes;
         w += step) {
        const int64_t k = w % d.dims, m = w / d.dims % d.heads, n = w / (d.dims * d.heads);
        const int64_t stride = d.heads * d.dims;
        T *plane = g.value + (n * d.keys * d.heads + m) * d.dims + k;
        for (int64_t j0 = 0; j0 < samples; j0 += kWarp) {
            const int64_t j = j0 + lane;
            mmd_bilinear_sample<A> s;
            s.undefined = true;
            int64_t start = 0;
            A scale = 0;
            if (j < samples) {
                const int64_t q = j / (d.levels * d.points), l = j / d.points % d.levels;
                const Level level(levels, l);
                const int64_t at = ((n * d.queries + q) * d.heads + m) * d.levels * d.points +
                                   j % (d.levels * d.points);
                if (level.inside) {
                    mmd_msda_locate(to_compute(in.locations[2 * at]),
                                    to_compute(in.locations[2 * at + 1]), level.h, level.w, &s);
                    start = level.start;
                    scale = to_compute(in.weights[at]) *
                            to_compute(g.output[((n * d.queries + q) * d.heads + m) * d.dims + k]);
                }
            }
            for (int c = 0; c < 4; ++c) {
                const bool cell = !s.undefined && s.index[c] >= 0;
                warp_ordered_add(plane, cell ? (start + s.index[c]) * stride : (int64_t)-1,
                                 cell ? scale * s.weight[c] : (A)0);
            }
        }
    }
}

unsigned warp_blocks(int64_t warps) { return blocks_for(warps * kWarp); }

int run(const mmd_tensor *value, const mmd_tensor *spatial_shapes,
        const mmd_tensor *level_start_index, const mmd_tensor *sampling_locations,
        const mmd_tensor *attention_weights, const mmd_tensor *output,
        const mmd_tensor *const *grads, bool deterministic, const mmd_context *ctx) {
    mmd_msda_shape d;
    int s = mmd_msda_check(value, spatial_shapes, level_start_index, sampling_locations,
                           attention_weights, output, grads, MMD_FLOAT16_BF16_32_64, &d);
    if (s) return s;
    const Levels levels{(const int64_t *)spatial_shapes->data,
                        (const int64_t *)level_start_index->data, d.levels, d.keys};
    const bool work = d.batch * d.queries * d.heads * (output ? d.dims : 1) > 0;
    return on_device(ctx, [&](cudaStream_t stream) -> int {
        const char *what = "multi_scale_deformable_attn level check";
        auto launch_check = [&](ErrorSink sink) {
            check_levels_kernel<<<1, 1, 0, stream>>>(levels, sink);
        };
        int s = MMD_OK;
        if (strict(ctx))
            s = check_on_device(stream, what, launch_check, [&](int64_t level, int code) {
                std::vector<int64_t> shapes(2 * d.levels), starts(d.levels);
                cudaError_t err = cudaMemcpy(shapes.data(), levels.shapes,
                                             sizeof(int64_t) * shapes.size(),
                                             cudaMemcpyDeviceToHost);
                if (err == cudaSuccess)
                    err = cudaMemcpy(starts.data(), levels.starts, sizeof(int64_t) * starts.size(),
                                     cudaMemcpyDeviceToHost);
                if (err != cudaSuccess) return cuda_error(err, what);
                return mmd_msda_level_error(code, level, shapes.data(), starts.data(), d.keys);
            });
        ErrorSink sink;
        if (!s) s = begin_deferred(ctx, format_error, d.keys, 0, 0, &sink);
        if (s) return s;
        if (!work) {   /* the levels are checked whatever the size, as on the CPU */
            if (strict(ctx)) return MMD_OK;
            launch_check(sink);
            return launch_status(what);
        }
        return by_dtype(value->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            const Arrays<T> in{(const T *)value->data, (const T *)sampling_locations->data,
                               (const T *)attention_weights->data};
            if (output) {
                forward_kernel<T><<<blocks_for(mmd_numel(output)), kThreads, 0, stream>>>(
                    in, levels, d, (T *)output->data, sink);
                return launch_status("multi_scale_deformable_attn launch");
            }
            const Grads<T> g{(const T *)grads[0]->data, (T *)grads[1]->data,
                             (T *)grads[2]->data, (T *)grads[3]->data};
            const int64_t warps = d.batch * d.queries * d.heads;
            backward_kernel<T><<<warp_blocks(warps), kThreads, 0, stream>>>(
                in, levels, d, g, !deterministic, sink);
            int s = launch_status("multi_scale_deformable_attn backward launch");
            if (s || !deterministic || d.dims == 0) return s;
            value_grad_kernel<T><<<warp_blocks(d.batch * d.heads * d.dims), kThreads, 0,
                                   stream>>>(in, levels, d, g);
            return launch_status("multi_scale_deformable_attn value gradient launch");
        });
    });
}

int multi_scale_deformable_attn_forward_cuda(const mmd_tensor *value,
                                             const mmd_tensor *spatial_shapes,
                                             const mmd_tensor *level_start_index,
                                             const mmd_tensor *sampling_locations,
                                             const mmd_tensor *attention_weights,
                                             const mmd_tensor *output, const mmd_context *ctx) {
    return run(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
               output, nullptr, false, ctx);
}

template <bool Deterministic>
int multi_scale_deformable_attn_backward_cuda(
    const mmd_tensor *value, const mmd_tensor *spatial_shapes,
    const mmd_tensor *level_start_index, const mmd_tensor *sampling_locations,
    const mmd_tensor *attention_weights, const mmd_tensor *grad_output,
    const mmd_tensor *grad_value, const mmd_tensor *grad_sampling_locations,
    const mmd_tensor *grad_attention_weights, const mmd_context *ctx) {
    const mmd_tensor *grads[4] = {grad_output, grad_value, grad_sampling_locations,
                                  grad_attention_weights};
    return run(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
               nullptr, grads, Deterministic, ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, multi_scale_deformable_attn) {
    MMD_REGISTER_DEVICE_IMPL(multi_scale_deformable_attn_forward_impl, CUDA, DEFAULT,
                             multi_scale_deformable_attn_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(multi_scale_deformable_attn_backward_impl, CUDA, DEFAULT,
                             multi_scale_deformable_attn_backward_cuda<false>);
    /* forward: one thread per output element, no atomics */
    MMD_REGISTER_DEVICE_IMPL(multi_scale_deformable_attn_forward_impl, CUDA, DETERMINISTIC,
                             multi_scale_deformable_attn_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(multi_scale_deformable_attn_backward_impl, CUDA, DETERMINISTIC,
                             multi_scale_deformable_attn_backward_cuda<true>);
}
