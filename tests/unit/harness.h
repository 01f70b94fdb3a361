// Test harness: owning DLPack tensors, random MoE problems, and a runner that
// drives a layer through the C ABI and compares it with the reference.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "kt_c_api.h"
#include "moe/reference.h"

namespace kt_test {

// A DLTensor that owns its storage, shape and strides.
struct Tensor {
  std::vector<unsigned char> bytes;
  std::vector<int64_t> shape, strides;
  DLTensor t{};

  Tensor() = default;
  Tensor(const Tensor&) = delete;
  Tensor& operator=(const Tensor&) = delete;

  static std::unique_ptr<Tensor> make(DLDataType dt, std::vector<int64_t> shape) {
    auto x = std::make_unique<Tensor>();
    x->shape = std::move(shape);
    int64_t n = 1;
    for (int64_t s : x->shape) n *= s;
    x->bytes.assign(static_cast<size_t>(n * dt.bits / 8) + 64, 0);
    x->t.data = x->bytes.data();
    x->t.device = {kDLCPU, 0};
    x->t.ndim = static_cast<int>(x->shape.size());
    x->t.dtype = dt;
    x->t.shape = x->shape.data();
    x->t.strides = nullptr;
    x->t.byte_offset = 0;
    return x;
  }
  DLTensor* dl() { return &t; }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t s : shape) n *= s;
    return n;
  }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
  uint16_t* u16() { return reinterpret_cast<uint16_t*>(bytes.data()); }
  // Element i (compact) as double.
  double get(int64_t i) const {
    const unsigned char* p = bytes.data();
    if (t.dtype.code == kDLFloat && t.dtype.bits == 32) return reinterpret_cast<const float*>(p)[i];
    if (t.dtype.code == kDLBfloat) return kt::bf16_to_f32(reinterpret_cast<const uint16_t*>(p)[i]);
    if (t.dtype.code == kDLInt && t.dtype.bits == 32) return reinterpret_cast<const int32_t*>(p)[i];
    if (t.dtype.code == kDLInt && t.dtype.bits == 64) return static_cast<double>(reinterpret_cast<const int64_t*>(p)[i]);
    return 0;
  }
  void set(int64_t i, double v) {
    unsigned char* p = bytes.data();
    if (t.dtype.code == kDLFloat && t.dtype.bits == 32) reinterpret_cast<float*>(p)[i] = static_cast<float>(v);
    else if (t.dtype.code == kDLBfloat) reinterpret_cast<uint16_t*>(p)[i] = kt::f32_to_bf16(static_cast<float>(v));
    else if (t.dtype.code == kDLInt && t.dtype.bits == 32) reinterpret_cast<int32_t*>(p)[i] = static_cast<int32_t>(v);
    else if (t.dtype.code == kDLInt && t.dtype.bits == 64) reinterpret_cast<int64_t*>(p)[i] = static_cast<int64_t>(v);
  }
  std::vector<double> values() const {
    std::vector<double> v(static_cast<size_t>(numel()));
    for (int64_t i = 0; i < numel(); ++i) v[static_cast<size_t>(i)] = get(i);
    return v;
  }
};

constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kF16{kDLFloat, 16, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};
constexpr DLDataType kI64{kDLInt, 64, 1};
constexpr DLDataType kU8{kDLUInt, 8, 1};

using TensorPtr = std::unique_ptr<Tensor>;

inline double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  if (den == 0) return std::sqrt(num);
  return std::sqrt(num / den);
}

// One MoE problem: shapes, options, routing pattern.
struct Case {
  std::string name;
  int64_t E = 4, K = 2, H = 64, I = 32, T = 8;
  kt_activation act = KT_ACT_SILU;
  float limit = 0.f;
  bool bias = false;
  kt_mode mode = KT_MODE_INFERENCE;
  int64_t rank = 0;
  unsigned targets = KT_PROJ_ALL;
  bool rslora = false;
  bool bf16_act = false;      // x, y, dy, dx in bf16
  bool bf16_params = false;   // LoRA factors, their gradients and full grads in bf16
  int minus_one_every = 0;    // every n-th route is -1
  bool one_expert = false;    // all routes to expert 0 (k = 1 then)
  std::vector<int> skipped;   // experts marked skipped
  uint32_t seed = 1;
  kt_precision precision = KT_PRECISION_DEFAULT;  // of the engine
  kt_weight_format format = KT_FORMAT_BF16;       // storage of the base weights
  kt_compute compute = KT_COMPUTE_BF16;           // how the weight GEMMs multiply
  // Base weights (and biases) from layer ckpt_layer of the checkpoint in
  // ckpt_dir (kt_ckpt_load_layer_with, dequantize as given) instead of
  // random ones; the reference computes from what the layer reads back.
  std::string ckpt_dir;
  int64_t ckpt_layer = 0;
  bool dequantize = false;
};

inline std::ostream& operator<<(std::ostream& o, const Case& c) { return o << c.name; }

// Builds the layer through the ABI, loads weights, runs forward + backward,
// and compares each quantity with the reference.
class Runner {
 public:
  // backend KT_GEMM_ONEDNN: not available (skip) when this build or CPU
  // cannot run it. By default an ISA's cases run kt's own kernels
  // (KT_GEMM_NATIVE): on AMX CPUs KT_GEMM_AUTO may take oneDNN's by a
  // timing, and the oneDNN backend has cases of its own.
  // shared: an engine to create the layer on (borrowed; the runner then
  // neither configures nor destroys it), instead of one of its own.
  Runner(const Case& c, kt_isa isa, int threads = 2, kt_gemm_backend backend = KT_GEMM_NATIVE,
         kt_engine* shared = nullptr);
  ~Runner();
  bool isa_available() const { return available_; }
  kt_engine* engine() { return engine_; }
  kt_moe* moe() { return moe_; }
  const Case& c() const { return c_; }

  void fill_inputs(uint32_t seed);  // new x, ids, w, dy
  // Forward (saving a context when save) into y; returns status.
  kt_status forward(kt_context** save);
  kt_status backward(kt_context* ctx, float grad_scale, kt_grad_accumulate mode);

  // The reference on the runner's inputs; with bf16_operands, on x and dy
  // rounded to bf16 as the bf16-operand tables take fp32 activations (the
  // header's precision contract), so a case whose result is that sensitive
  // to the rounding still checks kt's own error.
  std::vector<double> ref_forward(bool bf16_operands = false) const;
  kt::reference::Grads ref_backward(bool bf16_operands = false) const;

  // Quantity views of kt's outputs.
  std::vector<double> y() const { return y_->values(); }
  std::vector<double> dx() const { return dx_->values(); }
  std::vector<double> dw() const { return dw_->values(); }
  std::vector<double> grad_lora(int p, bool b) const { return (b ? glb_[p] : gla_[p])->values(); }
  std::vector<double> grad_full(int p, bool bias) const { return (bias ? gb_[p] : gW_[p])->values(); }

  // Changes LoRA param p (A or B) in place and tells kt.
  void perturb_lora(int p, bool b, double delta);

  // Every host tensor the runner owns (inputs, outputs, weights, LoRA
  // factors, gradient buffers), by name.
  std::vector<std::pair<std::string, const Tensor*>> host_tensors() const;
  // Their bytes now; and the names of those whose bytes differ from a
  // snapshot (a refused call must write none of the caller's memory).
  using Snapshot = std::vector<std::pair<std::string, std::vector<unsigned char>>>;
  Snapshot snapshot() const;
  std::vector<std::string> changed_since(const Snapshot& before) const;

  kt::reference::Spec spec;
  // The reference's weights: the bf16 tensors kt loaded, or for a quantized
  // base the dequantized weights the layer reads back (kt_moe_read_weights).
  kt::reference::Params params;
  // Quantized bases: relative L2 error of the layer's weights against the
  // loaded ones, per projection (0 for bf16).
  double quant_error[3] = {0, 0, 0};
  TensorPtr x_, ids_, w_, y_, dy_, dx_, dw_;
  TensorPtr la_[3], lb_[3], gla_[3], glb_[3], W_[3], B_[3], gW_[3], gb_[3];

 private:
  void load_random(std::mt19937& rng);
  void load_checkpoint();
  Case c_;
  bool available_ = false;
  kt_engine* engine_ = nullptr;
  bool own_engine_ = true;
  kt_moe* moe_ = nullptr;
};

}  // namespace kt_test
