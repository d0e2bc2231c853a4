"""mmdispatch.torch.mmcv: MMCV's names, signatures and defaults, with MMCV's
published values, gradients through autograd, and the numpy path's results."""
import math
import re
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")

import mmdispatch  # noqa: E402
from mmdispatch.torch import mmcv  # noqa: E402
from torch_models import needs_data_dependent_tracing  # noqa: E402

ROIS = torch.tensor([[0, 0.5, 0.5, 5, 6], [1, 1, 1, 6, 5], [0, 2.2, 1, 7, 7.5]],
                    dtype=torch.float64)


def feature_map(dtype=torch.float64):
    return torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(0), dtype=dtype)


@pytest.mark.parametrize("pool_mode", ["avg", "max"])
@pytest.mark.parametrize("aligned", [True, False])
def test_roi_align_defaults_values_and_gradients(pool_mode, aligned):
    x = feature_map().requires_grad_(True)
    out = mmcv.roi_align(x, ROIS, 2, 1.0, 0, pool_mode, aligned)
    expected = mmdispatch.ops.roi_align(x.detach().numpy(), ROIS.numpy(), 2, 1.0, 0, pool_mode,
                                        aligned)
    np.testing.assert_array_equal(out.detach().numpy(), expected)
    assert torch.autograd.gradcheck(
        lambda x: mmcv.roi_align(x, ROIS, (2, 3), 1.0, 2, pool_mode, aligned), (x,))
    torch.testing.assert_close(mmcv.roi_align(x, ROIS, 2),   # MMCV's defaults: sr 0, aligned
                               mmcv.roi_align(x, ROIS, 2, 1.0, 0, "avg", True))


def test_mmcv_published_values():
    # MMCV's tests: sigmoid focal loss of [[1, 0], [0, 1]] with targets [0, 1]
    loss = mmcv.sigmoid_focal_loss(torch.tensor([[1.0, 0], [0, 1]]), torch.tensor([0, 1]))
    np.testing.assert_allclose(float(loss), 0.13562961, rtol=1e-6)
    # roi_align on the 4x4 map of MMCV's tests
    x = torch.tensor([[[[1.0, 2, 5, 6], [3, 4, 7, 8], [9, 10, 13, 14], [11, 12, 15, 16]]]])
    out = mmcv.roi_align(x, torch.tensor([[0.0, 0, 0, 3, 3]]), 2, 1.0, 2)
    np.testing.assert_allclose(out[0, 0].numpy(), [[1.9375, 4.75], [7.5625, 10.375]])


def test_sigmoid_focal_loss_gradcheck_weights_and_reductions():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 4, generator=g, dtype=torch.float64).requires_grad_(True)
    target = torch.tensor([0, 4, 2, 1, 3, 4])
    weight = torch.rand(4, generator=g, dtype=torch.float64)
    for reduction in ("none", "sum", "mean"):
        assert torch.autograd.gradcheck(
            lambda x: mmcv.sigmoid_focal_loss(x, target, 2.0, 0.25, weight, reduction), (logits,))
    strided = torch.randn(6, 8, generator=g, dtype=torch.float64).requires_grad_(True)
    assert torch.autograd.gradcheck(
        lambda x: mmcv.sigmoid_focal_loss(x[:, ::2], target, 1.5, 0.5, None, "sum"), (strided,))
    none = mmcv.sigmoid_focal_loss(logits, target, reduction="none")
    torch.testing.assert_close(mmcv.sigmoid_focal_loss(logits, target), none.sum() / 6)
    module = mmcv.SigmoidFocalLoss(2.0, 0.25, weight)
    torch.testing.assert_close(module(logits, target),
                               mmcv.sigmoid_focal_loss(logits, target, 2.0, 0.25, weight))


def test_nms_returns_detections_and_indices_with_mmcvs_options():
    boxes = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 2.1], [5, 5, 6, 6], [5, 5, 6.2, 6]])
    scores = torch.tensor([0.9, 0.8, 0.05, 0.7])
    dets, inds = mmcv.nms(boxes, scores, 0.5)
    assert inds.tolist() == [0, 3]   # 1 and 2 overlap kept boxes above 0.5
    torch.testing.assert_close(dets[:, :4], boxes[inds])
    torch.testing.assert_close(dets[:, 4], scores[inds])
    dets, inds = mmcv.nms(boxes, scores, 0.5, score_threshold=0.1)
    assert inds.tolist() == [0, 3]
    dets, inds = mmcv.nms(boxes, scores, 0.5, max_num=1)
    assert inds.tolist() == [0] and dets.shape == (1, 5)


