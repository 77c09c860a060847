// safetensors reading and writing: header JSON (nlohmann, order-preserving so
// files are byte-reproducible), validation of untrusted headers, and the
// atomic tmp+fsync+rename write.
#include "core/safetensors.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <set>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "core/json_limits.h"

namespace ember {
namespace {

// The data section is raw little-endian bytes; ember's tensors are host-endian.
static_assert(std::endian::native == std::endian::little, "safetensors I/O assumes a little-endian host");

using ojson = nlohmann::ordered_json;

constexpr std::string_view kMetadataKey = "__metadata__";

struct DTypeName {
  const char* name;
  DType dtype;
};
constexpr DTypeName kDTypes[] = {
    {"F32", DType::Float32},        {"F16", DType::Float16},        {"BF16", DType::BFloat16}, {"F64", DType::Float64},
    {"I32", DType::Int32},          {"I64", DType::Int64},          {"U8", DType::UInt8},      {"BOOL", DType::Bool},
    {"F8_E4M3", DType::Float8E4M3}, {"F8_E5M2", DType::Float8E5M2},
};
// In the format but without an ember dtype: named as unsupported rather than
// unknown, so the user knows the file is fine and ember is the limit.
constexpr const char* kForeignDTypes[] = {"I8",  "I16",     "U16",     "U32",     "U64",
                                          "C64", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4"};

// The safetensors format caps the JSON header at 100 MB (as the reference
// implementation does); a larger one is not a safetensors file.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

std::string where(const std::string& source) { return absl::StrCat("safetensors file '", source, "': "); }

std::string shape_string(const Shape& s) {
  return absl::StrCat("[", absl::StrJoin(s, ", "), "]");
}

// One validated header entry.
struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin, end;
};

struct Header {
  std::vector<Entry> entries;  // in data-section order
  std::map<std::string, std::string> metadata;
};

// Validates the header JSON against a data section of `data_len` bytes:
// every field's type, the dtype, shape*dtype against the offsets, and that
// the tensors tile the data section exactly (no gap, overlap or overhang).
absl::StatusOr<Header> parse_header(std::string_view text, uint64_t data_len, const std::string& source) {
  const std::string w = where(source);
  if (const std::string deep = json_depth_error(text); !deep.empty())
    return absl::DataLossError(absl::StrCat(w, "invalid JSON header: ", deep));
  ojson j;
  try {
    j = ojson::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(w, "invalid JSON header: ", e.what()));
  }
  if (!j.is_object()) return absl::DataLossError(absl::StrCat(w, "invalid JSON header: not a JSON object"));
  Header h;
  for (const auto& [name, v] : j.items()) {
    if (name == kMetadataKey) {
      if (!v.is_object()) return absl::DataLossError(absl::StrCat(w, "__metadata__ is not a JSON object"));
      for (const auto& [k, s] : v.items()) {
        if (!s.is_string())
          return absl::DataLossError(absl::StrCat(w, "__metadata__ entry '", k, "' is not a string"));
        h.metadata[k] = s.get<std::string>();
      }
      continue;
    }
    // The writer refuses empty names (no state_dict key is empty); the reader
    // agrees, so whatever loads can be saved again (found by fuzzing).
    if (name.empty()) return absl::DataLossError(absl::StrCat(w, "a tensor with an empty name"));
    const std::string t = absl::StrCat(w, "tensor '", name, "': ");
    if (!v.is_object()) return absl::DataLossError(absl::StrCat(t, "entry is not a JSON object"));
    auto dt = v.find("dtype");
    auto sh = v.find("shape");
    auto off = v.find("data_offsets");
    if (dt == v.end() || !dt->is_string()) return absl::DataLossError(absl::StrCat(t, "missing or non-string \"dtype\""));
    if (sh == v.end() || !sh->is_array()) return absl::DataLossError(absl::StrCat(t, "missing or non-array \"shape\""));
    if (off == v.end() || !off->is_array() || off->size() != 2 || !(*off)[0].is_number_unsigned() ||
        !(*off)[1].is_number_unsigned())
      return absl::DataLossError(absl::StrCat(t, "\"data_offsets\" must be [begin, end], two non-negative integers"));
    Entry e;
    e.name = name;
    const std::string dname = dt->get<std::string>();
    bool found = false;
    for (const auto& d : kDTypes)
      if (dname == d.name) e.dtype = d.dtype, found = true;
    if (!found) {
      for (const char* f : kForeignDTypes)
        if (dname == f)
          return absl::UnimplementedError(
              absl::StrCat(t, "dtype ", dname, " is valid safetensors but ember has no such dtype"));
      return absl::DataLossError(absl::StrCat(t, "unknown dtype '", dname, "'"));
    }
    uint64_t numel = 1;
    for (const auto& d : *sh) {
      if (!d.is_number_unsigned() || d.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX))
        return absl::DataLossError(absl::StrCat(t, "shape ", sh->dump(), " has an entry that is not a size"));
      e.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(numel, d.get<uint64_t>(), &numel))
        return absl::DataLossError(absl::StrCat(t, "shape ", sh->dump(), " overflows"));
    }
    uint64_t nbytes;
    if (__builtin_mul_overflow(numel, dtype_size(e.dtype), &nbytes))
      return absl::DataLossError(absl::StrCat(t, "shape ", sh->dump(), " overflows"));
    e.begin = (*off)[0].get<uint64_t>();
    e.end = (*off)[1].get<uint64_t>();
    const std::string offs = absl::StrCat("data_offsets [", e.begin, ", ", e.end, "]");
    if (e.end < e.begin) return absl::DataLossError(absl::StrCat(t, offs, " end before begin"));
    if (e.end > data_len)
      return absl::DataLossError(absl::StrCat(t, offs, " out of range: the data section has ", data_len,
                                              " bytes (truncated file?)"));
    if (e.end - e.begin != nbytes)
      return absl::DataLossError(absl::StrCat(t, offs, " hold ", e.end - e.begin, " bytes, but shape ",
                                              shape_string(e.shape), " of ", dname, " needs ", nbytes));
    h.entries.push_back(std::move(e));
  }
  // Stable: empty tensors sharing an offset keep their header order.
  std::stable_sort(h.entries.begin(), h.entries.end(),
                   [](const Entry& a, const Entry& b) { return a.begin < b.begin; });
  uint64_t expected = 0;
  const Entry* prev = nullptr;
  for (const Entry& e : h.entries) {
    if (e.begin != expected) {
      const std::string after = prev ? absl::StrCat("tensor '", prev->name, "' ends at ", expected)
                                     : std::string("the data section starts at 0");
      return absl::DataLossError(absl::StrCat(w, "tensor '", e.name, "': data_offsets [", e.begin, ", ", e.end,
                                              e.begin < expected ? "] overlap the previous tensor (" : "] leave a gap (",
                                              after, ")"));
    }
    expected = e.end;
    prev = &e;
  }
  if (expected != data_len)
    return absl::DataLossError(absl::StrCat(w, "the tensors cover ", expected, " bytes of the data section, which has ",
                                            data_len, " (trailing bytes)"));
  return h;
}

