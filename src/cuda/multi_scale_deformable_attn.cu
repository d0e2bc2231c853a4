/* multi_scale_deformable_attn on CUDA, the math shared with the CPU kernels
 * (mmdispatch/ops/multi_scale_deformable_attn.h); float16 and bfloat16
 * compute in float32. Launches on ctx->stream, on ctx->device_id.
 *
 * - A head's channels go in 16-byte packs (4 float, 2 double, 8 half)
 *   where they split so and the arrays are 16-byte aligned, else one by
 *   one: each thread's arithmetic for a sample (location, corners,
 *   weights) serves a pack's channels. The deterministic backward goes
 *   channel by channel always (its sums over a group's lanes would
 *   otherwise be grouped by the arrays' alignment).
 * - Forward: one thread per pack of an output item (image, query, head), so
 *   that a warp reads a cell's channels together; each sample's location is
 *   loaded while the previous sample's cells are.
 * - Backward: a group of lanes per item (one per pack, up to a warp); the
 *   sums over channels for the location and attention gradients are group
 *   reductions in a fixed order (four at once, group_sum4). grad_value is
 *   added with atomics (default backend; float packs in one float4 atomic
 *   on sm_90), or (deterministic backend) by a second kernel with one warp
 *   per (image, head, channel) plane that takes every sample 32 at a time
 *   in order, adding with warp_ordered_add: the same sums in the same order
 *   on every run.
 * - The levels (spatial_shapes, level_start_index) are on the device. By
 *   default the first thread of the op's kernel checks them and reports a
 *   fault as a deferred error, and every thread reads only a level that
 *   lies within value's keys (others give NaN); in strict mode a check
 *   kernel and one sync come first, so the call raises and writes nothing. */
#include <stdint.h>

#include <initializer_list>
#include <type_traits>
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

/* V consecutive channels of a cell, in one 16-byte load or store where
 * V = 16 / sizeof(T) (run() takes that path when the channels per head
 * are a multiple of V and the arrays are 16-byte aligned), else one
 * channel (V = 1). A thread's arithmetic for a sample (its location, the
 * four cells and their weights) then serves V channels: with Deformable
 * DETR's 32 channels per head, a float thread did that work for 1 channel
 * of 32 and now for 4. */
template <typename T, int V> struct alignas(sizeof(T) * V) Pack {
    T v[V];
};

template <typename T, int V> __device__ inline Pack<T, V> load_pack(const T *at) {
    return *reinterpret_cast<const Pack<T, V> *>(at);
}

/* The next sample's location and attention weight of item (image, query,
 * head) `item`, loaded a sample ahead: their loads overlap the previous
 * sample's cell loads, where each sample's were a chain (its location,
 * then its cells). */
template <typename T> struct SampleStream {
    typedef typename Compute<T>::type A;
    const T *locations, *weights;
    int64_t first, samples;
    A x = 0, y = 0, weight = 0;

    __device__ SampleStream(const Arrays<T> &in, int64_t item, int64_t samples)
        : locations(in.locations), weights(in.weights), first(item * samples),
          samples(samples) {
        load(0);
    }
    __device__ void load(int64_t local) {
        if (local >= samples) return;
        const int64_t j = first + local;
        x = to_compute(locations[2 * j]);
        y = to_compute(locations[2 * j + 1]);
        weight = to_compute(weights[j]);
    }
};

/* One thread per V channels of an output item (image, query, head), so
 * that a warp reads a cell's channels together. */
template <typename T, int V>
__global__ void forward_kernel(Arrays<T> in, Levels levels, mmd_msda_shape d, T *output,
                               ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t packs = d.dims / V, total = d.batch * d.queries * d.heads * packs;
    if (blockIdx.x == 0 && threadIdx.x == 0) levels.check(sink);
    MMD_GRID_STRIDE_LOOP(i, total) {
        const int64_t item = i / packs, k = i % packs * V;
        const int64_t m = item % d.heads, n = item / (d.heads * d.queries);
        const int64_t stride = d.heads * d.dims;
        SampleStream<T> next(in, item, d.levels * d.points);
        A sum[V];
#pragma unroll
        for (int c = 0; c < V; ++c) sum[c] = 0;
        for (int64_t l = 0; l < d.levels; ++l) {
            const Level level(levels, l);
            if (!level.inside) {
#pragma unroll
                for (int c = 0; c < V; ++c) sum[c] = (A)NAN;
                next.load((l + 1) * d.points);   /* the next level's first sample */
                continue;
            }
            const T *cells = in.value + ((n * d.keys + level.start) * d.heads + m) * d.dims + k;
            for (int64_t p = 0; p < d.points; ++p) {
                const A x = next.x, y = next.y, weight = next.weight;
                next.load(l * d.points + p + 1);
                mmd_bilinear_sample<A> s;
                mmd_msda_locate(x, y, level.h, level.w, &s);
                Pack<T, V> corner[4];
#pragma unroll
                for (int q = 0; q < 4; ++q)
                    if (s.index[q] >= 0) corner[q] = load_pack<T, V>(cells + s.index[q] * stride);
#pragma unroll
                for (int c = 0; c < V; ++c) {
                    A v[4];
#pragma unroll
                    for (int q = 0; q < 4; ++q)
                        v[q] = s.index[q] >= 0 ? to_compute(corner[q].v[c]) : (A)0;
                    sum[c] += weight * mmd_bilinear_value(s, v);
                }
            }
        }
        Pack<T, V> out;
#pragma unroll
        for (int c = 0; c < V; ++c) out.v[c] = from_compute<T>(sum[c]);
        *reinterpret_cast<Pack<T, V> *>(output + item * d.dims + k) = out;
    }
}

