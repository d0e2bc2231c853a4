"""mmdispatch.bench: the device benchmarks run the same code on any array
module, so on a machine without a GPU they are exercised with numpy (their
timings are never judged; tests/test_main.py runs the whole suite)."""
import numpy as np
import pytest

import mmdispatch
from mmdispatch import bench

TINY = dict(bench.STANDARD, batch=1, channels=2, height=16, width=24, rois_per_image=6,
            image=(64, 96), output=3, nms_boxes=40)


def test_device_cases_run_roi_align_and_nms_and_wait_for_the_device_each_call():
    moved, waits = [], []

    def to_device(a):
        moved.append(a.shape)
        return np.asarray(a)

    cases = list(bench.device_cases(TINY, to_device, lambda: waits.append(1)))
    assert [name for name, _, _, _ in cases] == [
        "roi_align sampling_ratio=2 forward", "roi_align sampling_ratio=2 forward+backward",
        "roi_align sampling_ratio=0 forward", "roi_align sampling_ratio=0 forward+backward",
        "roi_pool forward+backward", "nms 40 boxes, IoU 0.5", "nms 2000 boxes, IoU 0.5"]
    assert (1, 2, 16, 24) in moved and (6, 5) in moved and (40, 4) in moved
    map_bytes, pooled_bytes = 4 * 2 * 16 * 24, 4 * 6 * 2 * 3 * 3
    assert cases[0][3] == map_bytes + pooled_bytes   # the map read, the output written
    assert cases[5][3] == 40 * 16 + 40 * 4 + 2 * 40 * 8   # boxes, scores, mask twice
    for _, ours, theirs, traffic in cases:
        before = len(waits)
        ours()
        assert len(waits) == before + 1
        assert theirs is None   # no torch device given
        assert traffic > 0


def test_torch_cases_time_mmdispatch_torch_beside_torchvision_the_focal_loss_included():
    torch = pytest.importorskip("torch")
    tv = bench.torchvision_ops()
    if tv is None:
        pytest.skip("torchvision is not installed")
    cases = list(bench.torch_cases(dict(TINY, focal=(300, 5)), "cpu", tv))
    names = [name for name, _, _, _ in cases]
    assert names[-2:] == ["sigmoid_focal_loss (300, 5), sum, forward",
                          "sigmoid_focal_loss (300, 5), sum, forward+backward (autograd)"]
    assert [c[3] for c in cases[-2:]] == [2 * 300 * 5 * 4, 5 * 300 * 5 * 4]
    for _, ours, theirs, _ in cases:
        ours()
        theirs()
    assert torch.is_grad_enabled()


def test_mmcv_focal_cases_time_class_index_targets_beside_torchvisions_one_hot_loss():
    torch = pytest.importorskip("torch")
    tv = bench.torchvision_ops()
    if tv is None:
        pytest.skip("torchvision is not installed")
    waits = []
    cases = list(bench.mmcv_focal_cases(dict(TINY, focal=(300, 5)), np.asarray,
                                        lambda: waits.append(1), "cpu", tv))
    name = "MMCV sigmoid_focal_loss (300, 5) (vs torchvision's, one-hot)"
    softmax = "MMCV softmax_focal_loss (300, 6) (vs torch's log_softmax form)"
    assert [c[0] for c in cases] == [f"{name} forward", f"{name} forward+backward",
                                     f"{softmax} forward", f"{softmax} forward+backward"]
    rows = 300 * (8 + 4)
    assert [c[3] for c in cases] == [2 * 300 * 5 * 4 + 300 * 8, 4 * 300 * 5 * 4 + 300 * 8,
                                     300 * 6 * 4 + rows, 3 * 300 * 6 * 4 + 2 * rows]
    for _, ours, theirs, _ in cases:
        ours()
        theirs()
    assert len(waits) == 4 and torch.is_grad_enabled()


def test_torch_call_costs_time_tiny_calls_of_both_libraries():
    pytest.importorskip("torch")
    tv = bench.torchvision_ops()
    if tv is None:
        pytest.skip("torchvision is not installed")
    costs = bench.torch_call_costs("cpu", tv, number=3)
    assert {"roi_align call, tiny input", "roi_align call, tiny input, autograd recorded",
            "sigmoid_focal_loss call, tiny input (8, 4), sum",
            "sigmoid_focal_loss forward+backward, tiny input (8, 4), sum"} <= set(costs)
    assert all(ours > 0 and theirs > 0 for ours, theirs in costs.values())


