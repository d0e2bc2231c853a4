/* Heap arrays for the CPU kernels' scratch memory, freed at scope exit. */
#ifndef MMDISPATCH_CPU_HEAP_ARRAY_H
#define MMDISPATCH_CPU_HEAP_ARRAY_H

#include <stdint.h>
#include <stdlib.h>

namespace {

/* n items of heap memory (at least one, so that an empty input is not an
 * allocation failure), freed with the holder; zeroed when asked. */
template <typename U> class HeapArray {
  public:
    explicit HeapArray(int64_t n, bool zeroed = false) { allocate(n, zeroed); }
    ~HeapArray() { free(data_); }
    HeapArray(const HeapArray &) = delete;
    HeapArray &operator=(const HeapArray &) = delete;
    U *get() const { return data_; }
    U &operator[](int64_t i) const { return data_[i]; }
    explicit operator bool() const { return data_ != nullptr; }
    /* n new items in place of the old ones */
    void reset(int64_t n, bool zeroed = false) {
        free(data_);
        allocate(n, zeroed);
    }

  private:
    void allocate(int64_t n, bool zeroed) {
        const size_t count = (size_t)(n > 0 ? n : 1);
        data_ = (U *)(zeroed ? calloc(count, sizeof(U)) : malloc(count * sizeof(U)));
    }
    U *data_;
};

/* n items, in the holder itself where n <= N (no allocation: scratch of
 * a small call), else on the heap, freed with the holder. */
template <typename U, int64_t N> class SmallArray {
  public:
    explicit SmallArray(int64_t n)
        : data_(n > N ? (U *)malloc((size_t)n * sizeof(U)) : inline_) {}
    ~SmallArray() {
        if (data_ != inline_) free(data_);
    }
    SmallArray(const SmallArray &) = delete;
    SmallArray &operator=(const SmallArray &) = delete;
    U *get() const { return data_; }
    U &operator[](int64_t i) const { return data_[i]; }
    explicit operator bool() const { return data_ != nullptr; }

  private:
    U inline_[N];
    U *data_;
};

}  // namespace

#endif
