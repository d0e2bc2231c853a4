/* box_iou_rotated (MMCV's semantics): the argument checks and the exact
 * geometry shared by the CPU kernel (src/cpu/box_iou_rotated.cpp) and the
 * CUDA kernel (src/cuda/box_iou_rotated.cu); the rotated nms ops use the
 * geometry too.
 *
 * A box is (cx, cy, w, h, angle in radians): the rectangle of sides w
 * (along its x axis) and h centred at (cx, cy), turned by the angle, which
 * is clockwise in image coordinates (x right, y down) when `clockwise`, else
 * counter-clockwise: its corners are the centre plus R(a) (+-w/2, +-h/2),
 * R the rotation matrix of a = angle (clockwise) or -angle. The
 * intersection of two boxes is computed as a convex polygon: one box
 * clipped by the other's four edges (Sutherland-Hodgman), in double
 * precision, with coordinates taken relative to the first box's centre;
 * its area by the shoelace formula, at most the smaller box's area (a box
 * met by itself: its area). Areas are w * h in double: a box whose area
 * overflows (sides past about 1e154) is undefined, and one whose area
 * underflows to 0 (sides below about 1e-154) has zero size; only float64
 * boxes reach either.
 *
 * "iou" = intersection / union, "iof" = intersection / the area of the
 * boxes1 box; a base <= 0 (zero-size boxes) gives 0. A pair with a value
 * that is not finite, a negative width or height, or an area past double's
 * range, gives NaN. */
#ifndef MMDISPATCH_OPS_BOX_IOU_ROTATED_H
#define MMDISPATCH_OPS_BOX_IOU_ROTATED_H

#include <math.h>

#include "mmdispatch/checks.h"

/* Shape/dtype/scalar checks; `float_mask` is the device's dtypes. */
inline int mmd_box_iou_rotated_check(const mmd_tensor *boxes1, const mmd_tensor *boxes2,
                                     const mmd_tensor *ious, int64_t mode, int aligned,
                                     unsigned float_mask) {
    if (mode != 0 && mode != 1)
        return mmd_error(MMD_ERR_VALUE, "mode must be 0 (iou) or 1 (iof), got %lld",
                         (long long)mode);
    const int64_t box_shape[2] = {MMD_ANY_DIM, 5};
    int s = mmd_check_shape(boxes1, "boxes1", 2, box_shape);
    if (!s) s = mmd_check_dtype(boxes1, "boxes1", float_mask);
    if (!s) s = mmd_check_contiguous(boxes1, "boxes1");
    if (!s) s = mmd_check_like(boxes2, "boxes2", 2, box_shape, boxes1, "boxes1");
    if (s) return s;
    const int64_t n = boxes1->shape[0], m = boxes2->shape[0];
    if (aligned && n != m)
        return mmd_error(MMD_ERR_VALUE, "aligned needs as many boxes2 as boxes1, got %lld and "
                         "%lld", (long long)n, (long long)m);
    const int64_t pairs[1] = {n}, table[2] = {n, m};
    return aligned ? mmd_check_like(ious, "ious", 1, pairs, boxes1, "boxes1")
                   : mmd_check_like(ious, "ious", 2, table, boxes1, "boxes1");
}

/* A rotated box in double precision. */
struct mmd_rbox {
    double cx, cy, w, h, angle;
};

/* A convex polygon of at most 8 vertices (a box clipped by 4 edges),
 * counter-clockwise in (x, y) with y up (positive signed area). */
struct mmd_polygon {
    double x[9], y[9];
    int count;
};

/* A box made ready to meet many others: its corners' offsets from its
 * centre (in order of positive signed area), the length of its diagonal,
 * its area w * h, and whether its IoU with any box is defined (finite
 * values, sides >= 0). A box's corner relative to (ox, oy) is
 * (cx - ox) + corner_x[i], (cy - oy) + corner_y[i], the same bits whether
 * the shape was made once for all pairs (the CPU kernels) or per pair. */
struct mmd_rbox_shape {
    double cx, cy;
    double corner_x[4], corner_y[4];
    double diagonal, area;
    bool defined;
};

MMD_HOSTDEV inline mmd_rbox_shape mmd_rbox_prepare(const mmd_rbox &b, bool clockwise) {
    mmd_rbox_shape shape;
    const double a = clockwise ? b.angle : -b.angle;
    const double c = cos(a), s = sin(a);
    const double dx[4] = {-0.5 * b.w, 0.5 * b.w, 0.5 * b.w, -0.5 * b.w};
    const double dy[4] = {-0.5 * b.h, -0.5 * b.h, 0.5 * b.h, 0.5 * b.h};
    shape.cx = b.cx;
    shape.cy = b.cy;
    for (int i = 0; i < 4; ++i) {
        shape.corner_x[i] = dx[i] * c - dy[i] * s;
        shape.corner_y[i] = dx[i] * s + dy[i] * c;
    }
    shape.diagonal = sqrt(b.w * b.w + b.h * b.h);
    shape.area = b.w * b.h;
    shape.defined = b.w >= 0 && b.h >= 0 && isfinite(b.cx + b.cy + b.w + b.h + b.angle) &&
                    isfinite(shape.area);
    return shape;
}

