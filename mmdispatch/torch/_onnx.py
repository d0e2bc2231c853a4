"""ONNX export of our ops: a model on mmdispatch.torch exports, with either
of torch.onnx.export's exporters, to the ONNX operators a model on
torchvision.ops exports to (RoiAlign, MaxRoiPool, NonMaxSuppression,
DeformConv; box_iou as elementwise operators), ps_roi_align as RoiAlign
and a Gather, MMCV's deformable attention as MMCV's grid_sample
fallback exports (GridSample), and torchvision's sigmoid_focal_loss as its
elementwise ops.

DerivedOp.__call__ hands a call that torch.onnx.export traces to
ONNX_EXPORTS (torch.onnx is imported only by then):
- the TorchScript exporter (`dynamo=False`) traces our op itself, with real
  tensors; the symbolic functions below, registered when torch.jit.trace
  first records one of our ops (the exporter's trace, or one exported
  later), translate its node;
- the torch.export-based exporter (`dynamo=True`, torch's default) builds
  its registry of translations before it traces, so a call records the ONNX
  operator directly (`torch.onnx.ops.symbolic`, torch 2.8 and later), and
  nms, whose output length only the data tells, records torchvision's nms,
  whose translation torch has when torchvision was imported before the
  export.
What ONNX cannot express (MMCV's max-mode roi_align and roi_pool bins, the
ops ONNX has no operator for) is refused, naming the op and the parameter.
"""
import sys

import numpy as np
import torch

from mmdispatch.ops.roi_align import _POOL_MODES
from mmdispatch.ops.roi_pool import CONVENTIONS
from mmdispatch.torch._library import _ON_JIT_TRACE, DERIVED, ONNX_EXPORTS, torch_name
from mmdispatch.torch._vision import focal_loss_composite

_AVG = _POOL_MODES["avg"]
_TORCHVISION_BINS = CONVENTIONS["torchvision"]
_INT64_MAX = (1 << 63) - 1
# the opsets where an operator has our semantics: RoiAlign's half-pixel
# mode (aligned=True) came in opset 16, DeformConv in opset 19
_ALIGNED_OPSET, _DEFORM_OPSET = 16, 19


def _error(op, message):
    return torch.onnx.errors.OnnxExporterError(f"{op}: torch.onnx.export cannot export {message}")


def _refuse_pool_mode(pool_mode):
    if pool_mode != _AVG:
        raise _error("roi_align_forward", "pool_mode='max' (ONNX's RoiAlign max mode takes "
                                          "the largest weighted corner of a sample, not the "
                                          "largest sample)")


def _refuse_convention(convention):
    if convention != _TORCHVISION_BINS:
        raise _error("roi_pool_forward", "convention='mmcv' (MMCV's roi_pool bins; ONNX's "
                                         "MaxRoiPool rounds a roi's corners to pixels, as "
                                         "torchvision's convention does)")


def _refuse(entry_point, args):
    """The error of a call whose semantics no ONNX operator has."""
    if entry_point == "roi_align_forward_impl":
        _refuse_pool_mode(args[6])
    elif entry_point == "roi_pool_forward_impl":
        _refuse_convention(args[5])
    elif entry_point == "nms_impl":
        _nms_threshold(args[3])


def _nms_threshold(threshold):
    """The threshold for ONNX's NonMaxSuppression, which compares IoU >
    threshold in float32 and takes thresholds in [0, 1]: the largest
    float32 <= threshold (an IoU of float32(0.3), just above 0.3, is
    suppressed, as in eager code), 1 for any larger (or NaN) threshold,
    which suppresses nothing either way; a negative one, which suppresses
    disjoint boxes too, is refused."""
    threshold = float(threshold)
    if threshold < 0:
        raise _error("nms", f"iou_threshold={threshold} (ONNX's NonMaxSuppression takes "
                            f"thresholds in [0, 1])")
    if not threshold < 1:
        return 1.0
    value = np.float32(threshold)
    if float(value) > threshold:   # compared in float64 (numpy 2 would compare in float32)
        value = np.nextafter(value, np.float32(-np.inf))
    return float(value)


