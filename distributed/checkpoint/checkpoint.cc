// Training checkpoints: the directory layout of checkpoint.h, the atomic
// tmp-dir + fsync + rename protocol, and loading that checks everything
// before it changes anything.
#include "distributed/checkpoint/checkpoint.h"
#include "distributed/checkpoint/checkpoint_internal.h"

#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "core/json_limits.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "core/safetensors.h"

namespace ember::distributed {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace testing {
namespace {
CheckpointSaveHooks& hooks() {
  static CheckpointSaveHooks h;
  return h;
}
}  // namespace
void set_checkpoint_save_hooks(CheckpointSaveHooks h) { hooks() = std::move(h); }
}  // namespace testing

namespace checkpoint_internal {

constexpr const char* kFormat = "ember-checkpoint";
constexpr int64_t kVersion = 1;
constexpr const char* kModelFile = "model.safetensors";
constexpr const char* kOptimizerFile = "optimizer.safetensors";
constexpr uintmax_t kMaxTrainerJsonBytes = 64 << 20;

void stage(const char* name, const std::string& dir) {
  if (testing::hooks().at_stage) testing::hooks().at_stage(name, dir);
}

// "ckpt/epoch_3/" and "ckpt/epoch_3" are one checkpoint; the suffixes
// ".tmp-<pid>" must attach to the name, not follow a slash.
std::string normalize_dir(std::string d) {
  while (d.size() > 1 && d.back() == '/') d.pop_back();
  return d;
}

absl::Status errno_status(const std::string& what, int err) {
  return absl::InternalError(absl::StrCat(what, ": ", std::strerror(err)));
}

absl::Status fsync_dir(const std::string& dir) {
  int fd = ::open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return errno_status(absl::StrCat("save_checkpoint: opening directory '", dir, "'"), errno);
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return errno_status(absl::StrCat("save_checkpoint: fsync of directory '", dir, "'"), err);
  return absl::OkStatus();
}

absl::Status write_file_synced(const std::string& path, const std::string& content) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return errno_status(absl::StrCat("save_checkpoint: creating '", path, "'"), errno);
  const char* p = content.data();
  size_t n = content.size();
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) {
      const int err = errno;
      ::close(fd);
      return errno_status(absl::StrCat("save_checkpoint: writing '", path, "'"), err);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0) {
    const int err = errno;
    ::close(fd);
    return errno_status(absl::StrCat("save_checkpoint: fsync of '", path, "'"), err);
  }
  if (::close(fd) != 0) return errno_status(absl::StrCat("save_checkpoint: closing '", path, "'"), errno);
  return absl::OkStatus();
}

// JSON has no inf/nan; hyperparameters may (e.g. max_norm = inf).
json number_to_json(double v) {
  if (std::isnan(v)) return "nan";
  if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
  return v;  // nlohmann prints the shortest text that parses back to v exactly
}

bool json_to_number(const json& j, double* out) {
  if (j.is_number()) {
    *out = j.get<double>();
    return true;
  }
  if (!j.is_string()) return false;
  const std::string s = j.get<std::string>();
  if (s == "nan") *out = std::numeric_limits<double>::quiet_NaN();
  else if (s == "inf") *out = std::numeric_limits<double>::infinity();
  else if (s == "-inf") *out = -std::numeric_limits<double>::infinity();
  else return false;
  return true;
}

// The update rule a checkpoint records: "AdamW" also for a wrapper such as
// "ZeroRedundancyOptimizer(AdamW)", whose state it saves in AdamW's format,
// so the state loads into either.
std::string algorithm_name(const std::string& name) {
  const size_t open = name.find('(');
  return open != std::string::npos && name.back() == ')' ? name.substr(open + 1, name.size() - open - 2) : name;
}

