// Sharded checkpoints (sharded.h): which pieces of the training state this
// rank holds, read off each tensor's ShardSpec (whatever parallelism set
// it) or whole when it has none, the parallel write and the agreed commit,
// the index, and the load that reads only the pieces overlapping what each
// rank holds now. Nothing here knows FSDP: a region is a region.
#include "distributed/checkpoint/sharded.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "core/autograd_hook.h"
#include "core/json_limits.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "core/safetensors.h"
#include "distributed/checkpoint/checkpoint_internal.h"
#include "distributed/checkpoint/sharded_internal.h"
#include "distributed/checkpoint/sharded_layout.h"
#include "distributed/comm/object_collectives.h"
#include "distributed/sharding/shard_spec.h"

namespace ember::distributed {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using namespace checkpoint_internal;
using namespace sharded_internal;

namespace {

constexpr const char* kIndexFormat = "ember-sharded-checkpoint";
// 2: a piece is a box ("offsets", "sizes") and a run of it ("begin",
// "numel"); 1: a run ("offset", "numel") of the whole tensor's flattening.
// Both load.
constexpr int64_t kIndexVersion = 2;
constexpr const char* kIndexFile = "index.json";

Tensor generator_state() {
  Tensor t = Tensor::empty({2}, DType::Int64);
  t.data<int64_t>()[0] = static_cast<int64_t>(default_generator().seed());
  t.data<int64_t>()[1] = static_cast<int64_t>(default_generator().offset());
  return t;
}
constexpr uintmax_t kMaxIndexBytes = uintmax_t{1} << 30;

std::string rank_file(int r) {
  char b[40];
  std::snprintf(b, sizeof b, "rank-%05d.safetensors", r);
  return b;
}

std::string hex64(uint64_t v) {
  char b[20];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

std::optional<DType> dtype_from_name(const std::string& s) {
  for (DType t : {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64, DType::Int32, DType::Int64,
                  DType::UInt8, DType::Bool})
    if (s == safetensors_dtype_name(t)) return t;
  return std::nullopt;
}

// Writes this rank's pieces to `path`; returns their records (name, shape,
// dtype, offset, numel, absolute byte range, checksum).
absl::StatusOr<json> write_rank_file(const std::string& path, const std::vector<Held>& held, int64_t max_piece_bytes) {
  std::vector<std::pair<std::string, Tensor>> items;
  json records = json::array();
  std::vector<size_t> record_of_item;
  for (const Held& h : held) {
    if (!h.writer) continue;
    json rec = {{"name", h.name}, {"shape", h.shape}, {"dtype", safetensors_dtype_name(h.dtype)}};
    if (!h.placement.empty()) rec["placement"] = h.placement;
    Tensor flat = h.local.detach().contiguous().view({-1}).to(kCPU).contiguous();
    const int64_t n = flat.numel(), es = static_cast<int64_t>(dtype_size(h.dtype));
    const int64_t per = std::max<int64_t>(1, max_piece_bytes / es);
    if (n == 0) {  // registers an empty tensor's shape and dtype
      records.push_back(rec);
      continue;
    }
    std::string box;  // the piece's name in the file: "<tensor>@<box offsets>+<run begin>"
    for (int64_t o : h.region.box.offsets) box += (box.empty() ? "" : ",") + std::to_string(o);
    for (int64_t s = 0; s < n; s += per) {
      Tensor c = flat.narrow(0, s, std::min(per, n - s)).contiguous();
      json r = rec;
      r["offsets"] = h.region.box.offsets;
      r["sizes"] = h.region.box.lengths;
      r["begin"] = h.region.begin + s;
      r["numel"] = c.numel();
      r["xxh64"] = hex64(XXH64(c.raw_data(), static_cast<size_t>(c.numel() * es), 0));
      items.push_back({h.name + "@" + box + "+" + std::to_string(h.region.begin + s), c});
      record_of_item.push_back(records.size());
      records.push_back(std::move(r));
    }
  }
  if (auto s = save_safetensors(path, items, {{"format", "ember-sharded"}}); !s.ok()) return s;
  // The byte ranges, from the header just written.
  std::ifstream in(path, std::ios::binary);
  uint64_t header_len = 0;
  in.read(reinterpret_cast<char*>(&header_len), 8);
  std::string header(header_len, '\0');
  in.read(header.data(), static_cast<std::streamsize>(header_len));
  if (!in) return absl::InternalError(absl::StrCat(path, ": cannot read back the header just written"));
  const json hj = json::parse(header);
  for (size_t k = 0; k < items.size(); ++k) {
    const json& off = hj.at(items[k].first).at("data_offsets");
    const int64_t base = 8 + static_cast<int64_t>(header_len);
    records[record_of_item[k]]["bytes"] = {base + off[0].get<int64_t>(), base + off[1].get<int64_t>()};
  }
  return records;
}

absl::Status checked_index(const json& j, const std::string& path, CheckpointIndex* out);

// Rank 0: the index of every rank's records.
absl::StatusOr<json> build_index(const std::vector<json>& records, int world, const std::string& layout,
                                 const std::string& mesh, const std::string& where) {
  json tensors = json::object();
  for (int r = 0; r < world; ++r)
    for (const json& rec : records[r]) {
      const std::string name = rec.at("name").get<std::string>();
      auto it = tensors.find(name);
      if (it == tensors.end()) {
        tensors[name] = {{"shape", rec.at("shape")}, {"dtype", rec.at("dtype")}, {"pieces", json::array()}};
        it = tensors.find(name);
      } else if ((*it)["shape"] != rec.at("shape") || (*it)["dtype"] != rec.at("dtype")) {
        return absl::InternalError(absl::StrCat(where, ": ranks disagree on tensor '", name, "': ",
                                                (*it)["shape"].dump(), " ", (*it)["dtype"].dump(), " vs ",
                                                rec.at("shape").dump(), " ", rec.at("dtype").dump(), " on rank ", r));
      }
      if (rec.contains("placement") && !it->contains("placement")) (*it)["placement"] = rec.at("placement");
      if (!rec.contains("begin")) continue;
      (*it)["pieces"].push_back({{"file", rank_file(r)},
                                 {"offsets", rec.at("offsets")},
                                 {"sizes", rec.at("sizes")},
                                 {"begin", rec.at("begin")},
                                 {"numel", rec.at("numel")},
                                 {"bytes", rec.at("bytes")},
                                 {"xxh64", rec.at("xxh64")}});
    }
  json sorted = json::object();
  std::vector<std::string> names;
  for (const auto& [k, v] : tensors.items()) names.push_back(k);
  std::sort(names.begin(), names.end());
  for (const auto& n : names) {
    json t = tensors[n];
    // By box, then run: the order of the whole tensor's rows for row pieces.
    std::sort(t["pieces"].begin(), t["pieces"].end(), [](const json& a, const json& b) {
      const auto oa = a.at("offsets").get<Shape>(), ob = b.at("offsets").get<Shape>();
      return oa != ob ? oa < ob : a.at("begin").get<int64_t>() < b.at("begin").get<int64_t>();
    });
    sorted[n] = std::move(t);
  }
  json files = json::array();
  for (int r = 0; r < world; ++r) files.push_back(rank_file(r));
  json index = {{"format", kIndexFormat}, {"version", kIndexVersion}, {"world_size", world},
                {"layout", layout},       {"files", files},           {"tensors", std::move(sorted)}};
  if (!mesh.empty()) index["mesh"] = mesh;
  // The index must describe every tensor exactly once before it is written.
  CheckpointIndex check;
  if (auto s = checked_index(index, where, &check); !s.ok())
    return absl::InternalError(absl::StrCat("the index built is inconsistent (a bug): ", s.message()));
  return index;
}

// ---- Reading the index ----

absl::Status checked_index(const json& j, const std::string& path, CheckpointIndex* out) {
  auto bad = [&](const std::string& m) { return absl::DataLossError(absl::StrCat(path, ": ", m)); };
  if (!j.is_object()) return bad("not a JSON object");
  auto f = j.find("format");
  if (f == j.end() || !f->is_string() || f->get<std::string>() != kIndexFormat)
    return absl::InvalidArgumentError(absl::StrCat(path, ": \"format\" is ", f == j.end() ? "missing" : f->dump(),
                                                   ", expected \"", kIndexFormat, "\""));
  auto v = j.find("version");
  if (v == j.end() || !v->is_number_integer()) return bad("\"version\" is missing or not an integer");
  if (v->get<int64_t>() != kIndexVersion && v->get<int64_t>() != 1)
    return absl::InvalidArgumentError(absl::StrCat(path, ": version ", v->get<int64_t>(),
                                                   " is not supported (this ember reads versions 1 and ", kIndexVersion,
                                                   ")"));
  out->version = v->get<int>();
  const bool v1 = out->version == 1;
  auto ws = j.find("world_size");
  if (ws == j.end() || !ws->is_number_integer() || ws->get<int64_t>() < 1) return bad("\"world_size\" must be >= 1");
  out->world_size = ws->get<int>();
  if (auto l = j.find("layout"); l != j.end() && l->is_string()) out->layout = l->get<std::string>();
  if (auto m = j.find("mesh"); m != j.end() && m->is_string()) out->mesh = m->get<std::string>();
  auto files = j.find("files");
  if (files == j.end() || !files->is_array()) return bad("\"files\" must be an array of file names");
  for (const json& fj : *files) {
    if (!fj.is_string()) return bad("\"files\" holds a non-string");
    const std::string name = fj.get<std::string>();
    if (name.empty() || name.find('/') != std::string::npos || name == "." || name == "..")
      return bad(absl::StrCat("file name '", name, "' is not a plain name in the checkpoint directory"));
    out->files.push_back(name);
  }
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_object()) return bad("\"tensors\" must be an object");
  auto integer = [](const json& o, const char* k, int64_t* x) {
    auto it = o.find(k);
    if (it == o.end() || !it->is_number_integer() || it->get<int64_t>() < 0) return false;
    *x = it->get<int64_t>();
    return true;
  };
  for (const auto& [name, t] : tensors->items()) {
    const std::string at = absl::StrCat("tensor '", name, "'");
    CheckpointTensor ct;
    ct.name = name;
    if (!t.is_object()) return bad(at + " is not an object");
    if (auto pl = t.find("placement"); pl != t.end() && pl->is_string()) ct.placement = pl->get<std::string>();
    auto shape = t.find("shape");
    if (shape == t.end() || !shape->is_array()) return bad(at + ": \"shape\" must be an array");
    int64_t numel = 1;  // with overflow checks: the file is untrusted
    for (const json& d : *shape) {
      if (!d.is_number_integer() || d.get<int64_t>() < 0) return bad(at + ": \"shape\" holds a non-size");
      ct.shape.push_back(d.get<int64_t>());
      if (__builtin_mul_overflow(numel, ct.shape.back(), &numel)) return bad(at + ": \"shape\" overflows");
    }
    auto dt = t.find("dtype");
    std::optional<DType> dtype = dt != t.end() && dt->is_string() ? dtype_from_name(dt->get<std::string>()) : std::nullopt;
    if (!dtype) return bad(at + ": \"dtype\" is missing or unknown");
    ct.dtype = *dtype;
    const int64_t es = static_cast<int64_t>(dtype_size(ct.dtype));
    auto pieces = t.find("pieces");
    if (pieces == t.end() || !pieces->is_array()) return bad(at + ": \"pieces\" must be an array");
    auto ints = [](const json& o, const char* k, size_t n, Shape* x) {
      auto it = o.find(k);
      if (it == o.end() || !it->is_array() || it->size() != n) return false;
      for (const json& e : *it) {
        if (!e.is_number_integer() || e.get<int64_t>() < 0) return false;
        x->push_back(e.get<int64_t>());
      }
      return true;
    };
    int64_t covered = 0;
    for (const json& p : *pieces) {
      CheckpointPiece cp;
      int64_t b = 0, e = 0;
      auto file = p.is_object() ? p.find("file") : p.end();
      auto bytes = p.is_object() ? p.find("bytes") : p.end();
      auto hash = p.is_object() ? p.find("xxh64") : p.end();
      Region& r = cp.region;
      const bool placed = p.is_object() &&
                          (v1 ? integer(p, "offset", &r.begin)
                              : ints(p, "offsets", ct.shape.size(), &r.box.offsets) &&
                                    ints(p, "sizes", ct.shape.size(), &r.box.lengths) && integer(p, "begin", &r.begin));
      if (v1) r.box = whole_box(ct.shape);
      if (file == p.end() || !file->is_string() || !placed || !integer(p, "numel", &r.numel) || bytes == p.end() ||
          !bytes->is_array() || bytes->size() != 2 || !(*bytes)[0].is_number_integer() ||
          !(*bytes)[1].is_number_integer() || hash == p.end() || !hash->is_string() ||
          hash->get<std::string>().size() != 16)
        return bad(
            at +
            (v1 ? ": a piece needs \"file\", \"offset\", \"numel\", \"bytes\" [begin, end] and a 16-digit \"xxh64\""
                : ": a piece needs \"file\", \"offsets\" and \"sizes\" (one per dimension), \"begin\", "
                  "\"numel\", \"bytes\" [begin, end] and a 16-digit \"xxh64\""));
      cp.file = file->get<std::string>();
      try {  // inside the tensor, the run inside its box (untrusted numbers: checked before any use)
        for (size_t d = 0; d < ct.shape.size(); ++d)
          if (r.box.offsets[d] > ct.shape[d] || r.box.lengths[d] > ct.shape[d] - r.box.offsets[d])
            throw Error("outside");
        int64_t box_numel = 1;
        for (int64_t l : r.box.lengths)
          if (__builtin_mul_overflow(box_numel, l, &box_numel)) throw Error("overflow");
        if (r.begin > box_numel || r.numel > box_numel - r.begin) throw Error("outside");
      } catch (const Error&) {
        return bad(absl::StrCat(at, ": piece ", r.to_string(), " lies outside the tensor ", shape_str(ct.shape)));
      }
      if (std::find(out->files.begin(), out->files.end(), cp.file) == out->files.end())
        return bad(
            absl::StrCat(at, ": piece ", r.to_string(), " is in '", cp.file, "', which \"files\" does not list"));
      b = (*bytes)[0].get<int64_t>(), e = (*bytes)[1].get<int64_t>();
      int64_t nbytes = 0;
      if (b < 0 || e < b || __builtin_mul_overflow(r.numel, es, &nbytes) || e - b != nbytes)
        return bad(
            absl::StrCat(at, ": piece ", r.to_string(), " has ", r.numel, " elements but bytes [", b, ", ", e, ")"));
      cp.byte_begin = b, cp.byte_end = e;
      try {
        cp.xxh64 = std::stoull(hash->get<std::string>(), nullptr, 16);
      } catch (...) {
        return bad(at + ": \"xxh64\" is not hexadecimal");
      }
      // Exactly once: no two pieces share an element, and together they hold
      // as many as the tensor has. Pieces of one box (a region split at
      // max_piece_bytes) compare runs; others their common elements.
      for (const CheckpointPiece& q : ct.pieces) {
        const Region& o = q.region;
        const bool shared = o.box == r.box ? std::max(o.begin, r.begin) < std::min(o.begin + o.numel, r.begin + r.numel)
                                           : r.numel > 0 && o.numel > 0 && overlap(ct.shape, o, r) > 0;
        if (shared)
          return bad(absl::StrCat(at, ": pieces overlap: ", o.to_string(), " in '", q.file, "' and ", r.to_string(),
                                  " in '", cp.file, "' (each element must be in exactly one piece)"));
      }
      covered += r.numel;
      ct.pieces.push_back(std::move(cp));
    }
    if (covered != numel) return bad(absl::StrCat(at, ": the pieces cover ", covered, " of its ", numel, " elements"));
    out->tensors.push_back(std::move(ct));
  }
  std::sort(out->tensors.begin(), out->tensors.end(),
            [](const CheckpointTensor& a, const CheckpointTensor& b) { return a.name < b.name; });
  return absl::OkStatus();
}

// Open files of one checkpoint, read by byte range.
class PieceReader {
 public:
  explicit PieceReader(std::string dir) : dir_(std::move(dir)) {}
  ~PieceReader() {
    for (auto& [k, fd] : fds_) ::close(fd);
  }
  PieceReader(const PieceReader&) = delete;
  PieceReader& operator=(const PieceReader&) = delete;

