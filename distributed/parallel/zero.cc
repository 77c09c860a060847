// ZeroRedundancyOptimizer: building the sharded layout (one FlatBuffer per
// group, dtype and device; the local optimizer over this rank's pieces), the
// step (local step, then in-place all-gathers), and the state dict's two
// directions (consolidate the shards onto one rank; cut a full state dict
// down to this rank's shard). See zero.h.
#include "distributed/parallel/zero.h"

#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "autograd/autograd.h"
#include "core/autograd_hook.h"
#include "core/ops.h"
#include "distributed/init.h"
#include "distributed/sharding/shard_spec.h"

namespace ember::distributed {

struct ZeroRedundancyOptimizer::Impl {
  // The parameters of one group with one dtype and device, adopted into a
  // flat buffer sharded over the ranks.
  struct Buffer {
    size_t group = 0;
    FlatBuffer flat;
    std::vector<Tensor> params;          // entry i's parameter
    std::vector<int64_t> global_index;   // entry i's index in the state dict (torch's numbering)
  };
  // One parameter of the local optimizer: the part of entry `entry` of
  // buffer `buffer` inside this rank's shard.
  struct Piece {
    size_t buffer = 0;
    size_t entry = 0;
    FlatBuffer::Piece where;
    Tensor param;  // a view of the flat buffer, [numel]
  };
  std::vector<Buffer> buffers;
  std::vector<Piece> pieces;  // the local optimizer's parameters, in its order
  // After consolidate_state_dict: the full state, on `consolidated_on`.
  optim::OptimizerStateDict consolidated;
  int consolidated_on = -1;
};

struct ZeroRedundancyOptimizer::Built {
  std::shared_ptr<ProcessGroup> pg;
  std::vector<optim::ParamGroup> groups;
  std::unique_ptr<optim::Optimizer> local;
  std::unique_ptr<Impl> impl;
};

namespace {

constexpr const char* kName = "ZeroRedundancyOptimizer";

std::vector<optim::ParamGroup> one_group(std::vector<Tensor> params) {
  if (params.empty()) return {};
  return {optim::ParamGroup{std::move(params), {}}};
}

}  // namespace

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<Tensor> params, const OptimizerFactory& make,
                                                 ZeroOptions options)
    : ZeroRedundancyOptimizer(one_group(std::move(params)), make, std::move(options)) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(std::vector<optim::ParamGroup> groups, const OptimizerFactory& make,
                                                 ZeroOptions options)
    : ZeroRedundancyOptimizer([&] {
        Built b;
        b.pg = options.process_group ? options.process_group : default_group();
        EMBER_CHECK(!groups.empty(), kName, ": optimizer got an empty parameter list");
        EMBER_CHECK(make != nullptr, kName, ": the optimizer factory is empty");
        const int ws = b.pg->size(), rank = b.pg->rank();
        b.impl = std::make_unique<Impl>();
        Impl& impl = *b.impl;
        // Every group checked before any parameter moves into a buffer.
        std::set<const TensorImpl*> seen;
        for (size_t gi = 0; gi < groups.size(); ++gi)
          for (size_t i = 0; i < groups[gi].params.size(); ++i) {
            const Tensor& p = groups[gi].params[i];
            EMBER_CHECK(p.defined() && is_floating(p.dtype()) && p.is_leaf(), kName, ": parameter ", i,
                        " of group ", gi, " must be a defined floating-point leaf tensor");
            EMBER_CHECK(seen.insert(p.impl_ptr().get()).second, kName, ": parameter ", i, " of group ", gi, " ",
                        shape_str(p.sizes()), " appears more than once across parameter groups");
          }
        int64_t index = 0;
        std::vector<optim::ParamGroup> local_groups;
        for (size_t gi = 0; gi < groups.size(); ++gi) {
          // Per (dtype, device), in order of first appearance.
          std::vector<std::tuple<DType, Device, std::vector<std::pair<Tensor, int64_t>>>> classes;
          for (size_t i = 0; i < groups[gi].params.size(); ++i, ++index) {
            const Tensor& p = groups[gi].params[i];
            auto it = std::find_if(classes.begin(), classes.end(), [&](const auto& c) {
              return std::get<0>(c) == p.dtype() && std::get<1>(c) == p.device();
            });
            if (it == classes.end()) it = classes.insert(classes.end(), {p.dtype(), p.device(), {}});
            std::get<2>(*it).emplace_back(p, index);
          }
          optim::ParamGroup local{{}, groups[gi].options};
          for (auto& [dtype, device, members] : classes) {
            Impl::Buffer buf;
            buf.group = gi;
            std::vector<std::pair<std::string, Shape>> layout;
            for (auto& [p, idx] : members) {
              layout.emplace_back("param." + std::to_string(idx), p.sizes());
              buf.params.push_back(p);
              buf.global_index.push_back(idx);
            }
            buf.flat = FlatBuffer(layout, {dtype, device}, ws);
            buf.flat.adopt(buf.params);
            for (const FlatBuffer::Piece& where : buf.flat.pieces(rank)) {
              Impl::Piece piece;
              piece.buffer = impl.buffers.size();
              piece.entry = where.entry;
              piece.where = where;
              piece.param = buf.flat.shard(rank).narrow(0, where.shard_offset, where.numel);
              piece.param.requires_grad_();
              local.params.push_back(piece.param);
              impl.pieces.push_back(std::move(piece));
            }
            impl.buffers.push_back(std::move(buf));
          }
          local_groups.push_back(std::move(local));
        }
        b.local = make(std::move(local_groups));
        EMBER_CHECK(b.local != nullptr, kName, ": the optimizer factory returned null");
        EMBER_CHECK(b.local->param_groups().size() == groups.size(), kName, ": the factory's optimizer has ",
                    b.local->param_groups().size(), " parameter groups; it must keep the ", groups.size(),
                    " it is given");
        b.groups = std::move(groups);
        return b;
      }()) {}

