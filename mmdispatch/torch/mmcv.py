"""mmcv.ops' functions and modules, with MMCV's names, signatures and
defaults, on mmdispatch's kernels: `from mmdispatch.torch.mmcv import
roi_align` in place of `from mmcv.ops import roi_align`. Rois are (K, 5)
tensors [batch index, x1, y1, x2, y2]."""
import functools
import math
import warnings

import numpy as np
import torch
from torch import nn

from mmdispatch.ops._arrays import choice as _choice
from mmdispatch.ops.bbox_overlaps import _MODES as _OVERLAP_MODES
from mmdispatch.ops.multi_scale_deformable_attn import _im2col_step
from mmdispatch.ops.roi_align import _POOL_MODES
from mmdispatch.ops.roi_pool import CONVENTIONS as _ROI_POOL_CONVENTIONS
from mmdispatch.ops.soft_nms import METHODS as _SOFT_NMS_METHODS
from mmdispatch.torch import _vision
from mmdispatch.torch._library import DERIVED
from mmdispatch.torch._vision import _nms, _pair
from mmdispatch.torch._vision import categories as _categories
from mmdispatch.torch._vision import deform_groups as _deform_groups_of
from mmdispatch.torch._vision import in_dtype_of as _in_dtype_of
from mmdispatch.torch._vision import like_dtype as _like_dtype
from mmdispatch.torch._vision import rois_of as _rois_of
from mmdispatch.torch._vision import with_coordinates as _with_coordinates

__all__ = ["DeformConv2d", "DeformConv2dPack", "ModulatedDeformConv2d",
           "ModulatedDeformConv2dPack", "MultiScaleDeformableAttention",
           "MultiScaleDeformableAttnFunction", "RoIAlign", "RoIAlignRotated", "RoIPool",
           "SigmoidFocalLoss", "SoftmaxFocalLoss", "batched_nms", "bbox_overlaps",
           "box_iou_rotated", "deform_conv2d", "modulated_deform_conv2d",
           "multi_scale_deformable_attn", "multi_scale_deformable_attn_pytorch", "nms",
           "nms_match", "nms_rotated", "roi_align", "roi_align_rotated", "roi_pool",
           "sigmoid_focal_loss", "soft_nms", "softmax_focal_loss"]

_ROI_ALIGN = DERIVED["roi_align_forward_impl"]
_ROI_POOL = DERIVED["roi_pool_forward_impl"]
_OVERLAPS = DERIVED["bbox_overlaps_impl"]
_FOCAL_LOSS = DERIVED["sigmoid_focal_loss_forward_impl"]
_SOFTMAX_FOCAL_LOSS = DERIVED["softmax_focal_loss_forward_impl"]
_DEFORM_CONV2D = DERIVED["deform_conv2d_forward_impl"]
_MSDA = DERIVED["multi_scale_deformable_attn_forward_impl"]
_BOX_IOU_ROTATED = DERIVED["box_iou_rotated_impl"]
_NMS_ROTATED = DERIVED["nms_rotated_impl"]
_ROI_ALIGN_ROTATED = DERIVED["roi_align_rotated_forward_impl"]
_SOFT_NMS = DERIVED["soft_nms_impl"]


def _renamed(**old_to_new):
    """MMCV's deprecated_api_warning: keyword arguments under their old
    names still work, with a DeprecationWarning."""
    def wrap(fn):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            for old, new in old_to_new.items():
                if old in kwargs:
                    if new in kwargs:
                        raise TypeError(f"{fn.__qualname__}: got both {old!r} and its new name "
                                        f"{new!r}")
                    warnings.warn(f"{fn.__qualname__}: {old!r} is deprecated, use {new!r}",
                                  DeprecationWarning, stacklevel=2)
                    kwargs[new] = kwargs.pop(old)
            return fn(*args, **kwargs)
        return call
    return wrap


def _float32_threshold(iou_threshold):
    """MMCV's kernels take the threshold as a C float: an IoU equal to 0.3
    is compared with 0.3 rounded to float32 (0.30000001...), not with the
    double 0.3 that torchvision compares with."""
    return float(np.float32(iou_threshold))


def _from_numpy(*arrays):
    """mmcv.ops' nms functions take numpy arrays too: (tensors, whether the
    first was numpy)."""
    return ([torch.from_numpy(a) if isinstance(a, np.ndarray) else a for a in arrays],
            isinstance(arrays[0], np.ndarray))


def _to_numpy(is_numpy, *tensors):
    return tuple(t.cpu().numpy() for t in tensors) if is_numpy else tensors


