"""ONNX export of models on mmdispatch.torch (mmdispatch/torch/_onnx.py),
with both of torch.onnx.export's exporters: the ONNX operators torchvision's
ops export to, the eager results from ONNX Runtime on the export's inputs
and on inputs of other sizes, and clear errors for what ONNX cannot
express."""
import sys
import threading
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (the test extra has it)")
torchvision = pytest.importorskip("torchvision", reason="torchvision is not installed")
onnx = pytest.importorskip("onnx", reason="onnx is not installed (the test extra has it)")
ort = pytest.importorskip("onnxruntime", reason="onnxruntime is not installed (the test extra "
                                               "has it)")

import mmdispatch.torch as mt  # noqa: E402
from mmdispatch.torch import mmcv  # noqa: E402

EXPORTERS = ["dynamo", "torchscript"]


def needs_exporter(exporter):
    if exporter == "dynamo":
        pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript")
        if not hasattr(getattr(torch.onnx, "ops", None), "symbolic"):
            pytest.skip(f"torch {torch.__version__} has no torch.onnx.ops.symbolic (torch 2.8)")


def export(model, args, path, exporter, names, dynamic, opset=None):
    """torch.onnx.export of `model` to `path`; `dynamic`: {input name:
    [its dynamic axes]}."""
    needs_exporter(exporter)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # the TorchScript exporter's deprecation, tracer notes
        if exporter == "dynamo":
            shapes = tuple({axis: torch.export.Dim.AUTO for axis in dynamic.get(name, ())}
                           for name in names)
            torch.onnx.export(model, args, str(path), dynamo=True, input_names=names,
                              dynamic_shapes=shapes, opset_version=opset, verbose=False)
        else:
            torch.onnx.export(model, args, str(path), dynamo=False, input_names=names,
                              dynamic_axes=dynamic, opset_version=opset or 17)
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def operators(path):
    """(domain, operator) of every node of the model, in subgraphs too."""
    found = set()

    def walk(graph):
        for node in graph.node:
            found.add((node.domain, node.op_type))
            for attribute in node.attribute:
                if attribute.g.node:
                    walk(attribute.g)

    walk(onnx.load(str(path)).graph)
    return found


def run(session, args):
    return session.run(None, {i.name: a.numpy() for i, a in zip(session.get_inputs(), args)})


def random_boxes(n, seed, size=20.0):
    g = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=g) * size
    return torch.cat([xy, xy + torch.rand(n, 2, generator=g) * size / 2 + 0.5], 1)


class Detection(torch.nn.Module):
    """What a detector's head and post-processing call."""

    def forward(self, x, rois, boxes, scores, idxs):
        return (mt.roi_align(x, rois, 5, 0.5, -1, True),
                mt.roi_align(x, rois, (3, 4), 0.5, 2, False),
                mt.RoIAlign((2, 2), 0.25, 0)(x, rois),
                mt.roi_pool(x, rois, 3, 0.5),
                mt.nms(boxes, scores, 0.5),
                mt.batched_nms(boxes, scores, idxs, 0.4),
                mt.box_iou(boxes, boxes[:7]))


