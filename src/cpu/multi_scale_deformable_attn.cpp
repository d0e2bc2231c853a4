/* multi_scale_deformable_attn on CPU.
 *
 * Forward shares out the (image, query) pairs; for each head, a sample's
 * four cells are D contiguous values each, added into the head's D outputs.
 * Backward shares out the (image, head) pairs: all of a pair's samples
 * read and write only that image and head's part of value and grad_value,
 * so the scattered sums into grad_value are race-free, and deterministic
 * (queries, levels and points in order). The levels are checked before
 * anything is written. */
#include "mmdispatch/ops/multi_scale_deformable_attn.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "heap_array.h"
#include "vec16.h"

namespace {

template <typename T> struct Call {
    mmd_msda_shape d;
    const T *value, *locations, *weights;
    const int64_t *shapes, *starts;

    /* value[n, starts[l] + key, m, :] is level(n, l, m)[key * key_stride()] */
    const T *level(int64_t n, int64_t l, int64_t m) const {
        return value + ((n * d.keys + starts[l]) * d.heads + m) * d.dims;
    }
    int64_t key_stride() const { return d.heads * d.dims; }
    /* the offset of (n, q, m)'s first level and point */
    int64_t samples_of(int64_t n, int64_t q, int64_t m) const {
        return ((n * d.queries + q) * d.heads + m) * d.levels * d.points;
    }
};

/* A corner's D values: the cell's, or `zeros` for a corner off the level. */
template <typename T>
inline const T *cell_of(const mmd_bilinear_sample<T> &s, int corner, const T *level,
                        int64_t stride, const T *zeros) {
    return s.index[corner] >= 0 ? level + s.index[corner] * stride : zeros;
}

template <typename T> int forward(const Call<T> &c, T *output) {
    const mmd_msda_shape &d = c.d;
    const HeapArray<T> zero_row(d.dims, true);   /* what a corner off the level reads */
    if (!zero_row)
        return mmd_error(MMD_ERR_MEMORY, "cannot allocate %lld bytes",
                         (long long)(d.dims * sizeof(T)));
    const T *zeros = zero_row.get();
    const int64_t items = d.batch * d.queries, stride = c.key_stride();
    const int64_t work = items * d.heads * d.levels * d.points * (d.dims + 8);
    mmd_parallel_for(items, mmd_even_chunk(items), mmd_worth_threads(items, work),
                     [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t n = item / d.queries, q = item % d.queries;
            for (int64_t m = 0; m < d.heads; ++m) {
                T *__restrict out = output + (item * d.heads + m) * d.dims;
                for (int64_t k = 0; k < d.dims; ++k) out[k] = 0;
                const int64_t first = c.samples_of(n, q, m);
                const T *loc = c.locations + 2 * first, *attn = c.weights + first;
                for (int64_t l = 0; l < d.levels; ++l) {
                    const int64_t h = c.shapes[2 * l], w = c.shapes[2 * l + 1];
                    const T *level = c.level(n, l, m);
                    for (int64_t p = 0; p < d.points; ++p, loc += 2, ++attn) {
                        mmd_bilinear_sample<T> s;
                        mmd_msda_locate(loc[0], loc[1], h, w, &s);
                        if (s.undefined) {
                            for (int64_t k = 0; k < d.dims; ++k) out[k] = (T)NAN;
                            continue;
                        }
                        /* attention weight x the sample (a corner off the level reads
                         * zeros), as the definition has it: a non-finite weight of a
                         * sample that reads nothing still makes the output NaN */
                        const T *__restrict c0 = cell_of(s, 0, level, stride, zeros);
                        const T *__restrict c1 = cell_of(s, 1, level, stride, zeros);
                        const T *__restrict c2 = cell_of(s, 2, level, stride, zeros);
                        const T *__restrict c3 = cell_of(s, 3, level, stride, zeros);
                        const T a = *attn, w0 = s.weight[0], w1 = s.weight[1],
                                w2 = s.weight[2], w3 = s.weight[3];
                        for (int64_t k = 0; k < d.dims; ++k)
                            out[k] += a * (w0 * c0[k] + w1 * c1[k] + w2 * c2[k] + w3 * c3[k]);
                    }
                }
            }
        }
        return (int)MMD_OK;
    });
    return MMD_OK;
}

template <typename T> struct Grads {
    const T *output;   /* grad_output */
    T *value, *locations, *weights;
};

/* grad's dot products with the four corners' D values. Per corner, two
 * vectors of partial sums over the first D rounded down to 2 * lanes: lane
 * j of the first takes every k with k mod 2 * lanes = j, lane j of the
 * second every k with k mod 2 * lanes = lanes + j. The two are added, and
 * the dot product is the rest of D (in order) plus the lanes in order: a
 * fixed order, so the sums are deterministic. */
