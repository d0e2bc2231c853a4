"""Every Python code block of the README runs as pasted, in a fresh
interpreter outside the source tree (so the installed package is the one
imported), and what its comments say of shapes and values holds."""
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
if not README.exists():   # a copy of tests/ alone, as the wheel build's test step runs it
    pytest.skip("no README.md beside tests/", allow_module_level=True)


def python_blocks():
    return re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


def test_the_readme_has_python_blocks():
    assert len(python_blocks()) >= 4


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs_as_pasted(index, tmp_path):
    code = python_blocks()[index]
    for layer in ("torch", "torchvision", "dask"):   # optional: the test extra has them
        if f"import {layer}" in code or f"from {layer}" in code:
            pytest.importorskip(layer, reason=f"{layer} is not installed (the test extra has it)")
    # what the comments promise, checked after the block has run
    checks = {
        "keep = nms(boxes, scores, 0.5)": "assert keep.tolist() == [0, 2]",
        "per_class = batched_nms(": "assert per_class.tolist() == [0, 1, 2]",
        "ious = bbox_overlaps(boxes, boxes[:2])": "assert ious.shape == (3, 2)",
        "pooled = roi_pool(": "assert pooled.shape == (1, 8, 7, 7)",
        "pooled[at] = roi_align(": "assert ious.shape == (len(keep), 4)",
        "keep = torchvision.ops.nms(boxes,": "assert keep.tolist() == [0, 2]",
        'program.save("head.onnx")': (
            "import numpy as np, onnxruntime; session = onnxruntime.InferenceSession('head.onnx'); "
            "got = session.run(None, {i.name: a.numpy() for i, a in "
            "zip(session.get_inputs(), args)}); want = Head()(*args); "
            "np.testing.assert_allclose(got[0], want[0].numpy(), rtol=1e-5, atol=1e-5); "
            "assert got[1].tolist() == want[1].tolist() == [0, 2]"),
        "model.roi_heads.box_roi_pool = MultiScaleRoIAlign(": (
            "assert isinstance(model.roi_heads.box_roi_pool, MultiScaleRoIAlign); "
            "assert len(detections) == 1 and detections[0]['boxes'].shape[1] == 4"),
    }
    extra = "\n".join(check for marker, check in checks.items() if marker in code)
    out = subprocess.run([sys.executable, "-c", code + "\n" + extra], cwd=tmp_path,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