constexpr int kWarp = 32;

/* Each of v[0..3] summed over the `lanes` lanes of a group (a power of two,
 * at most a warp, groups aligned in the warp), into every lane of the
 * group, in a fixed order. From 4 lanes on, halves of the group trade the
 * values they will not keep (lanes lanes/2 apart trade two, then lanes/4
 * apart one), so that a member m sums value 2 * (m & lanes/2 ? 1 : 0) +
 * (m & lanes/4 ? 1 : 0) over the rest of the butterfly, and the four
 * totals are read back from members 0, lanes/4, lanes/2 and 3 lanes/4: a
 * warp of 32 makes 10 shuffles where four butterflies take 20. Every lane
 * of the warp calls it. */
template <typename A> __device__ inline void group_sum4(A v[4], int lanes) {
    constexpr unsigned kAll = 0xffffffffu;
    const int lane = threadIdx.x % kWarp, member = lane & (lanes - 1);
    if (lanes < 4) {
        for (int delta = lanes / 2; delta > 0; delta /= 2)
#pragma unroll
            for (int c = 0; c < 4; ++c) v[c] += __shfl_xor_sync(kAll, v[c], delta);
        return;
    }
    const int half = lanes / 2, quarter = lanes / 4;
    const bool upper = member & half, odd = member & quarter;
    A keep0 = upper ? v[2] : v[0], keep1 = upper ? v[3] : v[1];
    keep0 += __shfl_xor_sync(kAll, upper ? v[0] : v[2], half);
    keep1 += __shfl_xor_sync(kAll, upper ? v[1] : v[3], half);
    A keep = odd ? keep1 : keep0;
    keep += __shfl_xor_sync(kAll, odd ? keep0 : keep1, quarter);
    for (int delta = quarter / 2; delta > 0; delta /= 2) keep += __shfl_xor_sync(kAll, keep, delta);
#pragma unroll
    for (int c = 0; c < 4; ++c) v[c] = __shfl_sync(kAll, keep, lane - member + quarter * c);
}

/* The lanes of a backward group: the smallest power of two that gives each
 * of an item's `packs` packs of channels a lane, at most a warp. */
inline int group_lanes(int64_t packs) {
    int lanes = 1;
    while (lanes < packs && lanes < kWarp) lanes *= 2;
    return lanes;
}

template <typename T> struct Grads {
    const T *output;   /* grad_output */
    T *value, *locations, *weights;
};

/* Adds scale * g[c] into the pack of channels at `cell`: one float4
 * atomic where the device has them (float, V = 4), else V single ones. */
template <typename T, int V, typename A>
__device__ inline void add_pack(T *cell, A scale, const A g[V]) {
    constexpr bool kVector = MMD_CUDA_VECTOR_ATOMICS && std::is_same<T, float>::value && V == 4;
    if constexpr (kVector) {
        atomicAdd(reinterpret_cast<float4 *>(cell),
                  make_float4(scale * g[0], scale * g[1], scale * g[2], scale * g[3]));
    } else {
#pragma unroll
        for (int c = 0; c < V; ++c) atomicAdd(cell + c, from_compute<T>(scale * g[c]));
    }
}

/* A group of `lanes` lanes per item (image, query, head), each lane V
 * channels at a time (its first V held in registers): the location and
 * attention weight gradients, whose sums over the channels are group
 * reductions in a fixed order (group_sum4), and (`atomics`) grad_value.
 * Every lane of a warp takes part in every sample's reduction (the loops
 * are the same in every lane; a lane past the last item, or a sample off
 * the levels, adds zeros and writes nothing). */
