/* deform_conv2d on CPU: deformable im2col + matrix products (gemm.h).
 *
 * Each image is first copied channels-last (a row of C values per pixel,
 * plus four rows of zeros for cells off the map), so that a bilinear
 * sample reads its four cells' channels as four contiguous rows and the
 * columns are made by vector loops over channels. The output pixels go in
 * chunks whose column buffer takes at most kColumnBytes, so memory stays
 * bounded on large maps. For a chunk, a table holds each (pixel, offset
 * group, kernel tap)'s bilinear sample (cells, weights, mask), computed
 * once and shared by the group's channels. The columns are pixel-major: a
 * pixel's row holds, per weight group and tap, the group's channels'
 * masked samples. Each weight group's output is then one product with its
 * weight, reordered once per call to (out, tap, channel). Where our tile
 * products (gemm.h) are as fast as a BLAS and the groups fill their strips
 * (tiles_suit), the forward instead makes the columns of a small block of
 * pixels on each thread and multiplies them there and then
 * (forward_tiles), and the backward's two products run on the tiles
 * (BackwardTiles).
 *
 * Backward recomputes the columns, adds grad_output x columns into
 * grad_weight, turns the columns into their gradient (grad_output^T x
 * weight), and from it gets grad_offset and grad_mask (per pixel, group and
 * tap, summed over the group's channels in channel order) and grad_input
 * (channels-last, each block of channels on one thread, so the scattered
 * sums are race-free and deterministic; cells off the map go to the extra
 * rows, which are dropped). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "mmdispatch/gemm.h"
#include "mmdispatch/ops/deform_conv2d.h"
#include "mmdispatch/parallel.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "heap_array.h"

namespace {

constexpr int64_t kColumnBytes = int64_t(1) << 25;    /* a chunk's columns */
constexpr int64_t kMaxChunk = 65536;                  /* pixels in a chunk */
constexpr int64_t kChannelBlock = 64;                 /* channels of a col2im work item */
constexpr int64_t kTile = 32;                         /* side of a transpose tile */
constexpr int64_t kOffMapRows = 4;                    /* rows for cells off the map */

/* A bilinear sample whose cells off the map index rows past the image's
 * pixels: cell k the row plane + k, so the four rows of a sample are always
 * distinct. Those rows are zeros in the image and dropped in its gradient. */
template <typename T> struct Sample : mmd_bilinear_sample<T> {
    T mask;
};

/* A run of input channels [c0, c1) in one weight group and one offset
 * group. Its columns start at `column` in a pixel's row; tap t adds t times
 * the weight group's channels. */
struct Segment {
    int64_t c0, c1, offset_group, column;
};

/* dst (cols x rows, row stride ld_dst) = the transpose of src (rows x cols,
 * row stride ld_src), by tiles shared out over the threads. */
template <typename T>
void transpose(const T *src, int64_t rows, int64_t cols, int64_t ld_src, T *dst, int64_t ld_dst) {
    const int64_t tiles_r = (rows + kTile - 1) / kTile, tiles_c = (cols + kTile - 1) / kTile;
    const int64_t tiles = tiles_r * tiles_c;
    mmd_parallel_for(tiles, mmd_even_chunk(tiles), mmd_worth_threads(tiles, rows * cols),
                     [&](int64_t begin, int64_t end) {
        for (int64_t tile = begin; tile < end; ++tile) {
            const int64_t r0 = tile / tiles_c * kTile, c0 = tile % tiles_c * kTile;
            const int64_t r1 = r0 + kTile < rows ? r0 + kTile : rows;
            const int64_t c1 = c0 + kTile < cols ? c0 + kTile : cols;
            for (int64_t c = c0; c < c1; ++c)
                for (int64_t r = r0; r < r1; ++r) dst[c * ld_dst + r] = src[r * ld_src + c];
        }
        return (int)MMD_OK;
    });
}

