// The mesh planner: which dp_replicate x dp_shard x tp x pp mesh (with its
// pipeline schedule, micro-batches and activation checkpointing) to train a
// model with on N GPUs, from per-rank memory and an estimated step time.
// It extends the memory planner (memory_plan.h: the ZeRO paper's
// accounting of parameters, gradients and optimizer state, applied to what
// one rank's stage and tensor-parallel shard hold) with activations
// (Korthikanti et al. 2022: s·b·h·34 bytes per layer and micro-batch in
// 16 bits, divided by tp under sequence parallelism; the attention scores'
// 5·a·s/h term is absent because attention is fused, as ember's and
// FlashAttention's; 2·s·b·h with full recompute), times the micro-batches
// a schedule keeps alive on its first rank (1F1B and ZB-H1: pp; interleaved:
// pp·(1 + (pp-1)/(pp·v)); GPipe: all), and with a step time: step_cost.h's
// predict_step (the last stage's compute from its FLOPs, stretched by the
// schedule's bubble; every collective of tp, dp and pp counted, what the
// backward hides subtracted), by default over Hardware's peak and links
// (bandwidth and latency per link kind, no contention), or over a
// measured ComputeProfile and collectives' fits (PlanOptions::compute,
// links). Each dimension's group spans hosts when its stride × size
// exceeds the GPUs per host (tp innermost, then dp_shard, dp_replicate, pp
// outermost, as //examples:gpt lays the mesh out): then it gets the
// inter-host link.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "distributed/parallel/plan_types.h"

namespace ember::distributed {

struct MeshPlan {
  ModelSpec model;
  Hardware hw;
  PlanOptions options;
  std::vector<MeshCandidate> feasible;  // fastest first
  std::vector<MeshCandidate> rejected;
  const MeshCandidate& best() const;
  // The best few with their memory and time breakdown, then how many were
  // rejected and for which reasons (each reason once, with a count and an
  // example mesh).
  std::string table() const;
};

MeshPlan plan_mesh(const ModelSpec& model, const Hardware& hw, const PlanOptions& options);

// One mesh: `c` gives the dimensions, schedule, virtual stages,
// micro-batches per data-parallel rank, AC policy and offload; the result
// has its memory and time filled in, or `rejected` set. What plan_mesh
// does for each candidate, and what //examples:gpt prints for its own run.
MeshCandidate evaluate_mesh(const ModelSpec& model, const Hardware& hw, const PlanOptions& options, MeshCandidate c);

}  // namespace ember::distributed