def _random_detections(n, classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    corner = torch.rand(n, 2, generator=g) * 50
    boxes = torch.cat([corner, corner + 5 + torch.rand(n, 2, generator=g) * 20], dim=1)
    return boxes, torch.rand(n, generator=g), torch.randint(0, classes, (n,), generator=g)


@pytest.mark.parametrize("split_thr", [None, 10])   # 10: MMCV's loop over classes
def test_batched_nms_keeps_classes_apart_as_torchvision_and_returns_mmcvs_detections(split_thr):
    tv_ops = pytest.importorskip("torchvision.ops")
    boxes, scores, idxs = _random_detections(300, 5)
    cfg = {"type": "nms", "iou_threshold": 0.4}
    if split_thr is not None:
        cfg["split_thr"] = split_thr
    dets, keep = mmcv.batched_nms(boxes, scores, idxs, cfg)
    assert keep.tolist() == tv_ops.batched_nms(boxes, scores, idxs, 0.4).tolist()
    torch.testing.assert_close(dets, torch.cat([boxes[keep], scores[keep, None]], dim=1))
    assert cfg == {"type": "nms", "iou_threshold": 0.4, **(
        {} if split_thr is None else {"split_thr": split_thr})}   # the caller's dict untouched
    # class_agnostic, from the argument or the config: plain nms
    plain = tv_ops.nms(boxes, scores, 0.4).tolist()
    assert mmcv.batched_nms(boxes, scores, idxs, cfg, class_agnostic=True)[1].tolist() == plain
    assert mmcv.batched_nms(boxes, scores, idxs, dict(cfg, class_agnostic=True))[1].tolist() \
        == plain
    # max_num and score_threshold as mmcv.ops.nms takes them
    top = mmcv.batched_nms(boxes, scores, idxs, dict(cfg, max_num=7, score_threshold=0.2))[1]
    above = (scores > 0.2).nonzero().flatten()
    expected = above[tv_ops.batched_nms(boxes[above], scores[above], idxs[above], 0.4)][:7]
    assert top.tolist() == expected.tolist()


@pytest.mark.parametrize("nms_type", ["nms", "soft_nms", "nms_rotated"])
def test_batched_nms_keeps_each_distinct_floating_class_apart(nms_type):
    """Floating class ids are classes by value, as MMCV's loop over
    torch.unique(idxs) takes them: 0.5 is not merged into 0."""
    boxes = torch.tensor([[0.0, 0, 10, 10]] * 3)
    if nms_type == "nms_rotated":
        boxes = torch.tensor([[5.0, 5, 10, 10, 0]] * 3)
    scores = torch.tensor([0.9, 0.8, 0.7])
    cfg = {"type": nms_type, "iou_threshold": 0.5}
    if nms_type == "soft_nms":
        cfg["method"] = "naive"
    _, keep = mmcv.batched_nms(boxes, scores, torch.tensor([0.0, 0.5, -0.0]), cfg)
    assert keep.tolist() == [0, 1]


def test_batched_nms_without_config_sorts_by_score_and_refuses_other_types():
    boxes, scores, idxs = _random_detections(20, 3)
    dets, inds = mmcv.batched_nms(boxes, scores, idxs, None)
    assert inds.tolist() == scores.argsort(descending=True, stable=True).tolist()
    torch.testing.assert_close(dets[:, 4], scores[inds])
    with pytest.raises(ValueError, match=re.escape(
            "batched_nms: nms_cfg type must be 'nms', 'soft_nms', 'nms_rotated' or a function, "
            "got 'nms_match'")):
        mmcv.batched_nms(boxes, scores, idxs, {"type": "nms_match", "iou_threshold": 0.5})
    with pytest.raises(ValueError, match="batched_nms: nms_cfg must give iou_threshold"):
        mmcv.batched_nms(boxes, scores, idxs, {"type": "nms"})
    with pytest.raises(TypeError, match=re.escape("batched_nms: nms_cfg has unknown options "
                                                  "['min_score'] for type 'nms'")):
        mmcv.batched_nms(boxes, scores, idxs, {"iou_threshold": 0.5, "min_score": 0.1})
    with pytest.raises(TypeError, match=re.escape("batched_nms: nms_cfg has unknown options "
                                                  "['score_threshold'] for type 'soft_nms'")):
        mmcv.batched_nms(boxes, scores, idxs, {"type": "soft_nms", "score_threshold": 0.1})
    with pytest.raises(ValueError, match=re.escape("batched_nms: method must be one of")):
        mmcv.batched_nms(boxes, scores, idxs, {"type": "soft_nms", "method": "hard"})


# MMCV's published soft_nms values (tests/test_ops/test_nms.py there):
# iou_threshold 0.3, sigma 0.5, min_score 0.01
SOFT_BOXES = torch.tensor([[6, 3, 8, 7], [3, 6, 9, 11], [3, 7, 10, 12], [1, 4, 13, 7.]])
SOFT_SCORES = torch.tensor([0.6, 0.9, 0.7, 0.2])
SOFT_OUTPUT = {"linear": ([0.9, 0.6, 0.29024392, 0.2], [1, 0, 2, 3]),
               "gaussian": ([0.9, 0.59630775, 0.35275510, 0.18650459], [1, 0, 2, 3]),
               "naive": ([0.9, 0.6, 0.2], [1, 0, 3])}


@pytest.mark.parametrize("method", ["linear", "gaussian", "naive"])
def test_soft_nms_gives_mmcvs_published_values(method):
    dets, inds = mmcv.soft_nms(SOFT_BOXES, SOFT_SCORES, 0.3, 0.5, 0.01, method)
    scores, expected = SOFT_OUTPUT[method]
    assert inds.dtype == torch.int64 and inds.tolist() == expected
    assert torch.equal(dets[:, :4], SOFT_BOXES[expected])
    torch.testing.assert_close(dets[:, 4], torch.tensor(scores), rtol=1e-6, atol=0)


def test_soft_nms_takes_half_precision_on_the_cpu_and_matches_the_numpy_path():
    boxes, scores, idxs = _random_detections(60, 4)
    dets, inds = mmcv.soft_nms(boxes, scores, 0.4, 0.5, 0.05, "gaussian")
    expected = mmdispatch.ops.soft_nms(boxes.numpy(), scores.numpy(), 0.4, 0.5, 0.05, "gaussian")
    np.testing.assert_array_equal(dets.numpy(), expected[0])
    np.testing.assert_array_equal(inds.numpy(), expected[1])
    half, half_inds = mmcv.soft_nms(boxes.half(), scores.half(), 0.4, 0.5, 0.05, "gaussian")
    assert half.dtype == torch.float16 and half_inds.dtype == torch.int64


def test_batched_nms_with_soft_nms_decays_within_classes_and_applies_max_num():
    boxes, scores, idxs = _random_detections(80, 3)
    cfg = {"type": "soft_nms", "iou_threshold": 0.4, "min_score": 0.05, "method": "linear"}
    dets, keep = mmcv.batched_nms(boxes, scores, idxs, cfg)
    expected = mmdispatch.ops.batched_soft_nms(boxes.numpy(), scores.numpy(), idxs.numpy(), 0.4,
                                               0.5, 0.05, "linear")
    np.testing.assert_array_equal(keep.numpy(), expected[1])
    np.testing.assert_array_equal(dets.numpy(), expected[0])
    assert torch.all(dets[1:, 4] <= dets[:-1, 4])
    top, top_keep = mmcv.batched_nms(boxes, scores, idxs, dict(cfg, max_num=5, split_thr=10))
    assert top_keep.tolist() == keep[:5].tolist() and torch.equal(top, dets[:5])
    agnostic = mmcv.batched_nms(boxes, scores, idxs, cfg, class_agnostic=True)[1]
    assert agnostic.tolist() == mmcv.soft_nms(boxes, scores, 0.4, 0.5, 0.05)[1].tolist()


@needs_data_dependent_tracing
def test_soft_nms_compiles_with_a_data_dependent_count():
    boxes, scores, _ = _random_detections(30, 2)

    def post_process(boxes, scores):
        dets, inds = mmcv.soft_nms(boxes, scores, 0.3, 0.5, 0.05)
        return dets[:, 4] * 2, inds + 1

    compiled = torch.compile(post_process, fullgraph=True, dynamic=False)
    got = compiled(boxes, scores)
    expected = post_process(boxes, scores)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_bbox_overlaps_roi_pool_and_modules():
    b1 = torch.tensor([[0, 0, 10, 10], [10, 10, 20, 20], [32, 32, 38, 42]], dtype=torch.float32)
    b2 = torch.tensor([[0, 0, 10, 20], [0, 10, 10, 19], [10, 10, 20, 20]], dtype=torch.float32)
    np.testing.assert_allclose(mmcv.bbox_overlaps(b1, b2, offset=1).numpy(),
                               mmdispatch.ops.bbox_overlaps(b1.numpy(), b2.numpy(), offset=1))
    np.testing.assert_allclose(mmcv.bbox_overlaps(b1, b2, "iof", True).numpy(),
                               mmdispatch.ops.bbox_overlaps(b1.numpy(), b2.numpy(), "iof", True))
    x = feature_map().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda x: mmcv.roi_pool(x, ROIS, 2, 1.0), (x,))
    torch.testing.assert_close(mmcv.RoIPool(2)(x, ROIS), mmcv.roi_pool(x, ROIS, 2))
    torch.testing.assert_close(mmcv.RoIAlign(2, pool_mode="max")(x, ROIS),
                               mmcv.roi_align(x, ROIS, 2, pool_mode="max"))