/* The arrays of a call, and its shape. */
template <typename T> struct Call {
    mmd_dcn_shape d;
    const T *input, *offset, *mask, *weight;

    int64_t plane() const { return d.height * d.width; }
    int64_t row() const { return d.in_channels * d.taps(); }   /* a pixel's columns */
    int64_t group_channels() const { return d.in_channels / d.groups; }
    int64_t group_columns() const { return group_channels() * d.taps(); }
    int64_t group_outputs() const { return d.out_channels / d.groups; }
    int64_t samples() const { return d.offset_groups * d.taps(); }   /* per pixel */

    int64_t chunk() const {
        const int64_t r = row();
        int64_t pixels = r > 0 ? kColumnBytes / (r * (int64_t)sizeof(T)) : kMaxChunk;
        if (pixels < 1) pixels = 1;
        if (pixels > kMaxChunk) pixels = kMaxChunk;
        /* even chunks: a short last one would make a slow product */
        const int64_t chunks = (d.pixels() + pixels - 1) / pixels;
        return chunks > 0 ? (d.pixels() + chunks - 1) / chunks : 0;
    }

    /* The runs of channels in channel order (at most groups + offset_groups
     * of them); returns how many. */
    int64_t segments(Segment *out) const {
        const int64_t per_group = group_channels(), per_offset = d.channels_per_offset_group();
        int64_t count = 0;
        for (int64_t c = 0; c < d.in_channels;) {
            const int64_t gw = c / per_group, go = c / per_offset;
            const int64_t end_w = (gw + 1) * per_group, end_o = (go + 1) * per_offset;
            const int64_t c1 = end_w < end_o ? end_w : end_o;
            out[count++] = Segment{c, c1, go, gw * group_columns() + (c - gw * per_group)};
            c = c1;
        }
        return count;
    }

    /* The samples of image n's pixels [p0, p0 + count), sample (g, t) of
     * pixel q at table[q * samples() + g * taps + t]: those of rows (g, t)
     * in [r0, r1) here, all of them in locate. */
    void locate_rows(int64_t n, int64_t p0, int64_t count, Sample<T> *table, int64_t r0,
                     int64_t r1) const {
        const int64_t taps = d.taps(), rows = samples(), pixels = d.pixels();
        for (int64_t r = r0; r < r1; ++r) {
            const int64_t g = r / taps, t = r % taps, i = t / d.kernel_w, j = t % d.kernel_w;
            const T *dy = offset + ((n * d.offset_groups + g) * 2 * taps + 2 * t) * pixels;
            const T *dx = dy + pixels;
            const T *m = mask ? mask + ((n * d.offset_groups + g) * taps + t) * pixels : nullptr;
            for (int64_t q = 0; q < count; ++q) {
                const int64_t p = p0 + q, oy = p / d.out_w, ox = p % d.out_w;
                const T y = mmd_dcn_base<T>(oy, i, d.stride_h, d.pad_h, d.dilation_h) + dy[p];
                const T x = mmd_dcn_base<T>(ox, j, d.stride_w, d.pad_w, d.dilation_w) + dx[p];
                Sample<T> &s = table[q * rows + r];
                place(y, x, &s);
                s.mask = m ? m[p] : (T)1;
            }
        }
    }
    /* mmd_bilinear_locate, with the cells off the map at rows plane() + k */
    void place(T y, T x, Sample<T> *s) const {
        mmd_bilinear_locate(y, x, d.height, d.width, s);
        for (int k = 0; k < 4; ++k)
            if (s->index[k] < 0) s->index[k] = plane() + k;   /* weight 0, value 0 */
    }
    /* Sample (g, t) of image n's pixel p at mmd_bilinear_edge_shift's
     * position for `edge`: where an edge sample takes its one derivative. */
    Sample<T> edge_sample(int64_t n, int64_t g, int64_t t, int64_t p, unsigned char edge) const {
        const int64_t taps = d.taps(), pixels = d.pixels();
        const T *dy = offset + ((n * d.offset_groups + g) * 2 * taps + 2 * t) * pixels + p;
        T y = mmd_dcn_base<T>(p / d.out_w, t / d.kernel_w, d.stride_h, d.pad_h, d.dilation_h) +
              dy[0];
        T x = mmd_dcn_base<T>(p % d.out_w, t % d.kernel_w, d.stride_w, d.pad_w, d.dilation_w) +
              dy[pixels];
        mmd_bilinear_edge_shift(edge, &y, &x);
        Sample<T> s;
        place(y, x, &s);
        return s;
    }
    void locate(int64_t n, int64_t p0, int64_t count, Sample<T> *table) const {
        const int64_t rows = samples();
        mmd_parallel_for(rows, 1, mmd_worth_threads(rows, rows * count * 8),
                         [&](int64_t begin, int64_t end) {
            locate_rows(n, p0, count, table, begin, end);
            return (int)MMD_OK;
        });
    }

    /* A pixel's row of columns: mask * sample of each channel, the same
     * sums as mmd_bilinear_value's (an off-map cell reads a zero row); the
     * rows of pixels [q0, q1) here, all of them in im2col. */
    void im2col_rows(const T *image, const Sample<T> *table, const Segment *segs, int64_t nsegs,
                     T *columns, int64_t q0, int64_t q1) const {
        const int64_t taps = d.taps(), channels = d.in_channels, step = group_channels();
        const int64_t per_pixel = samples(), width = row();
        for (int64_t q = q0; q < q1; ++q) {
            const Sample<T> *sq = table + q * per_pixel;
            T *row_q = columns + q * width;
            for (int64_t k = 0; k < nsegs; ++k) {
                const Segment &sg = segs[k];
                const int64_t n = sg.c1 - sg.c0;
                for (int64_t t = 0; t < taps; ++t) {
                    const Sample<T> &s = sq[sg.offset_group * taps + t];
                    T *__restrict out = row_q + sg.column + t * step;
                    if (s.undefined) {
                        for (int64_t c = 0; c < n; ++c) out[c] = s.mask * (T)NAN;
                        continue;
                    }
                    const T *__restrict a = image + s.index[0] * channels + sg.c0;
                    const T *__restrict b = image + s.index[1] * channels + sg.c0;
                    const T *__restrict e = image + s.index[2] * channels + sg.c0;
                    const T *__restrict f = image + s.index[3] * channels + sg.c0;
                    const T w0 = s.weight[0], w1 = s.weight[1], w2 = s.weight[2],
                            w3 = s.weight[3], m = s.mask;
                    for (int64_t c = 0; c < n; ++c)
                        out[c] = m * (w0 * a[c] + w1 * b[c] + w2 * e[c] + w3 * f[c]);
                }
            }
        }
    }
    void im2col(const T *image, int64_t count, const Sample<T> *table, const Segment *segs,
                int64_t nsegs, T *columns) const {
        mmd_parallel_for(count, mmd_even_chunk(count), mmd_worth_threads(count, count * row()),
                         [&](int64_t begin, int64_t end) {
            im2col_rows(image, table, segs, nsegs, columns, begin, end);
            return (int)MMD_OK;
        });
    }
};

