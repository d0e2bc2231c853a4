"""mmdispatch.profile (mmdispatch/profiler.py): records, the per-op table,
the Chrome trace, and CUDA device times on a GPU."""
import json
import re
import threading

import numpy as np
import pytest

import mmdispatch
from mmdispatch import ops


def workload(repeat=3):
    x = np.ones((2, 4, 16, 16), np.float32)
    rois = np.array([[0, 0, 0, 9, 9], [1, 2, 2, 12, 15]], np.float32)
    boxes = np.random.default_rng(0).random((50, 4), dtype=np.float32) * 10
    boxes[:, 2:] += boxes[:, :2]
    for _ in range(repeat):
        ops.roi_align(x, rois, 7, sampling_ratio=2)
        ops.nms(boxes, np.linspace(1, 0, 50, dtype=np.float32), 0.5)
    ops.bbox_overlaps(boxes, boxes)


def test_profile_records_every_call_with_op_device_backend_dtypes_and_shapes():
    with mmdispatch.profile() as p:
        workload()
    assert [c.op for c in p.calls] == ["roi_align_forward_impl", "nms_impl"] * 3 + [
        "bbox_overlaps_impl"]
    first = p.calls[0]
    assert (first.device, first.backend, first.kernel) == ("cpu", "default", "C")
    assert first.shapes[:3] == ((2, 4, 16, 16), (2, 5), (2, 4, 7, 7))
    assert first.dtypes[:3] == ("float32",) * 3
    assert all(c.host_ns >= 0 for c in p.calls)
    assert mmdispatch.hooks() == []


def test_profile_stops_recording_at_the_end_of_its_block():
    with mmdispatch.profile() as p:
        workload(1)
    workload(1)
    assert len(p.calls) == 3


def test_the_table_sums_per_op_sorted_by_total_time():
    with mmdispatch.profile() as p:
        workload()
    rows = p.summary()
    assert {r["op"]: r["calls"] for r in rows} == {"roi_align_forward_impl": 3, "nms_impl": 3,
                                                   "bbox_overlaps_impl": 1}
    totals = [r["host_ns"] for r in rows]
    assert totals == sorted(totals, reverse=True)
    for row in rows:
        assert row["host_ns"] == sum(c.host_ns for c in p.calls if c.op == row["op"])
        assert row["device_ns"] is None and row["errors"] == 0
    lines = p.table().splitlines()
    assert lines[0].split() == ["op", "calls", "host", "total", "host", "mean", "device",
                                "total", "errors"]
    assert [line.split()[0] for line in lines[2:]] == [r["op"] for r in rows]
    assert str(p) == p.table()


def test_failed_calls_are_counted_as_errors():
    with mmdispatch.profile() as p:
        with pytest.raises(ValueError):
            ops.roi_align(np.zeros((1, 1, 4, 4), np.float32),
                          np.array([[3, 0, 0, 1, 1]], np.float32), 2)
    row, = p.summary()
    assert row["errors"] == 1 and isinstance(p.calls[0].error, ValueError)


def test_export_chrome_trace_writes_complete_events_per_thread(tmp_path):
    with mmdispatch.profile() as p:
        workload(1)
        worker = threading.Thread(target=workload, args=(1,))
        worker.start()
        worker.join()
    path = p.export_chrome_trace(tmp_path / "trace.json")
    trace = json.loads(path.read_text())
    calls = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(calls) == len(p.calls) == 6
    assert {e["tid"] for e in calls} == {threading.get_ident(), worker.ident}
    for event, call in zip(calls, p.calls):
        assert event["name"] == call.op and event["cat"] == "host"
        assert event["ts"] == call.start_ns / 1e3 and event["dur"] == call.host_ns / 1e3
        assert event["args"]["device"] == "cpu" and event["args"]["kernel"] == "C"
    assert calls[0]["args"]["shapes"]["input"] == [2, 4, 16, 16]
    assert trace["displayTimeUnit"] == "ms"


def test_start_and_stop_without_a_with_block():
    p = mmdispatch.profile().start()
    with pytest.raises(RuntimeError, match="already started"):
        p.start()
    workload(1)
    p.stop()
    p.stop()
    assert len(p.calls) == 3 and mmdispatch.hooks() == []


def test_device_times_of_cuda_calls(cupy):
    x = cupy.ones((2, 64, 50, 50), cupy.float32)
    rois = cupy.asarray([[0, 0, 0, 30, 30], [1, 5, 5, 45, 40]] * 64, cupy.float32)
    with mmdispatch.profile() as p:
        for _ in range(3):
            ops.roi_align(x, rois, 7, sampling_ratio=2)
    assert all(c.device == "cuda:0" and c.stream is not None for c in p.calls)
    row, = p.summary()
    assert row["calls"] == 3 and row["device_ns"] > 0
    cells = re.split(r"\s{2,}", p.table().splitlines()[2].strip())
    assert cells[0] == "roi_align_forward_impl" and cells[4].endswith(" ms")   # device total


def test_device_times_of_torch_cuda_calls_come_from_torch_events_without_cupy(torch_cuda,
                                                                              monkeypatch):
    """A PyTorch user's process need not import CuPy: the device times then
    come from torch's CUDA events on the kernel's stream (torch's current
    stream, where mmdispatch.torch launches)."""
    import sys

    import mmdispatch.torch as mt
    monkeypatch.setitem(sys.modules, "cupy", None)   # as if CuPy were never imported
    torch = torch_cuda
    x = torch.ones((2, 64, 50, 50), device="cuda")
    rois = torch.tensor([[0, 0, 0, 30, 30], [1, 5, 5, 45, 40]] * 64, device="cuda")
    side = torch.cuda.Stream()
    with mmdispatch.profile() as p, torch.cuda.stream(side):
        for _ in range(3):
            mt.roi_align(x, rois, 7, 1.0, 2)
    assert [c.notes["profile_events"].library for c in p.calls] == ["torch"] * 3
    assert all(c.device == "cuda:0" and c.stream == side.cuda_stream for c in p.calls)
    row, = p.summary()
    assert row["calls"] == 3 and row["device_ns"] > 0
