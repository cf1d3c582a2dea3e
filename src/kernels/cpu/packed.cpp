#include "kernels/cpu/packed.h"

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>

#include "base/error.h"
#include "base/thread_pool.h"
#include "kernels/act_quant.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "tensor/blocks.h"
#include "tensor/dequant.h"

namespace serval::cpu {
namespace {

// One row's block of 32 values as unsigned integers, and how they scale.
struct BlockMeta {
  float scale = 0, neg_min = 0;     // per super-block (repeated for its blocks)
  int sub[2] = {1, 1}, min[2] = {1, 1};  // per half
};

// How a GGUF type maps onto the packed layout (packed.h).
struct TypeLayout {
  DType type;
  bool nibbles;
  int planes;  // bit planes above the nibbles, or kFp4Codes (packed.h)
  bool has_sub, split, mins;
  int offset;  // u = q + offset, q as tensor/blocks.h unpacks it
};

constexpr TypeLayout kLayouts[] = {
    {DType::Q4_0, true, 0, false, false, false, 8},    {DType::Q4_1, true, 0, false, false, true, 0},
    {DType::Q5_0, true, 1, false, false, false, 16},   {DType::Q5_1, true, 1, false, false, true, 0},
    {DType::Q8_0, false, 0, false, false, false, 128}, {DType::Q2_K, true, 0, true, true, true, 0},
    {DType::Q3_K, true, 0, true, true, false, 4},      {DType::Q4_K, true, 0, true, false, true, 0},
    {DType::Q5_K, true, 1, true, false, true, 0},      {DType::Q6_K, true, 2, true, true, false, 32},
    {DType::IQ4_NL, false, 0, false, false, false, 128},
    // MXFP4's values -12..12 with an offset of 12, kept as their 4-bit codes (kFp4Table); its scale stays
    // the file's E8M0 byte (scale_e8m0).
    {DType::MXFP4, true, kFp4Codes, false, false, false, 12},
};

const TypeLayout* layout_of(DType t) {
  for (const auto& l : kLayouts)
    if (l.type == t) return &l;
  return nullptr;
}

// One GGUF block of a row: its values into u (unsigned, offset added) and the meta of its blocks of 32.
void unpack_unit(const TypeLayout& l, const uint8_t* src, uint8_t* u, BlockMeta* m) {
  const int max_u = !l.nibbles ? 255 : l.planes == kFp4Codes ? 24 : (16 << l.planes) - 1;
  auto put = [&](const int8_t* q, int n) {
    bool fits = true;
    for (int i = 0; i < n; ++i) {
      const int v = q[i] + l.offset;
      fits &= v >= 0 && v <= max_u;
      u[i] = uint8_t(v);
    }
    check(fits, "internal: a value does not fit its packed layout");
  };
  if (!is_kquant(l.type)) {
    Block32 b;
    unpack_block32(l.type, src, b);
    put(b.q, 32);
    m->scale = b.d, m->neg_min = b.m;
    return;
  }
  BlockK b;
  unpack_block_k(l.type, src, b);
  put(b.q, 256);
  for (int j = 0; j < 8; ++j) {
    m[j].scale = b.d, m[j].neg_min = -b.dmin;
    for (int h = 0; h < 2; ++h) {
      const int s = b.sub_len == 16 ? 2 * j + h : j;  // sub-blocks of 16 (split) or 32
      m[j].sub[h] = b.scale[s], m[j].min[h] = b.min[s];
    }
  }
}

// The E8M0 byte whose e8m0_half is `d` (an MXFP4 block's scale as unpack_block32 gives it).
uint8_t e8m0_of(float d) {
  uint32_t bits;
  std::memcpy(&bits, &d, 4);
  const uint32_t e = bits >= 0x800000 ? (bits >> 23) + 1 : bits == 0x400000 ? 1 : 0;
  check(e <= 255 && e8m0_half(uint8_t(e)) == d, "internal: an MXFP4 scale is not a power of two E8M0 holds");
  return uint8_t(e);
}

// MXFP4's unsigned values (0..24) as their codes in kFp4Table (0 as code 0, not 8).
void to_fp4_codes(uint8_t* u, int64_t n) {
  static const auto code_of = [] {
    std::array<int, 25> c;
    c.fill(-1);
    for (int code = 15; code >= 0; --code) c[kFp4Table[code]] = code;
    return c;
  }();
  for (int64_t i = 0; i < n; ++i) {
    check(u[i] <= 24 && code_of[u[i]] >= 0, "internal: an MXFP4 value has no code");
    u[i] = uint8_t(code_of[u[i]]);
  }
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
    for (int pl = 0; pl < p.planes; ++pl) {  // plane pl holds bit 4 + pl
      uint8_t* plane = dst + 256 + 64 * pl;
      for (int k4 = 0; k4 < 8; ++k4)
        for (int i = 0; i < 4; ++i) {  // row r's 4 bytes of vector k4 are its bytes j = 4r .. 4r+3
          const int j = 4 * r + i, bit = (v[4 * k4 + i] >> (4 + pl)) & 1;
          if (p.plane_by_value) plane[j] |= uint8_t(bit << k4);
          else plane[8 * k4 + j / 8] |= uint8_t(bit << (j % 8));
        }
    }
  }
}

void pack_group(const WeightMatrix& w, const TypeLayout& l, PackedWeights& p, int64_t g) {
  const int64_t unit_bytes = dtype_info(w.type).block_bytes, unit_blocks = dtype_info(w.type).block_elems / kPackBlock;
  std::vector<uint8_t> u(p.cols);
  std::vector<BlockMeta> meta(p.n_blocks);
  for (int r = 0; r < kPackRows; ++r) {
    const int64_t row = g * kPackRows + r;
    if (row >= p.rows) break;  // padding rows keep zero values and scales
    const uint8_t* src = w.data + row * w.row_stride;
    for (int64_t b = 0; b < p.n_blocks; b += unit_blocks)
      unpack_unit(l, src + (b / unit_blocks) * unit_bytes, u.data() + b * kPackBlock, meta.data() + b);
    if (p.fp4_codes) to_fp4_codes(u.data(), p.cols);
    place_row(p, g, r, u.data());
    for (int64_t b = 0; b < p.n_blocks; ++b) {
      const size_t f = p.super_index(g, b / p.sb) + r;
      if (p.fp4_codes) p.scale_e8m0[f] = e8m0_of(meta[b].scale);
      else p.scale[f] = meta[b].scale;
      if (p.mins) p.neg_min[f] = meta[b].neg_min;
      for (int h = 0; h < p.halves(); ++h) {
        const size_t i = p.int_index(g, b) + h * kPackRows + r;
        if (p.has_sub) p.sub[i] = int8_t(meta[b].sub[h]);
        if (p.mins) p.min[i] = int8_t(meta[b].min[h]);
      }
    }
  }
}

}  // namespace

