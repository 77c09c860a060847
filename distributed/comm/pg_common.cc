// Shared by the Gloo and NCCL process groups: Work completion, error
// messages that name the operation, the store-based signature check and the
// argument validation (see pg_common.h).
#include "distributed/comm/pg_common.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <optional>
#include <sstream>
#include <thread>

#include "core/exception.h"

namespace ember::distributed {

const char* reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::Sum:
      return "sum";
    case ReduceOp::Avg:
      return "avg";
    case ReduceOp::Max:
      return "max";
    case ReduceOp::Min:
      return "min";
    case ReduceOp::Product:
      return "product";
  }
  return "?";
}

int ProcessGroup::global_rank(int group_rank) const {
  EMBER_CHECK(group_rank >= 0 && group_rank < size_, backend_name(), " group: rank ", group_rank,
              " is outside the group's ranks [0, ", size_, ")");
  return global_ranks_[group_rank];
}

int ProcessGroup::group_rank_of(int global_rank) const {
  auto it = std::lower_bound(global_ranks_.begin(), global_ranks_.end(), global_rank);
  return it != global_ranks_.end() && *it == global_rank ? static_cast<int>(it - global_ranks_.begin()) : -1;
}

void ProcessGroup::set_global_ranks(std::vector<int> ranks) {
  EMBER_CHECK(static_cast<int>(ranks.size()) == size_, "set_global_ranks: ", ranks.size(), " ranks for a group of ",
              size_);
  EMBER_CHECK(std::is_sorted(ranks.begin(), ranks.end()), "set_global_ranks: the ranks must ascend");
  std::lock_guard<std::mutex> lock(fr_mu_);
  global_ranks_ = std::move(ranks);
  fr_group_.reset();  // the recorder's description names the members
}

void ProcessGroup::set_name(std::string name) {
  EMBER_CHECK(!name.empty(), backend_name(), " group: set_name needs a name");
  std::lock_guard<std::mutex> lock(fr_mu_);
  name_ = std::move(name);
  fr_group_.reset();
}

std::shared_ptr<const fr::GroupDesc> ProcessGroup::fr_group() const {
  std::lock_guard<std::mutex> lock(fr_mu_);
  if (!fr_group_) {  // made anew after set_name or set_global_ranks
    auto g = std::make_shared<fr::GroupDesc>();
    g->name = name_;
    g->ranks = global_ranks_;
    g->backend = backend_name();
    g->rank = rank_;
    fr_group_ = std::move(g);
  }
  return fr_group_;
}

// ---- Counters ----

namespace {
int64_t bytes_of(const Tensor& t) { return t.numel() * static_cast<int64_t>(dtype_size(t.dtype())); }
}  // namespace

void ProcessGroup::count(const char* op, int64_t bytes) {
  std::lock_guard<std::mutex> lock(counters_mu_);
  OpCount& c = counters_[op];
  c.calls += 1;
  c.bytes += bytes;
}

std::map<std::string, ProcessGroup::OpCount> ProcessGroup::counters() const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  return counters_;
}

ProcessGroup::OpCount ProcessGroup::counter(const std::string& op) const {
  std::lock_guard<std::mutex> lock(counters_mu_);
  auto it = counters_.find(op);
  return it == counters_.end() ? OpCount{} : it->second;
}

void ProcessGroup::reset_counters() {
  std::lock_guard<std::mutex> lock(counters_mu_);
  counters_.clear();
}

// ---- The validating front of every backend ----

void ProcessGroup::check_tensor(const Tensor& t, const std::string& where, const char* name) const {
  const Device d = device();
  EMBER_CHECK(t.device() == d, where, ": ", name, " is on ", t.device(), "; this ", backend_name(), " group works on ",
              d);
}

