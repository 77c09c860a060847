// The pipeline runtime (pipeline.h): one loop over this rank's action list.
#include "distributed/parallel/pp/pipeline.h"

#include <algorithm>
#include <functional>
#include <limits>
#include <optional>
#include <set>
#include <unordered_set>

#include "core/exception.h"
#include "core/ops.h"
#include "core/profiler.h"
#include "distributed/parallel/flat_buffer.h"
#include "distributed/parallel/rank_agreement.h"
#include "optim/clip_grad.h"

namespace ember::distributed::pp {
namespace {

constexpr int kMaxDims = 8;
constexpr int kHeaderLen = kMaxDims + 3;           // ndim, dims, dtype, magic
constexpr int64_t kHeaderMagic = 0x5050;           // "PP": a header, not data
constexpr int kControlTag = 1 << 29;               // above every action's tag
constexpr int kEdgeTag = kControlTag + (1 << 20);  // ordered transfers: + the sender's rank

uint64_t fnv(const std::string& s, uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}
// A hash that survives Tensor::from_vector's doubles (52 bits).
int64_t hash52(uint64_t h) { return static_cast<int64_t>(h & ((uint64_t{1} << 52) - 1)); }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// What one (micro-batch, stage) keeps between its actions.
struct Pipeline::Slot {
  Tensor input;                         // the stage's input: a leaf (activations) or the micro-batch (stage 0)
  Tensor output;                        // what B backpropagates from: the activation, or the last stage's scaled loss
  Tensor grad_out;                      // the gradient of the output, received (RecvB)
  autograd::DeferredBackward deferred;  // split backward: the weights' part, for W
};

Pipeline::Pipeline(Schedule schedule, std::vector<std::shared_ptr<PipelineStage>> stages,
                   std::shared_ptr<ProcessGroup> pp, PipelineOptions options)
    : schedule_(std::move(schedule)), stages_(std::move(stages)), pp_(std::move(pp)), options_(std::move(options)) {
  EMBER_CHECK(pp_ != nullptr, "Pipeline: no pp process group");
  EMBER_CHECK(pp_->size() == schedule_.ranks, "Pipeline: the pp group has ", pp_->size(), " ranks but schedule ",
              schedule_.name, " is for ", schedule_.ranks);
  EMBER_CHECK(options_.loss != nullptr, "Pipeline: PipelineOptions::loss is required (the last stage's loss)");
  rank_ = pp_->rank();
  validate(schedule_);
  ordered_ = options_.ordered_transfers || pp_->p2p_in_order();
  if (ordered_) {
    // The schedule is every rank's: what each sender sends this rank, in
    // the order it sends it.
    for (int src = 0; src < schedule_.ranks; ++src)
      for (const Action& a : schedule_.actions[src])
        if ((a.kind == ActionKind::SendF || a.kind == ActionKind::SendB) && dest_of(a) == rank_)
          inbound_[src].push_back(tag(a));
    for (const Action& a : schedule_.actions[rank_])
      if (a.kind == ActionKind::RecvF || a.kind == ActionKind::RecvB) recv_of_.emplace(tag(a), a);
  }
  const std::vector<int> want = schedule_.stages_of(rank_);
  EMBER_CHECK(stages_.size() == want.size(), "Pipeline: pp rank ", rank_, " holds ", want.size(),
              " stage(s) under schedule ", schedule_.name, " but was given ", stages_.size());
  for (size_t i = 0; i < want.size(); ++i) {
    EMBER_CHECK(
        stages_[i] != nullptr && stages_[i]->index() == want[i] && stages_[i]->num_stages() == schedule_.num_stages(),
        "Pipeline: pp rank ", rank_, "'s stage ", i, " should be stage ", want[i], " of ", schedule_.num_stages(),
        ", got ", stages_[i] ? stages_[i]->description() : std::string("none"));
  }
  split_ = schedule_.split_backward();
}

Pipeline::~Pipeline() = default;

PipelineStage& Pipeline::stage(int index) const {
  for (auto& s : stages_)
    if (s->index() == index) return *s;
  EMBER_INTERNAL_ASSERT(false, "Pipeline: pp rank ", rank_, " holds no stage ", index);
  return *stages_.front();
}

int Pipeline::tag(const Action& a) const {
  // One tag per message of a step: forward messages by the receiving
  // stage, backward ones by the sending stage.
  const bool fwd = a.kind == ActionKind::SendF || a.kind == ActionKind::RecvF;
  const int to_stage = a.kind == ActionKind::SendF ? a.stage + 1 : a.stage;
  const int from_stage = a.kind == ActionKind::RecvB ? a.stage + 1 : a.stage;
  return ((a.mb * schedule_.num_stages() + (fwd ? to_stage : from_stage)) * 2) + (fwd ? 0 : 1);
}

void Pipeline::check_agreement() {
  // Every rank's view of the schedule, as numbers: the same on every rank
  // or the first step stops here, naming what differs.
  uint64_t lists = 0;
  for (const auto& list : schedule_.actions)
    for (const Action& a : list) lists = fnv(a.str(), lists);
  const std::vector<double> mine{static_cast<double>(schedule_.ranks), static_cast<double>(schedule_.virtual_stages),
                                 static_cast<double>(schedule_.microbatches),
                                 static_cast<double>(hash52(fnv(schedule_.name))), static_cast<double>(hash52(lists))};
  const int64_t k = static_cast<int64_t>(mine.size());
  Tensor local = Tensor::from_vector(mine, {k}, DType::Int64);
  Tensor all = Tensor::empty({k * pp_->size()}, DType::Int64).to(pp_->device());
  pp_->allgather_into_tensor(all, local.to(pp_->device()))->wait();
  Tensor host = all.to(kCPU);
  const int64_t* v = host.data<int64_t>();
  auto name_of = [&](int64_t h) {
    for (const auto& n : schedule_names())
      if (hash52(fnv(n)) == h) return n;
    return std::string("another schedule");
  };
  for (int r = 0; r < pp_->size(); ++r) {
    const int64_t* o = v + r * k;
    const int64_t* me = local.data<int64_t>();
    if (std::equal(o, o + k, me)) continue;
    EMBER_CHECK(false, "pipeline: the pp ranks disagree at the first step: rank ", rank_, " runs schedule ",
                schedule_.name, " (pp ", me[0], ", ", me[1], " virtual stage(s), ", me[2], " micro-batches), rank ", r,
                " runs ", name_of(o[3]), " (pp ", o[0], ", ", o[1], " virtual stage(s), ", o[2], " micro-batches)",
                std::equal(o, o + 4, me) ? "; their action lists differ" : "");
  }
  // Every pair of ranks the schedule moves data between (the same list on
  // every rank): an NCCL group gives each its own communicator and stream,
  // so one pair's transfers never wait behind another's or a collective.
  std::set<std::pair<int, int>> edges;
  for (int src = 0; src < schedule_.ranks; ++src)
    for (const Action& a : schedule_.actions[src])
      if (a.kind == ActionKind::SendF || a.kind == ActionKind::SendB) {
        const int dst = dest_of(a);
        if (dst != src) edges.insert({src, dst});
      }
  pp_->connect_p2p({edges.begin(), edges.end()});
}

void Pipeline::send(const Tensor& t, const Action& a) {
  fr::CallerTag caller(a.kind == ActionKind::SendF ? "pipeline send activation" : "pipeline send gradient");
  const int dst = dest_of(a);
  Tensor c = t.detach().contiguous();
  if (a.kind == ActionKind::SendF) {
    auto it = out_meta_.find(a.stage + 1);
    if (it == out_meta_.end()) {
      // The first message of this boundary: its header first.
      EMBER_CHECK(c.dim() <= kMaxDims, "pipeline: stage ", a.stage, " output has ", c.dim(), " dimensions (at most ",
                  kMaxDims, ")");
      std::vector<double> h(kHeaderLen, 0);
      h[0] = static_cast<double>(c.dim());
      for (int d = 0; d < c.dim(); ++d) h[1 + d] = static_cast<double>(c.size(d));
      h[kMaxDims + 1] = static_cast<double>(static_cast<int>(c.dtype()));
      h[kMaxDims + 2] = static_cast<double>(kHeaderMagic);
      Tensor header = Tensor::from_vector(h, {kHeaderLen}, DType::Int64).to(pp_->device());
      sends_.emplace_back(pp_->send(header, dst, wire_tag(kControlTag + a.stage + 1, rank_)), header);
      out_meta_[a.stage + 1] = {c.sizes(), c.dtype()};
    } else {
      EMBER_CHECK(it->second.first == c.sizes() && it->second.second == c.dtype(), "pipeline: stage ", a.stage,
                  " (rank ", rank_, ") produced ", shape_str(c.sizes()), " ", c.dtype(), " for micro-batch ", a.mb,
                  ", but stage ", a.stage + 1, " (rank ", dst, ") agreed at the first step to receive ",
                  shape_str(it->second.first), " ", it->second.second,
                  "; every micro-batch of every step must have one shape");
    }
  }
  sends_.emplace_back(pp_->send(c, dst, wire_tag(tag(a), rank_)), c);
  send_posted_[tag(a)] = seconds_since(step_start_);
}

int Pipeline::dest_of(const Action& a) const {
  return schedule_.rank_of(a.kind == ActionKind::SendF ? a.stage + 1 : a.stage - 1);
}

int Pipeline::wire_tag(int t, int sender) const { return ordered_ ? kEdgeTag + sender : t; }

int Pipeline::source_of(const Action& a) const {
  return schedule_.rank_of(a.kind == ActionKind::RecvF ? a.stage - 1 : a.stage + 1);
}

bool Pipeline::post_recv(const Action& a, bool may_block) {
  const int t = tag(a);
  if (recvs_.count(t)) return true;
  if (!ordered_) {
    post_one(t, a);
    return true;
  }
  // In the sender's order: every message it sends this rank before this
  // one is posted first. Their buffers' shapes are known by then (an
  // activation's from its boundary's header, which comes first; a
  // gradient's from the activation this rank sent), except a header's
  // content, which is waited for.
  const int src = source_of(a);
  const std::vector<int>& order = inbound_[src];
  size_t& next = inbound_posted_[src];
  const size_t pos = static_cast<size_t>(std::find(order.begin(), order.end(), t) - order.begin());
  EMBER_INTERNAL_ASSERT(pos < order.size() && pos >= next, "pipeline: ", a.str(), " is not the next of rank ", src,
                        "'s messages to rank ", rank_);
  if (!may_block)
    for (size_t i = next; i <= pos; ++i) {
      const Action& r = recv_of_.at(order[i]);
      if ((r.kind == ActionKind::RecvF && !in_meta_.count(r.stage)) ||
          (r.kind == ActionKind::RecvB && !out_meta_.count(r.stage + 1)))
        return false;
    }
  for (; next <= pos; ++next) post_one(order[next], recv_of_.at(order[next]));
  return true;
}

void Pipeline::post_one(int t, const Action& a) {
  fr::CallerTag caller(a.kind == ActionKind::RecvF ? "pipeline recv activation" : "pipeline recv gradient");
  Shape shape;
  DType dtype;
  if (a.kind == ActionKind::RecvF) {
    auto it = in_meta_.find(a.stage);
    if (it == in_meta_.end()) {
      // The boundary's header, once: blocking, under the group's timeout.
      const int src = schedule_.rank_of(a.stage - 1);
      Tensor header = Tensor::empty({kHeaderLen}, DType::Int64).to(pp_->device());
      pp_->recv(header, src, wire_tag(kControlTag + a.stage, src))->wait();
      Tensor h = header.to(kCPU);
      const int64_t* v = h.data<int64_t>();
      EMBER_CHECK(v[kMaxDims + 2] == kHeaderMagic && v[0] >= 0 && v[0] <= kMaxDims, "pipeline: stage ", a.stage,
                  " (rank ", rank_, ") received no valid activation header from stage ", a.stage - 1, " (rank ", src,
                  "); do the ranks run the same schedule?");
      Shape s(v + 1, v + 1 + v[0]);
      it = in_meta_.emplace(a.stage, std::make_pair(s, static_cast<DType>(v[kMaxDims + 1]))).first;
    }
    shape = it->second.first;
    dtype = it->second.second;
  } else if (ordered_) {
    // The gradient of an activation this rank sent: the boundary's shape.
    auto it = out_meta_.find(a.stage + 1);
    EMBER_INTERNAL_ASSERT(it != out_meta_.end(), "pipeline: ", a.str(), " before any activation of stage ", a.stage,
                          " was sent");
    shape = it->second.first;
    dtype = it->second.second;
  } else {
    // The gradient of this stage's output: its shape and dtype.
    auto sit = slots_.find({a.mb, a.stage});
    EMBER_INTERNAL_ASSERT(sit != slots_.end() && sit->second->output.defined(), "pipeline: ", a.str(),
                          " before its forward");
    shape = sit->second->output.sizes();
    dtype = sit->second->output.dtype();
  }
  Tensor buf = Tensor::empty(shape, {dtype, pp_->device()});
  const int src = source_of(a);
  recvs_[t] = {buf, pp_->recv(buf, src, wire_tag(t, src))};
}

Tensor Pipeline::take_recv(const Action& a) {
  post_recv(a);
  auto it = recvs_.find(tag(a));
  Posted p = std::move(it->second);
  recvs_.erase(it);
  const bool ready = p.work->is_completed();
  {
    profiler::Scope wait(profiler::Kind::Wait, profiler::enabled() ? a.str() : std::string());
    p.work->wait();
  }
  recv_done_[tag(a)] = {seconds_since(step_start_), !ready};
  return p.buffer;
}

void Pipeline::run_action(size_t index, const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets,
                          std::vector<Tensor>& losses) {
  const Action& a = schedule_.actions[rank_][index];
  const int S = schedule_.num_stages(), M = schedule_.microbatches;
  auto& slot_ptr = slots_[{a.mb, a.stage}];
  if (!slot_ptr) slot_ptr = std::make_unique<Slot>();
  Slot& slot = *slot_ptr;
  auto local_slot = [&](int stage) -> Slot& {
    auto it = slots_.find({a.mb, stage});
    EMBER_INTERNAL_ASSERT(it != slots_.end(), "pipeline: ", a.str(), " before stage ", stage, "'s action");
    return *it->second;
  };
  switch (a.kind) {
    case ActionKind::RecvF:
      slot.input = take_recv(a);
      return;
    case ActionKind::RecvB:
      slot.grad_out = take_recv(a);
      return;
    case ActionKind::SendF:
      send(slot.output, a);
      return;
    case ActionKind::SendB: {
      Tensor g = slot.input.grad();
      send(g.defined() ? g : zeros_like(slot.input), a);
      slot.input = Tensor();
      return;
    }
    default:
      break;
  }
  PipelineStage& st = stage(a.stage);
  const double t0 = seconds_since(step_start_);
  profiler::Scope prof(profiler::Kind::User, profiler::enabled() ? a.str() : std::string());
  if (a.kind == ActionKind::F) {
    Tensor x;
    if (a.stage == 0) {
      EMBER_CHECK(static_cast<int>(inputs.size()) == M && inputs[a.mb].defined(), "pipeline: stage 0 (rank ", rank_,
                  ") needs the ", M, " micro-batches' inputs, got ", inputs.size());
      x = inputs[a.mb];
    } else {
      // The previous stage's output, as a leaf of this stage's graph.
      Tensor in = schedule_.rank_of(a.stage - 1) == rank_ ? local_slot(a.stage - 1).output : slot.input;
      x = in.detach();
      if (is_floating(x.dtype())) x.requires_grad_();
    }
    slot.input = x;
    Tensor out;
    try {
      out = st(x);
    } catch (const Error& e) {
      throw Error("pipeline " + st.description() + " (rank " + std::to_string(rank_) + "), forward of micro-batch " +
                  std::to_string(a.mb) + " on " + shape_str(x.sizes()) +
                  (a.stage > 0 ? " from stage " + std::to_string(a.stage - 1) : std::string()) + ": " + e.what());
    }
    if (a.stage == S - 1) {
      EMBER_CHECK(static_cast<int>(targets.size()) == M && targets[a.mb].defined(), "pipeline: the last stage (rank ",
                  rank_, ") needs the ", M, " micro-batches' targets, got ", targets.size());
      Tensor loss = options_.loss(out, targets[a.mb]);
      EMBER_CHECK(loss.numel() == 1, "pipeline: the loss of micro-batch ", a.mb, " is ", shape_str(loss.sizes()),
                  "; PipelineOptions::loss must return a scalar");
      losses[a.mb] = loss.detach();
      // M micro-batches' mean losses, each / M: the whole batch's mean.
      if (!schedule_.forward_only()) {
        out = loss * (1.0 / M);
        if (options_.scale_loss) out = options_.scale_loss(out);
      }
    }
    slot.output = out;
  } else if (a.kind == ActionKind::B) {
    Tensor grad;
    if (a.stage < S - 1) {
      if (schedule_.rank_of(a.stage + 1) == rank_) {
        Slot& next = local_slot(a.stage + 1);
        grad = next.input.grad();
        if (!grad.defined()) grad = zeros_like(slot.output);
        next.input = Tensor();
      } else {
        grad = slot.grad_out;
        slot.grad_out = Tensor();
      }
    }
    if (slot.output.requires_grad()) {
      if (split_)
        slot.deferred = autograd::backward_input(slot.output, grad, {slot.input});
      else
        slot.output.backward(grad);
    }
    slot.output = Tensor();
  } else {  // W
    if (slot.deferred.pending()) slot.deferred.run();
  }
  times_.push_back({a, t0, seconds_since(step_start_)});
}

std::vector<Tensor> Pipeline::step(const std::vector<Tensor>& inputs, const std::vector<Tensor>& targets) {
  EMBER_CHECK(failed_.empty(), "pipeline rank ", rank_, ": an earlier step failed (", failed_,
              "); its transfers may still be posted, so this pipeline cannot run another step");
  if (!agreed_) {
    check_agreement();
    agreed_ = true;
  }
  step_start_ = std::chrono::steady_clock::now();
  times_.clear();
  send_posted_.clear();
  recv_done_.clear();
  slots_.clear();
  inbound_posted_.clear();
  std::vector<Tensor> losses(schedule_.microbatches);
  const auto& list = schedule_.actions[rank_];
  // Evaluation: nothing recorded for a backward that will not come.
  std::optional<NoGradGuard> no_grad;
  if (schedule_.forward_only()) no_grad.emplace();
  // A loss scaler on a rank without the loss still scales this step (the
  // gradients arriving from the last stage are scaled): show it a loss, so
  // it is set up to unscale them (GradScaler starts at its first scale()).
  if (options_.scale_loss && !schedule_.forward_only() && rank_ != schedule_.rank_of(schedule_.num_stages() - 1)) {
    NoGradGuard ng;
    options_.scale_loss(zeros({}, {DType::Float32, pp_->device()}));
  }
  // The receives the next compute action needs go out before the current
  // one runs, where their buffers can be made by then (not the first
  // step's headers, which block; not a gradient of an output not yet
  // computed), else right after it.
  auto prefetch = [&](size_t i) {
    for (size_t j = i + 1; j < list.size() && !list[j].is_compute(); ++j) {
      const Action& r = list[j];
      if (r.kind == ActionKind::RecvF && in_meta_.count(r.stage)) post_recv(r, /*may_block=*/false);
      if (r.kind == ActionKind::RecvB) {
        auto it = slots_.find({r.mb, r.stage});
        if (it != slots_.end() && it->second->output.defined()) post_recv(r, /*may_block=*/false);
      }
    }
  };
  const std::vector<std::shared_ptr<FSDPModule>> fsdp =
      schedule_.forward_only() ? std::vector<std::shared_ptr<FSDPModule>>{} : fsdp_stages();
  EMBER_CHECK(fsdp.empty() || options_.dp_group == nullptr || options_.dp_group->size() == 1, "pipeline rank ", rank_,
              ": PipelineOptions::dp_group averages whole gradients over replicas of a pipeline without FSDP; ",
              "stages wrapped by fully_shard reduce their own (HSDP: a 2-D (dp_replicate, dp_shard) mesh for the ",
              "replicas)");
  for (auto& f : fsdp) f->begin_micro_batches();
  size_t at = 0;
  try {
    for (; at < list.size(); ++at) {
      if (list[at].is_compute()) prefetch(at);
      run_action(at, inputs, targets, losses);
      if (list[at].is_compute()) prefetch(at);
    }
    for (auto& [work, t] : sends_) work->wait();
  } catch (const std::exception& e) {
    // The Work objects keep their tensors alive; what this step posted may
    // still match a later message, so the pipeline takes no more steps.
    for (auto& [work, t] : sends_) {
      try {
        work->wait(Millis(0));
      } catch (const std::exception&) {  // the first error is the one to report
      }
    }
    sends_.clear();
    recvs_.clear();
    slots_.clear();
    // Name where: the action, and for a transfer the peer (a dead peer's
    // error from the transport names only an address).
    std::string where = "pipeline rank " + std::to_string(rank_) + " (schedule " + schedule_.name + ")";
    if (at < list.size()) {
      const Action& a = list[at];
      where += ", " + a.str();
      int peer_stage = -1;
      if (a.kind == ActionKind::SendF || a.kind == ActionKind::RecvB) peer_stage = a.stage + 1;
      if (a.kind == ActionKind::SendB || a.kind == ActionKind::RecvF) peer_stage = a.stage - 1;
      if (peer_stage >= 0)
        where += std::string(a.kind == ActionKind::SendF || a.kind == ActionKind::SendB ? " to" : " from") + " rank " +
                 std::to_string(schedule_.rank_of(peer_stage)) + " (stage " + std::to_string(peer_stage) + ")";
    } else {
      where += ", waiting for its sends at the end of the step";
    }
    failed_ = where + ": " + e.what();
    throw Error(failed_);
  }
  sends_.clear();
  slots_.clear();
  if (!schedule_.forward_only()) {
    // Tied gradients summed while FSDP's are still whole (each stage's
    // units lay the tied tensor out differently), then reduced.
    exchange_tied_grads();
    for (auto& f : fsdp) f->end_micro_batches();
    average_over_replicas();
  }
  if (rank_ != schedule_.rank_of(schedule_.num_stages() - 1)) losses.clear();
  return losses;
}

void Pipeline::exchange_tied_grads() {
  std::unordered_set<std::string> done;
  for (auto& st : stages_)
    for (const auto& tied : st->tied) {
      if (!done.insert(tied.name).second) continue;
      std::vector<int> others;
      for (int s : tied.stages)
        if (schedule_.rank_of(s) != rank_) others.push_back(schedule_.rank_of(s));
      if (others.empty()) continue;  // every holder on this rank: one tensor, one gradient
      EMBER_CHECK(others.size() == 1 && tied.stages.size() == 2, "pipeline: tied parameter ", tied.name, " on stages ",
                  tied.stages.size(), "; two holders are supported");
      Tensor p;
      for (auto& [n, t] : st->named_parameters())
        if (n == tied.name) p = t;
      EMBER_CHECK(p.defined(), "pipeline: ", st->description(), " declares the tied parameter ", tied.name,
                  " but holds none by that name");
      Tensor g = p.grad().defined() ? p.grad() : zeros_like(p);
      Tensor mine = g.detach().contiguous().clone(), theirs = Tensor::empty(g.sizes(), g.options());
      // The lower rank sends first, the higher receives first: a group that
      // matches in call order (NCCL) pairs them without waiting on itself.
      std::shared_ptr<Work> s, r;
      if (rank_ < others[0]) {
        s = pp_->send(mine, others[0], kControlTag - 1);
        r = pp_->recv(theirs, others[0], kControlTag - 1);
      } else {
        r = pp_->recv(theirs, others[0], kControlTag - 1);
        s = pp_->send(mine, others[0], kControlTag - 1);
      }
      s->wait();
      r->wait();
      NoGradGuard ng;
      // mine + theirs on one rank, theirs + mine on the other: the same sum
      // (float addition commutes).
      Tensor sum = mine + theirs;
      if (p.grad().defined())
        p.grad().copy_(sum);
      else
        p.set_grad(sum);
    }
}

void Pipeline::average_over_replicas() {
  const auto& dp = options_.dp_group;
  if (dp == nullptr || dp->size() == 1) return;
  // Every replica holds the same stages: the same parameters in the same
  // order, so one flat buffer per dtype (FlatBuffer, DDP's bucket layout)
  // lines up across them. A parameter without a gradient takes part as
  // zeros, so the layouts never differ.
  std::map<DType, std::vector<std::pair<std::string, Tensor>>> by_dtype;
  std::vector<Tensor> params = parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    Tensor& p = params[i];
    if (!p.requires_grad()) continue;
    if (!p.grad().defined()) p.set_grad(zeros_like(p));
    by_dtype[p.grad().dtype()].emplace_back(std::to_string(i), p.grad());
  }
  NoGradGuard ng;
  for (auto& [dtype, grads] : by_dtype) {
    FlatBuffer fb = FlatBuffer::from_tensors(grads);
    dp->allreduce(fb.flat(), ReduceOp::Avg)->wait();
    for (size_t i = 0; i < grads.size(); ++i) grads[i].second.copy_(fb.view(i));
  }
}

std::vector<std::shared_ptr<FSDPModule>> Pipeline::fsdp_stages() const {
  std::vector<std::shared_ptr<FSDPModule>> out;
  for (auto& st : stages_) {
    if (auto f = fsdp_of(*st)) {
      out.push_back(std::move(f));
      continue;
    }
    for (auto& [name, m] : st->named_modules())
      EMBER_CHECK(fsdp_of(*m) == nullptr, "pipeline: ", st->description(), " (rank ", rank_, ") holds the FSDP unit '",
                  name, "' but is not wrapped itself; call fully_shard on the stage after its blocks, so the ",
                  "pipeline can keep its units gathered through the step and reduce their gradients once");
  }
  return out;
}

std::vector<Tensor> Pipeline::parameters() const {
  std::vector<Tensor> out;
  std::unordered_set<const TensorImpl*> seen;
  for (auto& st : stages_)
    for (auto& [n, p] : st->named_parameters())
      if (seen.insert(&p.impl()).second) out.push_back(p);
  return out;
}

double Pipeline::clip_grad_norm_(double max_norm, double norm_type) {
  // A tied parameter counts on its first stage only.
  std::vector<Tensor> all = parameters(), counted;
  std::unordered_set<const TensorImpl*> skip;
  for (auto& st : stages_)
    for (const auto& tied : st->tied)
      if (st->index() != tied.stages.front())
        for (auto& [n, p] : st->named_parameters())
          if (n == tied.name) skip.insert(&p.impl());
  for (const Tensor& p : all)
    if (!skip.count(&p.impl())) counted.push_back(p);
  const double inf = std::numeric_limits<double>::infinity();
  const double norm = optim::clip_grad_norm_(counted, inf, norm_type, grad_norm_allreduce(pp_, norm_type));
  if (norm > max_norm) {
    // The scale clip_grad_norm_ applies, to every parameter (the tied one too).
    const double coef = max_norm / (norm + 1e-6);
    std::vector<Tensor> grads;
    for (const Tensor& p : all)
      if (p.grad().defined()) grads.push_back(p.grad());
    NoGradGuard ng;
    foreach_mul_(grads, coef);
  }
  return norm;
}

Pipeline::Measured Pipeline::measure_last_step() {
  const int S = schedule_.num_stages(), M = schedule_.microbatches;
  const int tags = 2 * M * S;
  // One message of sums over the ranks: busy time; per stage and kind the
  // time and count of compute actions; per tag the send's post and the
  // receive's arrival (absolute seconds) and whether the receive waited.
  // The span by min and max.
  const int n_stage = 6 * S, off_tags = 1 + n_stage;
  std::vector<double> v(off_tags + 3 * tags, 0.0);
  double first = 1e300, last = -1e300;
  const double base = std::chrono::duration<double>(step_start_.time_since_epoch()).count();
  for (const ActionTime& t : times_) {
    v[0] += t.end - t.start;
    first = std::min(first, base + t.start);
    last = std::max(last, base + t.end);
    const int k = t.action.kind == ActionKind::F ? 0 : t.action.kind == ActionKind::B ? 1 : 2;
    v[1 + 6 * t.action.stage + k] += t.end - t.start;
    v[1 + 6 * t.action.stage + 3 + k] += 1;
  }
  for (auto& [t, at] : send_posted_) v[off_tags + 3 * t] = base + at;
  for (auto& [t, done] : recv_done_) {
    v[off_tags + 3 * t + 1] = base + done.first;
    v[off_tags + 3 * t + 2] = done.second ? 1 : 0;
  }
  Tensor sums = Tensor::from_vector(v, {static_cast<int64_t>(v.size())}, DType::Float64).to(pp_->device());
  Tensor lo = Tensor::from_vector({first}, {1}, DType::Float64).to(pp_->device());
  Tensor hi = Tensor::from_vector({last}, {1}, DType::Float64).to(pp_->device());
  pp_->allreduce(sums, ReduceOp::Sum)->wait();
  pp_->allreduce(lo, ReduceOp::Min)->wait();
  pp_->allreduce(hi, ReduceOp::Max)->wait();
  v = sums.to(kCPU).to_vector();
  Measured m;
  m.makespan = hi.to(kCPU).item() - lo.to(kCPU).item();
  m.bubble_fraction = m.makespan > 0 ? 1.0 - v[0] / (schedule_.ranks * m.makespan) : 0.0;
  double tot[3] = {0, 0, 0}, cnt[3] = {0, 0, 0};
  m.stage_costs.resize(S);
  for (int st = 0; st < S; ++st) {
    double* c[3] = {&m.stage_costs[st].f, &m.stage_costs[st].b, &m.stage_costs[st].w};
    for (int k = 0; k < 3; ++k) {
      const double sum = v[1 + 6 * st + k], n = v[1 + 6 * st + 3 + k];
      *c[k] = n > 0 ? sum / n : 0;
      tot[k] += sum, cnt[k] += n;
    }
  }
  m.costs.f = cnt[0] > 0 ? tot[0] / cnt[0] : 0;
  m.costs.b = cnt[1] > 0 ? tot[1] / cnt[1] : 0;
  m.costs.w = cnt[2] > 0 ? tot[2] / cnt[2] : 0;
  double lat = 0, waited = 0;
  for (int t = 0; t < tags; ++t) {
    const double post = v[off_tags + 3 * t], done = v[off_tags + 3 * t + 1];
    if (v[off_tags + 3 * t + 2] > 0 && post > 0 && done >= post) lat += done - post, waited += 1;
  }
  m.costs.comm = waited > 0 ? lat / waited : 0;
  for (Costs& c : m.stage_costs) c.comm = m.costs.comm;
  return m;
}

}  // namespace ember::distributed::pp