def test_roi_pool_takes_mmcvs_bins_where_torchvisions_would_round_the_corners():
    """mmcv.ops.roi_pool spans x1 * scale to (x2 + 1) * scale unrounded; at
    scale 0.5 the roi (0, 0, 7, 7) is cells [0, 4) in bins of 2, where
    torchvision's rounds to 5 cells in bins of 2.5."""
    x = torch.arange(64.0).reshape(1, 1, 8, 8).requires_grad_(True)
    rois = torch.tensor([[0.0, 0, 0, 7, 7]])
    out = mmcv.roi_pool(x, rois, 2, 0.5)
    assert out.flatten().tolist() == [9, 11, 25, 27]
    assert mmdispatch.torch.roi_pool(x, rois, 2, 0.5).flatten().tolist() == [18, 20, 34, 36]
    out.sum().backward()
    assert x.grad.flatten().nonzero().flatten().tolist() == [9, 11, 25, 27]
    module = mmcv.RoIPool(2, 0.5)
    assert module.output_size == (2, 2) and module.spatial_scale == 0.5
    assert repr(module) == "RoIPool(output_size=(2, 2), spatial_scale=0.5)"
    torch.testing.assert_close(module(x, rois), out)


@pytest.mark.parametrize("call, message", [
    (lambda: mmcv.roi_align(feature_map(), ROIS, 2, pool_mode="mean"),
     "roi_align: pool_mode must be one of 'avg', 'max', got 'mean'"),
    (lambda: mmcv.bbox_overlaps(torch.zeros(1, 4), torch.zeros(1, 4), mode="giou"),
     "bbox_overlaps: mode must be one of 'iou', 'iof', got 'giou'"),
    (lambda: mmcv.sigmoid_focal_loss(torch.zeros(2, 3), torch.tensor([0, 9])),
     "sigmoid_focal_loss_forward_impl: target[1] = 9 is not a class index in [0, 3]"),
    (lambda: mmcv.sigmoid_focal_loss(torch.zeros(2, 3), torch.tensor([0, 1]), reduction="avg"),
     "sigmoid_focal_loss: reduction must be"),
])
def test_bad_input_gets_a_clear_error(call, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        call()


def test_star_import_gives_mmcvs_ops_and_nothing_of_the_modules_own():
    """`from mmdispatch.torch.mmcv import *` in place of `from mmcv.ops
    import *`: every public function and module, and none of the names the
    module uses itself (torch, nn, math, its helpers): the functions and
    classes of mmdispatch's torch layer without a leading underscore."""
    namespace = {}
    exec("from mmdispatch.torch.mmcv import *", namespace)
    names = set(namespace) - {"__builtins__"}
    public = {name for name, value in vars(mmcv).items() if not name.startswith("_")
              and getattr(value, "__module__", "").startswith("mmdispatch.torch")}
    assert names == set(mmcv.__all__) == public
    assert "multi_scale_deformable_attn_pytorch" in names and "torch" not in names


# --- MMCV's behaviour where torchvision's differs, and MMCV's other entry points ----------

def test_nms_compares_the_iou_with_the_float32_threshold_as_mmcvs_kernels():
    """IoU exactly 0.3: MMCV's C float threshold is 0.30000001..., so the box
    stays; torchvision compares with the double 0.3 and drops it."""
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 3]])
    scores = torch.tensor([0.9, 0.8])
    assert mmcv.nms(boxes, scores, 0.3)[1].tolist() == [0, 1]
    assert mmdispatch.torch.nms(boxes, scores, 0.3).tolist() == [0]
    idxs = torch.zeros(2, dtype=torch.int64)
    assert mmcv.batched_nms(boxes, scores, idxs, dict(iou_threshold=0.3))[1].tolist() == [0, 1]


