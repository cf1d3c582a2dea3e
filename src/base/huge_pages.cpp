#include "base/huge_pages.h"

#include <sys/mman.h>

#include <cstdlib>

namespace serval {

void HugeDeleter::operator()(void* p) const {
  if (mapped == 0) std::free(p);
  else if (p) munmap(p, mapped);
}

HugeBuffer alloc_huge(size_t bytes) {
  if (bytes < kHugePage) return {static_cast<uint8_t*>(std::aligned_alloc(64, (bytes + 63) / 64 * 64)), HugeDeleter{}};
  const size_t len = (bytes + 4095) / 4096 * 4096;
  // Map 2 MiB more than needed, then unmap the head and tail around the first 2 MiB boundary.
  void* raw = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return {nullptr, HugeDeleter{}};
  const uintptr_t base = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t start = (base + kHugePage - 1) & ~uintptr_t(kHugePage - 1);
  if (start > base) munmap(raw, start - base);
  munmap(reinterpret_cast<void*>(start + len), base + kHugePage - start);  // start - base < kHugePage
  madvise(reinterpret_cast<void*>(start), len, MADV_HUGEPAGE);  // advice: an error leaves 4 KiB pages
  return {reinterpret_cast<uint8_t*>(start), HugeDeleter{len}};
}

}  // namespace serval
