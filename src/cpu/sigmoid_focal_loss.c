/* sigmoid_focal_loss on CPU: elementwise over (N, C), rows split over OpenMP threads; targets
 * are validated before anything is written. The typed kernels (after #else, with T / TFN
 * naming the type and the name suffix) are instantiated for float and double through
 * mmdispatch/typed.h. */
#ifndef MMD_REAL

#include "mmdispatch/ops/sigmoid_focal_loss.h"
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

/* Loss (backward = 0) or its gradient (backward = 1) for every element. */
static void TFN(focal_loss)(int backward, const mmd_tensor *input, const mmd_tensor *target,
                            const mmd_tensor *weight, const mmd_tensor *output, T gamma,
                            T alpha) {
    const int64_t rows = input->shape[0], classes = input->shape[1];
    const T *x = (const T *)input->data;
    const int64_t *t = (const int64_t *)target->data;
    const T *w = weight ? (const T *)weight->data : NULL;
    T *out = (T *)output->data;
#pragma omp parallel for schedule(static) if (rows * classes > 16384)
    for (int64_t i = 0; i < rows; ++i) {
        const T scale = (w && t[i] < classes) ? w[t[i]] : (T)1;
        for (int64_t c = 0; c < classes; ++c) {
            const int64_t o = i * classes + c;
            const int positive = c == t[i];
            out[o] = scale * (backward ? TFN(mmd_focal_loss_grad)(x[o], positive, gamma, alpha)
                                       : TFN(mmd_focal_loss)(x[o], positive, gamma, alpha));
        }
    }
}

#undef T
#undef TFN
#endif
