// Autocast's thread-local state, the cast cache and the policy helpers the
// ops call (autocast.h).
#include "core/autocast.h"

#include <memory>
#include <unordered_map>
#include <utility>

#include "core/autograd_hook.h"
#include "core/exception.h"
#include "core/tensor.h"

namespace ember {
namespace {

struct ThreadState {
  bool enabled[2] = {false, false};                     // indexed by DeviceType
  DType dtype[2] = {DType::BFloat16, DType::Float16};   // torch's defaults: CPU bf16, CUDA fp16
  int depth = 0;                                        // live guards, for clearing the cache
  // Leaf tensor -> its cast (Note [caches] in docs/design.md). The key is the
  // leaf's TensorImpl; the entry keeps the leaf alive, so that address is
  // not reused by another tensor while cached. The value depends on the
  // leaf's data, so a hit also needs the same storage (a weak pointer: a
  // storage freed by set_data and another allocated at its address do not
  // compare equal), offset and storage version (an optimizer step, copy_ or
  // set_data inside the scope makes a fresh cast), and a cast made under
  // no_grad (no graph) is not served to a forward that records one.
  struct Entry {
    Tensor source, cast;
    std::weak_ptr<Storage> storage;
    int64_t offset;
    uint64_t version;
  };
  std::unordered_map<const void*, Entry> cache;
};

thread_local ThreadState t_state;

int index_of(DeviceType t) { return t == DeviceType::CUDA ? 1 : 0; }

bool is_half(DType t) { return t == DType::BFloat16 || t == DType::Float16; }

}  // namespace

AutocastGuard::AutocastGuard(DeviceType device_type, DType dtype, bool enabled) : type_(device_type) {
  EMBER_CHECK(!enabled || is_half(dtype), "autocast: dtype ", dtype_name(dtype),
              " is not a low-precision floating type; use bfloat16 or float16");
  const int i = index_of(type_);
  prev_enabled_ = t_state.enabled[i];
  prev_dtype_ = t_state.dtype[i];
  t_state.enabled[i] = enabled;
  if (enabled) t_state.dtype[i] = dtype;
  ++t_state.depth;
}

AutocastGuard::~AutocastGuard() {
  const int i = index_of(type_);
  t_state.enabled[i] = prev_enabled_;
  t_state.dtype[i] = prev_dtype_;
  if (--t_state.depth == 0) t_state.cache.clear();
}

bool autocast_enabled(DeviceType device_type) { return t_state.enabled[index_of(device_type)]; }
DType autocast_dtype(DeviceType device_type) { return t_state.dtype[index_of(device_type)]; }

namespace autocast {

Tensor low(const Tensor& t) {
  if (!t.defined() || !is_floating(t.dtype())) return t;
  const int i = index_of(t.device().type);
  if (!t_state.enabled[i]) return t;
  const DType want = t_state.dtype[i];
  if (t.dtype() == want || t.dtype() == DType::Float64) return t;  // float64 is left alone, as in torch
  const bool cacheable = t.requires_grad() && t.is_leaf();
  if (cacheable) {
    auto it = t_state.cache.find(t.impl_ptr().get());
    if (it != t_state.cache.end()) {
      const ThreadState::Entry& e = it->second;
      if (e.cast.dtype() == want && e.storage.lock() == t.impl().storage && e.offset == t.storage_offset() &&
          e.version == t.storage_version() && (e.cast.requires_grad() || !GradMode::is_enabled()))
        return e.cast;
    }
  }
  Tensor cast = t.to(want);
  if (cacheable)
    t_state.cache[t.impl_ptr().get()] = {t, cast, t.impl().storage, t.storage_offset(), t.storage_version()};
  return cast;
}

Tensor fp32(const Tensor& t) {
  if (!t.defined() || !is_half(t.dtype()) || !t_state.enabled[index_of(t.device().type)]) return t;
  return t.to(DType::Float32);
}

int64_t cached_casts() { return static_cast<int64_t>(t_state.cache.size()); }

State current_state() { return State{{t_state.enabled[0], t_state.enabled[1]}, {t_state.dtype[0], t_state.dtype[1]}}; }

struct RegionScope::Saved {
  ThreadState state;
};

RegionScope::RegionScope(const State& state) : saved_(std::make_unique<Saved>(Saved{std::move(t_state)})) {
  t_state = ThreadState{};
  for (int i = 0; i < 2; ++i) {
    t_state.enabled[i] = state.enabled[i];
    t_state.dtype[i] = state.dtype[i];
  }
}

RegionScope::~RegionScope() { t_state = std::move(saved_->state); }

DisabledScope::DisabledScope() {
  for (int i = 0; i < 2; ++i) {
    prev_[i] = t_state.enabled[i];
    t_state.enabled[i] = false;
  }
}

DisabledScope::~DisabledScope() {
  for (int i = 0; i < 2; ++i) t_state.enabled[i] = prev_[i];
}

}  // namespace autocast
}  // namespace ember
