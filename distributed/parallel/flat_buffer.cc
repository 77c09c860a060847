// FlatBuffer: the layout (offsets, padding, shards), the views and the two
// collectives that move a flat buffer between its sharded and whole forms.
#include "distributed/parallel/flat_buffer.h"

#include <algorithm>
#include <set>

#include "core/autograd_hook.h"
#include "core/ops.h"

namespace ember::distributed {

FlatBuffer::FlatBuffer(const std::vector<std::pair<std::string, Shape>>& entries, TensorOptions options, int world_size,
                       const std::vector<MemoryFormat>& formats)
    : world_size_(world_size) {
  EMBER_CHECK(world_size >= 1, "FlatBuffer: world_size must be at least 1, got ", world_size);
  EMBER_CHECK(formats.empty() || formats.size() == entries.size(), "FlatBuffer: ", formats.size(), " formats for ",
              entries.size(), " entries");
  std::set<std::string> names;
  for (const auto& [name, shape] : entries) {
    EMBER_CHECK(names.insert(name).second, "FlatBuffer: entry '", name, "' appears twice");
    FlatEntry e{name, shape, numel_, shape_numel(shape)};
    EMBER_CHECK(e.numel >= 0, "FlatBuffer: entry '", name, "' has an invalid shape ", shape_str(shape));
    if (!formats.empty() && formats[entries_.size()] == MemoryFormat::ChannelsLast) {
      EMBER_CHECK(shape.size() == 4, "FlatBuffer: entry '", name, "' ", shape_str(shape),
                  " cannot be channels-last: it is not 4-D");
      EMBER_CHECK(world_size == 1, "FlatBuffer: entry '", name, "' is channels-last in a buffer sharded ", world_size,
                  " ways; shards count elements in logical order, so sharded entries are contiguous");
      e.format = MemoryFormat::ChannelsLast;
    }
    numel_ += e.numel;
    entries_.push_back(std::move(e));
  }
  const int64_t padded = (numel_ + world_size - 1) / world_size * world_size;
  // Zeroed: the padding must stay zero (it is reduced and gathered too).
  flat_ = zeros({padded}, options);
  for (size_t i = 0; i < entries_.size(); ++i) views_.push_back(view_in(flat_, i));
}

Tensor FlatBuffer::view_in(const Tensor& buffer, size_t i) const {
  EMBER_CHECK(i < entries_.size(), "FlatBuffer::view_in: entry ", i, " out of range (", entries_.size(), " entries)");
  EMBER_CHECK(buffer.dim() == 1 && buffer.numel() == padded_numel(), "FlatBuffer::view_in: buffer ",
              shape_str(buffer.sizes()), " is not laid out as this one (", padded_numel(), " elements)");
  const FlatEntry& e = entries_[i];
  Tensor piece = buffer.narrow(0, e.offset, e.numel);
  if (e.format == MemoryFormat::Contiguous) return piece.view(e.shape);
  // NHWC memory behind NCHW sizes, as Tensor::empty(..., ChannelsLast).
  return piece.view({e.shape[0], e.shape[2], e.shape[3], e.shape[1]}).permute({0, 3, 1, 2});
}

FlatBuffer FlatBuffer::from_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors, int world_size) {
  EMBER_CHECK(!tensors.empty(), "FlatBuffer::from_tensors: no tensors");
  std::vector<std::pair<std::string, Shape>> layout;
  const Tensor& first = tensors.front().second;
  for (const auto& [name, t] : tensors) {
    EMBER_CHECK(t.defined(), "FlatBuffer::from_tensors: '", name, "' is undefined");
    EMBER_CHECK(t.dtype() == first.dtype() && t.device() == first.device(), "FlatBuffer::from_tensors: '", name,
                "' is ", t.dtype(), " on ", t.device(), " but '", tensors.front().first, "' is ", first.dtype(), " on ",
                first.device(), "; one buffer holds one dtype on one device");
    layout.emplace_back(name, t.sizes());
  }
  FlatBuffer fb(layout, first.options(), world_size);
  std::vector<Tensor> values;
  for (const auto& [name, t] : tensors) values.push_back(t);
  fb.copy_from(values);
  return fb;
}

const Tensor& FlatBuffer::view(size_t i) const {
  EMBER_CHECK(i < views_.size(), "FlatBuffer::view: entry ", i, " out of range (", views_.size(), " entries)");
  return views_[i];
}

std::optional<size_t> FlatBuffer::find(const std::string& name) const {
  for (size_t i = 0; i < entries_.size(); ++i)
    if (entries_[i].name == name) return i;
  return std::nullopt;
}

Tensor FlatBuffer::shard(int rank) const {
  EMBER_CHECK(rank >= 0 && rank < world_size_, "FlatBuffer::shard: rank ", rank, " out of range (world size ",
              world_size_, ")");
  return flat_.narrow(0, rank * shard_numel(), shard_numel());
}

