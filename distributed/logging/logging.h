// Rank-aware printing for multi-process jobs: progress that only rank 0
// should print (log_rank0 / LOG0), and per-rank messages tagged with the rank
// (log_all / LOG_ALL). Arguments are concatenated like EMBER_CHECK's:
//
//   LOG0("epoch ", epoch, " loss ", loss);       // rank 0 only: "epoch 3 loss 0.41"
//   LOG_ALL("shard has ", n, " samples");         // every rank: "[rank 2] shard has 60000 samples"
//
// The rank comes from set_log_rank() when called (init_process_group may do
// so), else from RANK (torchrun, //tools:launch), else SLURM_PROCID, else 0.
// It is read from the environment rather than from the default process group
// so that this header sits below the rest of //distributed.
//
// EMBER_LOG_RANKS widens log_rank0 for debugging: "all" prints it on every
// rank, a comma list ("0,3") on those ranks, each line then tagged
// "[rank N] "; unset or "0" is the default (rank 0, untagged). Any other
// value throws ember::Error naming the variable.
//
// Every message goes out as one write(2) (one line per line of the message,
// each tagged), under a mutex, so lines from threads and from ranks sharing a
// pipe do not interleave mid-line.
#pragma once

#include <cstdio>
#include <string>

#include "core/exception.h"

namespace ember::distributed {

// The rank logging uses; -1 goes back to reading the environment.
void set_log_rank(int rank);
int log_rank();

// Where messages go; nullptr (the default) means stdout. For tests and for
// programs that want their logs in a file.
void set_log_sink(std::FILE* sink);

namespace detail {
// Whether log_rank0 prints on this rank, and whether it tags its lines.
bool log_rank0_enabled();
bool log_rank0_tagged();
// Writes msg (a newline is added when missing), each line tagged with
// "[rank N] " when `tagged`.
void log_write(const std::string& msg, bool tagged);
}  // namespace detail

template <typename... Args>
void log_rank0(const Args&... args) {
  if (detail::log_rank0_enabled()) detail::log_write(::ember::detail::str_cat(args...), detail::log_rank0_tagged());
}

template <typename... Args>
void log_all(const Args&... args) {
  detail::log_write(::ember::detail::str_cat(args...), /*tagged=*/true);
}

}  // namespace ember::distributed

// As log_rank0/log_all; LOG0 does not even evaluate its arguments on the
// ranks that stay silent.
#define LOG0(...)                                                                                \
  do {                                                                                           \
    if (::ember::distributed::detail::log_rank0_enabled())                                       \
      ::ember::distributed::detail::log_write(::ember::detail::str_cat(__VA_ARGS__),             \
                                              ::ember::distributed::detail::log_rank0_tagged()); \
  } while (0)

#define LOG_ALL(...) ::ember::distributed::log_all(__VA_ARGS__)
