/* Inline numpy / int helpers of the dispatcher (mmdispatch._core): the tests
 * of the common call, with no Python-level call. */
#ifndef MMDISPATCH_PYARRAY_H
#define MMDISPATCH_PYARRAY_H

#include <Python.h>
#include <stdint.h>
#include <numpy/arrayobject.h>

#include "mmdispatch/tensor.h"

static inline int mmd_is_exact_ndarray(PyObject *obj) {
    return Py_TYPE(obj) == &PyArray_Type;
}

/* An exact numpy array's layout is what the dispatcher takes as it is (its
   dtype may not be): at most MMD_MAX_NDIM axes, native byte order,
   C-contiguous and aligned. */
static inline int mmd_is_plain_numpy(PyObject *obj) {
    PyArrayObject *arr = (PyArrayObject *)obj;
    return PyArray_NDIM(arr) <= MMD_MAX_NDIM && !PyArray_ISBYTESWAPPED(arr) &&
           PyArray_CHKFLAGS(arr, NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED);
}

/* An exact int of one digit or none (|v| < 2**30): its value, read from the
   object as Cython's own conversions do; 0 for any other int. */
static inline int mmd_compact_int(PyObject *v, int64_t *out) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)v)) return 0;
    *out = (int64_t)PyUnstable_Long_CompactValue((PyLongObject *)v);
#else
    const Py_ssize_t size = Py_SIZE(v);
    if (size < -1 || size > 1) return 0;
    *out = size * (int64_t)((PyLongObject *)v)->ob_digit[0];
#endif
    return 1;
}

#endif