json trainer_json(const nn::Module&, const optim::Optimizer* optimizer, const optim::LRScheduler* scheduler,
                  const TrainingState& state, json extra, const optim::OptimizerStateDict* opt_sd) {
  json j = json::object();
  j["format"] = kFormat;
  j["version"] = kVersion;
  if (optimizer) {
    json groups = json::array();
    for (const auto& g : opt_sd->param_groups) {
      json options = json::object();
      for (const auto& [k, v] : g.options) options[k] = number_to_json(v);
      json group = json::object();
      group["options"] = std::move(options);
      group["params"] = g.params;
      if (!g.param_names.empty()) group["param_names"] = g.param_names;
      groups.push_back(std::move(group));
    }
    j["optimizer"] = {{"name", algorithm_name(optimizer->name())}, {"param_groups", std::move(groups)}};
  } else {
    j["optimizer"] = nullptr;
  }
  if (scheduler) {
    const optim::LRSchedulerState s = scheduler->state_dict();
    json base = json::array(), last = json::array();
    for (double v : s.base_lrs) base.push_back(number_to_json(v));
    for (double v : s.last_lr) last.push_back(number_to_json(v));
    j["scheduler"] = {{"last_epoch", s.last_epoch}, {"base_lrs", std::move(base)}, {"last_lr", std::move(last)}};
  } else {
    j["scheduler"] = nullptr;
  }
  j["epoch"] = state.epoch;
  j["step"] = state.step;
  j["rng"] = {{"seed", default_generator().seed()}, {"offset", default_generator().offset()}};
  j["extra"] = std::move(extra);
  return j;
}

absl::StatusOr<json> read_json_file(const std::string& path, uintmax_t max_bytes, const std::string& missing_hint) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    std::error_code ec;
    if (!fs::exists(path, ec)) return absl::NotFoundError(absl::StrCat(path, ": missing file", missing_hint));
    return absl::InternalError(absl::StrCat(path, ": cannot open: ", std::strerror(errno)));
  }
  std::error_code size_ec;
  const uintmax_t size = fs::file_size(path, size_ec);
  if (!size_ec && size > max_bytes)
    return absl::DataLossError(absl::StrCat(path, ": ", size, " bytes, more than the ", max_bytes, " a ",
                                            fs::path(path).filename().string(),
                                            " may have (not a checkpoint ember wrote?)"));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = std::move(ss).str();
  if (const std::string deep = json_depth_error(text); !deep.empty())
    return absl::DataLossError(absl::StrCat(path, ": invalid JSON: ", deep));
  try {
    return json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(path, ": invalid JSON (truncated or corrupted file?): ", e.what()));
  }
}

// Reads and checks trainer.json's envelope; errors name the file.
absl::StatusOr<json> read_trainer_json(const std::string& path) {
  // trainer.json holds a few KB of fields: a file far larger than any ember
  // writes is refused before it is read.
  auto parsed = read_json_file(path, kMaxTrainerJsonBytes);
  if (!parsed.ok()) return parsed.status();
  const json& j = *parsed;
  if (!j.is_object()) return absl::DataLossError(absl::StrCat(path, ": not a JSON object"));
  auto f = j.find("format");
  if (f == j.end() || !f->is_string() || f->get<std::string>() != kFormat)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": \"format\" is ", f == j.end() ? "missing" : f->dump(), ", expected \"", kFormat, "\""));
  auto v = j.find("version");
  if (v == j.end() || !v->is_number_integer())
    return absl::InvalidArgumentError(absl::StrCat(path, ": \"version\" is missing or not an integer"));
  if (v->get<int64_t>() != kVersion)
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": version ", v->get<int64_t>(), " is not supported (this ember reads version ", kVersion, ")"));
  return j;
}

// Field access that turns a wrong type into an error naming file and field.
struct Fields {
  const std::string& path;
  absl::Status status = absl::OkStatus();

