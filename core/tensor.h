// Tensor: a strided view of reference-counted Storage.
//
//   ember::Tensor x = ember::arange(6, ember::DType::Float32).view({2, 3});
//   ember::Tensor y = x.transpose(0, 1);          // shares x's memory
//   ember::Tensor z = ember::matmul(x, y) + 1.0;  // [2, 2]
//   std::cout << z;                               // values, shape, dtype, device
//
// A Tensor is a cheap handle (shared_ptr to TensorImpl). Views share storage
// and differ only in sizes/strides/offset; strides are in elements. Ops live
// in core/ops.h. TensorImpl carries an opaque autograd slot so autograd/ can
// attach its metadata without core/ knowing about it.
#pragma once

#include <cstdint>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/exception.h"

namespace ember {

using Shape = std::vector<int64_t>;

struct Storage {
  DataPtr data;
  // The size of the memory, kept while it is freed so restore brings back
  // the same amount.
  size_t nbytes = 0;
  // Bumped by every in-place write, by freeing or restoring the memory and by
  // set_data on a tensor using it, so autograd can tell when a tensor it saved
  // for backward changed after the forward pass; `last_change` names what
  // bumped it last, for the error.
  uint64_t version = 0;
  const char* last_change = nullptr;
  // The memory was given back (Tensor::free_storage); every view of it
  // refuses data access until restore_storage, with `freed_why` (when the
  // caller gave one) as the reason in the error.
  bool freed = false;
  const char* freed_why = nullptr;
  Device device() const { return data.device; }
  void bump_version(const char* why) {
    ++version;
    last_change = why;
  }
};

// Implemented in autograd/; core only holds it and reads requires_grad to
// decide whether an op must be recorded (core/autograd_hook.h).
class Tensor;
struct AutogradMetaBase {
  virtual ~AutogradMetaBase() = default;
  bool requires_grad = false;
};

// Implemented in distributed/sharding/: how a tensor is laid out across
// ranks (global shape, the box and run of it this rank holds). Attached to
// a parameter by whichever parallelism shards it, read by checkpoints and
// norms; core only carries it. It survives set_data (the parameter object
// stays; only its data moves), not detach or alias.
struct ShardMetaBase {
  virtual ~ShardMetaBase() = default;
  // What a norm over the global tensor (clip_grad_norm_) needs, without
  // core knowing meshes: whether this rank's elements count (of the ranks
  // holding one element, exactly one counts it), the ranks the partial sums
  // must be combined over (an opaque key: tensors with the same key combine
  // once; null: nothing to combine, the tensor is this rank's alone), and
  // the combining itself (a sum, or a max, of a one-element float64 CPU
  // tensor over those ranks, in place; collective).
  virtual bool counts_in_norm() const { return true; }
  virtual const void* norm_domain() const { return nullptr; }
  virtual void reduce_norm_partial(const Tensor& partial, bool max) const { (void)partial, (void)max; }
};

struct TensorImpl {
  std::shared_ptr<Storage> storage;
  Shape sizes;
  Shape strides;
  int64_t offset = 0;
  DType dtype = DType::Float32;
  std::shared_ptr<AutogradMetaBase> autograd_meta;
  std::shared_ptr<const ShardMetaBase> shard_meta;
};

// How a 4-D [N, C, H, W] tensor lies in memory. ChannelsLast is NHWC memory
// behind the same NCHW sizes (PyTorch's torch.channels_last): cuDNN's tensor
// core convolutions want it. Elementwise ops, batch norm and pooling keep it.
enum class MemoryFormat { Contiguous, ChannelsLast };

struct TensorOptions {
  DType dtype = DType::Float32;
  Device device = kCPU;
  TensorOptions() = default;
  TensorOptions(DType t) : dtype(t) {}
  TensorOptions(Device d) : device(d) {}
  TensorOptions(DType t, Device d) : dtype(t), device(d) {}
};

class Tensor {
 public:
  Tensor() = default;
  explicit Tensor(std::shared_ptr<TensorImpl> impl) : impl_(std::move(impl)) {}

  // Uninitialized contiguous tensor.
  static Tensor empty(const Shape& sizes, TensorOptions opts = {});
  // Uninitialized in `format` (ChannelsLast needs 4-D sizes).
  static Tensor empty(const Shape& sizes, TensorOptions opts, MemoryFormat format);
  // Copies `values` (row-major) into a new CPU tensor of `dtype`, then to `device`.
  static Tensor from_vector(const std::vector<double>& values, const Shape& sizes, TensorOptions opts = {});