/* Scratch memory of a call: a chunk's columns and samples, the image
 * channels-last (and its gradient, for backward), the weight as (out, tap,
 * channel) (and its gradient) and the channel runs. */
template <typename T> struct Workspace {
    int64_t bytes;
    HeapArray<T> columns;
    HeapArray<Sample<T>> table;
    HeapArray<T> image, grad_image, weight, grad_weight;
    HeapArray<Segment> segs;
    int64_t nsegs = 0;

    Workspace(const Call<T> &call, int64_t chunk, bool grads)
        : bytes((int64_t)sizeof(T) * (call.row() * chunk +
                                       (grads ? 2 : 1) * ((call.plane() + kOffMapRows) * call.d.in_channels +
                                                          call.d.out_channels *
                                                              call.group_columns())) +
                (int64_t)sizeof(Sample<T>) * call.samples() * chunk),
          columns(call.row() * chunk), table(call.samples() * chunk),
          image((call.plane() + kOffMapRows) * call.d.in_channels),
          grad_image(grads ? (call.plane() + kOffMapRows) * call.d.in_channels : 0),
          weight(call.d.out_channels * call.group_columns()),
          grad_weight(grads ? call.d.out_channels * call.group_columns() : 0, true),
          segs(call.d.groups + call.d.offset_groups) {
        if (segs) nsegs = call.segments(segs.get());
    }
    bool ok() const {
        return columns && table && image && grad_image && weight && grad_weight && segs;
    }
    /* `more`: the bytes of the caller's own buffers beside these */
    int no_memory(int64_t more = 0) const {
        return mmd_error(MMD_ERR_MEMORY, "cannot allocate %lld bytes for deform_conv2d's columns",
                         (long long)(bytes + more));
    }
    /* Image n channels-last, with the off-map rows zeroed. */
    void load_image(const Call<T> &call, int64_t n) {
        const int64_t channels = call.d.in_channels, plane = call.plane();
        transpose(call.input + n * channels * plane, channels, plane, plane, image.get(),
                  channels);
        memset(image.get() + plane * channels, 0, sizeof(T) * kOffMapRows * channels);
    }
};

/* The ranges a parallel loop over `items` hands out, at most `most` of them
 * (at least one), each with a scratch slot of its own: mmd_parallel_for
 * starts every range at a multiple of per_range. */
struct Ranges {
    int64_t per_range, slots;
    Ranges(int64_t items, int64_t most) {
        if (most > items) most = items;
        if (most < 1) most = 1;
        per_range = (items + most - 1) / most;
        if (per_range < 1) per_range = 1;
        slots = (items + per_range - 1) / per_range;
    }
    int64_t slot(int64_t begin) const { return begin / per_range; }
};

/* (out, channel, tap) <-> (out, tap, channel) per out channel, with the
 * group's channels as one run. */
template <typename T>
void reorder_weight(const Call<T> &call, const T *src, T *dst, bool to_taps) {
    const int64_t taps = call.d.taps(), channels = call.group_channels(), k = call.group_columns();
    for (int64_t o = 0; o < call.d.out_channels; ++o)
        for (int64_t c = 0; c < channels; ++c)
            for (int64_t t = 0; t < taps; ++t) {
                const int64_t by_channel = o * k + c * taps + t, by_tap = o * k + t * channels + c;
                if (to_taps)
                    dst[by_tap] = src[by_channel];
                else
                    dst[by_channel] = src[by_tap];
            }
}

