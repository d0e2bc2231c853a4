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
    assert [name for name, _, _ in cases] == [
        "roi_align sampling_ratio=2 forward", "roi_align sampling_ratio=2 forward+backward",
        "roi_align sampling_ratio=0 forward", "roi_align sampling_ratio=0 forward+backward",
        "nms 40 boxes, IoU 0.5"]
    assert (1, 2, 16, 24) in moved and (6, 5) in moved and (40, 4) in moved
    for _, ours, theirs in cases:
        before = len(waits)
        ours()
        assert len(waits) == before + 1
        assert theirs is None   # no torch device given


def test_device_call_costs_time_both_host_costs_and_restore_the_registry():
    waits = []
    before = mmdispatch.registry_table()
    costs = bench.device_call_costs(np.asarray, lambda: waits.append(1), "cpu", number=20)
    assert set(costs) == {"no-op kernel through roi_align_forward_impl (host)",
                          "roi_align call, tiny input (host, launches included)"}
    assert all(seconds > 0 for seconds in costs.values())
    assert waits   # one wait per batch of calls
    assert mmdispatch.registry_table() == before   # the no-op kernel is gone again


def test_cuda_part_says_why_it_is_skipped_where_it_cannot_run():
    cupy, reason = bench.cuda_runtime()
    if cupy is not None:
        pytest.skip("CUDA kernels and CuPy are usable here: the GPU part runs")
    rows, skipped = bench.run_cuda(True, 1, None)
    assert rows is None and skipped == reason
    assert "CUDA" in reason or "CuPy" in reason
