"""python -m mmdispatch info / demo."""
import json
import subprocess
import sys


def run(*args, cwd):
    # cwd outside the checkout, so `-m` imports the installed package
    return subprocess.run([sys.executable, "-m", "mmdispatch", *args], capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def test_info_prints_build_devices_and_registry(tmp_path):
    result = run("info", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    for expected in ("build:", "cuda:", "devices at run time:", "cpu: available",
                     "roi_align_forward_impl", "C src/cpu/roi_align.cpp:roi_align_forward_cpu",
                     "float32 matmul precision (CUDA cuBLAS products; mmdispatch.torch follows "
                     "torch's): highest"):
        assert expected in result.stdout


def test_demo_checks_pass(tmp_path):
    result = run("demo", cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    for op in ("roi_align", "nms", "bbox_overlaps", "sigmoid_focal_loss"):
        assert f"MMCV published {op} values: match" in result.stdout
    assert "demo: all checks passed" in result.stdout


def test_bench_quick_writes_a_result_for_every_benchmark(tmp_path):
    """Smoke test only: the suite runs and reports; timings are not judged."""
    out = tmp_path / "bench.json"
    result = run("bench", "--quick", "--repeat", "1", "--json", str(out), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    names = [row["benchmark"] for row in report["results"]]
    assert any(name.startswith("roi_align sampling_ratio=0 forward+backward") for name in names)
    assert any(name.startswith("nms") for name in names)
    assert "roi_pool forward+backward" in names
    assert "import mmdispatch (fresh interpreter)" in names
    assert "mid-size roi_align call p99, one other busy process" in names
    assert all(row["mmdispatch"] > 0 for row in report["results"])
    assert "| benchmark | mmdispatch |" in result.stdout
    cuda_rows = [name for name in names if name.startswith("CUDA ")]
    if report["cuda_skipped"]:   # no usable GPU or no CuPy: said so, and no CUDA rows
        assert not cuda_rows
        assert f"CUDA benchmarks skipped: {report['cuda_skipped']}" in result.stdout
    else:   # a GPU: 7 roi_align/roi_pool/nms benchmarks, 4 ps_roi_*, 2 deform_conv2d,
        # 2 multi_scale_deformable_attn, 2 rotated, 2 soft_nms, 3 with the deterministic
        # backend, 2 host costs, the call behind a long kernel
        assert len(cuda_rows) == 25, cuda_rows
        assert sum(name.endswith("deterministic backend") for name in cuda_rows) == 3
        assert "CUDA achieved memory bandwidth" in result.stdout
        assert any(name.endswith("returned before it finished: yes") for name in cuda_rows)
