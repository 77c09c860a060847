// Sharded checkpoints (sharded.h), the reading half: the index format and
// its checks (an index is untrusted input), reading pieces by byte range
// with their checksums, verify / newest_verified_checkpoint, and the load
// that reads only the pieces overlapping what each rank holds now and
// changes nothing unless every rank read everything. The save is in
// sharded_save.cc; what of the state a rank holds, in sharded_layout.cc.
// Nothing here knows FSDP: a region is a region.
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

constexpr uintmax_t kMaxIndexBytes = uintmax_t{1} << 30;

std::optional<DType> dtype_from_name(const std::string& s) {
  for (DType t : {DType::Float32, DType::Float16, DType::BFloat16, DType::Float64, DType::Int32, DType::Int64,
                  DType::UInt8, DType::Bool, DType::Float8E4M3, DType::Float8E5M2})
    if (s == safetensors_dtype_name(t)) return t;
  return std::nullopt;
}

// ---- Reading the index ----

absl::Status bad_index(const std::string& path, const std::string& m) {
  return absl::DataLossError(absl::StrCat(path, ": ", m));
}

// A non-negative integer under `k`, into *x; false when it is missing or
// not one.
bool json_size(const json& o, const char* k, int64_t* x) {
  auto it = o.find(k);
  if (it == o.end() || !it->is_number_integer() || it->get<int64_t>() < 0) return false;
  *x = it->get<int64_t>();
  return true;
}

// `n` non-negative integers under `k`, appended to *x.
bool json_sizes(const json& o, const char* k, size_t n, Shape* x) {
  auto it = o.find(k);
  if (it == o.end() || !it->is_array() || it->size() != n) return false;
  for (const json& e : *it) {
    if (!e.is_number_integer() || e.get<int64_t>() < 0) return false;
    x->push_back(e.get<int64_t>());
  }
  return true;
}

// The index's own fields: format, version, world size, layout, mesh, files.
absl::Status checked_header(const json& j, const std::string& path, CheckpointIndex* out) {
  auto bad = [&](const std::string& m) { return bad_index(path, m); };
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
  return absl::OkStatus();
}

// One piece of tensor `ct` (its shape and dtype already checked): its
// fields, its region inside the tensor, its file among the index's, its
// byte range the size of its elements. `at` names the tensor in errors.
absl::Status checked_piece(const json& p, const CheckpointTensor& ct, const CheckpointIndex& index,
                           const std::string& at, const std::string& path, CheckpointPiece* out) {
  auto bad = [&](const std::string& m) { return bad_index(path, m); };
  const bool v1 = index.version == 1;
  CheckpointPiece& cp = *out;
  int64_t b = 0, e = 0;
  auto file = p.is_object() ? p.find("file") : p.end();
  auto bytes = p.is_object() ? p.find("bytes") : p.end();
  auto hash = p.is_object() ? p.find("xxh64") : p.end();
  Region& r = cp.region;
  const bool placed = p.is_object() && (v1 ? json_size(p, "offset", &r.begin)
                                           : json_sizes(p, "offsets", ct.shape.size(), &r.box.offsets) &&
                                                 json_sizes(p, "sizes", ct.shape.size(), &r.box.lengths) &&
                                                 json_size(p, "begin", &r.begin));
  if (v1) r.box = whole_box(ct.shape);
  if (file == p.end() || !file->is_string() || !placed || !json_size(p, "numel", &r.numel) || bytes == p.end() ||
      !bytes->is_array() || bytes->size() != 2 || !(*bytes)[0].is_number_integer() ||
      !(*bytes)[1].is_number_integer() || hash == p.end() || !hash->is_string() ||
      hash->get<std::string>().size() != 16)
    return bad(at +
               (v1 ? ": a piece needs \"file\", \"offset\", \"numel\", \"bytes\" [begin, end] and a 16-digit \"xxh64\""
                   : ": a piece needs \"file\", \"offsets\" and \"sizes\" (one per dimension), \"begin\", "
                     "\"numel\", \"bytes\" [begin, end] and a 16-digit \"xxh64\""));
  cp.file = file->get<std::string>();
  try {  // inside the tensor, the run inside its box (untrusted numbers: checked before any use)
    for (size_t d = 0; d < ct.shape.size(); ++d)
      if (r.box.offsets[d] > ct.shape[d] || r.box.lengths[d] > ct.shape[d] - r.box.offsets[d]) throw Error("outside");
    int64_t box_numel = 1;
    for (int64_t l : r.box.lengths)
      if (__builtin_mul_overflow(box_numel, l, &box_numel)) throw Error("overflow");
    if (r.begin > box_numel || r.numel > box_numel - r.begin) throw Error("outside");
  } catch (const Error&) {
    return bad(absl::StrCat(at, ": piece ", r.to_string(), " lies outside the tensor ", shape_str(ct.shape)));
  }
  if (std::find(index.files.begin(), index.files.end(), cp.file) == index.files.end())
    return bad(absl::StrCat(at, ": piece ", r.to_string(), " is in '", cp.file, "', which \"files\" does not list"));
  b = (*bytes)[0].get<int64_t>(), e = (*bytes)[1].get<int64_t>();
  int64_t nbytes = 0;
  const int64_t es = static_cast<int64_t>(dtype_size(ct.dtype));
  if (b < 0 || e < b || __builtin_mul_overflow(r.numel, es, &nbytes) || e - b != nbytes)
    return bad(absl::StrCat(at, ": piece ", r.to_string(), " has ", r.numel, " elements but bytes [", b, ", ", e, ")"));
  cp.byte_begin = b, cp.byte_end = e;
  try {
    cp.xxh64 = std::stoull(hash->get<std::string>(), nullptr, 16);
  } catch (...) {
    return bad(at + ": \"xxh64\" is not hexadecimal");
  }
  return absl::OkStatus();
}