  // The piece's bytes, checksum verified.
  absl::Status read(const CheckpointTensor& t, const CheckpointPiece& p, std::string* bytes) {
    const std::string path = dir_ + "/" + p.file;
    auto it = fds_.find(p.file);
    if (it == fds_.end()) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0)
        return errno == ENOENT ? absl::NotFoundError(absl::StrCat(path, ": missing file (tensor '", t.name, "')"))
                               : absl::InternalError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
      it = fds_.emplace(p.file, fd).first;
    }
    // Checked before anything is allocated: an index may name any range.
    struct stat st {};
    if (::fstat(it->second, &st) != 0 || !S_ISREG(st.st_mode))
      return absl::DataLossError(absl::StrCat(path, ": not a regular file (tensor '", t.name, "')"));
    if (p.byte_end > st.st_size)
      return absl::DataLossError(absl::StrCat(path, ": truncated: tensor '", t.name, "' bytes [", p.byte_begin, ", ",
                                              p.byte_end, ") end past the end of the file (", st.st_size, " bytes)"));
    const size_t n = static_cast<size_t>(p.byte_end - p.byte_begin);
    bytes->resize(n);
    size_t done = 0;
    while (done < n) {
      const ssize_t r = ::pread(it->second, bytes->data() + done, n - done, p.byte_begin + static_cast<off_t>(done));
      if (r < 0 && errno == EINTR) continue;
      if (r < 0) return absl::InternalError(absl::StrCat(path, ": read failed: ", std::strerror(errno)));
      if (r == 0)
        return absl::DataLossError(absl::StrCat(path, ": truncated: tensor '", t.name, "' bytes [", p.byte_begin, ", ",
                                                p.byte_end, ") end past the end of the file"));
      done += static_cast<size_t>(r);
    }
    const uint64_t h = XXH64(bytes->data(), n, 0);
    if (h != p.xxh64)
      return absl::DataLossError(absl::StrCat(path, ": checksum mismatch in tensor '", t.name, "' bytes [",
                                              p.byte_begin, ", ", p.byte_end, ") (", p.region.to_string(), "): xxh64 ",
                                              hex64(h), ", the index says ", hex64(p.xxh64), " (corrupted file?)"));
    return absl::OkStatus();
  }

