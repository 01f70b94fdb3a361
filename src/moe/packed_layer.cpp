#include "moe/packed_layer.h"

#include <mutex>

#include "io/packed_cache.h"
#include "moe/moe_layer.h"
#include "runtime/engine.h"

namespace kt {

namespace {

io::PackedShape packed_shape(const kt_moe& m) {
  io::PackedShape s;
  s.format = m.options().weight_format;
  s.experts = m.num_experts(), s.hidden = m.hidden(), s.intermediate = m.intermediate();
  s.has_bias = m.options().has_bias != 0;
  s.gate_expert_bytes = static_cast<uint64_t>(m.stored_expert_bytes(kGate));
  s.down_expert_bytes = static_cast<uint64_t>(m.stored_expert_bytes(kDown));
  return s;
}

}  // namespace

void save_packed_layer(kt_moe* moe, const std::string& path, const char* where) {
  std::lock_guard<std::mutex> lock(moe->engine()->compute_mutex);
  io::PackedSource source;
  for (int p = 0; p < 3; ++p) {
    source.weights[p] = moe->stored_weights(p);
    source.biases[p] = moe->biases(p);
  }
  source.loaded = &moe->loaded_mask();
  io::save_packed(moe->engine(), packed_shape(*moe), source, path, where);
}

void load_packed_layer(kt_moe* moe, const std::string& path, unsigned flags, const char* where) {
  const io::PackedMapping m = io::map_packed(packed_shape(*moe), path, where);
  std::lock_guard<std::mutex> lock(moe->engine()->compute_mutex);
  if (!(flags & KT_PACKED_SKIP_CHECKSUMS)) io::verify_packed(m, moe->engine());
  moe->adopt_packed(m.memory, m.weights, m.biases, m.loaded);
}

}  // namespace kt
