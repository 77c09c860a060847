// Live recovery's state transfer (live_recovery.h): who holds step M, who
// sends to whom, the messages (a JSON header naming every tensor, then the
// tensors in that order, one send each) and the state applied.
#include "distributed/checkpoint/live_recovery.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>

#include "core/autograd_hook.h"
#include "core/exception.h"
#include "core/ops.h"
#include "distributed/sharding/shard_spec.h"

namespace ember::distributed {
namespace {

using json = nlohmann::json;

constexpr const char* kModel = "model.";
constexpr const char* kOptim = "optim.";

// What a rank holds of each of the model's tensors, by name: its shard.
std::vector<std::pair<std::string, Tensor>> model_tensors(nn::Module& model) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [name, t] : model.named_parameters()) out.emplace_back(kModel + name, local_shard(t));
  for (auto& [name, t] : model.named_buffers()) out.emplace_back(kModel + name, local_shard(t));
  return out;
}

// The messages between one sender and one receiver, in order; the tag
// numbers them (Gloo matches a send to its receive by tag and peer).
void send_state(const LiveState& st, ProcessGroup& pg, int dst, int64_t* bytes,
                std::vector<std::shared_ptr<Work>>* works, std::vector<Tensor>* keep) {
  json header = {{"step", st.step}, {"meta", st.meta}, {"extra", st.extra}, {"tensors", json::array()}};
  for (const auto& [name, t] : st.tensors) header["tensors"].push_back({name, static_cast<int>(t.dtype()), t.sizes()});
  const std::string text = header.dump();
  Tensor len = Tensor::from_vector({static_cast<double>(text.size())}, {1}, DType::Int64).to(pg.device());
  Tensor body = empty({static_cast<int64_t>(text.size())}, DType::UInt8);
  std::copy(text.begin(), text.end(), body.data<uint8_t>());
  body = body.to(pg.device());
  int tag = 0;
  auto post = [&](const Tensor& t) {
    keep->push_back(t);
    works->push_back(pg.send(t, dst, tag++));
    *bytes += static_cast<int64_t>(t.nbytes());
  };
  post(len);
  post(body);
  for (const auto& [name, t] : st.tensors) post(t.to(pg.device()).contiguous());
}

LiveState receive_state(ProcessGroup& pg, int src, int64_t* bytes) {
  int tag = 0;
  auto get = [&](Tensor t) {
    pg.recv(t, src, tag++)->wait();
    *bytes += static_cast<int64_t>(t.nbytes());
    return t.to(kCPU);
  };
  const int64_t n = static_cast<int64_t>(get(empty({1}, TensorOptions(DType::Int64, pg.device()))).item());
  Tensor body = get(empty({n}, TensorOptions(DType::UInt8, pg.device())));
  const json header = json::parse(std::string(body.data<uint8_t>(), body.data<uint8_t>() + n));
  LiveState st;
  st.step = header.at("step").get<int64_t>();
  st.meta = header.at("meta").get<std::string>();
  st.extra = header.at("extra").get<std::string>();
  for (const auto& e : header.at("tensors")) {
    const Shape shape = e.at(2).get<Shape>();
    Tensor t = empty(shape, TensorOptions(static_cast<DType>(e.at(1).get<int>()), pg.device()));
    pg.recv(t, src, tag++)->wait();
    *bytes += static_cast<int64_t>(t.nbytes());
    st.tensors.emplace_back(e.at(0).get<std::string>(), t);
  }
  return st;
}