def roi_align(input, rois, output_size, spatial_scale=1.0, sampling_ratio=0, pool_mode="avg",
              aligned=True):
    """mmcv.ops.roi_align: (K, C, *output_size); pool_mode "avg" or "max";
    differentiable with respect to input in both modes."""
    h, w = _pair("roi_align", output_size)
    mode = _choice("roi_align", "pool_mode", pool_mode, _POOL_MODES)
    features, rois = _with_coordinates(input, _rois_of("roi_align", rois, input))
    return _in_dtype_of(_ROI_ALIGN(features, rois, h, w, float(spatial_scale),
                                   int(sampling_ratio), mode, bool(aligned))[0], input)


def roi_pool(input, rois, output_size, spatial_scale=1.0):
    """mmcv.ops.roi_pool: (K, C, *output_size), with MMCV's bins (convention
    "mmcv" of mmdispatch.ops.roi_pool: the roi spans x1 * spatial_scale to
    (x2 + 1) * spatial_scale, not rounded; a roi of no width gives zeros).
    torchvision's roi_pool, which rounds the corners, differs wherever a
    scaled corner is not a whole number. Differentiable with respect to
    input."""
    h, w = _pair("roi_pool", output_size)
    features, rois = _with_coordinates(input, _rois_of("roi_pool", rois, input))
    return _in_dtype_of(_ROI_POOL(features, rois, h, w, float(spatial_scale),
                                  _ROI_POOL_CONVENTIONS["mmcv"])[0], input)


def _detections(boxes, scores, idxs, iou_threshold, offset, score_threshold, max_num):
    """(dets, inds) of nms within each class of idxs (None: one class)."""
    inds = torch.arange(boxes.shape[0], device=boxes.device)
    if score_threshold > 0:
        valid = scores > score_threshold
        boxes, scores, inds = boxes[valid], scores[valid], inds[valid]
        idxs = None if idxs is None else idxs[valid]
    keep = _nms(boxes, scores, None if idxs is None else _categories(idxs),
                _float32_threshold(iou_threshold), offset)
    if max_num > 0:
        keep = keep[:max_num]
    dets = torch.cat([boxes[keep], scores[keep].reshape(-1, 1)], dim=1)
    return dets, inds[keep]


@_renamed(iou_thr="iou_threshold")
def nms(boxes, scores, iou_threshold, offset=0, score_threshold=0, max_num=-1):
    """mmcv.ops.nms: returns (dets, inds), dets (k, 5) the kept boxes with
    their scores, inds their indices into `boxes`, by decreasing score
    (numpy arrays in, numpy arrays out). Boxes with scores <=
    score_threshold (when it is > 0) are left out first; max_num > 0 keeps
    at most that many. As in MMCV's kernels, a box is suppressed when its
    IoU exceeds iou_threshold rounded to float32."""
    (boxes, scores), is_numpy = _from_numpy(boxes, scores)
    return _to_numpy(is_numpy, *_detections(boxes, scores, None, iou_threshold, offset,
                                             score_threshold, max_num))


def _soft_detections(op, boxes, scores, idxs, iou_threshold, sigma, min_score, method, offset):
    code = _choice(op, "method", method, _SOFT_NMS_METHODS)
    return _SOFT_NMS(boxes, _like_dtype(scores, boxes), idxs, _float32_threshold(iou_threshold),
                     float(sigma), float(min_score), code, int(offset))


@_renamed(iou_thr="iou_threshold")
def soft_nms(boxes, scores, iou_threshold=0.3, sigma=0.5, min_score=1e-3, method="linear",
             offset=0):
    """mmcv.ops.soft_nms, on CPU and CUDA (MMCV's kernel is CPU-only):
    returns (dets, inds), dets (k, 5) the kept boxes with their decayed
    scores, inds their indices, in selection order (by non-increasing score
    when the scores are >= 0); numpy arrays in, numpy arrays out.
    method "naive", "linear" or "gaussian"; mmdispatch.ops.soft_nms has the
    exact definition. Boxes of equal scores are taken in index order (MMCV's
    swaps take them in another)."""
    (boxes, scores), is_numpy = _from_numpy(boxes, scores)
    return _to_numpy(is_numpy, *_soft_detections("soft_nms", boxes, scores, None,
                                                  iou_threshold, sigma, min_score, method,
                                                  offset))


