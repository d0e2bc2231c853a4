"""mmdispatch.dask on a real dask.distributed LocalCluster (2 worker
processes, started and stopped by this module): blockwise bbox_overlaps,
NMS per image over Bags and DataFrames, equal to the single-process ops;
the ops' errors reach the client."""
import re

import numpy as np
import pytest

import mmdispatch
from mmdispatch import ops

da = pytest.importorskip("dask.array", reason="Dask is not installed (extra 'dask')")
db = pytest.importorskip("dask.bag")
dd = pytest.importorskip("dask.dataframe")
distributed = pytest.importorskip("distributed")
pd = pytest.importorskip("pandas")
mdask = pytest.importorskip("mmdispatch.dask")


@pytest.fixture(scope="module")
def client():
    """A LocalCluster of 2 worker processes, one thread each."""
    with distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True,
                                  dashboard_address=None) as cluster:
        with distributed.Client(cluster) as client:
            yield client


def random_boxes(rng, n, dtype=np.float32, extent=1000.0, size=100.0):
    boxes = rng.random((n, 4), dtype=np.float64) * extent
    boxes[:, 2:] = boxes[:, :2] + rng.random((n, 2)) * size
    return boxes.astype(dtype)


def test_row_maxima_of_a_100k_by_100k_iou_equal_the_single_process_op(client):
    rng = np.random.default_rng(0)
    a = random_boxes(rng, 100_000, extent=3000.0)
    b = random_boxes(rng, 100_000, extent=3000.0)
    lazy = mdask.bbox_overlaps(da.from_array(a, chunks=(5000, 4)),
                               da.from_array(b, chunks=(5000, 4))).max(axis=1)
    assert isinstance(lazy, da.Array) and lazy.shape == (100_000,)
    got = lazy.compute()
    expected = np.concatenate([ops.bbox_overlaps(a[i:i + 2500], b).max(axis=1)
                               for i in range(0, len(a), 2500)])
    np.testing.assert_array_equal(got, expected)
    assert (got > 0).any()


@pytest.mark.parametrize("mode", ["iou", "iof"])
@pytest.mark.parametrize("chunks", [(7, 4), (50, 2)])
def test_the_blockwise_matrix_equals_the_op(client, mode, chunks):
    rng = np.random.default_rng(1)
    a, b = random_boxes(rng, 53, np.float64, 50, 30), random_boxes(rng, 41, np.float64, 50, 30)
    lazy = mdask.bbox_overlaps(da.from_array(a, chunks=chunks), da.from_array(b, chunks=(9, 4)),
                               mode, offset=1)
    assert lazy.chunks[0] == da.from_array(a, chunks=chunks).chunks[0]
    np.testing.assert_array_equal(lazy.compute(), ops.bbox_overlaps(a, b, mode, offset=1))


def test_aligned_overlaps_rechunk_the_second_array_to_the_first(client):
    rng = np.random.default_rng(2)
    a, b = random_boxes(rng, 30, extent=20), random_boxes(rng, 30, extent=20)
    lazy = mdask.bbox_overlaps(da.from_array(a, chunks=8), da.from_array(b, chunks=13),
                               aligned=True)
    np.testing.assert_array_equal(lazy.compute(), ops.bbox_overlaps(a, b, aligned=True))


def test_a_wrong_box_width_raises_the_ops_error_at_the_call_when_it_is_known():
    a = da.zeros((10, 3), chunks=5, dtype=np.float32)
    with pytest.raises(ValueError, match=r"bbox_overlaps_impl: bboxes1 must have shape "
                                         r"\(\*, 4\), got \(0, 3\)"):
        mdask.bbox_overlaps(a, da.zeros((4, 4), chunks=2, dtype=np.float32))
    with pytest.raises(ValueError, match=re.escape(
            "bbox_overlaps_impl: aligned=True needs as many bboxes1 as bboxes2, got 4 and 5")):
        mdask.bbox_overlaps(da.zeros((4, 4), chunks=2), da.zeros((5, 4), chunks=2),
                            aligned=True)   # the real lengths (it said 0 and 1)


def test_a_chunk_of_the_wrong_width_raises_the_ops_error_on_the_client(client):
    # chunks that claim width 4 and hold 3 columns: only the task can tell
    lying = da.zeros((10, 3), chunks=5, dtype=np.float32).map_blocks(
        lambda x: x, chunks=((5, 5), (4,)), dtype=np.float32)
    lazy = mdask.bbox_overlaps(lying, da.zeros((4, 4), chunks=2, dtype=np.float32))
    with pytest.raises(ValueError, match=r"bbox_overlaps_impl: bboxes1 must have shape "
                                         r"\(\*, 4\), got \(5, 3\)"):
        lazy.compute()


def detections(seed, images, per_image, classes=5):
    rng = np.random.default_rng(seed)
    return [{"image_id": i, "boxes": random_boxes(rng, per_image, extent=600.0, size=120.0),
             "scores": rng.random(per_image, dtype=np.float32),
             "labels": rng.integers(0, classes, per_image)} for i in range(images)]


@pytest.mark.filterwarnings("ignore:Sending large graph")   # the records are in the graph
def test_nms_over_a_bag_of_2000_images_of_1000_boxes_equals_the_op_per_image(client):
    records = detections(3, 2000, 1000)
    lazy = mdask.nms(db.from_sequence(records, npartitions=16), 0.5)
    assert isinstance(lazy, db.Bag)
    kept = lazy.compute()
    assert len(kept) == 2000
    for got, record in zip(kept, records):
        keep = ops.nms(record["boxes"], record["scores"], 0.5)
        assert got["image_id"] == record["image_id"]
        for field in ("boxes", "scores", "labels"):
            np.testing.assert_array_equal(got[field], record[field][keep])