def test_nms_and_soft_nms_take_numpy_arrays_and_return_numpy_arrays():
    boxes = np.array([[0, 0, 10, 10], [1, 1, 11, 11], [50, 50, 60, 60]], np.float32)
    scores = np.array([0.9, 0.8, 0.7], np.float32)
    dets, inds = mmcv.nms(boxes, scores, 0.5)
    assert isinstance(dets, np.ndarray) and isinstance(inds, np.ndarray)
    assert inds.tolist() == [0, 2] and dets.shape == (2, 5)
    dets, inds = mmcv.soft_nms(boxes, scores, 0.5, method="naive")
    assert isinstance(dets, np.ndarray) and inds.tolist() == [0, 2]


def test_nms_dets_promote_boxes_and_scores_dtypes_as_torch_cat_does():
    boxes = torch.tensor([[0.0, 0, 10, 10]])
    dets, _ = mmcv.nms(boxes, torch.tensor([0.5], dtype=torch.float64), 0.5)
    assert dets.dtype == torch.float64


def test_deprecated_argument_names_still_work_with_a_warning():
    boxes = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11]])
    scores = torch.tensor([0.9, 0.8])
    with pytest.warns(DeprecationWarning, match="'iou_thr' is deprecated"):
        assert mmcv.nms(boxes, scores, iou_thr=0.5)[1].tolist() == [0]
    with pytest.warns(DeprecationWarning):
        keep = mmcv.batched_nms(boxes, scores, torch.zeros(2), dict(iou_thr=0.5))[1]
    assert keep.tolist() == [0]
    with pytest.warns(DeprecationWarning):
        module = mmcv.RoIAlign(out_size=3, sample_num=2)
    assert module.output_size == (3, 3) and module.sampling_ratio == 2
    with pytest.warns(DeprecationWarning):
        assert mmcv.RoIAlignRotated(out_size=(2, 3), spatial_scale=1.0, sample_num=1).output_size == (2, 3)
    with pytest.warns(DeprecationWarning):
        assert mmcv.DeformConv2d(4, 4, 3, deformable_groups=2).deform_groups == 2
    with pytest.warns(DeprecationWarning):
        assert mmcv.ModulatedDeformConv2d(4, 4, 3, deformable_groups=2).deform_groups == 2