  const json* get(const json& obj, const char* key, const char* what) {
    auto it = obj.find(key);
    if (it == obj.end()) {
      fail(absl::StrCat("missing \"", key, "\" (", what, ")"));
      return nullptr;
    }
    return &*it;
  }
  void fail(const std::string& msg) {
    if (status.ok()) status = absl::DataLossError(absl::StrCat(path, ": ", msg));
  }
  int64_t integer(const json& obj, const char* key) {
    const json* v = get(obj, key, "an integer");
    if (v && v->is_number_integer()) return v->get<int64_t>();
    if (v) fail(absl::StrCat("\"", key, "\" is not an integer"));
    return 0;
  }
  // A count of epochs or steps: an integer >= 0 (a negative epoch would make
  // training resume "before" the checkpoint and overwrite it).
  int64_t count(const json& obj, const char* key) {
    const int64_t v = integer(obj, key);
    if (status.ok() && v < 0) fail(absl::StrCat("\"", key, "\" is ", v, "; it counts, so it must be >= 0"));
    return v;
  }
  uint64_t unsigned_integer(const json& obj, const char* key) {
    const json* v = get(obj, key, "a non-negative integer");
    if (v && v->is_number_unsigned()) return v->get<uint64_t>();
    if (v) fail(absl::StrCat("\"", key, "\" is not a non-negative integer"));
    return 0;
  }
  std::vector<double> numbers(const json& obj, const char* key) {
    std::vector<double> out;
    const json* v = get(obj, key, "an array of numbers");
    if (!v) return out;
    if (!v->is_array()) fail(absl::StrCat("\"", key, "\" is not an array"));
    else
      for (const json& e : *v) {
        double d;
        if (!json_to_number(e, &d)) fail(absl::StrCat("\"", key, "\" holds a non-number ", e.dump()));
        out.push_back(d);
      }
    return out;
  }
};

absl::StatusOr<optim::OptimizerStateDict> parse_optimizer(const json& o, const std::string& path,
                                                          const std::string& expected_name) {
  Fields f{path};
  if (!o.is_object()) return absl::DataLossError(absl::StrCat(path, ": \"optimizer\" is not an object"));
  const json* name = f.get(o, "name", "the optimizer's type");
  if (name && (!name->is_string() || name->get<std::string>() != expected_name))
    return absl::InvalidArgumentError(absl::StrCat(path, ": the checkpoint's optimizer is ", name->dump(),
                                                   ", the optimizer given is ", expected_name));
  const json* groups = f.get(o, "param_groups", "an array");
  if (!f.status.ok()) return f.status;
  if (!groups->is_array()) return absl::DataLossError(absl::StrCat(path, ": \"param_groups\" is not an array"));
  optim::OptimizerStateDict sd;
  for (size_t gi = 0; gi < groups->size(); ++gi) {
    const json& g = (*groups)[gi];
    const std::string at = absl::StrCat(path, ": param_groups[", gi, "]");
    auto opts = g.is_object() ? g.find("options") : g.end();
    auto params = g.is_object() ? g.find("params") : g.end();
    if (!g.is_object() || opts == g.end() || !opts->is_object() || params == g.end() || !params->is_array())
      return absl::DataLossError(absl::StrCat(at, " needs an \"options\" object and a \"params\" array"));
    optim::OptimizerStateDict::Group out;
    for (const auto& [k, v] : opts->items()) {
      double d;
      if (!json_to_number(v, &d)) return absl::DataLossError(absl::StrCat(at, ": option '", k, "' is not a number"));
      out.options[k] = d;
    }
    for (const json& p : *params) {
      if (!p.is_number_integer()) return absl::DataLossError(absl::StrCat(at, ": \"params\" holds a non-integer"));
      out.params.push_back(p.get<int64_t>());
    }
    // Optional (checkpoints before names, or written by hand): positional.
    if (auto names = g.find("param_names"); names != g.end()) {
      if (!names->is_array() || names->size() != out.params.size())
        return absl::DataLossError(absl::StrCat(at, ": \"param_names\" must be an array of ", out.params.size(),
                                                " strings, one per entry of \"params\""));
      for (const json& n : *names) {
        if (!n.is_string()) return absl::DataLossError(absl::StrCat(at, ": \"param_names\" holds a non-string"));
        out.param_names.push_back(n.get<std::string>());
      }
    }
    sd.param_groups.push_back(std::move(out));
  }
  return sd;
}

