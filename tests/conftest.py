import os
import sys

import numpy as np
import pytest

import mmdispatch

# tests/support on the path (appended: it shadows nothing) for the stand-in
# arrays that the tests and the tools there share
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
from stand_ins import FakeDeviceArray  # noqa: E402

try:
    from hypothesis import HealthCheck, settings
except ImportError:  # the property and fuzz tests skip themselves without hypothesis
    settings = None

if settings is not None:
    # "ci" (the default) keeps the whole suite within seconds on a 2-core
    # machine and is derandomized, so a CI run is reproducible; "thorough"
    # is for a long local run: HYPOTHESIS_PROFILE=thorough pytest tests/ops -k Properties
    # (HYPOTHESIS_MAX_EXAMPLES sets its examples per test, 2000 by default).
    # differing_executors: the property tests are methods that every op's
    # test class inherits (tests/support/properties.py), and pytest makes an
    # instance per test; none defines an executor (execute_example,
    # setup_example), so every call runs the same way.
    _common = dict(deadline=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.differing_executors])
    settings.register_profile("ci", max_examples=40, derandomize=True, database=None, **_common)
    settings.register_profile(
        "thorough", max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "2000")), **_common)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture(autouse=True)
def no_dispatch_layers_leak():
    """Every test leaves no hook and no fallback behind (they are
    process-wide); one that does fails, and they are removed."""
    yield
    leaked = (mmdispatch.hooks(), mmdispatch.registered_fallbacks())
    if leaked != ([], {}):
        for hook in leaked[0]:
            mmdispatch._core._remove_hook(hook)
        for device in leaked[1]:
            mmdispatch._core._remove_fallbacks(device)
        pytest.fail(f"the test left hooks {leaked[0]} or fallbacks {leaked[1]} behind")


@pytest.fixture
def cupy():
    """CuPy with a usable GPU and CUDA kernels, else the test is skipped.
    Afterwards the test's kernels are waited for, and a deferred error one of
    them left fails that test instead of a later one."""
    if not any(d["device"] == "cuda" and d["available"] for d in mmdispatch.devices()):
        status = [d["status"] for d in mmdispatch.devices() if d["device"] == "cuda"]
        pytest.skip(f"CUDA kernels unusable here: {status[0] if status else 'not built'}")
    cp = pytest.importorskip("cupy", reason="CuPy is not installed")
    yield cp
    mmdispatch.synchronize("cuda")


@pytest.fixture
def torch_cuda():
    """torch with a usable GPU and mmdispatch's CUDA kernels, else skipped:
    for dtypes only torch has on the GPU (bfloat16), handed over through
    DLPack. Afterwards the test's kernels are waited for, as with `cupy`."""
    if not any(d["device"] == "cuda" and d["available"] for d in mmdispatch.devices()):
        pytest.skip("CUDA kernels unusable here")
    torch = pytest.importorskip("torch", reason="torch is not installed")
    if not torch.cuda.is_available():
        pytest.skip("torch sees no GPU")
    yield torch
    mmdispatch.synchronize("cuda")


class DLPackOnly:
    """Wraps a numpy array so that only the DLPack protocol is visible, and
    only its unversioned form (__dlpack__ takes no max_version): the
    dispatcher's fallback for pre-1.0 exporters."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, stream=None):
        return self.array.__dlpack__()

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


@pytest.fixture(scope="session")
def cuda_emulator():
    """The CUDA kernels of src/cuda built for the CPU (tests/support/cuda_emu),
    else the test is skipped (a copy of tests/ without the sources, or no
    C++ compiler). `with cuda_emulator.active():` puts them in the CUDA
    slots; cuda_emu.DeviceView arrays reach them."""
    import cuda_emu

    reason = cuda_emu.unavailable_reason()
    if reason:
        pytest.skip(reason)
    return cuda_emu.load()


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


@pytest.fixture
def fake_array():
    """Factory for stand-in arrays on other devices: fake_array(2, 0)."""
    return FakeDeviceArray


@pytest.fixture
def dlpack_only():
    """Factory wrapping a numpy array behind the DLPack protocol only."""
    return DLPackOnly


def central_difference(f, x, eps=1e-6):
    """d f / d x by central differences, one element of x at a time."""
    numeric = np.zeros_like(x)
    for index in np.ndindex(x.shape):
        plus, minus = x.copy(), x.copy()
        plus[index] += eps
        minus[index] -= eps
        numeric[index] = (f(plus) - f(minus)) / (2 * eps)
    return numeric


@pytest.fixture
def numeric_gradient():
    """central_difference(f, x, eps=1e-6): finite-difference gradient of a
    scalar function of a float64 array."""
    return central_difference