  bool defined() const { return impl_ != nullptr; }
  const Shape& sizes() const { return impl().sizes; }
  const Shape& shape() const { return impl().sizes; }
  const Shape& strides() const { return impl().strides; }
  int64_t size(int64_t dim) const;
  int64_t stride(int64_t dim) const;
  int64_t dim() const { return static_cast<int64_t>(impl().sizes.size()); }
  int64_t numel() const;
  int64_t storage_offset() const { return impl().offset; }
  DType dtype() const { return impl().dtype; }
  Device device() const { return impl().storage->device(); }
  TensorOptions options() const { return {dtype(), device()}; }
  size_t element_size() const { return dtype_size(dtype()); }
  size_t nbytes() const { return numel() * element_size(); }
  bool is_contiguous() const;
  // Dense in `format`: ChannelsLast means NHWC strides (size-1 dims ignored).
  bool is_contiguous(MemoryFormat format) const;
  // ChannelsLast for a 4-D tensor that is NHWC-dense and not also plain
  // contiguous (C == 1 and the like); otherwise Contiguous. Ops give their
  // outputs this layout.
  MemoryFormat suggest_memory_format() const;
  // Contiguous in one of the memory formats: its elements fill numel()
  // consecutive slots, so a list op that treats every element alike (an
  // optimizer step, unscaling, a norm) can walk it as a flat array, and two
  // dense tensors with the same sizes and suggest_memory_format() line up.
  bool is_dense() const { return is_contiguous() || is_contiguous(MemoryFormat::ChannelsLast); }
  bool is_cuda() const { return device().is_cuda(); }
  bool is_same(const Tensor& o) const { return impl_ == o.impl_; }
  bool shares_storage(const Tensor& o) const { return impl().storage == o.impl().storage; }
  // ---- Autograd (implemented by autograd/, which a binary must link) ----
  // True when autograd tracks this tensor (a leaf that asked for gradients,
  // or the result of a recorded op).
  bool requires_grad() const { return impl_ && impl_->autograd_meta && impl_->autograd_meta->requires_grad; }
  // Marks a leaf as a parameter whose .grad() backward fills; returns *this.
  Tensor& requires_grad_(bool enabled = true);
  // Leaf: requires no grad, or was created by the user rather than an op.
  bool is_leaf() const;
  // The accumulated gradient of a leaf (undefined until a backward reaches it).
  Tensor grad() const;
  void set_grad(const Tensor& grad) const;
  // Runs backward from this tensor: `grad` defaults to 1 for a one-element
  // tensor; retain_graph keeps saved tensors for another backward.
  void backward(const Tensor& grad = Tensor(), bool retain_graph = false) const;
  // Same data, no history: the result is a leaf that requires no grad.
  Tensor detach() const { return alias(); }
  // Points this tensor (and every handle sharing it) at `data`'s storage and
  // geometry, keeping its autograd identity: how Module::to() moves
  // parameters and how flat buffers (DDP buckets, FSDP shards) adopt them.
  // A graph recorded before may hold this handle for its backward and would
  // read the new data, so the old storage's version is bumped: such a
  // backward fails naming set_data instead of computing with the wrong
  // values. The one safe way to swap data is therefore between iterations
  // (after backward, before the next forward), under NoGradGuard.
  // See Note [set_data keeps identity] (docs/design.md).
  void set_data(const Tensor& data) const;

  // ---- Storage that can be given back and restored (FSDP's unsharded
  // parameters, torch's storage().resize_(0) and back). The Storage object,
  // every handle and view, the autograd leaf and optimizer state keyed by it
  // all stay; only the memory goes. Each bumps the version, so a backward
  // that saved the tensor before fails with "freed" or "restored" rather
  // than reading lost or uninitialized memory. ----
  // Returns the memory to its allocator; a no-op when already freed. `why`
  // (a string that outlives the storage) is what a read of it is told.
  void free_storage(const char* why = nullptr) const;
  // Allocates the storage's size again on its device; the contents are
  // uninitialized until written (e.g. by an all-gather).
  void restore_storage() const;
  bool storage_freed() const { return impl().storage->freed; }
  // The storage's version counter, and a way to set it back: a caller that
  // restored exactly the values a graph saved (FSDP re-gathers the same
  // parameters before backward) records the version before free_storage
  // and sets it after refilling, as torch's _unsafe_set_version_counter.
  // Nothing checks the contents: the caller vouches for them.
  uint64_t storage_version() const { return impl().storage->version; }
  void unsafe_set_storage_version(uint64_t version) const { impl().storage->version = version; }

