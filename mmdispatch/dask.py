"""mmdispatch's ops on Dask collections, for datasets beyond one machine:
pairwise overlaps of millions of boxes, and NMS over every image of a
dataset. Needs the optional extra: ``pip install mmdispatch[dask]``.

- ``bbox_overlaps(a, b)``: dask arrays of boxes (N, 4) and (M, 4), numpy or
  CuPy chunks; block (i, j) of the (N, M) result is ops.bbox_overlaps of
  row-block i of a and row-block j of b, computed by one task, so no more
  than one block pair is ever in memory per task. Reductions fuse into that
  task: ``bbox_overlaps(a, b).max(axis=1)`` never materialises the matrix.
- ``nms`` / ``batched_nms``: over a dask Bag of per-image records (dicts
  with ``boxes``, ``scores`` and any other per-box arrays, as a detector
  returns them), or over a dask DataFrame of detection rows grouped by an
  image-id column. The kept rows come back lazily, as the same kind of
  collection.

Everything is lazy; ``.compute()`` runs it on the current scheduler, a
``dask.distributed`` cluster included. Errors of the ops (a wrong box
width, a bad dtype) are raised by the call where the shapes are known
here, else by the task, and Dask re-raises them on the client.
"""
import warnings

import numpy as np

try:
    import dask.array as da
    import dask.bag as db
    from dask.array import PerformanceWarning
except ImportError as exc:   # pragma: no cover - the extra is not installed
    raise ImportError("mmdispatch.dask needs Dask: pip install 'mmdispatch[dask]'") from exc

from mmdispatch import ops

__all__ = ["batched_nms", "bbox_overlaps", "nms"]


def _aligned(x):
    """x, or an aligned copy of a numpy array that is not: a chunk that
    arrived over the network (pickle's out-of-band buffers) may sit at any
    address, and the kernels refuse misaligned data."""
    if isinstance(x, np.ndarray) and not x.flags.aligned:
        return x.copy()
    return x


def _overlaps_block(a, b, mode, aligned, offset):
    return ops.bbox_overlaps(_aligned(a), _aligned(b), mode, aligned, offset)


def _as_boxes(x):
    return x if isinstance(x, da.Array) else da.asarray(x)


def _check(a, b, mode, aligned, offset):
    """The op's own checks and errors, on empty arrays of the inputs'
    widths and dtypes, where the widths are known."""
    if any(np.isnan(s) for s in (*a.shape[1:], *b.shape[1:])):
        return
    empty = [np.empty((0,) + tuple(x.shape[1:]), x.dtype) for x in (a, b)]
    _overlaps_block(empty[0], empty[1], mode, aligned, offset)
    if aligned and not (np.isnan(a.shape[0]) or np.isnan(b.shape[0])) \
            and a.shape[0] != b.shape[0]:   # the op's length error, with the real lengths
        raise ValueError(f"bbox_overlaps_impl: aligned=True needs as many bboxes1 as bboxes2, "
                         f"got {a.shape[0]} and {b.shape[0]}")


def bbox_overlaps(bboxes1, bboxes2, mode="iou", aligned=False, offset=0):
    """ops.bbox_overlaps on dask arrays, blockwise: (N, M) chunked like
    bboxes1's rows by bboxes2's rows, or (N,) with ``aligned=True`` (then
    bboxes2 is rechunked to bboxes1's rows)."""
    a, b = _as_boxes(bboxes1), _as_boxes(bboxes2)
    _check(a, b, mode, aligned, offset)
    if a.ndim != 2 or b.ndim != 2:
        raise ValueError(f"bbox_overlaps: bboxes1 and bboxes2 must be 2-D (N, 4), got shapes "
                         f"{a.shape} and {b.shape}")
    a, b = a.rechunk({1: -1}), b.rechunk({1: -1})
    meta = a._meta[:0, :0]   # the chunks' library (numpy or CuPy)
    if aligned:
        b = b.rechunk({0: a.chunks[0]})
        return da.map_blocks(_overlaps_block, a, b, mode, True, offset, drop_axis=1,
                             dtype=a.dtype, meta=meta.reshape((0,)))
    with warnings.catch_warnings():
        # an outer product has (blocks of a) x (blocks of b) blocks: that is the point
        warnings.simplefilter("ignore", PerformanceWarning)
        return da.blockwise(_overlaps_block, "ij", a, "ik", b, "jk", concatenate=True,
                            dtype=a.dtype, meta=meta, mode=mode, aligned=False, offset=offset)


