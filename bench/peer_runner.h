// The peers of kt_bench that run in Python (peers_baseline.py: kt-kernel's
// MoE, DeepSpeed's CPU Adam; vLLM's CPU fused MoE in a second process, from
// vLLM's own venv) as subprocesses kt_bench talks to a call at a time, so that kt and a peer are timed in the same rounds, one call each.
#ifndef KT_BENCH_PEER_RUNNER_H_
#define KT_BENCH_PEER_RUNNER_H_

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

#include "workload.h"

namespace kt_bench {

// The pause before each call of kt or a peer when the two alternate: idle
// workers spin after a call (kt's at most 5 ms, kt-kernel's 20-30 ms,
// DeepSpeed's OpenMP threads some ms), and on as many cores as threads the
// other side's call would share them with the spinners.
inline constexpr unsigned kPeerGapUs = 50000;

// A flat JSON object: key -> value text (parse_flat_json_object).
using Fields = std::map<std::string, std::string>;

class PeerProcess {
 public:
  // Starts `python script --threads N [script_args...]` with its stderr in
  // `log_path`; reads its hello line. ok() is false with reason() set when it
  // did not start.
  PeerProcess(const std::string& python, const std::string& script, int threads, const std::string& log_path,
              const std::vector<std::string>& script_args = {});
  ~PeerProcess();
  PeerProcess(const PeerProcess&) = delete;
  PeerProcess& operator=(const PeerProcess&) = delete;

  bool ok() const { return pid_ > 0 && reason_.empty(); }
  const std::string& reason() const { return reason_; }
  const Fields& hello() const { return hello_; }
  // hello()[key], "" when absent.
  std::string said(const std::string& key) const;

  // Sends one command (values are written as JSON strings, which the script
  // converts) and reads the reply. False, with *error set, when the process
  // is gone or replied {"error": ...}; a reply {"reason": ...} is returned
  // for the caller to judge.
  bool ask(const Fields& command, Fields* reply, std::string* error);
  // moe_call / adam_step: the seconds the peer took, negative on failure.
  double seconds_of(const Fields& command, std::string* error);

 private:
  pid_t pid_ = -1;
  FILE* to_ = nullptr;
  FILE* from_ = nullptr;
  std::string reason_, log_path_;
  Fields hello_;
  std::string last_log_line() const;
};

// Writes the layer's weights (gate.bf16, up.bf16, down.bf16) and each
// workload's batches (ids_T.i32, rw_T.f32, x_T.bf16) to `dir` for a peer.
bool write_layer_for_peer(const std::string& dir, const LayerWeights& layer, const std::vector<Workload>& work,
                          std::string* error);

// y of the first `rows` tokens of `b`, in double precision from the bf16
// weights (silu(x Wg^T) * (x Wu^T)) Wd^T, summed over the routes with their
// weights: the reference kt's and a peer's y are measured against.
std::vector<double> reference_y(const LayerWeights& layer, const Batch& b, int64_t rows);
// Relative L2 distance of `got` (rows x H, row-major, first rows of a y)
// from `ref`.
double rel_l2_to(const float* got, const std::vector<double>& ref);

}  // namespace kt_bench

#endif  // KT_BENCH_PEER_RUNNER_H_