ZeroRedundancyOptimizer::ZeroRedundancyOptimizer(Built built)
    : optim::Optimizer(std::string(kName) + "(" + built.local->name() + ")", built.local->defaults()),
      pg_(std::move(built.pg)),
      local_(std::move(built.local)),
      impl_(std::move(built.impl)) {
  init(std::move(built.groups));
}

ZeroRedundancyOptimizer::~ZeroRedundancyOptimizer() = default;

void ZeroRedundancyOptimizer::validate(const optim::Options& o) const { local_->check_options(o); }

std::vector<std::string> ZeroRedundancyOptimizer::state_names() const { return local_->state_names(); }

void ZeroRedundancyOptimizer::step() { step_impl(nullptr); }

void ZeroRedundancyOptimizer::step_unless_inf(const Tensor& found_inf) {
  EMBER_CHECK(found_inf.defined(), name(), "::step_unless_inf: found_inf is undefined");
  step_impl(&found_inf);
}

void ZeroRedundancyOptimizer::step_impl(const Tensor* found_inf) {
  NoGradGuard no_grad;
  impl_->consolidated_on = -1;
  impl_->consolidated = {};
  // Hyperparameters live in our groups (schedulers and checkpoints see
  // them); the local optimizer takes them each step.
  for (size_t gi = 0; gi < param_groups().size(); ++gi) {
    local_->param_groups()[gi].options = param_groups()[gi].options;
    local_->param_groups()[gi].lr_tensor = param_groups()[gi].lr_tensor;
  }
  // Each piece's gradient is its part of the parameter's (DDP-averaged)
  // gradient; a parameter without one leaves its pieces without one.
  for (auto& piece : impl_->pieces) {
    const Tensor& owner = impl_->buffers[piece.buffer].params[piece.entry];
    Tensor g = owner.grad();
    piece.param.set_grad(g.defined() ? g.reshape({-1}).narrow(0, piece.where.entry_offset, piece.where.numel)
                                     : Tensor());
  }
  if (found_inf) local_->step_unless_inf(*found_inf);
  else local_->step();
  for (auto& piece : impl_->pieces) piece.param.set_grad(Tensor());
  // Every rank's updated shard to every rank, in place.
  std::vector<std::shared_ptr<Work>> works;
  for (auto& buf : impl_->buffers) works.push_back(buf.flat.all_gather(*pg_, buf.flat.shard(pg_->rank())));
  for (auto& w : works) w->wait();
}

int64_t ZeroRedundancyOptimizer::local_state_bytes() const {
  int64_t bytes = 0;
  for (const auto& piece : impl_->pieces)
    for (const auto& [name, t] : local_->state(piece.param)) bytes += static_cast<int64_t>(t.nbytes());
  return bytes;
}