/* Whether the tile products (gemm.h) take a call's products: where they are
 * as fast as a BLAS, and a group's out channels and columns each fill at
 * least a quarter of a strip (a depthwise convolution's single out channel
 * would leave 31 of 32 lanes idle: 63 ms against the BLAS's 45 for 64
 * channels of 96x96, 3x3). */
template <typename T> bool tiles_suit(const Call<T> &call) {
    const int64_t strip = mmd_tile_strip((int64_t)sizeof(T));
    return mmd_tiles_beat_blas() && 4 * call.group_outputs() >= strip &&
           4 * call.group_columns() >= strip;
}

/* Forward on the tile products (gemm.h), where they are as fast as a BLAS:
 * each thread takes blocks of an image's output pixels and makes a block's
 * samples, its columns and their products with every strip of the packed
 * weight in scratch of its own, small enough to stay in its core's cache.
 * The columns never go out to memory, and no BLAS threads wake (OpenBLAS's
 * spin for a while after each product, taking cores from the next image's
 * columns). The outputs do not depend on the thread count. */
template <typename T> int forward_tiles(const Call<T> &call, const T *bias, T *output) {
    const mmd_dcn_shape &d = call.d;
    const int64_t pixels = d.pixels(), outs = call.group_outputs(), k = call.group_columns();
    const int64_t width = call.row(), per_pixel = call.samples();
    const int64_t block = mmd_tile_block(width, (int64_t)sizeof(T));
    const int64_t blocks = (pixels + block - 1) / block, threads = mmd_max_threads();
    /* two ranges a thread, or one where their columns would pass kColumnBytes */
    const Ranges ranges(blocks, 2 * threads * block * width * (int64_t)sizeof(T) <= kColumnBytes
                                    ? 2 * threads
                                    : threads);
    /* the Workspace's columns and samples: a block's for each slot */
    Workspace<T> work(call, ranges.slots * block, false);
    const int64_t packed_group = mmd_packed_size<T>(outs, k);
    HeapArray<T> packed(d.groups * packed_group);
    if (!work.ok() || !packed) return work.no_memory((int64_t)sizeof(T) * d.groups * packed_group);
    reorder_weight(call, call.weight, work.weight.get(), true);
    for (int64_t g = 0; g < d.groups; ++g)
        mmd_pack_strips(outs, k, (T)1, work.weight.get() + g * outs * k, k, 1,
                        packed.get() + g * packed_group);
    for (int64_t n = 0; n < d.batch; ++n) {
        T *out = output + n * d.out_channels * pixels;
        work.load_image(call, n);
        mmd_parallel_for(blocks, ranges.per_range,
                         mmd_worth_threads(blocks, pixels * (width + 1) * d.out_channels),
                         [&](int64_t begin, int64_t end) {
            const int64_t slot = ranges.slot(begin);
            T *cols = work.columns.get() + slot * block * width;
            Sample<T> *samples = work.table.get() + slot * block * per_pixel;
            for (int64_t b = begin; b < end; ++b) {
                const int64_t p0 = b * block, count = pixels - p0 < block ? pixels - p0 : block;
                call.locate_rows(n, p0, count, samples, 0, per_pixel);
                call.im2col_rows(work.image.get(), samples, work.segs.get(), work.nsegs, cols, 0,
                                 count);
                for (int64_t g = 0; g < d.groups; ++g)
                    mmd_tile_product(outs, count, k, packed.get() + g * packed_group,
                                     cols + g * k, width, bias ? bias + g * outs : nullptr, 0,
                                     out + g * outs * pixels + p0, pixels, 1);
            }
            return (int)MMD_OK;
        });
    }
    return MMD_OK;
}

template <typename T> int forward(const Call<T> &call, const T *bias, T *output) {
    const mmd_dcn_shape &d = call.d;
    const int64_t pixels = d.pixels(), chunk = call.chunk();
    if (d.batch * d.out_channels * pixels == 0) return MMD_OK;
    if (tiles_suit(call)) return forward_tiles(call, bias, output);
    Workspace<T> work(call, chunk, false);
    if (!work.ok()) return work.no_memory();
    reorder_weight(call, call.weight, work.weight.get(), true);
    const int64_t outs = call.group_outputs(), k = call.group_columns(), width = call.row();
    for (int64_t n = 0; n < d.batch; ++n) {
        T *out = output + n * d.out_channels * pixels;
        work.load_image(call, n);
        for (int64_t p0 = 0; p0 < pixels; p0 += chunk) {
            const int64_t count = p0 + chunk < pixels ? chunk : pixels - p0;
            call.locate(n, p0, count, work.table.get());
            call.im2col(work.image.get(), count, work.table.get(), work.segs.get(), work.nsegs,
                        work.columns.get());
            for (int64_t g = 0; g < d.groups; ++g)
                mmd_gemm(0, 1, outs, count, k, (T)1, work.weight.get() + g * outs * k, k,
                         work.columns.get() + g * k, width, (T)0, out + g * outs * pixels + p0,
                         pixels);
        }
        if (bias != nullptr)
            for (int64_t o = 0; o < d.out_channels; ++o)
                for (int64_t p = 0; p < pixels; ++p) out[o * pixels + p] += bias[o];
    }
    return MMD_OK;
}

