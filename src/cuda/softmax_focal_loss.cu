/* softmax_focal_loss on CUDA: a group of a warp's lanes per row (its
 * softmax, then its loss or gradient), the math shared with the CPU kernels
 * (mmdispatch/ops/softmax_focal_loss.h); float16 and bfloat16 compute in
 * float32. Launches on ctx->stream, on ctx->device_id. A target >= C is
 * never used to index: by default its row is NaN and the first such row is
 * reported as a deferred error; in strict mode targets are checked before
 * anything is written and the call raises. */
#include "mmdispatch/cuda/targets.cuh"
#include "mmdispatch/ops/softmax_focal_loss.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

using namespace mmd_cuda;

/* A class index below C, or negative (an ignored row). */
struct ValidTarget {
    int64_t classes;
    __device__ bool operator()(int64_t t) const { return t < classes; }
};

/* Deferred messages; args[0] is the number of classes. */
int format_error(const mmd_deferred_call *call, int64_t row, int) {
    return mmd_error(MMD_ERR_VALUE,
                     "target[%lld] is not a class index in [0, %lld) (negative: ignored)",
                     (long long)row, (long long)call->args[0]);
}

/* Lanes of a warp per row: the fewest (a power of 2, at most 32) that
 * give each at most 4 of the row's elements. */
inline int lanes_per_row(int64_t classes) {
    int lanes = 1;
    while (lanes < 32 && lanes * 4 < classes) lanes *= 2;
    return lanes;
}

/* The sum (Max false) or the maximum of `value` over the `width` lanes of
 * a row's group (`mask` their bits), in every one of them: a butterfly,
 * whose every lane adds the same pairs, so each gets the same bits. */
template <bool Max, typename A>
__device__ inline A group_reduce(A value, int width, unsigned mask) {
    for (int offset = width / 2; offset > 0; offset /= 2) {
        const A other = __shfl_xor_sync(mask, value, offset, width);
        value = Max ? (other > value ? other : value) : value + other;
    }
    return value;
}

/* The loss of each row (grad_output null) into `result` (N,), or the
 * gradient of sum(loss * grad_output) into `result` (N, C): `width` lanes
 * (lanes_per_row) per row, lane j taking its elements j, j + width, ...
 * (the group's loads coalesced), its maximum and sum reduced over the
 * group. */
template <typename T>
__global__ void focal_loss_kernel(const T *input, const int64_t *target, const T *weight,
                                  const T *grad_output, T *result, int64_t rows,
                                  int64_t classes, int width, typename Compute<T>::type gamma,
                                  typename Compute<T>::type alpha, ErrorSink sink) {
    typedef typename Compute<T>::type A;
    const int lane = threadIdx.x % width;
    const unsigned mask = width == 32 ? 0xffffffffu
                                      : ((1u << width) - 1) << (threadIdx.x % 32 - lane);
    const int64_t groups = (int64_t)blockDim.x * gridDim.x / width;
    for (int64_t i = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / width; i < rows;
         i += groups) {
        const T *x = input + i * classes;
        const int64_t label = target[i];
        const bool bad = label >= classes;
        if (bad && lane == 0) sink.report(i, kBadTarget);
        if (bad || label < 0) {   /* bad: NaN; ignored: 0 */
            const T fill = from_compute<T>(bad ? (A)NAN : (A)0);
            if (grad_output == nullptr) {
                if (lane == 0) result[i] = fill;
            } else {
                for (int64_t c = lane; c < classes; c += width) result[i * classes + c] = fill;
            }
            continue;
        }
        A max = -INFINITY;   /* NaN never the maximum */
        for (int64_t c = lane; c < classes; c += width) {
            const A v = to_compute(x[c]);
            max = v > max ? v : max;
        }
        max = group_reduce<true>(max, width, mask);
        A rest = 0, ties = 0;
        for (int64_t c = lane; c < classes; c += width) {
            const A y = to_compute(x[c]) - max;
            if (y == 0)
                ties += 1;
            else
                rest += exp(y);
        }
        const A others = mmd_softmax_others(group_reduce<false>(rest, width, mask),
                                            group_reduce<false>(ties, width, mask));
        const mmd_softmax_focal_target<mmd_scalar_math<A>> f(to_compute(x[label]) - max, others);
        const A scale = weight ? to_compute(weight[label]) : (A)1;
        if (grad_output == nullptr) {
            if (lane == 0)
                result[i] = from_compute<T>(scale * mmd_softmax_focal_loss(f, gamma, alpha));
            continue;
        }
        const A factor = to_compute(grad_output[i]) * scale *
                         mmd_softmax_focal_loss_factor(f, gamma, alpha);
        const A per_term = mmd_softmax_focal_loss_term_scale(factor, others);
        for (int64_t c = lane; c < classes; c += width)
            result[i * classes + c] = from_compute<T>(
                c == label ? factor * f.q : per_term * exp(to_compute(x[c]) - max));
    }
}