absl::Status check_model_state(const SafetensorsFile& file, const nn::Module& model, const std::string& path) {
  const nn::StateDict mine = model.state_dict();
  for (const auto& [k, t] : mine) {
    const Tensor* src = file.find(k);
    if (!src) return absl::InvalidArgumentError(absl::StrCat(path, ": missing tensor '", k, "' (the model has it)"));
    if (src->sizes() != t.sizes())
      return absl::InvalidArgumentError(absl::StrCat(path, ": tensor '", k, "' has shape ", shape_str(src->sizes()),
                                                     " in the checkpoint, ", shape_str(t.sizes()), " in the model"));
  }
  for (const auto& [k, t] : file.tensors)
    if (!mine.contains(k))
      return absl::InvalidArgumentError(absl::StrCat(path, ": unexpected tensor '", k, "' (the model has no such entry)"));
  return absl::OkStatus();
}

// Swaps two paths atomically; false (errno set) where unsupported.
bool rename_exchange(const std::string& a, const std::string& b) {
  if (testing::hooks().no_rename_exchange) {
    errno = EINVAL;
    return false;
  }
  return ::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0;
}

// The body of save_checkpoint once the JSON is built; ember::Error and
// filesystem errors propagate as exceptions to the caller's handler.
absl::Status write_checkpoint(const std::string& dir, const std::vector<std::pair<std::string, Tensor>>& model_items,
                              const std::vector<std::pair<std::string, Tensor>>* optimizer_items,
                              const std::string& trainer) {
  const fs::path parent = fs::path(dir).parent_path();
  if (!parent.empty()) fs::create_directories(parent);
  const std::string tmp = dir + ".tmp-" + std::to_string(::getpid());
  fs::remove_all(tmp);  // a leftover of an earlier crashed process with our pid
  fs::create_directory(tmp);
  claim_tmp_dir(tmp);
  auto fail = [&](absl::Status s) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    return s;
  };
  const std::map<std::string, std::string> meta = {{"format", "pt"}};
  if (auto s = save_safetensors(tmp + "/" + kModelFile, model_items, meta); !s.ok()) return fail(s);
  stage("model_written", dir);
  if (optimizer_items)
    if (auto s = save_safetensors(tmp + "/" + kOptimizerFile, *optimizer_items, meta); !s.ok()) return fail(s);
  // trainer.json last: its presence marks the directory complete.
  if (auto s = write_file_synced(tmp + "/" + kTrainerFile, trainer); !s.ok()) return fail(s);
  if (auto s = fsync_dir(tmp); !s.ok()) return fail(s);
  stage("tmp_complete", dir);
  absl::Status committed = commit_dir(tmp, dir);
  // Once this save is committed, the directories of saves killed earlier go.
  if (committed.ok()) remove_dead_tmp_dirs(dir);
  return committed;
}

absl::Status commit_dir(const std::string& tmp, const std::string& dir) {
  const std::string pid = std::to_string(::getpid());
  auto fail = [&](absl::Status s) {
    std::error_code ec;
    fs::remove_all(tmp, ec);
    return s;
  };
  const std::string parent_str = fs::path(dir).parent_path().string();
  std::error_code ec;
  unclaim_tmp_dir(tmp);  // the checkpoint does not carry it
  if (fs::exists(dir, ec)) {
    if (rename_exchange(tmp, dir)) {
      // <dir> is the new checkpoint; tmp holds the previous one.
      if (auto s = fsync_dir(parent_str); !s.ok()) return s;
      stage("exchanged", dir);
      fs::remove_all(tmp, ec);
      return absl::OkStatus();
    }
    // No RENAME_EXCHANGE on this filesystem: move the old one aside first.
    const std::string old = dir + ".old-" + pid;
    fs::remove_all(old);
    if (::rename(dir.c_str(), old.c_str()) != 0)
      return fail(errno_status(absl::StrCat("save_checkpoint: renaming '", dir, "' to '", old, "'"), errno));
    stage("old_moved_aside", dir);
    if (::rename(tmp.c_str(), dir.c_str()) != 0) {
      const absl::Status s = errno_status(absl::StrCat("save_checkpoint: renaming '", tmp, "' to '", dir, "'"), errno);
      ::rename(old.c_str(), dir.c_str());  // put the previous one back
      return fail(s);
    }
    if (auto s = fsync_dir(parent_str); !s.ok()) return s;
    stage("renamed", dir);
    fs::remove_all(old, ec);
    return absl::OkStatus();
  }
  if (::rename(tmp.c_str(), dir.c_str()) != 0)
    return fail(errno_status(absl::StrCat("save_checkpoint: renaming '", tmp, "' to '", dir, "'"), errno));
  if (auto s = fsync_dir(parent_str); !s.ok()) return s;
  stage("renamed", dir);
  return absl::OkStatus();
}