// Writes `st` into freshly built training objects (the checkpoint load's
// order: owners drop derived copies, optimizer, model, counters).
void apply_state(const LiveState& st, nn::Module& model, optim::Optimizer& opt, optim::LRScheduler* sched,
                 optim::GradScaler* scaler, int rank) {
  std::map<std::string, Tensor> by_name(st.tensors.begin(), st.tensors.end());
  NoGradGuard no_grad;
  for (auto& [name, t] : model.named_parameters())
    if (const ShardSpec* spec = shard_spec(t); spec && spec->before_load) spec->before_load();
  optim::OptimizerStateDict sd = opt.state_dict();
  sd.state.clear();
  for (const auto& [name, t] : st.tensors)
    if (name.rfind(kOptim, 0) == 0) sd.state.emplace_back(name.substr(std::string(kOptim).size()), t);
  opt.load_state_dict(sd);
  for (auto& [name, dst] : model_tensors(model)) {
    auto it = by_name.find(name);
    EMBER_CHECK(it != by_name.end(), "live recovery: rank ", rank, ": the state received has no ", name);
    EMBER_CHECK(it->second.numel() == dst.numel(), "live recovery: rank ", rank, ": ", name, " holds ", dst.numel(),
                " elements here but ", it->second.numel(), " in the state received (another mesh or model?)");
    Tensor d = dst;
    d.copy_(it->second.view(dst.sizes()));
  }
  const json meta = json::parse(st.meta);
  if (sched && meta.contains("scheduler")) {
    const json& j = meta["scheduler"];
    sched->load_state_dict({j.at("last_epoch").get<int64_t>(), j.at("base_lrs").get<std::vector<double>>(),
                            j.at("last_lr").get<std::vector<double>>()});
    // The groups' lrs as the scheduler last set them (the optimizer's own
    // groups were built afresh, at the first step's lr).
    const auto& lr = sched->get_last_lr();
    for (size_t g = 0; g < opt.param_groups().size() && g < lr.size(); ++g) optim::set_lr(opt.param_groups()[g], lr[g]);
  }
  if (scaler && scaler->is_enabled() && meta.contains("scaler"))
    scaler->load_state_dict(meta["scaler"].get<std::map<std::string, double>>());
  if (meta.contains("rng")) {
    default_generator().manual_seed(meta["rng"].at(0).get<uint64_t>());
    default_generator().set_offset(meta["rng"].at(1).get<uint64_t>());
  }
}

}  // namespace

void StepStartBuffers::take(nn::Module& model, int64_t step) {
  if (step == step_) return;
  NoGradGuard no_grad;
  buffers_.clear();
  for (auto& [name, t] : model.named_buffers()) buffers_.emplace_back(kModel + name, local_shard(t).clone());
  step_ = step;
}

LiveState capture_live_state(nn::Module& model, const optim::Optimizer& opt, const optim::LRScheduler* sched,
                             const optim::GradScaler* scaler, int64_t step, std::string extra,
                             const StepStartBuffers* start) {
  LiveState st;
  st.step = step;
  st.extra = std::move(extra);
  st.tensors = model_tensors(model);
  if (start && start->step() == step) {
    std::map<std::string, Tensor> at_start(start->buffers().begin(), start->buffers().end());
    for (auto& [name, t] : st.tensors)
      if (auto it = at_start.find(name); it != at_start.end()) t = it->second;
  }
  for (const auto& [key, t] : opt.state_dict().state) st.tensors.emplace_back(kOptim + key, t);
  json meta = json::object();
  if (sched) {
    const optim::LRSchedulerState s = sched->state_dict();
    meta["scheduler"] = {{"last_epoch", s.last_epoch}, {"base_lrs", s.base_lrs}, {"last_lr", s.last_lr}};
  }
  if (scaler && scaler->is_enabled()) meta["scaler"] = scaler->state_dict();
  meta["rng"] = {default_generator().seed(), default_generator().offset()};
  st.meta = meta.dump();
  return st;
}

ReplicaMap replicas_along(const DeviceMesh& mesh, const std::string& dim) {
  const std::vector<int> shape = mesh.shape();
  const std::vector<int> ranks = mesh.ranks();
  const int d = mesh.has_dim(dim) ? mesh.dim_index(dim) : -1;
  // Copies only: the map may outlive the mesh. ranks() is row-major.
  return [shape, ranks, d](int rank) -> std::vector<int> {
    auto pos = std::find(ranks.begin(), ranks.end(), rank);
    EMBER_CHECK(pos != ranks.end(), "replicas_along: rank ", rank, " is not in the mesh");
    if (d < 0) return {rank};
    // Row-major coordinates of the rank, then every value along `dim`.
    std::vector<int> coord(shape.size());
    for (int64_t i = pos - ranks.begin(), k = static_cast<int64_t>(shape.size()) - 1; k >= 0; --k) {
      coord[k] = static_cast<int>(i % shape[k]);
      i /= shape[k];
    }
    std::vector<int> out;
    for (int v = 0; v < shape[d]; ++v) {
      coord[d] = v;
      int64_t index = 0;
      for (size_t k = 0; k < shape.size(); ++k) index = index * shape[k] + coord[k];
      out.push_back(ranks[index]);
    }
    return out;
  };
}

