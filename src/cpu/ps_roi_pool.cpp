/* ps_roi_pool on CPU. Forward and backward share out the planes of the
 * feature map by image, bin and a run of output channels (ps_plane_groups.h):
 * planes stay in cache while every roi uses them, each bin's loop serves
 * several planes, and backward's sums, the rois in order, are race-free
 * and deterministic. */
#include "mmdispatch/ops/ps_roi_pool.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "ps_plane_groups.h"

namespace {

template <typename T> using Geometry = mmd_pool_geometry<T>;

/* The call's shapes and scalars; `map` is input (forward) or grad_input
 * (backward). */
template <typename T> struct Call {
    const T *rois;
    int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w;
    T scale;

    int geometry(int64_t k, Geometry<T> *g) const {
        return mmd_ps_roi_pool_geometry(rois + 5 * k, batch, scale, pooled_h, pooled_w, g);
    }
    int64_t out_channels() const { return channels / (pooled_h * pooled_w); }
};

template <typename T>
Call<T> make_call(const mmd_tensor *map, const mmd_tensor *rois, int64_t pooled_h,
                  int64_t pooled_w, double spatial_scale) {
    return Call<T>{(const T *)rois->data, rois->shape[0], map->shape[0], map->shape[1],
                   map->shape[2], map->shape[3], pooled_h, pooled_w, (T)spatial_scale};
}

/* The rois by image (RoisByImage) and the cells of each one's bin rows and
 * columns, computed once per call: the j-th roi of that order has rows
 * [row_lo, row_hi)[ph * K + j] in bin row ph, columns likewise, so an item
 * (one bin row and column) reads them in sequence. */
struct Cells {
    RoisByImage by_image;
    HeapArray<int64_t> row_lo, row_hi, col_lo, col_hi;

    template <typename T>
    explicit Cells(const Call<T> &call)
        : by_image(call.num_rois, call.batch), row_lo(call.num_rois * call.pooled_h),
          row_hi(call.num_rois * call.pooled_h), col_lo(call.num_rois * call.pooled_w),
          col_hi(call.num_rois * call.pooled_w) {}

