/* The focal losses' class-target validation on CUDA, for a `Valid`: a
 * functor passed to kernels by value whose
 * `__device__ bool operator()(int64_t target) const` accepts a target. */
#ifndef MMDISPATCH_CUDA_TARGETS_CUH
#define MMDISPATCH_CUDA_TARGETS_CUH

#include "mmdispatch/cuda/common.cuh"

namespace mmd_cuda {

enum { kBadTarget = 1 };

/* Reports every row whose target `valid` refuses into `sink`. */
template <typename Valid>
__global__ void check_targets_kernel(const int64_t *target, int64_t rows, Valid valid,
                                     ErrorSink sink) {
    MMD_GRID_STRIDE_LOOP(i, rows) {
        if (!valid(target[i])) sink.report(i, kBadTarget);
    }
}

/* In strict mode checks the targets on the device before anything is
 * written (one sync), raising error_of(row, value) for the first bad one;
 * then records the call (deferred errors formatted by `format`, with
 * `classes` as args[0]) and fills `sink` for the op kernels' own reports.
 * With nothing to compute (`work` false) the check kernel reports into the
 * sink instead, so bad targets are an error whatever the input's size, as
 * on the CPU. `what` names the check in CUDA errors. */
template <typename Valid, typename ErrorOf>
int check_targets(const mmd_context *ctx, const char *what, const int64_t *target, int64_t rows,
                  Valid valid, mmd_deferred_format format, int64_t classes, ErrorOf error_of,
                  cudaStream_t stream, bool work, ErrorSink *sink) {
    auto launch_check = [&](ErrorSink into) {
        check_targets_kernel<<<blocks_for(rows), kThreads, 0, stream>>>(target, rows, valid,
                                                                        into);
    };
    int s = MMD_OK;
    if (strict(ctx) && rows > 0)
        s = check_on_device(stream, what, launch_check, [&](int64_t row, int) {
            int64_t value = 0;
            const cudaError_t err = cudaMemcpy(&value, target + row, sizeof value,
                                               cudaMemcpyDeviceToHost);
            return err != cudaSuccess ? cuda_error(err, what) : error_of(row, value);
        });
    if (!s) s = begin_deferred(ctx, format, classes, 0, 0, sink);
    if (!s && !work && !strict(ctx) && rows > 0) {
        launch_check(*sink);
        s = launch_status(what);
    }
    return s;
}

}  // namespace mmd_cuda

#endif