template <typename T, int V>
__global__ void backward_kernel(Arrays<T> in, Levels levels, mmd_msda_shape d, Grads<T> g,
                                int lanes, bool atomics, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int64_t items = d.batch * d.queries * d.heads, packs = d.dims / V;
    const int per_warp = kWarp / lanes, member = (int)(threadIdx.x % kWarp) & (lanes - 1);
    const int64_t warps = (items + per_warp - 1) / per_warp;
    if (blockIdx.x == 0 && threadIdx.x == 0) levels.check(sink);
    const int64_t step = (int64_t)gridDim.x * blockDim.x / kWarp;
    for (int64_t w = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp; w < warps;
         w += step) {
        const int64_t mine = w * per_warp + (int)(threadIdx.x % kWarp) / lanes;
        const bool valid = mine < items;
        const int64_t item = valid ? mine : 0;   /* a spare lane reads item 0's, adds zeros */
        const int64_t m = item % d.heads, n = item / (d.heads * d.queries);
        const int64_t samples = d.levels * d.points, stride = d.heads * d.dims;
        const T *grad = g.output + item * d.dims;
        A held[V];   /* grad_output's channels of the lane's first pack */
        if (member < packs) {
            const Pack<T, V> first = load_pack<T, V>(grad + member * V);
#pragma unroll
            for (int c = 0; c < V; ++c) held[c] = to_compute(first.v[c]);
        }
        SampleStream<T> next(in, item, samples);
        for (int64_t l = 0; l < d.levels; ++l) {
            const Level level(levels, l);
            const int64_t offset = ((n * d.keys + (level.inside ? level.start : 0)) * d.heads + m) *
                                   d.dims;
            for (int64_t p = 0; p < d.points; ++p) {
                const int64_t j = item * samples + l * d.points + p;
                const A loc_x = next.x, loc_y = next.y, attn = next.weight;
                next.load(l * d.points + p + 1);
                mmd_bilinear_sample<A> s;
                mmd_msda_locate(loc_x, loc_y, level.h, level.w, &s);
                /* off the levels or undefined: NaN gradients, none for value */
                const bool off = !level.inside || s.undefined, skip = !valid || off;
                /* grad's dot products with the four corners, from which those
                 * with the sample and its derivatives follow (as on the CPU) */
                A dots[4] = {0, 0, 0, 0};
                for (int64_t pack = member; !skip && pack < packs; pack += lanes) {
                    A gk[V];
                    if (pack == member) {
#pragma unroll
                        for (int c = 0; c < V; ++c) gk[c] = held[c];
                    } else {
                        const Pack<T, V> read = load_pack<T, V>(grad + pack * V);
#pragma unroll
                        for (int c = 0; c < V; ++c) gk[c] = to_compute(read.v[c]);
                    }
                    const int64_t k = pack * V;
#pragma unroll
                    for (int q = 0; q < 4; ++q) {
                        if (s.index[q] < 0) continue;
                        const int64_t at = offset + s.index[q] * stride + k;
                        const Pack<T, V> cell = load_pack<T, V>(in.value + at);
#pragma unroll
                        for (int c = 0; c < V; ++c) dots[q] += gk[c] * to_compute(cell.v[c]);
                        if (atomics) add_pack<T, V, A>(g.value + at, attn * s.weight[q], gk);
                    }
                }
                group_sum4(dots, lanes);
                if (member != 0 || !valid) continue;
                if (off) {
                    const T nan = from_compute<T>((A)NAN);
                    g.locations[2 * j] = g.locations[2 * j + 1] = g.weights[j] = nan;
                    continue;
                }
                g.weights[j] = from_compute<T>(mmd_bilinear_value(s, dots));
                g.locations[2 * j] =
                    from_compute<T>(attn * mmd_bilinear_dvalue_dx(s, dots) * (A)level.w);
                g.locations[2 * j + 1] =
                    from_compute<T>(attn * mmd_bilinear_dvalue_dy(s, dots) * (A)level.h);
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

/* Blocks for `items` items of `lanes` lanes each (whole warps). */
unsigned warp_blocks(int64_t items, int lanes = kWarp) {
    const int per_warp = kWarp / lanes;
    return blocks_for((items + per_warp - 1) / per_warp * kWarp);
}

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
            constexpr int kPack = 16 / sizeof(T);
            /* a head's channels in 16-byte packs where they split so and
             * every array they are read from or written to is aligned */
            const auto packed = [&](std::initializer_list<const mmd_tensor *> arrays) {
                if (d.dims % kPack != 0) return false;
                for (const mmd_tensor *a : arrays)
                    if ((uintptr_t)a->data % 16 != 0) return false;
                return true;
            };
            const int64_t items = d.batch * d.queries * d.heads;
            if (output) {
                if (packed({value, output}))
                    forward_kernel<T, kPack><<<blocks_for(items * (d.dims / kPack)), kThreads, 0,
                                               stream>>>(in, levels, d, (T *)output->data, sink);
                else
                    forward_kernel<T, 1><<<blocks_for(items * d.dims), kThreads, 0, stream>>>(
                        in, levels, d, (T *)output->data, sink);
                return launch_status("multi_scale_deformable_attn launch");
            }
            const Grads<T> g{(const T *)grads[0]->data, (T *)grads[1]->data,
                             (T *)grads[2]->data, (T *)grads[3]->data};
            /* the deterministic backend's bits must not depend on where the
             * arrays lie: per channel there, whatever the alignment */
            if (!deterministic && packed({value, grads[0], grads[1]})) {
                const int lanes = group_lanes(d.dims / kPack);
                backward_kernel<T, kPack><<<warp_blocks(items, lanes), kThreads, 0, stream>>>(
                    in, levels, d, g, lanes, !deterministic, sink);
            } else {
                const int lanes = group_lanes(d.dims);
                backward_kernel<T, 1><<<warp_blocks(items, lanes), kThreads, 0, stream>>>(
                    in, levels, d, g, lanes, !deterministic, sink);
            }
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
