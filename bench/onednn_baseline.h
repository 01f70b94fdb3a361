// The oneDNN yardstick: per expert, bf16 x bf16 -> fp32 oneDNN matmuls for
// gate, up and down (and, for training, the dx and weight-gradient GEMMs),
// with gather, activation and combine as plain C++ between them. These are
// the GEMMs kt runs, without kt's fusion; the gap is what fusion buys.
#ifndef KT_BENCH_ONEDNN_BASELINE_H_
#define KT_BENCH_ONEDNN_BASELINE_H_

#include <memory>
#include <string>
#include <vector>

#include "workload.h"

namespace kt_bench {

class OneDnnBaseline {
 public:
  OneDnnBaseline(const LayerWeights& layer, int threads);
  ~OneDnnBaseline();
  OneDnnBaseline(const OneDnnBaseline&) = delete;
  OneDnnBaseline& operator=(const OneDnnBaseline&) = delete;

  // LoRA has no oneDNN counterpart here; every other case does.
  static bool supports(Case which) { return which != Case::kTrainLora; }
  // Median seconds of one call over the workload's batches, as KtRunner::time_case.
  double time_case(Case which, const Workload& work, int warmup, int reps, std::string* error);
  // One call on the workload's first batch: y and (training cases) dx as
  // floats, to check that the baseline computes what kt computes.
  bool outputs(Case which, const Workload& work, std::vector<float>* y, std::vector<float>* dx, std::string* error);
  static std::string version();

 private:
  struct Impl;
  struct Workspace;
  void size_workspace(Case which, const Workload& work, Workspace& ws) const;
  void run(Case which, const Batch& b, Workspace& ws);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kt_bench

#endif  // KT_BENCH_ONEDNN_BASELINE_H_
