#include "workload.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <set>
#include <thread>

namespace kt_bench {

LayerWeights make_layer_weights(const ModelShape& shape, int64_t experts, uint64_t seed) {
  LayerWeights w;
  w.shape = shape;
  w.experts = experts;
  const int64_t H = shape.hidden, I = shape.intermediate;
  w.gate = HostTensor(kDLBfloat, 16, {experts, I, H});
  w.up = HostTensor(kDLBfloat, 16, {experts, I, H});
  w.down = HostTensor(kDLBfloat, 16, {experts, H, I});
  // Scaled 1/sqrt(fan_in) like a trained layer; one generator per expert so
  // host threads can share the filling.
  const float gate_scale = 1.f / std::sqrt(static_cast<float>(H));
  const float down_scale = 1.f / std::sqrt(static_cast<float>(I));
  const int64_t per_expert = I * H;
  auto fill = [&](int64_t first, int64_t step) {
    for (int64_t e = first; e < experts; e += step) {
      Rng rng(seed + static_cast<uint64_t>(e));
      for (int64_t i = e * per_expert; i < (e + 1) * per_expert; ++i) {
        w.gate.u16()[i] = to_bf16(gate_scale * rng.normal());
        w.up.u16()[i] = to_bf16(gate_scale * rng.normal());
        w.down.u16()[i] = to_bf16(down_scale * rng.normal());
      }
    }
  };
  const int64_t fillers = std::max<int64_t>(1, std::min<int64_t>(8, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < fillers; ++t) pool.emplace_back(fill, t, fillers);
  for (auto& t : pool) t.join();
  return w;
}

namespace {

Batch make_batch_shell(const ModelShape& s, int64_t tokens, Rng& rng) {
  Batch b;
  b.tokens = tokens;
  b.x = HostTensor(kDLBfloat, 16, {tokens, s.hidden});
  b.dy = HostTensor(kDLBfloat, 16, {tokens, s.hidden});
  b.ids = HostTensor(kDLInt, 32, {tokens, s.top_k});
  b.route_weights = HostTensor(kDLFloat, 32, {tokens, s.top_k});
  for (int64_t i = 0; i < tokens * s.hidden; ++i) {
    b.x.u16()[i] = to_bf16(rng.normal());
    b.dy.u16()[i] = to_bf16(rng.normal());
  }
  // Positive weights normalised per token, like a softmax over the top k.
  for (int64_t t = 0; t < tokens; ++t) {
    float sum = 0;
    float* w = b.route_weights.f32() + t * s.top_k;
    for (int64_t j = 0; j < s.top_k; ++j) sum += (w[j] = 0.2f + static_cast<float>(rng.next() % 1000) / 1000.f);
    for (int64_t j = 0; j < s.top_k; ++j) w[j] /= sum;
  }
  return b;
}

// Routes to experts the layer does not hold become "no route"; counts what is left.
void finish_batch(Batch& b, int64_t held_experts) {
  std::set<int32_t> touched;
  b.routes = 0;
  for (int64_t i = 0; i < b.ids.numel(); ++i) {
    int32_t& id = b.ids.i32()[i];
    if (id >= held_experts) id = -1;
    if (id >= 0) {
      ++b.routes;
      touched.insert(id);
    }
  }
  b.touched_experts = static_cast<int64_t>(touched.size());
}

}  // namespace

double Workload::mean_routes() const {
  double sum = 0;
  for (const Batch& b : batches) sum += static_cast<double>(b.routes);
  return batches.empty() ? 0 : sum / static_cast<double>(batches.size());
}

double Workload::mean_touched() const {
  double sum = 0;
  for (const Batch& b : batches) sum += static_cast<double>(b.touched_experts);
  return batches.empty() ? 0 : sum / static_cast<double>(batches.size());
}

Workload make_workload(const LayerWeights& layer, int64_t tokens, uint64_t seed) {
  const ModelShape& s = layer.shape;
  Rng rng(seed);
  Workload w;
  w.tokens = tokens;
  const int64_t routes = tokens * s.top_k;
  // Few routes: walk a random permutation of the experts, so consecutive
  // batches share no expert and together cover the layer (cold weights).
  // Many routes: independent random top-k per token, two batches.
  const bool disjoint = routes <= s.experts;
  const int64_t count = disjoint ? std::clamp<int64_t>((s.experts + routes - 1) / routes, 2, 16) : 2;
  std::vector<int32_t> perm(static_cast<size_t>(s.experts));
  std::iota(perm.begin(), perm.end(), 0);
  for (size_t i = perm.size(); i > 1; --i) std::swap(perm[i - 1], perm[rng.next() % i]);
  int64_t cursor = 0;
  for (int64_t n = 0; n < count; ++n) {
    Batch b = make_batch_shell(s, tokens, rng);
    for (int64_t t = 0; t < tokens; ++t) {
      int32_t* ids = b.ids.i32() + t * s.top_k;
      if (disjoint) {
        for (int64_t j = 0; j < s.top_k; ++j) ids[j] = perm[static_cast<size_t>(cursor++ % s.experts)];
      } else {
        for (int64_t j = 0; j < s.top_k; ++j) {
          int32_t e;
          do {
            e = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(s.experts));
          } while (std::find(ids, ids + j, e) != ids + j);
          ids[j] = e;
        }
      }
    }
    finish_batch(b, layer.experts);
    w.batches.push_back(std::move(b));
  }
  return w;
}

Workload make_touched_workload(const LayerWeights& layer, int64_t tokens, int64_t touched, uint64_t seed) {
  const ModelShape& s = layer.shape;
  Rng rng(seed);
  Workload w;
  w.tokens = tokens;
  // Batches use disjoint expert windows while the held experts allow it.
  const int64_t count = std::clamp<int64_t>(layer.experts / touched, 2, 8);
  for (int64_t n = 0; n < count; ++n) {
    Batch b = make_batch_shell(s, tokens, rng);
    const int64_t base = (n * touched) % layer.experts;
    for (int64_t t = 0; t < tokens; ++t)
      for (int64_t j = 0; j < s.top_k; ++j)
        b.ids.i32()[t * s.top_k + j] = static_cast<int32_t>((base + (t * s.top_k + j) % touched) % layer.experts);
    finish_batch(b, layer.experts);
    w.batches.push_back(std::move(b));
  }
  return w;
}

const char* case_key(Case c) {
  switch (c) {
    case Case::kForward: return "forward";
    case Case::kTrainDx: return "train_dx";
    case Case::kTrainLora: return "train_lora";
    case Case::kTrainFull: return "train_full";
  }
  return "unknown";
}

const char* case_label(Case c) {
  switch (c) {
    case Case::kForward: return "forward";
    case Case::kTrainDx: return "fwd+bwd dx";
    case Case::kTrainLora: return "fwd+bwd LoRA r16";
    case Case::kTrainFull: return "fwd+bwd full grads";
  }
  return "unknown";
}

double case_flops(Case c, const ModelShape& s, double routes) {
  const double HI = static_cast<double>(s.hidden) * static_cast<double>(s.intermediate);
  const double base = 6 * HI * routes;
  switch (c) {
    case Case::kForward: return base;
    case Case::kTrainDx: return 2 * base;
    case Case::kTrainLora:
      return 2 * base + 18.0 * kLoraRank * static_cast<double>(s.hidden + s.intermediate) * routes;
    case Case::kTrainFull: return 3 * base;
  }
  return 0;
}

double case_bytes(Case c, const LayerWeights& layer, double touched) {
  const double weights = layer.bytes_per_expert() * touched;
  switch (c) {
    case Case::kForward: return weights;
    case Case::kTrainDx:
    case Case::kTrainLora: return 2 * weights;
    case Case::kTrainFull: return 2 * weights + 2 * layer.bytes_per_expert() * static_cast<double>(layer.experts);
  }
  return 0;
}

}  // namespace kt_bench
