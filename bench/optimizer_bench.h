// `--cases optimizer`: kt's fused AdamW against torch.optim.AdamW and the
// memory floor, on a model's expert weights (fp32 masters), plus the full
// fine-tune step of that layer it belongs to: forward, backward, optimizer.
#ifndef KT_BENCH_OPTIMIZER_BENCH_H_
#define KT_BENCH_OPTIMIZER_BENCH_H_

#include <cstdint>
#include <string>
#include <vector>

#include "kt_c_api.h"
#include "model_shapes.h"
#include "peer_runner.h"

namespace kt_bench {

// Bytes AdamW must move per fp32 parameter: read param, grad, exp_avg,
// exp_avg_sq; write param, exp_avg, exp_avg_sq.
inline constexpr double kAdamwBytesPerParam = 28;
// A layer's step with bf16 parameters also writes the host's bf16 copy and
// the packed bf16 panel.
inline constexpr double kLayerStepBytesPerParam = kAdamwBytesPerParam + 2 + 2;

struct OptimizerRow {
  int64_t experts = 0;  // experts of the layer's shape these parameters belong to
  int64_t params = 0;
  double kt_plain_s = -1;    // kt_optimizer_step over host fp32 tensors
  double kt_layer_s = -1;    // kt_optimizer_step of a full-mode layer (bf16 params, panels written)
  double repack_s = -1;      // kt_moe_params_changed of that layer (what a torch optimizer needs after it)
  double fwd_bwd_s = -1;     // forward + backward with full-weight gradients at `tokens`
  double torch_forloop_s = -1;  // torch.optim.AdamW(foreach=False)
  double torch_foreach_s = -1;  // torch.optim.AdamW(foreach=True)
  // DeepSpeed's DeepSpeedCPUAdam on the same tensors, a step of each in
  // every round (taking turns at going first): its median, kt's median in
  // those rounds, and the median of each round's DeepSpeed / kt.
  double deepspeed_s = -1, kt_beside_deepspeed_s = -1, deepspeed_ratio = -1;
  // kt's step with assume_finite in those rounds (one pass over the
  // gradients; printed on stderr, kt_bench's table has no column for it).
  double kt_assume_finite_beside_s = -1, deepspeed_ratio_assume_finite = -1;
  // The floor in those rounds: a stream with an fp32 AdamW step's traffic
  // (reads p, g, m, v; writes p, m, v; 28 B/param) on as many threads, the
  // third call of each round (median).
  double floor_beside_s = -1;
  std::string error;         // the first kt failure, if any
};

struct OptimizerReport {
  ModelShape shape{};
  int64_t tokens = 0;  // of the fine-tune step
  std::vector<OptimizerRow> rows;
  std::string torch_version, torch_reason;  // reason: why torch did not run
  int torch_threads = 0;
  std::string deepspeed_version, deepspeed_flags, deepspeed_reason;  // reason: why it did not run
};

struct OptimizerBenchOptions {
  ModelShape shape{};
  std::vector<int64_t> param_counts;  // each rounded to whole experts of `shape`
  int64_t tokens = 512;
  int warmup = 1;
  int reps = 5;
  int threads = 1;
  bool torch = true;
  std::string python, torch_script;
  PeerProcess* peer = nullptr;  // DeepSpeed's CPU Adam, where the peers' interpreter has it
  std::string peer_dir;         // where the tensors are written for it
};

OptimizerReport run_optimizer_bench(kt_engine* engine, const OptimizerBenchOptions& o, const std::string& torch_reason);

}  // namespace kt_bench

#endif  // KT_BENCH_OPTIMIZER_BENCH_H_
