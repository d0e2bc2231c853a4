/* Messages for rois rejected by any roi op (see mmdispatch/ops/rois.h). */
#include "mmdispatch/deferred.h"
#include "mmdispatch/ops/rois.h"
#include "mmdispatch/tensor.h"

int mmd_roi_error(int code, int64_t roi_index, int64_t batch_size) {
    switch (code) {
    case MMD_ROI_NONFINITE:
        return mmd_error(MMD_ERR_VALUE, "rois[%lld] contains NaN or inf (or overflows once scaled)",
                         (long long)roi_index);
    case MMD_ROI_BAD_BATCH:
        return mmd_error(MMD_ERR_VALUE,
                         "rois[%lld, 0] (batch index) must be an integer in [0, %lld)",
                         (long long)roi_index, (long long)batch_size);
    case MMD_ROI_NEGATIVE_SIZE:
        return mmd_error(MMD_ERR_VALUE,
                         "rois[%lld] has negative width or height (x2 < x1 or y2 < y1), which "
                         "aligned sampling (roi_align's aligned=True, ps_roi_align) does not "
                         "allow",
                         (long long)roi_index);
    case MMD_ROI_NEGATIVE_SIDES:
        return mmd_error(MMD_ERR_VALUE,
                         "rois[%lld] has a negative width or height (columns 3 and 4), which "
                         "aligned sampling does not allow",
                         (long long)roi_index);
    case MMD_ROI_GRID_TOO_LARGE:
        return mmd_error(MMD_ERR_VALUE,
                         "rois[%lld] needs more than %d samples per bin axis; use a smaller "
                         "roi, spatial_scale or sampling_ratio",
                         (long long)roi_index, MMD_ROI_ALIGN_MAX_GRID);
    default:
        return mmd_error(MMD_ERR_RUNTIME, "rois[%lld]: unknown roi error %d",
                         (long long)roi_index, code);
    }
}

int mmd_roi_deferred_error(const mmd_deferred_call *call, int64_t roi_index, int code) {
    return mmd_roi_error(code, roi_index, call->args[0]);
}
