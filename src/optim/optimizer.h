// kt_optimizer: fused AdamW / SGD over fp32 masters (src/kernels/update.h has
// the loops), created over host tensors or over a layer's bound trainable
// parameters; its state saves to and loads from one safetensors file.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <string>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/buffer.h"
#include "core/dtype.h"
#include "core/tensor.h"
#include "kernels/update.h"
#include "kt_c_api.h"

struct kt_optimizer {
  // One parameter's slice of a state arena (or empty).
  struct StateSlice {
    float* ptr = nullptr;
    size_t n = 0;
    float* data() { return ptr; }
    const float* data() const { return ptr; }
    size_t size() const { return n; }
  };
  struct Param {
    std::string name;             // "W_GATE", "param.3": names its tensors in state files
    int param_id = 0, grad_id = 0;  // the layer's kt_arg ids (layer mode)
    kt::View param, grad;         // the host's tensors (retained)
    int64_t numel = 0;
    float* master = nullptr;      // param's own data (fp32) or own_master
    kt::Buffer<float> own_master; // for a bf16 parameter
    uint16_t* bf16_copy = nullptr;  // the bf16 parameter written back, or null
    StateSlice m, v, vmax;        // AdamW moments / SGD momentum (m), in the arenas
    std::vector<int64_t> shape;   // kt_optimizer_state's DLTensor shape
    // Full mode: the step packs each updated run of rows into the layer's
    // panels (projection proj, [experts][rows, cols] per parameter), or
    // copies an updated bias into the layer's fp32 biases.
    int proj = -1;
    bool is_bias = false;
    int64_t rows = 0, cols = 0;
  };

  kt_engine* engine = nullptr;  // null: steps run on the calling thread
  kt_moe* moe = nullptr;        // layer mode; reset when the layer is destroyed
  bool layer_mode = false;
  kt_optimizer_options opt;
  int64_t step = 0;
  bool momentum_started = false;  // SGD: buffers hold a previous step's value
  std::vector<Param> params;
  // Each state kind of every parameter in one buffer (huge pages when
  // large), each parameter's slice 64-byte aligned: a step over many small
  // tensors (LoRA factors) streams its state as one array.
  kt::Buffer<float> m_arena, v_arena, vmax_arena;
  const kt::optim::UpdateKernels* kernels = nullptr;

  // Submitted steps not yet ended.
  std::mutex state_mutex;
  std::unordered_map<kt_job*, std::shared_ptr<kt_job>> jobs;
  std::condition_variable jobs_done;
  // Takes an ended (or dropped) job off the list, waking the destruction
  // that waits for the list to empty.
  void job_ended(kt_job* job);
  // Serialises optimizers without an engine.
  std::mutex own_mutex;

  // Locks the engine's compute mutex (or own_mutex without an engine).
  std::unique_lock<std::mutex> lock_compute();

  // Sets up state for every param (after params are filled).
  void allocate_state();
  // The whole step, under lock_compute(); returns false when skipped (never
  // with opt.assume_finite, which makes no check).
  bool step_now(float unscale, float clip, const char* where);
  double grad_sq_norm(const char* where);
  void save(const std::string& path, const char* where);
  void load(const std::string& path, const char* where);

  // Layer mode: the layer still exists and still binds what we update.
  void check_layer(const char* where);
  // Layer mode: the layer reads the (new) parameters (full mode: repacks).
  void layer_params_changed();
  // Layer mode: true when the step writes the layer's panels itself.
  bool packs_in_step() const { return layer_mode && moe && params.size() && params[0].proj >= 0; }

  // Work items: (param, first element, elements); a full-mode weight's
  // items are whole panels of one expert.
  struct Item {
    size_t param;
    int64_t offset, n;
  };
  std::vector<Item> items;
  void plan_items();
  // Full mode: writes the layer's packed panels / biases of item i.
  void write_layer_item(const Item& item, kt::bf16_t* const packed[3], float* const biases[3]) const;

  // Runs fn(item index, span) over every item (on the pool when there is
  // an engine), handed out from the first item or from the last.
  template <class F>
  void for_chunks(F&& fn, bool backwards = false);
};

namespace kt {
namespace optim {
// Refuses options outside their ranges (KT_ERR_INVALID_ARGUMENT naming where).
void validate_options(const kt_optimizer_options& o, const char* where);
void set_options_defaults(kt_optimizer_options& o);
// Row-major without gaps (extents of 1 may have any stride).
bool is_compact(const kt::View& v);
// Builds an optimizer (checked arguments; throws kt::Error naming where).
kt_optimizer* create_for_tensors(kt_engine* engine, const kt_optimizer_options& o,
                                 const kt_optimizer_param* params, size_t n, const char* where);
kt_optimizer* create_for_layer(kt_moe* moe, const kt_optimizer_options& o, const char* where);
// Called by kt_moe_destroy under the compute lock: the layer's optimizers
// fail their later calls instead of touching it.
void detach_layer(kt_moe* moe);
// Checks a host gradient for parameter `param` (dtype, shape, compact).
kt::View check_grad(const DLTensor* grad, const kt::View& param, const std::string& name, const char* where);
}  // namespace optim
}  // namespace kt