  // The elements of `want` (a region of tensor `t`) into `out` (a CPU
  // contiguous tensor of t's dtype and want.numel elements), reading only
  // the pieces that share elements with it.
  // The elements of several regions of `t`, one after another, into a new
  // CPU tensor `out`.
  absl::Status read_regions(const CheckpointTensor& t, const std::vector<Region>& want, Tensor& out) {
    std::vector<Tensor> parts;
    for (const Region& r : want) {
      parts.push_back(Tensor::empty({r.numel}, {t.dtype, kCPU}));
      if (auto s = read_region(t, r, parts.back()); !s.ok()) return s;
    }
    out = parts.size() == 1 ? parts[0] : cat(parts, 0);
    return absl::OkStatus();
  }

  absl::Status read_region(const CheckpointTensor& t, const Region& want, Tensor& out) {
    std::string buf;
    for (const CheckpointPiece& p : t.pieces) {
      if (overlap(t.shape, p.region, want) == 0) continue;
      if (auto s = read(t, p, &buf); !s.ok()) return s;
      copy_overlap(t.shape, p.region, buf.data(), want, out.raw_data(), dtype_size(t.dtype));
    }
    return absl::OkStatus();
  }

 private:
  std::string dir_;
  std::map<std::string, int> fds_;
};

// Every rank's error, by rank (empty: none) -> one message naming the
// failed ranks (empty: none failed).
std::string name_failures(const std::vector<std::string>& errors) {
  std::string failed;
  for (size_t r = 0; r < errors.size(); ++r)
    if (!errors[r].empty()) failed += absl::StrCat(failed.empty() ? "" : "; ", "rank ", r, ": ", errors[r]);
  return failed;
}

