"""mmcv.ops' functions and modules, with MMCV's names, signatures and
defaults, on mmdispatch's kernels: `from mmdispatch.torch.mmcv import
roi_align` in place of `from mmcv.ops import roi_align`. Rois are (K, 5)
tensors [batch index, x1, y1, x2, y2]."""
import torch
from torch import nn

from mmdispatch.ops.bbox_overlaps import _MODES as _OVERLAP_MODES
from mmdispatch.ops.roi_align import _POOL_MODES
from mmdispatch.torch import _vision
from mmdispatch.torch._library import DERIVED
from mmdispatch.torch._vision import _int_pair, _nms, _pair, like_dtype, rois_of
from mmdispatch.torch._vision import deform_groups as deform_groups_of

_ROI_ALIGN = DERIVED["roi_align_forward_impl"]
_OVERLAPS = DERIVED["bbox_overlaps_impl"]
_FOCAL_LOSS = DERIVED["sigmoid_focal_loss_forward_impl"]
_SOFTMAX_FOCAL_LOSS = DERIVED["softmax_focal_loss_forward_impl"]
_DEFORM_CONV2D = DERIVED["deform_conv2d_forward_impl"]


def _choice(op, name, value, options):
    if isinstance(value, str) and value in options:
        return options[value]
    raise ValueError(f"{op}: {name} must be one of {', '.join(map(repr, options))}, got "
                     f"{value!r}")


def roi_align(input, rois, output_size, spatial_scale=1.0, sampling_ratio=0, pool_mode="avg",
              aligned=True):
    """mmcv.ops.roi_align: (K, C, *output_size); pool_mode "avg" or "max";
    differentiable with respect to input in both modes."""
    h, w = _pair("roi_align", output_size)
    mode = _choice("roi_align", "pool_mode", pool_mode, _POOL_MODES)
    rois = rois_of("roi_align", rois, input)
    return _ROI_ALIGN(input, rois, h, w, float(spatial_scale), int(sampling_ratio), mode,
                      bool(aligned))[0]


# mmcv.ops.roi_pool has torchvision's signature and defaults
roi_pool = _vision.roi_pool


def _detections(boxes, scores, idxs, iou_threshold, offset, score_threshold, max_num):
    """(dets, inds) of nms within each class of idxs (None: one class)."""
    inds = torch.arange(boxes.shape[0], device=boxes.device)
    if score_threshold > 0:
        valid = scores > score_threshold
        boxes, scores, inds = boxes[valid], scores[valid], inds[valid]
        idxs = None if idxs is None else idxs[valid]
    keep = _nms(boxes, scores, None if idxs is None else idxs.to(torch.int64), iou_threshold,
                offset)
    if max_num > 0:
        keep = keep[:max_num]
    dets = torch.cat([boxes[keep], scores[keep].reshape(-1, 1).to(boxes.dtype)], dim=1)
    return dets, inds[keep]


def nms(boxes, scores, iou_threshold, offset=0, score_threshold=0, max_num=-1):
    """mmcv.ops.nms: returns (dets, inds), dets (k, 5) the kept boxes with
    their scores, inds their indices into `boxes`, by decreasing score.
    Boxes with scores <= score_threshold (when it is > 0) are left out
    first; max_num > 0 keeps at most that many."""
    return _detections(boxes, scores, None, iou_threshold, offset, score_threshold, max_num)


_NMS_OPTIONS = ("iou_threshold", "offset", "score_threshold", "max_num")


def batched_nms(boxes, scores, idxs, nms_cfg, class_agnostic=False):
    """mmcv.ops.batched_nms: nms within each class of idxs, configured by
    nms_cfg (a dict: iou_threshold, and optionally type "nms", offset,
    score_threshold, max_num, split_thr, class_agnostic). Returns (dets,
    keep) by decreasing score, dets (k, 5) the kept boxes with their scores.
    nms_cfg None sorts every box by score, without nms. The kernel keeps
    classes apart itself, so split_thr (MMCV's switch from the coordinate
    offset trick to a loop over classes) changes nothing; "soft_nms" and
    other types are not supported."""
    op = "batched_nms"
    if nms_cfg is None:
        scores, inds = scores.sort(descending=True, stable=True)
        return torch.cat([boxes[inds], scores[:, None].to(boxes.dtype)], dim=-1), inds
    cfg = dict(nms_cfg)
    class_agnostic = cfg.pop("class_agnostic", class_agnostic)
    nms_type = cfg.pop("type", "nms")
    if nms_type != "nms":
        raise ValueError(f"{op}: nms_cfg type must be 'nms', got {nms_type!r}")
    cfg.pop("split_thr", None)
    if "iou_threshold" not in cfg:
        raise ValueError(f"{op}: nms_cfg must give iou_threshold, got {nms_cfg!r}")
    unknown = sorted(set(cfg) - set(_NMS_OPTIONS))
    if unknown:
        raise TypeError(f"{op}: nms_cfg has unknown options {unknown}; known: type, "
                        f"class_agnostic, split_thr, {', '.join(_NMS_OPTIONS)}")
    return _detections(boxes, scores, None if class_agnostic else idxs, cfg["iou_threshold"],
                       cfg.get("offset", 0), cfg.get("score_threshold", 0),
                       cfg.get("max_num", -1))


def bbox_overlaps(bboxes1, bboxes2, mode="iou", aligned=False, offset=0):
    """mmcv.ops.bbox_overlaps: (N, M) ("iou" or "iof"), or (N,) when
    aligned. Not differentiable (as in MMCV)."""
    code = _choice("bbox_overlaps", "mode", mode, _OVERLAP_MODES)
    bboxes2 = like_dtype(bboxes2, bboxes1)
    return _OVERLAPS(bboxes1, bboxes2, code, bool(aligned), int(offset))


def _focal_loss(op, derived, input, target, gamma, alpha, weight, reduction):
    """A focal loss's derived op, reduced as MMCV reduces it ("mean": the
    sum over N, the rows)."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{op}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    target = target.to(torch.int64)
    if weight is not None:
        weight = like_dtype(weight, input)
    loss = derived(input, target, weight, float(gamma), float(alpha))
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / input.shape[0]
    return loss


def sigmoid_focal_loss(input, target, gamma=2.0, alpha=0.25, weight=None, reduction="mean"):
    """mmcv.ops.sigmoid_focal_loss: input (N, C) logits, target (N,) class
    indices in [0, C] (C: background), weight an optional (C,) per-class
    weight; "mean" is the sum over N (rows), as in MMCV. Differentiable with
    respect to input."""
    return _focal_loss("sigmoid_focal_loss", _FOCAL_LOSS, input, target, gamma, alpha, weight,
                       reduction)


def softmax_focal_loss(input, target, gamma=2.0, alpha=0.25, weight=None, reduction="mean"):
    """mmcv.ops.softmax_focal_loss: input (N, C) logits, target (N,) class
    indices in [0, C) (negative: the row is ignored), weight an optional
    (C,) per-class weight; the loss is per row, "mean" divides its sum by N,
    as in MMCV. Differentiable with respect to input."""
    return _focal_loss("softmax_focal_loss", _SOFTMAX_FOCAL_LOSS, input, target, gamma, alpha,
                       weight, reduction)


class RoIAlign(nn.Module):
    """mmcv.ops.RoIAlign (use_torchvision is accepted and ignored: these
    kernels serve both)."""

    def __init__(self, output_size, spatial_scale=1.0, sampling_ratio=0, pool_mode="avg",
                 aligned=True, use_torchvision=False):
        super().__init__()
        self.output_size = output_size
        self.spatial_scale = float(spatial_scale)
        self.sampling_ratio = int(sampling_ratio)
        self.pool_mode = pool_mode
        self.aligned = aligned
        self.use_torchvision = use_torchvision

    def forward(self, input, rois):
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio,
                         self.pool_mode, self.aligned)

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio}, "
                f"pool_mode={self.pool_mode}, aligned={self.aligned}, "
                f"use_torchvision={self.use_torchvision})")


class RoIPool(_vision.RoIPool):
    """mmcv.ops.RoIPool (torchvision's, with spatial_scale 1.0 by default)."""

    def __init__(self, output_size, spatial_scale=1.0):
        super().__init__(output_size, float(spatial_scale))


class SigmoidFocalLoss(nn.Module):
    """mmcv.ops.SigmoidFocalLoss."""
    loss = staticmethod(sigmoid_focal_loss)

    def __init__(self, gamma, alpha, weight=None, reduction="mean"):
        super().__init__()
        self.gamma = float(gamma)
        self.alpha = float(alpha)
        self.register_buffer("weight", weight)
        self.reduction = reduction

    def forward(self, input, target):
        return self.loss(input, target, self.gamma, self.alpha, self.weight, self.reduction)

    def __repr__(self):
        return (f"{self.__class__.__name__}(gamma={self.gamma}, alpha={self.alpha}, "
                f"reduction={self.reduction})")


class SoftmaxFocalLoss(SigmoidFocalLoss):
    """mmcv.ops.SoftmaxFocalLoss."""
    loss = staticmethod(softmax_focal_loss)



def _deform(op, input, offset, mask, weight, bias, stride, padding, dilation, groups,
            deform_groups):
    """The deformable convolution with MMCV's explicit groups and
    deform_groups, checked against the tensors' shapes."""
    implied = deform_groups_of(op, input, offset, weight)
    if (groups, deform_groups) != implied:
        raise ValueError(f"{op}: groups={groups}, deform_groups={deform_groups} do not match "
                         f"the shapes, which imply groups={implied[0]}, "
                         f"deform_groups={implied[1]} (weight (C_out, C_in // groups, "
                         f"kh, kw), offset (N, 2 * deform_groups * kh * kw, out_h, out_w))")
    return _DEFORM_CONV2D(input, offset, mask, weight, bias, *_int_pair(op, "stride", stride),
                          *_int_pair(op, "padding", padding),
                          *_int_pair(op, "dilation", dilation), groups, deform_groups)


def deform_conv2d(input, offset, weight, stride=1, padding=0, dilation=1, groups=1,
                  deform_groups=1, bias=False, im2col_step=32):
    """mmcv.ops.deform_conv2d (DCNv1): no bias (MMCV refuses one too);
    im2col_step is accepted and ignored (the kernels bound their own
    memory)."""
    if bias:
        raise ValueError("deform_conv2d: bias=True is not supported (as in MMCV); use "
                         "modulated_deform_conv2d or add the bias after")
    return _deform("deform_conv2d", input, offset, None, weight, None, stride, padding,
                   dilation, groups, deform_groups)


def modulated_deform_conv2d(input, offset, mask, weight, bias=None, stride=1, padding=0,
                            dilation=1, groups=1, deform_groups=1):
    """mmcv.ops.modulated_deform_conv2d (DCNv2)."""
    return _deform("modulated_deform_conv2d", input, offset, mask, weight, bias, stride,
                   padding, dilation, groups, deform_groups)


class DeformConv2d(_vision.DeformConv2d):
    """mmcv.ops.DeformConv2d: forward(x, offset), without bias by default."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, deform_groups=1, bias=False, im2col_step=32):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias)
        self.deform_groups = deform_groups
        self.im2col_step = im2col_step

    def forward(self, x, offset):
        return _deform("DeformConv2d", x, offset, None, self.weight, self.bias, self.stride,
                       self.padding, self.dilation, self.groups, self.deform_groups)


class ModulatedDeformConv2d(_vision.DeformConv2d):
    """mmcv.ops.ModulatedDeformConv2d: forward(x, offset, mask)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, deform_groups=1, bias=True):
        super().__init__(in_channels, out_channels, kernel_size, stride, padding, dilation,
                         groups, bias)
        self.deform_groups = deform_groups

    def forward(self, x, offset, mask):
        return _deform("ModulatedDeformConv2d", x, offset, mask, self.weight, self.bias,
                       self.stride, self.padding, self.dilation, self.groups,
                       self.deform_groups)