def detection_inputs(seed, batch, rois, boxes):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(batch, 3, 20, 24, generator=g)
    corners = random_boxes(rois, seed + 1)
    index = torch.randint(0, batch, (rois, 1), generator=g).float()
    return (x, torch.cat([index, corners], 1), random_boxes(boxes, seed + 2),
            torch.rand(boxes, generator=g), torch.randint(0, 3, (boxes,), generator=g))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_model_on_our_ops_exports_to_torchvisions_onnx_operators_and_runs_in_onnxruntime(
        exporter, tmp_path):
    names = ["x", "rois", "boxes", "scores", "idxs"]
    dynamic = {"x": [0], "rois": [0], "boxes": [0], "scores": [0], "idxs": [0]}
    session = export(Detection(), detection_inputs(0, 2, 4, 60), tmp_path / "m.onnx", exporter,
                     names, dynamic)
    found = operators(tmp_path / "m.onnx")
    assert {("", "RoiAlign"), ("", "MaxRoiPool"), ("", "NonMaxSuppression")} <= found
    assert not [op for op in found if op[0] not in ("", "ai.onnx")]   # no op of ours left
    # the inputs of the export, and inputs of other sizes (fewer, more, none)
    for args in (detection_inputs(0, 2, 4, 60), detection_inputs(5, 3, 9, 90),
                 detection_inputs(6, 1, 1, 1), detection_inputs(7, 2, 3, 0)):
        got, want = run(session, args), Detection()(*args)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if w.dtype == torch.int64:   # nms's kept indices, in score order
                np.testing.assert_array_equal(g, w.numpy())
            else:
                np.testing.assert_allclose(g, w.numpy(), rtol=1e-5, atol=1e-5)