namespace {
// Defined, then the backend's own check.
#define EMBER_PG_TENSOR(t, w, name)    \
  do {                                 \
    detail::check_defined(t, w, name); \
    check_tensor(t, w, name);          \
  } while (0)

// What the flight recorder learns of this call from the front (the group,
// the tensors' sizes and dtypes, the peer, the caller's return address);
// the backend's next_op_info records it with the sequence number. Nothing
// is built when recording is off.
#define EMBER_FR_CALL(inputs, outputs, peer, tag)                                                                 \
  std::optional<fr::PendingCall> fr_call;                                                                         \
  if (fr::FlightRecorder::get().enabled())                                                                        \
  fr_call.emplace(fr_group(), std::vector<fr::TensorMeta> inputs, std::vector<fr::TensorMeta> outputs, peer, tag, \
                  __builtin_return_address(0))
}  // namespace

std::shared_ptr<Work> ProcessGroup::allreduce(const Tensor& tensor, ReduceOp op) {
  const std::string w = detail::where(backend_name(), "allreduce", rank_, size_);
  EMBER_PG_TENSOR(tensor, w, "tensor");
  detail::check_reduce_dtype(tensor.dtype(), op, w);
  detail::bump_version(tensor);
  count("allreduce", bytes_of(tensor));
  EMBER_FR_CALL({fr::meta(tensor)}, {fr::meta(tensor)}, -1, 0);
  return do_allreduce(tensor, op);
}

std::shared_ptr<Work> ProcessGroup::broadcast(const Tensor& tensor, int root) {
  const std::string w = detail::where(backend_name(), "broadcast", rank_, size_);
  EMBER_PG_TENSOR(tensor, w, "tensor");
  detail::check_root(root, size_, w);
  if (rank_ != root) detail::bump_version(tensor);
  count("broadcast", bytes_of(tensor));
  EMBER_FR_CALL({fr::meta(tensor)}, {fr::meta(tensor)}, -1, 0);
  return do_broadcast(tensor, root);
}

std::shared_ptr<Work> ProcessGroup::reduce(const Tensor& tensor, int root, ReduceOp op) {
  const std::string w = detail::where(backend_name(), "reduce", rank_, size_);
  EMBER_PG_TENSOR(tensor, w, "tensor");
  detail::check_root(root, size_, w);
  detail::check_reduce_dtype(tensor.dtype(), op, w);
  if (rank_ == root) detail::bump_version(tensor);
  count("reduce", bytes_of(tensor));
  EMBER_FR_CALL({fr::meta(tensor)}, {fr::meta(tensor)}, -1, 0);
  return do_reduce(tensor, root, op);
}

std::shared_ptr<Work> ProcessGroup::allgather(const std::vector<Tensor>& outputs, const Tensor& input) {
  const std::string w = detail::where(backend_name(), "allgather", rank_, size_);
  EMBER_PG_TENSOR(input, w, "input");
  detail::check_allgather_list(outputs, input, size_, w);
  for (size_t r = 0; r < outputs.size(); ++r) {
    const std::string name = "outputs[" + std::to_string(r) + "]";
    EMBER_PG_TENSOR(outputs[r], w, name.c_str());
  }
  for (const Tensor& o : outputs) detail::bump_version(o);
  int64_t bytes = 0;
  for (const Tensor& o : outputs) bytes += bytes_of(o);
  count("allgather", bytes);
  std::vector<fr::TensorMeta> outs;
  if (fr::FlightRecorder::get().enabled())
    for (const Tensor& o : outputs) outs.push_back(fr::meta(o));
  EMBER_FR_CALL({fr::meta(input)}, (std::move(outs)), -1, 0);
  return do_allgather(outputs, input);
}

