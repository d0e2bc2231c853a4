"""Deformable convolution (DCNv1; DCNv2 with a mask) with torchvision's
semantics, dispatched through deform_conv2d_forward_impl /
deform_conv2d_backward_impl.

- input is (N, C_in, H, W), weight (C_out, C_in // groups, kh, kw), bias
  (C_out,) or None; the weight groups are C_in // weight.shape[1].
- offset is (N, 2 * offset_groups * kh * kw, out_h, out_w): for offset
  group g and kernel tap (i, j), channel g*2*kh*kw + 2*(i*kw + j) moves the
  tap's sample along y and the next channel along x; the input's channels
  split evenly over the offset groups (offset_groups = offset.shape[1] //
  (2 * kh * kw)).
- mask (DCNv2) is (N, offset_groups * kh * kw, out_h, out_w) or None (all
  ones, DCNv1): each sample is multiplied by it.
- out_h = (H + 2 * pad_h - (dilation_h * (kh - 1) + 1)) // stride_h + 1
  (out_w alike), and offset and mask must have that size.
- samples are bilinear with zeros outside the map; a NaN offset gives a
  NaN sample.
- offset gradients are the floor rule's, as torchvision's: a sample at
  y == -1 exactly reads 0, but its y gradient is row 0 interpolated at x
  (x == -1 alike, column 0). Zero offsets with padding 1 put the first
  row's and column's taps there. MMCV's kernels give 0 there.
- the CPU kernel's matrix products call a BLAS (gemm.h), which may skip a
  product by zero: a NaN or inf in weight (or in grad_output, backward)
  then need not reach an output that IEEE arithmetic would make NaN. NaN
  in input, offset and mask always propagates.
"""
from mmdispatch import _core
from mmdispatch.ops._arrays import _cupy, check_ndim, explain, native, pair

__all__ = ["deform_conv2d", "deform_conv2d_backward"]
# the dispatch entry points (signatures.txt) these functions call
ENTRY_POINTS = ("deform_conv2d_forward_impl", "deform_conv2d_backward_impl")

# The gradients of every differentiable input, for the PyTorch layer: each
# is one output ("result") of deform_conv2d_backward_impl, which is called
# once for all of them, with `grad_output` the gradient of the forward's
# `output` and the other parameters the forward's.
GRADIENTS = {
    "deform_conv2d_forward_impl": {
        name: {"backward": "deform_conv2d_backward_impl", "grad_output": "output",
               "result": f"grad_{name}"}
        for name in ("input", "offset", "mask", "weight", "bias")
    },
}
# entry points whose CUDA kernels make float32 matrix products (cuBLAS),
# which may run in TF32 (mmdispatch.set_float32_matmul_precision; the
# PyTorch layer sets torch's setting for their calls)
FLOAT32_PRODUCTS = ("deform_conv2d_forward_impl", "deform_conv2d_backward_impl")

_LAYOUTS = (("input", 4, "(N, C_in, H, W)"), ("offset", 4, "(N, 2 * G * kh * kw, out_h, out_w)"),
            ("weight", 4, "(C_out, C_in // groups, kh, kw)"))


def _groups(op, input, offset, weight):
    """(groups, offset_groups) that the arrays' shapes imply."""
    arrays = {"input": input, "offset": offset, "weight": weight}
    shapes = {}
    for name, ndim, layout in _LAYOUTS:
        array = native(op, name, arrays[name])
        check_ndim(op, name, array, ndim, layout)
        shapes[name] = array.shape
    c_in, per_group = shapes["input"][1], shapes["weight"][1]
    if per_group == 0 or c_in % per_group:
        raise ValueError(f"{op}: weight has {per_group} input channels per group, which must "
                         f"divide the input's {c_in} channels (groups = C_in // "
                         f"weight.shape[1])")
    taps, offset_channels = 2 * shapes["weight"][2] * shapes["weight"][3], shapes["offset"][1]
    if taps == 0 or offset_channels % taps:
        raise ValueError(f"{op}: offset has {offset_channels} channels, which must be a "
                         f"multiple of 2 * kh * kw = {taps} (2 * offset_groups * kh * kw)")
    return c_in // per_group, offset_channels // taps


_cublas_asked = False


def _load_cupys_cublas(input):
    """Has CuPy load its cuBLAS (CuPy loads it lazily, at its first product)
    before the first CUDA product of a CuPy call, so that the CUDA kernels
    find it (mmdispatch/cuda/cublas.cuh: they take the process's cuBLAS,
    looked up once at their first product, and load nothing themselves).
    Once per process; without cuBLAS the kernels use their own products."""
    global _cublas_asked
    cupy = _cupy()
    if _cublas_asked or cupy is None or not isinstance(input, cupy.ndarray):
        return
    _cublas_asked = True
    try:
        cupy.cuda.cublas   # noqa: B018 (the attribute imports CuPy's cuBLAS module)
    except Exception:   # no cuBLAS installed: nothing to take
        pass


def _geometry(op, stride, padding, dilation):
    return (*pair(op, "stride", stride), *pair(op, "padding", padding, low=0),
            *pair(op, "dilation", dilation))


def deform_conv2d(input, offset, weight, bias=None, stride=1, padding=0, dilation=1, mask=None):
    """(N, C_out, out_h, out_w) in the input's dtype, library and device."""
    op = "deform_conv2d"
    geometry = _geometry(op, stride, padding, dilation)
    _load_cupys_cublas(input)
    try:
        groups, offset_groups = _groups(op, input, offset, weight)
        return _core.deform_conv2d_forward_impl(input, offset, mask, weight, bias, None,
                                                *geometry, groups, offset_groups)
    except (TypeError, ValueError) as exc:
        explain(op, exc, tuple(a for a in (("mask", mask, 4, "(N, G * kh * kw, out_h, out_w)"),
                                           ("bias", bias, 1, "(C_out,)")) if a[1] is not None))


def deform_conv2d_backward(grad_output, input, offset, weight, stride=1, padding=0, dilation=1,
                           mask=None):
    """The gradients of sum(output * grad_output) with respect to input,
    offset, mask, weight and bias, as a tuple in that order (grad_mask is
    None without a mask)."""
    op = "deform_conv2d_backward"
    geometry = _geometry(op, stride, padding, dilation)
    _load_cupys_cublas(input)
    try:
        groups, offset_groups = _groups(op, input, offset, weight)
        grads = _core.deform_conv2d_backward_impl(grad_output, input, offset, mask, weight, None,
                                                  None, None, None, None, *geometry, groups,
                                                  offset_groups)
    except (TypeError, ValueError) as exc:
        explain(op, exc, (("grad_output", grad_output, 4, "(N, C_out, out_h, out_w)"),))
    grad_input, grad_offset, grad_mask, grad_weight, grad_bias = grads
    return (grad_input, grad_offset, None if mask is None else grad_mask, grad_weight, grad_bias)