def _dense_rank(values):
    """Each value's rank among the distinct values (0, 1, ...; every NaN
    one value, -0.0 as 0.0), in torch's operators: batched nms's
    categories as small integers, which the float32 offsets keep apart
    (float categories have no bit view in ONNX)."""
    ordered, order = values.sort()
    previous = torch.cat([ordered[:1], ordered[:-1]])
    new = ordered != previous
    if values.is_floating_point():
        new = new & ~(ordered.isnan() & previous.isnan())
    return torch.zeros_like(order).scatter(0, order, new.to(torch.int64).cumsum(0))


def _nms_boxes(boxes, idxs, offset, add, span):
    """The boxes for ONNX's NonMaxSuppression: x2 and y2 + 1 for offset=1
    (the same IoU as MMCV's +1 on widths and heights), and, for a batched
    call, each category's boxes moved past all others' by a multiple of
    the coordinates' range plus one (`add` and `span` build the graph)."""
    if offset:
        boxes = add(boxes, "offset")
    if idxs is not None:
        boxes = add(boxes, span(boxes, idxs))
    return boxes


# ---- the TorchScript exporter: symbolic functions of our ops' nodes

def _constant(g, value):
    return g.op("Constant", value_t=value)


def _check_opset(g, op, need, what="it"):
    if g.opset < need:
        raise _error(op, f"{what} at opset_version {g.opset}: ONNX's operator with these "
                         f"semantics needs opset_version >= {need}")


def _rois_split(g, rois):
    """(batch indices as int64, the (K, 4) corners) of (K, 5) rois."""
    index = g.op("Gather", rois, _constant(g, torch.tensor(0)), axis_i=1)
    corners = g.op("Gather", rois, _constant(g, torch.tensor([1, 2, 3, 4])), axis_i=1)
    return g.op("Cast", index, to_i=7), corners


def _ts_roi_align(g, input, rois, height, width, spatial_scale, sampling_ratio, pool_mode,
                  aligned):
    from torch.onnx.symbolic_helper import _maybe_get_const
    _refuse_pool_mode(_maybe_get_const(pool_mode, "i"))   # a jit.trace did not refuse it
    _check_opset(g, "roi_align_forward", 10)   # RoiAlign came in opset 10
    attributes = {}
    if _maybe_get_const(aligned, "b"):
        _check_opset(g, "roi_align_forward", _ALIGNED_OPSET, "aligned=True")
        attributes["coordinate_transformation_mode_s"] = "half_pixel"
    elif g.opset >= _ALIGNED_OPSET:   # before: RoiAlign's only mode
        attributes["coordinate_transformation_mode_s"] = "output_half_pixel"
    index, corners = _rois_split(g, rois)
    output = g.op("RoiAlign", input, corners, index, mode_s="avg",
                  output_height_i=_maybe_get_const(height, "i"),
                  output_width_i=_maybe_get_const(width, "i"),
                  sampling_ratio_i=max(_maybe_get_const(sampling_ratio, "i"), 0),
                  spatial_scale_f=_maybe_get_const(spatial_scale, "f"), **attributes)
    none = _constant(g, torch.empty(0))   # avg mode's argmax outputs are empty
    return output, none, none


def _ts_roi_pool(g, input, rois, height, width, spatial_scale, convention):
    from torch.onnx.symbolic_helper import _maybe_get_const
    _refuse_convention(_maybe_get_const(convention, "i"))   # a jit.trace did not refuse it
    output = g.op("MaxRoiPool", input, rois,
                  pooled_shape_i=[_maybe_get_const(height, "i"), _maybe_get_const(width, "i")],
                  spatial_scale_f=_maybe_get_const(spatial_scale, "f"))
    return output, None   # the argmax: only a backward pass reads it