std::shared_ptr<Work> ProcessGroup::allgather_into_tensor(const Tensor& output, const Tensor& input) {
  const std::string w = detail::where(backend_name(), "allgather_into_tensor", rank_, size_);
  EMBER_PG_TENSOR(output, w, "output");
  EMBER_PG_TENSOR(input, w, "input");
  detail::check_same_dtype(output, "output", input, "input", w);
  detail::check_flat_sizes(output, "output", input, "input", size_, w);
  detail::bump_version(output);
  count("allgather", bytes_of(output));
  EMBER_FR_CALL({fr::meta(input)}, {fr::meta(output)}, -1, 0);
  return do_allgather_into_tensor(output, input);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_front(const Tensor& output, const Tensor& input, ReduceOp op,
                                                         bool consume_input) {
  const std::string w = detail::where(backend_name(), "reduce_scatter_tensor", rank_, size_);
  EMBER_PG_TENSOR(output, w, "output");
  EMBER_PG_TENSOR(input, w, "input");
  detail::check_same_dtype(output, "output", input, "input", w);
  detail::check_flat_sizes(input, "input", output, "output", size_, w);
  detail::check_reduce_dtype(input.dtype(), op, w);
  detail::bump_version(output);
  if (consume_input) detail::bump_version(input);
  count("reduce_scatter", bytes_of(input));
  EMBER_FR_CALL({fr::meta(input)}, {fr::meta(output)}, -1, 0);
  return do_reduce_scatter_tensor(output, input, op, consume_input);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_tensor(const Tensor& output, const Tensor& input, ReduceOp op) {
  return reduce_scatter_front(output, input, op, false);
}

std::shared_ptr<Work> ProcessGroup::reduce_scatter_tensor_consuming_input(const Tensor& output, const Tensor& input,
                                                                          ReduceOp op) {
  return reduce_scatter_front(output, input, op, true);
}

std::shared_ptr<Work> ProcessGroup::all_to_all_single(const Tensor& output, const Tensor& input) {
  const std::string w = detail::where(backend_name(), "all_to_all_single", rank_, size_);
  EMBER_PG_TENSOR(output, w, "output");
  EMBER_PG_TENSOR(input, w, "input");
  detail::check_same_dtype(output, "output", input, "input", w);
  EMBER_CHECK(output.numel() == input.numel(), w, ": output has shape ", shape_str(output.sizes()),
              " but input has shape ", shape_str(input.sizes()), " (equal splits need equal numel)");
  EMBER_CHECK(input.numel() % size_ == 0, w, ": input has ", input.numel(), " elements (shape ",
              shape_str(input.sizes()), "), not divisible into ", size_, " equal blocks");
  detail::bump_version(output);
  count("all_to_all", bytes_of(input));
  EMBER_FR_CALL({fr::meta(input)}, {fr::meta(output)}, -1, 0);
  return do_all_to_all_single(output, input);
}

std::shared_ptr<Work> ProcessGroup::all_to_all_single(const Tensor& output, const Tensor& input,
                                                      const std::vector<int64_t>& output_split_sizes,
                                                      const std::vector<int64_t>& input_split_sizes) {
  const std::string w = detail::where(backend_name(), "all_to_all_single (uneven splits)", rank_, size_);
  EMBER_PG_TENSOR(output, w, "output");
  EMBER_PG_TENSOR(input, w, "input");
  detail::check_same_dtype(output, "output", input, "input", w);
  EMBER_CHECK(output.dim() >= 1 && input.dim() >= 1, w, ": output ", shape_str(output.sizes()), " and input ",
              shape_str(input.sizes()), " need a dim 0 to split");
  const Shape out_row(output.sizes().begin() + 1, output.sizes().end()),
      in_row(input.sizes().begin() + 1, input.sizes().end());
  EMBER_CHECK(out_row == in_row, w, ": output ", shape_str(output.sizes()), " and input ", shape_str(input.sizes()),
              " have rows of different shapes");
  auto elems = [&](const std::vector<int64_t>& splits, const Tensor& t, const char* name) {
    EMBER_CHECK(static_cast<int>(splits.size()) == size_, w, ": ", name, " has ", splits.size(),
                " entries for a group of ", size_);
    int64_t sum = 0;
    for (int64_t s : splits) {
      EMBER_CHECK(s >= 0, w, ": ", name, " has a negative size ", s);
      sum += s;
    }
    EMBER_CHECK(sum == t.sizes()[0], w, ": ", name, " sums to ", sum, " rows but the tensor is ", shape_str(t.sizes()));
    std::vector<int64_t> out;
    const int64_t row = shape_numel(in_row);
    for (int64_t s : splits) out.push_back(s * row);
    return out;
  };
  std::vector<int64_t> out_elems = elems(output_split_sizes, output, "output_split_sizes");
  std::vector<int64_t> in_elems = elems(input_split_sizes, input, "input_split_sizes");
  // What this rank sends itself is what it receives from itself.
  EMBER_CHECK(output_split_sizes[rank_] == input_split_sizes[rank_], w, ": input_split_sizes[", rank_,
              "] = ", input_split_sizes[rank_], " rows to itself but output_split_sizes[", rank_,
              "] = ", output_split_sizes[rank_], " from itself");
  detail::bump_version(output);
  count("all_to_all", bytes_of(input));
  EMBER_FR_CALL({fr::meta(input)}, {fr::meta(output)}, -1, 0);
  Tensor in = input.contiguous();
  if (output.is_contiguous()) return do_all_to_all_v(output, in, out_elems, in_elems);
  Tensor out = Tensor::empty(output.sizes(), output.options());
  std::shared_ptr<Work> work = do_all_to_all_v(out, in, out_elems, in_elems);
  work->wait();
  Tensor(output).copy_(out);
  return work;
}

std::shared_ptr<Work> ProcessGroup::barrier() {
  EMBER_FR_CALL({}, {}, -1, 0);
  return do_barrier();
}

std::shared_ptr<Work> ProcessGroup::send(const Tensor& tensor, int dst, int tag) {
  const std::string w = detail::where(backend_name(), "send", rank_, size_);
  EMBER_PG_TENSOR(tensor, w, "tensor");
  detail::check_peer(dst, rank_, size_, w);
  count("send", bytes_of(tensor));
  EMBER_FR_CALL({fr::meta(tensor)}, {}, global_rank(dst), tag);
  return do_send(tensor, dst, tag);
}

std::shared_ptr<Work> ProcessGroup::recv(const Tensor& tensor, int src, int tag) {
  const std::string w = detail::where(backend_name(), "recv", rank_, size_);
  EMBER_PG_TENSOR(tensor, w, "tensor");
  detail::check_peer(src, rank_, size_, w);
  detail::bump_version(tensor);
  count("recv", bytes_of(tensor));
  EMBER_FR_CALL({}, {fr::meta(tensor)}, global_rank(src), tag);
  return do_recv(tensor, src, tag);
}

void ProcessGroup::connect_p2p(const std::vector<std::pair<int, int>>& edges) {
  const std::string w = detail::where(backend_name(), "connect_p2p", rank_, size_);
  for (const auto& [src, dst] : edges)
    EMBER_CHECK(src >= 0 && src < size_ && dst >= 0 && dst < size_ && src != dst, w, ": edge (", src, ", ", dst,
                ") is not a pair of two ranks of a group of ", size_);
  do_connect_p2p(edges);
}

#undef EMBER_PG_TENSOR
#undef EMBER_FR_CALL

namespace detail {

std::string OpInfo::describe() const {
  std::ostringstream os;
  os << op << " (" << (collective ? "collective #" : "p2p op #") << seq << ", " << backend << " group "
     << (group.empty() ? "" : group + " ") << "rank " << rank << " of " << size << ", timeout " << timeout.count()
     << " ms)";
  return os.str();
}

Error unusable_group_error(const std::string& what, const std::string& first_failure) {
  return Error(what + ": this group can no longer be used; an earlier operation failed: " + first_failure);
}

OpInfo next_op_info(OpCounters& counters, const char* op, bool collective, const std::string& backend, int rank,
                    int size, Millis timeout, Signature signature) {
  OpInfo info;
  info.op = op;
  info.seq = collective ? counters.collectives++ : counters.p2p++;
  info.collective = collective;
  info.backend = backend;
  info.rank = rank;
  info.size = size;
  info.timeout = timeout;
  info.signature = std::move(signature.text);
  info.bytes = signature.bytes;
  info.fr_id = fr::FlightRecorder::get().record_op(op, !collective, info.seq, timeout.count());
  if (const fr::PendingCall* call = fr::current_call(); call && call->group) info.group = call->group->name;
  return info;
}

Signature make_signature(const std::string& op, const Tensor* tensor, int64_t numel, int root, const ReduceOp* reduce) {
  std::ostringstream os;
  os << "op=" << op << " dtype=" << (tensor ? dtype_name(tensor->dtype()) : "none") << " numel=" << numel
     << " root=" << root;
  if (reduce) os << " reduce=" << reduce_op_name(*reduce);
  return {os.str(), tensor ? numel * static_cast<int64_t>(dtype_size(tensor->dtype())) : 0};
}

Signature make_uneven_signature(const std::string& op, const Tensor& input) {
  Signature s = make_signature(op, &input, -1, -1, nullptr);
  s.bytes = bytes_of(input);
  return s;
}

CollectiveEvent::CollectiveEvent(const OpInfo& info, const std::string& group)
    : scope_(profiler::Kind::Collective, info.op) {
  if (!scope_.active()) return;
  begin_ns_ = profiler::now_ns();
  scope_.arg("bytes", info.bytes);
  scope_.arg("seq", info.seq);
  scope_.arg("group", group);
  const int64_t queued = std::chrono::duration_cast<std::chrono::nanoseconds>(PgClock::now() - info.enqueued).count();
  scope_.arg("queued_us", info.enqueued == PgClock::time_point{} ? 0 : queued / 1000);
}

void CollectiveEvent::transfer_started() {
  if (scope_.active()) scope_.arg("peer_wait_us", (profiler::now_ns() - begin_ns_) / 1000);
}

namespace {
std::string what_of(std::exception_ptr e);
}  // namespace

// ---- CompletionWork ----

bool CompletionWork::is_completed() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

bool CompletionWork::is_success() {
  std::lock_guard<std::mutex> lock(mu_);
  return done_ && !error_;
}

}  // namespace detail

namespace {
thread_local double t_wait_seconds = 0;
}  // namespace

double thread_wait_seconds() { return t_wait_seconds; }
detail::WaitClock::~WaitClock() { t_wait_seconds += std::chrono::duration<double>(PgClock::now() - start_).count(); }

namespace detail {

void CompletionWork::wait() {
  WaitClock clock;
  // The caller's blocked time: with the collective's own event (on the
  // thread that ran it) this splits waiting from transferring.
  profiler::Scope prof(profiler::Kind::Wait, profiler::enabled() ? "wait " + info_.op : std::string());
  if (prof.active()) prof.arg("seq", info_.seq);
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return done_; });
  if (error_) std::rethrow_exception(error_);
}

bool CompletionWork::wait(Millis timeout) {
  WaitClock clock;
  std::unique_lock<std::mutex> lock(mu_);
  if (!cv_.wait_for(lock, timeout, [&] { return done_; })) return false;
  if (error_) std::rethrow_exception(error_);
  return true;
}

std::exception_ptr CompletionWork::exception() {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

void CompletionWork::finish(std::exception_ptr error) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    if (finishing_) {
      // Another thread is finishing it (NCCL's watchdog and a poll): once
      // that is done, so is this call.
      cv_.wait(lock, [&] { return done_; });
      return;
    }
    finishing_ = true;
  }
  // Recorded, and the process's first failure dumped, before the work
  // counts as done: no waiter or poller can see the error (and let it end
  // the process) while the dump is still being written.
  fr::FlightRecorder& recorder = fr::FlightRecorder::get();
  if (error) {
    const std::string msg = what_of(error);
    recorder.finished(info_.fr_id, msg);
    recorder.dump_on_failure("operation failed: " + msg);
  } else {
    recorder.finished(info_.fr_id);
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = std::move(error);
  }
  cv_.notify_all();
}

