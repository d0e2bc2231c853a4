/* Bilinear sampling of a plane with zeros outside it, as deformable
 * convolution (ops/deform_conv2d.h) and multi-scale deformable attention
 * (ops/multi_scale_deformable_attn.h) define it: a position (y, x) in cell
 * units reads the four cells around it, each weighted by its nearness; a
 * cell off the plane reads 0, a position outside (-1, H) x (-1, W) reads 0,
 * and a NaN position reads NaN. Host and device code.
 *
 * mmd_bilinear_dvalue_dy / _dx are the derivatives inside that range and 0
 * outside it, as MMCV's kernels define them. On the range's low edges the
 * floor rule (cells floor(y) and floor(y) + 1, zero off the plane) gives
 * one derivative that is not 0 although the value is: at y == -1 with x in
 * (-1, W), d/dy is row 0 interpolated at x; at x == -1 with y in (-1, H),
 * d/dx is column 0 interpolated at y. torchvision's deform_conv2d backward
 * takes those, and zero offsets with padding 1 (deformable convolution's
 * usual start) put the first row's and column's taps there. So
 * mmd_bilinear_locate marks such a sample in `edge`; deform_conv2d samples
 * mmd_bilinear_edge_shift's position and takes mmd_bilinear_edge_derivative.
 * multi-scale deformable attention keeps MMCV's 0 (it lands there only at
 * a sampling location of exactly -0.5 / H or -0.5 / W). */
#ifndef MMDISPATCH_BILINEAR_H
#define MMDISPATCH_BILINEAR_H

#include <math.h>
#include <stdint.h>

#include "mmdispatch/tensor.h"

/* One bilinear sample: the four cells around (y, x) as flat indices into a
 * plane (-1 for a cell outside the map) with their weights, the fractional
 * parts for the coordinate gradients, and whether the position is NaN. */
template <typename T> struct mmd_bilinear_sample {
    int64_t index[4];   /* (y0, x0), (y0, x1), (y1, x0), (y1, x1) */
    T weight[4];
    T ly, lx;
    bool undefined;
    unsigned char edge;   /* MMD_BILINEAR_EDGE_Y or _X: on a low edge (above) */
};

enum { MMD_BILINEAR_EDGE_Y = 1, MMD_BILINEAR_EDGE_X = 2 };

template <typename T>
MMD_HOSTDEV inline void mmd_bilinear_locate(T y, T x, int64_t height, int64_t width,
                                            mmd_bilinear_sample<T> *s) {
    s->undefined = isnan(y) || isnan(x);
    for (int q = 0; q < 4; ++q) {
        s->index[q] = -1;
        s->weight[q] = 0;
    }
    s->ly = s->lx = 0;
    s->edge = 0;
    if (!(y > (T)-1 && y < (T)height && x > (T)-1 && x < (T)width)) {
        if (y == (T)-1 && x > (T)-1 && x < (T)width) s->edge = MMD_BILINEAR_EDGE_Y;
        if (x == (T)-1 && y > (T)-1 && y < (T)height) s->edge = MMD_BILINEAR_EDGE_X;
        return;
    }
    const T fy = floor(y), fx = floor(x);
    const int64_t y0 = (int64_t)fy, x0 = (int64_t)fx, y1 = y0 + 1, x1 = x0 + 1;
    const T ly = y - fy, lx = x - fx, hy = 1 - ly, hx = 1 - lx;
    s->ly = ly;
    s->lx = lx;
    const bool vy0 = y0 >= 0, vy1 = y1 < height, vx0 = x0 >= 0, vx1 = x1 < width;
    if (vy0 && vx0) s->index[0] = y0 * width + x0, s->weight[0] = hy * hx;
    if (vy0 && vx1) s->index[1] = y0 * width + x1, s->weight[1] = hy * lx;
    if (vy1 && vx0) s->index[2] = y1 * width + x0, s->weight[2] = ly * hx;
    if (vy1 && vx1) s->index[3] = y1 * width + x1, s->weight[3] = ly * lx;
}

/* The four cells' values (0 outside the map). */
template <typename T, typename V>
MMD_HOSTDEV inline void mmd_bilinear_corners(const mmd_bilinear_sample<T> &s, const V *plane,
                                             T v[4]) {
    for (int q = 0; q < 4; ++q) v[q] = s.index[q] >= 0 ? (T)plane[s.index[q]] : (T)0;
}

/* The interpolated value, and its derivatives with respect to y and x. */
template <typename T>
MMD_HOSTDEV inline T mmd_bilinear_value(const mmd_bilinear_sample<T> &s, const T v[4]) {
    if (s.undefined) return (T)NAN;
    return s.weight[0] * v[0] + s.weight[1] * v[1] + s.weight[2] * v[2] + s.weight[3] * v[3];
}
template <typename T>
MMD_HOSTDEV inline T mmd_bilinear_dvalue_dy(const mmd_bilinear_sample<T> &s, const T v[4]) {
    if (s.undefined) return (T)NAN;
    return (1 - s.lx) * (v[2] - v[0]) + s.lx * (v[3] - v[1]);
}
template <typename T>
MMD_HOSTDEV inline T mmd_bilinear_dvalue_dx(const mmd_bilinear_sample<T> &s, const T v[4]) {
    if (s.undefined) return (T)NAN;
    return (1 - s.ly) * (v[1] - v[0]) + s.ly * (v[3] - v[2]);
}

/* An edge sample's (edge not 0) derivative that is not zero, from the
 * sample `at` of mmd_bilinear_edge_shift's position and its corners v:
 * row 0 interpolated along x (y edge), or column 0 along y (x edge). As the
 * floor rule has it, with the cells off the plane at 0. */
template <typename T>
MMD_HOSTDEV inline void mmd_bilinear_edge_shift(unsigned char edge, T *y, T *x) {
    if (edge == MMD_BILINEAR_EDGE_Y) *y = 0;
    if (edge == MMD_BILINEAR_EDGE_X) *x = 0;
}
template <typename T>
MMD_HOSTDEV inline T mmd_bilinear_edge_derivative(unsigned char edge,
                                                  const mmd_bilinear_sample<T> &at,
                                                  const T v[4]) {
    return edge == MMD_BILINEAR_EDGE_Y ? (1 - at.lx) * v[0] + at.lx * v[1]
                                       : (1 - at.ly) * v[0] + at.ly * v[2];
}

#endif