template <typename T>
inline void corner_dots(const T *grad, const T *const cells[4], int64_t dims, T dots[4]) {
    typedef typename Vec<T>::type V;
    constexpr int W = Vec<T>::lanes;
    const T *c0 = cells[0], *c1 = cells[1], *c2 = cells[2], *c3 = cells[3];
    V a0 = {}, a1 = {}, a2 = {}, a3 = {}, b0 = {}, b1 = {}, b2 = {}, b3 = {};
    int64_t k = 0;
    for (; k + 2 * W <= dims; k += 2 * W) {
        const V g = Vec<T>::load(grad + k), h = Vec<T>::load(grad + k + W);
        a0 += g * Vec<T>::load(c0 + k), b0 += h * Vec<T>::load(c0 + k + W);
        a1 += g * Vec<T>::load(c1 + k), b1 += h * Vec<T>::load(c1 + k + W);
        a2 += g * Vec<T>::load(c2 + k), b2 += h * Vec<T>::load(c2 + k + W);
        a3 += g * Vec<T>::load(c3 + k), b3 += h * Vec<T>::load(c3 + k + W);
    }
    a0 += b0, a1 += b1, a2 += b2, a3 += b3;
    T rest[4] = {0, 0, 0, 0};
    for (; k < dims; ++k) {
        rest[0] += grad[k] * c0[k];
        rest[1] += grad[k] * c1[k];
        rest[2] += grad[k] * c2[k];
        rest[3] += grad[k] * c3[k];
    }
    const V *lanes[4] = {&a0, &a1, &a2, &a3};
    for (int corner = 0; corner < 4; ++corner) {
        T sum = rest[corner];
        for (int j = 0; j < W; ++j) sum += (*lanes[corner])[j];
        dots[corner] = sum;
    }
}

/* Backward reads an (image, head)'s samples query by query, at scattered
 * cells of value and grad_value and in rows of the other arrays that are
 * heads * D apart, none of which the hardware prefetches well. So each
 * query prefetches the cells of the query kAhead after it, and the rows of
 * the query 2 * kAhead after it (the locations the cells' prefetch reads).
 * Single thread, standard workload: 800 -> 630 ms. */
constexpr int64_t kAhead = 2;

template <typename T> int backward(const Call<T> &c, const Grads<T> &g) {
    const mmd_msda_shape &d = c.d;
    const HeapArray<T> zero_row(d.dims, true);   /* what a corner off the level reads */
    if (!zero_row)
        return mmd_error(MMD_ERR_MEMORY, "cannot allocate %lld bytes",
                         (long long)(d.dims * sizeof(T)));
    const T *zeros = zero_row.get();
    const int64_t items = d.batch * d.heads, stride = c.key_stride();
    const int64_t samples = d.levels * d.points;
    const int64_t work = items * d.queries * samples * (4 * d.dims + 8);
    mmd_parallel_for(items, 1, mmd_worth_threads(items, work), [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            const int64_t n = item / d.heads, m = item % d.heads;
            for (int64_t q = 0; q < d.queries; ++q) {
                if (q + 2 * kAhead < d.queries) {
                    const int64_t ahead = c.samples_of(n, q + 2 * kAhead, m);
                    mmd_prefetch_bytes(c.locations + 2 * ahead, 2 * samples * sizeof(T));
                    mmd_prefetch_bytes(c.weights + ahead, samples * sizeof(T));
                    mmd_prefetch_bytes(g.output + ((n * d.queries + q + 2 * kAhead) * d.heads + m)
                                       * d.dims, d.dims * sizeof(T));
                }
                if (q + kAhead < d.queries) {
                    const T *ahead = c.locations + 2 * c.samples_of(n, q + kAhead, m);
                    const int64_t bytes = d.dims * (int64_t)sizeof(T);
                    for (int64_t l = 0; l < d.levels; ++l) {
                        const T *level = c.level(n, l, m);
                        const T *grad_level = g.value + (level - c.value);
                        for (int64_t p = 0; p < d.points; ++p, ahead += 2) {
                            mmd_bilinear_sample<T> s;
                            mmd_msda_locate(ahead[0], ahead[1], c.shapes[2 * l],
                                            c.shapes[2 * l + 1], &s);
                            for (int corner = 0; corner < 4; ++corner) {
                                if (s.index[corner] < 0) continue;
                                mmd_prefetch_bytes(level + s.index[corner] * stride, bytes);
                                mmd_prefetch_bytes(grad_level + s.index[corner] * stride, bytes);
                            }
                        }
                    }
                }
                const T *__restrict grad = g.output + ((n * d.queries + q) * d.heads + m) * d.dims;
                const int64_t first = c.samples_of(n, q, m);
                const T *loc = c.locations + 2 * first, *attn = c.weights + first;
                T *grad_loc = g.locations + 2 * first, *grad_attn = g.weights + first;
                for (int64_t l = 0; l < d.levels; ++l) {
                    const int64_t h = c.shapes[2 * l], w = c.shapes[2 * l + 1];
                    const T *level = c.level(n, l, m);
                    T *grad_level = g.value + (level - c.value);
                    for (int64_t p = 0; p < d.points;
                         ++p, loc += 2, ++attn, grad_loc += 2, ++grad_attn) {
                        mmd_bilinear_sample<T> s;
                        mmd_msda_locate(loc[0], loc[1], h, w, &s);
                        if (s.undefined) {   /* no cell: NaN gradients, none for value */
                            grad_loc[0] = grad_loc[1] = *grad_attn = (T)NAN;
                            continue;
                        }
                        /* the sample and its derivatives are sums of the corners with
                         * weights, so grad's dot products with all three follow from
                         * its dot products with the corners; a corner off the level
                         * reads no value (0, not grad x 0, which may be NaN) */
                        const T *cells[4];
                        for (int corner = 0; corner < 4; ++corner)
                            cells[corner] = cell_of(s, corner, level, stride, zeros);
                        T dots[4];
                        corner_dots(grad, cells, d.dims, dots);
                        for (int corner = 0; corner < 4; ++corner)
                            if (s.index[corner] < 0) dots[corner] = 0;
                        *grad_attn = mmd_bilinear_value(s, dots);
                        grad_loc[0] = *attn * mmd_bilinear_dvalue_dx(s, dots) * (T)w;
                        grad_loc[1] = *attn * mmd_bilinear_dvalue_dy(s, dots) * (T)h;
                        for (int corner = 0; corner < 4; ++corner) {
                            if (s.index[corner] < 0) continue;
                            const T scale = *attn * s.weight[corner];
                            T *__restrict into = grad_level + s.index[corner] * stride;
                            for (int64_t k = 0; k < d.dims; ++k) into[k] += scale * grad[k];
                        }
                    }
                }
            }
        }
        return (int)MMD_OK;
    });
    return MMD_OK;
}

