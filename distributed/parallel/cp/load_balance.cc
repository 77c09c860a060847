// Head-tail sequence layout of context parallelism (load_balance.h).
#include "distributed/parallel/cp/load_balance.h"

#include "core/exception.h"
#include "core/ops.h"

namespace ember::distributed::cp {
namespace {

void check_rank(int cp, int rank) {
  EMBER_CHECK(cp >= 1, "context parallel: cp must be at least 1, got ", cp);
  EMBER_CHECK(rank >= 0 && rank < cp, "context parallel: rank ", rank, " is not in [0, ", cp, ")");
}

}  // namespace

int64_t chunk_length(int64_t seq, int cp) {
  EMBER_CHECK(cp >= 1, "context parallel: cp must be at least 1, got ", cp);
  EMBER_CHECK(seq > 0 && seq % (2 * cp) == 0, "context parallel: the sequence length ", seq,
              " must be a multiple of 2 x cp = ", 2 * cp,
              " (load balancing cuts it into 2·cp chunks, each rank holding a head and a tail chunk)");
  return seq / (2 * cp);
}

std::vector<int64_t> positions(int64_t seq, int cp, int rank) {
  check_rank(cp, rank);
  const int64_t c = chunk_length(seq, cp);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(2 * c));
  for (int64_t chunk : {int64_t{rank}, int64_t{2 * cp - 1 - rank}})
    for (int64_t i = 0; i < c; ++i) out.push_back(chunk * c + i);
  return out;
}

Tensor shard(const Tensor& x, int64_t dim, int cp, int rank) {
  check_rank(cp, rank);
  EMBER_CHECK(x.defined(), "context parallel shard: the tensor is undefined");
  const int64_t d = dim < 0 ? dim + x.dim() : dim;
  EMBER_CHECK(d >= 0 && d < x.dim(), "context parallel shard: dim ", dim, " is not a dim of ", shape_str(x.sizes()));
  const int64_t c = chunk_length(x.size(d), cp);
  return cat({x.narrow(d, rank * c, c), x.narrow(d, (2 * cp - 1 - rank) * c, c)}, d);
}

Tensor unshard(const std::vector<Tensor>& parts, int64_t dim, int cp) {
  EMBER_CHECK(static_cast<int>(parts.size()) == cp, "context parallel unshard: ", parts.size(),
              " slices for cp = ", cp);
  const int64_t d = dim < 0 ? dim + parts[0].dim() : dim;
  EMBER_CHECK(d >= 0 && d < parts[0].dim(), "context parallel unshard: dim ", dim, " is not a dim of ",
              shape_str(parts[0].sizes()));
  const int64_t local = parts[0].size(d);
  EMBER_CHECK(local % 2 == 0, "context parallel unshard: a slice of ", local, " holds no two equal chunks");
  const int64_t c = local / 2;
  std::vector<Tensor> chunks(static_cast<size_t>(2 * cp));
  for (int r = 0; r < cp; ++r) {
    EMBER_CHECK(parts[r].sizes() == parts[0].sizes(), "context parallel unshard: slice ", r, " is ",
                shape_str(parts[r].sizes()), ", slice 0 ", shape_str(parts[0].sizes()));
    chunks[r] = parts[r].narrow(d, 0, c);
    chunks[2 * cp - 1 - r] = parts[r].narrow(d, c, c);
  }
  return cat(chunks, d);
}

}  // namespace ember::distributed::cp
