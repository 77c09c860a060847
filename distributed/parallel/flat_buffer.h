// FlatBuffer: many tensors (parameters, or their gradients) laid out back to
// back in one flat buffer, each reachable as a view of its own shape. It is
// the one mechanism under everything that moves parameters as a block:
// DDP's gradient buckets, ZeRO's sharded optimizer step, and FSDP's sharded
// parameters and sharded checkpoints to come.
//
//   FlatBuffer fb({{"fc.weight", {4, 3}}, {"fc.bias", {4}}}, {DType::Float32}, /*world_size=*/3);
//   fb.numel();          // 16 elements of entries
//   fb.padded_numel();   // 18: zero padding up to a multiple of the world size
//   fb.view(0);          // [4, 3], a view into fb.flat() at offset 0
//   fb.shard(r);         // rank r's [6] slice of the flat buffer
//   fb.pieces(r);        // which parts of which entries that slice holds
//
// Sharding is by element, not by tensor: every rank's shard has exactly
// padded_numel / world_size elements, whatever the tensor sizes, so memory
// divides evenly (ZeRO, FSDP). The padding is zeros and stays zero.
//
// Collectives: all_gather() fills the whole buffer from every rank's shard
// (unshard), reduce_scatter() reduces it into this rank's shard. release()
// gives the buffer's memory back while views stay valid handles (their data
// refuses access until restore()), for FSDP's reshard after forward.
//
// An unsharded buffer (world size 1) may lay an entry out channels-last:
// its view then has the strides of a channels-last tensor of its shape, so
// DDP's gradient buckets follow channels-last parameters (PyTorch's
// gradient layout contract) and no step converts their layout. Sharded
// buffers keep every entry contiguous: shards and pieces count elements in
// the entries' logical order, which checkpoints rely on.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "distributed/comm/process_group.h"

namespace ember::distributed {

struct FlatEntry {
  std::string name;
  Shape shape;
  int64_t offset = 0;  // in elements, from the start of the buffer
  int64_t numel = 0;
  MemoryFormat format = MemoryFormat::Contiguous;  // of its view (ChannelsLast: unsharded buffers only)
};

class FlatBuffer {
 public:
  FlatBuffer() = default;
  // Lays `entries` (name, shape) out in order in a new zeroed buffer of
  // `options`, padded to a multiple of `world_size`. Names must be unique.
  // `formats` (one per entry, or empty: all contiguous) lays entries out
  // channels-last; only with world_size 1.
  FlatBuffer(const std::vector<std::pair<std::string, Shape>>& entries, TensorOptions options, int world_size = 1,
             const std::vector<MemoryFormat>& formats = {});
  // The layout of `tensors` (their names and shapes; they must share dtype
  // and device), with their current values copied in.
  static FlatBuffer from_tensors(const std::vector<std::pair<std::string, Tensor>>& tensors, int world_size = 1);

  bool defined() const { return flat_.defined(); }
  // The whole buffer, [padded_numel()].
  const Tensor& flat() const { return flat_; }
  const std::vector<FlatEntry>& entries() const { return entries_; }
  size_t size() const { return entries_.size(); }
  // Entry i (or by name) as a view of its shape into flat().
  const Tensor& view(size_t i) const;
  // Entry i's view into `buffer`, another buffer laid out as this one
  // (padded_numel() elements), in the entry's format.
  Tensor view_in(const Tensor& buffer, size_t i) const;
  const std::vector<Tensor>& views() const { return views_; }
  std::optional<size_t> find(const std::string& name) const;

  int64_t numel() const { return numel_; }
  int64_t padded_numel() const { return flat_.defined() ? flat_.numel() : 0; }
  int world_size() const { return world_size_; }
  int64_t shard_numel() const { return padded_numel() / world_size_; }
  // Rank `rank`'s contiguous block of flat().
  Tensor shard(int rank) const;

  // The part of one entry that lies in a shard.
  struct Piece {
    size_t entry = 0;
    int64_t entry_offset = 0;  // first element, within the entry (flattened)
    int64_t shard_offset = 0;  // where it starts within the shard
    int64_t numel = 0;
  };
  // The entries overlapping rank `rank`'s shard, in order (padding excluded).
  std::vector<Piece> pieces(int rank) const;

  // Copies tensors[i] into view(i) (shapes must match).
  void copy_from(const std::vector<Tensor>& tensors) const;
  // Makes every tensors[i] (a parameter) a view of this buffer: its values
  // are copied in and it is pointed at view(i) with set_data, keeping its
  // identity. Like set_data, only between iterations.
  void adopt(const std::vector<Tensor>& tensors) const;

  // Fills flat() with every rank's shard: `local` is this rank's (it may be
  // shard(pg.rank()) itself, in place). Asynchronous, as every collective.
  std::shared_ptr<Work> all_gather(ProcessGroup& pg, const Tensor& local) const;
  // Reduces flat() over the ranks into `out` (shard_numel() elements).
  std::shared_ptr<Work> reduce_scatter(ProcessGroup& pg, const Tensor& out, ReduceOp op = ReduceOp::Avg) const;
  // The same for `input`, a buffer laid out as this one (padded_numel()
  // elements in any dtype: the gradients of the parameters this layout
  // holds), e.g. FSDP's gradient buffer while the parameters' own buffer is
  // freed. `consume_input`: `input` is scratch afterwards, which lets a
  // backend reduce in it instead of a copy (ProcessGroup's
  // reduce_scatter_tensor_consuming_input).
  std::shared_ptr<Work> reduce_scatter(ProcessGroup& pg, const Tensor& input, const Tensor& out, ReduceOp op,
                                       bool consume_input) const;

  // Gives flat()'s memory back / allocates it again (uninitialized, padding
  // included: the next all_gather fills it). Views and adopted parameters
  // share the storage, so they follow. Release only once the collectives
  // that use the buffer have completed (wait(), or synchronize() before
  // freeing on the stream that waited): the memory goes straight back to
  // the allocator.
  // `why` (a string that outlives the buffer): what a read of a view says.
  void release(const char* why = nullptr) const { flat_.free_storage(why); }
  void restore() const { flat_.restore_storage(); }
  bool released() const { return flat_.defined() && flat_.storage_freed(); }

 private:
  void check_group(const ProcessGroup& pg, const char* op) const;
  std::vector<FlatEntry> entries_;
  std::vector<Tensor> views_;
  Tensor flat_;
  int64_t numel_ = 0;
  int world_size_ = 1;
};

}  // namespace ember::distributed
