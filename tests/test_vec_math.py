"""The CPU kernels' vector exp and log1p (src/cpu/vec_math.h, through
tools/vec_math_accuracy.py; log1p on [0, 1] and, wide, on [0, kWide]):
within 1.2 ulp (wide: 1.3) of the exact values over the domain the focal
losses give them, and the same bits from every x86 clone (SSE2, SSE4.2,
AVX2) of the kernels that use them."""
import pathlib
import shutil
import sys

import pytest

TOOLS = pathlib.Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture(scope="module")
def accuracy():
    if not (TOOLS / "vec_math_accuracy.py").exists():
        pytest.skip("a copy of tests/ without the tools")
    if shutil.which("g++") is None:
        pytest.skip("no g++ to compile the driver with")
    sys.path.insert(0, str(TOOLS))
    try:
        import vec_math_accuracy
    finally:
        sys.path.remove(str(TOOLS))
    return vec_math_accuracy.measure(200_000)


def test_vector_exp_and_log1p_are_within_1_2_ulp_and_wide_log1p_1_3_of_the_exact_values(
        accuracy):
    for by_type in accuracy.values():
        for dtype, (exp_ulps, log_ulps, wide_ulps, _) in by_type.items():
            assert exp_ulps <= 1.2 and log_ulps <= 1.2 and wide_ulps <= 1.3, \
                (dtype, exp_ulps, log_ulps, wide_ulps)


def test_every_instruction_set_gives_the_same_bits(accuracy):
    digests = {dtype: {sets[dtype][-1] for sets in accuracy.values()}
               for dtype in ("float", "double")}
    assert all(len(found) == 1 for found in digests.values()), digests