/* The arrays backward writes. */
template <typename T> struct Grads {
    T *input, *offset, *mask, *weight, *bias;
};

/* grad_offset and grad_mask of image n's pixels [p0, p0 + count), from the
 * columns' gradient. */
template <typename T>
void offset_and_mask_grads(const Call<T> &call, const Workspace<T> &work, int64_t n, int64_t p0,
                           int64_t count, const T *grad_columns, const Grads<T> &grads) {
    const mmd_dcn_shape &d = call.d;
    const int64_t taps = d.taps(), pixels = d.pixels(), channels = d.in_channels;
    const int64_t per_pixel = call.samples(), width = call.row(), step = call.group_channels();
    const T *image = work.image.get();
    const Sample<T> *table = work.table.get();
    mmd_parallel_for(count, mmd_even_chunk(count), mmd_worth_threads(count, count * width * 4),
                     [&](int64_t begin, int64_t end) {
        for (int64_t q = begin; q < end; ++q) {
            const T *gq = grad_columns + q * width;
            for (int64_t r = 0; r < per_pixel; ++r) {
                const int64_t g = r / taps, t = r % taps;
                const Sample<T> &s = table[q * per_pixel + r];
                const T wy = 1 - s.lx, wx = 1 - s.ly;
                T gy = 0, gx = 0, gm = 0;
                for (int64_t k = 0; k < work.nsegs; ++k) {
                    const Segment &sg = work.segs[k];
                    if (sg.offset_group != g) continue;
                    const T *gc = gq + sg.column + t * step;
                    const T *a = image + s.index[0] * channels + sg.c0;
                    const T *b = image + s.index[1] * channels + sg.c0;
                    const T *e = image + s.index[2] * channels + sg.c0;
                    const T *f = image + s.index[3] * channels + sg.c0;
                    for (int64_t c = 0; c < sg.c1 - sg.c0; ++c) {
                        /* mmd_bilinear_value and its derivatives; the mask
                         * goes into each channel's term, as the chain rule
                         * writes it (so 0 * inf terms are NaN there too) */
                        const T masked = gc[c] * s.mask;
                        gm += gc[c] * (s.weight[0] * a[c] + s.weight[1] * b[c] +
                                       s.weight[2] * e[c] + s.weight[3] * f[c]);
                        gy += masked * (wy * (e[c] - a[c]) + s.lx * (f[c] - b[c]));
                        gx += masked * (wx * (b[c] - a[c]) + s.ly * (f[c] - e[c]));
                    }
                }
                if (s.edge) {   /* its one derivative that is not 0 (bilinear.h) */
                    const Sample<T> at = call.edge_sample(n, g, t, p0 + q, s.edge);
                    T ge = 0;
                    for (int64_t k = 0; k < work.nsegs; ++k) {
                        const Segment &sg = work.segs[k];
                        if (sg.offset_group != g) continue;
                        const T *gc = gq + sg.column + t * step;
                        for (int64_t c = 0; c < sg.c1 - sg.c0; ++c) {
                            T v[4];
                            for (int e = 0; e < 4; ++e)
                                v[e] = image[at.index[e] * channels + sg.c0 + c];
                            ge += gc[c] * s.mask * mmd_bilinear_edge_derivative(s.edge, at, v);
                        }
                    }
                    (s.edge == MMD_BILINEAR_EDGE_Y ? gy : gx) = ge;
                }
                if (s.undefined) gy = gx = gm = (T)NAN;
                const int64_t at = ((n * d.offset_groups + g) * 2 * taps + 2 * t) * pixels + p0 + q;
                grads.offset[at] = gy;
                grads.offset[at + pixels] = gx;
                grads.mask[((n * d.offset_groups + g) * taps + t) * pixels + p0 + q] = gm;
            }
        }
        return (int)MMD_OK;
    });
}

/* Adds the columns' gradient into the channels-last grad_image: each block
 * of a channel run on one thread, its samples in (pixel, tap) order. */
