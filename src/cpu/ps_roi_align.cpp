/* ps_roi_align on CPU. Each roi's interpolation weights (per sample row
 * and column) go in a table, a chunk of rois at a time; then forward and
 * backward share out the planes of the feature map by image, bin and a run
 * of output channels (ps_plane_groups.h): planes stay in cache while every
 * roi uses them, each bin's samples serve several planes, and backward's
 * sums, the rois in order, are race-free and deterministic. */
#include <stdlib.h>

#include "mmdispatch/ops/ps_roi_align.h"
#include "mmdispatch/registry.h"
#include "mmdispatch_generated.h"
#include "ps_plane_groups.h"

namespace {

template <typename T> using Geometry = mmd_roi_geometry<T>;
template <typename T> using Axis = mmd_interp_axis<T>;

/* The call's shapes and scalars; `map` is input (forward) or grad_input
 * (backward). */
template <typename T> struct Call {
    const T *rois;
    int64_t num_rois, batch, channels, height, width, pooled_h, pooled_w;
    T scale;
    int64_t sampling_ratio;

    int geometry(int64_t k, Geometry<T> *g) const {
        return mmd_ps_roi_align_geometry(rois + 5 * k, batch, scale, pooled_h, pooled_w,
                                         sampling_ratio, g);
    }
    int64_t out_channels() const { return channels / (pooled_h * pooled_w); }
};

template <typename T>
Call<T> make_call(const mmd_tensor *map, const mmd_tensor *rois, int64_t pooled_h,
                  int64_t pooled_w, double spatial_scale, int64_t sampling_ratio) {
    return Call<T>{(const T *)rois->data, rois->shape[0], map->shape[0], map->shape[1],
                   map->shape[2], map->shape[3], pooled_h, pooled_w, (T)spatial_scale,
                   sampling_ratio};
}

/* The geometry of rois [begin, end) and the interpolation of each one's
 * sample rows (ph, iy) and columns (pw, ix); a sample's bilinear weights
 * are their products. Built for a chunk of rois at a time, whose axes fit
 * kTableBudget (a roi larger than that is a chunk of its own). */
constexpr int64_t kTableBudget = int64_t(1) << 20;   /* axes in a table */

template <typename T> struct RoiTable {
    int64_t begin = 0, end = 0;
    Geometry<T> *geometry = nullptr;
    int64_t *first_row = nullptr, *first_col = nullptr;   /* per roi, into rows / cols */
    Axis<T> *rows = nullptr, *cols = nullptr;

    RoiTable() = default;
    RoiTable(const RoiTable &) = delete;
    RoiTable &operator=(const RoiTable &) = delete;
    ~RoiTable() { release(); }

    void release() {
        free(geometry), free(first_row), free(first_col), free(rows), free(cols);
        geometry = nullptr, first_row = first_col = nullptr, rows = cols = nullptr;
    }

    /* The next chunk, from roi `from`; MMD_OK or an out-of-memory error. */
    int build(const Call<T> &call, int64_t from) {
        release();
        begin = end = from;
        int64_t n_rows = 0, n_cols = 0;
        while (end < call.num_rois) {
            Geometry<T> g{};
            call.geometry(end, &g);
            const int64_t more = call.pooled_h * g.grid_h + call.pooled_w * g.grid_w;
            if (end > begin && n_rows + n_cols + more > kTableBudget) break;
            n_rows += call.pooled_h * g.grid_h;
            n_cols += call.pooled_w * g.grid_w;
            ++end;
        }
        const int64_t count = end - begin;
        geometry = (Geometry<T> *)malloc(sizeof(Geometry<T>) * count);
        first_row = (int64_t *)malloc(sizeof(int64_t) * count);
        first_col = (int64_t *)malloc(sizeof(int64_t) * count);
        rows = (Axis<T> *)malloc(sizeof(Axis<T>) * (n_rows + 1));
        cols = (Axis<T> *)malloc(sizeof(Axis<T>) * (n_cols + 1));
        if (!geometry || !first_row || !first_col || !rows || !cols)
            return mmd_error(MMD_ERR_MEMORY, "out of memory for the sample weights of rois "
                             "%lld to %lld", (long long)begin, (long long)end - 1);
        int64_t r = 0, c = 0;
        for (int64_t k = begin; k < end; ++k) {
            Geometry<T> &g = geometry[k - begin];
            g = Geometry<T>{};
            call.geometry(k, &g);
            first_row[k - begin] = r, first_col[k - begin] = c;
            r += call.pooled_h * g.grid_h;
            c += call.pooled_w * g.grid_w;
        }
        return mmd_parallel_for(count, mmd_even_chunk(count),
                                mmd_worth_threads(count, n_rows + n_cols),
                                [&](int64_t b0, int64_t b1) {
            for (int64_t i = b0; i < b1; ++i) {
                const Geometry<T> &g = geometry[i];
                for (int64_t ph = 0; ph < call.pooled_h; ++ph)
                    for (int64_t iy = 0; iy < g.grid_h; ++iy)
                        mmd_interp(mmd_roi_align_sample(g.start_h, g.bin_h, ph, iy, g.grid_h),
                                   call.height, &rows[first_row[i] + ph * g.grid_h + iy]);
                for (int64_t pw = 0; pw < call.pooled_w; ++pw)
                    for (int64_t ix = 0; ix < g.grid_w; ++ix)
                        mmd_interp(mmd_roi_align_sample(g.start_w, g.bin_w, pw, ix, g.grid_w),
                                   call.width, &cols[first_col[i] + pw * g.grid_w + ix]);
            }
            return (int)MMD_OK;
        });
    }

    /* Roi k's sample rows of bin row ph and columns of bin column pw. */
    const Axis<T> *rows_of(int64_t k, int64_t ph) const {
        return rows + first_row[k - begin] + ph * geometry[k - begin].grid_h;
    }
    const Axis<T> *cols_of(int64_t k, int64_t pw) const {
        return cols + first_col[k - begin] + pw * geometry[k - begin].grid_w;
    }
    T divisor(int64_t k) const {
        const int64_t count = geometry[k - begin].grid_h * geometry[k - begin].grid_w;
        return (T)(count > 1 ? count : 1);
    }
};

/* One roi's samples in an item's planes: its sample rows and columns of
 * the item's bin, the bin's sample count (at least 1), and the element of
 * output (or grad_output) the bin is in the item's first plane; the next
 * planes' are `bins` apart. */
template <typename T> struct BinSamples {
    const Axis<T> *rows, *cols;
    int64_t grid_h, grid_w, out;
    T divisor;
};

/* For each chunk of rois (RoiTable) and every item (ps_plane_groups.h):
 * f(size, planes, samples) for each roi of the chunk on the item's image
 * (of the item's part of the chunk, where `split_rois`: the forward), in
 * order, with `planes` the offset of the item's first plane in the map
 * (the next are bins * plane_size apart). */
template <typename T, typename F>
int for_items_and_rois(const Call<T> &call, const T *map, bool split_rois, const F &f) {
    const int64_t bins = call.pooled_h * call.pooled_w, c_out = call.out_channels();
    const int64_t plane_size = call.height * call.width;
    const PsPlaneGroups groups(call.batch, call.channels, bins, split_rois, call.num_rois);
    RoiTable<T> table;
    for (int64_t from = 0; from < call.num_rois; from = table.end) {
        int s = table.build(call, from);
        if (s) return s;
        const int64_t work = call.batch * call.channels * (table.end - table.begin) * 4;
        s = ps_for_plane_groups(groups, map, plane_size, work,
                                [&](auto size, const PsItem &it, mmd_block_prefetch &next) {
            const int64_t ph = it.b / call.pooled_w, pw = it.b % call.pooled_w;
            const int64_t planes = groups.first_plane(it) * plane_size;
            int64_t first, last;
            it.rois(table.begin, table.end, &first, &last);
            for (int64_t k = first; k < last; ++k) {
                const Geometry<T> &g = table.geometry[k - table.begin];
                if (g.batch != it.n) continue;
                next.step();
                f(size, planes,
                  BinSamples<T>{table.rows_of(k, ph), table.cols_of(k, pw), g.grid_h, g.grid_w,
                                (k * c_out + it.co) * bins + it.b, table.divisor(k)});
            }
        });
        if (s) return s;
    }
    return MMD_OK;
}

template <typename T> int forward(const Call<T> &call, const T *input, T *output) {
    int s = mmd_check_rois<Geometry<T>>(call);
    const int64_t c_out = call.out_channels(), bins = call.pooled_h * call.pooled_w;
    if (s || call.num_rois * c_out * bins == 0) return s;
    const int64_t stride = bins * call.height * call.width;
    return for_items_and_rois(call, input, true,
                              [&](auto size, int64_t planes, const BinSamples<T> &b) {
        constexpr int G = decltype(size)::value;
        T sum[G] = {};
        for (int64_t iy = 0; iy < b.grid_h; ++iy) {
            const Axis<T> ay = b.rows[iy];
            for (int64_t ix = 0; ix < b.grid_w; ++ix) {
                const Axis<T> ax = b.cols[ix];
                /* a sample outside the map adds 0 (its weights) */
                if (!(ay.valid && ax.valid)) continue;
                for (int g = 0; g < G; ++g)
                    sum[g] += mmd_ps_roi_align_bilinear(input + planes + g * stride, call.width,
                                                        ay, ax);
            }
        }
        for (int g = 0; g < G; ++g) output[b.out + g * bins] = sum[g] / b.divisor;
    });
}

/* Adds into grad_input (the caller passes it initialised, zeros for a plain
 * gradient); each plane gets the rois in order. */
template <typename T> int backward(const Call<T> &call, const T *grad_output, T *grad_input) {
    int s = mmd_check_rois<Geometry<T>>(call);
    const int64_t bins = call.pooled_h * call.pooled_w, c_out = call.out_channels();
    if (s || call.num_rois * c_out * bins == 0 || call.height * call.width == 0) return s;
    const int64_t stride = bins * call.height * call.width, width = call.width;
    return for_items_and_rois(call, (const T *)grad_input, false,
                              [&](auto size, int64_t planes, const BinSamples<T> &b) {
        constexpr int G = decltype(size)::value;
        T grad[G];
        for (int g = 0; g < G; ++g) grad[g] = grad_output[b.out + g * bins] / b.divisor;
        for (int64_t iy = 0; iy < b.grid_h; ++iy) {
            const Axis<T> ay = b.rows[iy];   /* copies: the stores below may not change them */
            if (!ay.valid) continue;
            for (int64_t ix = 0; ix < b.grid_w; ++ix) {
                const Axis<T> ax = b.cols[ix];
                if (!ax.valid) continue;
                const int64_t ll = ay.low * width + ax.low, lh = ay.low * width + ax.high;
                const int64_t hl = ay.high * width + ax.low, hh = ay.high * width + ax.high;
                for (int g = 0; g < G; ++g) {
                    T *plane = grad_input + planes + g * stride;
                    plane[ll] += grad[g] * ay.w_low * ax.w_low;
                    plane[lh] += grad[g] * ay.w_low * ax.w_high;
                    plane[hl] += grad[g] * ay.w_high * ax.w_low;
                    plane[hh] += grad[g] * ay.w_high * ax.w_high;
                }
            }
        }
    });
}

int ps_roi_align_forward_cpu(const mmd_tensor *input, const mmd_tensor *rois,
                             const mmd_tensor *output, int64_t pooled_height,
                             int64_t pooled_width, double spatial_scale, int64_t sampling_ratio,
                             const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_align_forward_check(input, rois, output, pooled_height, pooled_width,
                                           spatial_scale, sampling_ratio, MMD_FLOAT32_64);
    if (s) return s;
    if (input->dtype == MMD_FLOAT32)
        return forward(make_call<float>(input, rois, pooled_height, pooled_width, spatial_scale,
                                        sampling_ratio),
                       (const float *)input->data, (float *)output->data);
    return forward(make_call<double>(input, rois, pooled_height, pooled_width, spatial_scale,
                                     sampling_ratio),
                   (const double *)input->data, (double *)output->data);
}

int ps_roi_align_backward_cpu(const mmd_tensor *grad_output, const mmd_tensor *rois,
                              const mmd_tensor *grad_input, int64_t pooled_height,
                              int64_t pooled_width, double spatial_scale, int64_t sampling_ratio,
                              const mmd_context *ctx) {
    (void)ctx;
    int s = mmd_ps_roi_align_backward_check(grad_output, rois, grad_input, pooled_height,
                                            pooled_width, spatial_scale, sampling_ratio,
                                            MMD_FLOAT32_64);
    if (s) return s;
    if (grad_input->dtype == MMD_FLOAT32)
        return backward(make_call<float>(grad_input, rois, pooled_height, pooled_width,
                                         spatial_scale, sampling_ratio),
                        (const float *)grad_output->data, (float *)grad_input->data);
    return backward(make_call<double>(grad_input, rois, pooled_height, pooled_width,
                                      spatial_scale, sampling_ratio),
                    (const double *)grad_output->data, (double *)grad_input->data);
}

}  // namespace

MMD_REGISTRATIONS(cpu, ps_roi_align) {
    MMD_REGISTER_DEVICE_IMPL(ps_roi_align_forward_impl, CPU, DEFAULT, ps_roi_align_forward_cpu);
    MMD_REGISTER_DEVICE_IMPL(ps_roi_align_backward_impl, CPU, DEFAULT, ps_roi_align_backward_cpu);
}
