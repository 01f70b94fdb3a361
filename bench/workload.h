// Synthetic layers and batches: bf16 expert weights shaped like a real model
// (or a slice of its experts), token batches routed top-k, and the work each
// benchmark case does on them (FLOPs, bytes of the touched experts).
#ifndef KT_BENCH_WORKLOAD_H_
#define KT_BENCH_WORKLOAD_H_

#include <cstdint>
#include <string>
#include <vector>

#include "bench_common.h"
#include "model_shapes.h"

namespace kt_bench {

// The expert weights of one layer in HF nn.Linear layout: gate/up [E,I,H],
// down [E,H,I], bf16. When the model's experts do not fit the memory budget
// the layer holds its first `experts` of `shape.experts` (a slice); routes to
// the others are handed over as "no route" (-1), as a host does with experts
// it computes elsewhere, so each loaded expert sees the model's real load.
struct LayerWeights {
  ModelShape shape{};
  int64_t experts = 0;  // experts held (== shape.experts unless a slice)
  HostTensor gate, up, down;
  bool is_slice() const { return experts < shape.experts; }
  double bytes_per_expert() const { return 3.0 * shape.hidden * shape.intermediate * 2; }
};

LayerWeights make_layer_weights(const ModelShape& shape, int64_t experts, uint64_t seed);

// One routed batch: x and dy [T,H] bf16, ids [T,k] int32, routing weights [T,k] fp32.
struct Batch {
  int64_t tokens = 0;
  HostTensor x, ids, route_weights, dy;
  int64_t routes = 0;          // ids >= 0
  int64_t touched_experts = 0; // distinct ids >= 0
};

// Several batches of T tokens. Consecutive batches route to different
// experts where the model has enough of them, so a timed loop cycling through
// them reads cold weights, as consecutive layers of a real model do.
struct Workload {
  int64_t tokens = 0;
  std::vector<Batch> batches;
  double mean_routes() const;
  double mean_touched() const;
};

Workload make_workload(const LayerWeights& layer, int64_t tokens, uint64_t seed);

// T tokens whose k routes go round-robin to `touched` experts (>= k): the
// cost-versus-touched-experts sweep at a fixed token count.
Workload make_touched_workload(const LayerWeights& layer, int64_t tokens, int64_t touched, uint64_t seed);

enum class Case { kForward, kTrainDx, kTrainLora, kTrainFull };
inline constexpr Case kAllCases[] = {Case::kForward, Case::kTrainDx, Case::kTrainLora, Case::kTrainFull};
inline constexpr int64_t kLoraRank = 16;

const char* case_key(Case c);    // "forward", "train_dx", "train_lora", "train_full"
const char* case_label(Case c);  // readable form for the table

// Useful FLOPs of one call: forward 6HI per route; + backward dx 6HI;
// + LoRA 18r(H+I) (forward, dA, dB and the dx share, three projections);
// + full weight grads 6HI.
double case_flops(Case c, const ModelShape& s, double routes);
// Bytes a call must move at least: the touched experts' bf16 weights once
// per pass (forward 1, training 2), and in full mode the fp32 gradients of
// every held expert (the contract writes untouched experts' grads as zero).
double case_bytes(Case c, const LayerWeights& layer, double touched);

}  // namespace kt_bench

#endif  // KT_BENCH_WORKLOAD_H_
