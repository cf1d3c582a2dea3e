// Attention over the paged KV cache timed on its own (Google Benchmark): the attention of one decode
// step (or of a prefill chunk) of a model's shape, over every layer's own F16 cache so that the keys
// and values come from memory as in a real step (24 layers of 8K positions of the Qwen 0.5B are 96 MiB),
// at the active ISA level (SERVAL_ISA lowers it), on --threads pool threads. A block table of 16-slot
// blocks in a scattered order, as an engine's free list hands them out.
//
//   build/serval_bench_attention --threads=2 --benchmark_filter=decode [--huge]
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <numeric>
#include <string>
#include <vector>

#include "base/cpu.h"
#include "tensor/dequant.h"
#include "kernels/isa.h"
#include "base/huge_pages.h"
#include "kernels/ops.h"

namespace serval {
namespace {

struct Shape {
  const char* name;
  int n_layer, n_head, n_head_kv, d_head;
};
// Qwen2.5-Coder 0.5B and 1.5B (the models of docs/benchmarks.md's depth runs).
const Shape kShapes[] = {{"qwen_0.5b", 24, 14, 2, 64}, {"qwen_1.5b", 28, 12, 2, 128}};

constexpr int32_t kBlock = 16;
bool g_huge = false;

// --huge: the pools on transparent huge pages (alloc_huge, as KvCache allocates them), else in 4 KiB pages.
HugeBuffer alloc(size_t bytes) {
  if (g_huge) return alloc_huge(bytes);
  return {static_cast<uint8_t*>(std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096)), HugeDeleter{}};
}

// Every layer's cache of `ctx` positions of one sequence, random F16 values.
struct Cache {
  HugeBuffer kb, vb;  // [n_layer][slots][kv_dim] F16
  uint16_t *k, *v;
  std::vector<int32_t> blocks;
  int64_t kv_dim = 0, slots = 0;
  Cache(const Shape& s, int64_t ctx) {
    kv_dim = int64_t(s.n_head_kv) * s.d_head;
    const int64_t n_blocks = (ctx + kBlock - 1) / kBlock;
    slots = n_blocks * kBlock;
    const size_t n = size_t(s.n_layer * slots * kv_dim);
    kb = alloc(n * 2), vb = alloc(n * 2);
    k = reinterpret_cast<uint16_t*>(kb.get()), v = reinterpret_cast<uint16_t*>(vb.get());
    uint32_t x = 12345;
    for (size_t i = 0; i < n; ++i) {
      x = x * 1664525u + 1013904223u;
      k[i] = f32_to_fp16(float(int(x >> 20) - 2048) / 2048.0f);
      v[i] = f32_to_fp16(float(int((x >> 8) & 4095) - 2048) / 2048.0f);
    }
    blocks.resize(size_t(n_blocks));
    std::iota(blocks.begin(), blocks.end(), 0);
    for (int64_t i = n_blocks - 1; i > 0; --i) {  // a fixed scattered order
      x = x * 1664525u + 1013904223u;
      std::swap(blocks[size_t(i)], blocks[size_t(x % uint32_t(i + 1))]);
    }
  }
  KvLayerView layer(int l) const {
    KvLayerView kv;
    kv.type = DType::F16, kv.kv_dim = kv_dim;
    kv.k = reinterpret_cast<const uint8_t*>(k + l * slots * kv_dim);
    kv.v = reinterpret_cast<const uint8_t*>(v + l * slots * kv_dim);
    return kv;
  }
};

// range(0): context (positions attended by the last query); range(1): queries (the last n_q positions).
void run_case(benchmark::State& state, const Shape& s) {
  const int64_t ctx = state.range(0);
  const int n_q = int(state.range(1));
  const Cache cache(s, ctx);
  const int64_t q_floats = int64_t(s.n_head) * s.d_head;
  std::vector<float> q(size_t(n_q * q_floats)), out(q.size());
  for (size_t i = 0; i < q.size(); ++i) q[i] = float(int((i * 2654435761u) % 2001) - 1000) / 1000.0f;
  std::vector<AttentionQuery> queries;
  for (int i = 0; i < n_q; ++i)
    queries.push_back({q.data() + i * q_floats, KvSpan{cache.blocks, kBlock, 0, ctx - n_q + i}, out.data() + i * q_floats});
  const AttentionShape shape{s.n_head, s.n_head_kv, s.d_head, 0.125f};
  for (auto _ : state) {
    for (int l = 0; l < s.n_layer; ++l) cpu::attention_batch(shape, queries, cache.layer(l));
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(cpu::isa_name(cpu::active_isa()));
  // K and V bytes of the attended positions, every layer (read once per step whatever the queries).
  state.counters["GB/s"] = benchmark::Counter(double(s.n_layer) * double(ctx) * double(cache.kv_dim) * 4.0,
                                              benchmark::Counter::kIsIterationInvariantRate);
}

}  // namespace
}  // namespace serval

int main(int argc, char** argv) {
  int threads = 1;
  std::vector<char*> rest;
  for (int i = 0; i < argc; ++i) {
    if (std::strncmp(argv[i], "--threads=", 10) == 0) threads = std::atoi(argv[i] + 10);
    else if (std::strcmp(argv[i], "--huge") == 0) serval::g_huge = true;
    else rest.push_back(argv[i]);
  }
  serval::set_compute_threads(std::max(1, threads));
  for (const auto& s : serval::kShapes) {
    const std::string name = s.name;
    benchmark::RegisterBenchmark((name + "_decode").c_str(), [&s](benchmark::State& st) { serval::run_case(st, s); })
        ->ArgNames({"ctx", "queries"})
        ->Args({1024, 1})->Args({8192, 1})
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((name + "_prefill").c_str(), [&s](benchmark::State& st) { serval::run_case(st, s); })
        ->ArgNames({"ctx", "queries"})
        ->Args({512, 512})->Args({4096, 512})
        ->Unit(benchmark::kMillisecond);
  }
  int n = int(rest.size());
  benchmark::Initialize(&n, rest.data());
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
}