absl::StatusOr<std::string> trainer_text(const nn::Module& model, const optim::Optimizer* optimizer,
                                         const optim::LRScheduler* scheduler, const TrainingState& state,
                                         const std::vector<std::vector<std::string>>* group_names) {
  if (state.epoch < 0 || state.step < 0)
    return absl::InvalidArgumentError(absl::StrCat("save_checkpoint: epoch ", state.epoch, " and step ", state.step,
                                                   " must be >= 0"));
  json extra;
  if (const std::string deep = json_depth_error(state.extra_json); !deep.empty())
    return absl::InvalidArgumentError(absl::StrCat("save_checkpoint: extra_json: ", deep));
  try {
    extra = json::parse(state.extra_json.empty() ? std::string("{}") : state.extra_json);
  } catch (const nlohmann::json::exception& e) {
    return absl::InvalidArgumentError(absl::StrCat("save_checkpoint: extra_json is not valid JSON: ", e.what()));
  }
  if (!extra.is_object()) return absl::InvalidArgumentError("save_checkpoint: extra_json must be a JSON object");
  std::optional<optim::OptimizerStateDict> opt_sd;
  if (optimizer) {
    opt_sd = optimizer->groups_dict();  // the state itself goes to the tensor files
    optim::name_parameters(*opt_sd, *optimizer, model.named_parameters());
    if (group_names && group_names->size() == opt_sd->param_groups.size()) {
      int64_t next = 0;  // indices numbered across the groups, as torch's
      for (size_t g = 0; g < group_names->size(); ++g) {
        auto& group = opt_sd->param_groups[g];
        group.param_names = (*group_names)[g];
        group.params.clear();
        for (size_t k = 0; k < group.param_names.size(); ++k) group.params.push_back(next++);
      }
    }
  }
  return trainer_json(model, optimizer, scheduler, state, std::move(extra), opt_sd ? &*opt_sd : nullptr).dump(2) + "\n";
}

absl::StatusOr<TrainerFile> read_trainer_file(const std::string& trainer_path, const optim::Optimizer* optimizer,
                                              const optim::LRScheduler* scheduler) {
  auto trainer = read_trainer_json(trainer_path);
  if (!trainer.ok()) return trainer.status();
  const json& j = *trainer;
  TrainerFile out;
  TrainingState& st = out.state;
  Fields f{trainer_path};
  st.epoch = f.count(j, "epoch");
  st.step = f.count(j, "step");
  const json* rng = f.get(j, "rng", "an object with seed and offset");
  if (rng && !rng->is_object()) f.fail("\"rng\" is not an object");
  if (rng && rng->is_object()) {
    st.rng_seed = f.unsigned_integer(*rng, "seed");
    st.rng_offset = f.unsigned_integer(*rng, "offset");
  }
  const json* extra = f.get(j, "extra", "an object");
  if (extra && !extra->is_object()) f.fail("\"extra\" is not an object");
  const json* opt_j = f.get(j, "optimizer", "an object or null");
  const json* sched_j = f.get(j, "scheduler", "an object or null");
  if (!f.status.ok()) return f.status;
  st.extra_json = extra->dump();
  if (optimizer) {
    if (opt_j->is_null())
      return absl::InvalidArgumentError(absl::StrCat(trainer_path, ": the checkpoint holds no optimizer state"));
    auto sd = parse_optimizer(*opt_j, trainer_path, algorithm_name(optimizer->name()));
    if (!sd.ok()) return sd.status();
    out.optimizer_groups = std::move(*sd);
  }
  if (scheduler) {
    if (sched_j->is_null())
      return absl::InvalidArgumentError(absl::StrCat(trainer_path, ": the checkpoint holds no scheduler state"));
    if (!sched_j->is_object()) return absl::DataLossError(absl::StrCat(trainer_path, ": \"scheduler\" is not an object"));
    optim::LRSchedulerState sched_state;
    sched_state.last_epoch = f.integer(*sched_j, "last_epoch");
    sched_state.base_lrs = f.numbers(*sched_j, "base_lrs");
    sched_state.last_lr = f.numbers(*sched_j, "last_lr");
    if (!f.status.ok()) return f.status;
    const size_t groups = scheduler->optimizer().param_groups().size();
    if (sched_state.base_lrs.size() != groups || sched_state.last_lr.size() != groups || sched_state.last_epoch < 0)
      return absl::InvalidArgumentError(absl::StrCat(
          trainer_path, ": the scheduler state has ", sched_state.base_lrs.size(), " base_lrs, ",
          sched_state.last_lr.size(), " last_lr and last_epoch ", sched_state.last_epoch, "; the scheduler's optimizer has ",
          groups, " parameter groups"));
    out.scheduler_state = std::move(sched_state);
  }
  return out;
}