def nms_match(dets, iou_threshold):
    """mmcv.ops.nms_match: dets (N, 5) boxes with scores. Greedy nms in
    score order (ties in index order) that records what each kept box
    suppresses: a box is suppressed when its IoU with the kept box is >=
    iou_threshold (float32). Returns one group per kept box, its indices in
    score order, the kept box first; int64 tensors, or numpy arrays for a
    numpy dets. Computed where dets are, with an N x N IoU table (MMCV's
    kernel runs on the CPU in O(N) memory)."""
    is_numpy = isinstance(dets, np.ndarray)
    t = torch.from_numpy(dets) if is_numpy else dets.detach()
    if t.shape[0] == 0:
        return []
    if t.dim() != 2 or t.shape[1] != 5:
        raise ValueError(f"nms_match: dets must have shape (N, 5), got {tuple(t.shape)}")
    order = t[:, 4].sort(descending=True, stable=True)[1]
    boxes = t[order, :4].contiguous()
    ious = _OVERLAPS(boxes, boxes, 0, False, 0)
    # two boxes of no area: MMCV's 0 / 0 is NaN, which suppresses nothing
    empty = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]) == 0
    hit = (ious >= _float32_threshold(iou_threshold)) & ~(empty[:, None] & empty[None, :])
    free = torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
    groups = []
    for i in range(t.shape[0]):
        if not free[i]:
            continue
        members = hit[i] & free
        members[: i + 1] = False
        free &= ~members
        free[i] = False
        groups.append(order[torch.cat([torch.tensor([i], device=t.device),
                                       members.nonzero().flatten()])])
    return [g.cpu().numpy() for g in groups] if is_numpy else [g.to(t.device) for g in groups]


_NMS_OPTIONS = ("iou_threshold", "offset", "score_threshold", "max_num")
_SOFT_NMS_OPTIONS = ("iou_threshold", "sigma", "min_score", "method", "offset", "max_num")


def batched_nms(boxes, scores, idxs, nms_cfg, class_agnostic=False):
    """mmcv.ops.batched_nms: nms within each class of idxs, configured by
    nms_cfg (a dict: type "nms" (the default) with iou_threshold and
    optionally offset, score_threshold, max_num; or type "soft_nms" with
    optionally iou_threshold, sigma, min_score, method, offset, max_num;
    and split_thr, class_agnostic). Returns (dets, keep) by decreasing
    score, dets (k, 5) the kept boxes with their scores (decayed, for
    soft_nms). nms_cfg None sorts every box by score, without nms. The
    kernels keep classes apart themselves, so split_thr (MMCV's switch from
    the coordinate offset trick to a loop over classes) changes nothing,
    except in one corner of soft_nms: min_score spares only the first box
    selected overall, as MMCV's offset trick does, not the first of each
    class, as its loop does."""
    op = "batched_nms"
    if nms_cfg is None:
        scores, inds = scores.sort(descending=True, stable=True)
        return torch.cat([boxes[inds], scores[:, None].to(boxes.dtype)], dim=-1), inds
    cfg = dict(nms_cfg)
    class_agnostic = cfg.pop("class_agnostic", class_agnostic)
    nms_type = cfg.pop("type", "nms")
    nms_type = _NMS_BY_FUNCTION.get(nms_type, nms_type) if callable(nms_type) else nms_type
    if "iou_thr" in cfg:
        warnings.warn(f"{op}: nms_cfg's 'iou_thr' is deprecated, use 'iou_threshold'",
                      DeprecationWarning, stacklevel=2)
        cfg.setdefault("iou_threshold", cfg.pop("iou_thr"))
    cfg.pop("split_thr", None)
    if callable(nms_type):
        return _batched_by_offsets(nms_type, boxes, scores, idxs, cfg, class_agnostic)
    if nms_type not in ("nms", "soft_nms", "nms_rotated"):
        raise ValueError(f"{op}: nms_cfg type must be 'nms', 'soft_nms', 'nms_rotated' or a "
                         f"function, got {nms_type!r}")
    if nms_type in ("nms", "nms_rotated") and "iou_threshold" not in cfg:
        raise ValueError(f"{op}: nms_cfg must give iou_threshold, got {nms_cfg!r}")
    if nms_type == "nms_rotated":
        if boxes.shape[0] == 0:
            return boxes.new_zeros((0, 6)), torch.zeros(0, dtype=torch.int64,
                                                        device=boxes.device)
        labels = None if class_agnostic else idxs
        dets, keep = nms_rotated(boxes, scores, cfg.pop("iou_threshold"), labels, **cfg)
        return torch.cat([boxes[keep], dets[:, -1:].to(boxes.dtype)], dim=-1), keep
    options = _NMS_OPTIONS if nms_type == "nms" else _SOFT_NMS_OPTIONS
    unknown = sorted(set(cfg) - set(options))
    if unknown:
        raise TypeError(f"{op}: nms_cfg has unknown options {unknown} for type {nms_type!r}; "
                        f"known: type, class_agnostic, split_thr, {', '.join(options)}")
    if nms_type == "soft_nms":
        dets, keep = _soft_detections(
            op, boxes, scores, None if class_agnostic else _categories(idxs),
            cfg.get("iou_threshold", 0.3), cfg.get("sigma", 0.5), cfg.get("min_score", 1e-3),
            cfg.get("method", "linear"), cfg.get("offset", 0))
        max_num = cfg.get("max_num", -1)
        return (dets[:max_num], keep[:max_num]) if max_num > 0 else (dets, keep)
    return _detections(boxes, scores, None if class_agnostic else idxs, cfg["iou_threshold"],
                       cfg.get("offset", 0), cfg.get("score_threshold", 0),
                       cfg.get("max_num", -1))


