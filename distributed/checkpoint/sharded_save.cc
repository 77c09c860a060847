// Saving sharded checkpoints (sharded.h): staging what this rank holds of
// the training state (each tensor's ShardSpec read by sharded_layout.cc),
// the rank files every rank writes in parallel, the index rank 0 builds of
// them, the agreed commit (no index unless every rank wrote), and the
// AsyncCheckpointer that writes staged host copies on a thread. Kept apart
// from sharded.cc (the index format, reading and loading) because a save and
// a load share only the format, which sharded_internal.h names.
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>
#include <unordered_set>

#include "absl/strings/str_cat.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "core/safetensors.h"
#include "distributed/checkpoint/checkpoint_internal.h"
#include "distributed/checkpoint/sharded.h"
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

Tensor generator_state() {
  Tensor t = Tensor::empty({2}, DType::Int64);
  t.data<int64_t>()[0] = static_cast<int64_t>(default_generator().seed());
  t.data<int64_t>()[1] = static_cast<int64_t>(default_generator().offset());
  return t;
}

std::string rank_file(int r) {
  char b[40];
  std::snprintf(b, sizeof b, "rank-%05d.safetensors", r);
  return b;
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
        return absl::InternalError(absl::StrCat(where, ": ranks disagree on tensor '", name,
                                                "': ", (*it)["shape"].dump(), " ", (*it)["dtype"].dump(), " vs ",
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
      if (!t.ok())
        out.error = std::string(t.status().message());
      else
        out.trainer = *t;
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
      if (error.empty()) checkpoint_internal::claim_tmp_dir(tmp);
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
      if (!r.ok())
        error = std::string(r.status().message());
      else
        records = std::move(*r);
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
      return absl::InternalError(
          absl::StrCat(where, ": ", failed, " (nothing committed; the previous checkpoint stays)"));
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
    // Committed and agreed: rank 0 removes what saves killed earlier left,
    // with no rank waiting on it in a collective.
    if (rank == 0) remove_dead_tmp_dirs(dir);
    return absl::OkStatus();
  } catch (const std::exception& e) {  // a collective failed: a rank died or timed out
    remove_tmp();
    return absl::InternalError(absl::StrCat(where, ": ", e.what()));
  }
}

absl::Status check_save_args(const std::string& dir, const ShardedSaveOptions& options) {
  if (dir.empty() || dir == "/")
    return absl::InvalidArgumentError("save_sharded_checkpoint: empty checkpoint directory");
  if (options.max_piece_bytes < 1)
    return absl::InvalidArgumentError("save_sharded_checkpoint: max_piece_bytes must be >= 1");
  return absl::OkStatus();
}

}  // namespace

absl::Status save_sharded_checkpoint(const std::string& dir_in, nn::Module& model, optim::Optimizer* optimizer,
                                     const optim::LRScheduler* scheduler, const TrainingState& state, ProcessGroup& pg,
                                     const ShardedSaveOptions& options) {
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
  std::string dir;    // of the save in flight or last done
  absl::Status last;  // its outcome, once joined
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
}  // namespace ember::distributed
