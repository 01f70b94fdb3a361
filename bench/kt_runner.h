// kt through its public C ABI only: one layer per training mode, loaded from
// the host's stacked bf16 weights, timed on the benchmark's workloads.
#ifndef KT_BENCH_KT_RUNNER_H_
#define KT_BENCH_KT_RUNNER_H_

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kt_c_api.h"
#include "workload.h"

namespace kt_bench {

// A kernel a stage ran (kt_engine_profile_kernel), per call of the case.
struct KernelUse {
  std::string stage, kernel;
  double calls = 0, gflop = 0;
};
struct CaseProfile {
  std::vector<std::pair<std::string, double>> stage_ms;  // ms per call by stage
  std::vector<KernelUse> kernels;
};
// "gemm_bf16w__amx 96.1% (1536 calls), gemm_bf16w__avx512bf16 3.9% (40),
// transpose_panels__avx512bf16 (96)": each kernel's share of the case's
// GEMM flops and its calls per case call, over the stages.
std::string kernel_summary(const std::vector<KernelUse>& kernels);

class KtRunner {
 public:
  // format: how the layer stores the base weights (kt_moe_options.weight_format);
  // kt quantizes the host's bf16 weights into it, or, with source, the layer
  // is loaded from layer source_layer of that checkpoint (kt_ckpt_load_layer).
  // compute: kt_moe_options.compute (KT_COMPUTE_INT8: forward only).
  KtRunner(kt_engine* engine, const LayerWeights& layer, int64_t max_tokens,
           kt_weight_format format = KT_FORMAT_BF16, const kt_ckpt* source = nullptr,
           int64_t source_layer = 0, kt_compute compute = KT_COMPUTE_BF16);
  ~KtRunner();
  KtRunner(const KtRunner&) = delete;
  KtRunner& operator=(const KtRunner&) = delete;

  // Median seconds of one call of `which` over the workload's batches (cycled),
  // after `warmup` calls; negative with *error set when kt reports a failure.
  double time_case(Case which, const Workload& work, int warmup, int reps, std::string* error,
                   double pause_s = 0);
  // Times of this runner and `other` (none when null) on the same case,
  // timed in alternation (a call of each per round, after `warmup` untimed
  // rounds and at least half a second of them), so that both see the machine
  // in the same state; with `beside`, called once per round after the two, a
  // limit measured in the same rounds (it returns seconds, or a negative
  // number when it cannot run: then NaN). Medians, and the fastest of each;
  // negative times with *error set when kt fails (NaN for a missing other).
  struct Alternating {
    double mine = -1, other = -1, beside = -1;                 // medians
    double mine_best = -1, other_best = -1, beside_best = -1;  // fastest
    // The median over the rounds of each round's mine / other: the two
    // calls side by side (taking turns at going first), so a drift of the
    // machine's load within the run leaves it, where the medians of each
    // side may catch it on different calls.
    double ratio = -1;
    // The same for the call beside: the median of each round's beside / mine.
    double beside_ratio = -1;
  };
  Alternating time_alternating(KtRunner* other, Case which, const Workload& work, int warmup,
                               int reps, std::string* error,
                               const std::function<double()>& beside = nullptr);
  // kt's per-stage profile over `calls` further calls (profiling is on only
  // for them, so the timed calls never pay for it): (stage, ms per call) of
  // every stage that ran, and the kernels each stage ran.
  bool profile_case(Case which, const Workload& work, int calls, CaseProfile* profile,
                    std::string* error);
  // One call on the workload's first batch: y and (training cases) dx as floats.
  bool outputs(Case which, const Workload& work, std::vector<float>* y, std::vector<float>* dx, std::string* error);
  // (mode, seconds) of every layer loaded so far: how long kt took to pack it.
  const std::vector<std::pair<std::string, double>>& loads() const { return loads_; }
  // Relative L2 distance of the weights the layer computes with
  // (kt_moe_read_weights, fp32) from the host's bf16 weights, over the three
  // projections: the quantization error of the format. NaN with *error set
  // when kt fails or no layer was prepared.
  double weight_rel_l2(std::string* error) const;
  // Bytes per expert of the stored base weights (kt_moe_get_info) of the
  // last layer prepared; 0 before.
  double expert_weight_bytes() const { return expert_weight_bytes_; }

 private:
  bool prepare(kt_mode mode, std::string* error);
  // One forward (+ backward for training cases) of batch b into y, dx, droute.
  bool call(Case which, const Batch& b, HostTensor& y, HostTensor& dx, HostTensor& droute, std::string* error);
  void release_layer();

  kt_engine* engine_;
  const LayerWeights& layer_;
  int64_t max_tokens_;
  kt_weight_format format_;
  kt_compute compute_;
  const kt_ckpt* source_;
  int64_t source_layer_;
  double expert_weight_bytes_ = 0;
  kt_moe* moe_ = nullptr;
  kt_mode mode_ = KT_MODE_INFERENCE;
  std::vector<std::pair<std::string, double>> loads_;
  std::vector<HostTensor> params_;  // LoRA factors and gradient buffers bound to the layer
};

// The LoRA factors a LoRA runner binds, fp32, in the order A_gate, B_gate,
// A_up, B_up, A_down, B_down (A [E, r, in], B [E, out, r]); B non-zero like a
// trained adapter, so no work can be skipped. The same on every call, so a
// peer can be given the factors kt trains.
std::vector<std::vector<float>> lora_factors(const LayerWeights& layer);

// "kt_xxx failed: KT_ERR_...: message" for the last failed call.
std::string kt_error(const char* call, kt_status status);

}  // namespace kt_bench

#endif  // KT_BENCH_KT_RUNNER_H_