std::string agree_on_errors(ProcessGroup& pg, const std::string& mine) {
  return name_failures(allgather_strings(pg, mine));
}

}  // namespace

const CheckpointTensor* CheckpointIndex::find(const std::string& name) const {
  auto it = std::lower_bound(tensors.begin(), tensors.end(), name,
                             [](const CheckpointTensor& t, const std::string& n) { return t.name < n; });
  return it != tensors.end() && it->name == name ? &*it : nullptr;
}

bool is_sharded_checkpoint(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / kIndexFile, ec);
}

absl::StatusOr<CheckpointIndex> read_checkpoint_index(const std::string& dir_in) {
  const std::string path = normalize_dir(dir_in) + "/" + kIndexFile;
  auto parsed = read_json_file(path, kMaxIndexBytes, " (not a sharded checkpoint, or not committed)");
  if (!parsed.ok()) return parsed.status();
  const json& j = *parsed;
  CheckpointIndex index;
  if (auto s = checked_index(j, path, &index); !s.ok()) return s;
  return index;
}

absl::Status verify_checkpoint(const std::string& dir_in) {
  const std::string dir = normalize_dir(dir_in);
  auto index = read_checkpoint_index(dir);
  if (!index.ok()) return index.status();
  PieceReader reader(dir);
  std::string buf;
  for (const CheckpointTensor& t : index->tensors)
    for (const CheckpointPiece& p : t.pieces)
      if (auto s = reader.read(t, p, &buf); !s.ok()) return s;
  return absl::OkStatus();
}