void apply_trainer_file(const TrainerFile& t, optim::LRScheduler* scheduler) {
  if (scheduler && t.scheduler_state) scheduler->load_state_dict(*t.scheduler_state);
  default_generator().manual_seed(t.state.rng_seed);
  default_generator().set_offset(t.state.rng_offset);
}

}  // namespace checkpoint_internal

using namespace checkpoint_internal;

absl::Status save_checkpoint(const std::string& dir_in, const nn::Module& model, const optim::Optimizer* optimizer,
                             const optim::LRScheduler* scheduler, const TrainingState& state) {
  profiler::Scope prof(profiler::Kind::Checkpoint, "save_checkpoint");
  const std::string dir = normalize_dir(dir_in);
  if (dir.empty() || dir == "/") return absl::InvalidArgumentError("save_checkpoint: empty checkpoint directory");
  try {
    auto trainer = trainer_text(model, optimizer, scheduler, state);
    if (!trainer.ok()) return trainer.status();
    const nn::StateDict model_sd = model.state_dict();
    std::optional<optim::OptimizerStateDict> opt_sd;
    if (optimizer) opt_sd = optimizer->state_dict();
    return write_checkpoint(dir, model_sd.items(), opt_sd ? &opt_sd->state : nullptr, *trainer);
  } catch (const Error& e) {
    return absl::InternalError(absl::StrCat("save_checkpoint '", dir, "': ", e.what()));
  } catch (const fs::filesystem_error& e) {
    return absl::InternalError(absl::StrCat("save_checkpoint '", dir, "': ", e.what()));
  }
}

absl::StatusOr<TrainingState> load_checkpoint(const std::string& dir_in, nn::Module& model,
                                              optim::Optimizer* optimizer, optim::LRScheduler* scheduler) {
  profiler::Scope prof(profiler::Kind::Checkpoint, "load_checkpoint");
  const std::string dir = normalize_dir(dir_in);
  std::error_code ec;
  if (!fs::is_directory(dir, ec))
    return absl::NotFoundError(absl::StrCat("load_checkpoint: '", dir, "' is not a checkpoint directory"));
  const std::string trainer_path = dir + "/" + kTrainerFile;
  auto trainer = read_trainer_file(trainer_path, optimizer, scheduler);
  if (!trainer.ok()) return trainer.status();

  // 1. Read and check everything.
  const std::string model_path = dir + "/" + kModelFile;
  auto model_file = load_safetensors(model_path);
  if (!model_file.ok()) return model_file.status();
  try {
    if (auto s = check_model_state(*model_file, model, model_path); !s.ok()) return s;
  } catch (const Error& e) {
    return absl::InternalError(absl::StrCat(model_path, ": ", e.what()));
  }

  std::optional<optim::OptimizerStateDict> opt_sd;
  const std::string opt_path = dir + "/" + kOptimizerFile;
  if (optimizer) {
    auto opt_file = load_safetensors(opt_path);
    if (!opt_file.ok()) return opt_file.status();
    opt_sd = std::move(*trainer->optimizer_groups);
    opt_sd->state = std::move(opt_file->tensors);
  }

  // 2. Apply. The optimizer checks all its entries before changing any, so
  // it goes first; the model's names and shapes were checked above.
  if (optimizer) {
    try {
      optimizer->load_state_dict(optim::match_by_name(*opt_sd, *optimizer, model.named_parameters()));
    } catch (const Error& e) {
      return absl::InvalidArgumentError(absl::StrCat(opt_path, " (with ", trainer_path, "): ", e.what()));
    }
  }
  try {
    nn::StateDict sd;
    for (const auto& [k, t] : model_file->tensors) sd.insert(k, t);
    model.load_state_dict(sd, /*strict=*/true);
    apply_trainer_file(*trainer, scheduler);
  } catch (const Error& e) {
    return absl::InternalError(absl::StrCat("load_checkpoint '", dir, "': ", e.what()));
  }
  return trainer->state;
}

