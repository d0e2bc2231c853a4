"""mmdispatch.ops._fastpath: the compiled helper of the roi ops' fast paths
takes exactly the common call and leaves every other one (None) to the op's
general path."""
import numpy as np
import pytest

from mmdispatch.ops._fastpath import box_pairs_output, index_like, nms_outputs, pooled_output


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size, hw", [(3, (3, 3)), ((2, 5), (2, 5)), ((1, 1), (1, 1))])
def test_pooled_output_allocates_the_k_c_h_w_output_of_the_input_dtype(dtype, size, hw):
    x = np.zeros((2, 3, 8, 8), dtype)
    for k in (0, 1, 4):
        output, h, w, empty = pooled_output(x, np.zeros((k, 5), dtype), size)
        assert type(output) is np.ndarray and output.shape == (k, 3, *hw)
        assert output.dtype == dtype and output.base is None
        assert output.flags.c_contiguous and output.flags.writeable and output.flags.owndata
        assert (h, w) == hw and type(h) is int and type(w) is int
        assert empty.shape == (0,) and empty.dtype == dtype


def test_pooled_output_shares_one_empty_array_per_dtype():
    x, rois = np.zeros((1, 1, 2, 2), np.float32), np.zeros((1, 5), np.float32)
    assert pooled_output(x, rois, 1)[3] is pooled_output(x, rois, 2)[3]
    assert pooled_output(x.astype(np.float64), rois.astype(np.float64), 1)[3].dtype == np.float64


def _not_plain():
    a = np.zeros((2, 3, 4, 6), np.float32)
    unaligned = np.frombuffer(bytearray(a.nbytes + 1), np.uint8)[1:].view(np.float32)

    class Sub(np.ndarray):
        pass

    return {
        "strided": a[:, :, :, ::2],
        "fortran": np.asfortranarray(a),
        "byteswapped": a.astype(">f4"),
        "subclass": a.view(Sub),
        "unaligned": unaligned.reshape(a.shape),
        "list": a.tolist(),
        "3-d": a[0],
        "5-d": a[None],
        "float16": a.astype(np.float16),
        "int32": a.astype(np.int32),
    }


@pytest.mark.parametrize("case", sorted(_not_plain()))
def test_pooled_output_leaves_inputs_that_are_not_plain_float_numpy(case):
    rois = np.zeros((1, 5), np.float32)
    assert pooled_output(_not_plain()[case], rois, 2) is None


@pytest.mark.parametrize("rois", [
    np.zeros((1, 4), np.float32),              # not (K, 5)
    np.zeros((1, 5, 1), np.float32),           # 3-d
    np.zeros(5, np.float32),                   # 1-d
    np.zeros((1, 5), np.float64),              # dtype differs from the input's
    np.zeros((5, 2), np.float32).T,            # F-order
    np.zeros((2, 10), np.float32)[:, ::2],     # strided
    [[0, 0, 0, 1, 1]],
])
def test_pooled_output_leaves_rois_that_are_not_plain_k_by_5_of_the_input_dtype(rois):
    assert pooled_output(np.zeros((1, 1, 4, 4), np.float32), rois, 2) is None


@pytest.mark.parametrize("size", [0, -1, (0, 2), (2, -3), True, (True, 2), 2.0, (2, 2.0),
                                  [2, 2], (2, 2, 2), (2,), 2 ** 40, (2 ** 31, 1), "2", None])
def test_pooled_output_leaves_sizes_that_are_not_positive_ints(size):
    x, rois = np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 5), np.float32)
    assert pooled_output(x, rois, size) is None


def test_pooled_output_leaves_an_output_numpy_cannot_allocate():
    """An output past numpy's size limit is left to the general path, which
    raises the error naming the op."""
    x, rois = np.zeros((1, 2 ** 20, 1, 1), np.float32), np.zeros((1, 5), np.float32)
    assert pooled_output(x, rois, (2 ** 29, 2 ** 29)) is None


