/* binary_focal_loss on CPU: elementwise, the elements split over the worker
 * pool; the math is mmdispatch/ops/binary_focal_loss.h's, on vectors of 8
 * floats or 4 doubles (vec_math.h's exp and log1p; the C library's for
 * logits past its domain). */
#include "mmdispatch/ops/binary_focal_loss.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "vec_math.h"

namespace {

/* an element (exp, log1p, pow) costs several steps: shared out from 16384 */
constexpr int64_t kParallelFrom = 16384;

/* out[i] = the loss of element i, for i in [begin, end). */
template <typename T>
MMD_X86_CLONES void forward_range(const T *x, const T *t, T *out, int64_t begin, int64_t end,
                                  T gamma, T alpha) {
    typedef VecMath<T> M;
    mmd_vec_elements<M>(
        begin, end, x,
        [&](int64_t i, int count, const typename M::value &xv) {
            const typename M::value tv = M::load(t + i, count);
            M::store(out + i, count,
                     mmd_binary_focal_loss_of<M>(xv, tv, gamma,
                                                 mmd_binary_focal_weight<M>(tv, alpha)));
        },
        [&](int64_t i) { out[i] = mmd_binary_focal_loss(x[i], t[i], gamma, alpha); });
}

/* grad_input and grad_target, each where it is not null, of elements
 * [begin, end): the element's gradients times grad_output's (g[0] for
 * every element where `broadcast`). */
template <typename T>
MMD_X86_CLONES void backward_range(const T *x, const T *t, const T *g, bool broadcast,
                                   T *grad_input, T *grad_target, int64_t begin, int64_t end,
                                   T gamma, T alpha) {
    typedef VecMath<T> M;
    typedef typename M::value V;
    mmd_vec_elements<M>(
        begin, end, x,
        [&](int64_t i, int count, const V &xv) {
            const V tv = M::load(t + i, count);
            V d_x, d_t;
            mmd_binary_focal_loss_grad_of<M>(xv, tv, gamma, mmd_binary_focal_weight<M>(tv, alpha),
                                             mmd_binary_focal_weight_slope(alpha), &d_x, &d_t);
            const V gv = broadcast ? V() + g[0] : M::load(g + i, count);
            if (grad_input) M::store(grad_input + i, count, gv * d_x);
            if (grad_target) M::store(grad_target + i, count, gv * d_t);
        },
        [&](int64_t i) {
            T d_x, d_t;
            mmd_binary_focal_loss_grad(x[i], t[i], gamma, alpha, &d_x, &d_t);
            const T gi = g[broadcast ? 0 : i];
            if (grad_input) grad_input[i] = gi * d_x;
            if (grad_target) grad_target[i] = gi * d_t;
        });
}

template <typename T>
void forward(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *output,
             T gamma, T alpha) {
    const int64_t total = mmd_numel(input);
    const T *x = (const T *)input->data, *t = (const T *)target->data;
    T *out = (T *)output->data;
    mmd_parallel_for(total, mmd_even_chunk(total), total >= kParallelFrom,
                     [&](int64_t begin, int64_t end) {
                         forward_range(x, t, out, begin, end, gamma, alpha);
                         return (int)MMD_OK;
                     });
}

template <typename T>
void backward(const mmd_tensor *input, const mmd_tensor *target, const mmd_tensor *grad_output,
              T *grad_input, T *grad_target, T gamma, T alpha) {
    const int64_t total = mmd_numel(input);
    const T *x = (const T *)input->data, *t = (const T *)target->data;
    const T *g = (const T *)grad_output->data;
    const bool broadcast = mmd_binary_focal_loss_broadcast(grad_output, input);
    mmd_parallel_for(total, mmd_even_chunk(total), total >= kParallelFrom,
                     [&](int64_t begin, int64_t end) {
                         backward_range(x, t, g, broadcast, grad_input, grad_target, begin, end,
                                        gamma, alpha);
                         return (int)MMD_OK;
                     });
}

int binary_focal_loss_forward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                  const mmd_tensor *output, double gamma, double alpha,
                                  const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_binary_focal_loss_forward_check(input, target, output, gamma, alpha, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        forward<float>(input, target, output, (float)gamma, (float)alpha);
    else
        forward<double>(input, target, output, gamma, alpha);
    return MMD_OK;
}

int binary_focal_loss_backward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                   const mmd_tensor *grad_output, const mmd_tensor *grad_input,
                                   const mmd_tensor *grad_target, double gamma, double alpha,
                                   int with_grad_input, int with_grad_target,
                                   const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_binary_focal_loss_backward_check(input, target, grad_output, grad_input,
                                                 grad_target, gamma, alpha, with_grad_input,
                                                 with_grad_target, MMD_FLOAT32_64);
    if (s || !(with_grad_input || with_grad_target)) return s;
    auto run = [&](auto zero) {
        typedef decltype(zero) T;
        backward<T>(input, target, grad_output, with_grad_input ? (T *)grad_input->data : nullptr,
                    with_grad_target ? (T *)grad_target->data : nullptr, (T)gamma, (T)alpha);
    };
    if (input->dtype == MMD_FLOAT32)
        run(0.0f);
    else
        run(0.0);
    return MMD_OK;
}

}  // namespace

MMD_REGISTRATIONS(cpu, binary_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_forward_impl, CPU, DEFAULT,
                             binary_focal_loss_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(binary_focal_loss_backward_impl, CPU, DEFAULT,
                             binary_focal_loss_backward_cpu);
}
