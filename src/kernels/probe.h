// A roofline probe: this machine's measured compute peaks and memory read bandwidth, on all the compute
// threads at once (`serval bench --roofline` divides what a model achieves by them).
//
// The compute peaks run register-only loops of independent instructions (no memory operands inside
// the loop) at each level the CPU has: int8 VPDPBUSD (AVX-512 VNNI), int8 AMX TDPBSUD tiles, BF16
// VDPBF16PS (AVX512_BF16). Operations are counted as 2 per multiply-add (a multiply and an add), the
// convention of the int8 ops a matrix product needs (2 per weight per token). The read bandwidth
// streams a buffer several times larger than the last-level cache, split among the threads, several
// passes; the best pass is reported (as STREAM does).
#pragma once
#include <cstddef>
#include <string>

namespace serval::cpu {

struct RooflinePeaks {
  int threads = 0;
  double int8_avx512_ops = 0;    // VPDPBUSD int8 ops/s; 0 when the CPU lacks AVX-512 VNNI
  double int8_amx_ops = 0;       // TDPBSUD int8 ops/s; 0 when detected_isa() is not Amx
  double bf16_avx512_flops = 0;  // VDPBF16PS flops/s; 0 when the CPU lacks AVX512_BF16
  double read_bytes_per_s = 0;   // streaming read bandwidth
  size_t read_buffer_bytes = 0;
  int read_passes = 0;

  // The best int8 level's peak and its name ("amx", "avx512-vnni", or "none" when neither ran).
  double int8_peak() const { return int8_amx_ops > int8_avx512_ops ? int8_amx_ops : int8_avx512_ops; }
  const char* int8_peak_level() const;
  // One line for people: every peak that ran.
  std::string describe() const;
};

struct ProbeOptions {
  double seconds = 0.25;         // per compute measurement (each is repeated 3 times, the best kept)
  size_t read_buffer_bytes = 0;  // 0: 4 x the last-level cache, 256 MiB .. 2 GiB and at most 1/4 of RAM
  int read_passes = 5;
};

// Runs every probe on compute_threads() threads (the compute pool). Takes about a second or two, plus
// the time to fill the read buffer.
RooflinePeaks probe_roofline(const ProbeOptions& options = {});

// The single measurements (what probe_roofline combines); each returns 0 when the CPU lacks the level.
double probe_int8_avx512_ops(double seconds);
double probe_int8_amx_ops(double seconds);
double probe_bf16_avx512_flops(double seconds);
// Best of `passes` streaming reads of a buffer of `bytes` (rounded down to a multiple of 4 KiB).
double probe_read_bytes_per_s(size_t bytes, int passes);
// Whether the CPU (and OS) run AVX512_BF16 on top of the Avx512 level.
bool probe_has_avx512_bf16();

}  // namespace serval::cpu