/* Box i of an (n, 5) array of float or double, made ready. */
template <typename T>
MMD_HOSTDEV inline mmd_rbox_shape mmd_rbox_shape_at(const T *boxes, int64_t i, bool clockwise) {
    const T *b = boxes + 5 * i;
    return mmd_rbox_prepare(
        mmd_rbox{(double)b[0], (double)b[1], (double)b[2], (double)b[3], (double)b[4]}, clockwise);
}

/* The corners of box b relative to (ox, oy). */
MMD_HOSTDEV inline void mmd_rbox_polygon(const mmd_rbox_shape &b, double ox, double oy,
                                         mmd_polygon *p) {
    for (int i = 0; i < 4; ++i) {
        p->x[i] = (b.cx - ox) + b.corner_x[i];
        p->y[i] = (b.cy - oy) + b.corner_y[i];
    }
    p->count = 4;
}

/* The part of `in` on the left of the directed line a -> b (its inside,
 * for a clip polygon of positive signed area), into `out`. */
MMD_HOSTDEV inline void mmd_clip_by_edge(const mmd_polygon &in, double ax, double ay, double bx,
                                         double by, mmd_polygon *out) {
    out->count = 0;
    const double ex = bx - ax, ey = by - ay;
    for (int i = 0; i < in.count; ++i) {
        const int j = i + 1 < in.count ? i + 1 : 0;
        const double side_i = ex * (in.y[i] - ay) - ey * (in.x[i] - ax);
        const double side_j = ex * (in.y[j] - ay) - ey * (in.x[j] - ax);
        if (side_i >= 0) {
            out->x[out->count] = in.x[i];
            out->y[out->count++] = in.y[i];
        }
        if ((side_i >= 0) != (side_j >= 0)) {   /* the edge crosses the line */
            const double t = side_i / (side_i - side_j);
            out->x[out->count] = in.x[i] + t * (in.x[j] - in.x[i]);
            out->y[out->count++] = in.y[i] + t * (in.y[j] - in.y[i]);
        }
    }
}

MMD_HOSTDEV inline double mmd_polygon_area(const mmd_polygon &p) {
    double twice = 0;
    for (int i = 0; i < p.count; ++i) {
        const int j = i + 1 < p.count ? i + 1 : 0;
        twice += p.x[i] * p.y[j] - p.x[j] * p.y[i];
    }
    return fabs(0.5 * twice);
}

/* Whether a and b are the same box: the same centre and corners (corners
 * 2 and 3 are exactly the negations of 0 and 1: mmd_rbox_prepare). */
MMD_HOSTDEV inline bool mmd_rbox_same(const mmd_rbox_shape &a, const mmd_rbox_shape &b) {
    return a.cx == b.cx && a.cy == b.cy && a.corner_x[0] == b.corner_x[0] &&
           a.corner_y[0] == b.corner_y[0] && a.corner_x[1] == b.corner_x[1] &&
           a.corner_y[1] == b.corner_y[1];
}

/* The area of the intersection of a and b (both of non-negative, finite
 * size). The clipped polygon's vertices carry rounding of about 1e-16 of
 * the boxes' extent, which for a box thinner than about 1e-12 of its
 * length is a sizeable part of its area: a box met by itself gives its
 * own area, and no intersection is taken larger than either box (a thin
 * box crossing a large one gave more than its whole area, an IoU of
 * 6e-5 where the true one is below 1e-280). */
MMD_HOSTDEV inline double mmd_rbox_intersection(const mmd_rbox_shape &a, const mmd_rbox_shape &b) {
    /* boxes farther apart than their half diagonals cannot meet */
    const double reach = 0.5 * (a.diagonal + b.diagonal);
    const double ddx = b.cx - a.cx, ddy = b.cy - a.cy;
    if (!(ddx * ddx + ddy * ddy <= reach * reach) || a.area == 0 || b.area == 0) return 0;
    /* the same corners: the same box, but for sides their rounding
     * absorbed (a thin box's 1e-20 against 2e-20): the smaller area */
    if (mmd_rbox_same(a, b)) return a.area < b.area ? a.area : b.area;
    mmd_polygon clip, polygon[2];
    mmd_rbox_polygon(b, a.cx, a.cy, &clip);
    mmd_rbox_polygon(a, a.cx, a.cy, &polygon[0]);
    int current = 0;
    for (int e = 0; e < 4 && polygon[current].count > 0; ++e) {
        const int f = e + 1 < 4 ? e + 1 : 0;
        mmd_clip_by_edge(polygon[current], clip.x[e], clip.y[e], clip.x[f], clip.y[f],
                         &polygon[1 - current]);
        current = 1 - current;
    }
    const double area = polygon[current].count >= 3 ? mmd_polygon_area(polygon[current]) : 0;
    const double smaller = a.area < b.area ? a.area : b.area;
    return area > smaller ? smaller : area;
}

/* IoU (mode 0) or IoF (mode 1) of two prepared boxes. */
MMD_HOSTDEV inline double mmd_rbox_overlap(const mmd_rbox_shape &a, const mmd_rbox_shape &b,
                                           int64_t mode) {
    if (!(a.defined && b.defined)) return NAN;
    const double inter = mmd_rbox_intersection(a, b);
    const double base = mode == 0 ? a.area + b.area - inter : a.area;
    return base > 0 ? inter / base : 0;
}

#endif