// Bool tensors must hold 0/1: any other byte read as bool is UB.
void normalize_bools(Tensor& t) {
  if (t.dtype() != DType::Bool) return;
  auto* p = static_cast<uint8_t*>(t.raw_data());
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = p[i] != 0;
}

struct Prepared {
  std::string header;          // 8-byte length + padded JSON
  std::vector<Tensor> data;    // CPU, contiguous, in file order
  uint64_t data_len = 0;
};

absl::StatusOr<Prepared> prepare(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                 const std::map<std::string, std::string>& metadata) {
  Prepared p;
  ojson j = ojson::object();
  if (!metadata.empty()) {
    ojson m = ojson::object();
    for (const auto& [k, v] : metadata) m[k] = v;
    j[std::string(kMetadataKey)] = std::move(m);
  }
  std::set<std::string> seen;
  for (const auto& [name, t] : tensors) {
    if (name.empty() || name == kMetadataKey)
      return absl::InvalidArgumentError(absl::StrCat("save_safetensors: invalid tensor name '", name, "'"));
    if (!seen.insert(name).second)
      return absl::InvalidArgumentError(absl::StrCat("save_safetensors: tensor name '", name, "' appears twice"));
    if (!t.defined())
      return absl::InvalidArgumentError(absl::StrCat("save_safetensors: tensor '", name, "' is undefined"));
    Tensor c;
    try {
      c = t.detach().cpu().contiguous();
    } catch (const Error& e) {
      return absl::InternalError(absl::StrCat("save_safetensors: tensor '", name, "': ", e.what()));
    }
    const uint64_t begin = p.data_len;
    p.data_len += c.nbytes();
    ojson e = ojson::object();
    e["dtype"] = safetensors_dtype_name(c.dtype());
    e["shape"] = c.sizes();
    e["data_offsets"] = {begin, p.data_len};
    j[name] = std::move(e);
    p.data.push_back(std::move(c));
  }
  std::string text;
  try {
    text = j.dump();
  } catch (const nlohmann::json::exception& e) {  // invalid UTF-8 in a name
    return absl::InvalidArgumentError(absl::StrCat("save_safetensors: cannot encode the header: ", e.what()));
  }
  text.append((8 - text.size() % 8) % 8, ' ');
  const uint64_t n = text.size();
  p.header.resize(8);
  std::memcpy(p.header.data(), &n, 8);
  p.header += text;
  return p;
}