class FocalLoss(torch.nn.Module):
    def forward(self, logits, targets):
        return (mt.sigmoid_focal_loss(logits, targets, 0.25, 2, "sum"),
                mt.sigmoid_focal_loss(logits, targets, -1, 1.5))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_sigmoid_focal_loss_exports_as_elementwise_operators_and_gives_the_eager_values(
        exporter, tmp_path):
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(6, 4, generator=g) * 3, torch.rand(6, 4, generator=g))
    session = export(FocalLoss(), args, tmp_path / "f.onnx", exporter, ["logits", "targets"],
                     {"logits": [0], "targets": [0]})
    assert not [op for op in operators(tmp_path / "f.onnx") if op[0] not in ("", "ai.onnx")]
    for inputs in (args, (torch.randn(9, 4, generator=g) * 3, torch.rand(9, 4, generator=g))):
        for got, want in zip(run(session, inputs), FocalLoss()(*inputs)):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_deform_conv2d_exports_to_deform_conv_with_and_without_mask_and_bias(exporter, tmp_path):
    g = torch.Generator().manual_seed(3)
    x = torch.rand(2, 4, 8, 7, generator=g)
    offset = torch.randn(2, 2 * 2 * 9, 8, 7, generator=g)   # two offset groups
    mask = torch.rand(2, 2 * 9, 8, 7, generator=g)
    weight = torch.randn(6, 2, 3, 3, generator=g)   # two weight groups
    bias = torch.randn(6, generator=g)

    class Model(torch.nn.Module):
        def forward(self, x, offset, mask, weight, bias):
            return (mt.deform_conv2d(x, offset, weight, bias, padding=1, mask=mask),
                    mt.deform_conv2d(x, offset, weight, None, padding=1),
                    mt.deform_conv2d(x, offset[:, :, ::2, ::2].contiguous(), weight, bias,
                                     stride=2, padding=1, dilation=1))

    args = (x, offset, mask, weight, bias)
    session = export(Model(), args, tmp_path / "d.onnx", exporter,
                     ["x", "offset", "mask", "weight", "bias"], {}, opset=19)
    assert ("", "DeformConv") in operators(tmp_path / "d.onnx")
    for got, want in zip(run(session, args), Model()(*args)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_mmcvs_aligned_roi_align_and_offset_nms_export_with_their_semantics(exporter, tmp_path):
    class Model(torch.nn.Module):
        def forward(self, x, rois, dets):
            kept, keep = mmcv.nms(dets[:, :4], dets[:, 4], 0.3, offset=1)
            return mmcv.roi_align(x, rois, 4, 0.5, 2), keep, mmcv.bbox_overlaps(
                dets[:, :4], dets[:5, :4], offset=1)

    x, rois, boxes, scores, _ = detection_inputs(1, 2, 5, 40)
    # whole-pixel boxes, where +1 on widths and heights changes which overlap
    dets = torch.cat([boxes.round(), scores[:, None]], 1)
    session = export(Model(), (x, rois, dets), tmp_path / "mmcv.onnx", exporter,
                     ["x", "rois", "dets"], {"dets": [0], "rois": [0]})
    got, want = run(session, (x, rois, dets)), Model()(x, rois, dets)
    np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(got[1], want[1].numpy())
    np.testing.assert_allclose(got[2], want[2].numpy(), rtol=1e-6, atol=1e-6)
    assert not np.array_equal(want[1].numpy(), mmcv.nms(dets[:, :4], dets[:, 4], 0.3)[1])


def test_torchvisions_faster_rcnn_on_our_pooler_exports_and_detects_as_in_eager_code(tmp_path):
    from torchvision.models.detection import FasterRCNN
    from torchvision.models.detection.backbone_utils import resnet_fpn_backbone

    torch.manual_seed(0)
    backbone = resnet_fpn_backbone(backbone_name="resnet18", weights=None, trainable_layers=5)
    model = FasterRCNN(backbone, num_classes=3, min_size=128, max_size=160, box_score_thresh=0.0,
                       box_roi_pool=mt.MultiScaleRoIAlign(["0", "1", "2", "3"], 7, 2)).eval()
    images = [torch.rand(3, 128, 160, generator=torch.Generator().manual_seed(1))]
    # torchvision's detection models export with the TorchScript exporter
    # (their batched_nms guards on data under torch.export)
    session = export(model, (images,), tmp_path / "frcnn.onnx", "torchscript", ["image"], {})
    assert ("", "RoiAlign") in operators(tmp_path / "frcnn.onnx")
    got = run(session, images)
    with torch.no_grad():
        want = model(images)[0]
    assert len(want["boxes"]) > 0
    np.testing.assert_allclose(got[0], want["boxes"].numpy(), rtol=1e-4, atol=1e-3)
    np.testing.assert_array_equal(got[1], want["labels"].numpy())
    np.testing.assert_allclose(got[2], want["scores"].numpy(), rtol=1e-4, atol=1e-5)


def raised(info):
    """The messages of an exception and of its causes (the dynamo exporter
    wraps what the traced code raised)."""
    messages, exc = [], info.value
    while exc is not None:
        messages.append(f"{type(exc).__name__}: {exc}")
        exc = exc.__cause__ or exc.__context__
    return "\n".join(messages)


class Call(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x, rois):
        return self.fn(x, rois)


REFUSED = {
    "mmcv roi_align max": (lambda x, r: mmcv.roi_align(x, r, 2, pool_mode="max"),
                           ["roi_align_forward", "pool_mode='max'"]),
    "mmcv roi_pool": (lambda x, r: mmcv.roi_pool(x, r, 2), ["roi_pool_forward", "convention"]),
    "ps_roi_pool": (lambda x, r: mt.ps_roi_pool(x.repeat(1, 4, 1, 1)[:, :4], r, 2),
                    ["ps_roi_pool_forward", "ONNX has no operator for it"]),
    "roi_align_rotated": (lambda x, r: mmcv.roi_align_rotated(x, torch.cat(
        [r, torch.zeros_like(r[:, :1])], 1), 2, 1.0), ["roi_align_rotated_forward",
                                                  "ONNX has no operator"]),
}


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("case", sorted(REFUSED))
def test_what_onnx_cannot_express_is_refused_naming_the_op_and_the_parameter(exporter, case,
                                                                             tmp_path):
    fn, words = REFUSED[case]
    x, rois = detection_inputs(0, 2, 3, 1)[:2]
    with pytest.raises(Exception) as info:
        export(Call(fn), (x, rois), tmp_path / "r.onnx", exporter, ["x", "rois"], {})
    message = raised(info)
    assert "torch.onnx.export cannot export" in message
    for word in words:
        assert word in message


def test_the_torchscript_exporter_below_opset_16_exports_roi_align_but_not_aligned(tmp_path):
    """RoiAlign's half-pixel mode (aligned=True) came in opset 16; before,
    its only mode is aligned=False's."""
    x, rois = detection_inputs(0, 2, 3, 1)[:2]
    model = Call(lambda x, r: mt.roi_align(x, r, (3, 2), 0.5, 2, aligned=False))
    session = export(model, (x, rois), tmp_path / "r.onnx", "torchscript", ["x", "rois"],
                     {"rois": [0]}, opset=11)
    more = detection_inputs(4, 2, 6, 1)[:2]
    np.testing.assert_allclose(run(session, more)[0], model(*more).numpy(), rtol=1e-5, atol=1e-5)
    with pytest.raises(Exception) as info:
        export(Call(lambda x, r: mt.roi_align(x, r, 2, aligned=True)), (x, rois),
               tmp_path / "r.onnx", "torchscript", ["x", "rois"], {}, opset=11)
    assert ("roi_align_forward: torch.onnx.export cannot export aligned=True at opset_version "
            "11: ONNX's operator with these semantics needs opset_version >= 16") in raised(info)


def test_the_dynamo_exporter_says_to_import_torchvision_first_for_nms(tmp_path, monkeypatch):
    """It records torchvision's nms, whose translation torch registers only
    for a torchvision imported before the export."""
    needs_exporter("dynamo")
    monkeypatch.delitem(sys.modules, "torchvision")
    x, rois = detection_inputs(0, 2, 3, 1)[:2]
    with pytest.raises(Exception) as info:
        export(Call(lambda x, r: mt.nms(r[:, 1:], r[:, 0], 0.5)), (x, rois), tmp_path / "n.onnx",
               "dynamo", ["x", "rois"], {})
    assert "nms: torch.onnx.export cannot export it unless torchvision was imported" \
        in raised(info)


def test_eager_calls_outside_an_export_run_our_kernels_after_torch_onnx_is_imported():
    import torch.onnx  # noqa: F401
    x, rois, boxes, scores, idxs = detection_inputs(2, 2, 4, 30)
    torch.testing.assert_close(mt.roi_align(x, rois, 3, 0.5, 2, True),
                               torchvision.ops.roi_align(x, rois, 3, 0.5, 2, True))
    torch.testing.assert_close(mt.nms(boxes, scores, 0.5), torchvision.ops.nms(boxes, scores, 0.5))


class DeformableAttention(torch.nn.Module):
    """Deformable DETR's encoder attention, its levels' sizes known to the
    model (taken from the feature maps, as detectors do)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.attention = mmcv.MultiScaleDeformableAttention(embed_dims=16, num_heads=2,
                                                            num_levels=2, num_points=3,
                                                            batch_first=True)
        # offsets that reach outside the maps too (MMCV's start stays inside)
        torch.nn.init.normal_(self.attention.sampling_offsets.weight, std=2.0)
        torch.nn.init.normal_(self.attention.attention_weights.weight)

    def forward(self, query, level0, level1, reference_points):
        shapes = torch.as_tensor([level0.shape[-2:], level1.shape[-2:]], dtype=torch.int64)
        value = torch.cat([level0.flatten(2), level1.flatten(2)], 2).transpose(1, 2)
        return self.attention(query, value=value, reference_points=reference_points,
                              spatial_shapes=shapes,
                              level_start_index=torch.cat([shapes.new_zeros(1),
                                                           shapes.prod(1).cumsum(0)[:-1]]))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_multi_scale_deformable_attention_exports_as_grid_sample_and_gives_its_values(
        exporter, tmp_path):
    g = torch.Generator().manual_seed(5)
    args = (torch.randn(2, 7, 16, generator=g), torch.randn(2, 16, 6, 8, generator=g),
            torch.randn(2, 16, 3, 4, generator=g), torch.rand(2, 7, 2, 2, generator=g))
    model = DeformableAttention().eval()
    session = export(model, args, tmp_path / "msda.onnx", exporter,
                     ["query", "level0", "level1", "reference_points"],
                     {"query": [0, 1], "level0": [0], "level1": [0], "reference_points": [0, 1]})
    assert ("", "GridSample") in operators(tmp_path / "msda.onnx")
    more = (torch.randn(1, 11, 16, generator=g), torch.randn(1, 16, 6, 8, generator=g),
            torch.randn(1, 16, 3, 4, generator=g), torch.rand(1, 11, 2, 2, generator=g) * 1.4 - 0.2)
    for inputs in (args, more):
        with torch.no_grad():
            want = model(*inputs)
        np.testing.assert_allclose(run(session, inputs)[0], want.numpy(), rtol=1e-4, atol=1e-5)


def test_deformable_attention_levels_given_as_an_input_follow_the_data_in_the_dynamo_export(
        tmp_path):
    """torch.export keeps the levels' sizes symbolic: other levels of the
    same total size give their own results (the TorchScript exporter bakes
    the traced ones in, as it does for MMCV's fallback, and warns)."""
    g = torch.Generator().manual_seed(6)
    value = torch.randn(1, 12 + 2, 2, 4, generator=g)
    locations = torch.rand(1, 3, 2, 2, 2, 2, generator=g)
    weights = torch.rand(1, 3, 2, 2, 2, generator=g)

    class Model(torch.nn.Module):
        def forward(self, value, shapes, locations, weights):
            return mmcv.multi_scale_deformable_attn(value, shapes, None, locations, weights)

    session = export(Model(), (value, torch.tensor([[3, 4], [1, 2]]), locations, weights),
                     tmp_path / "m.onnx", "dynamo", ["value", "shapes", "locations", "weights"],
                     {})
    for levels in ([[3, 4], [1, 2]], [[2, 6], [2, 1]], [[1, 2], [3, 4]]):
        args = (value, torch.tensor(levels), locations, weights)
        np.testing.assert_allclose(run(session, args)[0], Model()(*args).numpy(), rtol=1e-5,
                                   atol=1e-6)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_batched_nms_of_float_categories_exports_each_distinct_value_a_category(exporter,
                                                                               tmp_path):
    """Our batched_nms keeps 0.0 and 0.5 apart (torchvision's loop over
    torch.unique does too): the export ranks the values, where eager code
    compares their bits, which ONNX cannot view."""
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10.5], [1, 1, 11, 11], [0, 0, 10, 10],
                          [40, 40, 50, 50]])
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])

    class Model(torch.nn.Module):
        def forward(self, boxes, scores, idxs):
            return mt.batched_nms(boxes, scores, idxs, 0.5)

    session = export(Model(), (boxes, scores, torch.tensor([0.0, 0.5, 0.5, -0.0, 0.0])),
                     tmp_path / "b.onnx", exporter, ["boxes", "scores", "idxs"],
                     {"boxes": [0], "scores": [0], "idxs": [0]})
    for idxs in ([0.0, 0.5, 0.5, -0.0, 0.0], [2.5, 0.5, 1e9, 1e9 + 128, 2.5],
                 [float("nan"), 1.0, float("nan"), 1.0, 0.0]):
        args = (boxes, scores, torch.tensor(idxs))
        np.testing.assert_array_equal(run(session, args)[0], Model()(*args).numpy())


