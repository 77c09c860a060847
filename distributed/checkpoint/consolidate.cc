// consolidate_checkpoint (sharded.h): a sharded checkpoint read whole and
// written as one process's, with PyTorch's names, for load_checkpoint and
// torch's load_state_dict.
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "core/safetensors.h"
#include "distributed/checkpoint/checkpoint_internal.h"
#include "distributed/checkpoint/sharded.h"
#include "distributed/checkpoint/sharded_internal.h"

namespace ember::distributed {
namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using namespace checkpoint_internal;
using namespace sharded_internal;

absl::Status consolidate_checkpoint(const std::string& dir_in, const std::string& out_in) {
  const std::string dir = normalize_dir(dir_in), out = normalize_dir(out_in);
  auto index = read_checkpoint_index(dir);
  if (!index.ok()) return index.status();
  const std::string trainer_path = dir + "/" + kTrainerFile;
  std::string trainer;
  {
    std::ifstream in(trainer_path, std::ios::binary);
    if (!in) return absl::NotFoundError(absl::StrCat(trainer_path, ": missing file"));
    std::stringstream ss;
    ss << in.rdbuf();
    trainer = std::move(ss).str();
  }
  // Optimizer state keyed by the saved parameter indices: "optim.state.<name>.<s>" -> "state.<index>.<s>".
  std::map<std::string, int64_t> index_of;
  try {
    const json j = json::parse(trainer);
    const json& o = j.at("optimizer");
    if (!o.is_null())
      for (const json& g : o.at("param_groups")) {
        const json& ids = g.at("params");
        const json& names = g.at("param_names");
        for (size_t k = 0; k < ids.size(); ++k) index_of[names.at(k).get<std::string>()] = ids.at(k).get<int64_t>();
      }
  } catch (const nlohmann::json::exception& e) {
    return absl::DataLossError(absl::StrCat(trainer_path, ": no optimizer parameter groups with names: ", e.what()));
  }
  std::vector<std::pair<std::string, Tensor>> model_items, opt_items;
  for (const CheckpointTensor& t : index->tensors) {
    auto v = read_checkpoint_tensor(dir, t);
    if (!v.ok()) return v.status();
    if (t.name.rfind(kRngPrefix, 0) == 0) continue;  // per-rank generators: trainer.json has rank 0's
    if (t.name.rfind(kOptimPrefix, 0) != 0) {
      model_items.push_back({t.name, *v});
      continue;
    }
    std::string param, state;
    const bool named = split_optim_name(t.name, &param, &state);
    auto it = named ? index_of.find(param) : index_of.end();
    if (it == index_of.end())
      return absl::DataLossError(
          absl::StrCat(dir, ": optimizer state '", t.name, "' belongs to no parameter of ", trainer_path, "'s groups"));
    opt_items.push_back({absl::StrCat("state.", it->second, ".", state), *v});
  }
  std::sort(opt_items.begin(), opt_items.end(), [](const auto& a, const auto& b) {
    const int64_t ia = std::stoll(a.first.substr(6)), ib = std::stoll(b.first.substr(6));
    return ia != ib ? ia < ib : a.first < b.first;
  });
  try {
    const fs::path parent = fs::path(out).parent_path();
    if (!parent.empty()) fs::create_directories(parent);
    const std::string tmp = out + ".tmp-" + std::to_string(::getpid());
    fs::remove_all(tmp);
    fs::create_directories(tmp);
    checkpoint_internal::claim_tmp_dir(tmp);
    const std::map<std::string, std::string> meta = {{"format", "pt"}};
    absl::Status s = save_safetensors(tmp + "/model.safetensors", model_items, meta);
    if (s.ok() && !index_of.empty()) s = save_safetensors(tmp + "/optimizer.safetensors", opt_items, meta);
    if (s.ok()) s = write_file_synced(tmp + "/" + kTrainerFile, trainer);
    if (s.ok()) s = fsync_dir(tmp);
    if (!s.ok()) {
      fs::remove_all(tmp);
      return s;
    }
    s = commit_dir(tmp, out);
    if (s.ok()) remove_dead_tmp_dirs(out);
    return s;
  } catch (const fs::filesystem_error& e) {
    return absl::InternalError(absl::StrCat("consolidate '", dir, "' into '", out, "': ", e.what()));
  }
}

}  // namespace ember::distributed
