// Roofline probe, AMX-INT8: independent TDPBSUD tile products on tile registers only. Called only when
// detected_isa() is Amx (the OS has granted the tile state).
#include <immintrin.h>

#include <cstring>

#include "kernels/cpu/probe_loops.h"

namespace serval::cpu::probe {
namespace {

struct alignas(64) TileConfig {
  uint8_t palette = 0, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
static_assert(sizeof(TileConfig) == 64);

}  // namespace

uint64_t amx_loop(int64_t iters, uint64_t* sink) {
  // This thread's configuration (all zero when none is loaded), restored at the end.
  TileConfig saved;
  _tile_storeconfig(&saved);
  // Tiles 0-3: int32 sums (16 x 16); 4, 5: A (16 rows x 64 signed bytes); 6, 7: B (16 x 64 unsigned
  // bytes in the VNNI order). Four independent products per iteration, the 2 x 2 blocking of a GEMM.
  TileConfig c;
  c.palette = 1;
  for (int i = 0; i < 8; ++i) c.rows[i] = 16, c.colsb[i] = 64;
  asm volatile("" : : "r"(&c) : "memory");  // LDTILECFG reads all 64 bytes (see gemm_amx.cpp)
  _tile_loadconfig(&c);
  alignas(64) int8_t src[16 * 64];
  for (int i = 0; i < 16 * 64; ++i) src[i] = int8_t((i * 37 + 11) % 127 - 63);
  _tile_loadd(4, src, 64);
  _tile_loadd(5, src + 1, 64);
  _tile_loadd(6, src + 2, 64);
  _tile_loadd(7, src + 3, 64);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t it = 0; it < iters; ++it) {
    _tile_dpbsud(0, 4, 6);
    _tile_dpbsud(1, 4, 7);
    _tile_dpbsud(2, 5, 6);
    _tile_dpbsud(3, 5, 7);
  }
  alignas(64) int32_t out[16 * 16];
  uint64_t acc = 0;
  _tile_stored(0, out, 64);
  acc += uint32_t(out[0]);
  _tile_stored(3, out, 64);
  acc += uint32_t(out[255]);
  *sink += acc;
  if (saved.palette == 0) {
    _tile_release();
  } else {
    asm volatile("" : : "r"(&saved) : "memory");
    _tile_loadconfig(&saved);
  }
  return uint64_t(iters) * 4 * 16 * 16 * 64 * 2;  // 16 x 16 sums of 64 byte products per TDPBSUD
}

}  // namespace serval::cpu::probe
