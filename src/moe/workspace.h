// What one forward or backward of a layer uses and then drops: the
// intermediates between its stages and each worker's scratch. The layers of
// one engine compute one at a time (under its compute lock), so they share
// one workspace: a model of 48 layers holds one layer's intermediates, not 48.
// Buffers are sized on first use and only grow, to the largest call seen.
#pragma once

#include <cstdint>
#include <mutex>
#include <vector>

#include "core/buffer.h"
#include "moe/weight_operand.h"

struct kt_context;  // moe/moe_layer.h

namespace kt {

// Routes sorted by expert: position p (expert-major, then token, then slot).
struct Routing {
  int64_t tokens = 0;
  int64_t routes = 0;                 // valid routes (not -1, not skipped)
  std::vector<int64_t> offsets;       // [E+1] start of each expert's positions
  std::vector<int32_t> active;        // experts with >= 1 route, ascending
  Buffer<int32_t> token;              // [routes] token of position p
  Buffer<int32_t> slot;               // [routes] t*k + j of position p
  Buffer<float> weight;               // [routes] routing weight of position p
  void reserve(int64_t max_tokens, int64_t k, int64_t experts);
};

// One worker's scratch.
struct ThreadScratch {
  Buffer<bf16_t> panels[2];  // weight panels unpacked for a tile (double-buffered)
  Buffer<float> c[3];        // C tiles of a row chunk (gate, up, down)
  Buffer<float> grad;        // a row chunk of a gradient, or of a converted input row
  Buffer<bf16_t> zip[2];     // zipped operands of the weight gradients
  OperandScratch operand;    // of the weight operands (dequantized panels, scales)
  std::vector<const void*> rows;
  std::vector<const float*> frows;
};

// Shapes in elements; "A format" is the kernels' A operand (bf16 or fp32
// rows padded to the panels' K), "int8" the int8 rows of KT_COMPUTE_INT8.
struct MoeWorkspace {
  explicit MoeWorkspace(int threads) : per_thread(static_cast<size_t>(threads)) {}
  ~MoeWorkspace();  // frees the spare contexts (moe_layer.cpp)
  MoeWorkspace(const MoeWorkspace&) = delete;
  MoeWorkspace& operator=(const MoeWorkspace&) = delete;
  // Grows every worker's scratch to a layer's tiles: kpad, the longer padded
  // K of its panels; wide, max(H, I); rank, its LoRA rank.
  void fit_threads(const WeightOperand& operand, int64_t kpad, int64_t wide, int64_t rank);

  Routing routing;                // of a forward that saves no context
  std::vector<int64_t> route_fill;  // next position of each expert while routing
  std::vector<int64_t> items;     // the work items of the current stage
  std::vector<ThreadScratch> per_thread;

  // Forward.
  Buffer<float> x_f32;            // [T, H] x, for LoRA, when no context saves it
  Buffer<char> x_packed;          // [T, kp(H)] x in A format
  Buffer<uint8_t> x_int8;         // [T] int8 rows of x
  Buffer<char> x_by_route;        // [routes] x's rows (A format or int8) in route order
  Buffer<float> lora_a_proj[3];   // [routes, r] LoRA A-projections, when no context saves them
  Buffer<float> act_f32;          // [routes, I] activations (LoRA down, int8, backward's dW_down)
  Buffer<char> act_packed;        // [routes, kp(I)] activations in A format
  Buffer<uint8_t> act_int8;       // [routes] int8 rows of the activations
  Buffer<float> route_down_out;   // [routes, H padded] down outputs before the combine
  Buffer<float> token_sum;        // [T, H] per-token sum: y of the forward, dx of the backward

  // Backward.
  Buffer<float> dy_f32;           // [T, H] dy
  Buffer<char> dy_packed;         // [T, padded H] dy in A format
  Buffer<char> dy_by_route;       // [routes] dy's rows in route order
  Buffer<float> d_gate, d_up;     // [routes, I] gradients of gate and up before the activation
  Buffer<char> d_gate_packed, d_up_packed;  // the same in A format
  Buffer<float> lora_b_proj[3];   // [routes, r] the delta projected by s*B
  Buffer<float> route_weight_parts;  // [routes, blocks of I] parts of dL/dw per route
  Buffer<float> route_dx;         // [routes, H padded] each route's dx before the sum per token
                                  // (experts split over NUMA nodes)
  Buffer<float> down_delta;       // [routes, H] w * dy, the down projection's delta
  Buffer<float> weighted_down_lora[2];  // [routes, r] w * lora_b_proj[down], w * the saved la[down]

  // Saved contexts that any layer released, with their buffers, for the
  // next forward that saves one: steady-state training allocates nothing,
  // and a model whose contexts live one at a time (activation
  // checkpointing) keeps one spare, not one per layer. Contexts are
  // released outside the compute lock, hence a lock of its own.
  std::mutex spare_mutex;
  std::vector<kt_context*> spare_contexts;
};

}  // namespace kt
