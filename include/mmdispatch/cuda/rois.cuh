/* The roi ops' roi validation on CUDA (roi_align, ps_roi_align,
 * ps_roi_pool), for a `Check`: a functor passed to kernels by value whose
 * `__device__ int operator()(int64_t k) const` gives roi k's MMD_ROI_*
 * code (mmdispatch/ops/rois.h) from the op's own geometry. */
#ifndef MMDISPATCH_CUDA_ROIS_CUH
#define MMDISPATCH_CUDA_ROIS_CUH

#include "mmdispatch/cuda/common.cuh"
#include "mmdispatch/ops/rois.h"

namespace mmd_cuda {

/* Reports every bad roi into `sink`. */
template <typename Check>
__global__ void check_rois_kernel(Check check, int64_t num_rois, ErrorSink sink) {
    MMD_GRID_STRIDE_LOOP(k, num_rois) {
        const int code = check(k);
        if (code != MMD_ROI_OK) sink.report(k, code);
    }
}

/* In strict mode validates the rois on the device before anything is
 * written (one sync); then records the call (its deferred errors name a
 * roi of an input of `batch` images) and fills `sink` for the op kernels'
 * own reports. With nothing to compute (`work` false) the check kernel
 * reports into the sink instead, so bad rois are an error whatever the
 * output's size, as on the CPU. `what` names the check in CUDA errors. */
template <typename Check>
int check_rois(const mmd_context *ctx, const char *what, Check check, int64_t num_rois,
               int64_t batch, cudaStream_t stream, bool work, ErrorSink *sink) {
    auto launch_check = [&](ErrorSink into) {
        check_rois_kernel<<<blocks_for(num_rois), kThreads, 0, stream>>>(check, num_rois, into);
    };
    int s = MMD_OK;
    if (strict(ctx) && num_rois > 0)
        s = check_on_device(stream, what, launch_check, [&](int64_t index, int code) {
            return mmd_roi_error(code, index, batch);
        });
    if (!s) s = begin_deferred(ctx, mmd_roi_deferred_error, batch, 0, 0, sink);
    if (!s && !work && !strict(ctx) && num_rois > 0) {
        launch_check(*sink);
        s = launch_status(what);
    }
    return s;
}

}  // namespace mmd_cuda

#endif