absl::StatusOr<std::optional<std::string>> newest_verified_checkpoint(const std::string& root,
                                                                      const std::string& prefix,
                                                                      std::vector<std::string>* skipped) {
  std::vector<std::string> mine;
  std::vector<std::string>& skip = skipped ? *skipped : mine;
  auto found = latest_checkpoint(root, prefix, /*fall_back=*/true, &skip, [](const std::string& dir) {
    std::error_code ec;
    return fs::is_regular_file(fs::path(dir) / kIndexFile, ec) ? verify_checkpoint(dir) : absl::OkStatus();
  });
  if (!found.ok() || found->has_value() || skip.empty()) return found;
  std::string all;
  for (const std::string& s : skip) all += (all.empty() ? "" : "; ") + s;
  return absl::DataLossError(absl::StrCat("no checkpoint under ", root, " verifies (each was left untouched): ", all));
}

absl::StatusOr<std::optional<std::string>> newest_verified_checkpoint(const std::string& root,
                                                                      const std::string& prefix, ProcessGroup& pg,
                                                                      std::vector<std::string>* skipped) {
  json mine = json::object();
  if (pg.rank() == 0) {
    std::vector<std::string> sk;
    auto found = newest_verified_checkpoint(root, prefix, &sk);
    mine["skipped"] = sk;
    if (!found.ok())
      mine["error"] = std::string(found.status().message());
    else if (found->has_value())
      mine["path"] = **found;
  }
  const json got = json::parse(allgather_strings(pg, mine.dump())[0]);
  if (skipped)
    for (const auto& s : got.value("skipped", json::array())) skipped->push_back(s.get<std::string>());
  if (got.contains("error")) return absl::DataLossError(got["error"].get<std::string>());
  if (got.contains("path")) return std::optional<std::string>(got["path"].get<std::string>());
  return std::optional<std::string>();
}

absl::StatusOr<Tensor> read_checkpoint_tensor(const std::string& dir, const CheckpointTensor& t) {
  Tensor out = Tensor::empty(t.shape, {t.dtype, kCPU});
  PieceReader reader(normalize_dir(dir));
  if (auto s = reader.read_region(t, whole_region(t.shape), out); !s.ok()) return s;
  return out;
}

namespace {

// Host copies of the pieces in one pass, for an async save: one buffer per
// dtype with each piece a view of it, and the memcpys spread over the
// threads. (A clone per tensor allocates once per piece and leaves every
// small tensor's copy to one thread: measured, staging then blocked the
// training loop 5-20% longer than the copy itself.)
void copy_to_host(std::vector<Held>& pieces) {
  const int64_t n = static_cast<int64_t>(pieces.size());
  std::vector<Tensor> src(pieces.size()), dst(pieces.size());
  std::vector<int64_t> at(pieces.size());
  std::map<DType, int64_t> total;
  for (int64_t i = 0; i < n; ++i) {
    Tensor t = pieces[i].local.detach();
    if (t.device() != kCPU || !t.is_contiguous()) t = t.to(kCPU).contiguous();  // device tensors: one copy here
    src[i] = t;
    at[i] = total[t.dtype()];
    total[t.dtype()] += t.numel();
  }
  std::map<DType, Tensor> buffers;
  for (const auto& [dt, elems] : total) buffers[dt] = Tensor::empty({elems}, {dt, kCPU});
  for (int64_t i = 0; i < n; ++i) dst[i] = buffers.at(src[i].dtype()).narrow(0, at[i], src[i].numel());
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t i = 0; i < n; ++i)
    if (src[i].numel() > 0) std::memcpy(dst[i].raw_data(), src[i].raw_data(), src[i].nbytes());
  for (int64_t i = 0; i < n; ++i) pieces[i].local = dst[i];
}

// What a save writes, taken from the live state: the pieces this rank
// writes (host copies when `copy`: training may go on changing the live
// tensors), trainer.json's text (rank 0), and the layout's description.
struct Staged {
  std::vector<Held> pieces;
  std::string trainer, layout;
  std::string error;  // staging failed on this rank
};

Staged stage_state(nn::Module& model, optim::Optimizer* optimizer, const optim::LRScheduler* scheduler,
                   const TrainingState& state, ProcessGroup& pg, bool copy) {
  Staged out;
  try {
    ModelLayout L = model_layout(model, pg);
    out.layout = L.description;
    // trainer.json lists every rank's parameters in each optimizer group
    // (pipeline stages hold different ones), each once, in rank order.
    std::vector<std::vector<std::string>> group_names;
    if (optimizer && pg.size() > 1) {
      optim::OptimizerStateDict mine = optimizer->groups_dict();
      optim::name_parameters(mine, *optimizer, model.named_parameters());
      std::string text;
      for (const auto& g : mine.param_groups) {
        for (const auto& n : g.param_names) text += n + "\n";
        text += "\x1e\n";  // end of a group
      }
      const std::vector<std::string> all = allgather_strings(pg, text);
      group_names.resize(mine.param_groups.size());
      std::vector<std::unordered_set<std::string>> seen(group_names.size());
      for (size_t r = 0; r < all.size(); ++r) {
        std::istringstream in(all[r]);
        size_t g = 0;
        for (std::string line; std::getline(in, line);) {
          if (line == "\x1e") {
            ++g;
            continue;
          }
          if (g < group_names.size() && seen[g].insert(line).second) group_names[g].push_back(line);
        }
        if (g != group_names.size() && out.error.empty())
          out.error = absl::StrCat("rank ", r, "'s optimizer has ", g, " parameter group(s), rank ", pg.rank(), "'s ",
                                   group_names.size(), "; every rank's must have the same groups");
      }
    }
    std::vector<Held> held = L.held;
    held.push_back(
        {kRngPrefix + std::to_string(pg.rank()), {2}, DType::Int64, whole_region({2}), generator_state(), true});
    if (optimizer) {
      std::vector<Held> o = optimizer_held(*optimizer, L);
      held.insert(held.end(), o.begin(), o.end());
    }
    for (Held& h : held)
      if (h.writer) out.pieces.push_back(std::move(h));
    if (copy) copy_to_host(out.pieces);
    if (pg.rank() == 0) {
      auto t = trainer_text(model, optimizer, scheduler, state, group_names.empty() ? nullptr : &group_names);
      if (!t.ok()) out.error = std::string(t.status().message());
      else out.trainer = *t;
    }
  } catch (const std::exception& e) {
    out.error = e.what();
  }
  return out;
}