def test_batched_nms_takes_nms_rotated_and_functions_as_its_type():
    """nms_cfg type "nms_rotated" on (N, 5) boxes keeps classes apart, as
    MMCV's offset trick does; a function as the type runs on boxes moved
    apart by class, as MMCV runs it."""
    boxes = torch.tensor([[10.0, 10, 8, 4, 0.1], [10.5, 10, 8, 4, 0.1], [10.2, 10, 8, 4, 0.1],
                          [40, 40, 6, 6, 0.0]])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6])
    idxs = torch.tensor([0, 0, 1, 1])
    dets, keep = mmcv.batched_nms(boxes, scores, idxs, dict(type="nms_rotated", iou_threshold=0.5))
    assert keep.tolist() == [0, 2, 3] and dets.shape == (3, 6)
    torch.testing.assert_close(dets[:, 5], scores[keep])
    flat = torch.tensor([[0.0, 0, 10, 10], [1, 1, 11, 11], [0, 0, 10, 10]])
    for kind in (mmcv.nms, "nms"):
        dets, keep = mmcv.batched_nms(flat, scores[:3], idxs[:3], dict(type=kind, iou_threshold=0.5))
        assert keep.tolist() == [0, 2]
    calls = []

    def my_nms(b, s, iou_threshold):
        calls.append(b.clone())
        return mmcv.nms(b, s, iou_threshold)
    dets, keep = mmcv.batched_nms(flat, scores[:3], idxs[:3], dict(type=my_nms, iou_threshold=0.5))
    assert keep.tolist() == [0, 2] and torch.equal(dets[:, :4], flat[keep])
    assert calls[0][2, 0] > 10   # class 1's box moved past class 0's
    with pytest.raises(ValueError, match="batched_nms: nms_cfg must give iou_threshold"):
        mmcv.batched_nms(boxes, scores, idxs, dict(type="nms_rotated"))


def test_nms_match_groups_each_kept_box_with_what_it_suppresses():
    dets = torch.tensor([[0.0, 0, 10, 10, 0.9], [50, 50, 60, 60, 0.85], [1, 0, 10, 10, 0.8],
                         [0, 0, 10, 9, 0.7], [51, 50, 60, 60, 0.6], [100, 100, 110, 110, 0.5]])
    groups = mmcv.nms_match(dets, 0.5)
    assert [g.tolist() for g in groups] == [[0, 2, 3], [1, 4], [5]]
    assert all(g.dtype == torch.int64 for g in groups)
    as_numpy = mmcv.nms_match(dets.numpy(), 0.5)
    assert [g.tolist() for g in as_numpy] == [[0, 2, 3], [1, 4], [5]]
    assert mmcv.nms_match(torch.zeros(0, 5), 0.5) == []
    # IoU exactly at the threshold is suppressed (MMCV's >=)
    exact = torch.tensor([[0.0, 0, 10, 10, 0.9], [0, 0, 10, 5, 0.8]])
    assert [g.tolist() for g in mmcv.nms_match(exact, 0.5)] == [[0, 1]]
    # two boxes of no area: MMCV's IoU is 0 / 0, NaN, which suppresses nothing
    flat = torch.tensor([[0.0, 0, 0, 5, 0.9], [0, 0, 0, 5, 0.8], [0, 0, 10, 10, 0.7]])
    assert [g.tolist() for g in mmcv.nms_match(flat, 0.0)] == [[0, 2], [1]]