def _ts_nms(g, boxes, scores, idxs, iou_threshold, offset):
    from torch.onnx.symbolic_helper import _is_none, _maybe_get_const, _unsqueeze_helper
    # ONNX Runtime's NonMaxSuppression takes float32
    boxes = g.op("Cast", boxes, to_i=1)
    scores = g.op("Cast", scores, to_i=1)

    def add(value, what):
        if what == "offset":
            what = _constant(g, torch.tensor([0.0, 0.0, 1.0, 1.0]))
        return g.op("Add", value, what)

    def span(value, categories):
        width = g.op("Add", g.op("Sub", g.op("ReduceMax", value, keepdims_i=0),
                                 g.op("ReduceMin", value, keepdims_i=0)),
                     _constant(g, torch.tensor(1.0)))
        moved = g.op("Mul", g.op("Cast", categories, to_i=1), width)
        return _unsqueeze_helper(g, moved, [1])

    boxes = _nms_boxes(boxes, None if _is_none(idxs) else idxs,
                       _maybe_get_const(offset, "i"), add, span)
    _check_opset(g, "nms", 10)   # NonMaxSuppression came in opset 10
    threshold = _nms_threshold(_maybe_get_const(iou_threshold, "f"))
    selected = g.op("NonMaxSuppression", _unsqueeze_helper(g, boxes, [0]),
                    _unsqueeze_helper(g, scores, [0, 1]),
                    _constant(g, torch.tensor([_INT64_MAX])),
                    _constant(g, torch.tensor([threshold], dtype=torch.float32)))
    return g.op("Gather", selected, _constant(g, torch.tensor(2)), axis_i=1)


def _ts_deform_conv2d(g, input, offset, mask, weight, bias, stride_h, stride_w, pad_h, pad_w,
                      dilation_h, dilation_w, groups, offset_groups):
    from torch.onnx.symbolic_helper import _is_none, _maybe_get_const
    _check_opset(g, "deform_conv2d_forward", _DEFORM_OPSET)
    ints = [_maybe_get_const(v, "i") for v in (stride_h, stride_w, pad_h, pad_w, dilation_h,
                                               dilation_w, groups, offset_groups)]
    # the traced call has a bias (_export gives it zeros); a mask is the last input
    inputs = (input, weight, offset, bias) + (() if _is_none(mask) else (mask,))
    return g.op("DeformConv", *inputs, strides_i=ints[0:2], pads_i=[ints[2], ints[3]] * 2,
                dilations_i=ints[4:6], group_i=ints[6], offset_group_i=ints[7])


_SYMBOLICS = {
    "roi_align_forward_impl": _ts_roi_align,
    "roi_pool_forward_impl": _ts_roi_pool,
    "nms_impl": _ts_nms,
    "deform_conv2d_forward_impl": _ts_deform_conv2d,
}
_REGISTERED: list = []


def _unsupported(entry_point):
    """The symbolic function of an op the TorchScript exporter cannot
    translate: a clear error in place of torch's unknown-operator one."""
    name = torch_name(entry_point)

    def symbolic(g, *args):
        if entry_point in _TORCH_FORMS:
            raise _error(name, "it from a torch.jit.trace of the model: export the model itself "
                               "(torch.onnx.export(model, args)), whose trace records it as "
                               "torch's operators")
        raise _error(name, "it: ONNX has no operator for it")
    return symbolic


def _register_symbolics():
    """Our ops' symbolic functions for the TorchScript exporter, once,
    when torch.jit.trace (the exporter's, or one whose graph is exported
    later) first records one of our ops: the exporter looks them up after
    tracing."""
    if not _REGISTERED:
        for entry_point in DERIVED:
            torch.onnx.register_custom_op_symbolic(
                f"mmdispatch::{torch_name(entry_point)}",
                _SYMBOLICS.get(entry_point) or _unsupported(entry_point), 9)
        _REGISTERED.append(True)


_ON_JIT_TRACE[0] = _register_symbolics


# ---- the torch.export-based exporter: ONNX operators recorded at the call

def _symbolic(op, *args, **kwargs):
    symbolic = getattr(getattr(torch.onnx, "ops", None), "symbolic", None)
    if symbolic is None:
        raise _error(op, f"it with torch {torch.__version__}'s torch.export-based exporter "
                         f"(torch.onnx.ops.symbolic needs torch 2.8): export with dynamo=False")
    return symbolic(*args, **kwargs)


def _roi_corners(rois):
    return rois[:, 1:5], rois[:, 0].to(torch.int64)