def test_msda_cases_compare_the_op_with_a_grid_sample_fallback_that_computes_the_same():
    torch = pytest.importorskip("torch")
    tiny = dict(bench.MSDA_STANDARD, batch=1, heads=2, dims=4, points=2,
                levels=((4, 6), (2, 3)))
    waits = []
    cases = list(bench.msda_cases(tiny, np.asarray, lambda: waits.append(1), "cpu",
                                  (torch, None)))
    assert [name.split(" (")[0] for name, _, _, _ in cases] == [
        "multi_scale_deformable_attn forward", "multi_scale_deformable_attn forward+backward"]
    for _, ours, theirs, traffic in cases:
        ours()
        theirs()
        assert traffic > 0
    assert len(waits) == 2
    rng = np.random.default_rng(1)
    value = rng.standard_normal((1, 30, 2, 4))
    locations = rng.uniform(-0.2, 1.2, (1, 5, 2, 2, 2, 2))
    weights = rng.random((1, 5, 2, 2, 2))
    shapes = np.array([[4, 6], [2, 3]])
    expected = mmdispatch.ops.multi_scale_deformable_attn(value, shapes, np.array([0, 24]),
                                                           locations, weights)
    got = bench.grid_sample_attention(torch, torch.from_numpy(value), [(4, 6), (2, 3)],
                                      torch.from_numpy(locations), torch.from_numpy(weights))
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-12, atol=1e-12)


def test_device_call_costs_time_both_host_costs_and_restore_the_registry():
    waits = []
    before = mmdispatch.registry_table()
    theirs = []
    costs = bench.device_call_costs(np.asarray, lambda: waits.append(1), "cpu", number=20,
                                    theirs=lambda: theirs.append(1))
    assert set(costs) == {"no-op kernel through roi_align_forward_impl (host)",
                          "roi_align call, tiny input (host, launches included)"}
    assert all(ours > 0 for ours, _ in costs.values())
    assert costs["no-op kernel through roi_align_forward_impl (host)"][1] is None
    assert costs["roi_align call, tiny input (host, launches included)"][1] > 0 and theirs
    assert waits   # one wait per batch of calls
    assert mmdispatch.registry_table() == before   # the no-op kernel is gone again


def test_cuda_part_says_why_it_is_skipped_where_it_cannot_run():
    cupy, reason = bench.cuda_runtime()
    if cupy is not None:
        pytest.skip("CUDA kernels and CuPy are usable here: the GPU part runs")
    rows, skipped = bench.run_cuda(True, 1, None)
    assert rows is None and skipped == reason
    assert "CUDA" in reason or "CuPy" in reason


def test_gpu_only_run_leaves_out_every_cpu_row_and_says_why_gpu_rows_are_missing():
    cupy, _ = bench.cuda_runtime()
    if cupy is not None:
        pytest.skip("CUDA kernels and CuPy are usable here: the GPU rows would run")
    report = bench.run(quick=True, repeat=1, gpu_only=True)
    names = [row["benchmark"] for row in report["results"]]
    assert names == ["import mmdispatch (fresh interpreter)",
                     "import numpy (fresh interpreter, reference point)"]
    assert report["cuda_skipped"] and report["torch_skipped"]
    assert report["workload"] == "quick, GPU rows only"
    text = bench.table(report)
    assert "CUDA benchmarks skipped" in text and "dispatch overhead share" not in text


def test_gpu_only_refuses_the_cpu_overhead_plot():
    with pytest.raises(SystemExit):
        bench.main(["--gpu-only", "--plot", "x.png"])


def test_import_time_is_measured_in_fresh_interpreters():
    ours, numpy_only = bench.import_seconds(1)
    assert ours > 0 and numpy_only > 0


def test_bandwidth_table_lists_gpu_rows_with_their_share_of_the_peak():
    row = bench.result_row("CUDA x", "s", 0.001, 0.002, traffic=3e9)
    untrafficked = bench.result_row("CUDA soft_nms", "s", 0.02)   # no least traffic
    for r in (row, untrafficked):
        r["peak_bandwidth"] = 6e12
    report = {"workload": "quick", "repeat": 1, "torchvision": "0", "cuda_skipped": None,
              "machine": {"platform": "p", "cpu_status": "c", "cpu_products": "b; tiles t"},
              "results": [row, untrafficked], "overhead": {"sweep": []}}
    text = bench.table(report)
    assert "device peak 6000 GB/s" in text
    assert "| CUDA x | 2861 MiB | 3000 GB/s | 50.0 % | 1500 GB/s | 25.0 % |" in text
    assert "| CUDA soft_nms | 20 ms | - | - |" in text   # in the timings, not the bandwidths
    assert "| CUDA soft_nms |" not in text.split("CUDA achieved memory bandwidth")[1]