size_t PackedWeights::bytes() const {
  return size_t(n_groups * n_blocks) * block_bytes() + scale.size() * 4 + scale_e8m0.size() + neg_min.size() * 4 +
         sub.size() + min.size();
}

bool packable(DType type) { return layout_of(type) != nullptr; }

std::shared_ptr<const PackedWeights> pack_weights(const WeightMatrix& w, PlaneLayout plane) {
  const TypeLayout* l = layout_of(w.type);
  check(l != nullptr, "no packed layout for this weight type");
  const int64_t unit = dtype_info(w.type).block_elems;
  check(w.cols % unit == 0, "packed weights need whole blocks");
  auto p = std::make_shared<PackedWeights>();
  p->source = w.type;
  p->nibbles = l->nibbles, p->planes = std::max(l->planes, 0), p->fp4_codes = l->planes == kFp4Codes;
  p->has_sub = l->has_sub, p->split = l->split, p->mins = l->mins;
  if (plane == PlaneLayout::ForThisCpu) plane = detected_isa() >= Isa::Avx512 ? PlaneLayout::StepMasks : PlaneLayout::ValueBytes;
  p->plane_by_value = l->planes > 0 && plane == PlaneLayout::ValueBytes;
  p->offset = l->offset, p->sb = int(unit / kPackBlock);
  p->rows = w.rows, p->cols = w.cols;
  p->n_groups = (w.rows + kPackRows - 1) / kPackRows, p->n_blocks = w.cols / kPackBlock, p->n_super = w.cols / unit;
  const size_t q_bytes = size_t(p->n_groups * p->n_blocks) * p->block_bytes();
  p->q = alloc_weights(q_bytes);
  check(p->q != nullptr, "out of memory packing weights");
  if (p->q.get_deleter().mapped == 0) std::memset(p->q.get(), 0, q_bytes);  // a fresh mapping is zero already
  if (p->fp4_codes) p->scale_e8m0.assign(size_t(p->n_groups * p->n_super) * kPackRows, 0);  // padding: 2^-128
  else p->scale.assign(size_t(p->n_groups * p->n_super) * kPackRows, 0.0f);
  if (p->mins) p->neg_min.assign(p->scale.size(), 0.0f);  // no type with mins is MXFP4
  const size_t n_int = size_t(p->n_groups * p->n_blocks) * kPackRows * p->halves();
  if (p->has_sub) p->sub.assign(n_int, 0);
  if (p->mins) p->min.assign(n_int, 0);
  parallel_for(p->n_groups, [&](int64_t g) { pack_group(w, *l, *p, g); });
  return p;
}