def test_batched_nms_over_a_bag_keeps_classes_apart(client):
    records = detections(4, 40, 300)
    kept = mdask.batched_nms(db.from_sequence(records, npartitions=4), 0.3).compute()
    for got, record in zip(kept, records):
        keep = ops.batched_nms(record["boxes"], record["scores"], record["labels"], 0.3)
        np.testing.assert_array_equal(got["boxes"], record["boxes"][keep])
        np.testing.assert_array_equal(got["labels"], record["labels"][keep])


def rows_of(records):
    return pd.DataFrame({
        "image_id": np.concatenate([np.full(len(r["scores"]), r["image_id"]) for r in records]),
        **{name: np.concatenate([r["boxes"][:, j] for r in records])
           for j, name in enumerate(("x1", "y1", "x2", "y2"))},
        "scores": np.concatenate([r["scores"] for r in records]),
        "labels": np.concatenate([r["labels"] for r in records]),
    })


@pytest.mark.parametrize("batched", [False, True])
def test_nms_over_a_dataframe_grouped_by_image_returns_the_kept_rows(client, batched):
    rows = rows_of(detections(5, 300, 200))
    frame = dd.from_pandas(rows, npartitions=7)
    lazy = (mdask.batched_nms(frame, 0.5) if batched else mdask.nms(frame, 0.5))
    assert isinstance(lazy, dd.DataFrame)
    got = lazy.compute()
    expected = []
    for _, group in rows.groupby("image_id"):
        coordinates = group[["x1", "y1", "x2", "y2"]].to_numpy()
        keep = (ops.batched_nms(coordinates, group["scores"].to_numpy(),
                                group["labels"].to_numpy(), 0.5) if batched
                else ops.nms(coordinates, group["scores"].to_numpy(), 0.5))
        expected.append(group.iloc[keep])
    pd.testing.assert_frame_equal(got.sort_index(), pd.concat(expected).sort_index())


def test_nms_errors_reach_the_client(client):
    records = detections(6, 4, 10)
    records[2]["boxes"] = records[2]["boxes"][:, :3]   # a record with the wrong box width
    with pytest.raises(ValueError, match=r"^nms"):
        mdask.nms(db.from_sequence(records, npartitions=2), 0.5).compute()
    frame = dd.from_pandas(rows_of(detections(7, 3, 5)), npartitions=2)
    with pytest.raises(ValueError, match=r"nms: the detections have no column\(s\) \['score'\]"):
        mdask.nms(frame, 0.5, scores="score")
    with pytest.raises(TypeError, match="nms: detections must be a dask Bag"):
        mdask.nms([1, 2], 0.5)


def test_dataframe_nms_takes_the_ops_classes_and_keeps_images_without_an_id(client):
    """The class column goes to ops.batched_nms as it is, which refuses a
    float one as it refuses float idxs (an int64 conversion merged 0.5
    into 0); rows whose image id is NaN are an image of their own (they
    were dropped by groupby)."""
    frame = pd.DataFrame(dict(image_id=[0.0, 0.0, np.nan], x1=[1.0, 1, 1], y1=[1.0, 1, 1],
                              x2=[10.0, 10, 10], y2=[10.0, 10, 10], scores=[0.9, 0.8, 0.7],
                              labels=[0.0, 0.5, 0.0]))
    lazy = dd.from_pandas(frame, npartitions=1)
    with pytest.raises(TypeError, match="batched_nms: idxs must have an integer dtype"):
        mdask.batched_nms(lazy, 0.5).compute()
    kept = mdask.nms(lazy, 0.5).compute()
    assert sorted(kept.index.tolist()) == [0, 2]
    frame["labels"] = [False, True, False]   # a bool column: two classes
    kept = mdask.batched_nms(dd.from_pandas(frame, npartitions=1), 0.5).compute()
    assert sorted(kept.index.tolist()) == [0, 1, 2]


def test_the_workers_ran_the_tasks(client):
    """The cluster is real: two worker processes, each with mmdispatch."""
    versions = client.run(lambda: __import__("mmdispatch").__version__)
    assert len(versions) == 2 and set(versions.values()) == {mmdispatch.__version__}


def test_misaligned_chunks_from_the_network_are_copied_not_refused():
    raw = np.zeros(4 * 4 * 5 + 1, np.uint8)
    boxes = raw[1:].view(np.float32).reshape(5, 4)   # a float32 array at an odd address
    boxes[:, 2:] = 1
    assert not boxes.flags.aligned
    record = {"boxes": boxes, "scores": np.ones(5, np.float32)}
    kept = mdask.nms(db.from_sequence([record]), 0.5).compute(scheduler="sync")
    np.testing.assert_array_equal(kept[0]["boxes"], boxes[:1])
    np.testing.assert_array_equal(
        mdask.bbox_overlaps(da.from_array(boxes, chunks=2), boxes).compute(scheduler="sync"),
        ops.bbox_overlaps(boxes.copy(), boxes.copy()))


def test_cupy_chunks_run_the_cuda_kernel_and_stay_on_the_gpu(cupy):
    rng = np.random.default_rng(8)
    a, b = random_boxes(rng, 300), random_boxes(rng, 200)
    lazy = mdask.bbox_overlaps(da.from_array(cupy.asarray(a), chunks=(64, 4), asarray=False),
                               da.from_array(cupy.asarray(b), chunks=(50, 4), asarray=False))
    assert isinstance(lazy._meta, cupy.ndarray)
    got = lazy.max(axis=1).compute(scheduler="sync")
    assert isinstance(got, cupy.ndarray)
    expected = ops.bbox_overlaps(cupy.asarray(a), cupy.asarray(b)).max(axis=1)
    cupy.testing.assert_array_equal(got, expected)