# ---- NMS over many images

def _per_box(record, n):
    """The fields of a record that hold one entry per box."""
    return [k for k, v in record.items() if hasattr(v, "shape") and len(v.shape) >= 1
            and v.shape[0] == n]


def _nms_record(record, iou_threshold, boxes, scores, idxs, offset):
    b, s = _aligned(record[boxes]), _aligned(record[scores])
    if idxs is None:
        keep = ops.nms(b, s, iou_threshold, offset)
    else:
        keep = ops.batched_nms(b, s, _aligned(record[idxs]), iou_threshold, offset)
    n = b.shape[0]
    kept = dict(record)
    for key in _per_box(record, n):
        kept[key] = record[key][keep]
    return kept


def _nms_partition(frame, iou_threshold, by, boxes, scores, idxs, offset):
    """The kept rows of every image in one partition (each image's rows
    all in this partition), image by image, by decreasing score."""
    if len(frame) == 0:
        return frame
    coordinates = frame[list(boxes)].to_numpy()
    score = frame[scores].to_numpy(dtype=coordinates.dtype)
    # the class column as it is: ops.batched_nms refuses a non-integer one,
    # as it refuses non-integer idxs (converting it to int64 merged 0.5
    # into 0 and made NaN a class)
    classes = None if idxs is None else frame[idxs].to_numpy()
    if classes is not None and classes.dtype == np.bool_:   # two classes, as before
        classes = classes.astype(np.int64)
    kept = []
    # rows whose image id is NaN (or None) are an image of their own, not
    # dropped (groupby's default)
    for rows in frame.groupby(by, sort=False, dropna=False).indices.values():
        if classes is None:
            keep = ops.nms(coordinates[rows], score[rows], iou_threshold, offset)
        else:
            keep = ops.batched_nms(coordinates[rows], score[rows], classes[rows],
                                   iou_threshold, offset)
        kept.append(rows[keep])
    return frame.iloc[np.concatenate(kept)]


def _nms(detections, iou_threshold, idxs, by, boxes, scores, offset):
    if isinstance(detections, db.Bag):
        boxes = "boxes" if boxes is None else boxes
        return detections.map(_nms_record, iou_threshold, boxes, scores, idxs, offset)
    frame_type = _dataframe_type()
    if frame_type is not None and isinstance(detections, frame_type):
        boxes = ("x1", "y1", "x2", "y2") if boxes is None else tuple(boxes)
        missing = [c for c in (by, *boxes, scores, *([idxs] if idxs else []))
                   if c not in detections.columns]
        if missing:
            raise ValueError(f"nms: the detections have no column(s) {missing}; columns: "
                             f"{list(detections.columns)}")
        return detections.shuffle(on=by).map_partitions(
            _nms_partition, iou_threshold, by, boxes, scores, idxs, offset,
            meta=detections._meta)
    raise TypeError(f"nms: detections must be a dask Bag of per-image records or a dask "
                    f"DataFrame of detection rows, got {type(detections).__name__}")


def _dataframe_type():
    try:
        import dask.dataframe as dd
    except ImportError:   # dask without its dataframe extra
        return None
    return dd.DataFrame


def nms(detections, iou_threshold, *, by="image_id", boxes=None, scores="scores", offset=0):
    """ops.nms per image, lazily.

    - A Bag of records (dicts): ``boxes`` (default "boxes", (K, 4)) and
      ``scores`` (K,) name the fields; each record comes back with every
      per-box field (first dimension K) cut to the kept boxes, by
      decreasing score; other fields as they were.
    - A DataFrame of rows: grouped by column ``by``; ``boxes`` names the
      four coordinate columns (default x1, y1, x2, y2) and ``scores`` the
      score column; the kept rows come back (a shuffle by ``by``)."""
    return _nms(detections, iou_threshold, None, by, boxes, scores, offset)


def batched_nms(detections, iou_threshold, idxs="labels", *, by="image_id", boxes=None,
                scores="scores", offset=0):
    """ops.batched_nms per image (boxes of different ``idxs``, a field or
    column of class ids, never suppress each other), lazily; as nms."""
    return _nms(detections, iou_threshold, idxs, by, boxes, scores, offset)

