/* sigmoid_focal_loss on CPU: elementwise over (N, C), rows split over OpenMP threads; targets
 * are validated before anything is written. The typed kernels (after #else, with T / TFN
 * naming the type and the name suffix) are instantiated for float and double through
 * mmdispatch/typed.h. */
#ifndef MMD_REAL

#include "mmdispatch/ops/sigmoid_focal_loss.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"

#define MMD_TYPED_FILE "sigmoid_focal_loss.c"
#include "mmdispatch/typed.h"

int mmd_sigmoid_focal_loss_check(const mmd_tensor *input, const mmd_tensor *target,
                                 const mmd_tensor *weight, const mmd_tensor *output,
                                 const char *output_name, double gamma, double alpha,
                                 unsigned float_mask) {
    const int64_t any2[2] = {MMD_ANY_DIM, MMD_ANY_DIM};
    int s = mmd_check_shape(input, "input", 2, any2);
    if (!s) s = mmd_check_dtype(input, "input", float_mask);
    if (!s) s = mmd_check_contiguous(input, "input");
    if (s) return s;
    /* float16/float32 kernels compute in float: the scalars must fit it. */
    const int in_float = input->dtype != MMD_FLOAT64;
    if (!(isfinite(gamma) && gamma >= 0 && (!in_float || isfinite((float)gamma))))
        return mmd_error(MMD_ERR_VALUE, "gamma must be finite%s and >= 0, got %g",
                         in_float ? " in float32" : "", gamma);
    if (!(isfinite(alpha) && (!in_float || isfinite((float)alpha))))
        return mmd_error(MMD_ERR_VALUE, "alpha must be finite%s, got %g",
                         in_float ? " in float32" : "", alpha);
    const int64_t rows[1] = {input->shape[0]}, classes[1] = {input->shape[1]};
    s = mmd_check_shape(target, "target", 1, rows);
    if (!s) s = mmd_check_dtype(target, "target", MMD_DTYPE_BIT(MMD_INT64));
    if (!s) s = mmd_check_contiguous(target, "target");
    if (!s && weight) s = mmd_check_shape(weight, "weight", 1, classes);
    if (!s && weight) s = mmd_check_same_dtype(weight, "weight", input, "input");
    if (!s && weight) s = mmd_check_contiguous(weight, "weight");
    if (!s) s = mmd_check_shape(output, output_name, 2, input->shape);
    if (!s) s = mmd_check_same_dtype(output, output_name, input, "input");
    if (!s) s = mmd_check_contiguous(output, output_name);
    return s;
}

int mmd_sigmoid_focal_loss_target_error(int64_t row, int64_t value, int64_t num_classes) {
    return mmd_error(MMD_ERR_VALUE,
                     "target[%lld] = %lld is not a class index in [0, %lld] (%lld = background)",
                     (long long)row, (long long)value, (long long)num_classes,
                     (long long)num_classes);
}

static int check_targets(const mmd_tensor *target, int64_t num_classes) {
    const int64_t *t = (const int64_t *)target->data;
    for (int64_t i = 0; i < target->shape[0]; ++i)
        if (t[i] < 0 || t[i] > num_classes)
            return mmd_sigmoid_focal_loss_target_error(i, t[i], num_classes);
    return MMD_OK;
}

static int focal_loss_run(int backward, const mmd_tensor *input, const mmd_tensor *target,
                          const mmd_tensor *weight, const mmd_tensor *output, double gamma,
                          double alpha) {
    int s = mmd_sigmoid_focal_loss_check(input, target, weight, output,
                                         backward ? "grad_input" : "output", gamma, alpha,
                                         MMD_FLOAT32_64);
    if (!s) s = check_targets(target, input->shape[1]);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        focal_loss_f32(backward, input, target, weight, output, (float)gamma, (float)alpha);
    else
        focal_loss_f64(backward, input, target, weight, output, gamma, alpha);
    return MMD_OK;
}

static int sigmoid_focal_loss_forward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                          const mmd_tensor *weight, const mmd_tensor *output,
                                          double gamma, double alpha, const mmd_context *ctx) {
    (void)ctx;
    return focal_loss_run(0, input, target, weight, output, gamma, alpha);
}

static int sigmoid_focal_loss_backward_cpu(const mmd_tensor *input, const mmd_tensor *target,
                                           const mmd_tensor *weight,
                                           const mmd_tensor *grad_input, double gamma,
                                           double alpha, const mmd_context *ctx) {
    (void)ctx;
    return focal_loss_run(1, input, target, weight, grad_input, gamma, alpha);
}

#include "mmdispatch_generated.h"

MMD_REGISTRATIONS(cpu, sigmoid_focal_loss) {
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_forward_impl, CPU, DEFAULT,
                             sigmoid_focal_loss_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(sigmoid_focal_loss_backward_impl, CPU, DEFAULT,
                             sigmoid_focal_loss_backward_cpu);
}

#else /* typed kernels, instantiated above for float and double */
#define T MMD_REAL
#define TFN MMD_FN

/* The loop over rows of the loss (backward = 0) or its gradient (1). */
struct TFN(focal_loop) {
    int backward;
    const T *input, *weight;
    const int64_t *target;
    T *output;
    int64_t classes;
    T gamma, alpha;
};

static int TFN(focal_rows)(const void *loop, int64_t begin, int64_t end) {
    const struct TFN(focal_loop) *l = (const struct TFN(focal_loop) *)loop;
    const int64_t classes = l->classes, *t = l->target;
    for (int64_t i = begin; i < end; ++i) {
        const T scale = (l->weight && t[i] < classes) ? l->weight[t[i]] : (T)1;
        for (int64_t c = 0; c < classes; ++c) {
            const int64_t o = i * classes + c;
            const int positive = c == t[i];
            const T x = l->input[o];
            l->output[o] = scale * (l->backward
                                        ? TFN(mmd_focal_loss_grad)(x, positive, l->gamma, l->alpha)
                                        : TFN(mmd_focal_loss)(x, positive, l->gamma, l->alpha));
        }
    }
    return MMD_OK;
}

/* Loss (backward = 0) or its gradient (backward = 1) for every element. */
static void TFN(focal_loss)(int backward, const mmd_tensor *input, const mmd_tensor *target,
                            const mmd_tensor *weight, const mmd_tensor *output, T gamma,
                            T alpha) {
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const struct TFN(focal_loop) loop = {
        backward, (const T *)input->data, weight ? (const T *)weight->data : NULL,
        (const int64_t *)target->data, (T *)output->data, classes, gamma, alpha};
    /* an element (exp, log1p, pow) costs several steps: shared out from 16384 */
    mmd_parallel_for(rows, mmd_even_chunk(rows), rows * classes > 16384, TFN(focal_rows), &loop);
}

#undef T
#undef TFN
#endif
