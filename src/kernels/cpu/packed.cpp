#include "kernels/cpu/packed.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "base/error.h"
#include "base/thread_pool.h"
#include "kernels/act_quant.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "tensor/dequant.h"

namespace serval::cpu {
namespace {

// One row's block of 32 values, unpacked to unsigned integers, and how they scale.
struct BlockMeta {
  float scale = 0, neg_min = 0;
  int32_t sub_lo = 0, sub_hi = 0;
};

float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return fp16_to_f32(h);
}

void scale_min_k4(int j, const uint8_t* q, int* sc, int* mn) {
  if (j < 4) {
    *sc = q[j] & 63;
    *mn = q[j + 4] & 63;
  } else {
    *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

// Q4_0 / Q5_0 / Q8_0: one block of 32 per GGUF block.
void unpack_q4_0(const uint8_t* b, uint8_t* u, BlockMeta* m) {
  m->scale = half_at(b);
  for (int j = 0; j < 16; ++j) u[j] = b[2 + j] & 0x0F, u[j + 16] = b[2 + j] >> 4;
}
void unpack_q5_0(const uint8_t* b, uint8_t* u, BlockMeta* m) {
  m->scale = half_at(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  for (int j = 0; j < 16; ++j) {
    u[j] = uint8_t((b[6 + j] & 0x0F) | (((qh >> j) & 1) << 4));
    u[j + 16] = uint8_t((b[6 + j] >> 4) | (((qh >> (j + 16)) & 1) << 4));
  }
}
void unpack_q8_0(const uint8_t* b, uint8_t* u, BlockMeta* m) {
  m->scale = half_at(b);
  for (int j = 0; j < 32; ++j) u[j] = uint8_t(int(int8_t(b[2 + j])) + 128);
}

// Q4_K / Q5_K: 8 blocks of 32 per super-block; value = d * sc * q - dmin * mn.
template <bool kFive>
void unpack_q45_k(const uint8_t* b, uint8_t* u, BlockMeta* m) {
  const float d = half_at(b), dmin = half_at(b + 2);
  const uint8_t* qh = b + 16;
  const uint8_t* ql = b + (kFive ? 48 : 16);
  for (int j = 0; j < 8; ++j) {
    int sc, mn;
    scale_min_k4(j, b + 4, &sc, &mn);
    m[j].scale = d * float(sc);
    m[j].neg_min = -(dmin * float(mn));
    for (int l = 0; l < 32; ++l) {
      const uint8_t byte = ql[32 * (j / 2) + l];
      int v = j % 2 ? byte >> 4 : byte & 0x0F;
      if (kFive) v |= ((qh[l] >> j) & 1) << 4;
      u[32 * j + l] = uint8_t(v);
    }
  }
}

// Q6_K: 16 sub-blocks of 16 with int8 scales; value = d * sc * (q - 32).
void unpack_q6_k(const uint8_t* b, uint8_t* u, BlockMeta* m) {
  const float d = half_at(b + 208);
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  for (int h = 0; h < 2; ++h) {
    const uint8_t *ql = b + 64 * h, *qh = b + 128 + 32 * h;
    for (int l = 0; l < 32; ++l) {
      uint8_t* o = u + 128 * h;
      o[l] = uint8_t((ql[l] & 0x0F) | ((qh[l] & 3) << 4));
      o[32 + l] = uint8_t((ql[32 + l] & 0x0F) | (((qh[l] >> 2) & 3) << 4));
      o[64 + l] = uint8_t((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4));
      o[96 + l] = uint8_t((ql[32 + l] >> 4) | (((qh[l] >> 6) & 3) << 4));
    }
  }
  for (int j = 0; j < 8; ++j) m[j] = {d, 0.0f, sc[2 * j], sc[2 * j + 1]};
}

struct TypeLayout {
  DType type;
  bool nibbles, plane, split, mins;
  int offset;
  int blocks_per_unit;  // blocks of 32 per GGUF block
  void (*unpack)(const uint8_t*, uint8_t*, BlockMeta*);
};

constexpr TypeLayout kLayouts[] = {
    {DType::Q4_0, true, false, false, false, 8, 1, unpack_q4_0},
    {DType::Q5_0, true, true, false, false, 16, 1, unpack_q5_0},
    {DType::Q8_0, false, false, false, false, 128, 1, unpack_q8_0},
    {DType::Q4_K, true, false, false, true, 0, 8, unpack_q45_k<false>},
    {DType::Q5_K, true, true, false, true, 0, 8, unpack_q45_k<true>},
    {DType::Q6_K, false, false, true, false, 32, 8, unpack_q6_k},
};

const TypeLayout* layout_of(DType t) {
  for (const auto& l : kLayouts)
    if (l.type == t) return &l;
  return nullptr;
}

// Stores one row's unpacked values into its lane of a group.
void place_row(PackedWeights& p, int64_t g, int r, const uint8_t* u) {
  for (int64_t b = 0; b < p.n_blocks; ++b) {
    uint8_t* dst = p.q.get() + (g * p.n_blocks + b) * p.block_bytes();
    const uint8_t* v = u + b * kPackBlock;
    if (!p.nibbles) {
      for (int k4 = 0; k4 < 8; ++k4) std::memcpy(dst + k4 * 64 + 4 * r, v + 4 * k4, 4);
      continue;
    }
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) dst[j * 64 + 4 * r + i] = uint8_t((v[4 * j + i] & 0x0F) | ((v[4 * (j + 4) + i] & 0x0F) << 4));
    if (!p.plane) continue;
    for (int k4 = 0; k4 < 8; ++k4) {  // row r's 4 bytes of vector k4 are bits 4r .. 4r+3 of its mask
      int bits = 0;
      for (int i = 0; i < 4; ++i) bits |= ((v[4 * k4 + i] >> 4) & 1) << i;
      dst[256 + 8 * k4 + r / 2] |= uint8_t(bits << (4 * (r % 2)));
    }
  }
}

void pack_group(const WeightMatrix& w, const TypeLayout& l, PackedWeights& p, int64_t g) {
  const int64_t unit_bytes = dtype_info(w.type).block_bytes;
  std::vector<uint8_t> u(p.cols);
  std::vector<BlockMeta> meta(p.n_blocks);
  for (int r = 0; r < kPackRows; ++r) {
    const int64_t row = g * kPackRows + r;
    if (row >= p.rows) break;  // padding rows keep zero values and scales
    const uint8_t* src = w.data + row * w.row_stride;
    for (int64_t b = 0; b < p.n_blocks; b += l.blocks_per_unit)
      l.unpack(src + (b / l.blocks_per_unit) * unit_bytes, u.data() + b * kPackBlock, meta.data() + b);
    place_row(p, g, r, u.data());
    for (int64_t b = 0; b < p.n_blocks; ++b) {
      const size_t i = p.index(g, b) + r;
      p.scale[i] = meta[b].scale;
      if (p.mins) p.neg_min[i] = meta[b].neg_min;
      if (p.split) p.sub[2 * p.index(g, b) + r] = meta[b].sub_lo, p.sub[2 * p.index(g, b) + kPackRows + r] = meta[b].sub_hi;
    }
  }
}

}  // namespace

void AlignedFree::operator()(void* p) const { std::free(p); }

size_t PackedWeights::bytes() const {
  return size_t(n_groups * n_blocks) * block_bytes() + scale.size() * 4 + neg_min.size() * 4 + sub.size() * 4;
}

bool packable(DType type) { return layout_of(type) != nullptr; }

std::shared_ptr<const PackedWeights> pack_weights(const WeightMatrix& w) {
  const TypeLayout* l = layout_of(w.type);
  check(l != nullptr, "no packed layout for this weight type");
  check(w.cols % (kPackBlock * l->blocks_per_unit) == 0, "packed weights need whole blocks");
  auto p = std::make_shared<PackedWeights>();
  p->source = w.type;
  p->nibbles = l->nibbles, p->plane = l->plane, p->split = l->split, p->mins = l->mins, p->offset = l->offset;
  p->rows = w.rows, p->cols = w.cols;
  p->n_groups = (w.rows + kPackRows - 1) / kPackRows, p->n_blocks = w.cols / kPackBlock;
  const size_t q_bytes = size_t(p->n_groups * p->n_blocks) * p->block_bytes();
  p->q.reset(static_cast<uint8_t*>(std::aligned_alloc(64, (q_bytes + 63) / 64 * 64)));
  check(p->q != nullptr, "out of memory packing weights");
  std::memset(p->q.get(), 0, q_bytes);
  const size_t n_meta = size_t(p->n_groups * p->n_blocks) * kPackRows;
  p->scale.assign(n_meta, 0.0f);
  if (p->mins) p->neg_min.assign(n_meta, 0.0f);
  if (p->split) p->sub.assign(2 * n_meta, 0);
  parallel_for(p->n_groups, [&](int64_t g) { pack_group(w, *l, *p, g); });
  return p;
}

void quantize_packed_acts(DType weight_type, const float* x, int64_t cols, int64_t n_tok, PackedActs& out) {
  const ActType at = act_type_for(weight_type);
  check(at == ActType::Q8_0 || at == ActType::Q8_K, "packed activations are Q8_0 or Q8_K");
  out.n_tok = n_tok, out.cols = cols, out.n_blocks = cols / kPackBlock;
  const int64_t padded = (n_tok + 15) / 16 * 16;
  out.qs.resize(padded * cols);
  std::fill(out.qs.begin() + n_tok * cols, out.qs.end(), int8_t(0));
  out.d.resize(n_tok * out.n_blocks);
  out.sums.resize(n_tok * out.n_blocks * 2);
  const size_t row_bytes = act_row_bytes(at, cols);
#if defined(SERVAL_X86_KERNELS)
  if (active_isa() >= Isa::Avx512) {
    parallel_for(n_tok, [&](int64_t t) {
      quantize_act_row_avx512(at == ActType::Q8_K, x + t * cols, cols, out.qs.data() + t * cols,
                              out.d.data() + t * out.n_blocks, out.sums.data() + t * out.n_blocks * 2);
    });
    return;
  }
#endif
  parallel_for(n_tok, [&](int64_t t) {
    std::vector<uint8_t> buf(row_bytes);
    quantize_act_row(at, x + t * cols, cols, buf.data());
    int8_t* qs = out.qs.data() + t * cols;
    float* d = out.d.data() + t * out.n_blocks;
    if (at == ActType::Q8_0) {
      const auto* blocks = reinterpret_cast<const BlockQ8_0*>(buf.data());
      for (int64_t b = 0; b < out.n_blocks; ++b) {
        d[b] = fp16_to_f32(blocks[b].d);
        std::memcpy(qs + b * 32, blocks[b].qs, 32);
      }
    } else {
      const auto* blocks = reinterpret_cast<const BlockQ8_K*>(buf.data());
      for (int64_t b = 0; b < out.n_blocks; ++b) d[b] = blocks[b / 8].d;
      for (int64_t s = 0; s < cols / 256; ++s) std::memcpy(qs + s * 256, blocks[s].qs, 256);
    }
    int32_t* sums = out.sums.data() + t * out.n_blocks * 2;
    for (int64_t h = 0; h < out.n_blocks * 2; ++h) {
      int32_t s = 0;
      for (int i = 0; i < 16; ++i) s += qs[h * 16 + i];
      sums[h] = s;
    }
  });
}

}  // namespace serval::cpu