template <typename T>
void col2im(const Call<T> &call, Workspace<T> &work, int64_t count, const T *grad_columns) {
    const int64_t taps = call.d.taps(), channels = call.d.in_channels;
    const int64_t per_pixel = call.samples(), width = call.row(), step = call.group_channels();
    int64_t items = 0;
    for (int64_t k = 0; k < work.nsegs; ++k)
        items += (work.segs[k].c1 - work.segs[k].c0 + kChannelBlock - 1) / kChannelBlock;
    T *image = work.grad_image.get();
    const Sample<T> *table = work.table.get();
    const Segment *segs = work.segs.get();
    const int64_t nsegs = work.nsegs;
    mmd_parallel_for(items, 1, mmd_worth_threads(items, count * width * 4),
                     [&](int64_t begin, int64_t end) {
        for (int64_t item = begin; item < end; ++item) {
            int64_t k = 0, first = item;   /* the item'th block, in run order */
            for (; k < nsegs; ++k) {
                const int64_t blocks = (segs[k].c1 - segs[k].c0 + kChannelBlock - 1) / kChannelBlock;
                if (first < blocks) break;
                first -= blocks;
            }
            const Segment &sg = segs[k];
            const int64_t c0 = sg.c0 + first * kChannelBlock;
            const int64_t n = (c0 + kChannelBlock < sg.c1 ? c0 + kChannelBlock : sg.c1) - c0;
            const int64_t column = sg.column + (c0 - sg.c0);
            for (int64_t q = 0; q < count; ++q)
                for (int64_t t = 0; t < taps; ++t) {
                    const Sample<T> &s = table[q * per_pixel + sg.offset_group * taps + t];
                    const T *__restrict gc = grad_columns + q * width + column + t * step;
                    T *__restrict a = image + s.index[0] * channels + c0;
                    T *__restrict b = image + s.index[1] * channels + c0;
                    T *__restrict e = image + s.index[2] * channels + c0;
                    T *__restrict f = image + s.index[3] * channels + c0;
                    const T w0 = s.weight[0], w1 = s.weight[1], w2 = s.weight[2],
                            w3 = s.weight[3], m = s.mask;
                    for (int64_t c = 0; c < n; ++c) {
                        const T grad = gc[c] * m;
                        a[c] += grad * w0;
                        b[c] += grad * w1;
                        e[c] += grad * w2;
                        f[c] += grad * w3;
                    }
                }
        }
        return (int)MMD_OK;
    });
}

/* Backward's two products on the tiles (gemm.h), where they are as fast as
 * a BLAS (and so that no BLAS threads spin through col2im):
 * - grad_weight += grad_output x columns, a strip of a group's columns at a
 *   time per thread: the strip packed (its columns' values pixel by pixel),
 *   then its tiles over the group's out channels, whose grad_output rows
 *   are the tiles' rows as they are;
 * - the columns' gradient, grad_output^T x weight, a block of pixels at a
 *   time per thread: grad_output transposed for the chunk (a row of out
 *   channels per pixel), the weight packed once as (tap, channel) strips.
 * Each value is one sum (pixels, or out channels, in order), whatever the
 * thread count. */
