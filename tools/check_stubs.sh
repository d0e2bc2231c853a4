#!/usr/bin/env bash
# Checks the type stubs of an installed mmdispatch (run it with the Python of
# the environment it is installed in; needs mypy: pip install mypy):
#   1. mypy --strict accepts a snippet that uses the API as the README does;
#   2. mypy rejects misuse (each bad line carries the `type: ignore` it must
#      need; --strict turns an unneeded one into an error);
#   3. stubtest compares the stubs with the runtime modules.
#   PYTHON=.venv/bin/python tools/check_stubs.sh
set -euo pipefail
python=${PYTHON:-python3}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"  # not the source tree: check the installed package

cat > use_api.py <<'PY'
import numpy as np

import mmdispatch
from mmdispatch import _core

x = np.zeros((1, 2, 4, 4), dtype=np.float32)
rois = np.array([[0, 0, 0, 3, 3]], dtype=np.float32)
out = np.zeros((1, 2, 2, 2), dtype=np.float32)
mmdispatch.roi_align_forward_impl(x, rois, out, np.zeros_like(out), np.zeros_like(out),
                                  2, 2, 1.0, 0, 1, True)
_core.nms_impl(rois[:, 1:], rois[:, 0], None, np.zeros(1, np.int64), np.zeros(1, np.int64),
               0.5, 0)
with mmdispatch.use_backend("cpu", "reference"):
    backend: str = mmdispatch.get_backend("cpu")


def kernel(*args: object) -> str:
    return "python"


with mmdispatch.register_impl("roi_align_forward_impl", "vulkan", kernel) as handle:
    active: bool = handle.active
rows = [(row["op"], row["active"]) for row in mmdispatch.registry_table()]
available = [device["available"] for device in mmdispatch.devices()]
signatures: dict[str, str] = mmdispatch.op_signatures()
version: str = mmdispatch.__version__
PY

cat > misuse.py <<'PY'
import numpy as np

import mmdispatch

x = np.zeros((1, 2, 4, 4), dtype=np.float32)
mmdispatch.roi_align_forward_impl(x, x, x, x, x, 2, 2, 1.0, 0, 1)  # type: ignore[call-arg]
mmdispatch.roi_align_forward_impl(x, None, x, x, x, 2, 2, 1.0, 0, 1, True)  # type: ignore[arg-type]
mmdispatch.bbox_overlaps_impl(x, x, x, "iou", False, 0)  # type: ignore[arg-type]
mmdispatch.register_impl("nms_impl", "cpu", print, overide=True)  # type: ignore[call-arg]
mmdispatch.no_such_entry_point(x)  # type: ignore[attr-defined]
n: int = mmdispatch.backends()  # type: ignore[assignment]
PY

# - Cython adds __test__ to every module and the pickling pair to every cdef
#   class; the stubs leave them out.
# - The cdef classes are not marked @disjoint_base (PEP 800), which type
#   checkers older than the marker would not know.
# - `except ImportError as exc` at module level (torch, dask): mypy keeps
#   `exc` as a module attribute; Python deletes it after the except block.
# - _Tensor is torch.Tensor itself: its reflected operators differ between
#   torch's own stubs and its runtime, which is torch's business.
# - functools.lru_cache and staticmethod(f) class attributes: stubtest
#   compares the wrapper's type with the wrapped function's.
cat > allowlist.txt <<'TXT'
mmdispatch\.(_core|_benchkit)\.__test__
mmdispatch\._core\.(\w+\.)?__(reduce|setstate)_cython__
mmdispatch\._core\.(BoxedCall|CallRecord|FallbackHandle|HookHandle|KernelHandle|OpRegistry)
mmdispatch\.(torch|dask)\.exc
mmdispatch\.torch\._library\._Tensor\..*
mmdispatch\.torch\._library\._madvise
mmdispatch\.torch\.mmcv\.(SigmoidFocalLoss|SoftmaxFocalLoss)\.loss
mmdispatch\.torch\.mmcv\.MultiScaleDeformableAttnFunction\.apply
TXT
# The package's optional imports (cupy, torch) need not be installed;
# without torch the PyTorch layer (mmdispatch.torch) cannot be imported.
printf '[mypy]\nignore_missing_imports = True\n' > mypy.ini
if ! "$python" -c "import torch" 2>/dev/null; then
    echo 'mmdispatch\.torch(\..*)?' >> allowlist.txt
fi

"$python" -m mypy --strict --config-file mypy.ini use_api.py misuse.py
"$python" -m mypy.stubtest --mypy-config-file mypy.ini --allowlist allowlist.txt mmdispatch