// ---- Errors ----

namespace {
std::string what_of(std::exception_ptr e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& ex) {
    return ex.what();
  } catch (...) {
    return "unknown exception";
  }
}

bool contains(const std::string& s, const char* needle) { return s.find(needle) != std::string::npos; }
}  // namespace

bool is_connection_loss(std::exception_ptr cause) {
  const std::string msg = what_of(cause);
  return contains(msg, "closed") || contains(msg, "reset by peer") || contains(msg, "Broken pipe") ||
         contains(msg, "Connection refused");
}

std::vector<LostRank> lost_ranks_within(Store& store, Millis within, std::string* store_error,
                                        PgClock::time_point born) {
  const auto until = PgClock::now() + within;
  for (;;) {
    std::vector<LostRank> lost;
    try {
      lost = born == PgClock::time_point{}
                 ? store.lost_ranks()
                 : store.lost_ranks_since(std::chrono::duration_cast<Millis>(PgClock::now() - born));
    } catch (const std::exception& e) {
      if (store_error) *store_error = e.what();  // the store is gone too: its host died
      return {};
    }
    if (!lost.empty() || PgClock::now() >= until) return lost;
    std::this_thread::sleep_for(Millis{20});
  }
}

std::exception_ptr op_error(const OpInfo& info, std::exception_ptr cause, Millis elapsed,
                            const std::vector<LostRank>& lost, const std::string& store_error) {
  std::string msg = what_of(cause);
  // Already one of ours (a signature check, a failed group): keep it as is.
  if (msg.rfind(info.describe(), 0) == 0) return cause;
  const bool timed_out = contains(msg, "Timed out") || contains(msg, "timed out") || contains(msg, "timeout");
  std::ostringstream os;
  os << info.describe() << (timed_out ? " timed out" : " failed") << " after " << elapsed.count() << " ms: " << msg;
  if (!lost.empty()) {
    os << " (";
    for (size_t i = 0; i < lost.size(); ++i) os << (i ? ", " : "") << lost[i].describe();
    os << (lost.size() == 1 ? " has" : " have")
       << " left the job without saying goodbye: the process exited, crashed or was killed)";
  } else if (is_connection_loss(cause) && !store_error.empty()) {
    os << " (a peer process exited or closed its connection in the middle of the operation, and the store "
       << "cannot be reached either: " << store_error << ")";
  } else if (is_connection_loss(cause)) {
    os << " (a peer process exited or closed its connection in the middle of the operation)";
  } else if (timed_out) {
    os << " (a peer is slow, hung, dead, or did not call this collective; the op's timeout is " << info.timeout.count()
       << " ms)";
  }
  return std::make_exception_ptr(Error(os.str()));
}