def _batched_by_offsets(fn, boxes, scores, idxs, cfg, class_agnostic):
    """batched_nms with a function of its own as nms_cfg's type, as MMCV
    runs one: on boxes moved apart by class (x1, y1, x2, y2 each plus idx *
    (the largest coordinate + 1); the centre for (N, 5) rotated boxes), it
    returns (dets, keep) and dets' last column is the kept scores."""
    if class_agnostic:
        moved = boxes
    elif boxes.shape[-1] == 5:
        largest = boxes[:, :2].max() + boxes[:, 2:4].max()
        shift = idxs.to(boxes) * (largest + 1)
        moved = torch.cat([boxes[:, :2] + shift[:, None], boxes[:, 2:5]], dim=-1)
    else:
        shift = idxs.to(boxes) * (boxes.max() + torch.tensor(1).to(boxes))
        moved = boxes + shift[:, None]
    dets, keep = fn(moved, scores, **cfg)
    return torch.cat([boxes[keep], dets[:, -1:].to(boxes.dtype)], dim=-1), keep


def bbox_overlaps(bboxes1, bboxes2, mode="iou", aligned=False, offset=0):
    """mmcv.ops.bbox_overlaps: (N, M) ("iou" or "iof"), or (N,) when
    aligned. Not differentiable (as in MMCV). Either set may be empty in
    any shape with no rows (a (0,) tensor too): the result is then (rows,
    cols), or (rows, 1) when aligned, as MMCV's. A pair whose union has no
    area is 0 (MMCV's CPU division gives NaN)."""
    code = _choice("bbox_overlaps", "mode", mode, _OVERLAP_MODES)
    rows, cols = bboxes1.shape[0], bboxes2.shape[0]
    if aligned and rows != cols:   # MMCV asserts it before its empty case too
        raise ValueError(f"bbox_overlaps: aligned=True needs as many bboxes1 as bboxes2, got "
                         f"{rows} and {cols}")
    if rows * cols == 0:   # as MMCV: (rows, 1) when aligned
        return bboxes1.new_zeros((rows, 1) if aligned else (rows, cols))
    bboxes2 = _like_dtype(bboxes2, bboxes1)
    return _OVERLAPS(bboxes1, bboxes2, code, bool(aligned), int(offset))


def box_iou_rotated(bboxes1, bboxes2, mode="iou", aligned=False, clockwise=True):
    """mmcv.ops.box_iou_rotated: boxes (cx, cy, w, h, angle in radians),
    (N, M) or (N,) when aligned; the intersection is the clipped polygon,
    in double.
    Not differentiable (as in MMCV)."""
    op = "box_iou_rotated"
    code = _choice(op, "mode", mode, _OVERLAP_MODES)
    return _BOX_IOU_ROTATED(bboxes1, _like_dtype(bboxes2, bboxes1), code, bool(aligned),
                            bool(clockwise))


def nms_rotated(dets, scores, iou_threshold, labels=None, clockwise=True):
    """mmcv.ops.nms_rotated: dets (N, 5) rotated boxes (cx, cy, w, h,
    angle), scores (N,), labels (N,) or None (nms within each label).
    Returns (dets (k, 6): the kept boxes with their scores, keep_inds) by
    decreasing score, or (dets, None) for no boxes, as MMCV; the IoU is
    box_iou_rotated's, exactly. A box is suppressed when its IoU exceeds the
    threshold rounded to float32, as MMCV's CUDA kernel has it (its CPU
    kernel suppresses at equality too). With labels, boxes of different
    labels never suppress each other (MMCV's CPU and CUDA kernels ignore
    labels, so its own test expects a box of another class suppressed). A
    NaN score ranks first, as MMCV's sort puts it (_vision.nan_first)."""
    if dets.shape[0] == 0:
        return dets, None
    scores = _like_dtype(scores, dets)
    keep = _NMS_ROTATED(dets, _vision.nan_first(scores),
                        None if labels is None else _categories(labels),
                        _float32_threshold(iou_threshold), bool(clockwise))
    return torch.cat([dets[keep], scores[keep].reshape(-1, 1)], dim=1), keep