absl::StatusOr<std::optional<std::string>> latest_checkpoint(
    const std::string& root, const std::string& prefix, bool fall_back, std::vector<std::string>* skipped,
    const std::function<absl::Status(const std::string& dir)>& verify) {
  std::error_code ec;
  std::vector<std::pair<int64_t, fs::path>> found;
  for (fs::directory_iterator it(root, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) continue;
    const std::string digits = name.substr(prefix.size());
    // Only "<prefix><N>": this skips "<prefix>N.tmp-<pid>" and "<prefix>N.old-<pid>".
    if (digits.size() > 18 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    std::error_code dec;
    if (!it->is_directory(dec)) continue;
    found.emplace_back(std::stoll(digits), it->path());
  }
  std::sort(found.begin(), found.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [n, path] : found) {
    // What a load would trip over first, without reading any tensor: the
    // trainer file, and the headers and sizes of the tensor files it needs
    // (a truncated model file is damage found here, where a fallback can
    // still skip it, not halfway through a load).
    auto trainer = read_trainer_json((path / kTrainerFile).string());
    absl::Status st = trainer.status();
    std::error_code fec;
    const fs::path& dir = path;  // a structured binding cannot be captured before C++20 compilers caught up
    auto check_tensors = [&](const char* file) {
      if (!st.ok()) return;
      if (!fs::is_regular_file(dir / file, fec))
        st = absl::NotFoundError(absl::StrCat((dir / file).string(), ": missing file"));
      else
        st = check_safetensors_file((dir / file).string());
    };
    if (fs::is_regular_file(dir / "index.json", fec)) {
      // A sharded checkpoint (sharded.h): the rank files its index names.
      if (st.ok()) {
        auto parsed = read_json_file((dir / "index.json").string(), uintmax_t{1} << 30);
        const json index = parsed.ok() ? *parsed : json();
        if (!parsed.ok())
          st = parsed.status();
        else if (!index.is_object() || index.value("format", "") != "ember-sharded-checkpoint" ||
                 !index.contains("files") || !index["files"].is_array())
          st = absl::DataLossError(absl::StrCat((dir / "index.json").string(),
                                                ": not an ember sharded checkpoint index (format, files)"));
        else
          for (const json& f : index["files"]) {
            if (!f.is_string() || f.get<std::string>().find('/') != std::string::npos) continue;
            check_tensors(f.get<std::string>().c_str());
          }
      }
    } else if (st.ok() && fs::is_regular_file(dir / "rank-00000.safetensors", fec)) {
      // Rank files without their index: a sharded checkpoint that lost it,
      // not a single-file one missing its model.
      st = absl::NotFoundError(absl::StrCat((dir / "index.json").string(),
                                            ": missing file (the directory holds a sharded checkpoint's rank files)"));
    } else {
      check_tensors(kModelFile);
      if (st.ok() && trainer->contains("optimizer") && !(*trainer)["optimizer"].is_null()) check_tensors(kOptimizerFile);
    }
    if (st.ok() && verify) st = verify(path.string());
    if (st.ok()) return std::optional<std::string>(path.string());
    if (!fall_back)
      return absl::DataLossError(absl::StrCat("the newest checkpoint ", path.string(),
                                              " is damaged and was left untouched: ", st.message(),
                                              " (repair or remove it, or fall back to the previous checkpoint)"));
    if (skipped) skipped->push_back(absl::StrCat(path.string(), " (", st.message(), ")"));
  }
  return std::optional<std::string>();
}

}  // namespace ember::distributed
