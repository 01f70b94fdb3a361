// kt_bench's parts: the options (kt_bench.cpp), the cases kt and its
// baselines run (kt_bench_cases.cpp), the peers beside kt
// (kt_bench_peers.cpp) and the table and JSON output (kt_bench_output.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "kt_c_api.h"
#include "kt_runner.h"
#include "machine_limits.h"
#include "model_shapes.h"
#include "optimizer_bench.h"
#include "peer_runner.h"
#include "torch_runner.h"
#include "workload.h"

namespace kt_bench {

// The torch baseline script: beside the program when installed
// (<prefix>/libexec/kt/), else the one in the source tree it was built from.
std::string default_torch_script();

// The peers' interpreter: $KT_BENCH_PEERS_PYTHON (the kt-moe command of a pip
// install sets it to its own interpreter, the venv where the peers are
// installed beside kt), else the source tree's venv.
std::string default_peers_python();

// vLLM's interpreter (the venv where vLLM's CPU build is installed):
// $KT_BENCH_VLLM_PYTHON, else empty: the vLLM peer does not run.
std::string default_vllm_python();

// A --format entry: the storage format, and KT_COMPUTE_INT8 for "name/int8".
struct FormatChoice {
  kt_weight_format format = KT_FORMAT_BF16;
  kt_compute compute = KT_COMPUTE_BF16;
  std::string label() const {
    return std::string(kt_weight_format_name(format)) + (compute == KT_COMPUTE_INT8 ? "/int8" : "");
  }
};

struct Options {
  bool json = false;
  bool quick = false;
  std::vector<std::string> models{"qwen3-30b-a3b"};
  std::vector<int64_t> tokens{1, 8, 32, 128, 512, 2048};
  std::vector<Case> cases{std::begin(kAllCases), std::end(kAllCases)};
  bool optimizer = true;                          // the `optimizer` case
  std::vector<int64_t> optim_params{16000000, 64000000};
  int threads = 0;
  int reps = 5;
  int warmup = 1;
  kt_isa max_isa = KT_ISA_AUTO;
  kt_gemm_backend backend = KT_GEMM_AUTO;
  double max_weight_gb = 1.25;
  bool profile = false;
  bool onednn = true;
  bool torch = true;
  std::string python = "/usr/bin/python3";
  std::string torch_script = default_torch_script();
  // The interpreter of the optional peers (kt-kernel, DeepSpeed, torch 2):
  // see default_peers_python.
  bool peers = true;
  std::string peers_python = default_peers_python();
  // vLLM's CPU fused MoE beside kt's forward, run by this interpreter (a
  // second peers' process: vLLM has a venv of its own); empty: not run.
  std::string vllm_python = default_vllm_python();
  // Storage formats (with how the layer multiplies) compared side by side
  // with bf16 (kt only).
  std::vector<FormatChoice> formats;
};

struct Row {
  Case which = Case::kForward;
  int64_t tokens = 0;
  double routes = 0, touched = 0, flops = 0, bytes = 0;
  double kt_s = NAN, onednn_s = NAN, torch_s = NAN;
  // Memory-bound cases: kt timed again in rounds with a plain read of the
  // same bytes after each call, and that read (medians).
  double kt_beside_read_s = NAN, read_s = NAN;
  std::string kt_error, onednn_error, torch_error;
  // Relative L2 distance of oneDNN's result from kt's on the first batch:
  // y for forward, dx for fwd+bwd dx (NaN when not compared).
  double onednn_rel_l2 = NAN;
  // The kernels each stage ran (one untimed round of the batches) and,
  // with --profile, ms per call by stage.
  CaseProfile kt_profile;
};

// kt with another storage format of the base weights, on a bf16 row's
// workload: bytes are those the format stores for the touched experts.
struct FormatRow {
  FormatChoice choice;
  Case which = Case::kForward;
  int64_t tokens = 0;
  double bytes_per_weight = 0, bytes = 0, kt_s = NAN;
  double bf16_s = NAN;  // the bf16 layer, timed in alternation with this one
  double paired = NAN;  // the median of each round's kt_s / bf16_s (Alternating::ratio)
  // A plain read of `bytes` by the same threads, the third call of each of
  // those rounds: its median and fastest (NaN where the bytes are over its
  // buffer's size), and the fastest of kt's calls. Single calls and reads
  // stall now and then: a ratio compares medians with medians, or the
  // fastest with the fastest.
  double read_s = NAN, read_best_s = NAN, kt_best_s = NAN;
  CaseProfile kt_profile;  // as Row's
  std::string error;
};

// The quantization error of a format on the benchmark's weights.
struct FormatError {
  FormatChoice choice;
  double weight_rel_l2;  // of the layer's W' from the bf16 weights
  // KT_COMPUTE_INT8: y against the same base with bf16 activations (the
  // error int8 activations add), and the T of the batch it was taken on.
  double activation_rel_l2 = NAN;
  int64_t activation_tokens = 0;
};

// A synthetic quantized checkpoint written for a format kt does not
// quantize to itself.
struct CheckpointWritten {
  kt_weight_format format;
  double file_bytes, seconds;
};

struct TouchedRow {
  int64_t touched = 0, tokens = 0;
  double bytes = 0;
  double kt_s = NAN;
};

// Cost model t = a * touched + b * routes fitted by least squares over one
// case's rows: a is the per-expert (weight streaming) cost, b the per-route
// (compute) cost; the residual says how linear the cost is.
struct LinearFit {
  double ms_per_expert = NAN, us_per_route = NAN, max_rel_residual = NAN;
};

// A peer's time on a row's workload, each call beside one of kt's (the two
// taking turns, same batches), and both results against a double-precision
// reference on the first rows of the first batch.
struct PeerRow {
  std::string peer, variant;  // "kt-kernel" or "vllm", "bf16" | "int8" | "int4"
  std::string peer_class;     // the peer's class that ran
  std::string kt_format;      // the kt layer it is compared with
  Case which = Case::kForward;
  int64_t tokens = 0;
  double kt_s = NAN, peer_s = NAN;  // medians over the rounds
  double ratio = NAN;               // median of each round's peer / kt
  double kt_rel_l2 = NAN, peer_rel_l2 = NAN;
  int64_t rows_compared = 0;
  std::string note;  // what the two calls share or do not (training cases)
  std::string error;
};

// A peer, or part of one, that did not run, and why.
struct PeerSkip {
  std::string peer, what, reason;
};

struct ModelReport {
  ModelShape shape;
  int64_t experts_held;
  double weight_bytes;
  std::vector<std::pair<std::string, double>> loads;  // (layer mode, seconds kt took to pack it)
  std::vector<Row> rows;
  std::vector<TouchedRow> sweep;
  std::vector<FormatRow> formats;  // --format
  std::vector<CheckpointWritten> checkpoints;  // --format's checkpoint-only formats
  std::vector<FormatError> format_errors;      // --format
  std::map<Case, LinearFit> fits;
  std::string onednn_reason;  // empty when it ran
  TorchRun torch;
  TorchRun torch2;             // the peers' interpreter's torch, when not --python's
  std::vector<PeerRow> peer_rows;
};

struct Limits {
  MachineLimits machine;
  double peak_gflops = 0;
  std::string peak_kind;
  // kt's fixed cost per layer call: a T=1 forward of a layer too small to
  // cost anything else (NaN with call_error set when kt failed).
  double call_us = NAN;
  // The same after a pause before each call (kCallPause: a host's own work
  // between layer calls, attention on the GPU at decode), which idle
  // workers may sleep through.
  double call_paused_us = NAN;
  std::string call_error;
};

// The roofline's two floors of a case, in seconds: its FLOPs at the measured
// peak and its bytes at the measured bandwidth (0 where unmeasured).
struct Floors {
  double compute, memory;
};
Floors floors_of(double flops, double bytes, const Limits& lim);

// A peer that ran, by name ("kt-kernel", "deepspeed", "torch"), its version
// and the interpreter it ran in.
struct PeerEntry {
  std::string name, version, python, role, detail;
};

// A layer too small to cost anything but the call, and the pause before each
// call of the paused measurement (a host's own work between layer calls,
// attention on the GPU at decode), which idle workers may sleep through.
constexpr ModelShape kMinimalLayer{"minimal", 64, 64, 8, 8, 1};
constexpr double kCallPause = 1e-3;

// ------------------------------------------------------------ cases

std::string onednn_version();

// Median microseconds of a T=1 forward on kMinimalLayer, back to back and
// after kCallPause: what a layer call costs beyond its weights' bytes and
// FLOPs (argument checks, routing, the workers' hand-offs).
void measure_call_us(kt_engine* engine, Limits* lim);

// Every case of o on one model: kt, its storage formats, kt-kernel (through
// peer), vLLM (through vllm), oneDNN and torch.
ModelReport bench_model(const ModelShape& shape, const Options& o, kt_engine* engine, int threads,
                        const Limits& lim, const std::string& torch_reason, PeerProcess* peer, PeerProcess* vllm,
                        const std::string& peer_dir, std::vector<PeerSkip>* skips);

// ------------------------------------------------------------ peers

// kt-kernel beside kt on the same layer, routing and inputs, on the cases of
// --cases it has: the forward and, where its build has the bf16 SFT classes,
// train_lora and train_dx; a skip with the reason for each case it does not run.
// *layer_written: whether peer_dir holds the layer and its batches (set once
// written).
void bench_kt_kernel(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o,
                     kt_engine* engine, KtRunner& bf16, int64_t max_tokens, PeerProcess* peer,
                     const std::string& peer_dir, bool* layer_written, ModelReport* rep,
                     std::vector<PeerSkip>* skips);

// vLLM's CPU fused MoE (the op its unquantized CPU experts serve with, its
// weights prepacked as at its load) beside kt's bf16 forward at every T, on
// the same layer, routing, inputs and threads; a skip with the reason for
// each case it does not run (it has no training path).
void bench_vllm(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o, KtRunner& bf16,
                int64_t max_tokens, PeerProcess* vllm, const std::string& peer_dir, bool* layer_written,
                ModelReport* rep, std::vector<PeerSkip>* skips);

// Which peers ran, and adds a skip for each one that did not (with why).
std::vector<PeerEntry> summarize_peers(const Options& o, PeerProcess* peer, PeerProcess* vllm,
                                       const std::vector<ModelReport>& models, const OptimizerReport* optimizer,
                                       std::vector<PeerSkip>* skips);

std::string skip_line(const std::vector<PeerSkip>& skips);

// Removes `dir` and the files in it (the peers' data: weights, batches,
// outputs, their log).
void remove_directory(const std::string& dir);

// ------------------------------------------------------------ output

void print_table(const Options& o, const Limits& lim, const kt_engine_info& info, const std::vector<ModelReport>& models,
                 const OptimizerReport* optimizer, const std::vector<PeerEntry>& peers,
                 const std::vector<PeerSkip>& skips);

void write_json(const Options& o, const Limits& lim, const kt_engine_info& info, const std::vector<ModelReport>& models,
                const OptimizerReport* optimizer, const std::vector<PeerEntry>& peers,
                const std::vector<PeerSkip>& skips);

}  // namespace kt_bench
