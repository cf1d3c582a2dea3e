// GGUF reader: valid files parse; every kind of bad file gives a clear serval::Error, never a crash.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "base/error.h"
#include "base/mapped_file.h"
#include "gguf_builder.h"
#include "io/gguf.h"
#include "io/safetensors.h"
#include "model/config.h"
#include "model/model.h"
#include "test_support.h"

namespace serval {
namespace {

using test::GgufBuilder;

GgufBuilder small_file() {
  GgufBuilder b;
  b.add_str("general.architecture", "llama");
  b.add_u32("llama.block_count", 1);
  b.add_f32("some.float", 1.5f);
  b.add_bool("some.bool", true);
  b.add_str_array("some.strings", {"a", "bc", ""});
  b.add_tensor("a", {4, 2}, 0, test::f32_bytes({1, 2, 3, 4, 5, 6, 7, 8}));
  b.add_tensor("b", {32}, 8, std::vector<uint8_t>(34, 1));
  return b;
}

// Expects parsing to throw serval::Error whose message contains `needle`.
void expect_error(const std::vector<uint8_t>& bytes, const std::string& needle) {
  try {
    GgufFile f("test.gguf", bytes);
    FAIL() << "parsed a bad file; expected an error containing '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("test.gguf"), std::string::npos) << "error must name the file: " << e.what();
  }
}

TEST(Gguf, ParsesMetadataAndTensors) {
  const auto bytes = small_file().bytes();
  GgufFile f("test.gguf", bytes);
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.block_count"), 1);
  EXPECT_FLOAT_EQ(f.get_float("some.float"), 1.5f);
  EXPECT_TRUE(f.get_bool("some.bool"));
  EXPECT_EQ(f.get_array("some.strings").strings, (std::vector<std::string>{"a", "bc", ""}));
  ASSERT_EQ(f.tensors().size(), 2u);
  const TensorRef* a = f.find_tensor("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->ne, (std::vector<uint64_t>{4, 2}));
  EXPECT_EQ(a->nbytes, 32u);
  float v;
  std::memcpy(&v, a->data + 28, 4);
  EXPECT_EQ(v, 8.0f);
  EXPECT_EQ(f.find_tensor("b")->type, DType::Q8_0);
  EXPECT_THROW(f.get_int("general.architecture"), Error);  // wrong type
  EXPECT_THROW(f.get_string("missing.key"), Error);
}

TEST(Gguf, VersionTwoAccepted) {
  auto b = small_file();
  b.version = 2;
  GgufFile f("test.gguf", b.bytes());
  EXPECT_EQ(f.version(), 2u);
}

TEST(Gguf, BadMagicAndVersion) {
  auto bytes = small_file().bytes();
  bytes[0] = 'X';
  expect_error(bytes, "bad magic");
  auto b = small_file();
  b.version = 1;
  expect_error(b.bytes(), "unsupported GGUF version 1");
  expect_error({}, "bad magic");
}

TEST(Gguf, TruncatedAtEveryOffset) {
  const auto bytes = small_file().bytes();
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + n);
    EXPECT_THROW(GgufFile("test.gguf", cut), Error) << "truncated at " << n;
  }
}

TEST(Gguf, TruncatedRealModelAtManyOffsets) {
  MappedFile file(test::shared_path("models/stories260K.gguf"));
  const auto all = file.bytes();
  for (size_t n = 0; n < all.size(); n += (n < 20000 ? 13 : 9973)) {
    EXPECT_THROW(GgufFile("test.gguf", all.first(n)), Error) << "truncated at " << n;
  }
}

TEST(Gguf, AbsurdCounts) {
  auto bytes = small_file().bytes();
  std::vector<uint8_t> b = bytes;
  const uint64_t huge = uint64_t(1) << 60;
  std::memcpy(b.data() + 16, &huge, 8);  // metadata count
  expect_error(b, "absurd metadata count");
  b = bytes;
  std::memcpy(b.data() + 8, &huge, 8);  // tensor count
  expect_error(b, "absurd tensor count");
  GgufBuilder g;
  GgufBuilder::put_str(g.kv, "arr");
  GgufBuilder::put<uint32_t>(g.kv, 9);
  GgufBuilder::put<uint32_t>(g.kv, 4);
  GgufBuilder::put<uint64_t>(g.kv, huge);
  g.n_kv = 1;
  expect_error(g.bytes(), "does not fit");
  GgufBuilder s;
  GgufBuilder::put<uint64_t>(s.kv, huge);  // key length
  s.kv.resize(s.kv.size() + 64);
  s.n_kv = 1;
  expect_error(s.bytes(), "absurd length");
}

TEST(Gguf, BadTensors) {
  {  // unknown dtype
    GgufBuilder b;
    b.add_tensor("t", {32}, 16 /* IQ2_XXS */, std::vector<uint8_t>(64));
    expect_error(b.bytes(), "unsupported type IQ2_XXS");
    GgufBuilder c;
    c.add_tensor("t", {32}, 999, std::vector<uint8_t>(64));
    expect_error(c.bytes(), "type 999");
  }
  {  // overlapping
    GgufBuilder b;
    b.add_tensor("x", {8}, 0, test::f32_bytes(std::vector<float>(8)));
    b.add_tensor("y", {8}, 0, test::f32_bytes(std::vector<float>(8)), 0);
    expect_error(b.bytes(), "overlap");
  }
  {  // data past the end
    GgufBuilder b;
    b.add_tensor("x", {64}, 0, test::f32_bytes(std::vector<float>(8)));
    expect_error(b.bytes(), "past the end");
  }
  {  // row not a multiple of the block size
    GgufBuilder b;
    b.add_tensor("x", {33}, 8, std::vector<uint8_t>(68));
    expect_error(b.bytes(), "not a multiple");
  }
  {  // misaligned offset
    GgufBuilder b;
    b.add_tensor("x", {2}, 0, test::f32_bytes(std::vector<float>(16)), 4);
    expect_error(b.bytes(), "not aligned");
  }
  {  // too many dimensions, zero dimension, duplicate names
    GgufBuilder b;
    b.add_tensor("x", {1, 1, 1, 1, 1}, 0, test::f32_bytes({1}));
    expect_error(b.bytes(), "dimensions");
    GgufBuilder z;
    z.add_tensor("x", {0}, 0, {});
    expect_error(z.bytes(), "absurd dimension");
    GgufBuilder d;
    d.add_tensor("x", {1}, 0, test::f32_bytes({1}));
    d.add_tensor("x", {1}, 0, test::f32_bytes({1}));
    expect_error(d.bytes(), "duplicate tensor");
  }
  {  // element count overflow
    GgufBuilder b;
    b.add_tensor("x", {uint64_t(1) << 40, uint64_t(1) << 40}, 0, {});
    expect_error(b.bytes(), "overflow");
  }
}

TEST(Gguf, BadMetadata) {
  GgufBuilder b;
  b.add_u32("general.alignment", 3);
  expect_error(b.bytes(), "power of two");
  GgufBuilder t;
  GgufBuilder::put_str(t.kv, "k");
  GgufBuilder::put<uint32_t>(t.kv, 77);
  t.n_kv = 1;
  expect_error(t.bytes(), "unknown value type 77");
  GgufBuilder d;
  d.add_u32("k", 1);
  d.add_u32("k", 2);
  expect_error(d.bytes(), "duplicate metadata key");
}

// A copy of stories260K with one change, written to a temp file so Model::load sees a real file.
std::string patched_model(const std::string& name, const std::function<void(std::vector<uint8_t>&)>& patch) {
  MappedFile file(test::shared_path("models/stories260K.gguf"));
  std::vector<uint8_t> bytes(file.bytes().begin(), file.bytes().end());
  patch(bytes);
  const auto path = std::filesystem::temp_directory_path() / ("serval-test-" + name + ".gguf");
  std::ofstream(path, std::ios::binary).write(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  return path.string();
}

// Replaces the first occurrence of `from` with `to` (same length) in the bytes.
void replace_bytes(std::vector<uint8_t>& b, const std::string& from, const std::string& to) {
  auto it = std::search(b.begin(), b.end(), from.begin(), from.end());
  ASSERT_NE(it, b.end()) << from;
  std::copy(to.begin(), to.end(), it);
}

TEST(Gguf, ModelWithWrongShapeOrArchitectureIsRejected) {
  // The tensor named "blk.0.attn_q.weight" renamed: a required tensor goes missing.
  auto missing = patched_model("missing", [](auto& b) { replace_bytes(b, "blk.0.attn_q.weight", "blk.0.attn_X.weight"); });
  EXPECT_THROW({
    try { Model::load(missing); } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("missing tensor 'blk.0.attn_q.weight'"), std::string::npos) << e.what();
      throw;
    }
  }, Error);
  // Swap two tensors' names of different shapes: wq [64, 64] <-> wk [64, 32].
  auto swapped = patched_model("swapped", [](auto& b) {
    replace_bytes(b, "blk.0.attn_q.weight", "blk.0.attn_T.weight");
    replace_bytes(b, "blk.0.attn_k.weight", "blk.0.attn_q.weight");
    replace_bytes(b, "blk.0.attn_T.weight", "blk.0.attn_k.weight");
  });
  EXPECT_THROW({
    try { Model::load(swapped); } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("has shape"), std::string::npos) << e.what();
      throw;
    }
  }, Error);
  auto arch = patched_model("arch", [](auto& b) {
    // The string value follows its key, the u32 type and the u64 length.
    const std::string key = "general.architecture";
    auto it = std::search(b.begin(), b.end(), key.begin(), key.end());
    ASSERT_NE(it, b.end());
    const std::string value = "mamba";
    std::copy(value.begin(), value.end(), it + key.size() + 12);
  });
  EXPECT_THROW({
    try { Model::load(arch); } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("unsupported architecture 'mamba'"), std::string::npos) << e.what();
      throw;
    }
  }, Error);
}