template <typename T> struct BackwardTiles {
    const Call<T> &call;
    Workspace<T> &work;
    bool on;
    /* a strip packs `sub` pixels at a time, its scratch about kStripBytes */
    static constexpr int64_t kStripBytes = int64_t(1) << 18;
    int64_t strip = 0, sub = 0, packed_group = 0, chunk = 0;
    Ranges ranges{0, 1};
    HeapArray<T> packed, transposed, scratch;

    BackwardTiles(const Call<T> &c, Workspace<T> &w, int64_t chunk_pixels)
        : call(c), work(w), on(tiles_suit(c)), packed(0), transposed(0), scratch(0) {
        if (!on) return;
        const mmd_dcn_shape &d = call.d;
        const int64_t outs = call.group_outputs(), k = call.group_columns();
        chunk = chunk_pixels;
        strip = mmd_tile_strip((int64_t)sizeof(T));
        sub = kStripBytes / (strip * (int64_t)sizeof(T));
        if (sub > chunk) sub = chunk;
        if (sub < 1) sub = 1;
        packed_group = mmd_packed_size<T>(k, outs);
        ranges = Ranges(d.groups * ((k + strip - 1) / strip), mmd_max_threads());
        packed.reset(d.groups * packed_group);
        transposed.reset(chunk * d.out_channels);
        scratch.reset(ranges.slots * sub * strip);
        if (!packed || !transposed || !scratch) return;
        for (int64_t g = 0; g < d.groups; ++g)   /* w'[j][o] = weight[o][j] */
            mmd_pack_strips(k, outs, (T)1, work.weight.get() + g * outs * k, 1, k,
                            packed.get() + g * packed_group);
    }
    bool ok() const { return !on || (packed && transposed && scratch); }
    int64_t bytes() const {
        return (int64_t)sizeof(T) * (call.d.groups * packed_group + chunk * call.d.out_channels +
                                     ranges.slots * sub * strip);
    }

    void products(const T *grad_out, int64_t p0, int64_t count) {
        const mmd_dcn_shape &d = call.d;
        const int64_t outs = call.group_outputs(), k = call.group_columns();
        const int64_t pixels = d.pixels(), width = call.row(), strips = (k + strip - 1) / strip;
        T *columns = work.columns.get();
        T *grad_weight = work.grad_weight.get();
        const int64_t items = d.groups * strips;
        mmd_parallel_for(items, ranges.per_range, mmd_worth_threads(items, count * outs * k),
                         [&](int64_t begin, int64_t end) {
            T *strip_values = scratch.get() + ranges.slot(begin) * sub * strip;
            for (int64_t item = begin; item < end; ++item) {
                const int64_t g = item / strips, j0 = item % strips * strip;
                const int64_t n = k - j0 < strip ? k - j0 : strip;
                for (int64_t q0 = 0; q0 < count; q0 += sub) {   /* in pixel order */
                    const int64_t m = count - q0 < sub ? count - q0 : sub;
                    /* w'[j][q] = columns[q0 + q][g * k + j0 + j] */
                    mmd_pack_strips(n, m, (T)1, columns + q0 * width + g * k + j0, 1, width,
                                    strip_values);
                    mmd_tile_product(n, outs, m, strip_values,
                                     grad_out + g * outs * pixels + p0 + q0, pixels,
                                     (const T *)nullptr, 1, grad_weight + g * outs * k + j0, 1, k);
                }
            }
            return (int)MMD_OK;
        });
        transpose(grad_out + p0, d.out_channels, count, pixels, transposed.get(), d.out_channels);
        const int64_t block = mmd_tile_block(outs, (int64_t)sizeof(T));
        const int64_t blocks = (count + block - 1) / block;
        mmd_parallel_for(blocks, mmd_even_chunk(blocks),
                         mmd_worth_threads(blocks, count * outs * width),
                         [&](int64_t begin, int64_t end) {
            for (int64_t b = begin; b < end; ++b) {
                const int64_t q0 = b * block, n = count - q0 < block ? count - q0 : block;
                for (int64_t g = 0; g < d.groups; ++g)
                    mmd_tile_product(k, n, outs, packed.get() + g * packed_group,
                                     transposed.get() + q0 * d.out_channels + g * outs,
                                     d.out_channels, (const T *)nullptr, 0,
                                     columns + q0 * width + g * k, 1, width);
            }
            return (int)MMD_OK;
        });
    }
};

template <typename T> int backward(const Call<T> &call, const T *grad_output, const Grads<T> &grads) {
    const mmd_dcn_shape &d = call.d;
    const int64_t pixels = d.pixels(), width = call.row(), plane = call.plane();
    memset(grads.input, 0, sizeof(T) * d.batch * d.in_channels * plane);
    memset(grads.weight, 0, sizeof(T) * d.out_channels * call.group_columns());
    for (int64_t o = 0; o < d.out_channels; ++o) {
        T sum = 0;
        for (int64_t n = 0; n < d.batch; ++n)
            for (int64_t p = 0; p < pixels; ++p)
                sum += grad_output[(n * d.out_channels + o) * pixels + p];
        grads.bias[o] = sum;
    }
    if (d.batch * pixels == 0 || width == 0) {
        memset(grads.offset, 0, sizeof(T) * d.batch * 2 * call.samples() * pixels);
        memset(grads.mask, 0, sizeof(T) * d.batch * call.samples() * pixels);
        return MMD_OK;
    }
    const int64_t chunk = call.chunk();
    Workspace<T> work(call, chunk, true);
    if (!work.ok()) return work.no_memory();
    reorder_weight(call, call.weight, work.weight.get(), true);
    const int64_t outs = call.group_outputs(), k = call.group_columns();
    BackwardTiles<T> tiles(call, work, chunk);
    if (!tiles.ok()) return work.no_memory(tiles.bytes());
    T *columns = work.columns.get();
    for (int64_t n = 0; n < d.batch; ++n) {
        const T *grad_out = grad_output + n * d.out_channels * pixels;
        work.load_image(call, n);
        memset(work.grad_image.get(), 0, sizeof(T) * (plane + kOffMapRows) * d.in_channels);
        for (int64_t p0 = 0; p0 < pixels; p0 += chunk) {
            const int64_t count = p0 + chunk < pixels ? chunk : pixels - p0;
            call.locate(n, p0, count, work.table.get());
            call.im2col(work.image.get(), count, work.table.get(), work.segs.get(), work.nsegs,
                        columns);
            if (tiles.on)
                tiles.products(grad_out, p0, count);
            else
                for (int64_t g = 0; g < d.groups; ++g) {
                    const T *grad_g = grad_out + g * outs * pixels + p0;
                    /* grad_weight += grad_output x columns */
                    mmd_gemm(0, 0, outs, k, count, (T)1, grad_g, pixels, columns + g * k, width,
                             (T)1, work.grad_weight.get() + g * outs * k, k);
                    /* the columns' gradient: grad_output^T x weight */
                    mmd_gemm(1, 0, count, k, outs, (T)1, grad_g, pixels,
                             work.weight.get() + g * outs * k, k, (T)0, columns + g * k, width);
                }
            offset_and_mask_grads(call, work, n, p0, count, columns, grads);
            col2im(call, work, count, columns);
        }
        transpose(work.grad_image.get(), plane, d.in_channels, d.in_channels,
                  grads.input + n * d.in_channels * plane, plane);
    }
    reorder_weight(call, work.grad_weight.get(), grads.weight, false);
    return MMD_OK;
}