# batched_nms's nms_cfg type given as one of these functions: their own path
_NMS_BY_FUNCTION = {nms: "nms", soft_nms: "soft_nms", nms_rotated: "nms_rotated"}


def roi_align_rotated(input, rois, output_size, spatial_scale, sampling_ratio=0,
                      aligned=True, clockwise=False):
    """mmcv.ops.roi_align_rotated: rois (K, 6) [batch index, cx, cy, w, h,
    angle]; (K, C, *output_size); differentiable with respect to input."""
    h, w = _pair("roi_align_rotated", output_size)
    features, rois = _with_coordinates(input, rois)
    return _in_dtype_of(_ROI_ALIGN_ROTATED(features, rois, h, w, float(spatial_scale),
                                           int(sampling_ratio), bool(aligned), bool(clockwise)),
                        input)


class RoIAlignRotated(nn.Module):
    """mmcv.ops.RoIAlignRotated."""

    @_renamed(out_size="output_size", sample_num="sampling_ratio")
    def __init__(self, output_size, spatial_scale, sampling_ratio=0, aligned=True,
                 clockwise=False):
        super().__init__()
        self.output_size = _pair("RoIAlignRotated", output_size)
        self.spatial_scale = float(spatial_scale)
        self.sampling_ratio = int(sampling_ratio)
        self.aligned = aligned
        self.clockwise = clockwise

    def forward(self, input, rois):
        return roi_align_rotated(input, rois, self.output_size, self.spatial_scale,
                                 self.sampling_ratio, self.aligned, self.clockwise)

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio}, "
                f"aligned={self.aligned}, clockwise={self.clockwise})")


def _focal_loss(op, derived, input, target, gamma, alpha, weight, reduction):
    """A focal loss's derived op, reduced as MMCV reduces it ("mean": the
    sum over N, the rows)."""
    if reduction not in ("none", "mean", "sum"):
        raise ValueError(f"{op}: reduction must be 'none', 'mean' or 'sum', got {reduction!r}")
    if target.is_floating_point() or target.is_complex():   # MMCV asserts torch.long
        raise TypeError(f"{op}: target must hold class indices (an integer dtype), got "
                        f"{target.dtype}")
    target = target.to(torch.int64)
    if weight is not None:
        weight = _like_dtype(weight, input)
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
    """mmcv.ops.RoIAlign. use_torchvision=True runs the avg pooling whatever
    pool_mode says, as MMCV does (it calls torchvision's roi_align, which
    has no max mode); these kernels serve both."""

    @_renamed(out_size="output_size", sample_num="sampling_ratio")
    def __init__(self, output_size, spatial_scale=1.0, sampling_ratio=0, pool_mode="avg",
                 aligned=True, use_torchvision=False):
        super().__init__()
        self.output_size = _pair("RoIAlign", output_size)
        self.spatial_scale = float(spatial_scale)
        self.sampling_ratio = int(sampling_ratio)
        self.pool_mode = pool_mode
        self.aligned = aligned
        self.use_torchvision = use_torchvision

    def forward(self, input, rois):
        mode = "avg" if self.use_torchvision else self.pool_mode
        return roi_align(input, rois, self.output_size, self.spatial_scale, self.sampling_ratio,
                         mode, self.aligned)

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale}, sampling_ratio={self.sampling_ratio}, "
                f"pool_mode={self.pool_mode}, aligned={self.aligned}, "
                f"use_torchvision={self.use_torchvision})")


class RoIPool(nn.Module):
    """mmcv.ops.RoIPool: roi_pool above, with MMCV's bins."""

    def __init__(self, output_size, spatial_scale=1.0):
        super().__init__()
        self.output_size = _pair("RoIPool", output_size)
        self.spatial_scale = float(spatial_scale)

    def forward(self, input, rois):
        return roi_pool(input, rois, self.output_size, self.spatial_scale)

    def __repr__(self):
        return (f"{self.__class__.__name__}(output_size={self.output_size}, "
                f"spatial_scale={self.spatial_scale})")


