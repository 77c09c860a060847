// The flight recorder's cost per process-group operation: what every
// collective and transfer pays with recording on (distributed/comm/
// flight_recorder.h): the front's PendingCall (the group, one input and one
// output's sizes and dtypes), the scheduled entry, started, completed. One
// thread, and 2 threads recording at once (DDP's hooks and the main thread
// share the ring's lock).
//
//   bazel run -c opt //bench:flight_recorder_bench
#include <benchmark/benchmark.h>

#include <memory>

#include "distributed/comm/flight_recorder.h"

namespace ember::distributed::fr {
namespace {

void BM_RecordOp(benchmark::State& state) {
  static FlightRecorder* rec = nullptr;
  static std::shared_ptr<GroupDesc> group;
  if (state.thread_index() == 0) {
    rec = new FlightRecorder(2000);
    group = std::make_shared<GroupDesc>(GroupDesc{"dp_shard", {0, 1, 2, 3, 4, 5, 6, 7}, "gloo", 0});
  }
  int64_t seq = 0;
  for (auto _ : state) {
    PendingCall call(group, {{{4096, 1024}, DType::Float32}}, {{{4096, 1024}, DType::Float32}}, -1, 0, nullptr);
    const int64_t id = rec->record_op("allreduce", false, seq++, 600000);
    rec->started(id);
    rec->finished(id);
  }
  state.SetItemsProcessed(state.iterations());
  if (state.thread_index() == 0) {
    delete rec;
    rec = nullptr;
  }
}
BENCHMARK(BM_RecordOp)->Threads(1)->Threads(2)->UseRealTime();

}  // namespace
}  // namespace ember::distributed::fr