template <typename T>
Call<T> make_call(const mmd_dcn_shape &d, const mmd_tensor *input, const mmd_tensor *offset,
                  const mmd_tensor *mask, const mmd_tensor *weight) {
    return Call<T>{d, (const T *)input->data, (const T *)offset->data,
                   mask ? (const T *)mask->data : nullptr, (const T *)weight->data};
}

int deform_conv2d_forward_cpu(const mmd_tensor *input, const mmd_tensor *offset,
                              const mmd_tensor *mask, const mmd_tensor *weight,
                              const mmd_tensor *bias, const mmd_tensor *output, int64_t stride_h,
                              int64_t stride_w, int64_t pad_h, int64_t pad_w, int64_t dilation_h,
                              int64_t dilation_w, int64_t groups, int64_t offset_groups,
                              const mmd_context *ctx) {
    (void)ctx;
    mmd_dcn_shape d;
    int s = mmd_deform_conv2d_forward_check(input, offset, mask, weight, bias, output, stride_h,
                                            stride_w, pad_h, pad_w, dilation_h, dilation_w,
                                            groups, offset_groups, MMD_FLOAT32_64, &d);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return forward(make_call<float>(d, input, offset, mask, weight),
                       bias ? (const float *)bias->data : nullptr, (float *)output->data);
    return forward(make_call<double>(d, input, offset, mask, weight),
                   bias ? (const double *)bias->data : nullptr, (double *)output->data);
}

template <typename T>
Grads<T> grads_of(const mmd_tensor *grad_input, const mmd_tensor *grad_offset,
                  const mmd_tensor *grad_mask, const mmd_tensor *grad_weight,
                  const mmd_tensor *grad_bias) {
    return Grads<T>{(T *)grad_input->data, (T *)grad_offset->data, (T *)grad_mask->data,
                    (T *)grad_weight->data, (T *)grad_bias->data};
}

int deform_conv2d_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *input,
                               const mmd_tensor *offset, const mmd_tensor *mask,
                               const mmd_tensor *weight, const mmd_tensor *grad_input,
                               const mmd_tensor *grad_offset, const mmd_tensor *grad_mask,
                               const mmd_tensor *grad_weight, const mmd_tensor *grad_bias,
                               int64_t stride_h, int64_t stride_w, int64_t pad_h, int64_t pad_w,
                               int64_t dilation_h, int64_t dilation_w, int64_t groups,
                               int64_t offset_groups, const mmd_context *ctx) {
    (void)ctx;
    mmd_dcn_shape d;
    int s = mmd_deform_conv2d_backward_check(grad_output, input, offset, mask, weight,
                                             grad_input, grad_offset, grad_mask, grad_weight,
                                             grad_bias, stride_h, stride_w, pad_h, pad_w,
                                             dilation_h, dilation_w, groups, offset_groups,
                                             MMD_FLOAT32_64, &d);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return backward(make_call<float>(d, input, offset, mask, weight),
                        (const float *)grad_output->data,
                        grads_of<float>(grad_input, grad_offset, grad_mask, grad_weight,
                                        grad_bias));
    return backward(make_call<double>(d, input, offset, mask, weight),
                    (const double *)grad_output->data,
                    grads_of<double>(grad_input, grad_offset, grad_mask, grad_weight, grad_bias));
}

}  // namespace

MMD_REGISTRATIONS(cpu, deform_conv2d) {
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_forward_impl, CPU, DEFAULT, deform_conv2d_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(deform_conv2d_backward_impl, CPU, DEFAULT,
                             deform_conv2d_backward_cpu);
}