void ZeroRedundancyOptimizer::consolidate_state_dict(int to) {
  const int ws = pg_->size(), rank = pg_->rank();
  EMBER_CHECK(to >= 0 && to < ws, kName, "::consolidate_state_dict: rank ", to, " out of range (world size ", ws,
              ")");
  NoGradGuard no_grad;
  const std::vector<std::string> names = local_->state_names();
  const int64_t K = static_cast<int64_t>(names.size());
  std::map<int64_t, std::map<std::string, Tensor>> full;  // global index -> name -> value
  for (size_t bi = 0; bi < impl_->buffers.size(); ++bi) {
    const Impl::Buffer& buf = impl_->buffers[bi];
    const FlatBuffer& fb = buf.flat;
    const int64_t E = static_cast<int64_t>(fb.size());
    // Which entries hold which state, and their step counts: -1 = none;
    // a piece's "step" is its parameter's (all pieces step together).
    std::vector<double> info(static_cast<size_t>(K * E), -1.0);
    std::vector<const Impl::Piece*> mine;
    for (const auto& piece : impl_->pieces) {
      if (piece.buffer != bi) continue;
      mine.push_back(&piece);
      const auto& st = local_->state(piece.param);
      for (int64_t k = 0; k < K; ++k) {
        auto it = st.find(names[k]);
        if (it == st.end()) continue;
        double& slot = info[static_cast<size_t>(k * E + static_cast<int64_t>(piece.entry))];
        slot = std::max(slot, names[k] == "step" ? it->second.item() : 0.0);
      }
    }
    Tensor info_t = Tensor::from_vector(info, {K * E}, {DType::Float64, pg_->device()});
    pg_->allreduce(info_t, ReduceOp::Max)->wait();
    info = info_t.to_vector();
    for (int64_t k = 0; k < K; ++k) {
      bool any = false;
      for (int64_t e = 0; e < E; ++e) any = any || info[static_cast<size_t>(k * E + e)] >= 0;
      if (!any) continue;
      if (names[k] == "step") {
        for (int64_t e = 0; e < E; ++e) {
          const double v = info[static_cast<size_t>(k * E + e)];
          if (v >= 0) full[buf.global_index[e]]["step"] = Tensor::from_vector({v}, {}, {DType::Float32, kCPU});
        }
        continue;
      }
      // The state as a flat buffer like the parameters' (in the state's
      // dtype: float32 for 16-bit parameters): this rank's pieces in its
      // shard, sent to `to`, which receives every shard into the whole
      // buffer. Only `to` ever holds the whole; the others hold one shard.
      const TensorOptions state_opts{optim::state_dtype(fb.flat().dtype()), fb.flat().device()};
      const int64_t n = fb.shard_numel();
      Tensor flat = zeros({rank == to ? fb.padded_numel() : n}, state_opts);
      Tensor own = rank == to ? flat.narrow(0, rank * n, n) : flat;
      for (const Impl::Piece* piece : mine) {
        auto it = local_->state(piece->param).find(names[k]);
        if (it == local_->state(piece->param).end()) continue;
        Tensor dst = own.narrow(0, piece->where.shard_offset, piece->where.numel);
        dst.copy_(it->second.reshape({-1}));
      }
      const int tag = static_cast<int>(bi * static_cast<size_t>(K) + static_cast<size_t>(k));
      if (rank != to) {
        if (n > 0) pg_->send(flat, to, tag)->wait();
        continue;
      }
      std::vector<std::shared_ptr<Work>> recvs;
      for (int src = 0; src < ws && n > 0; ++src)
        if (src != to) recvs.push_back(pg_->recv(flat.narrow(0, src * n, n), src, tag));
      for (auto& w : recvs) w->wait();
      for (int64_t e = 0; e < E; ++e) {
        if (info[static_cast<size_t>(k * E + e)] < 0) continue;
        const FlatEntry& entry = fb.entries()[static_cast<size_t>(e)];
        full[buf.global_index[e]][names[k]] = flat.narrow(0, entry.offset, entry.numel).view(entry.shape).clone();
      }
    }
  }
  impl_->consolidated = {};
  impl_->consolidated_on = to;
  if (rank != to) return;
  optim::OptimizerStateDict& sd = impl_->consolidated;
  for (auto& [index, states] : full)
    for (auto& [name, t] : states) sd.state.emplace_back("state." + std::to_string(index) + "." + name, t);
  int64_t index = 0;
  for (const auto& g : param_groups()) {
    optim::OptimizerStateDict::Group out{g.options, {}};
    for (size_t i = 0; i < g.params.size(); ++i) out.params.push_back(index++);
    sd.param_groups.push_back(std::move(out));
  }
}

std::vector<optim::Optimizer::LocalState> ZeroRedundancyOptimizer::local_state() const {
  std::vector<LocalState> out;
  for (const auto& piece : impl_->pieces) {
    const Impl::Buffer& buf = impl_->buffers[piece.buffer];
    const FlatEntry& entry = buf.flat.entries()[piece.entry];
    auto spec = std::make_shared<ShardSpec>();
    spec->global_shape = entry.shape;
    spec->mesh_dims = {"dp"};
    spec->mesh_shape = {pg_->size()};
    spec->coord = {pg_->rank()};
    spec->placements = {Shard(0)};  // a run of the flat buffer: the region says which
    spec->layout = "zero";
    spec->region = run_region(entry.shape, piece.where.entry_offset, piece.where.numel);
    std::shared_ptr<const ShardMetaBase> part = spec;
    for (const auto& [name, t] : local_->state(piece.param)) out.push_back({buf.params[piece.entry], name, t, part});
  }
  return out;
}

