// libtorch front end of kt: one MoE layer's routed experts as a TorchScript
// custom class (torch.classes.kt.MoeLayer) plus the ops
//   kt::moe(layer, x, ids, weights) -> y          differentiable (autograd)
//   kt::moe_forward(layer, x, ids, weights, save) -> (y, context)
//   kt::moe_backward(layer, context, dy, param_grads) -> (dx, dweights)
//   kt::context_release(layer, context)
// The layer's trainable tensors (LoRA factors, or the stacked weights in full
// mode) are CPU tensors kt reads in place; kt writes their grad(): a new
// gradient when grad() is undefined, added to it otherwise, times grad_scale.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <string>
#include <tuple>
#include <vector>

#include "kt_c_api.h"

namespace kt_torch {

class MoeLayer : public torch::CustomClassHolder {
 public:
  // activation "silu" | "swiglu_oai"; mode "inference" | "lora" | "full";
  // num_threads 0 = one per CPU.
  MoeLayer(int64_t num_experts, int64_t top_k, int64_t hidden, int64_t intermediate,
           std::string activation, double act_limit, std::string mode, int64_t lora_rank,
           double lora_alpha, int64_t max_tokens, int64_t num_threads);
  ~MoeLayer() override;
  MoeLayer(const MoeLayer&) = delete;
  MoeLayer& operator=(const MoeLayer&) = delete;

  // Stacked [E, out, in] weights (bf16/fp16/fp32); in full mode copied into
  // the trainable weights.
  void load_weights(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down);
  // The trainable tensors, and their names (lora_A_gate, ..., w_down).
  std::vector<at::Tensor> parameters() const { return params_; }
  std::vector<std::string> parameter_names() const { return param_names_; }
  double lora_scale() const;
  double grad_scale() const { return grad_scale_; }
  void set_grad_scale(double s) { grad_scale_ = s; }
  int64_t hidden() const { return hidden_; }
  int64_t top_k() const { return top_k_; }

  std::tuple<at::Tensor, int64_t> forward(const at::Tensor& x, const at::Tensor& ids,
                                          const at::Tensor& weights, bool save);
  std::tuple<at::Tensor, at::Tensor> backward(int64_t context, const at::Tensor& dy,
                                              bool param_grads);
  void release(int64_t context);

 private:
  void sync_parameters();
  void bind(const std::vector<std::pair<int, at::Tensor>>& args);

  kt_engine* engine_ = nullptr;
  kt_moe* moe_ = nullptr;
  int64_t top_k_, hidden_;
  kt_mode mode_;
  double grad_scale_ = 1.0;
  std::vector<at::Tensor> params_;
  std::vector<std::string> param_names_;
  std::vector<int> param_ids_;                   // kt_arg_id of each parameter
  std::vector<const void*> bound_ptr_;           // data kt holds per parameter
  std::vector<int64_t> bound_version_;           // version counter kt has read
  std::vector<const void*> bound_grad_ptr_;      // grad buffer kt writes
  bool needs_reload_ = false;
};

}  // namespace kt_torch
