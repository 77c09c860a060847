// The process-group backends' factories, for callers that build groups
// themselves over a store (init_process_group and new_group use them; so do
// tests and benchmarks that need a group without the default one).
//
//   auto pg = make_gloo_group(store, rank, world);   // CPU tensors over TCP
//   auto pg = make_nccl_group(store, rank, world);   // CUDA tensors; an error naming the cause without a GPU
#pragma once

#include <cstdint>
#include <memory>

#include "distributed/comm/process_group.h"
#include "distributed/store/store.h"

namespace ember::distributed {

// Gloo's ring reduce-scatter moves each step's block in pieces of at most
// this many bytes, so its receive buffer is one piece (the memory planner
// counts it).
constexpr int64_t kGlooRingPieceBytes = int64_t{1} << 20;

std::shared_ptr<ProcessGroup> make_gloo_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options = {});
std::shared_ptr<ProcessGroup> make_nccl_group(std::shared_ptr<Store> store, int rank, int size,
                                              ProcessGroupOptions options = {});

}  // namespace ember::distributed