  // Pointer to the first element (storage base + offset).
  void* raw_data() const;
  template <typename T>
  T* data() const {
    EMBER_CHECK(dtype_of<T>() == dtype(), "data<", dtype_name(dtype_of<T>()), ">(): tensor has dtype ", dtype());
    return static_cast<T*>(raw_data());
  }

  // ---- Views: share storage, never copy. ----
  Tensor view(const Shape& sizes) const;              // one -1 allowed
  Tensor reshape(const Shape& sizes) const;           // view if possible, else copy
  Tensor flatten(int64_t start = 0, int64_t end = -1) const;
  Tensor transpose(int64_t d0, int64_t d1) const;
  Tensor t() const;                                    // 2-D transpose
  Tensor permute(const Shape& dims) const;
  Tensor slice(int64_t dim, int64_t start, int64_t end, int64_t step = 1) const;
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
  Tensor select(int64_t dim, int64_t index) const;    // drops `dim`
  Tensor expand(const Shape& sizes) const;            // -1 keeps a size
  Tensor squeeze() const;
  Tensor squeeze(int64_t dim) const;
  Tensor unsqueeze(int64_t dim) const;
  Tensor as_strided(const Shape& sizes, const Shape& strides, int64_t offset) const;  // not differentiable
  // Same storage, new metadata handle without autograd history (detach).
  Tensor alias() const;

  // ---- Copies and conversions. ----
  Tensor contiguous() const;
  // A copy laid out in `format` unless already so (differentiable).
  Tensor contiguous(MemoryFormat format) const;
  Tensor clone() const;
  // to() keeps a channels-last tensor channels-last (preserve_format).
  Tensor to(Device device) const;                     // no copy if already there
  Tensor to(DType dtype) const;                       // no copy if already that
  Tensor to(Device device, DType dtype) const;
  Tensor cpu() const { return to(kCPU); }
  Tensor cuda(int index = 0) const { return to(cuda_device(index)); }
  Tensor pin_memory() const;                          // CPU copy in page-locked memory
  Tensor& copy_(const Tensor& src);                   // broadcasts, casts, crosses devices
  Tensor& fill_(double value);
  Tensor& zero_() { return fill_(0.0); }

  // The single value of a one-element tensor.
  double item() const;
  template <typename T> T item() const { return static_cast<T>(item()); }
  // All values, row-major, as doubles (tests and printing).
  std::vector<double> to_vector() const;

  std::string str() const;
  TensorImpl& impl() const {
    EMBER_CHECK(impl_ != nullptr, "operation on an undefined tensor");
    return *impl_;
  }
  const std::shared_ptr<TensorImpl>& impl_ptr() const { return impl_; }

  // Operators (defined in core/ops.cc).
  Tensor operator-() const;
  Tensor& operator+=(const Tensor& o);
  Tensor& operator-=(const Tensor& o);
  Tensor& operator*=(const Tensor& o);
  Tensor& operator/=(const Tensor& o);
  Tensor& operator*=(double s);

 private:
  std::shared_ptr<TensorImpl> impl_;
};

std::ostream& operator<<(std::ostream& os, const Tensor& t);
std::string shape_str(const Shape& s);

// True when writing `dst` could change `src` before it is read: the two
// share storage without being the very same view. Ops then read a copy.
bool may_overlap(const Tensor& dst, const Tensor& src);
// Wraps a negative dim and checks range; `op` names the caller in errors.
int64_t wrap_dim(int64_t dim, int64_t ndim, const char* op);
Shape contiguous_strides(const Shape& sizes);
int64_t shape_numel(const Shape& sizes);
// Broadcast two shapes NumPy-style; throws naming `op` and both shapes.
Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op);
// Charges the memory of `t`'s storage to `kind` in its allocator's
// breakdown (allocator.h: a parameter, a .grad, optimizer state); a no-op
// for undefined tensors and freed storage.
void set_memory_kind(const Tensor& t, MemoryKind kind);

}  // namespace ember