class SigmoidFocalLoss(nn.Module):
    """mmcv.ops.SigmoidFocalLoss."""
    loss = staticmethod(sigmoid_focal_loss)

    def __init__(self, gamma, alpha, weight=None, reduction="mean"):
        super().__init__()
        self.gamma = gamma   # as given, as MMCV keeps them (its repr shows them so)
        self.alpha = alpha
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
    deform_groups, checked against the tensors' shapes. As MMCV, input,
    mask, weight and bias are cast to the offset's dtype (under autocast the
    offset comes from a float16 convolution)."""
    input = input.to(offset.dtype)
    weight = weight.to(offset.dtype)
    mask = None if mask is None else mask.to(offset.dtype)
    bias = None if bias is None else bias.to(offset.dtype)
    implied = _deform_groups_of(op, input, offset, weight)
    if (groups, deform_groups) != implied:
        raise ValueError(f"{op}: groups={groups}, deform_groups={deform_groups} do not match "
                         f"the shapes, which imply groups={implied[0]}, "
                         f"deform_groups={implied[1]} (weight (C_out, C_in // groups, "
                         f"kh, kw), offset (N, 2 * deform_groups * kh * kw, out_h, out_w))")
    return _DEFORM_CONV2D(input, offset, mask, weight, bias, *_pair(op, stride, "stride"),
                          *_pair(op, padding, "padding"),
                          *_pair(op, dilation, "dilation"), groups, deform_groups)


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


class _DeformBase(nn.Module):
    """What MMCV's two deformable convolution modules share: the geometry
    and a weight (C_out, C_in // groups, kh, kw); a bias parameter, None
    (bias False), or no `bias` attribute at all (bias None: DeformConv2d,
    as MMCV's)."""

    def __init__(self, op, in_channels, out_channels, kernel_size, stride, padding, dilation,
                 groups, deform_groups, bias):
        super().__init__()
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"{op}: groups ({groups}) must divide in_channels "
                             f"({in_channels}) and out_channels ({out_channels})")
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size = _pair(op, kernel_size, "kernel_size")
        self.stride = _pair(op, stride, "stride")
        self.padding = _pair(op, padding, "padding")
        self.dilation = _pair(op, dilation, "dilation")
        self.groups, self.deform_groups = groups, deform_groups
        self.transposed, self.output_padding = False, (0,)   # nn.Conv2d's attributes
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels // groups,
                                               *self.kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        elif bias is not None:
            self.register_parameter("bias", None)

    def _offset_conv(self, per_tap):
        """The Pack classes' offset convolution (torch's initialisation: the
        Packs zero it, as MMCV's, after the same random draws)."""
        return nn.Conv2d(self.in_channels, self.deform_groups * per_tap * self.kernel_size[0] *
                         self.kernel_size[1], self.kernel_size, self.stride, self.padding,
                         self.dilation, bias=True)

    def __repr__(self):
        return (f"{self.__class__.__name__}(in_channels={self.in_channels},\n"
                f"out_channels={self.out_channels},\nkernel_size={self.kernel_size},\n"
                f"stride={self.stride},\npadding={self.padding},\n"
                f"dilation={self.dilation},\ngroups={self.groups},\n"
                f"deform_groups={self.deform_groups},\n"
                f"bias={getattr(self, 'bias', None) is not None})")


class DeformConv2d(_DeformBase):
    """mmcv.ops.DeformConv2d (DCNv1): forward(x, offset); no bias (bias=True
    is refused, as in MMCV); MMCV's initialisation (kaiming uniform for
    ReLU). An input smaller than the kernel is padded with zeros at the
    bottom and right and the output cut back, as MMCV does."""

    @_renamed(deformable_groups="deform_groups")
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, deform_groups=1, bias=False, im2col_step=32):
        if bias:
            raise ValueError(f"DeformConv2d: bias={bias} is not supported (as in MMCV)")
        super().__init__("DeformConv2d", in_channels, out_channels, kernel_size, stride,
                         padding, dilation, groups, deform_groups, None)
        self.im2col_step = im2col_step
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.weight, nonlinearity="relu")

    def forward(self, x, offset):
        pad_h = max(self.kernel_size[0] - x.shape[2], 0)
        pad_w = max(self.kernel_size[1] - x.shape[3], 0)
        if pad_h or pad_w:
            x = nn.functional.pad(x, (0, pad_w, 0, pad_h))
            offset = nn.functional.pad(offset, (0, pad_w, 0, pad_h))
        out = _deform("DeformConv2d", x, offset, None, self.weight, None, self.stride,
                      self.padding, self.dilation, self.groups, self.deform_groups)
        return out[:, :, :out.shape[2] - pad_h, :out.shape[3] - pad_w] if pad_h or pad_w else out


class _OffsetPack(nn.Module):
    """What the Pack classes share: a checkpoint from before their version 2
    (MMCV's) names the offset convolution `<name>_offset`; it loads as
    conv_offset."""
    _version = 2

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        version = local_metadata.get("version", None)
        if version is None or version < 2:
            for kind in ("weight", "bias"):
                new, old = f"{prefix}conv_offset.{kind}", f"{prefix[:-1]}_offset.{kind}"
                if new not in state_dict and old in state_dict:
                    state_dict[new] = state_dict.pop(old)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)


