/* Channel chunks of a map in (batch, height, width, kLanes) scratch, for
 * the roi kernels whose bins read the map's cells many times over
 * (roi_align's avg kernels, roi_pool's forward): the map kLanes channels at
 * a time, transposed so that a cell's channels of the chunk lie in one line
 * (a group of chunks a launch, below); then a block per (chunk, roi), a
 * warp per bin, a lane per channel, each cell one coalesced load of the
 * chunk's channels, the bins' geometry worked out once for them (uniform in
 * the warp). Per-element kernels' lanes are 32 bins instead, each load a
 * sector of its own. */
#ifndef MMDISPATCH_CUDA_CHUNKS_CUH
#define MMDISPATCH_CUDA_CHUNKS_CUH

#include "mmdispatch/cuda/common.cuh"

namespace mmd_cuda {

constexpr int kLanes = 32;
/* The shared memory a launch gets without opting in. */
constexpr size_t kChunkShared = 48 * 1024;

/* Whether a call takes the chunked kernels: a map with cells,
 * MMD_CUDA_TRANSPOSED_MIN_ROIS rois or more (fewer left most of a GPU's SMs
 * idle in each chunk's launch, where a per-element kernel spreads them over
 * one launch; a launch of a group of chunks may need fewer: untimed), 16
 * channels or more (a chunk's filling half a warp or more, but for a last
 * partial chunk), a block's `shared_per_bin` bytes a bin fitting in
 * kChunkShared, and the bins (about `reads_per_bin` cells each) reading at
 * least MMD_CUDA_TRANSPOSED_MIN_READS times the map's cells (the
 * transposition reads and writes the map once). The emulator's build sets
 * both limits to 0. */
#ifndef MMD_CUDA_TRANSPOSED_MIN_READS
#define MMD_CUDA_TRANSPOSED_MIN_READS 2
#endif
#ifndef MMD_CUDA_TRANSPOSED_MIN_ROIS
#define MMD_CUDA_TRANSPOSED_MIN_ROIS 256
#endif
inline bool chunks_pay(int64_t num_rois, int64_t channels, int64_t batch, int64_t height,
                       int64_t width, int64_t bins, double reads_per_bin,
                       size_t shared_per_bin) {
    if (batch <= 0 || height <= 0 || width <= 0 || num_rois <= 0 ||
        num_rois < MMD_CUDA_TRANSPOSED_MIN_ROIS || channels < kLanes / 2 ||
        bins > (int64_t)(kChunkShared / shared_per_bin))
        return false;
    const double reads = (double)num_rois * (double)bins * reads_per_bin;
    return reads >= MMD_CUDA_TRANSPOSED_MIN_READS * (double)batch * (double)height * (double)width;
}

/* Bin b's row, in a chunked kernel: in int (a chunk's bins fit
 * kChunkShared, so there are at most 384), where a 64-bit division takes
 * several times the instructions. */
__device__ inline int64_t bin_row(int64_t b, int64_t pooled_w) { return (int)b / (int)pooled_w; }

/* The transpositions between the map's planes and a chunk's (n, h, w, kLanes)
 * scratch move tiles of kLanes channels x kTileCells cells through shared
 * memory, a block of kLanes x kTransposeRows threads per tile, so that both
 * sides' accesses coalesce. Each thread issues its kTileSpans x
 * kLanes / kTransposeRows loads together (unrolled) before it uses any.
 * Tiles of 32 cells, loaded in a loop of stride blockDim.y with a shared
 * store between the loads, kept one load a thread in flight: 15 us a chunk
 * of the bench's map (ncu on the H200, 2026-11-27), 2 TB/s for the 31 MB
 * read and written, 43 % of the card's peak (this version is not timed). */
constexpr int kTransposeRows = 8;
constexpr int kTileSpans = 4;
constexpr int kTileCells = kTileSpans * kLanes;
constexpr int kChannelsPerRow = kLanes / kTransposeRows;      /* a thread's channels */
constexpr int kCellsPerRow = kTileCells / kTransposeRows;     /* a thread's cells */

/* A launch of the chunked kernels takes a group of chunks, [c0, c0 +
 * count) with count up to group * kLanes channels, its scratch laid out
 * (chunk of the group, batch, height, width, kLanes): one transposition and
 * one launch of the bins' kernel a group, where a launch a chunk paid 8
 * launches' tails (a launch of a few hundred rois' blocks fills a GPU for
 * less than a wave) and their host time on the bench's map, 16 on each of
 * an FPN's levels (forward and backward). A group is as many chunks as
 * MMD_CUDA_CHUNK_GROUP_BYTES of scratch hold, at most
 * MMD_CUDA_CHUNK_GROUP_MAX (the emulator's build sets 2, so that its
 * tests take several groups). */
#ifndef MMD_CUDA_CHUNK_GROUP_BYTES
#define MMD_CUDA_CHUNK_GROUP_BYTES (32 << 20)
#endif
#ifndef MMD_CUDA_CHUNK_GROUP_MAX
#define MMD_CUDA_CHUNK_GROUP_MAX 1024
#endif
static_assert(MMD_CUDA_CHUNK_GROUP_MAX >= 1, "a launch takes a chunk at least");

/* Chunks of `count` channels. */
__host__ __device__ inline int64_t chunks_in(int64_t count) {
    return (count + kLanes - 1) / kLanes;
}

/* Chunk `index` of a group [c0, c0 + count): its channels [c0, c0 + count)
 * of the map's. */
struct Chunk {
    int64_t index, c0, count;
    __host__ __device__ Chunk(int64_t group_c0, int64_t group_count, int64_t index_)
        : index(index_), c0(group_c0 + index_ * kLanes),
          count(group_count - index_ * kLanes < kLanes ? group_count - index_ * kLanes
                                                       : kLanes) {}
};

/* f(k, chunk) for each roi k and Chunk of a group of `count` channels from
 * c0 that the block takes: a block per (chunk, roi), chunk-major (the
 * blocks at work at a time read one chunk's scratch), grid-stride. */
template <typename F>
__device__ inline void for_each_roi_of_chunks(int64_t num_rois, int64_t c0, int64_t count, F f) {
    const int64_t items = num_rois * chunks_in(count);
    for (int64_t item = blockIdx.x; item < items; item += gridDim.x)
        f(item % num_rois, Chunk(c0, count, item / num_rois));
}

/* Tiles of a group's (chunk, batch, cells) planes: f(plane, cell0) for
 * each of the block's (grid-stride), plane = chunk * batch + image. */
template <typename F>
__device__ inline void for_each_tile(int64_t planes, int64_t cells, F f) {
    const int64_t tiles = (cells + kTileCells - 1) / kTileCells;
    for (int64_t t = blockIdx.x; t < planes * tiles; t += gridDim.x)
        f(t / tiles, (t % tiles) * kTileCells);
}

/* f(i, s, c, cell) for each of the thread's kChannelsPerRow x kTileSpans
 * places (channel c, cell) of a [channel][cell] tile, unrolled (the
 * loads of the places in flight together). */
template <typename F> __device__ inline void for_each_place(F f) {
#pragma unroll
    for (int i = 0; i < kChannelsPerRow; ++i)
#pragma unroll
        for (int s = 0; s < kTileSpans; ++s)
            f(i, s, (int)threadIdx.y + i * kTransposeRows, s * kLanes + (int)threadIdx.x);
}

/* f(i, j) for each of the thread's kCellsPerRow cells j of a
 * [cell][channel] tile (its channel threadIdx.x), unrolled. */
template <typename F> __device__ inline void for_each_cell_place(F f) {
#pragma unroll
    for (int i = 0; i < kCellsPerRow; ++i) f(i, (int)threadIdx.y + i * kTransposeRows);
}

/* chunk[((g * batch + n) * cells + i) * kLanes + c] = input[n, c0 + g *
 * kLanes + c, i] for each chunk g of the group of `count` channels from
 * c0 (0 in the lanes past a chunk's channels). */
template <typename T>
__global__ void __launch_bounds__(kLanes * kTransposeRows)
    transpose_chunk_kernel(const T *input, T *chunk, int64_t batch, int64_t channels,
                           int64_t cells, int64_t c0, int64_t count) {
    typedef typename Compute<T>::type A;
    __shared__ A tile[kLanes][kTileCells + 1];   /* [channel][cell] */
    for_each_tile(chunks_in(count) * batch, cells, [&](int64_t plane, int64_t cell0) {
        const Chunk part(c0, count, plane / batch);
        const T *from = input + (plane % batch * channels + part.c0) * cells + cell0;
        A v[kChannelsPerRow][kTileSpans];
        for_each_place([&](int i, int s, int c, int cell) {
            v[i][s] = c < part.count && cell0 + cell < cells ? to_compute(from[c * cells + cell])
                                                             : (A)0;
        });
        for_each_place([&](int i, int s, int c, int cell) { tile[c][cell] = v[i][s]; });
        __syncthreads();
        T *to = chunk + (plane * cells + cell0) * kLanes + threadIdx.x;
        for_each_cell_place([&](int, int j) {
            if (cell0 + j < cells) to[j * kLanes] = from_compute<T>(tile[threadIdx.x][j]);
        });
        __syncthreads();
    });
}

/* The chunked kernels' launches for a (batch, channels, height, width) map
 * and num_rois rois, with scratch of `element_size` bytes an element: a
 * block per (chunk, roi) of a group (grid-stride), and each(f) calls f(c0,
 * count) for each group of chunks, channels [c0, c0 + count), until one
 * fails. */
struct Chunks {
    int64_t batch, channels, cells, num_rois;
    size_t element_size;
    int64_t group;   /* chunks a launch takes */
    unsigned transpose_blocks, roi_blocks;

