// Runs torch_baseline.py as a subprocess on the benchmark's own routing and
// collects its JSON-lines results, so torch is measured in the same run.
#ifndef KT_BENCH_TORCH_RUNNER_H_
#define KT_BENCH_TORCH_RUNNER_H_

#include <map>
#include <string>
#include <vector>

#include "workload.h"

namespace kt_bench {

struct TorchRun {
  bool ran = false;
  std::string reason;   // why nothing ran, or a failure of the subprocess
  std::string version;  // torch.__version__
  int threads = 0;
  std::map<std::pair<std::string, int64_t>, double> seconds;  // (case key, T or experts) -> median seconds
  std::map<std::pair<std::string, int64_t>, std::string> errors;
};

// "" when `python` imports torch, else a one-line reason.
std::string torch_unavailable_reason(const std::string& python);

TorchRun run_torch_baseline(const std::string& python, const std::string& script, const LayerWeights& layer,
                            const std::vector<Workload>& workloads, const std::vector<Case>& cases, int threads,
                            int warmup, int reps);

// torch_optim_baseline.py: torch.optim.AdamW steps over the fp32 expert
// weights of `experts[i]` experts of `shape`; keys ("adamw_forloop" |
// "adamw_foreach", experts).
TorchRun run_torch_optimizer_baseline(const std::string& python, const std::string& script, const ModelShape& shape,
                                      const std::vector<int64_t>& experts, int threads, int warmup, int reps);

// Parses one flat JSON object ({"k": "string" | number | true | false | null, ...})
// into key -> value text (strings unescaped). False when the line is not one.
bool parse_flat_json_object(const std::string& line, std::map<std::string, std::string>* out);

}  // namespace kt_bench

#endif  // KT_BENCH_TORCH_RUNNER_H_