// The write and the commit of staged state; every rank of `pg` calls it.
absl::Status write_staged(const std::string& dir, const Staged& staged, ProcessGroup& pg,
                          const ShardedSaveOptions& options) {
  const std::string where = absl::StrCat("save_sharded_checkpoint '", dir, "'");
  const int rank = pg.rank(), world = pg.size();
  NoGradGuard no_grad;
  std::string tmp;
  // Rank 0 owns the temporary directory: on any failure before the commit it
  // goes (best effort), so no failed save leaves ranks' files behind.
  auto remove_tmp = [&] {
    std::error_code ec;
    if (rank == 0 && !tmp.empty()) fs::remove_all(tmp, ec);
  };
  try {
    // 1. Rank 0 makes the temporary directory, named after its pid.
    Tensor nonce = full({1}, rank == 0 ? static_cast<double>(::getpid()) : 0.0, {DType::Int64, pg.device()});
    pg.broadcast(nonce, 0)->wait();
    tmp = absl::StrCat(dir, ".tmp-", static_cast<int64_t>(nonce.item()));
    std::string error = staged.error;
    if (rank == 0 && error.empty()) {
      std::error_code ec;
      const fs::path parent = fs::path(dir).parent_path();
      if (!parent.empty()) fs::create_directories(parent, ec);
      fs::remove_all(tmp, ec);  // a leftover of a crashed save with the same pid
      if (!fs::create_directories(tmp, ec)) error = absl::StrCat("cannot create '", tmp, "': ", ec.message());
    }
    if (std::string failed = agree_on_errors(pg, error); !failed.empty()) {
      remove_tmp();
      return absl::InternalError(absl::StrCat(where, ": ", failed));
    }
    stage("sharded_dir_created", dir);

    // 2. Every rank writes its pieces.
    json records;
    stage("sharded_rank_mid_write", dir);
    try {
      auto r = write_rank_file(tmp + "/" + rank_file(rank), staged.pieces, options.max_piece_bytes);
      if (!r.ok()) error = std::string(r.status().message());
      else records = std::move(*r);
    } catch (const std::exception& e) {
      error = e.what();
    }
    stage("sharded_rank_written", dir);

    // 3. Every rank's records, or the failures: no index unless all wrote.
    const std::vector<std::string> all = allgather_strings(pg, error.empty() ? records.dump() : "!" + error);
    std::vector<std::string> errors;  // "!<message>" marks a failed rank; records are JSON
    for (const std::string& a : all) errors.push_back(!a.empty() && a[0] == '!' ? a.substr(1) : "");
    if (std::string failed = name_failures(errors); !failed.empty()) {
      remove_tmp();
      return absl::InternalError(absl::StrCat(where, ": ", failed, " (nothing committed; the previous checkpoint stays)"));
    }

    // 4. Rank 0 writes trainer.json, then the index, then renames.
    // Rank 0 alone: whatever it throws becomes its error here, so the
    // agreement below is reached on every rank.
    std::string commit_error;
    if (rank == 0) try {
      std::vector<json> per_rank;
      for (int r = 0; r < world; ++r) per_rank.push_back(json::parse(all[r]));
      auto index = build_index(per_rank, world, staged.layout, options.mesh, where);
      absl::Status s = index.status();
      if (s.ok()) s = write_file_synced(tmp + "/" + kTrainerFile, staged.trainer);
      if (s.ok()) stage("sharded_before_index", dir);
      if (s.ok()) s = write_file_synced(tmp + "/" + kIndexFile, index->dump(1) + "\n");
      if (s.ok()) s = fsync_dir(tmp);
      if (s.ok()) stage("sharded_before_rename", dir);
      if (s.ok()) s = commit_dir(tmp, dir);
      if (!s.ok()) {
        commit_error = std::string(s.message());
        remove_tmp();
      }
    } catch (const std::exception& e) {
      commit_error = e.what();
      remove_tmp();
    }
    if (std::string f = agree_on_errors(pg, commit_error); !f.empty())
      return absl::InternalError(absl::StrCat(where, ": ", f));
    return absl::OkStatus();
  } catch (const std::exception& e) {  // a collective failed: a rank died or timed out
    remove_tmp();
    return absl::InternalError(absl::StrCat(where, ": ", e.what()));
  }
}

absl::Status check_save_args(const std::string& dir, const ShardedSaveOptions& options) {
  if (dir.empty() || dir == "/") return absl::InvalidArgumentError("save_sharded_checkpoint: empty checkpoint directory");
  if (options.max_piece_bytes < 1)
    return absl::InvalidArgumentError("save_sharded_checkpoint: max_piece_bytes must be >= 1");
  return absl::OkStatus();
}

}  // namespace

absl::Status save_sharded_checkpoint(const std::string& dir_in, nn::Module& model, optim::Optimizer* optimizer,
                                     const optim::LRScheduler* scheduler, const TrainingState& state,
                                     ProcessGroup& pg, const ShardedSaveOptions& options) {
  profiler::Scope prof(profiler::Kind::Checkpoint, "save_sharded_checkpoint");
  const std::string dir = normalize_dir(dir_in);
  if (auto s = check_save_args(dir, options); !s.ok()) return s;
  NoGradGuard no_grad;
  try {
    const Staged staged = stage_state(model, optimizer, scheduler, state, pg, /*copy=*/false);
    return write_staged(dir, staged, pg, options);
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat("save_sharded_checkpoint '", dir, "': ", e.what()));
  }
}

