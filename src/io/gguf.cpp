#include "io/gguf.h"

#include <algorithm>
#include <cstring>
#include <limits>

#include "base/error.h"

namespace serval {
namespace {

constexpr uint64_t kMaxDims = 4;
constexpr uint64_t kMaxStringLen = uint64_t(1) << 30;

// Bounds-checked little-endian reader over the mapped bytes.
class Cursor {
 public:
  Cursor(const std::string& path, std::span<const uint8_t> bytes) : path_(path), bytes_(bytes) {}

  size_t offset() const { return pos_; }
  size_t remaining() const { return bytes_.size() - pos_; }

  template <typename T>
  T read(const char* what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, bytes_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const char* what) {
    const uint64_t len = read<uint64_t>(what);
    if (len > kMaxStringLen) fail("{}: {} has absurd length {} at offset {}", path_, what, len, pos_ - 8);
    need(len, what);
    std::string s(reinterpret_cast<const char*>(bytes_.data() + pos_), len);
    pos_ += len;
    return s;
  }

  void need(uint64_t n, const char* what) const {
    if (n > remaining())
      fail("{}: truncated file: {} needs {} bytes at offset {} but only {} remain", path_, what, n, pos_,
           remaining());
  }

 private:
  const std::string& path_;
  std::span<const uint8_t> bytes_;
  size_t pos_ = 0;
};

size_t scalar_size(GgufValueType t) {
  switch (t) {
    case GgufValueType::UINT8: case GgufValueType::INT8: case GgufValueType::BOOL: return 1;
    case GgufValueType::UINT16: case GgufValueType::INT16: return 2;
    case GgufValueType::UINT32: case GgufValueType::INT32: case GgufValueType::FLOAT32: return 4;
    case GgufValueType::UINT64: case GgufValueType::INT64: case GgufValueType::FLOAT64: return 8;
    default: return 0;
  }
}

bool valid_value_type(uint32_t t) { return t <= static_cast<uint32_t>(GgufValueType::FLOAT64); }

// Reads one scalar of type `t` widened to int64 (integers, bool) or double (floats).
void read_scalar(Cursor& c, GgufValueType t, int64_t* as_int, double* as_float, uint64_t* as_u64) {
  switch (t) {
    case GgufValueType::UINT8: *as_int = c.read<uint8_t>("u8 value"); break;
    case GgufValueType::INT8: *as_int = c.read<int8_t>("i8 value"); break;
    case GgufValueType::UINT16: *as_int = c.read<uint16_t>("u16 value"); break;
    case GgufValueType::INT16: *as_int = c.read<int16_t>("i16 value"); break;
    case GgufValueType::UINT32: *as_int = c.read<uint32_t>("u32 value"); break;
    case GgufValueType::INT32: *as_int = c.read<int32_t>("i32 value"); break;
    case GgufValueType::UINT64: *as_u64 = c.read<uint64_t>("u64 value"); *as_int = static_cast<int64_t>(*as_u64); break;
    case GgufValueType::INT64: *as_int = c.read<int64_t>("i64 value"); break;
    case GgufValueType::BOOL: *as_int = c.read<uint8_t>("bool value") != 0; break;
    case GgufValueType::FLOAT32: *as_float = c.read<float>("f32 value"); break;
    case GgufValueType::FLOAT64: *as_float = c.read<double>("f64 value"); break;
    default: break;
  }
}

GgufArray read_array(Cursor& c, const std::string& path, const std::string& key) {
  GgufArray arr;
  const uint32_t et = c.read<uint32_t>("array element type");
  if (!valid_value_type(et)) fail("{}: key '{}': unknown array element type {}", path, key, et);
  arr.elem_type = static_cast<GgufValueType>(et);
  if (arr.elem_type == GgufValueType::ARRAY) fail("{}: key '{}': nested arrays are not supported", path, key);
  const uint64_t n = c.read<uint64_t>("array length");
  const size_t min_elem = arr.elem_type == GgufValueType::STRING ? 8 : scalar_size(arr.elem_type);
  if (n > c.remaining() / min_elem)
    fail("{}: key '{}': array of {} elements does not fit in the {} bytes left", path, key, n, c.remaining());
  if (arr.elem_type == GgufValueType::STRING) {
    arr.strings.reserve(n);
    for (uint64_t i = 0; i < n; ++i) arr.strings.push_back(c.read_string("array string"));
  } else if (arr.elem_type == GgufValueType::FLOAT32 || arr.elem_type == GgufValueType::FLOAT64) {
    arr.floats.resize(n);
    int64_t i64; uint64_t u64;
    for (uint64_t i = 0; i < n; ++i) read_scalar(c, arr.elem_type, &i64, &arr.floats[i], &u64);
  } else {
    arr.ints.resize(n);
    double f; uint64_t u64;
    for (uint64_t i = 0; i < n; ++i) read_scalar(c, arr.elem_type, &arr.ints[i], &f, &u64);
  }
  return arr;
}

GgufValue read_value(Cursor& c, uint32_t type, const std::string& path, const std::string& key) {
  if (!valid_value_type(type)) fail("{}: key '{}': unknown value type {}", path, key, type);
  GgufValue v{static_cast<GgufValueType>(type), int64_t{0}};
  int64_t i = 0; double f = 0; uint64_t u = 0;
  switch (v.type) {
    case GgufValueType::STRING: v.value = c.read_string("string value"); break;
    case GgufValueType::ARRAY: v.value = read_array(c, path, key); break;
    case GgufValueType::FLOAT32: case GgufValueType::FLOAT64:
      read_scalar(c, v.type, &i, &f, &u); v.value = f; break;
    case GgufValueType::BOOL: read_scalar(c, v.type, &i, &f, &u); v.value = i != 0; break;
    case GgufValueType::UINT64: read_scalar(c, v.type, &i, &f, &u); v.value = u; break;
    default: read_scalar(c, v.type, &i, &f, &u); v.value = i; break;
  }
  return v;
}

struct TensorInfo {
  std::string name;
  std::vector<uint64_t> ne;
  uint32_t type;
  uint64_t offset;
};

TensorInfo read_tensor_info(Cursor& c, const std::string& path) {
  TensorInfo t;
  t.name = c.read_string("tensor name");
  const uint32_t n_dims = c.read<uint32_t>("tensor dimension count");
  if (n_dims == 0 || n_dims > kMaxDims)
    fail("{}: tensor '{}' has {} dimensions (1 to {} allowed)", path, t.name, n_dims, kMaxDims);
  for (uint32_t d = 0; d < n_dims; ++d) {
    const uint64_t n = c.read<uint64_t>("tensor dimension");
    if (n == 0 || n > (uint64_t(1) << 40)) fail("{}: tensor '{}' has absurd dimension {}", path, t.name, n);
    t.ne.push_back(n);
  }
  t.type = c.read<uint32_t>("tensor type");
  t.offset = c.read<uint64_t>("tensor data offset");
  return t;
}

// Byte size of a tensor, checking the element count and block divisibility without overflow.
uint64_t tensor_nbytes(const TensorInfo& t, const DTypeInfo& info, const std::string& path) {
  uint64_t n = 1;
  for (auto d : t.ne) {
    if (n > std::numeric_limits<uint64_t>::max() / d) fail("{}: tensor '{}' element count overflows", path, t.name);
    n *= d;
  }
  if (t.ne[0] % info.block_elems != 0)
    fail("{}: tensor '{}' row length {} is not a multiple of the {} block size {}", path, t.name, t.ne[0],
         info.name, info.block_elems);
  const uint64_t blocks = n / info.block_elems;
  if (blocks > std::numeric_limits<uint64_t>::max() / info.block_bytes)
    fail("{}: tensor '{}' byte size overflows", path, t.name);
  return blocks * info.block_bytes;
}

}  // namespace

size_t GgufArray::size() const {
  if (elem_type == GgufValueType::STRING) return strings.size();
  if (elem_type == GgufValueType::FLOAT32 || elem_type == GgufValueType::FLOAT64) return floats.size();
  return ints.size();
}

GgufFile::GgufFile(const std::string& path, Data data)
    : path_(path), file_(std::make_unique<MappedFile>(path)), bytes_(file_->bytes()), data_(data) {
  parse();
}

GgufFile::GgufFile(const std::string& name, std::span<const uint8_t> bytes, Data data)
    : path_(name), bytes_(bytes), data_(data) {
  parse();
}

void GgufFile::parse() {
  Cursor c(path_, bytes_);
  if (bytes_.size() < 4 || std::memcmp(bytes_.data(), "GGUF", 4) != 0)
    fail("{}: not a GGUF file (bad magic)", path_);
  c.read<uint32_t>("magic");
  version_ = c.read<uint32_t>("version");
  if (version_ != 2 && version_ != 3) fail("{}: unsupported GGUF version {} (2 and 3 are supported)", path_, version_);
  const uint64_t n_tensors = c.read<uint64_t>("tensor count");
  const uint64_t n_kv = c.read<uint64_t>("metadata count");
  // Each key-value pair needs at least 12 bytes and each tensor info at least 28.
  if (n_kv > c.remaining() / 12) fail("{}: absurd metadata count {}", path_, n_kv);
  if (n_tensors > c.remaining() / 28) fail("{}: absurd tensor count {}", path_, n_tensors);

  for (uint64_t i = 0; i < n_kv; ++i) {
    std::string key = c.read_string("metadata key");
    const uint32_t type = c.read<uint32_t>("metadata value type");
    GgufValue v = read_value(c, type, path_, key);
    if (!metadata_.emplace(key, std::move(v)).second) fail("{}: duplicate metadata key '{}'", path_, key);
  }

  std::vector<TensorInfo> infos;
  for (uint64_t i = 0; i < n_tensors; ++i) infos.push_back(read_tensor_info(c, path_));

  uint64_t alignment = 32;
  if (auto a = find_int("general.alignment")) {
    if (*a <= 0 || (*a & (*a - 1)) != 0 || *a > 65536) fail("{}: general.alignment {} is not a power of two", path_, *a);
    alignment = static_cast<uint64_t>(*a);
  }
  const uint64_t data_start = (c.offset() + alignment - 1) / alignment * alignment;
  const uint64_t file_size = bytes_.size();
  if (data_ == Data::Required && find_bool(kShapeOnlyKey).value_or(false))
    fail("{}: a shape file (a model's header without its weights): run it with --load-format dummy", path_);
  if (n_tensors > 0 && data_start > file_size && data_ == Data::Required)
    fail("{}: truncated file: tensor data section missing", path_);
  // Without data, offsets are checked against each other only (as if the data were all there).
  const uint64_t data_size = data_ == Data::Absent ? uint64_t(1) << 50 : n_tensors > 0 ? file_size - data_start : 0;
  const uint8_t* base = data_ == Data::Absent ? nullptr : bytes_.data() + data_start;

  for (auto& t : infos) {
    auto info = dtype_info(t.type);
    if (!info) fail("{}: tensor '{}' has unsupported type {}", path_, t.name, dtype_name(t.type));
    const uint64_t nbytes = tensor_nbytes(t, *info, path_);
    if (t.offset % alignment != 0) fail("{}: tensor '{}' offset {} is not aligned to {}", path_, t.name, t.offset, alignment);
    if (t.offset > data_size || nbytes > data_size - t.offset)
      fail("{}: tensor '{}' data ({} bytes at offset {}) runs past the end of the file (truncated?)", path_, t.name,
           nbytes, t.offset);
    if (!tensor_index_.emplace(t.name, tensors_.size()).second) fail("{}: duplicate tensor name '{}'", path_, t.name);
    tensors_.push_back(TensorRef{t.name, info->type, t.ne, base ? base + t.offset : nullptr, nbytes});
  }

  std::vector<size_t> by_offset(infos.size());
  for (size_t i = 0; i < by_offset.size(); ++i) by_offset[i] = i;
  std::sort(by_offset.begin(), by_offset.end(), [&](size_t a, size_t b) { return infos[a].offset < infos[b].offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (infos[by_offset[i - 1]].offset + tensors_[by_offset[i - 1]].nbytes > infos[by_offset[i]].offset)
      fail("{}: tensors '{}' and '{}' overlap", path_, tensors_[by_offset[i - 1]].name, tensors_[by_offset[i]].name);
}

namespace {
const GgufValue& get_value(const std::map<std::string, GgufValue>& m, const std::string& path, const std::string& key) {
  auto it = m.find(key);
  if (it == m.end()) fail("{}: missing metadata key '{}'", path, key);
  return it->second;
}
}  // namespace

std::string GgufFile::get_string(const std::string& key) const {
  const auto& v = get_value(metadata_, path_, key);
  if (auto* s = std::get_if<std::string>(&v.value)) return *s;
  fail("{}: metadata key '{}' is not a string", path_, key);
}

int64_t GgufFile::get_int(const std::string& key) const {
  const auto& v = get_value(metadata_, path_, key);
  if (auto* i = std::get_if<int64_t>(&v.value)) return *i;
  if (auto* u = std::get_if<uint64_t>(&v.value)) {
    if (*u > uint64_t(std::numeric_limits<int64_t>::max())) fail("{}: metadata key '{}' is too large", path_, key);
    return static_cast<int64_t>(*u);
  }
  fail("{}: metadata key '{}' is not an integer", path_, key);
}

double GgufFile::get_float(const std::string& key) const {
  const auto& v = get_value(metadata_, path_, key);
  if (auto* f = std::get_if<double>(&v.value)) return *f;
  return static_cast<double>(get_int(key));
}

bool GgufFile::get_bool(const std::string& key) const {
  const auto& v = get_value(metadata_, path_, key);
  if (auto* b = std::get_if<bool>(&v.value)) return *b;
  fail("{}: metadata key '{}' is not a bool", path_, key);
}

const GgufArray& GgufFile::get_array(const std::string& key) const {
  const auto& v = get_value(metadata_, path_, key);
  if (auto* a = std::get_if<GgufArray>(&v.value)) return *a;
  fail("{}: metadata key '{}' is not an array", path_, key);
}

std::optional<int64_t> GgufFile::find_int(const std::string& key) const {
  return has(key) ? std::optional(get_int(key)) : std::nullopt;
}
std::optional<double> GgufFile::find_float(const std::string& key) const {
  return has(key) ? std::optional(get_float(key)) : std::nullopt;
}
std::optional<bool> GgufFile::find_bool(const std::string& key) const {
  return has(key) ? std::optional(get_bool(key)) : std::nullopt;
}
std::optional<std::string> GgufFile::find_string(const std::string& key) const {
  return has(key) ? std::optional(get_string(key)) : std::nullopt;
}

const TensorRef* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::string to_display_string(const GgufValue& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, std::string>) return x.size() > 80 ? x.substr(0, 77) + "..." : x;
        else if constexpr (std::is_same_v<T, GgufArray>) return fmt::format("[array of {}]", x.size());
        else if constexpr (std::is_same_v<T, bool>) return x ? "true" : "false";
        else return fmt::format("{}", x);
      },
      v.value);
}

}  // namespace serval