/* Checks the arguments and the levels; fills the call. */
template <typename T>
Call<T> make_call(const mmd_msda_shape &d, const mmd_tensor *value, const mmd_tensor *shapes,
                  const mmd_tensor *starts, const mmd_tensor *locations,
                  const mmd_tensor *weights) {
    return Call<T>{d, (const T *)value->data, (const T *)locations->data,
                   (const T *)weights->data, (const int64_t *)shapes->data,
                   (const int64_t *)starts->data};
}

int check(const mmd_tensor *value, const mmd_tensor *shapes, const mmd_tensor *starts,
          const mmd_tensor *locations, const mmd_tensor *weights, const mmd_tensor *output,
          const mmd_tensor *const *grads, mmd_msda_shape *d) {
    int s = mmd_msda_check(value, shapes, starts, locations, weights, output, grads,
                           MMD_FLOAT32_64, d);
    if (!s) s = mmd_msda_check_levels((const int64_t *)shapes->data,
                                      (const int64_t *)starts->data, d->levels, d->keys);
    return s;
}

int multi_scale_deformable_attn_forward_cpu(const mmd_tensor *value,
                                            const mmd_tensor *spatial_shapes,
                                            const mmd_tensor *level_start_index,
                                            const mmd_tensor *sampling_locations,
                                            const mmd_tensor *attention_weights,
                                            const mmd_tensor *output, const mmd_context *ctx) {
    (void)ctx;
    mmd_msda_shape d;
    int s = check(value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights, output, nullptr, &d);
    if (s) return s;
    if (value->dtype == MMD_FLOAT32)
        return forward(make_call<float>(d, value, spatial_shapes, level_start_index,
                                        sampling_locations, attention_weights),
                       (float *)output->data);
    return forward(make_call<double>(d, value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights),
                   (double *)output->data);
}

int multi_scale_deformable_attn_backward_cpu(
    const mmd_tensor *value, const mmd_tensor *spatial_shapes,
    const mmd_tensor *level_start_index, const mmd_tensor *sampling_locations,
    const mmd_tensor *attention_weights, const mmd_tensor *grad_output,
    const mmd_tensor *grad_value, const mmd_tensor *grad_sampling_locations,
    const mmd_tensor *grad_attention_weights, const mmd_context *ctx) {
    (void)ctx;
    const mmd_tensor *grads[4] = {grad_output, grad_value, grad_sampling_locations,
                                  grad_attention_weights};
    mmd_msda_shape d;
    int s = check(value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights, nullptr, grads, &d);
    if (s) return s;
    if (value->dtype == MMD_FLOAT32)
        return backward(make_call<float>(d, value, spatial_shapes, level_start_index,
                                         sampling_locations, attention_weights),
                        Grads<float>{(const float *)grad_output->data,
                                     (float *)grad_value->data,
                                     (float *)grad_sampling_locations->data,
                                     (float *)grad_attention_weights->data});
    return backward(make_call<double>(d, value, spatial_shapes, level_start_index,
                                      sampling_locations, attention_weights),
                    Grads<double>{(const double *)grad_output->data, (double *)grad_value->data,
                                  (double *)grad_sampling_locations->data,
                                  (double *)grad_attention_weights->data});
}

}  // namespace

MMD_REGISTRATIONS(cpu, multi_scale_deformable_attn) {
    MMD_REGISTER_DEVICE_IMPL(multi_scale_deformable_attn_forward_impl, CPU, DEFAULT,
                             multi_scale_deformable_attn_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(multi_scale_deformable_attn_backward_impl, CPU, DEFAULT,
                             multi_scale_deformable_attn_backward_cpu);
}
