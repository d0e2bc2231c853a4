/* toy_scale on CPU (the toy op of tests/test_toy_op.py). */
#include "mmdispatch/ops/toy_scale.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"

namespace {

template <typename T> void scale(const mmd_tensor *input, const mmd_tensor *output, T factor) {
    const T *in = (const T *)input->data;
    T *out = (T *)output->data;
    for (int64_t i = 0, n = mmd_numel(input); i < n; ++i) out[i] = mmd_toy_scale(in[i], factor);
}

int toy_scale_cpu(const mmd_tensor *input, const mmd_tensor *output, double factor,
                  const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_toy_scale_check(input, output, factor, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        scale<float>(input, output, (float)factor);
    else
        scale<double>(input, output, factor);
    return MMD_OK;
}

}  // namespace

MMD_REGISTRATIONS(cpu, toy_scale) {
    MMD_REGISTER_DEVICE_IMPL(toy_scale_impl, CPU, DEFAULT, toy_scale_cpu);
}
