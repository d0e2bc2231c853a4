/* Region-of-interest conventions shared by the roi ops (roi_align,
 * roi_pool) on every device: rois are (K, 5) rows [batch_index, x1, y1, x2,
 * y2] of the input's dtype, and each kernel validates every roi before it
 * writes any output, reporting the first bad one with these codes. */
#ifndef MMDISPATCH_OPS_ROIS_H
#define MMDISPATCH_OPS_ROIS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Outcome of validating one roi. */
enum {
    MMD_ROI_OK = 0,
    MMD_ROI_NONFINITE = 1,      /* NaN or inf, also after scaling */
    MMD_ROI_BAD_BATCH = 2,      /* batch index not an integer in [0, N) */
    MMD_ROI_NEGATIVE_SIZE = 3,  /* roi_align aligned=True: x2 < x1 or y2 < y1 */
    MMD_ROI_GRID_TOO_LARGE = 4  /* roi_align: too many samples per bin */
};

/* Samples per bin axis are capped so that a huge roi or sampling_ratio is an
 * error instead of an int overflow or an endless loop. */
#define MMD_ROI_ALIGN_MAX_GRID 32768

/* Formats the message for roi `roi_index`, rejected with `code`, and
 * returns MMD_ERR_VALUE (src/core/rois.c). */
int mmd_roi_error(int code, int64_t roi_index, int64_t batch_size);

/* The same for a roi reported as a deferred error (an mmd_deferred_format,
 * mmdispatch/deferred.h) by a call recorded with the batch size as args[0]. */
struct mmd_deferred_call;
int mmd_roi_deferred_error(const struct mmd_deferred_call *call, int64_t roi_index, int code);

#ifdef __cplusplus
}
#endif
#endif
