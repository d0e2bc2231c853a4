/* Channel chunks of a map in (batch, height, width, kLanes) scratch, for
 * the roi kernels whose bins read the map's cells many times over (roi_align's
 * avg kernels, roi_pool's forward): the map kLanes channels at a time,
 * transposed so that a cell's channels of the chunk lie in one line; then a
 * block per roi, a warp per bin, a lane per channel, each cell one
 * coalesced load of the chunk's channels, the bins' geometry worked out
 * once for them (uniform in the warp). Per-element kernels' lanes are 32
 * bins instead, each load a sector of its own. */
#ifndef MMDISPATCH_CUDA_CHUNKS_CUH
#define MMDISPATCH_CUDA_CHUNKS_CUH

#include "mmdispatch/cuda/common.cuh"

namespace mmd_cuda {

constexpr int kLanes = 32;
/* The shared memory a launch gets without opting in. */
constexpr size_t kChunkShared = 48 * 1024;

/* Whether a call takes the chunked kernels: a map with cells,
 * MMD_CUDA_TRANSPOSED_MIN_ROIS rois or more (fewer leave most of a GPU's
 * SMs idle in each of the chunks' launches, where a per-element kernel
 * spreads them over one launch), 16 channels or more (a chunk's filling
 * half a warp or more, but for a last partial chunk), a block's
 * `shared_per_bin` bytes a bin fitting in kChunkShared, and the bins
 * (about `reads_per_bin` cells each) reading at least
 * MMD_CUDA_TRANSPOSED_MIN_READS times the map's cells (the transposition
 * reads and writes the map once). The emulator's build sets both limits
 * to 0. */
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

/* Tiles of a (batch, cells) map: f(n, cell0) for each of the block's
 * (grid-stride). */
template <typename F>
__device__ inline void for_each_tile(int64_t batch, int64_t cells, F f) {
    const int64_t tiles = (cells + kTileCells - 1) / kTileCells;
    for (int64_t t = blockIdx.x; t < batch * tiles; t += gridDim.x)
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

/* chunk[((n * cells + i) * kLanes + c] = input[n, c0 + c, i] for the
 * chunk's `count` channels (0 in the lanes past them). */
template <typename T>
__global__ void __launch_bounds__(kLanes * kTransposeRows)
    transpose_chunk_kernel(const T *input, T *chunk, int64_t batch, int64_t channels,
                           int64_t cells, int64_t c0, int64_t count) {
    typedef typename Compute<T>::type A;
    __shared__ A tile[kLanes][kTileCells + 1];   /* [channel][cell] */
    for_each_tile(batch, cells, [&](int64_t n, int64_t cell0) {
        const T *from = input + (n * channels + c0) * cells + cell0;
        A v[kChannelsPerRow][kTileSpans];
        for_each_place([&](int i, int s, int c, int cell) {
            v[i][s] = c < count && cell0 + cell < cells ? to_compute(from[c * cells + cell])
                                                        : (A)0;
        });
        for_each_place([&](int i, int s, int c, int cell) { tile[c][cell] = v[i][s]; });
        __syncthreads();
        T *to = chunk + (n * cells + cell0) * kLanes + threadIdx.x;
        for_each_cell_place([&](int, int j) {
            if (cell0 + j < cells) to[j * kLanes] = from_compute<T>(tile[threadIdx.x][j]);
        });
        __syncthreads();
    });
}

/* The chunked kernels' launches for a (batch, channels, height, width) map
 * and num_rois rois: a block per roi (grid-stride), and each(f) calls
 * f(c0, count) for each chunk of kLanes channels, [c0, c0 + count), until
 * one fails. */
struct Chunks {
    int64_t batch, channels, cells;
    unsigned transpose_blocks, roi_blocks;

    Chunks(int64_t batch_, int64_t channels_, int64_t height, int64_t width, int64_t num_rois)
        : batch(batch_), channels(channels_), cells(height * width) {
        const int64_t tiles = batch * ((cells + kTileCells - 1) / kTileCells);
        transpose_blocks = grid_of(tiles);
        roi_blocks = grid_of(num_rois);
    }
    /* Elements of a chunk's scratch: (batch, height, width, kLanes). */
    int64_t scratch_size() const { return batch * cells * kLanes; }
    /* Allocates the scratch, of elements of `element_size` bytes, in
     * *chunk; false (the error cleared) where the device has no memory for
     * it: the per-element kernels need none. */
    bool allocate(StreamBuffer *chunk, size_t element_size) const {
        if (chunk->allocate(element_size * (size_t)scratch_size()) == cudaSuccess) return true;
        cudaGetLastError();
        return false;
    }
    template <typename F> int each(F f) const {
        for (int64_t c0 = 0; c0 < channels; c0 += kLanes) {
            const int s = f(c0, channels - c0 < kLanes ? channels - c0 : kLanes);
            if (s) return s;
        }
        return MMD_OK;
    }
    /* Chunk [c0, c0 + count) of the map `input` into scratch `chunk`. */
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