// Safetensors headers and config.json files found by fuzz_safetensors (tests/fuzz/safetensors/regressions):
// each must give serval::Error, not another exception, an overflow or undefined behaviour.
std::vector<uint8_t> safetensors_bytes(std::string header, size_t data_bytes) {
  header.resize((header.size() + 7) / 8 * 8, ' ');  // padded to 8 bytes, as writers do
  std::vector<uint8_t> out(8);
  const uint64_t n = header.size();
  std::memcpy(out.data(), &n, 8);
  out.insert(out.end(), header.begin(), header.end());
  out.resize(out.size() + data_bytes);
  return out;
}

TEST(Safetensors, BadHeadersGiveErrors) {
  const auto ok = safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", 8);
  SafetensorsFile file("ok", ok);
  ASSERT_EQ(file.tensors().size(), 1u);
  EXPECT_EQ(file.find_tensor("a")->nbytes, 8u);
  const auto dtype = safetensors_bytes(R"({"a":{"dtype":1,"shape":[1],"data_offsets":[0,4]}})", 4);
  EXPECT_THROW(SafetensorsFile("dtype", dtype), Error);
  // 2^32 x 2^32 elements wrap to 0 in 64 bits: must not pass as an empty tensor.
  const auto wrap = safetensors_bytes(R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})", 0);
  EXPECT_THROW(SafetensorsFile("wrap", wrap), Error);
  // Data at an odd offset: F16 elements would be read misaligned (a vector's bytes start on a 16-byte
  // boundary, and the header is padded to 8 bytes).
  const auto odd = safetensors_bytes(R"({"a":{"dtype":"F16","shape":[2],"data_offsets":[1,5]}})", 6);
  EXPECT_THROW(SafetensorsFile("odd", odd), Error);
}