class DeformConv2dPack(_OffsetPack, DeformConv2d):
    """mmcv.ops.DeformConv2dPack (MMCV's "DCN"): forward(x), the offsets from
    conv_offset, a convolution of x that starts at zero."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conv_offset = self._offset_conv(2)
        self.init_offset()

    def init_offset(self):
        """Zeroes conv_offset (the offsets start at 0), as MMCV's."""
        nn.init.zeros_(self.conv_offset.weight)
        nn.init.zeros_(self.conv_offset.bias)

    def forward(self, x):
        return super().forward(x, self.conv_offset(x))


class ModulatedDeformConv2d(_DeformBase):
    """mmcv.ops.ModulatedDeformConv2d (DCNv2): forward(x, offset, mask);
    MMCV's initialisation (weight uniform in +-1 / sqrt(in_channels * kh *
    kw), bias zero)."""

    @_renamed(deformable_groups="deform_groups")
    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1,
                 groups=1, deform_groups=1, bias=True):
        super().__init__("ModulatedDeformConv2d", in_channels, out_channels, kernel_size,
                         stride, padding, dilation, groups, deform_groups, bias)
        self.init_weights()

    def init_weights(self):
        bound = 1.0 / math.sqrt(self.in_channels * self.kernel_size[0] * self.kernel_size[1])
        nn.init.uniform_(self.weight, -bound, bound)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x, offset, mask):
        return _deform("ModulatedDeformConv2d", x, offset, mask, self.weight, self.bias,
                       self.stride, self.padding, self.dilation, self.groups,
                       self.deform_groups)


class ModulatedDeformConv2dPack(_OffsetPack, ModulatedDeformConv2d):
    """mmcv.ops.ModulatedDeformConv2dPack (MMCV's "DCNv2"): forward(x);
    conv_offset (zero at the start) gives both offset halves and the mask,
    which goes through a sigmoid."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.conv_offset = self._offset_conv(3)
        self.init_weights()   # again, as MMCV's: its seeded weights are MMCV's

    def init_weights(self):
        super().init_weights()
        if hasattr(self, "conv_offset"):   # zero again, as MMCV's
            nn.init.zeros_(self.conv_offset.weight)
            nn.init.zeros_(self.conv_offset.bias)

    def forward(self, x):
        o1, o2, mask = torch.chunk(self.conv_offset(x), 3, dim=1)
        return super().forward(x, torch.cat((o1, o2), dim=1), torch.sigmoid(mask))


def multi_scale_deformable_attn(value, value_spatial_shapes, value_level_start_index,
                                sampling_locations, attention_weights, im2col_step=64):
    """MMCV's MultiScaleDeformableAttnFunction.apply as a function: value
    (N, S, M, D), value_spatial_shapes (L, 2), value_level_start_index
    (L,), sampling_locations (N, Q, M, L, P, 2) in [0, 1], attention_weights
    (N, Q, M, L, P); returns (N, Q, M * D). Differentiable with respect to
    value, sampling_locations and attention_weights, on the CPU as on CUDA.
    im2col_step is checked and changes nothing (the kernels take the whole
    batch); the level tensors move to value's device if they are elsewhere."""
    _im2col_step("multi_scale_deformable_attn", im2col_step)
    if value_level_start_index is None:   # as MMCV's CPU path, which never reads it
        value_level_start_index = _level_starts(value_spatial_shapes, value.device)
    levels = (t.to(device=value.device, dtype=torch.int64)
              for t in (value_spatial_shapes, value_level_start_index))
    features, locations = _with_coordinates(value, sampling_locations)
    return _in_dtype_of(_MSDA(features, *levels, locations,
                              _like_dtype(attention_weights, features)), value)


class MultiScaleDeformableAttnFunction:
    """mmcv.ops.MultiScaleDeformableAttnFunction: `apply` is
    multi_scale_deformable_attn (the op itself carries the autograd)."""
    apply = staticmethod(multi_scale_deformable_attn)


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights):
    """mmcv.ops.multi_scale_deformable_attn_pytorch (MMCV's grid_sample
    fallback, which takes no level_start_index) on the same kernels."""
    # a list of (H, W) pairs too, which MMCV's loop over the shapes takes
    value_spatial_shapes = torch.as_tensor(value_spatial_shapes, dtype=torch.int64,
                                           device=value.device)
    return multi_scale_deformable_attn(value, value_spatial_shapes,
                                       _level_starts(value_spatial_shapes, value.device),
                                       sampling_locations, attention_weights)