def test_bbox_overlaps_of_an_empty_set_is_mmcvs_empty_shape():
    box = torch.FloatTensor([[0, 0, 10, 9]])
    assert mmcv.bbox_overlaps(torch.FloatTensor([]), box).shape == (0, 1)
    assert mmcv.bbox_overlaps(torch.zeros(0, 3), box).shape == (0, 1)
    assert mmcv.bbox_overlaps(box, torch.zeros(0, 4)).shape == (1, 0)
    assert mmcv.bbox_overlaps(torch.zeros(0, 4), torch.zeros(0, 4), aligned=True).shape == (0, 1)


def test_nms_rotated_of_no_boxes_returns_them_and_none():
    dets, keep = mmcv.nms_rotated(torch.zeros(0, 5), torch.zeros(0), 0.5)
    assert dets.shape == (0, 5) and keep is None


@pytest.mark.parametrize("batched", [False, True])
def test_nms_rotated_ranks_a_nan_score_first_as_mmcvs_sort_and_keeps_it_in_dets(batched):
    """MMCV sorts the scores with torch.sort(descending=True), which puts
    NaN first; our kernels rank it last, so the layer takes it as +inf
    (as mmcv.nms does), and dets keep the score given."""
    boxes = torch.tensor([[0.0, 0, 4, 4, 0], [0.5, 0, 4, 4, 0], [0, 0.4, 4, 4, 0],
                          [20, 20, 4, 4, 0.3]])
    scores = torch.tensor([0.9, 0.5, math.nan, 0.8])
    if batched:
        dets, keep = mmcv.batched_nms(boxes, scores, torch.zeros(4, dtype=torch.int64),
                                      dict(type="nms_rotated", iou_threshold=0.5))
    else:
        dets, keep = mmcv.nms_rotated(boxes, scores, 0.5)
    assert keep.tolist() == [2, 3]   # NaN first suppresses boxes 0 and 1
    assert math.isnan(dets[0, -1]) and dets[1, -1] == scores[3]


def test_modules_store_output_size_as_a_pair_and_use_torchvision_means_avg():
    x = feature_map()
    module = mmcv.RoIAlign(2, pool_mode="max", use_torchvision=True)
    assert module.output_size == (2, 2)
    torch.testing.assert_close(module(x, ROIS), mmcv.roi_align(x, ROIS, 2, pool_mode="avg"))
    assert mmcv.RoIAlignRotated(3, 1.0).output_size == (3, 3)


def test_deformable_modules_initialise_as_mmcvs():
    torch.manual_seed(0)
    dcn = mmcv.DeformConv2d(64, 64, 3)
    # no bias attribute at all, as MMCV's (its test asserts it)
    assert not hasattr(dcn, "bias") and not hasattr(mmcv.DeformConv2dPack(4, 4, 3), "bias")
    assert "bias=False" in repr(dcn)
    bound = math.sqrt(6 / (64 * 9))   # kaiming uniform for ReLU
    assert dcn.weight.abs().max() <= bound and dcn.weight.abs().max() > 0.9 * bound
    with pytest.raises(ValueError, match="DeformConv2d: bias=True is not supported"):
        mmcv.DeformConv2d(4, 4, 3, bias=True)
    dcn2 = mmcv.ModulatedDeformConv2d(64, 64, 3, groups=2)
    bound = 1 / math.sqrt(64 * 9)     # not divided by the groups
    assert dcn2.weight.abs().max() <= bound and dcn2.weight.abs().max() > 0.9 * bound
    assert (dcn2.bias == 0).all()


def test_pack_modules_start_as_the_deformable_convolution_at_rest():
    """conv_offset starts at zero: offsets 0 (and masks 0.5 for DCNv2), so
    the Pack modules start as the deformable convolution at rest."""
    torch.manual_seed(1)
    x = torch.randn(2, 4, 7, 8)
    pack = mmcv.DeformConv2dPack(4, 6, 3, padding=1)
    zero = torch.zeros(2, 18, 7, 8)
    torch.testing.assert_close(pack(x), mmcv.deform_conv2d(x, zero, pack.weight, padding=1))
    pack2 = mmcv.ModulatedDeformConv2dPack(4, 6, 3, padding=1)
    half = torch.full((2, 9, 7, 8), 0.5)
    torch.testing.assert_close(pack2(x), mmcv.modulated_deform_conv2d(
        x, zero, half, pack2.weight, pack2.bias, padding=1))
    pack2(x).sum().backward()
    assert pack2.conv_offset.weight.grad.abs().sum() > 0


