// GGUF (versions 2 and 3) reader over mmap with strict validation of every count, size and offset.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "base/mapped_file.h"
#include "io/tensor_ref.h"

namespace serval {

enum class GgufValueType : uint32_t {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, UINT32 = 4, INT32 = 5, FLOAT32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, UINT64 = 10, INT64 = 11, FLOAT64 = 12,
};

// An array value: its element type and its elements (numbers widened, strings as-is).
struct GgufArray {
  GgufValueType elem_type;
  std::vector<int64_t> ints;     // integer and bool elements
  std::vector<double> floats;    // FLOAT32 / FLOAT64 elements
  std::vector<std::string> strings;
  size_t size() const;
};

struct GgufValue {
  GgufValueType type;
  std::variant<int64_t, uint64_t, double, bool, std::string, GgufArray> value;
};

class GgufFile {
 public:
  // Whether tensor data must be present. Absent: a shape file (`serval export-shape`: the metadata and
  // tensor list, no data; marked by kShapeOnlyKey) or a whole GGUF read for its header: every tensor's
  // data pointer is null, its shape, type, size and offset checked as usual (offsets against each
  // other). A file marked shape-only is refused with a clear error where data is required.
  enum class Data { Required, Absent };
  // Opens and validates `path`; throws Error naming the file and the problem.
  explicit GgufFile(const std::string& path, Data data = Data::Required);
  // Parses bytes held by the caller (they must outlive this object); `name` appears in errors.
  GgufFile(const std::string& name, std::span<const uint8_t> bytes, Data data = Data::Required);

  uint32_t version() const { return version_; }
  const std::string& path() const { return path_; }
  const std::map<std::string, GgufValue>& metadata() const { return metadata_; }
  const std::vector<TensorRef>& tensors() const { return tensors_; }

  bool has(const std::string& key) const { return metadata_.count(key) > 0; }
  // Typed getters: throw Error when the key is missing or of the wrong type.
  std::string get_string(const std::string& key) const;
  int64_t get_int(const std::string& key) const;  // any integer type
  double get_float(const std::string& key) const;  // any float or integer type
  bool get_bool(const std::string& key) const;
  const GgufArray& get_array(const std::string& key) const;
  // Optional variants return the fallback when the key is absent (but still throw on a wrong type).
  std::optional<int64_t> find_int(const std::string& key) const;
  std::optional<double> find_float(const std::string& key) const;
  std::optional<bool> find_bool(const std::string& key) const;
  std::optional<std::string> find_string(const std::string& key) const;
  const TensorRef* find_tensor(const std::string& name) const;

 private:
  std::string path_;
  std::unique_ptr<MappedFile> file_;
  std::span<const uint8_t> bytes_;
  uint32_t version_ = 0;
  std::map<std::string, GgufValue> metadata_;
  std::vector<TensorRef> tensors_;
  std::map<std::string, size_t> tensor_index_;
  Data data_ = Data::Required;

  void parse();
};

// The metadata key that marks a shape file (a GGUF header without tensor data).
inline constexpr const char* kShapeOnlyKey = "serval.shape_only";

// Text form of a metadata value for `serval info` (arrays are summarized).
std::string to_display_string(const GgufValue& v);

}  // namespace serval