// Each check of the safetensors reader with its message asserted (mutation testing found that an
// error of any kind passed the tests above; docs/testing.md).
std::string safetensors_error(const std::vector<uint8_t>& bytes) {
  try {
    SafetensorsFile("f", bytes);
  } catch (const Error& e) {
    return e.what();
  }
  return "(accepted)";
}

std::string one_tensor(const std::string& dtype, const std::string& shape, const std::string& offsets) {
  return R"({"a":{"dtype":")" + dtype + R"(","shape":)" + shape + R"(,"data_offsets":)" + offsets + "}}";
}

TEST(Safetensors, EveryCheckSaysWhatIsWrong) {
  auto has = [](const std::string& what, const std::string& part) { return what.find(part) != std::string::npos; };
  EXPECT_TRUE(has(safetensors_error(safetensors_bytes("[1, 2]", 0)), "header is not a JSON object"));
  auto too_long = safetensors_bytes("{}", 0);
  const uint64_t claimed = too_long.size() - 7;  // one byte more than the file holds after the length
  std::memcpy(too_long.data(), &claimed, 8);
  EXPECT_TRUE(has(safetensors_error(too_long), "header length " + std::to_string(claimed) + " exceeds the file size"));
  EXPECT_TRUE(has(safetensors_error(safetensors_bytes(R"({"a":{"data_offsets":[0,4]}})", 4)),
                  "tensor 'a' lacks dtype, shape or data_offsets"));
  EXPECT_TRUE(has(safetensors_error(safetensors_bytes(one_tensor("C64", "[4]", "[0,32]"), 32)), "unsupported dtype C64"));
  // Integer tensors are buffers (BERT's position_ids), not weights: skipped, never read.
  EXPECT_EQ(SafetensorsFile("f", safetensors_bytes(one_tensor("I64", "[4]", "[0,32]"), 32)).tensors().size(), 0u);
  EXPECT_TRUE(has(safetensors_error(safetensors_bytes(one_tensor("F32", "[1,1,1,1,2]", "[0,8]"), 8)),
                  "tensor 'a' has a bad shape"));
  EXPECT_TRUE(has(safetensors_error(safetensors_bytes(one_tensor("F32", "[3]", "[0,12]"), 8)),
                  "data [0, 12) runs past the end of the file"));
  EXPECT_TRUE(has(safetensors_error(safetensors_bytes(one_tensor("F32", "[2]", "[0,12]"), 12)),
                  "byte size 12 does not match its shape"));
  const auto overlap = safetensors_bytes(
      R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", 12);
  EXPECT_TRUE(has(safetensors_error(overlap), "tensors 'a' and 'b' overlap")) << safetensors_error(overlap);
}

TEST(Safetensors, ShapesTypesAndScalarsAreRead) {
  const auto four = safetensors_bytes(one_tensor("F32", "[1,1,2,1]", "[0,8]"), 8);
  SafetensorsFile f4("four", four);
  EXPECT_EQ(f4.find_tensor("a")->n_elements(), 2u) << "four dimensions are allowed";
  const auto bf16 = safetensors_bytes(one_tensor("BF16", "[2]", "[0,4]"), 4);
  SafetensorsFile fb("bf16", bf16);
  EXPECT_EQ(fb.find_tensor("a")->type, DType::BF16);
  const auto f16 = safetensors_bytes(one_tensor("F16", "[2]", "[0,4]"), 4);
  SafetensorsFile fh("f16", f16);
  EXPECT_EQ(fh.find_tensor("a")->type, DType::F16);
  const auto scalar = safetensors_bytes(one_tensor("F32", "[]", "[0,4]"), 4);
  SafetensorsFile fs("scalar", scalar);
  EXPECT_EQ(fs.find_tensor("a")->ne, (std::vector<uint64_t>{1})) << "a scalar has one element";
  EXPECT_EQ(fs.find_tensor("a")->nbytes, 4u);
}

// A small config.json of `model_type` with `extra` fields appended, written to `path` and read.
ModelConfig small_hf_config(const std::filesystem::path& path, const std::string& model_type, const std::string& extra) {
  std::ofstream(path) << R"({"model_type":")" << model_type << R"(","hidden_size":8,"num_hidden_layers":1,)"
                      << R"("num_attention_heads":2,"intermediate_size":16,"vocab_size":16)" << extra << "}";
  return config_from_hf(path.string());
}

TEST(HfConfig, BadFieldsGiveErrors) {
  const auto path = std::filesystem::temp_directory_path() / "serval-test-config.json";
  auto load = [&](const std::string& extra) { return small_hf_config(path, "llama", extra); };
  EXPECT_EQ(load("").d_head, 4);
  EXPECT_EQ(load(R"(,"head_dim":null,"num_key_value_heads":null)").n_head_kv, 2);
  EXPECT_THROW(load(R"(,"hidden_size":1e300)"), Error);  // duplicate key: the last one wins
  EXPECT_THROW(load(R"(,"num_hidden_layers":1.5)"), Error);
  EXPECT_THROW(load(R"(,"max_position_embeddings":-1)"), Error);
  EXPECT_THROW(load(R"(,"rope_scaling":{"type":"linear","factor":0})"), Error);
  std::filesystem::remove(path);
}

// RoPE spelled as transformers 4 (rope_theta, rope_scaling) or 5 (rope_parameters) gives the same
// config; a type Serval does not implement, or a set without its base, is refused, never defaulted.
TEST(HfConfig, RopeParametersOfTransformers5) {
  const auto path = std::filesystem::temp_directory_path() / "serval-test-rope.json";
  auto load = [&](const std::string& extra) { return small_hf_config(path, "qwen2", extra); };
  EXPECT_EQ(load("").rope_base, 10000.0f);  // neither spelling: transformers' own default
  EXPECT_EQ(load(R"(,"rope_theta":1000000.0)").rope_base, 1e6f);
  EXPECT_EQ(load(R"(,"rope_parameters":{"rope_theta":1000000.0,"rope_type":"default"})").rope_base, 1e6f);
  // One set is every layer's, sliding-window layers included (gpt-oss's 150000).
  EXPECT_EQ(load(R"(,"rope_parameters":{"rope_theta":150000.0,"rope_type":"default"})").rope_base_swa, 1.5e5f);
  const auto linear = load(R"(,"rope_parameters":{"rope_theta":500000.0,"rope_type":"linear","factor":4.0})");
  EXPECT_EQ(linear.rope_base, 5e5f);
  EXPECT_EQ(linear.rope_linear_scale, 4.0f);
  const auto per_type = load(R"(,"rope_parameters":{"full_attention":{"rope_theta":1000000.0,"rope_type":"default"},)"
                             R"("sliding_attention":{"rope_theta":10000.0,"rope_type":"default"}})");
  EXPECT_EQ(per_type.rope_base, 1e6f);
  EXPECT_EQ(per_type.rope_base_swa, 1e4f);
  EXPECT_THROW(load(R"(,"rope_parameters":{"rope_type":"default"})"), Error);  // no base
  EXPECT_THROW(load(R"(,"rope_parameters":{"rope_theta":1e6,"rope_type":"llama3","factor":8.0})"), Error);  // no low/high
  EXPECT_THROW(load(R"(,"rope_scaling":{"rope_type":"dynamic","factor":2.0})"), Error);
  EXPECT_THROW(load(R"(,"rope_parameters":{"full_attention":{"rope_type":"default"}})"), Error);
  EXPECT_THROW(load(R"(,"rope_parameters":{"chunked_attention":{"rope_theta":1e4}})"), Error);
  EXPECT_THROW(load(R"(,"rope_parameters":"default")"), Error);
  EXPECT_THROW(load(R"(,"rope_theta":"big")"), Error);
  std::filesystem::remove(path);
}

// YaRN, LongRoPE and llama3 in both spellings; the derived factors are transformers' formulas.
TEST(HfConfig, RopeScalingTypes) {
  const auto path = std::filesystem::temp_directory_path() / "serval-test-rope-scaling.json";
  auto load = [&](const std::string& extra) { return small_hf_config(path, "qwen2", extra); };
  // transformers 4: rope_scaling beside rope_theta; the factor's default mscale 0.1 ln 4 + 1.
  const auto yarn4 = load(R"(,"rope_theta":1e6,"max_position_embeddings":131072,)"
                          R"("rope_scaling":{"type":"yarn","factor":4.0,"original_max_position_embeddings":32768})");
  EXPECT_EQ(yarn4.yarn_factor, 4.0f);
  EXPECT_EQ(yarn4.rope_orig_ctx, 32768);
  EXPECT_NEAR(yarn4.rope_attn_factor, 0.1 * std::log(4.0) + 1, 1e-6);
  EXPECT_TRUE(yarn4.yarn_truncate);
  // transformers 5; DeepSeek's mscale ratio (equal mscales: 1); no original: max_position_embeddings.
  const auto yarn5 = load(R"(,"max_position_embeddings":4096,"rope_parameters":{"rope_theta":1e4,"rope_type":"yarn",)"
                          R"("factor":40,"mscale":0.707,"mscale_all_dim":0.707,"beta_fast":16,"truncate":false})");
  EXPECT_EQ(yarn5.rope_orig_ctx, 4096);
  EXPECT_NEAR(yarn5.rope_attn_factor, 1.0, 1e-6);
  EXPECT_EQ(yarn5.yarn_beta_fast, 16.0f);
  EXPECT_FALSE(yarn5.yarn_truncate);
  // LongRoPE (Phi-3: original_max_position_embeddings at the top), factor 131072 / 4096 = 32.
  const std::string factors = R"("short_factor":[1,1],"long_factor":[2,4])";
  const auto lr = load(R"(,"hidden_size":8,"max_position_embeddings":131072,"original_max_position_embeddings":4096,)"
                       R"("rope_scaling":{"type":"longrope",)" + factors + "}");
  EXPECT_TRUE(lr.longrope);
  EXPECT_EQ(lr.rope_orig_ctx, 4096);
  EXPECT_NEAR(lr.rope_attn_factor, std::sqrt(1 + std::log(32.0) / std::log(4096.0)), 1e-6);
  EXPECT_EQ(lr.rope_long_factors, (std::vector<float>{2, 4}));
  EXPECT_THROW(load(R"(,"rope_scaling":{"type":"longrope","short_factor":[1],"long_factor":[2]})"), Error);  // 2 pairs
  EXPECT_THROW(load(R"(,"rope_scaling":{"type":"longrope","short_factor":[1,0],"long_factor":[2,4]})"), Error);
  EXPECT_THROW(load(R"(,"rope_scaling":{"type":"yarn","factor":-2})"), Error);
  // llama3 (Llama 3.1's numbers on pairs of a 4-wide head with base 500000): divisors in [1, factor].
  const auto l3 = load(R"(,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,)"
                       R"("high_freq_factor":4.0,"original_max_position_embeddings":8192},"rope_theta":500000.0)");
  ASSERT_EQ(l3.rope_llama3_freqs.size(), 2u);
  EXPECT_EQ(l3.rope_llama3_freqs[0], 1.0f);  // wavelength 2 pi: high frequency, kept
  // wavelength 2 pi sqrt(500000) = 4443, between 8192 / 4 and 8192: smoothed, s = (8192 / 4443 - 1) / 3
  EXPECT_NEAR(l3.rope_llama3_freqs[1], 2.6945297, 1e-5);
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace serval