def test_small_inputs_are_padded_to_the_kernel_as_mmcv_does():
    """An input smaller than the kernel is padded with zero rows and columns
    and the output cut back (MMCV's module does so): the same values as
    sampling outside the map, which reads 0."""
    torch.manual_seed(2)
    dcn = mmcv.DeformConv2d(2, 3, 3, padding=1)
    x = torch.randn(1, 2, 2, 2)
    offset = torch.randn(1, 18, 2, 2)
    out = dcn(x, offset)
    assert out.shape == (1, 3, 2, 2)
    torch.testing.assert_close(out, mmcv.deform_conv2d(x, offset, dcn.weight, padding=1))


def test_deformable_inputs_take_the_offsets_dtype_as_mmcv_under_autocast():
    x = torch.randn(1, 2, 5, 5)
    offset = torch.zeros(1, 18, 3, 3, dtype=torch.float64)
    weight = torch.randn(3, 2, 3, 3)
    assert mmcv.deform_conv2d(x, offset, weight).dtype == torch.float64


def test_sixteen_bit_features_with_float32_coordinates_run_in_float32():
    """roi_align, roi_pool, roi_align_rotated and msda on bfloat16 features
    with float32 rois or sampling locations: computed in float32 (16 bits
    would move the coordinates), the result in the features' dtype."""
    g = torch.Generator().manual_seed(9)
    x = torch.rand(1, 4, 30, 1100, generator=g).to(torch.bfloat16)
    rois = torch.tensor([[0, 1001.3, 5.2, 1013.7, 20.9]])
    rotated = torch.tensor([[0, 1007.3, 12.1, 12.4, 8.3, 0.3]])
    for op, coordinates in ((lambda x, r: mmcv.roi_align(x, r, 3, 1.0, 2), rois),
                            (lambda x, r: mmcv.roi_pool(x, r, 3), rois),
                            (lambda x, r: mmcv.roi_align_rotated(x, r, 3, 1.0, 2), rotated)):
        got = op(x, coordinates)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, op(x.float(), coordinates).to(torch.bfloat16),
                                   rtol=0, atol=0)
    value = torch.rand(1, 1100, 1, 4, generator=g).to(torch.bfloat16)
    shapes, starts = torch.tensor([[1, 1100]]), torch.tensor([0])
    locations = torch.full((1, 2, 1, 1, 1, 2), 0.5)
    locations[..., 0] = torch.tensor([0.9103, 0.9108]).reshape(1, 2, 1, 1, 1)
    weights = torch.ones(1, 2, 1, 1, 1)
    got = mmcv.multi_scale_deformable_attn(value, shapes, starts, locations, weights)
    assert got.dtype == torch.bfloat16
    expected = mmcv.multi_scale_deformable_attn(value.float(), shapes, starts, locations, weights)
    torch.testing.assert_close(got, expected.to(torch.bfloat16), rtol=0, atol=0)


def test_attention_takes_residual_as_mmcvs_old_name_of_identity():
    torch.manual_seed(3)
    attn = mmcv.MultiScaleDeformableAttention(embed_dims=16, num_heads=2, num_levels=1,
                                              num_points=2, dropout=0.0)
    query = torch.randn(5, 1, 16)
    shapes = torch.tensor([[2, 3]])
    starts = torch.tensor([0])
    ref = torch.rand(1, 5, 1, 2)
    value = torch.randn(6, 1, 16)
    other = torch.randn(5, 1, 16)
    expected = attn(query, value=value, identity=other, reference_points=ref,
                    spatial_shapes=shapes, level_start_index=starts)
    with pytest.warns(DeprecationWarning):
        got = attn(query, value=value, residual=other, reference_points=ref,
                   spatial_shapes=shapes, level_start_index=starts)
    torch.testing.assert_close(got, expected)