optim::OptimizerStateDict ZeroRedundancyOptimizer::state_dict() const {
  EMBER_CHECK(impl_->consolidated_on == pg_->rank(), kName, " (rank ", pg_->rank(),
              "): state_dict() returns the state consolidated onto this rank; ",
              impl_->consolidated_on < 0
                  ? std::string("call consolidate_state_dict(to) on every rank first (again after each step)")
                  : "it was consolidated onto rank " + std::to_string(impl_->consolidated_on));
  return impl_->consolidated;
}

void ZeroRedundancyOptimizer::load_state_dict(const optim::OptimizerStateDict& sd) {
  const std::string op = std::string(kName) + "::load_state_dict";
  EMBER_CHECK(sd.param_groups.size() == param_groups().size(), op, ": the state dict has ", sd.param_groups.size(),
              " parameter groups, the optimizer has ", param_groups().size());
  // Saved index -> (buffer, entry), by position as torch does.
  std::map<int64_t, std::pair<size_t, size_t>> where;
  std::map<int64_t, std::pair<size_t, size_t>> by_global;
  for (size_t bi = 0; bi < impl_->buffers.size(); ++bi)
    for (size_t e = 0; e < impl_->buffers[bi].global_index.size(); ++e)
      by_global[impl_->buffers[bi].global_index[e]] = {bi, e};
  int64_t global = 0;
  for (size_t gi = 0; gi < param_groups().size(); ++gi) {
    const auto& saved = sd.param_groups[gi];
    EMBER_CHECK(saved.params.size() == param_groups()[gi].params.size(), op, ": parameter group ", gi, " has ",
                saved.params.size(), " parameters in the state dict, ", param_groups()[gi].params.size(),
                " in the optimizer");
    for (int64_t idx : saved.params)
      EMBER_CHECK(where.emplace(idx, by_global.at(global++)).second, op, ": parameter index ", idx,
                  " appears twice in the state dict's groups");
  }
  // The local state dict: each full entry cut to this rank's pieces of it.
  std::map<std::pair<size_t, size_t>, std::vector<int64_t>> pieces_of;  // (buffer, entry) -> local indices
  for (size_t li = 0; li < impl_->pieces.size(); ++li)
    pieces_of[{impl_->pieces[li].buffer, impl_->pieces[li].entry}].push_back(static_cast<int64_t>(li));
  optim::OptimizerStateDict local;
  for (const auto& [key, t] : sd.state) {
    int64_t index = -1;
    std::string name;
    EMBER_CHECK(optim::parse_state_key(key, &index, &name), op, ": state dict entry '", key,
                "' is not named state.<index>.<name>");
    auto it = where.find(index);
    EMBER_CHECK(it != where.end(), op, ": state dict entry '", key, "' refers to parameter ", index,
                ", which no parameter group of the state dict lists");
    EMBER_CHECK(t.defined(), op, ": state dict entry '", key, "' is an undefined tensor");
    const auto [bi, e] = it->second;
    const FlatEntry& entry = impl_->buffers[bi].flat.entries()[e];
    if (name != "step")
      EMBER_CHECK(t.sizes() == entry.shape, op, ": state dict entry '", key, "' has shape ", shape_str(t.sizes()),
                  " but parameter ", index, " has shape ", shape_str(entry.shape));
    for (int64_t li : pieces_of[{bi, e}]) {
      const auto& w = impl_->pieces[static_cast<size_t>(li)].where;
      local.state.emplace_back("state." + std::to_string(li) + "." + name,
                               name == "step" ? t : t.reshape({-1}).narrow(0, w.entry_offset, w.numel));
    }
  }
  int64_t li = 0;
  for (size_t gi = 0; gi < param_groups().size(); ++gi) {
    optim::OptimizerStateDict::Group g{sd.param_groups[gi].options, {}};
    for (size_t k = 0; k < local_->param_groups()[gi].params.size(); ++k) g.params.push_back(li++);
    local.param_groups.push_back(std::move(g));
  }
  // The local optimizer checks names, options and shapes before changing
  // anything; then our groups take the options it accepted.
  local_->load_state_dict(local);
  for (size_t gi = 0; gi < param_groups().size(); ++gi) {
    param_groups()[gi].options = local_->param_groups()[gi].options;
    optim::set_lr(param_groups()[gi], param_groups()[gi].options.at("lr"));  // and its lr_tensor
  }
  impl_->consolidated_on = -1;
  impl_->consolidated = {};
}

}  // namespace ember::distributed