def _level_starts(spatial_shapes, device):
    """Each level's first row of value, from the levels' (H, W)."""
    sizes = torch.as_tensor(spatial_shapes, dtype=torch.int64, device=device).prod(1)
    return torch.cat([sizes.new_zeros(1), sizes.cumsum(0)[:-1]])


class MultiScaleDeformableAttention(nn.Module):
    """mmcv.ops.MultiScaleDeformableAttention (Deformable DETR's attention
    module), with MMCV's arguments, parameter names (so its checkpoints
    load), initialisation and forward. norm_cfg and init_cfg are accepted
    for the signature's sake: MMCV uses neither in this module's
    computation."""

    def __init__(self, embed_dims=256, num_heads=8, num_levels=4, num_points=4, im2col_step=64,
                 dropout=0.1, batch_first=False, norm_cfg=None, init_cfg=None,
                 value_proj_ratio=1.0):
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f"MultiScaleDeformableAttention: embed_dims must be divisible by "
                             f"num_heads, got {embed_dims} and {num_heads}")
        per_head = embed_dims // num_heads
        if per_head & (per_head - 1) or per_head == 0:
            warnings.warn("MultiScaleDeformableAttention: embed_dims // num_heads is not a "
                          "power of 2 (MMCV warns that its CUDA kernel is slower then)")
        _im2col_step("MultiScaleDeformableAttention", im2col_step)
        self.norm_cfg, self.init_cfg = norm_cfg, init_cfg
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        self.im2col_step = im2col_step
        self.embed_dims, self.num_heads = embed_dims, num_heads
        self.num_levels, self.num_points = num_levels, num_points
        samples = num_heads * num_levels * num_points
        self.sampling_offsets = nn.Linear(embed_dims, samples * 2)
        self.attention_weights = nn.Linear(embed_dims, samples)
        value_proj_size = int(embed_dims * value_proj_ratio)
        self.value_proj = nn.Linear(embed_dims, value_proj_size)
        self.output_proj = nn.Linear(value_proj_size, embed_dims)
        self.init_weights()

    def init_weights(self):
        """MMCV's: offsets start on a ring of directions, one per head,
        each point further out; uniform attention; xavier projections."""
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        angles = torch.arange(self.num_heads, dtype=torch.float32) * (2 * math.pi /
                                                                        self.num_heads)
        grid = torch.stack([angles.cos(), angles.sin()], -1)
        grid = (grid / grid.abs().max(-1, keepdim=True)[0]).view(self.num_heads, 1, 1, 2)
        grid = grid.repeat(1, self.num_levels, self.num_points, 1)
        grid = grid * torch.arange(1, self.num_points + 1, dtype=torch.float32).view(1, 1, -1, 1)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(grid.reshape(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        for layer in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight)
            nn.init.constant_(layer.bias, 0.0)

    @_renamed(residual="identity")
    def forward(self, query, key=None, value=None, identity=None, query_pos=None,
                key_padding_mask=None, reference_points=None, spatial_shapes=None,
                level_start_index=None, **kwargs):
        """query (Q, N, C), or (N, Q, C) with batch_first; value likewise
        with S keys (None: the query); reference_points (N, Q, L, 2) as (x,
        y) in [0, 1], or (N, Q, L, 4) boxes (cx, cy, w, h); returns the
        query's shape: identity (None: the query) + the attention's output."""
        op = "MultiScaleDeformableAttention"
        value = query if value is None else value
        identity = query if identity is None else identity
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
        n, num_query, _ = query.shape
        num_value = value.shape[1]
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(n, num_value, self.num_heads, -1)
        sample_shape = (n, num_query, self.num_heads, self.num_levels, self.num_points)
        offsets = self.sampling_offsets(query).view(*sample_shape, 2)
        weights = self.attention_weights(query).view(n, num_query, self.num_heads, -1)
        weights = weights.softmax(-1).view(sample_shape)
        if (reference_points is None or reference_points.dim() != 4
                or reference_points.shape[-1] not in (2, 4)):
            got = None if reference_points is None else tuple(reference_points.shape)
            raise ValueError(f"{op}: reference_points must be (N, Q, L, 2) or (N, Q, L, 4), got "
                             f"{got}")
        if reference_points.shape[-1] == 2:
            normaliser = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
            locations = (reference_points[:, :, None, :, None, :] +
                         offsets / normaliser[None, None, None, :, None, :])
        else:
            locations = (reference_points[:, :, None, :, None, :2] + offsets / self.num_points *
                         reference_points[:, :, None, :, None, 2:] * 0.5)
        output = multi_scale_deformable_attn(value, spatial_shapes, level_start_index, locations,
                                             weights, self.im2col_step)
        output = self.output_proj(output)
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity
