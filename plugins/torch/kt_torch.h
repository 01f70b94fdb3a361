// libtorch front end of kt: one MoE layer's routed experts as a TorchScript
// custom class (torch.classes.kt.MoeLayer) plus the ops
//   kt::moe(layer, x, ids, weights) -> y          differentiable (autograd)
//   kt::moe_forward(layer, x, ids, weights, save) -> (y, context)
//   kt::moe_backward(layer, context, dy, param_grads) -> (dx, dweights)
//   kt::context_release(layer, context)
// and kt's fused optimizer over a layer's parameters as a custom class
// (torch.classes.kt.LayerOptimizer).
// The layer's trainable tensors (LoRA factors, or the stacked weights in full
// mode) are CPU tensors kt reads in place; kt writes their grad(): a new
// gradient when grad() is undefined, added to it otherwise, times grad_scale.
#pragma once

#include <ATen/core/Tensor.h>
#include <torch/custom_class.h>

#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include "kt_c_api.h"

namespace kt_torch {

class MoeLayer : public torch::CustomClassHolder {
 public:
  // activation "silu" | "swiglu_oai"; mode "inference" | "lora" | "full";
  // num_threads 0 = one per CPU. Layers asking for the same num_threads share
  // one engine (one pinned worker pool), so many layers do not oversubscribe.
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

  // For LayerOptimizer: the layer handle, made current (parameters re-read
  // if the host changed them, every parameter's grad() bound as the
  // gradient kt's optimizer reads; all must be defined).
  kt_moe* prepare_optimizer_step();

 private:
  void sync_parameters();
  int grad_id(size_t i) const;
  void bind(const std::vector<std::pair<int, at::Tensor>>& args);

  std::shared_ptr<kt_engine> engine_;
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

// kt's fused AdamW or SGD (torch.optim's arithmetic, kt_optimizer_*) over a
// layer's trainable parameters, stepped from the gradients kt wrote into
// their grad(). After a step the layer computes with the new values: in full
// mode kt packed them in the same pass, so the next forward repacks nothing.
class LayerOptimizer : public torch::CustomClassHolder {
 public:
  // algorithm "adamw" | "sgd"; betas, eps for AdamW; momentum, nesterov for SGD.
  LayerOptimizer(c10::intrusive_ptr<MoeLayer> layer, std::string algorithm, double lr,
                 double weight_decay, double beta1, double beta2, double eps, double momentum,
                 bool nesterov);
  ~LayerOptimizer() override;
  LayerOptimizer(const LayerOptimizer&) = delete;
  LayerOptimizer& operator=(const LayerOptimizer&) = delete;

  // One step with g = grad * grad_unscale * clip_coef; false (and nothing
  // changed) when a gradient was not finite.
  bool step(double grad_unscale, double clip_coef);
  void set_lr(double lr);
  double lr() const;
  // Sum of squares of the gradients as stored (for global-norm clipping).
  double grad_sq_norm();
  int64_t steps() const;
  // Masters, moments, step and hyperparameters, written atomically.
  void save(const std::string& path);
  void load(const std::string& path);

 private:
  c10::intrusive_ptr<MoeLayer> layer_;  // outlives the optimizer
  kt_optimizer* opt_ = nullptr;
};

}  // namespace kt_torch