@pytest.mark.parametrize("shape", [(2, 3, 4, 5), (0, 3, 2, 2), (7,), ()])
def test_index_like_allocates_int64_of_the_same_shape(shape):
    array = np.zeros(shape, np.float32)
    index = index_like(array)
    assert type(index) is np.ndarray and index.shape == shape and index.dtype == np.int64
    assert index.flags.c_contiguous and index.flags.writeable and index.flags.owndata


@pytest.mark.parametrize("bad", [None, [1, 2], 3])
def test_index_like_takes_only_numpy_arrays(bad):
    with pytest.raises(TypeError):
        index_like(bad)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [0, 1, 5])
def test_nms_outputs_allocates_keep_and_a_zero_count(dtype, n):
    keep, num_kept = nms_outputs(np.zeros((n, 4), dtype), np.zeros(n, dtype))
    assert keep.shape == (n,) and keep.dtype == np.int64 and keep.flags.owndata
    assert num_kept.shape == (1,) and num_kept.dtype == np.int64 and num_kept[0] == 0


@pytest.mark.parametrize("boxes, scores", [
    (np.zeros((3, 4), np.float32), np.zeros(3, np.float64)),      # dtypes differ
    (np.zeros((3, 4), np.float16), np.zeros(3, np.float16)),      # not float32/64
    (np.zeros((3, 4), np.int64), np.zeros(3, np.int64)),
    (np.zeros((3, 5), np.float32), np.zeros(3, np.float32)),      # not (N, 4)
    (np.zeros((3, 4, 1), np.float32), np.zeros(3, np.float32)),
    (np.zeros(4, np.float32), np.zeros(1, np.float32)),
    (np.zeros((3, 4), np.float32), np.zeros(2, np.float32)),      # N differs
    (np.zeros((3, 4), np.float32), np.zeros((3, 1), np.float32)),
    (np.zeros((3, 8), np.float32)[:, ::2], np.zeros(3, np.float32)),   # strided
    (np.zeros((3, 4), np.float32), np.zeros(6, np.float32)[::2]),
    (np.zeros((3, 4), ">f4"), np.zeros(3, ">f4")),                # byte-swapped
    (np.zeros((3, 4), np.float32).tolist(), np.zeros(3, np.float32)),
    (np.zeros((3, 4), np.float32), None),
])
def test_nms_outputs_leaves_every_other_call(boxes, scores):
    assert nms_outputs(boxes, scores) is None


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n, m", [(0, 0), (3, 5), (4, 4), (0, 2)])
def test_box_pairs_output_allocates_n_by_m_or_n_when_aligned(dtype, n, m):
    b1, b2 = np.zeros((n, 4), dtype), np.zeros((m, 4), dtype)
    ious = box_pairs_output(b1, b2, False)
    assert ious.shape == (n, m) and ious.dtype == dtype and ious.flags.owndata
    if n == m:
        aligned = box_pairs_output(b1, b2, True)
        assert aligned.shape == (n,) and aligned.dtype == dtype


@pytest.mark.parametrize("b1, b2, aligned", [
    (np.zeros((3, 4), np.float32), np.zeros((2, 4), np.float32), True),    # aligned, N != M
    (np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32), 1),       # not a bool
    (np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32), np.bool_(True)),
    (np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float64), False),   # dtypes differ
    (np.zeros((3, 4), np.float16), np.zeros((3, 4), np.float16), False),
    (np.zeros((3, 5), np.float32), np.zeros((3, 4), np.float32), False),   # not (N, 4)
    (np.zeros((3, 4), np.float32), np.zeros((3, 3), np.float32), False),
    (np.zeros(4, np.float32), np.zeros((3, 4), np.float32), False),
    (np.zeros((4, 3), np.float32).T, np.zeros((3, 4), np.float32), False),  # F-order
    (np.zeros((3, 4), np.float32), np.zeros((3, 4), np.float32).tolist(), False),
])
def test_box_pairs_output_leaves_every_other_call(b1, b2, aligned):
    assert box_pairs_output(b1, b2, aligned) is None