    template <typename T> int build(const Call<T> &call) {
        if (!row_lo || !row_hi || !col_lo || !col_hi)
            return mmd_error(MMD_ERR_MEMORY, "out of memory for the bins of %lld rois",
                             (long long)call.num_rois);
        int s = by_image.build(call.num_rois, call.batch, [&](int64_t k) {
            return (int64_t)call.rois[5 * k];   /* checked by mmd_check_rois */
        });
        if (s) return s;
        const int64_t K = call.num_rois;
        for (int64_t j = 0; j < K; ++j) {
            Geometry<T> g{};
            call.geometry(by_image.order[j], &g);
            for (int64_t ph = 0; ph < call.pooled_h; ++ph)
                mmd_ps_roi_pool_bin(g.start_h, g.bin_h, ph, call.height, &row_lo[ph * K + j],
                                    &row_hi[ph * K + j]);
            for (int64_t pw = 0; pw < call.pooled_w; ++pw)
                mmd_ps_roi_pool_bin(g.start_w, g.bin_w, pw, call.width, &col_lo[pw * K + j],
                                    &col_hi[pw * K + j]);
        }
        return MMD_OK;
    }
};

/* One roi's bin in an item's planes: cells [h0, h1) x [w0, w1), and `out`,
 * the output (or grad_output) element of the item's first plane; the next
 * planes' are `bins` apart. */
struct Bin {
    int64_t out, h0, h1, w0, w1;
    bool empty() const { return h1 <= h0 || w1 <= w0; }
    int64_t area() const { return (h1 - h0) * (w1 - w0); }
};

/* For every item (ps_plane_groups.h): f(size, planes, bin) for each roi on
 * the item's image (its part of them, where `split_rois`: the forward), in
 * order, with `planes` the offset of the item's first plane in the map
 * (the next are bins * plane_size apart). */
template <typename T, typename F> int for_items_and_rois(const Call<T> &call, const T *map,
                                                         bool split_rois, const F &f) {
    Cells cells(call);
    int s = cells.build(call);
    if (s) return s;
    const int64_t bins = call.pooled_h * call.pooled_w, c_out = call.out_channels();
    const int64_t plane_size = call.height * call.width, K = call.num_rois;
    const PsPlaneGroups groups(call.batch, call.channels, bins, split_rois, K);
    return ps_for_plane_groups(groups, map, plane_size, call.batch * call.channels * K * 4,
                               [&](auto size, const PsItem &it, mmd_block_prefetch &next) {
        const int64_t ph = it.b / call.pooled_w, pw = it.b % call.pooled_w;
        const int64_t planes = groups.first_plane(it) * plane_size;
        const int64_t *row_lo = &cells.row_lo[ph * K], *row_hi = &cells.row_hi[ph * K];
        const int64_t *col_lo = &cells.col_lo[pw * K], *col_hi = &cells.col_hi[pw * K];
        int64_t first, last;
        it.rois(cells.by_image.start[it.n], cells.by_image.start[it.n + 1], &first, &last);
        for (int64_t j = first; j < last; ++j) {
            next.step();
            const int64_t k = cells.by_image.order[j];
            f(size, planes,
              Bin{(k * c_out + it.co) * bins + it.b, row_lo[j], row_hi[j], col_lo[j], col_hi[j]});
        }
    });
}

template <typename T> int forward(const Call<T> &call, const T *input, T *output) {
    int s = mmd_check_rois<Geometry<T>>(call);
    const int64_t c_out = call.out_channels(), bins = call.pooled_h * call.pooled_w;
    if (s || call.num_rois * c_out * bins == 0) return s;
    const int64_t stride = bins * call.height * call.width, width = call.width;
    return for_items_and_rois(call, input, true,
                              [&](auto size, int64_t planes, const Bin &bin) {
        constexpr int G = decltype(size)::value;
        T sum[G] = {};
        for (int64_t h = bin.h0; h < bin.h1; ++h)
            for (int64_t w = bin.w0; w < bin.w1; ++w) {
                MMD_SCALAR_LOOP(w);
                const T *cell = input + planes + h * width + w;
                for (int g = 0; g < G; ++g) sum[g] += cell[g * stride];
            }
        const T area = (T)(bin.empty() ? 1 : bin.area());
        for (int g = 0; g < G; ++g) output[bin.out + g * bins] = bin.empty() ? (T)0 : sum[g] / area;
    });
}

/* Adds into grad_input (the caller passes it initialised, zeros for a plain
 * gradient): each cell of a bin gets the bin's gradient over its area, the
 * rois in order. */
template <typename T> int backward(const Call<T> &call, const T *grad_output, T *grad_input) {
    int s = mmd_check_rois<Geometry<T>>(call);
    const int64_t bins = call.pooled_h * call.pooled_w, c_out = call.out_channels();
    if (s || call.num_rois * c_out * bins == 0 || call.height * call.width == 0) return s;
    const int64_t stride = bins * call.height * call.width, width = call.width;
    return for_items_and_rois(call, (const T *)grad_input, false,
                              [&](auto size, int64_t planes, const Bin &bin) {
        constexpr int G = decltype(size)::value;
        if (bin.empty()) return;
        T grad[G];
        for (int g = 0; g < G; ++g) grad[g] = grad_output[bin.out + g * bins] / (T)bin.area();
        for (int64_t h = bin.h0; h < bin.h1; ++h)
            for (int64_t w = bin.w0; w < bin.w1; ++w) {
                MMD_SCALAR_LOOP(w);
                T *cell = grad_input + planes + h * width + w;
                for (int g = 0; g < G; ++g) cell[g * stride] += grad[g];
            }
    });
}

int ps_roi_pool_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                            const mmd_tensor *output, int64_t pooled_height, int64_t pooled_width,
                            double spatial_scale, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_forward_check(input, rois, output, pooled_height, pooled_width,
                                     spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return forward(make_call<float>(input, rois, pooled_height, pooled_width, spatial_scale),
                       (const float *)input->data, (float *)output->data);
    return forward(make_call<double>(input, rois, pooled_height, pooled_width, spatial_scale),
                   (const double *)input->data, (double *)output->data);
}

int ps_roi_pool_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                             const mmd_tensor *grad_input, int64_t pooled_height,
                             int64_t pooled_width, double spatial_scale, const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_backward_check(grad_output, rois, grad_input, pooled_height, pooled_width,
                                      spatial_scale, MMD_FLOAT32_64);
    if (s) return s;
    if (grad_input->dtype == MMD_FLOAT32)
        return backward(make_call<float>(grad_input, rois, pooled_height, pooled_width,
                                         spatial_scale),
                        (const float *)grad_output->data, (float *)grad_input->data);
    return backward(make_call<double>(grad_input, rois, pooled_height, pooled_width,
                                      spatial_scale),
                    (const double *)grad_output->data, (double *)grad_input->data);
}

}  // namespace

MMD_REGISTRATIONS(cpu, ps_roi_pool) {
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_forward_impl, CPU, DEFAULT, ps_roi_pool_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(ps_roi_pool_backward_impl, CPU, DEFAULT, ps_roi_pool_backward_cpu);
}