// One tensor of the index: shape (no overflow), dtype, and pieces that hold
// each of its elements exactly once.
absl::Status checked_tensor(const std::string& name, const json& t, const CheckpointIndex& index,
                            const std::string& path, CheckpointTensor* out) {
  auto bad = [&](const std::string& m) { return bad_index(path, m); };
  const std::string at = absl::StrCat("tensor '", name, "'");
  CheckpointTensor& ct = *out;
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
  std::optional<DType> dtype =
      dt != t.end() && dt->is_string() ? dtype_from_name(dt->get<std::string>()) : std::nullopt;
  if (!dtype) return bad(at + ": \"dtype\" is missing or unknown");
  ct.dtype = *dtype;
  auto pieces = t.find("pieces");
  if (pieces == t.end() || !pieces->is_array()) return bad(at + ": \"pieces\" must be an array");
  int64_t covered = 0;
  for (const json& p : *pieces) {
    CheckpointPiece cp;
    if (auto s = checked_piece(p, ct, index, at, path, &cp); !s.ok()) return s;
    const Region& r = cp.region;
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
  return absl::OkStatus();
}

}  // namespace

namespace sharded_internal {

std::string hex64(uint64_t v) {
  char b[20];
  std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(v));
  return b;
}

absl::Status checked_index(const json& j, const std::string& path, CheckpointIndex* out) {
  if (auto s = checked_header(j, path, out); !s.ok()) return s;
  auto tensors = j.find("tensors");
  if (tensors == j.end() || !tensors->is_object()) return bad_index(path, "\"tensors\" must be an object");
  for (const auto& [name, t] : tensors->items()) {
    CheckpointTensor ct;
    if (auto s = checked_tensor(name, t, *out, path, &ct); !s.ok()) return s;
    out->tensors.push_back(std::move(ct));
  }
  std::sort(out->tensors.begin(), out->tensors.end(),
            [](const CheckpointTensor& a, const CheckpointTensor& b) { return a.name < b.name; });
  return absl::OkStatus();
}

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

}  // namespace sharded_internal