def test_table_header_names_the_cpu_matrix_products_the_run_used():
    report = {"workload": "quick", "repeat": 1, "torchvision": None, "cuda_skipped": None,
              "machine": {"platform": "p", "cpu_status": "c",
                          "cpu_products": "some BLAS; register tiles avx2"},
              "results": [], "overhead": {"sweep": []}}
    assert "CPU matrix products: some BLAS; register tiles avx2" in bench.table(report)


@pytest.mark.parametrize("method", ["naive", "linear", "gaussian"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_soft_nms_case_compares_with_a_numpy_implementation_that_computes_the_same(method,
                                                                                    dtype):
    rng = np.random.default_rng(5)
    corner = rng.integers(0, 60, (300, 2)) / 2
    boxes = np.concatenate([corner, corner + rng.integers(1, 30, (300, 2))], 1).astype(dtype)
    scores = rng.choice([0.2, 0.5, 0.7], 300).astype(dtype)        # ties
    idxs = rng.integers(0, 4, 300)
    dets, inds = bench.numpy_soft_nms(boxes, scores, idxs, 0.3, 0.5, 0.05, method)
    expected = mmdispatch.ops.batched_soft_nms(boxes, scores, idxs, 0.3, 0.5, 0.05, method)
    np.testing.assert_array_equal(inds, expected[1])
    if method == "gaussian":    # numpy's exp may differ from the C library's in the last bit
        np.testing.assert_allclose(dets, expected[0], rtol=1e-6)
    else:
        np.testing.assert_array_equal(dets, expected[0])
    cases = list(bench.soft_nms_cases(dict(bench.QUICK, soft_nms_boxes=50)))
    assert [name for name, *_ in cases] == [
        "soft_nms 50 boxes, 1 class, linear (vs vectorised numpy)",
        "batched soft_nms 50 boxes, 80 classes, linear (vs vectorised numpy)"]
    for _, ours, theirs, _ in cases:
        ours(), theirs()


def test_rotated_case_compares_with_a_numpy_implementation_that_computes_the_same():
    rng = np.random.default_rng(2)
    boxes = np.concatenate([rng.uniform(0, 6, (40, 2)), rng.uniform(0.2, 4, (40, 2)),
                            rng.uniform(-3, 3, (40, 1))], axis=1)
    turned = boxes[::-1].copy()
    turned[:5, 4] += np.pi / 2          # the same boxes, sides swapped
    turned[:5, 2:4] = turned[:5, 3:1:-1]
    np.testing.assert_allclose(bench.numpy_box_iou_rotated(boxes, turned, rows=7),
                               mmdispatch.ops.box_iou_rotated(boxes, turned), atol=1e-12)
    scores = rng.random(40)
    np.testing.assert_array_equal(bench.numpy_nms_rotated(boxes * [40, 40, 1, 1, 1], scores, 0.3),
                                  mmdispatch.ops.nms_rotated(boxes * [40, 40, 1, 1, 1], scores,
                                                             0.3))
    cases = list(bench.rotated_cases(dict(bench.QUICK, rotated_boxes=30, nms_boxes=50)))
    assert [name.split(" (")[0] for name, _, _, _ in cases] == [
        "box_iou_rotated 30x30", "nms_rotated 50 boxes, IoU 0.5"]
    for _, ours, theirs, _ in cases:
        ours()
        theirs()


def test_rotated_cases_on_a_device_time_ours_alone_each_call_waiting_for_the_device():
    synced = []
    cases = list(bench.rotated_cases(dict(bench.QUICK, rotated_boxes=30, nms_boxes=50),
                                     np.asarray, lambda: synced.append(1)))
    assert [(name, theirs) for name, _, theirs, _ in cases] == [
        ("box_iou_rotated 30x30", None), ("nms_rotated 50 boxes, IoU 0.5", None)]
    for _, ours, _, _ in cases:
        ours()
    assert synced == [1, 1]


def _run_files(tmp_path, capsys, rows_base, rows_new):
    """The base run as its --json file, the new one as the stderr log of a
    run cut short (the rows result_row printed as they were measured)."""
    report = {"results": [bench.result_row(*row) for row in rows_base]}
    base = tmp_path / "base.json"
    base.write_text(__import__("json").dumps(report))
    capsys.readouterr()
    for row in rows_new:
        bench.result_row(*row)
    new = tmp_path / "new.log"
    new.write_text("bench: roi_align ...\n" + capsys.readouterr().err + "Terminated\n")
    return base, new


def test_compare_sets_a_json_run_beside_a_log_cut_short_and_judges_beyond_torchvisions_drift(
        tmp_path, capsys):
    rows_base = [("CUDA a: forward", "s", 1e-3, 2e-3), ("CUDA b: forward", "s", 1e-3, 1e-3),
                 ("CUDA c: host", "s/call", 10e-6, None), ("gone", "s", 1.0, None),
                 ("CPU d: peak memory", "bytes", 2 * 2 ** 20, None)]
    rows_new = [("CUDA a: forward", "s", 0.5e-3, 2e-3),    # twice as fast, torchvision steady
                ("CUDA b: forward", "s", 1.2e-3, 1.2e-3),  # the machine drifted: no verdict
                ("CUDA c: host", "s/call", 12e-6, None),   # slower, nothing to drift against
                ("CPU d: peak memory", "bytes", 2 * 2 ** 20, None), ("added", "s", 1.0, None)]
    base, new = _run_files(tmp_path, capsys, rows_base, rows_new)
    rows = bench.load_results(new)
    assert rows["CUDA a: forward"]["mmdispatch"] == pytest.approx(0.5e-3)
    assert rows["CUDA a: forward"]["torchvision"] == pytest.approx(2e-3)
    assert rows["CPU d: peak memory"]["unit"] == "bytes"
    text = bench.compare_table(bench.load_results(base), rows, 0.05, ("base", "new"))
    lines = {line.split(" | ")[0][2:]: line for line in text.splitlines() if line.startswith("| ")}
    assert lines["CUDA a: forward"] == ("| CUDA a: forward | 1 ms | 0.5 ms | -50.0 % | +0.0 % | "
                                        "2.00x | 4.00x | faster |")
    assert lines["CUDA b: forward"].endswith("| +20.0 % | +20.0 % | 1.00x | 1.00x |  |")
    assert lines["CUDA c: host"].endswith("| +20.0 % | - | - | - | slower |")
    assert lines["CPU d: peak memory"].startswith("| CPU d: peak memory | 2.00 MiB | 2.00 MiB | "
                                                  "+0.0 % |")
    assert "only in base: gone" in text and "only in new: added" in text
    assert text.index("CUDA a") < text.index("CUDA b") < text.index("CUDA c")   # new's order


def test_compare_from_the_command_line_runs_nothing_and_refuses_what_is_not_a_run(
        tmp_path, capsys, monkeypatch):
    base, new = _run_files(tmp_path, capsys, [("x", "s", 1.0, 1.0)], [("x", "s", 2.0, 1.0)])
    monkeypatch.setattr(bench, "run", lambda **kw: pytest.fail("--compare ran the benchmarks"))
    assert bench.main(["--compare", str(base), str(new), "--threshold", "150"]) == 0
    out = capsys.readouterr().out
    assert "| benchmark | base.json | new.log |" in out
    assert "| x | 1.0000 s | 2.0000 s | +100.0 % | +0.0 % | 1.00x | 0.50x |  |" in out
    empty = tmp_path / "empty.log"
    empty.write_text("nothing measured\n")
    for paths in ([str(base), str(empty)], [str(base), str(tmp_path / "missing.json")]):
        with pytest.raises(SystemExit):
            bench.main(["--compare", *paths])
        assert "--compare" in capsys.readouterr().err


def test_tf32_cases_run_each_side_under_float32_matmul_precision_high_and_restore_it():
    """The CUDA deform_conv2d rows again with TF32 products on both sides:
    ours under mmdispatch's setting, torchvision's under torch's, each
    back to what it was after its call."""
    torch = pytest.importorskip("torch")
    seen = []

    def ours():
        seen.append(("ours", mmdispatch.get_float32_matmul_precision()))

    def theirs():
        seen.append(("theirs", torch.get_float32_matmul_precision()))

    cases = list(bench.tf32_cases([("deform_conv2d forward (x)", ours, theirs, None),
                                   ("alone", ours, None, 5)], (torch, None)))
    assert [(name, traffic) for name, _, _, traffic in cases] == [
        ("deform_conv2d forward (x), TF32 products (float32 matmul precision 'high')", None),
        ("alone, TF32 products (float32 matmul precision 'high')", 5)]
    assert cases[1][2] is None
    mmdispatch.set_float32_matmul_precision("medium")
    try:
        cases[0][1]()
        cases[0][2]()
        assert mmdispatch.get_float32_matmul_precision() == "medium"
    finally:
        mmdispatch.set_float32_matmul_precision("highest")
    assert seen == [("ours", "high"), ("theirs", "high")]
    assert torch.get_float32_matmul_precision() == "highest"