// The AMX A operands: each 16 tokens' 32 bytes of a block, contiguous.
static void tile_acts(PackedActs& a) {
  const int64_t n_tiles = (a.n_tok + 15) / 16;
  a.tiled.resize(size_t(n_tiles * a.n_blocks) * 16 * kPackBlock);
  parallel_for(n_tiles, [&](int64_t tile) {
    int8_t* dst = a.tiled.data() + size_t(tile * a.n_blocks) * 16 * kPackBlock;
    for (int64_t b = 0; b < a.n_blocks; ++b)
      for (int r = 0; r < 16; ++r, dst += kPackBlock) std::memcpy(dst, a.row(tile * 16 + r) + b * kPackBlock, kPackBlock);
  });
}

// The two half sums of each block as int16 in one int32 (|sum| <= 16 * 127 fits).
static void pair_sums(PackedActs& a) {
  for (size_t i = 0; i < a.pairs.size(); ++i)
    a.pairs[i] = int32_t(uint32_t(uint16_t(a.sums[2 * i])) | (uint32_t(uint16_t(a.sums[2 * i + 1])) << 16));
  a.tiled.clear();
  if (active_isa() == Isa::Amx && a.n_tok >= kAmxMinTokens) tile_acts(a);
}

void quantize_packed_acts(DType weight_type, const float* x, int64_t cols, int64_t n_tok, PackedActs& out) {
  ActType at = act_type_for(weight_type);
  if (at == ActType::Q8_1) at = ActType::Q8_0;  // the same values and scales; the sum is kept exactly below
  check(at == ActType::Q8_0 || at == ActType::Q8_K, "packed activations are Q8_0 or Q8_K");
  out.n_tok = n_tok, out.cols = cols, out.n_blocks = cols / kPackBlock;
  const int64_t padded = (n_tok + 15) / 16 * 16;
  out.qs.resize(padded * cols);
  std::fill(out.qs.begin() + n_tok * cols, out.qs.end(), int8_t(0));
  out.d.resize(n_tok * out.n_blocks);
  out.sums.resize(n_tok * out.n_blocks * 2);
  out.pairs.resize(n_tok * out.n_blocks);
  const size_t row_bytes = act_row_bytes(at, cols);
#if defined(SERVAL_X86_KERNELS)
  if (active_isa() >= Isa::Avx2) {
    const bool avx512 = active_isa() >= Isa::Avx512;
    parallel_for(n_tok, [&](int64_t t) {
      auto* row = avx512 ? &quantize_act_row_avx512 : &quantize_act_row_avx2;
      row(at == ActType::Q8_K, x + t * cols, cols, out.qs.data() + t * cols, out.d.data() + t * out.n_blocks,
          out.sums.data() + t * out.n_blocks * 2);
    });
    return pair_sums(out);
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
  pair_sums(out);
}

}  // namespace serval::cpu