def test_a_torch_jit_trace_of_a_model_exports_later_with_our_translations_and_refusals(
        tmp_path):
    """torch.onnx.export of a ScriptModule that torch.jit.trace made outside
    any export: the trace registered our symbolic functions, which refuse
    what ONNX cannot express as a traced export does."""
    x, rois, boxes, scores, idxs = detection_inputs(8, 2, 5, 40)
    model = Call(lambda x, r: mt.roi_align(x, r, (3, 2), 0.5, 2, True))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(model, (x, rois))
        refused = torch.jit.trace(Call(lambda x, r: mmcv.roi_align(x, r, 2, pool_mode="max")),
                                  (x, rois))
        pairs = torch.jit.trace(Call(lambda b, s: mt.box_iou(b, b[:3])), (boxes, scores))
    session = export(traced, (x, rois), tmp_path / "t.onnx", "torchscript", ["x", "rois"], {})
    np.testing.assert_allclose(run(session, (x, rois))[0], model(x, rois).numpy(), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(Exception) as info:
        export(refused, (x, rois), tmp_path / "r.onnx", "torchscript", ["x", "rois"], {})
    assert "roi_align_forward: torch.onnx.export cannot export pool_mode='max'" in raised(info)
    with pytest.raises(Exception) as info:
        export(pairs, (boxes, scores), tmp_path / "p.onnx", "torchscript", ["b", "s"], {})
    assert ("bbox_overlaps: torch.onnx.export cannot export it from a torch.jit.trace of the "
            "model: export the model itself") in raised(info)


@pytest.mark.parametrize("opset", [11, 12, 13])
def test_the_torchscript_exporter_exports_nms_at_opsets_before_13(opset, tmp_path):
    """Unsqueeze took its axes as an attribute before opset 13."""
    _, _, boxes, scores, idxs = detection_inputs(9, 1, 1, 50)

    class Model(torch.nn.Module):
        def forward(self, boxes, scores, idxs):
            return mt.nms(boxes, scores, 0.5), mt.batched_nms(boxes, scores, idxs, 0.5)

    session = export(Model(), (boxes, scores, idxs), tmp_path / "n.onnx", "torchscript",
                     ["boxes", "scores", "idxs"], {}, opset=opset)
    for got, want in zip(run(session, (boxes, scores, idxs)), Model()(boxes, scores, idxs)):
        np.testing.assert_array_equal(got, want.numpy())


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_roi_align_under_autocast_exports_in_one_dtype_and_gives_the_eager_values(exporter,
                                                                                 tmp_path):
    """Inside torch.autocast, 16-bit features meet float32 rois; ONNX's
    RoiAlign takes one dtype: the export computes both in float32, as the
    op's autocast kernel does, and returns the features' dtype."""
    x, rois = detection_inputs(10, 2, 4, 1)[:2]

    class Model(torch.nn.Module):
        def forward(self, x, rois):
            with torch.autocast("cpu", dtype=torch.float16):
                return mt.roi_align(x.half(), rois, 2, 0.5, 2, True)

    session = export(Model(), (x, rois), tmp_path / "a.onnx", exporter, ["x", "rois"], {})
    got, want = run(session, (x, rois))[0], Model()(x, rois)
    assert got.dtype == np.float16 and want.dtype == torch.float16
    np.testing.assert_allclose(got.astype(np.float32), want.float().numpy(), rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_ps_roi_align_exports_as_roi_align_of_every_channel_and_a_gather(exporter, tmp_path):
    """torchvision's ps_roi_align does not export; ours does, through
    RoiAlign (its sampling is roi_align's, aligned), then each bin's
    channel: the same values as eager code."""
    g = torch.Generator().manual_seed(11)
    x = torch.rand(2, 24, 16, 18, generator=g)

    class Model(torch.nn.Module):
        def forward(self, x, rois):
            return (mt.ps_roi_align(x, rois, (3, 2), 0.5, -1),
                    mt.PSRoIAlign(2, 0.5, 2)(x, rois))

    rois = torch.tensor([[0, 1, 1, 20, 24.0], [1, 3.3, 2, 9, 9], [1, 5, 5, 5, 5]])
    session = export(Model(), (x, rois), tmp_path / "ps.onnx", exporter, ["x", "rois"],
                     {"rois": [0]})
    assert ("", "RoiAlign") in operators(tmp_path / "ps.onnx")
    more = torch.cat([torch.randint(0, 2, (6, 1), generator=g).float(), random_boxes(6, 12)], 1)
    for r in (rois, more):
        for got, want in zip(run(session, (x, r)), Model()(x, r)):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_nms_thresholds_export_with_eager_codes_decisions(exporter, tmp_path):
    """An IoU of float32(0.3), just above 0.3, is suppressed as in eager
    code; thresholds of 1 and more suppress nothing; a negative one (which
    suppresses disjoint boxes too) is refused."""
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 3, 10], [20, 20, 30, 30]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    for threshold, kept in ((0.3, [0, 2]), (1.0, [0, 1, 2]), (1.5, [0, 1, 2])):
        model = Call(lambda b, s, t=threshold: mt.nms(b, s, t))
        assert model(boxes, scores).tolist() == kept
        session = export(model, (boxes, scores), tmp_path / "t.onnx", exporter, ["b", "s"], {})
        assert run(session, (boxes, scores))[0].tolist() == kept
    with pytest.raises(Exception) as info:
        export(Call(lambda b, s: mt.nms(b, s, -0.1)), (boxes, scores), tmp_path / "n.onnx",
               exporter, ["b", "s"], {})
    assert "nms: torch.onnx.export cannot export iou_threshold=-0.1" in raised(info)


def test_an_export_in_one_thread_leaves_other_threads_calls_as_they_are(tmp_path):
    """torch.onnx.export's flag (and torch.export's compiling flag) is the
    process's: eager calls of another thread meanwhile (a server's) run our
    kernels as before, under autocast too (which once took torch's
    dispatch, where torch's own custom-op wrapper can meet the exporting
    thread's fx annotations: KeyError 'custom' from torch, for any
    torch.library custom op)."""
    needs_exporter("dynamo")
    x, rois, boxes, scores, _ = detection_inputs(12, 2, 4, 30)
    idxs = torch.rand(30, generator=torch.Generator().manual_seed(3)).round()   # 0.0 and 1.0
    want_nms = mt.batched_nms(boxes, scores, idxs, 0.5)
    want_max = mmcv.roi_align(x, rois, 2, pool_mode="max")
    half = x.to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want_amp = mt.roi_align(half, rois, 2)
    done, failures, calls = threading.Event(), [], [0]

    def export_in_a_thread():
        try:
            export(Detection(), detection_inputs(0, 2, 4, 60), tmp_path / "m.onnx", "dynamo",
                   ["x", "rois", "boxes", "scores", "idxs"], {})
        finally:
            done.set()

    thread = threading.Thread(target=export_in_a_thread)
    thread.start()
    while not done.is_set():
        try:
            assert torch.equal(mt.batched_nms(boxes, scores, idxs, 0.5), want_nms)
            assert torch.equal(mmcv.roi_align(x, rois, 2, pool_mode="max"), want_max)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                assert torch.equal(mt.roi_align(half, rois, 2), want_amp)
            calls[0] += 1
        except Exception as exc:   # noqa: BLE001  (reported below)
            failures.append(repr(exc))
    thread.join()
    assert not failures, failures[:3]
    assert calls[0] > 0


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_model_on_cuda_tensors_exports_the_same_operators_and_values(exporter, torch_cuda,
                                                                       tmp_path):
    """Exported from CUDA tensors (the TorchScript exporter runs our CUDA
    kernels while it traces), run by ONNX Runtime on the CPU: the eager
    CUDA results."""
    args = tuple(a.cuda() for a in detection_inputs(13, 2, 5, 70))
    names = ["x", "rois", "boxes", "scores", "idxs"]
    session = export(Detection().cuda(), args, tmp_path / "c.onnx", exporter, names,
                     {name: [0] for name in names})
    assert {("", "RoiAlign"), ("", "MaxRoiPool"), ("", "NonMaxSuppression")} <= operators(
        tmp_path / "c.onnx")
    for inputs in (args, tuple(a.cuda() for a in detection_inputs(14, 3, 8, 40))):
        got = run(session, tuple(a.cpu() for a in inputs))
        for g, w in zip(got, Detection()(*inputs)):
            if w.dtype == torch.int64:
                np.testing.assert_array_equal(g, w.cpu().numpy())
            else:
                np.testing.assert_allclose(g, w.cpu().numpy(), rtol=1e-4, atol=1e-4)
