"""python -m mmdispatch info / demo."""
import subprocess
import sys


def run(*args):
    return subprocess.run([sys.executable, "-m", "mmdispatch", *args], capture_output=True,
                          text=True, timeout=300)


def test_info_prints_build_devices_and_registry():
    result = run("info")
    assert result.returncode == 0, result.stderr
    for expected in ("build:", "cuda:", "devices at run time:", "cpu: available",
                     "roi_align_forward_impl", "C src/cpu/roi_align.c:roi_align_forward_cpu"):
        assert expected in result.stdout


def test_demo_checks_pass():
    result = run("demo")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "MMCV published roi_align values: match" in result.stdout
    assert "demo: all checks passed" in result.stdout