absl::Status errno_error(const std::string& msg, int err) {
  std::string m = absl::StrCat(msg, ": ", std::strerror(err));
  return err == ENOENT ? absl::NotFoundError(m) : absl::InternalError(m);
}

absl::Status write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return errno_error(absl::StrCat("save_safetensors: writing '", path, "'"), errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return absl::OkStatus();
}

// Reads exactly n bytes at `offset`; false on a short read.
bool pread_all(int fd, void* data, size_t n, uint64_t offset) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    ssize_t r = ::pread(fd, p, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return false;
    p += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
  return true;
}

}  // namespace

const Tensor* SafetensorsFile::find(const std::string& name) const {
  for (const auto& [k, t] : tensors)
    if (k == name) return &t;
  return nullptr;
}

const char* safetensors_dtype_name(DType t) {
  for (const auto& d : kDTypes)
    if (d.dtype == t) return d.name;
  return "?";
}

absl::StatusOr<std::string> serialize_safetensors(const std::vector<std::pair<std::string, Tensor>>& tensors,
                                                  const std::map<std::string, std::string>& metadata) {
  auto p = prepare(tensors, metadata);
  if (!p.ok()) return p.status();
  std::string out = std::move(p->header);
  out.reserve(out.size() + p->data_len);
  for (const Tensor& t : p->data)
    if (t.nbytes() > 0) out.append(static_cast<const char*>(t.raw_data()), t.nbytes());
  return out;
}

absl::StatusOr<SafetensorsFile> parse_safetensors(std::string_view bytes, const std::string& source) {
  const std::string w = where(source);
  if (bytes.size() < 8)
    return absl::DataLossError(absl::StrCat(w, "truncated: ", bytes.size(), " bytes, too short for the header length"));
  uint64_t n;
  std::memcpy(&n, bytes.data(), 8);
  if (n > bytes.size() - 8)
    return absl::DataLossError(
        absl::StrCat(w, "header length ", n, " exceeds the file size ", bytes.size(), " (truncated file?)"));
  if (n > kMaxHeaderBytes)
    return absl::DataLossError(absl::StrCat(w, "header length ", n, " exceeds the format's limit of ", kMaxHeaderBytes));
  auto h = parse_header(bytes.substr(8, n), bytes.size() - 8 - n, source);
  if (!h.ok()) return h.status();
  SafetensorsFile f;
  f.metadata = std::move(h->metadata);
  const char* data = bytes.data() + 8 + n;
  for (const Entry& e : h->entries) {
    Tensor t = Tensor::empty(e.shape, TensorOptions(e.dtype));
    if (e.end > e.begin) std::memcpy(t.raw_data(), data + e.begin, e.end - e.begin);
    normalize_bools(t);
    f.tensors.emplace_back(e.name, std::move(t));
  }
  return f;
}

