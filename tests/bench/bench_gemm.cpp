// The packed GEMM timed on its own (Google Benchmark): one matrix of a model's shape and type, n_tok
// tokens, at the active ISA level (SERVAL_ISA lowers it), on one thread unless --threads says more.
// End-to-end runs on a shared VM drift by tens of percent from process to process; a kernel timed in a
// loop, with the minimum of repetitions, shows a change of a few percent. Run by scripts/bench-gemm.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "base/cpu.h"
#include "kernels/isa.h"
#include "kernels/ops.h"
#include "tensor/blocks.h"
#include "../unit/random_blocks.h"

namespace serval {
namespace {

struct Matrix {
  std::vector<uint8_t> bytes;
  WeightMatrix w;
  Matrix(DType t, int64_t rows, int64_t cols, bool tiles) : bytes(test::random_rows(t, rows, cols, 7)) {
    w = WeightMatrix{t, rows, cols, bytes.data(), row_bytes(t, cols)};
    cpu::prepare_weights(w);
    if (tiles) cpu::prepare_bf16_tiles(w);
  }
};

// The Qwen2.5-Coder 0.5B's matrices: the FFN's up/gate and down in Q5_0, the output matrix in Q8_0,
// a Q4_K / Q6_K pair of the k-quant files' shapes, and the 1.5B's Q6_K output matrix.
struct Case {
  const char* name;
  DType type;
  int64_t rows, cols;
  bool bf16_tiles = false;  // cpu::prepare_bf16_tiles (an encoder's matrices; a no-op without the tiles)
};
const Case kCases[] = {{"q5_0_ffn_up", DType::Q5_0, 4864, 896},   {"q5_0_ffn_down", DType::Q5_0, 896, 4864},
                       {"q8_0_output", DType::Q8_0, 151936, 896}, {"q4_k_ffn_up", DType::Q4_K, 4864, 1024},
                       {"q6_k_ffn_down", DType::Q6_K, 1024, 4864},
                       // the 1.5B's output matrix (its token embedding, tied) in Q6_K: 2-9 rows verify a draft
                       {"q6_k_output", DType::Q6_K, 151936, 1536},
                       // all-MiniLM-L6-v2's FFN in Q8_0 (the embeddings benchmark's model)
                       {"q8_0_minilm_up", DType::Q8_0, 1536, 384}, {"q8_0_minilm_down", DType::Q8_0, 384, 1536},
                       {"q8_0_minilm_up_bf16_tiles", DType::Q8_0, 1536, 384, true},
                       {"q8_0_minilm_down_bf16_tiles", DType::Q8_0, 384, 1536, true}};

void run_case(benchmark::State& state, const Case& c) {
  static std::map<const Case*, std::unique_ptr<Matrix>> made;  // each matrix packed once, for every token count
  auto& m = made[&c];
  if (!m) m = std::make_unique<Matrix>(c.type, c.rows, c.cols, c.bf16_tiles);
  const int64_t n_tok = state.range(0);
  std::vector<float> x(n_tok * c.cols), y(n_tok * c.rows);
  for (size_t i = 0; i < x.size(); ++i) x[i] = float((i * 2654435761u) % 2001) / 1000.0f - 1.0f;
  for (auto _ : state) {
    cpu::matmul(m->w, x.data(), y.data(), n_tok);
    benchmark::DoNotOptimize(y.data());
  }
  state.SetItemsProcessed(state.iterations() * n_tok);
  state.SetLabel(cpu::isa_name(cpu::active_isa()));
  state.counters["GMAC/s"] = benchmark::Counter(double(c.rows) * double(c.cols) * double(n_tok),
                                                benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace
}  // namespace serval

int main(int argc, char** argv) {
  int threads = 1;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0) threads = std::atoi(argv[i] + 10);
    else rest.push_back(argv[i]);
  }
  serval::set_compute_threads(std::max(1, threads));
  for (const auto& c : serval::kCases)
    benchmark::RegisterBenchmark(c.name, [&c](benchmark::State& s) { serval::run_case(s, c); })
        ->ArgName("tokens")
        ->Arg(1)->Arg(2)->Arg(3)->Arg(4)->Arg(8)->Arg(16)->Arg(512)
        ->ComputeStatistics("min", [](const std::vector<double>& v) { return *std::min_element(v.begin(), v.end()); })
        ->Unit(benchmark::kMicrosecond);
  int n = int(rest.size());
  benchmark::Initialize(&n, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
