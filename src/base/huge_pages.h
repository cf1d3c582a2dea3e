// Buffers that a forward pass streams through (packed weights, the KV cache's pools): from 2 MiB on, an
// anonymous mapping that starts on a 2 MiB boundary, advised into transparent huge pages, so that one
// TLB entry covers 2 MiB rather than 4 KiB (0.5B decode 7-15 % faster for the weights, docs/kernels.md;
// attention over an 8K cache about 10 %, docs/attention.md). Where the kernel gives no huge pages (THP
// "never") the advice does nothing. Pages are not touched here: they become resident when written.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>

namespace serval {

struct HugeDeleter {
  size_t mapped = 0;  // the length of a mapping from alloc_huge; 0: from std::aligned_alloc
  void operator()(void* p) const;
};
using HugeBuffer = std::unique_ptr<uint8_t[], HugeDeleter>;

// A 64-byte aligned buffer of `bytes` (below kHugePage: std::aligned_alloc). Null when out of memory.
HugeBuffer alloc_huge(size_t bytes);
constexpr size_t kHugePage = size_t(2) << 20;

}  // namespace serval