std::vector<FlatBuffer::Piece> FlatBuffer::pieces(int rank) const {
  EMBER_CHECK(rank >= 0 && rank < world_size_, "FlatBuffer::pieces: rank ", rank, " out of range (world size ",
              world_size_, ")");
  const int64_t begin = rank * shard_numel(), end = begin + shard_numel();
  std::vector<Piece> out;
  for (size_t i = 0; i < entries_.size(); ++i) {
    const FlatEntry& e = entries_[i];
    const int64_t lo = std::max(begin, e.offset), hi = std::min(end, e.offset + e.numel);
    if (lo < hi) out.push_back(Piece{i, lo - e.offset, lo - begin, hi - lo});
  }
  return out;
}

void FlatBuffer::copy_from(const std::vector<Tensor>& tensors) const {
  EMBER_CHECK(tensors.size() == entries_.size(), "FlatBuffer::copy_from: ", tensors.size(), " tensors for ",
              entries_.size(), " entries");
  NoGradGuard no_grad;
  for (size_t i = 0; i < tensors.size(); ++i) {
    EMBER_CHECK(tensors[i].sizes() == entries_[i].shape, "FlatBuffer::copy_from: '", entries_[i].name, "' has shape ",
                shape_str(entries_[i].shape), ", the tensor ", shape_str(tensors[i].sizes()));
    Tensor v = views_[i];
    v.copy_(tensors[i]);
  }
}

void FlatBuffer::adopt(const std::vector<Tensor>& tensors) const {
  // Every entry checked before any tensor moves (copy_from checks count and shapes).
  EMBER_CHECK(tensors.size() == entries_.size(), "FlatBuffer::adopt: ", tensors.size(), " tensors for ",
              entries_.size(), " entries");
  for (size_t i = 0; i < tensors.size(); ++i)
    EMBER_CHECK(tensors[i].defined() && tensors[i].dtype() == flat_.dtype() && tensors[i].device() == flat_.device() &&
                    tensors[i].sizes() == entries_[i].shape,
                "FlatBuffer::adopt: '", entries_[i].name, "' is ",
                tensors[i].defined() ? shape_str(tensors[i].sizes()) + " " + dtype_name(tensors[i].dtype()) + " on " +
                                           tensors[i].device().str()
                                     : std::string("undefined"),
                ", the entry ", shape_str(entries_[i].shape), " ", flat_.dtype(), " on ", flat_.device());
  copy_from(tensors);
  for (size_t i = 0; i < tensors.size(); ++i) tensors[i].set_data(views_[i]);
}

void FlatBuffer::check_group(const ProcessGroup& pg, const char* op) const {
  EMBER_CHECK(pg.size() == world_size_, "FlatBuffer::", op, ": the buffer is laid out for ", world_size_,
              " ranks, the process group has ", pg.size());
  EMBER_CHECK(!released(), "FlatBuffer::", op, ": the buffer was released; restore() it first");
}

std::shared_ptr<Work> FlatBuffer::all_gather(ProcessGroup& pg, const Tensor& local) const {
  check_group(pg, "all_gather");
  EMBER_CHECK(local.numel() == shard_numel(), "FlatBuffer::all_gather: rank ", pg.rank(), "'s shard has ",
              local.numel(), " elements, the layout's shards ", shard_numel());
  fr::CallerTag caller("FlatBuffer::all_gather (FSDP / ZeRO parameters)");
  return pg.allgather_into_tensor(flat_, local);
}

std::shared_ptr<Work> FlatBuffer::reduce_scatter(ProcessGroup& pg, const Tensor& out, ReduceOp op) const {
  check_group(pg, "reduce_scatter");
  EMBER_CHECK(out.numel() == shard_numel(), "FlatBuffer::reduce_scatter: rank ", pg.rank(), "'s output has ",
              out.numel(), " elements, the layout's shards ", shard_numel());
  fr::CallerTag caller("FlatBuffer::reduce_scatter (FSDP / ZeRO gradients)");
  return pg.reduce_scatter_tensor(out, flat_, op);
}

std::shared_ptr<Work> FlatBuffer::reduce_scatter(ProcessGroup& pg, const Tensor& input, const Tensor& out, ReduceOp op,
                                                 bool consume_input) const {
  EMBER_CHECK(pg.size() == world_size_, "FlatBuffer::reduce_scatter: the buffer is laid out for ", world_size_,
              " ranks, the process group has ", pg.size());
  EMBER_CHECK(input.numel() == padded_numel(), "FlatBuffer::reduce_scatter: the input has ", input.numel(),
              " elements, the layout ", padded_numel());
  EMBER_CHECK(out.numel() == shard_numel(), "FlatBuffer::reduce_scatter: rank ", pg.rank(), "'s output has ",
              out.numel(), " elements, the layout's shards ", shard_numel());
  fr::CallerTag caller("FlatBuffer::reduce_scatter (FSDP / ZeRO gradients)");
  return consume_input ? pg.reduce_scatter_tensor_consuming_input(out, input, op)
                       : pg.reduce_scatter_tensor(out, input, op);
}

}  // namespace ember::distributed