def test_deform_packs_initialise_as_mmcvs_and_load_their_version_1_checkpoints():
    """DeformConv2dPack has MMCV's init_offset; ModulatedDeformConv2dPack
    draws its weight again after building conv_offset, as MMCV's does, so
    a seeded model gets MMCV's weights; a checkpoint from before version 2
    (offset convolution named `_offset`) loads into conv_offset."""
    import collections
    pack = mmcv.DeformConv2dPack(4, 6, 3, padding=1)
    with torch.no_grad():
        pack.conv_offset.weight.fill_(1)
    pack.init_offset()
    assert not pack.conv_offset.weight.any() and not pack.conv_offset.bias.any()
    torch.manual_seed(0)
    ours = mmcv.ModulatedDeformConv2dPack(4, 6, 3).weight.detach()
    torch.manual_seed(0)   # MMCV's draws: weight, conv_offset's default init, weight again
    bound = 1 / math.sqrt(4 * 3 * 3)
    expected = torch.empty(6, 4, 3, 3).uniform_(-bound, bound)
    torch.nn.Conv2d(4, 27, 3)
    expected.uniform_(-bound, bound)
    assert torch.equal(ours, expected)
    for make in (lambda: mmcv.DeformConv2dPack(4, 6, 3, padding=1),
                 lambda: mmcv.ModulatedDeformConv2dPack(4, 6, 3, padding=1)):
        state = make().state_dict()
        old = collections.OrderedDict(
            (key.replace("conv_offset", "_offset"), value + ("offset" in key))
            for key, value in state.items())
        old._metadata = {key: dict(meta) for key, meta in state._metadata.items()}
        old._metadata[""]["version"] = 1
        module = make()
        module.load_state_dict(old)
        assert bool((module.conv_offset.bias == 1).all())


def test_mmcv_argument_checks_that_mmcv_makes():
    """bbox_overlaps with aligned=True refuses unequal counts even when one
    side is empty (MMCV asserts it first); the focal losses refuse float
    targets (MMCV asserts torch.long; converting truncated 0.7 to class
    0); roi_align_rotated's spatial_scale is required, as MMCV's."""
    with pytest.raises(ValueError, match=re.escape(
            "bbox_overlaps: aligned=True needs as many bboxes1 as bboxes2, got 0 and 3")):
        mmcv.bbox_overlaps(torch.zeros(0, 4), torch.zeros(3, 4), aligned=True)
    assert mmcv.bbox_overlaps(torch.zeros(0, 4), torch.zeros(0, 4), aligned=True).shape == (0, 1)
    for loss in (mmcv.sigmoid_focal_loss, mmcv.softmax_focal_loss):
        with pytest.raises(TypeError, match="focal_loss: target must hold class indices"):
            loss(torch.zeros(2, 3), torch.tensor([0.7, 1.0]))
    assert mmcv.SigmoidFocalLoss(2, 1).gamma == 2   # kept as given, as MMCV's
    import inspect
    for f in (mmcv.roi_align_rotated, mmcv.RoIAlignRotated.__init__):
        scale = inspect.signature(f).parameters["spatial_scale"]
        assert scale.default is inspect.Parameter.empty


def test_msda_without_level_start_index_derives_it_as_mmcvs_cpu_path_does():
    """MMCV's module runs its grid_sample fallback on the CPU, which never
    reads level_start_index, so a caller may leave it out; ours derives it
    from the shapes. A reference_points of other than 4 dimensions is a
    ValueError naming it."""
    torch.manual_seed(0)
    attn = mmcv.MultiScaleDeformableAttention(embed_dims=16, num_heads=4, num_levels=2,
                                              num_points=2, batch_first=True).eval()
    query, value = torch.rand(2, 7, 16), torch.rand(2, 16, 16)
    points = torch.rand(2, 7, 2, 2)
    shapes, starts = torch.tensor([[3, 4], [2, 2]]), torch.tensor([0, 12])
    expected = attn(query, value=value, reference_points=points, spatial_shapes=shapes,
                    level_start_index=starts)
    got = attn(query, value=value, reference_points=points, spatial_shapes=shapes)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    args = (torch.rand(1, 16, 4, 4), shapes, None, torch.rand(1, 3, 4, 2, 2, 2),
            torch.rand(1, 3, 4, 2, 2))
    torch.testing.assert_close(mmcv.multi_scale_deformable_attn(*args),
                               mmcv.multi_scale_deformable_attn_pytorch(*args[:2], *args[3:]),
                               rtol=0, atol=0)
    with pytest.raises(ValueError, match="reference_points must be .N, Q, L, 2."):
        attn(query, value=value, reference_points=torch.rand(2, 7, 2), spatial_shapes=shapes)


def test_the_grid_sample_fallbacks_name_takes_a_list_of_level_shapes():
    torch.manual_seed(0)
    value = torch.rand(1, 2 * 3 + 4 * 2, 2, 4, dtype=torch.float64)
    locations = torch.rand(1, 5, 2, 2, 3, 2, dtype=torch.float64)
    weights = torch.rand(1, 5, 2, 2, 3, dtype=torch.float64)
    shapes = torch.tensor([[2, 3], [4, 2]])
    expected = mmcv.multi_scale_deformable_attn_pytorch(value, shapes, locations, weights)
    got = mmcv.multi_scale_deformable_attn_pytorch(value, [(2, 3), (4, 2)], locations, weights)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