int focal_loss_run(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *weight,
                   const mmd_tensor *output, const mmd_tensor *grad_output,
                   const mmd_tensor *grad_input, double gamma, double alpha,
                   const mmd_context *ctx) {
    int s = mmd_softmax_focal_loss_check(input, target, weight, output, grad_output, grad_input,
                                         gamma, alpha, MMD_FLOAT16_BF16_32_64);
    if (s) return s;
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const mmd_tensor *result = output ? output : grad_input;
    const bool work = mmd_numel(result) > 0;
    return on_device(ctx, [&](cudaStream_t stream) -> int {
        const int64_t *t = (const int64_t *)target->data;
        ErrorSink sink;
        const int s = check_targets(ctx, "softmax_focal_loss target check", t, rows,
                                    ValidTarget{classes}, format_error, classes,
                                    [&](int64_t row, int64_t value) {
                                        return mmd_softmax_focal_loss_target_error(row, value,
                                                                                   classes);
                                    },
                                    stream, work, &sink);
        if (s || !work) return s;
        return by_dtype(input->dtype, [&](auto tag) {
            typedef decltype(tag) T;
            typedef typename Compute<T>::type A;
            const int width = lanes_per_row(classes);
            focal_loss_kernel<T><<<blocks_for(rows * width), kThreads, 0, stream>>>(
                (const T *)input->data, t, weight ? (const T *)weight->data : nullptr,
                grad_output ? (const T *)grad_output->data : nullptr, (T *)result->data, rows,
                classes, width, (A)gamma, (A)alpha, sink);
            return launch_status("softmax_focal_loss launch");
        });
    });
}

int softmax_focal_loss_forward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                    const mmd_tensor *weight, const mmd_tensor *output,
                                    double gamma, double alpha, const mmd_context *ctx) {
    return focal_loss_run(input, target, weight, output, nullptr, nullptr, gamma, alpha, ctx);
}

int softmax_focal_loss_backward_cuda(const mmd_tensor *input, const mmd_tensor *target,
                                     const mmd_tensor *weight, const mmd_tensor *grad_output,
                                     const mmd_tensor *grad_input, double gamma, double alpha,
                                     const mmd_context *ctx) {
    return focal_loss_run(input, target, weight, nullptr, grad_output, grad_input, gamma, alpha,
                          ctx);
}

}  // namespace

MMD_REGISTRATIONS(cuda, softmax_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_forward_impl, CUDA, DEFAULT,
                             softmax_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_backward_impl, CUDA, DEFAULT,
                             softmax_focal_loss_backward_cuda);
    /* no atomics, and reductions in a fixed order: deterministic as it is */
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_forward_impl, CUDA, DETERMINISTIC,
                             softmax_focal_loss_forward_cuda);
    MMD_REGISTER_DEVICE_IMPL(softmax_focal_loss_backward_impl, CUDA, DETERMINISTIC,
                             softmax_focal_loss_backward_cuda);
}