// ---- AsyncCheckpointer ----

struct AsyncCheckpointer::Impl {
  std::shared_ptr<ProcessGroup> pg;  // the background thread's own group
  ShardedSaveOptions options;
  std::thread worker;
  std::string dir;           // of the save in flight or last done
  absl::Status last;         // its outcome, once joined
  double staging_seconds = 0;

  absl::Status join() {
    if (worker.joinable()) worker.join();
    return last;
  }
};

AsyncCheckpointer::AsyncCheckpointer(std::shared_ptr<ProcessGroup> group, ShardedSaveOptions options)
    : impl_(std::make_unique<Impl>()) {
  EMBER_CHECK(group != nullptr, "AsyncCheckpointer: null process group");
  impl_->pg = std::move(group);
  impl_->options = options;
}

AsyncCheckpointer::~AsyncCheckpointer() {
  const absl::Status s = impl_->join();
  if (!s.ok()) std::fprintf(stderr, "AsyncCheckpointer: the last save failed: %s\n", std::string(s.message()).c_str());
}

absl::Status AsyncCheckpointer::save(const std::string& dir_in, nn::Module& model, optim::Optimizer* optimizer,
                                     const optim::LRScheduler* scheduler, const TrainingState& state,
                                     ProcessGroup& pg) {
  profiler::Scope prof(profiler::Kind::Checkpoint, "AsyncCheckpointer.save (staging)");
  const std::string dir = normalize_dir(dir_in);
  if (auto s = check_save_args(dir, impl_->options); !s.ok()) return s;
  // The previous save first: its failure is this call's error.
  if (absl::Status prev = impl_->join(); !prev.ok()) {
    impl_->last = absl::OkStatus();
    return prev;
  }
  const auto t0 = std::chrono::steady_clock::now();
  std::shared_ptr<Staged> staged;
  {
    NoGradGuard no_grad;
    try {
      staged = std::make_shared<Staged>(stage_state(model, optimizer, scheduler, state, pg, /*copy=*/true));
    } catch (const Error& e) {
      return absl::InternalError(absl::StrCat("save_sharded_checkpoint '", dir, "': ", e.what()));
    }
  }
  impl_->staging_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  impl_->dir = dir;
  impl_->worker = std::thread([impl = impl_.get(), dir, staged] {
    profiler::set_thread_name("async checkpoint writer");
    try {
      profiler::Scope prof(profiler::Kind::Checkpoint, "AsyncCheckpointer write");
      impl->last = write_staged(dir, *staged, *impl->pg, impl->options);
    } catch (...) {  // nothing may leave a thread: it would end the process
      impl->last = absl::InternalError(absl::StrCat("save_sharded_checkpoint '", dir, "': unexpected exception"));
    }
  });
  return absl::OkStatus();
}

absl::Status AsyncCheckpointer::wait() {
  absl::Status s = impl_->join();
  impl_->last = absl::OkStatus();
  return s;
}

double AsyncCheckpointer::last_staging_seconds() const { return impl_->staging_seconds; }