    Chunks(int64_t batch_, int64_t channels_, int64_t height, int64_t width, int64_t num_rois_,
           size_t element_size_)
        : batch(batch_), channels(channels_), cells(height * width), num_rois(num_rois_),
          element_size(element_size_) {
        const double chunk_bytes = (double)element_size * (double)batch * (double)cells * kLanes;
        const double fit = chunk_bytes > 0 ? (double)MMD_CUDA_CHUNK_GROUP_BYTES / chunk_bytes : 1;
        int64_t most = chunks_in(channels);
        most = most < MMD_CUDA_CHUNK_GROUP_MAX ? most : MMD_CUDA_CHUNK_GROUP_MAX;
        set_group(fit < 1 ? 1 : (fit < (double)most ? (int64_t)fit : most));
    }
    void set_group(int64_t chunks) {
        group = chunks;
        const int64_t tiles = batch * ((cells + kTileCells - 1) / kTileCells);
        transpose_blocks = grid_of(group * tiles);
        roi_blocks = grid_of(group * num_rois);
    }
    /* Elements of a group's scratch: (group, batch, height, width, kLanes). */
    int64_t scratch_size() const { return group * batch * cells * kLanes; }
    /* Allocates a group's scratch in *chunk, halving the group where the
     * device has no memory for it; false (the error cleared) where it has
     * none for one chunk: the per-element kernels need none. */
    bool allocate(StreamBuffer *chunk) {
        while (chunk->allocate(element_size * (size_t)scratch_size()) != cudaSuccess) {
            cudaGetLastError();
            if (group == 1) return false;
            set_group((group + 1) / 2);
        }
        return true;
    }
    template <typename F> int each(F f) const {
        const int64_t step = group * kLanes;
        for (int64_t c0 = 0; c0 < channels; c0 += step) {
            const int s = f(c0, channels - c0 < step ? channels - c0 : step);
            if (s) return s;
        }
        return MMD_OK;
    }
    /* The group [c0, c0 + count) of the map `input` into scratch `chunk`. */
    template <typename T>
    int transpose(const T *input, T *chunk, int64_t c0, int64_t count, const char *what,
                  cudaStream_t stream) const {
        transpose_chunk_kernel<T><<<transpose_blocks, dim3(kLanes, kTransposeRows), 0, stream>>>(
            input, chunk, batch, channels, cells, c0, count);
        return launch_status(what);
    }
};

}  // namespace mmd_cuda

#endif