absl::Status save_safetensors(const std::string& path, const std::vector<std::pair<std::string, Tensor>>& tensors,
                              const std::map<std::string, std::string>& metadata) {
  auto p = prepare(tensors, metadata);
  if (!p.ok()) return p.status();
  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_error(absl::StrCat("save_safetensors: cannot create '", tmp, "'"), errno);
  absl::Status s = write_all(fd, p->header.data(), p->header.size(), tmp);
  for (const Tensor& t : p->data)
    if (s.ok() && t.nbytes() > 0) s = write_all(fd, t.raw_data(), t.nbytes(), tmp);
  // fsync before rename: otherwise a crash can leave `path` naming a file
  // whose blocks never reached the disk.
  if (s.ok() && ::fsync(fd) != 0) s = errno_error(absl::StrCat("save_safetensors: fsync '", tmp, "'"), errno);
  if (::close(fd) != 0 && s.ok()) s = errno_error(absl::StrCat("save_safetensors: closing '", tmp, "'"), errno);
  if (s.ok() && ::rename(tmp.c_str(), path.c_str()) != 0)
    s = errno_error(absl::StrCat("save_safetensors: renaming '", tmp, "' to '", path, "'"), errno);
  if (!s.ok()) {
    ::unlink(tmp.c_str());
    return s;
  }
  // Makes the rename itself durable.
  std::string dir = std::filesystem::path(path).parent_path().string();
  if (dir.empty()) dir = ".";
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
  return absl::OkStatus();
}

namespace {
// load_safetensors, or with with_data=false only its checks (no tensor is
// allocated or read).
absl::StatusOr<SafetensorsFile> read_safetensors_file(const std::string& path, bool with_data) {
  const std::string w = where(path);
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return errno_error(absl::StrCat(w, "cannot open"), errno);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st;
  if (::fstat(fd, &st) != 0) return errno_error(absl::StrCat(w, "cannot stat"), errno);
  if (!S_ISREG(st.st_mode)) return absl::InvalidArgumentError(absl::StrCat(w, "not a regular file"));
  const uint64_t size = static_cast<uint64_t>(st.st_size);
  uint64_t n = 0;
  if (size < 8 || !pread_all(fd, &n, 8, 0))
    return absl::DataLossError(absl::StrCat(w, "truncated: ", size, " bytes, too short for the header length"));
  if (n > size - 8)
    return absl::DataLossError(
        absl::StrCat(w, "header length ", n, " exceeds the file size ", size, " (truncated file?)"));
  if (n > kMaxHeaderBytes)
    return absl::DataLossError(absl::StrCat(w, "header length ", n, " exceeds the format's limit of ", kMaxHeaderBytes));
  std::string text(n, '\0');
  if (!pread_all(fd, text.data(), n, 8)) return absl::DataLossError(absl::StrCat(w, "short read of the header"));
  auto h = parse_header(text, size - 8 - n, path);
  if (!h.ok()) return h.status();
  SafetensorsFile f;
  f.metadata = std::move(h->metadata);
  if (!with_data) return f;
  for (const Entry& e : h->entries) {
    Tensor t = Tensor::empty(e.shape, TensorOptions(e.dtype));
    if (e.end > e.begin && !pread_all(fd, t.raw_data(), e.end - e.begin, 8 + n + e.begin))
      return absl::DataLossError(absl::StrCat(w, "short read of tensor '", e.name, "' (file changed while reading?)"));
    normalize_bools(t);
    f.tensors.emplace_back(e.name, std::move(t));
  }
  return f;
}
}  // namespace

absl::StatusOr<SafetensorsFile> load_safetensors(const std::string& path) { return read_safetensors_file(path, true); }

absl::Status check_safetensors_file(const std::string& path) { return read_safetensors_file(path, false).status(); }

}  // namespace ember
