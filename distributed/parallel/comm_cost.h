// The measured cost of each collective (the step-time cost model's
// communication half): bench/collectives_fit.py fits t = alpha * a(p) +
// beta * bytes * f(p) per collective and group size to
// //bench:collectives_fit's timings (ring factors a, f in its docstring) and
// writes, per group size, the model evaluated there:
//
//   t = latency_s + bytes * seconds_per_byte
//
// with `bytes` the whole buffer as the process group's counters count it
// (allreduce and broadcast: the tensor; all-gather: the output;
// reduce-scatter and all-to-all: the input; send/recv: the message).
//
//   auto model = distributed::CommCostModel::load("bench/results/collectives_fit.json");
//   double t = model->seconds("allreduce", 4 << 20, 4);
//
// Only fitted group sizes are answered (a group of another size is another
// link: on one machine its processes share the cores differently).
#pragma once

#include <absl/status/statusor.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace ember::distributed {

class CommCostModel {
 public:
  struct Fit {
    double latency_s = 0, seconds_per_byte = 0;
    double median_rel_error = 0, max_rel_error = 0;  // over the points it was fitted to
  };

  // The fitter's JSON; an error names the file and the field that is wrong.
  static absl::StatusOr<CommCostModel> load(const std::string& path);

  // Seconds for `op` ("allreduce", "allgather", "reduce_scatter",
  // "broadcast", "all_to_all", "send_recv") on `bytes` in a group of
  // `group_size`; an unknown op or a group size never fitted is an error
  // naming what there is.
  double seconds(const std::string& op, int64_t bytes, int group_size) const;
  const Fit& fit(const std::string& op, int group_size) const;
  std::vector<std::string> ops() const;
  std::vector<int> group_sizes(const std::string& op) const;

 private:
  std::map<std::string, std::map<int, Fit>> fits_;
};

}  // namespace ember::distributed