LiveRecovery recover_live_state(const LiveState* kept, nn::Module& model, optim::Optimizer& opt,
                                optim::LRScheduler* sched, optim::GradScaler* scaler, ProcessGroup& pg,
                                const ReplicaMap& replicas) {
  const auto t0 = std::chrono::steady_clock::now();
  const int rank = pg.rank(), world = pg.size();
  // Who kept what: {kept, step} from every rank.
  const bool have = kept && !kept->empty();
  Tensor mine =
      Tensor::from_vector({have ? 1.0 : 0.0, have ? static_cast<double>(kept->step) : -1.0}, {2}, DType::Int64)
          .to(pg.device());
  Tensor all = empty({2 * world}, TensorOptions(DType::Int64, pg.device()));
  pg.allgather_into_tensor(all, mine)->wait();
  all = all.to(kCPU);
  const int64_t* a = all.data<int64_t>();
  int64_t newest = -1;
  for (int r = 0; r < world; ++r)
    if (a[2 * r]) newest = std::max(newest, a[2 * r + 1]);
  EMBER_CHECK(newest >= 0, "live recovery: no rank kept its training state; resume from a checkpoint instead");
  auto current = [&](int r) { return a[2 * r] && a[2 * r + 1] == newest; };
  // Every rank computes the same plan: for each rank that needs the state,
  // the lowest replica holding step `newest`.
  std::vector<int> source(world, -1);
  for (int r = 0; r < world; ++r) {
    if (current(r)) continue;
    std::vector<int> reps = replicas(r);
    for (int q : reps)
      if (q != r && current(q)) {
        source[r] = q;
        break;
      }
    if (source[r] < 0) {
      std::string list;
      for (int q : reps) list += (list.empty() ? "" : ", ") + std::to_string(q);
      throw Error("live recovery: rank " + std::to_string(r) +
                  (a[2 * r] ? " kept step " + std::to_string(a[2 * r + 1]) : std::string(" kept no state")) +
                  " and no replica of it (ranks " + list + ") holds step " + std::to_string(newest) +
                  "; resume from a checkpoint instead");
    }
  }
  LiveRecovery out;
  out.step = newest;
  std::vector<std::shared_ptr<Work>> sends;
  std::vector<Tensor> keep;
  for (int r = 0; r < world; ++r)
    if (source[r] == rank) {
      send_state(*kept, pg, r, &out.bytes_sent, &sends, &keep);
      out.sent_to.push_back(r);
    }
  LiveState received;
  if (source[rank] >= 0) {
    out.source = source[rank];
    received = receive_state(pg, source[rank], &out.bytes_received);
  }
  for (auto& w : sends) w->wait();
  // A state that does not fit (another model or mesh) fails its checks on
  // the receiving rank only. Every rank learns of it here, in one small
  // collective, and stops at once naming that rank, instead of going on to
  // its next step's collective and waiting there for a rank that never
  // comes (until the timeout).
  std::string failure;
  const LiveState& applied = source[rank] >= 0 ? received : *kept;
  try {
    EMBER_CHECK(source[rank] < 0 || received.step == newest, "live recovery: rank ", rank, " received step ",
                received.step, " from rank ", source[rank], ", expected ", newest);
    apply_state(applied, model, opt, sched, scaler, rank);
  } catch (const std::exception& e) {
    failure = e.what();
  }
  Tensor ok = Tensor::from_vector({failure.empty() ? 1.0 : 0.0}, {1}, DType::Int64).to(pg.device());
  Tensor oks = empty({world}, TensorOptions(DType::Int64, pg.device()));
  pg.allgather_into_tensor(oks, ok)->wait();
  oks = oks.to(kCPU);
  std::string failed;
  for (int r = 0; r < world; ++r)
    if (!oks.data<int64_t>()[r]) failed += (failed.empty() ? "" : ", ") + std::to_string(r);
  if (!failure.empty()) throw Error(failure);
  if (!failed.empty())
    throw Error("live recovery: rank(s) " + failed + " could not take the training state of step " +
                std::to_string(newest) + " (each names why in its own log); resume from a checkpoint instead");
  out.extra = applied.extra;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

}  // namespace ember::distributed