// ---- Signature check ----

namespace {
Millis left(PgClock::time_point deadline) {
  auto l = std::chrono::duration_cast<Millis>(deadline - PgClock::now());
  // Store waits of 0 ms may be read as "no timeout" by some stores; 1 ms is
  // as good as expired.
  return std::max(l, Millis{1});
}

std::string key(int64_t seq, const std::string& leaf) { return "sig/" + std::to_string(seq) + "/" + leaf; }

std::string as_string(const Bytes& b) { return std::string(b.begin(), b.end()); }
}  // namespace

void check_signature(Store& store, const OpInfo& info, PgClock::time_point deadline) {
  if (info.size <= 1) return;
  const std::string verdict_key = key(info.seq, "verdict");
  if (info.rank != 0) {
    store.set(key(info.seq, std::to_string(info.rank)), info.signature);
    // Rank 0 publishes a verdict naming the missing ranks when its own wait
    // expires at about the same deadline; a short grace lets us read it
    // rather than time out with less to say.
    const Millis grace = std::min<Millis>(info.timeout / 2, Millis{5000});
    try {
      store.wait({verdict_key}, left(deadline + grace));
    } catch (const RankLostError& e) {
      throw Error(info.describe() + ": signature check: " + e.what());
    } catch (const Error& e) {
      throw Error(::ember::detail::str_cat(
          info.describe(), ": signature check: rank 0 did not compare the ranks' calls within ", info.timeout.count(),
          " ms (rank 0 is dead, hung, or has not reached collective #", info.seq, "; this rank called ", info.signature,
          "): ", e.what()));
    }
    std::string verdict = as_string(store.get(verdict_key));
    if (verdict == "ok") return;
    throw Error(info.describe() + ": " + verdict);
  }

  // Rank 0: gather, compare, publish.
  std::vector<std::string> keys;
  for (int r = 1; r < info.size; ++r) keys.push_back(key(info.seq, std::to_string(r)));
  auto publish = [&](const std::string& verdict) {
    try {
      store.set(verdict_key, verdict);
    } catch (const std::exception&) {
      // The store itself failing is reported by the caller's own error.
    }
  };
  try {
    store.wait(keys, left(deadline));
  } catch (const RankLostError& e) {
    std::string msg = std::string("signature check: ") + e.what();
    publish(msg);
    throw Error(info.describe() + ": " + msg);
  } catch (const Error& e) {
    std::string missing;
    for (int r = 1; r < info.size; ++r) {
      bool here = false;
      try {
        here = store.check({keys[r - 1]});
      } catch (const std::exception&) {
      }
      if (!here) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    std::string msg = ::ember::detail::str_cat(
        "signature check: rank(s) ", missing, " did not reach collective #", info.seq, " within ", info.timeout.count(),
        " ms (dead, hung, or calling something else)", "; rank 0 called ", info.signature);
    publish(msg);
    throw Error(info.describe() + ": " + msg + " [store: " + e.what() + "]");
  }
  std::string mismatches;
  for (int r = 1; r < info.size; ++r) {
    std::string theirs = as_string(store.get(keys[r - 1]));
    store.delete_key(keys[r - 1]);
    if (theirs != info.signature) mismatches += ::ember::detail::str_cat("; rank ", r, " called ", theirs);
  }
  if (!mismatches.empty()) {
    std::string msg = ::ember::detail::str_cat(
        "signature mismatch at collective #", info.seq, ": rank 0 called ", info.signature, mismatches,
        " (every rank must call the same collectives in the same order with the same "
        "dtype, numel and root)");
    publish(msg);
    throw Error(info.describe() + ": " + msg);
  }
  store.set(verdict_key, std::string("ok"));
  // Every rank has posted its signature for this collective, so all of them
  // have read the previous verdict: it can go.
  if (info.seq > 0) store.delete_key(key(info.seq - 1, "verdict"));
}

// ---- Validation ----

std::string where(const std::string& backend, const char* op, int rank, int size) {
  return ::ember::detail::str_cat(backend, " ", op, " (rank ", rank, " of ", size, ")");
}

void check_defined(const Tensor& t, const std::string& where, const char* name) {
  EMBER_CHECK(t.defined(), where, ": ", name, " is an undefined tensor");
}

void check_group_args(const char* factory, const Store* store, int rank, int size, const ProcessGroupOptions& options) {
  EMBER_CHECK(store != nullptr, factory, ": store is null");
  EMBER_CHECK(size >= 1, factory, ": group size ", size, " must be at least 1");
  EMBER_CHECK(rank >= 0 && rank < size, factory, ": rank ", rank, " is not in a group of size ", size);
  EMBER_CHECK(options.timeout.count() > 0, factory, ": timeout must be positive, got ", options.timeout.count(), " ms");
}

void check_root(int root, int size, const std::string& where) {
  EMBER_CHECK(root >= 0 && root < size, where, ": root ", root, " is not a rank of a group of size ", size);
}

void check_peer(int peer, int rank, int size, const std::string& where) {
  EMBER_CHECK(peer >= 0 && peer < size, where, ": peer rank ", peer, " is not in a group of size ", size);
  EMBER_CHECK(peer != rank, where, ": peer rank ", peer, " is this rank; send/recv need another rank");
}

void check_same_dtype(const Tensor& a, const char* a_name, const Tensor& b, const char* b_name,
                      const std::string& where) {
  EMBER_CHECK(a.dtype() == b.dtype(), where, ": ", a_name, " has dtype ", a.dtype(), " (shape ", shape_str(a.sizes()),
              ") but ", b_name, " has dtype ", b.dtype(), " (shape ", shape_str(b.sizes()), ")");
}

void check_flat_sizes(const Tensor& big, const char* big_name, const Tensor& small, const char* small_name, int factor,
                      const std::string& where) {
  EMBER_CHECK(big.numel() == factor * small.numel(), where, ": ", big_name, " has shape ", shape_str(big.sizes()), " (",
              big.numel(), " elements) but must hold group size ", factor, " x ", small_name, " numel ", small.numel(),
              " = ", factor * small.numel(), " elements (", small_name, " shape ", shape_str(small.sizes()), ")");
}

void check_allgather_list(const std::vector<Tensor>& outputs, const Tensor& input, int size, const std::string& where) {
  EMBER_CHECK(static_cast<int>(outputs.size()) == size, where, ": got ", outputs.size(),
              " output tensors but the group has ", size, " ranks (one output per rank)");
  for (size_t r = 0; r < outputs.size(); ++r) {
    const std::string name = "outputs[" + std::to_string(r) + "]";
    check_defined(outputs[r], where, name.c_str());
    EMBER_CHECK(outputs[r].numel() == input.numel(), where, ": ", name, " has shape ", shape_str(outputs[r].sizes()),
                " but input has shape ", shape_str(input.sizes()), " (numel must match)");
    check_same_dtype(outputs[r], name.c_str(), input, "input", where);
  }
}

void check_reduce_dtype(DType dtype, ReduceOp op, const std::string& where) {
  EMBER_CHECK(!(dtype == DType::Bool && op == ReduceOp::Avg), where,
              ": ReduceOp avg is not defined for bool tensors (use max for 'any' or min for 'all')");
}

// One decision for the GPU of a rank: the option init_process_group fills
// from its resolved environment, else $LOCAL_RANK, else the rank.
int local_device_index(const ProcessGroupOptions& options, int rank, int device_count) {
  EMBER_CHECK(device_count > 0, "process group: no GPU to place rank ", rank, " on");
  int index = rank;
  if (options.local_rank >= 0) {
    index = options.local_rank;
  } else if (const char* local = std::getenv("LOCAL_RANK"); local && *local) {
    index = std::atoi(local);
  }
  EMBER_CHECK(index >= 0, "process group: LOCAL_RANK=", index, " must be at least 0");
  return index % device_count;
}

bool signature_checks_enabled(const ProcessGroupOptions& options) {
  if (options.check_signatures) return true;
  for (const char* name : {"EMBER_DISTRIBUTED_DEBUG", "TORCH_DISTRIBUTED_DEBUG"}) {
    const char* v = std::getenv(name);
    if (v && *v) {
      std::string level = v;
      for (char& c : level) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));  // as torch reads it
      EMBER_CHECK(level == "OFF" || level == "INFO" || level == "DETAIL", name, "=", v,
                  " is not a debug level; use OFF, INFO or DETAIL (DETAIL checks every collective's signature)");
      return level == "DETAIL";
    }
  }
  return false;
}

}  // namespace detail
}  // namespace ember::distributed
