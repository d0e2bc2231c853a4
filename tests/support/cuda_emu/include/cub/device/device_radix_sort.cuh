/* The CUDA emulator's cub::DeviceRadixSort (tests/support/cuda_emu): the
 * pair sorts, as a stable sort on the keys' radix order (floats by their
 * bits with the sign flipped, as CUB orders them), bits [begin, end). */
#ifndef MMD_EMU_CUB_DEVICE_RADIX_SORT_CUH
#define MMD_EMU_CUB_DEVICE_RADIX_SORT_CUH

#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "cuda_runtime.h"

namespace cub {

struct DeviceRadixSort {
    template <typename K> static uint64_t radix(K key, int begin_bit, int end_bit) {
        static_assert(sizeof(K) <= 8, "keys of at most 64 bits");
        uint64_t bits = 0;
        memcpy(&bits, &key, sizeof key);
        const int width = (int)sizeof(K) * 8;
        const uint64_t sign = (uint64_t)1 << (width - 1);
        if (std::is_floating_point<K>::value)
            bits = (bits & sign) ? ~bits : (bits | sign);
        else if (std::is_signed<K>::value)
            bits ^= sign;
        if (width < 64) bits &= ((uint64_t)1 << width) - 1;
        const uint64_t field = end_bit - begin_bit >= 64
                                   ? ~(uint64_t)0
                                   : (((uint64_t)1 << (end_bit - begin_bit)) - 1);
        return (bits >> begin_bit) & field;
    }

    template <typename K, typename V>
    static cudaError_t sort(void *scratch, size_t &scratch_bytes, const K *keys_in, K *keys_out,
                            const V *values_in, V *values_out, int n, int begin_bit, int end_bit,
                            bool descending) {
        if (scratch == nullptr) {
            scratch_bytes = 1;
            return cudaSuccess;
        }
        if (n < 0 || begin_bit < 0 || end_bit > (int)sizeof(K) * 8 || begin_bit >= end_bit)
            return cudaErrorInvalidValue;
        std::vector<int> order(n);
        for (int i = 0; i < n; ++i) order[i] = i;
        std::stable_sort(order.begin(), order.end(), [&](int a, int b) {
            const uint64_t ra = radix(keys_in[a], begin_bit, end_bit);
            const uint64_t rb = radix(keys_in[b], begin_bit, end_bit);
            return descending ? ra > rb : ra < rb;
        });
        std::vector<K> keys(n);
        std::vector<V> values(n);
        for (int i = 0; i < n; ++i) {
            keys[i] = keys_in[order[i]];
            values[i] = values_in[order[i]];
        }
        std::copy(keys.begin(), keys.end(), keys_out);
        std::copy(values.begin(), values.end(), values_out);
        return cudaSuccess;
    }

    template <typename K, typename V>
    static cudaError_t SortPairs(void *scratch, size_t &scratch_bytes, const K *keys_in,
                                 K *keys_out, const V *values_in, V *values_out, int n,
                                 int begin_bit = 0, int end_bit = sizeof(K) * 8,
                                 cudaStream_t = nullptr) {
        return sort(scratch, scratch_bytes, keys_in, keys_out, values_in, values_out, n,
                    begin_bit, end_bit, false);
    }

    template <typename K, typename V>
    static cudaError_t SortPairsDescending(void *scratch, size_t &scratch_bytes,
                                           const K *keys_in, K *keys_out, const V *values_in,
                                           V *values_out, int n, int begin_bit = 0,
                                           int end_bit = sizeof(K) * 8, cudaStream_t = nullptr) {
        return sort(scratch, scratch_bytes, keys_in, keys_out, values_in, values_out, n,
                    begin_bit, end_bit, true);
    }
};

}  // namespace cub

#endif
