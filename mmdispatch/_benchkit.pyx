# cython: language_level=3
"""The two sides of the dispatch-overhead benchmark (mmdispatch.bench):

- ``noop_roi_align_forward_kernel()``: a capsule holding a C kernel with
  roi_align_forward_impl's signature that does nothing, for
  ``register_impl`` — dispatching to it costs exactly the dispatcher;
- ``raw_roi_align_forward(...)``: the same Python arguments handed straight
  to the same no-op kernel (typed numpy arguments, raw data pointers, the
  GIL released around the call, the status checked), i.e. the least a
  Python-callable C kernel costs without any dispatcher.
"""
cimport numpy as cnp
from cpython.pycapsule cimport PyCapsule_New
from libc.stdint cimport int64_t

from mmdispatch._core cimport mmd_context, mmd_tensor

cnp.import_array()


cdef int noop_roi_align_forward(const mmd_tensor *input, const mmd_tensor *rois,
                                const mmd_tensor *output, const mmd_tensor *argmax_y,
                                const mmd_tensor *argmax_x, int64_t aligned_height,
                                int64_t aligned_width, double spatial_scale,
                                int64_t sampling_ratio, int64_t pool_mode, int aligned,
                                const mmd_context *ctx) noexcept nogil:
    return 0


def noop_roi_align_forward_kernel():
    """A C kernel capsule for register_impl("roi_align_forward_impl", ...)."""
    return PyCapsule_New(<void *>noop_roi_align_forward,
                         b"mmdispatch.kernel.roi_align_forward_impl", NULL)


def raw_roi_align_forward(cnp.ndarray input, cnp.ndarray rois, cnp.ndarray output,
                          cnp.ndarray argmax_y, cnp.ndarray argmax_x, int64_t aligned_height,
                          int64_t aligned_width, double spatial_scale, int64_t sampling_ratio,
                          int64_t pool_mode, bint aligned):
    """No-op kernel call without the dispatcher (the benchmark's baseline)."""
    cdef mmd_tensor t[5]
    cdef mmd_context ctx
    cdef int status
    t[0].data = cnp.PyArray_DATA(input)
    t[1].data = cnp.PyArray_DATA(rois)
    t[2].data = cnp.PyArray_DATA(output)
    t[3].data = cnp.PyArray_DATA(argmax_y)
    t[4].data = cnp.PyArray_DATA(argmax_x)
    ctx.stream = NULL
    ctx.device_id = 0
    with nogil:
        status = noop_roi_align_forward(&t[0], &t[1], &t[2], &t[3], &t[4], aligned_height,
                                        aligned_width, spatial_scale, sampling_ratio,
                                        pool_mode, aligned, &ctx)
    if status != 0:
        raise RuntimeError(f"roi_align_forward_impl: no-op kernel returned {status}")