absl::StatusOr<TrainingState> load_sharded_checkpoint(const std::string& dir_in, nn::Module& model,
                                                      optim::Optimizer* optimizer, optim::LRScheduler* scheduler,
                                                      ProcessGroup& pg) {
  profiler::Scope prof(profiler::Kind::Checkpoint, "load_sharded_checkpoint");
  const std::string dir = normalize_dir(dir_in);
  const std::string index_path = dir + "/" + kIndexFile;
  NoGradGuard no_grad;
  try {
    // 1. Read and check everything this rank needs.
    std::string error;
    std::optional<TrainerFile> trainer;
    Tensor rng;  // this rank's generator, when the world size is the saver's
    std::vector<std::pair<Tensor, Tensor>> model_copies;  // (destination, staged)
    std::vector<std::function<void()>> before_load;       // the shard specs' hooks
    optim::OptimizerStateDict opt_sd;
    try {
    do {
      auto index = read_checkpoint_index(dir);
      if (!index.ok()) {
        error = std::string(index.status().message());
        break;
      }
      auto t = read_trainer_file(dir + "/" + kTrainerFile, optimizer, scheduler);
      if (!t.ok()) {
        error = std::string(t.status().message());
        break;
      }
      trainer = std::move(*t);
      const ModelLayout L = model_layout(model, pg);
      for (const auto& [name, p] : L.by_name)
        if (p.before_load) before_load.push_back(p.before_load);
      PieceReader reader(dir);
      if (const CheckpointTensor* g = index->find(kRngPrefix + std::to_string(pg.rank()));
          g && index->world_size == pg.size() && g->dtype == DType::Int64 && g->shape == Shape{2}) {
        rng = Tensor::empty({2}, DType::Int64);
        if (auto s = reader.read_region(*g, whole_region(g->shape), rng); !s.ok()) {
          error = std::string(s.message());
          break;
        }
      }
      const std::string saved_by = absl::StrCat(" (saved by ", index->world_size, " rank(s), ", index->layout, ")");
      // Model: every entry, whole shape and dtype as the model has them.
      for (const auto& [name, p] : L.by_name) {
        const CheckpointTensor* src = index->find(name);
        if (!src) {
          error = absl::StrCat(index_path, ": no tensor '", name, "' (the model has it)", saved_by);
          break;
        }
        if (src->shape != p.shape || src->dtype != p.local.dtype()) {
          error = absl::StrCat(index_path, ": tensor '", name, "' is ", shape_str(src->shape), " ",
                               dtype_name(src->dtype), " in the checkpoint, ", shape_str(p.shape), " ",
                               dtype_name(p.local.dtype()), " in the model");
          break;
        }
        if (!p.holds) continue;
        Tensor staged;
        if (auto s = reader.read_regions(*src, p.regions, staged); !s.ok()) {
          error = std::string(s.message());
          break;
        }
        model_copies.push_back({p.local, staged});
      }
      if (!error.empty()) break;
      for (const CheckpointTensor& t2 : index->tensors)
        if (t2.name.rfind(kOptimPrefix, 0) != 0 && t2.name.rfind(kRngPrefix, 0) != 0 && !L.anywhere.count(t2.name)) {
          error =
              absl::StrCat(index_path, ": unexpected tensor '", t2.name, "' (the model has no such entry on any rank)");
          break;
        }
      if (!error.empty() || !optimizer) break;
      // Optimizer: the saved groups (names included) with each parameter's
      // state read for the piece of the parameter this rank holds.
      // parameter name -> (state name, its tensor)
      std::map<std::string, std::vector<std::pair<std::string, const CheckpointTensor*>>> state_of;
      for (const CheckpointTensor& t2 : index->tensors)
        if (std::string param, state; split_optim_name(t2.name, &param, &state))
          state_of[param].push_back({state, &t2});
      opt_sd = *trainer->optimizer_groups;
      // This rank's optimizer may hold other parameters than rank 0's did
      // (pipeline stages): the saved groups' options, this rank's params.
      {
        optim::OptimizerStateDict mine = optimizer->groups_dict();
        optim::name_parameters(mine, *optimizer, model.named_parameters());
        if (mine.param_groups.size() != opt_sd.param_groups.size()) {
          error = absl::StrCat(dir, "/", kTrainerFile, ": the checkpoint's optimizer has ", opt_sd.param_groups.size(),
                               " parameter group(s), this one ", mine.param_groups.size());
          break;
        }
        for (size_t gi = 0; gi < mine.param_groups.size(); ++gi) {
          if (opt_sd.param_groups[gi].param_names.size() != opt_sd.param_groups[gi].params.size()) continue;
          opt_sd.param_groups[gi].params = mine.param_groups[gi].params;
          opt_sd.param_groups[gi].param_names = mine.param_groups[gi].param_names;
        }
      }
      for (const auto& g : opt_sd.param_groups) {
        if (g.param_names.size() != g.params.size()) {
          error = absl::StrCat(dir, "/", kTrainerFile, ": the optimizer groups carry no parameter names");
          break;
        }
        for (size_t k = 0; k < g.params.size() && error.empty(); ++k) {
          auto pl = L.by_name.find(g.param_names[k]);
          if (pl == L.by_name.end()) {
            error = absl::StrCat(dir, "/", kTrainerFile, ": the optimizer's parameter '", g.param_names[k],
                                 "' is not in the model");
            break;
          }
          const Place& p = pl->second;
          for (const auto& [sname, st] : state_of[p.name]) {
            Tensor staged;
            absl::Status s;
            if (st->shape.empty()) {
              staged = Tensor::empty({}, {st->dtype, kCPU});
              s = reader.read_region(*st, whole_region({}), staged);
            } else if (st->shape != p.shape) {
              s = absl::InvalidArgumentError(absl::StrCat(index_path, ": optimizer state '", st->name, "' is ",
                                                          shape_str(st->shape), ", its parameter ", shape_str(p.shape)));
            } else {
              staged = Tensor::empty({0}, {st->dtype, kCPU});
              if (p.holds) s = reader.read_regions(*st, p.regions, staged);
              if (s.ok()) staged = staged.view(p.local.sizes()).to(p.local.device());
            }
            if (!s.ok()) {
              error = std::string(s.message());
              break;
            }
            opt_sd.state.push_back({absl::StrCat("state.", g.params[k], ".", sname), staged});
          }
        }
        if (!error.empty()) break;
      }
    } while (false);
    } catch (const std::exception& e) {  // reaches the agreement below all the same
      error = e.what();
    }

    // 2. Only if every rank read everything does any rank change its state.
    if (std::string failed = agree_on_errors(pg, error); !failed.empty())
      return absl::InvalidArgumentError(absl::StrCat("load_sharded_checkpoint '", dir, "': ", failed));
    // Owners drop what they derived from the old values (FSDP's gathered
    // parameters) before anything changes, so the optimizer sees shards.
    for (const auto& f : before_load) f();
    if (optimizer) {
      try {
        optimizer->load_state_dict(optim::match_by_name(opt_sd, *optimizer, model.named_parameters()));
      } catch (const Error& e) {
        return absl::InvalidArgumentError(absl::StrCat("load_sharded_checkpoint '", dir, "': optimizer: ", e.what()));
      }
    }
    for (auto& [dst, staged] : model_copies) {
      Tensor d = dst;
      d.copy_(staged.view(dst.sizes()));
    }
    apply_trainer_file(*trainer, scheduler);  // rank 0's generator, from trainer.json
    if (rng.defined()) {
      default_generator().manual_seed(static_cast<uint64_t>(rng.data<int64_t>()[0]));
      default_generator().set_offset(static_cast<uint64_t>(rng.data<int64_t>()[1]));
    }
    return trainer->state;
  } catch (const Error& e) {
    return absl::InternalError(absl::StrCat("load_sharded_checkpoint '", dir, "': ", e.what()));
  }
}

}  // namespace ember::distributed
