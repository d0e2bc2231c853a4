"""Type stubs of mmdispatch._benchkit, the dispatch-overhead benchmark's
no-op kernel and raw Cython baseline."""
import sys
from typing import Any, SupportsFloat, SupportsIndex

import numpy as np
from typing import TypeAlias

if sys.version_info >= (3, 13):
    from types import CapsuleType as _Capsule
else:
    _Capsule: TypeAlias = Any

def noop_roi_align_forward_kernel() -> _Capsule:
    """A C kernel capsule for register_impl("roi_align_forward_impl", ...)."""

def raw_roi_align_forward(
    input: np.ndarray[Any, Any],
    rois: np.ndarray[Any, Any],
    output: np.ndarray[Any, Any],
    argmax_y: np.ndarray[Any, Any],
    argmax_x: np.ndarray[Any, Any],
    aligned_height: SupportsIndex,
    aligned_width: SupportsIndex,
    spatial_scale: SupportsFloat,
    sampling_ratio: SupportsIndex,
    pool_mode: SupportsIndex,
    aligned: bool,
) -> None:
    """No-op kernel call without the dispatcher (the benchmark's baseline)."""
