# cython: language_level=3
"""Compiled helpers for the ops' fast paths.

A tiny op call costs as much in Python as in its kernel: attribute reads
(``input.shape[1]``, ``input.dtype``), type tests and numpy.empty's argument
parsing. These helpers do the tests and the allocation of the common call
(exact numpy arrays the dispatcher takes as they are, ints where sizes are
asked for) in one C pass. Each returns None for any other call, and the op's
general path then takes it: conversions, and every error, naming the op.
"""
cimport numpy as cnp
from cpython.ref cimport PyObject
from libc.stdint cimport int64_t

import numpy as np

from mmdispatch._core cimport (mmd_compact_int, mmd_is_exact_ndarray, mmd_is_plain_numpy,
                               mmd_numpy_empty)

cnp.import_array()

# A zero-size array of each float dtype, for outputs a mode leaves unused
# (roi_align's argmax pair in avg mode); never handed to the caller.
cdef object _EMPTY_F32 = np.empty((0,), np.float32)
cdef object _EMPTY_F64 = np.empty((0,), np.float64)


cdef inline bint _positive_int(object value, int64_t *out) noexcept:
    return type(value) is int and mmd_compact_int(value, out) and out[0] > 0


cdef inline bint _plain(object a, int ndim) noexcept:
    return (mmd_is_exact_ndarray(<PyObject *>a) and mmd_is_plain_numpy(<PyObject *>a)
            and cnp.PyArray_NDIM(<cnp.ndarray>a) == ndim)


cdef inline bint _float_type(int type_num) noexcept:
    return type_num == cnp.NPY_FLOAT32 or type_num == cnp.NPY_FLOAT64


def pooled_output(input, rois, output_size):
    """``(output, out_h, out_w, empty)`` for the common call of a roi pooling
    op, else None.

    The common call: ``input`` (N, C, H, W) and ``rois`` (K, 5) exact numpy
    arrays, C-contiguous, aligned and native-endian, both float32 or both
    float64; ``output_size`` a positive int or a tuple of two. ``output`` is
    a new, uninitialised (K, C, out_h, out_w) array of their dtype;
    ``out_h``/``out_w`` are the ints of output_size; ``empty`` is a shared
    zero-size array of the dtype, for outputs the call leaves unused. Where
    the output cannot be allocated the answer is None too, and the general
    path raises the error."""
    cdef int64_t h, w
    cdef Py_ssize_t dims[4]   # npy_intp
    cdef int type_num
    if type(output_size) is int:
        if not _positive_int(output_size, &h):
            return None
        w = h
        out_h = out_w = output_size
    elif type(output_size) is tuple and len(<tuple>output_size) == 2:
        out_h, out_w = output_size
        if not (_positive_int(out_h, &h) and _positive_int(out_w, &w)):
            return None
    else:
        return None
    if not (_plain(input, 4) and _plain(rois, 2)):
        return None
    type_num = cnp.PyArray_TYPE(<cnp.ndarray>input)
    if (not _float_type(type_num)
            or cnp.PyArray_TYPE(<cnp.ndarray>rois) != type_num
            or cnp.PyArray_DIM(<cnp.ndarray>rois, 1) != 5):
        return None
    dims[0] = cnp.PyArray_DIM(<cnp.ndarray>rois, 0)
    dims[1] = cnp.PyArray_DIM(<cnp.ndarray>input, 1)
    dims[2] = h
    dims[3] = w
    try:
        output = mmd_numpy_empty(4, dims, <object>cnp.PyArray_DESCR(<cnp.ndarray>input))
    except (MemoryError, ValueError):
        return None
    return output, out_h, out_w, _EMPTY_F32 if type_num == cnp.NPY_FLOAT32 else _EMPTY_F64


def index_like(cnp.ndarray array not None):
    """A new, uninitialised int64 array of ``array``'s shape: the argmax
    output that goes with a pooled_output output."""
    return cnp.PyArray_EMPTY(cnp.PyArray_NDIM(array), cnp.PyArray_DIMS(array), cnp.NPY_INT64, 0)


def nms_outputs(boxes, scores):
    """``(keep, num_kept)`` for the common call of nms, else None.

    The common call: ``boxes`` (N, 4) and ``scores`` (N,) exact numpy
    arrays, C-contiguous, aligned and native-endian, both float32 or both
    float64. ``keep`` is a new, uninitialised (N,) int64 array, ``num_kept``
    a new (1,) int64 zero: nms_impl's outputs. Where they cannot be
    allocated the answer is None too."""
    cdef cnp.npy_intp n, one = 1
    cdef int type_num
    if not (_plain(boxes, 2) and _plain(scores, 1)):
        return None
    type_num = cnp.PyArray_TYPE(<cnp.ndarray>boxes)
    n = cnp.PyArray_DIM(<cnp.ndarray>boxes, 0)
    if (not _float_type(type_num) or cnp.PyArray_TYPE(<cnp.ndarray>scores) != type_num
            or cnp.PyArray_DIM(<cnp.ndarray>boxes, 1) != 4
            or cnp.PyArray_DIM(<cnp.ndarray>scores, 0) != n):
        return None
    try:
        keep = cnp.PyArray_EMPTY(1, &n, cnp.NPY_INT64, 0)
        num_kept = cnp.PyArray_ZEROS(1, &one, cnp.NPY_INT64, 0)
    except MemoryError:
        return None
    return keep, num_kept


def box_pairs_output(bboxes1, bboxes2, aligned):
    """The ious output for the common call of bbox_overlaps, else None.

    The common call: ``bboxes1`` (N, 4) and ``bboxes2`` (M, 4) exact numpy
    arrays, C-contiguous, aligned and native-endian, both float32 or both
    float64; ``aligned`` True or False. The output is a new, uninitialised
    array of their dtype, (N, M), or (N,) when aligned (then M must be N).
    Where it cannot be allocated the answer is None too."""
    cdef cnp.npy_intp dims[2]
    cdef int type_num
    if not (_plain(bboxes1, 2) and _plain(bboxes2, 2)) or (aligned is not True
                                                             and aligned is not False):
        return None
    type_num = cnp.PyArray_TYPE(<cnp.ndarray>bboxes1)
    dims[0] = cnp.PyArray_DIM(<cnp.ndarray>bboxes1, 0)
    dims[1] = cnp.PyArray_DIM(<cnp.ndarray>bboxes2, 0)
    if (not _float_type(type_num) or cnp.PyArray_TYPE(<cnp.ndarray>bboxes2) != type_num
            or cnp.PyArray_DIM(<cnp.ndarray>bboxes1, 1) != 4
            or cnp.PyArray_DIM(<cnp.ndarray>bboxes2, 1) != 4
            or (aligned is True and dims[0] != dims[1])):
        return None
    try:
        return cnp.PyArray_EMPTY(1 if aligned is True else 2, dims, type_num, 0)
    except (MemoryError, ValueError):
        return None