namespace {

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

// What a load has read and checked before it changes anything: every
// rank reads everything first, and changes its state only once all agree.
struct StagedLoad {
  std::optional<TrainerFile> trainer;
  Tensor rng;                                           // this rank's generator, when the world size is the saver's
  std::vector<std::pair<Tensor, Tensor>> model_copies;  // (destination, staged)
  std::vector<std::function<void()>> before_load;       // the shard specs' hooks
  optim::OptimizerStateDict opt_sd;
};

// The model's entries: every one, whole shape and dtype as the model has
// them, the pieces this rank holds staged; no tensor the model lacks on
// every rank. Returns the error, or "".
std::string stage_model(const CheckpointIndex& index, const ModelLayout& L, PieceReader& reader,
                        const std::string& index_path, StagedLoad& out) {
  const std::string saved_by = absl::StrCat(" (saved by ", index.world_size, " rank(s), ", index.layout, ")");
  for (const auto& [name, p] : L.by_name) {
    const CheckpointTensor* src = index.find(name);
    if (!src) return absl::StrCat(index_path, ": no tensor '", name, "' (the model has it)", saved_by);
    if (src->shape != p.shape || src->dtype != p.local.dtype())
      return absl::StrCat(index_path, ": tensor '", name, "' is ", shape_str(src->shape), " ", dtype_name(src->dtype),
                          " in the checkpoint, ", shape_str(p.shape), " ", dtype_name(p.local.dtype()),
                          " in the model");
    if (!p.holds) continue;
    Tensor staged;
    if (auto s = reader.read_regions(*src, p.regions, staged); !s.ok()) return std::string(s.message());
    out.model_copies.push_back({p.local, staged});
  }
  for (const CheckpointTensor& t2 : index.tensors)
    if (t2.name.rfind(kOptimPrefix, 0) != 0 && t2.name.rfind(kRngPrefix, 0) != 0 && !L.anywhere.count(t2.name))
      return absl::StrCat(index_path, ": unexpected tensor '", t2.name, "' (the model has no such entry on any rank)");
  return "";
}

// The optimizer: the saved groups (names included) with each parameter's
// state read for the piece of the parameter this rank holds. Returns the
// error, or "".
std::string stage_optimizer(const CheckpointIndex& index, const ModelLayout& L, PieceReader& reader,
                            const std::string& dir, const std::string& index_path, nn::Module& model,
                            optim::Optimizer& optimizer, StagedLoad& out) {
  // parameter name -> (state name, its tensor)
  std::map<std::string, std::vector<std::pair<std::string, const CheckpointTensor*>>> state_of;
  for (const CheckpointTensor& t2 : index.tensors)
    if (std::string param, state; split_optim_name(t2.name, &param, &state)) state_of[param].push_back({state, &t2});
  optim::OptimizerStateDict& opt_sd = out.opt_sd;
  opt_sd = *out.trainer->optimizer_groups;
  // This rank's optimizer may hold other parameters than rank 0's did
  // (pipeline stages): the saved groups' options, this rank's params.
  {
    optim::OptimizerStateDict mine = optimizer.groups_dict();
    optim::name_parameters(mine, optimizer, model.named_parameters());
    if (mine.param_groups.size() != opt_sd.param_groups.size())
      return absl::StrCat(dir, "/", kTrainerFile, ": the checkpoint's optimizer has ", opt_sd.param_groups.size(),
                          " parameter group(s), this one ", mine.param_groups.size());
    for (size_t gi = 0; gi < mine.param_groups.size(); ++gi) {
      if (opt_sd.param_groups[gi].param_names.size() != opt_sd.param_groups[gi].params.size()) continue;
      opt_sd.param_groups[gi].params = mine.param_groups[gi].params;
      opt_sd.param_groups[gi].param_names = mine.param_groups[gi].param_names;
    }
  }
  for (const auto& g : opt_sd.param_groups) {
    if (g.param_names.size() != g.params.size())
      return absl::StrCat(dir, "/", kTrainerFile, ": the optimizer groups carry no parameter names");
    for (size_t k = 0; k < g.params.size(); ++k) {
      auto pl = L.by_name.find(g.param_names[k]);
      if (pl == L.by_name.end())
        return absl::StrCat(dir, "/", kTrainerFile, ": the optimizer's parameter '", g.param_names[k],
                            "' is not in the model");
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
        if (!s.ok()) return std::string(s.message());
        opt_sd.state.push_back({absl::StrCat("state.", g.params[k], ".", sname), staged});
      }
    }
  }
  return "";
}