def _one_dtype(input, rois):
    """(input, rois) in one dtype for ONNX's roi operators: float32 where
    they differ (torch.autocast leaves 16-bit features beside float32
    rois, which the op's autocast kernel computes in float32)."""
    if input.dtype == rois.dtype:
        return input, rois
    return input.float(), rois.float()


def _roi_align(input, rois, height, width, spatial_scale, sampling_ratio, pool_mode, aligned):
    op = "roi_align_forward"
    features, rois = _one_dtype(input, rois)
    corners, index = _roi_corners(rois)
    output = _symbolic(op, "RoiAlign", (features, corners, index),
                       dict(mode="avg", output_height=height, output_width=width,
                            sampling_ratio=max(sampling_ratio, 0),
                            spatial_scale=float(spatial_scale),
                            coordinate_transformation_mode=("half_pixel" if aligned
                                                            else "output_half_pixel")),
                       dtype=features.dtype,
                       shape=(rois.shape[0], input.shape[1], height, width),
                       version=_ALIGNED_OPSET)
    none = input.new_empty((0,))
    return output.to(input.dtype), none, none


def _roi_pool(input, rois, height, width, spatial_scale, convention):
    op = "roi_pool_forward"
    features, rois = _one_dtype(input, rois)
    output = _symbolic(op, "MaxRoiPool", (features, rois),
                       dict(pooled_shape=[height, width], spatial_scale=float(spatial_scale)),
                       dtype=features.dtype,
                       shape=(rois.shape[0], input.shape[1], height, width), version=11)
    return output.to(input.dtype), None   # the argmax: only a backward pass reads it


def _nms(boxes, scores, idxs, iou_threshold, offset):
    if "torchvision" not in sys.modules:
        raise _error("nms", "it unless torchvision was imported before the export (it records "
                            "torchvision's nms, whose ONNX function torch registers then), or "
                            "with dynamo=False")
    boxes = _nms_boxes(
        boxes.float(), idxs, offset,
        lambda b, what: b + (b.new_tensor([0.0, 0.0, 1.0, 1.0]) if what == "offset" else what),
        lambda b, categories: (categories.to(b.dtype) * (b.max() - b.min() + 1))[:, None])
    return torch.ops.torchvision.nms(boxes, scores.float(), _nms_threshold(iou_threshold))


def _deform_conv2d(input, offset, mask, weight, bias, stride_h, stride_w, pad_h, pad_w,
                   dilation_h, dilation_w, groups, offset_groups):
    op = "deform_conv2d_forward"
    height, width = offset.shape[2], offset.shape[3]
    return _symbolic(op, "DeformConv", (input, weight, offset, bias, mask),
                     dict(strides=[stride_h, stride_w], pads=[pad_h, pad_w, pad_h, pad_w],
                          dilations=[dilation_h, dilation_w], group=groups,
                          offset_group=offset_groups),
                     dtype=input.dtype, shape=(input.shape[0], weight.shape[0], height, width),
                     version=_DEFORM_OPSET)


_RECORDED = {
    "roi_align_forward_impl": _roi_align,
    "roi_pool_forward_impl": _roi_pool,
    "nms_impl": _nms,
    "deform_conv2d_forward_impl": _deform_conv2d,
}


# ---- both exporters

def _overlap(lo_a, hi_a, lo_b, hi_b, offset):
    width = torch.minimum(hi_a, hi_b) - torch.maximum(lo_a, lo_b) + offset
    return torch.where(width <= 0, torch.zeros_like(width), width)


def _bbox_overlaps(bboxes1, bboxes2, mode, aligned, offset):
    """bbox_overlaps in torch's ops, which both exporters translate
    (mmd_box_overlap's formula: a base of 0 or less gives 0)."""
    a = bboxes1 if aligned else bboxes1[:, None, :]
    b = bboxes2 if aligned else bboxes2[None, :, :]
    inter = (_overlap(a[..., 0], a[..., 2], b[..., 0], b[..., 2], offset)
             * _overlap(a[..., 1], a[..., 3], b[..., 1], b[..., 3], offset))
    area_a = (a[..., 2] - a[..., 0] + offset) * (a[..., 3] - a[..., 1] + offset)
    if mode == 0:
        base = area_a + (b[..., 2] - b[..., 0] + offset) * (b[..., 3] - b[..., 1] + offset) - inter
    else:
        base = area_a.expand_as(inter)
    zero = torch.where(inter.isnan(), inter, torch.zeros_like(inter))
    return torch.where(base <= 0, zero, inter / base)


def _multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations, weights):
    """Multi-scale deformable attention in torch's grid_sample (ONNX's
    GridSample, opset 16), as MMCV's fallback computes it: bilinear, zeros
    outside the map, a location x in [0, 1] at pixel x * W - 0.5
    (align_corners=False), the samples summed with their weights."""
    n, _, heads, depth = value.shape
    _, queries, _, levels, points, _ = locations.shape
    # the levels' (H, W): torch.export keeps an input's symbolic, jit.trace
    # bakes them in (and warns)
    sizes = spatial_shapes.tolist()
    starts = [0]
    for h, w in sizes[:-1]:
        starts.append(starts[-1] + h * w)
    grids = 2 * locations - 1
    sampled = []
    for level, ((h, w), start) in enumerate(zip(sizes, starts)):
        plane = value[:, start:start + h * w].permute(0, 2, 3, 1).reshape(n * heads, depth, h, w)
        grid = grids[:, :, :, level].transpose(1, 2).reshape(n * heads, queries, points, 2)
        sampled.append(torch.nn.functional.grid_sample(plane, grid, mode="bilinear",
                                                       padding_mode="zeros",
                                                       align_corners=False))
    weights = weights.transpose(1, 2).reshape(n * heads, 1, queries, levels * points)
    output = (torch.stack(sampled, -2).flatten(-2) * weights).sum(-1)
    return output.view(n, heads * depth, queries).transpose(1, 2).contiguous()


def _ps_roi_align(input, rois, height, width, spatial_scale, sampling_ratio):
    """ps_roi_align as our roi_align (aligned, avg: the same sampling) of
    every channel, which exports as RoiAlign, then each bin's own channel
    of its group: bin (i, j) of output channel c reads input channel
    (c * height + i) * width + j."""
    bins = height * width
    every = DERIVED["roi_align_forward_impl"](input, rois, height, width, spatial_scale,
                                              sampling_ratio, _AVG, True)[0]
    rois_count, channels = every.shape[0], input.shape[1] // bins
    own = torch.arange(bins, device=input.device) * (bins + 1)   # (b, b) of (bin, bin)
    return every.reshape(rois_count, channels, bins * bins)[:, :, own].reshape(
        rois_count, channels, height, width)


# entry point -> its form in torch's own ops (and our exportable ones),
# which both exporters translate
_TORCH_FORMS = {
    "ps_roi_align_forward_impl": _ps_roi_align,
    "bbox_overlaps_impl": _bbox_overlaps,
    "multi_scale_deformable_attn_forward_impl": _multi_scale_deformable_attn,
    "binary_focal_loss_forward_impl": focal_loss_composite,
}


def _exporting():
    is_exporting = getattr(torch.compiler, "is_exporting", None)
    return is_exporting is not None and is_exporting()


def _export(entry_point):
    def export(op, args):
        _refuse(entry_point, args)
        if entry_point == "nms_impl" and args[2] is not None:
            args = (args[0], args[1], _dense_rank(args[2]), *args[3:])
        if entry_point in _TORCH_FORMS:
            return _TORCH_FORMS[entry_point](*args)
        if torch.jit.is_tracing():   # the TorchScript exporter: our node, translated later
            _register_symbolics()
            if entry_point == "deform_conv2d_forward_impl" and args[4] is None:
                weight = args[3]
                args = (*args[:4], weight.new_zeros(weight.shape[0]), *args[5:])
            return op.op(*args)
        if _exporting():   # torch.export, for the other exporter
            return _RECORDED[entry_point](*args)
        # a trace of this thread that is neither exporter's (FakeTensors or
        # TorchDynamo outside torch.export while an export runs): the op itself
        return op.op(*args)
    return export


ONNX_EXPORTS.update({name: _export(name) for name in (*_RECORDED, *_TORCH_FORMS)})