// Reads and checks everything this rank needs into `out`, changing
// nothing. Returns the error, or "".
std::string stage_load(const std::string& dir, nn::Module& model, optim::Optimizer* optimizer,
                       optim::LRScheduler* scheduler, ProcessGroup& pg, StagedLoad& out) {
  const std::string index_path = dir + "/" + kIndexFile;
  auto index = read_checkpoint_index(dir);
  if (!index.ok()) return std::string(index.status().message());
  auto t = read_trainer_file(dir + "/" + kTrainerFile, optimizer, scheduler);
  if (!t.ok()) return std::string(t.status().message());
  out.trainer = std::move(*t);
  const ModelLayout L = model_layout(model, pg);
  for (const auto& [name, p] : L.by_name)
    if (p.before_load) out.before_load.push_back(p.before_load);
  PieceReader reader(dir);
  if (const CheckpointTensor* g = index->find(kRngPrefix + std::to_string(pg.rank()));
      g && index->world_size == pg.size() && g->dtype == DType::Int64 && g->shape == Shape{2}) {
    out.rng = Tensor::empty({2}, DType::Int64);
    if (auto s = reader.read_region(*g, whole_region(g->shape), out.rng); !s.ok()) return std::string(s.message());
  }
  if (std::string error = stage_model(*index, L, reader, index_path, out); !error.empty()) return error;
  if (!optimizer) return "";
  return stage_optimizer(*index, L, reader, dir, index_path, model, *optimizer, out);
}

}  // namespace

absl::StatusOr<TrainingState> load_sharded_checkpoint(const std::string& dir_in, nn::Module& model,
                                                      optim::Optimizer* optimizer, optim::LRScheduler* scheduler,
                                                      ProcessGroup& pg) {
  profiler::Scope prof(profiler::Kind::Checkpoint, "load_sharded_checkpoint");
  const std::string dir = normalize_dir(dir_in);
  NoGradGuard no_grad;
  try {
    // 1. Read and check everything this rank needs.
    std::string error;
    StagedLoad staged;
    try {
      error = stage_load(dir, model, optimizer, scheduler, pg, staged);
    } catch (const std::exception& e) {  // reaches the agreement below all the same
      error = e.what();
    }

    // 2. Only if every rank read everything does any rank change its state.
    if (std::string failed = agree_on_errors(pg, error); !failed.empty())
      return absl::InvalidArgumentError(absl::StrCat("load_sharded_checkpoint '", dir, "': ", failed));
    // Owners drop what they derived from the old values (FSDP's gathered
    // parameters) before anything changes, so the optimizer sees shards.
    for (const auto& f : staged.before_load) f();
    if (optimizer) {
      try {
        optimizer->load_state_dict(optim::match_by_name(staged.opt_sd, *optimizer, model.named_parameters()));
      } catch (const Error& e) {
        return absl::InvalidArgumentError(absl::StrCat("load_sharded_checkpoint '", dir, "': optimizer: ", e.what()));
      }
    }
    for (auto& [dst, copy] : staged.model_copies) {
      Tensor d = dst;
      d.copy_(copy.view(dst.sizes()));
    }
    apply_trainer_file(*staged.trainer, scheduler);  // rank 0's generator, from trainer.json
    if (staged.rng.defined()) {
      default_generator().manual_seed(static_cast<uint64_t>(staged.rng.data<int64_t>()[0]));
      default_generator().set_offset(static_cast<uint64_t>(staged.rng.data<int64_t>()[1]));
    }
    return staged.trainer->state;
  } catch (const Error& e) {
    return absl::InternalError(absl::StrCat("load_sharded_checkpoint '", dir, "': ", e.what()));
  }
}

}  // namespace ember::distributed
