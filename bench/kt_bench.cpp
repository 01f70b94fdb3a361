// kt_bench: kt on real MoE shapes against this machine's measured limits and
// against oneDNN-per-expert and torch eager, all in one run.
//
//   kt_bench [--json] [--quick] [--models LIST|all] [--tokens LIST] [--cases LIST]
//            [--threads N] [--reps N] [--warmup N] [--isa NAME] [--max-weight-gb X]
//            [--profile] [--no-onednn] [--no-torch] [--python PATH] [--torch-script PATH]
//            [--optim-params LIST] [--no-peers] [--peers-python PATH]
//            [--format LIST]
//
// Only kt's public C ABI is used for kt. See README.md for the columns.
#include <dirent.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "json_writer.h"
#include "kt_c_api.h"
#include "kt_runner.h"
#include "machine_limits.h"
#include "model_shapes.h"
#include "optimizer_bench.h"
#include "peer_runner.h"
#include "quant_checkpoint.h"
#include "torch_runner.h"
#include "workload.h"
#if KT_BENCH_HAVE_ONEDNN
#include "onednn_baseline.h"
#endif

namespace kt_bench {
namespace {

// The torch baseline script: beside the program when installed
// (<prefix>/libexec/kt/), else the one in the source tree it was built from.
std::string default_torch_script() {
  char self[4096];
  const ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
  if (n > 0) {
    self[n] = '\0';
    std::string dir(self);
    const std::string beside = dir.substr(0, dir.find_last_of('/')) + "/torch_baseline.py";
    if (access(beside.c_str(), R_OK) == 0) return beside;
  }
  return KT_BENCH_TORCH_SCRIPT;
}

// The peers' interpreter: $KT_BENCH_PEERS_PYTHON (the kt-moe command of a pip
// install sets it to its own interpreter, the venv where the peers are
// installed beside kt), else the source tree's venv.
std::string default_peers_python() {
  const char* env = std::getenv("KT_BENCH_PEERS_PYTHON");
  return env && *env ? env : KT_BENCH_PEERS_PYTHON;
}

// torch_optim_baseline.py, found like torch_baseline.py.
std::string optimizer_script_of(const std::string& torch_script) {
  return torch_script.substr(0, torch_script.find_last_of('/') + 1) + "torch_optim_baseline.py";
}

// peers_baseline.py, found like torch_baseline.py.
std::string peers_script_of(const std::string& torch_script) {
  return torch_script.substr(0, torch_script.find_last_of('/') + 1) + "peers_baseline.py";
}

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
  // Storage formats (with how the layer multiplies) compared side by side
  // with bf16 (kt only).
  std::vector<FormatChoice> formats;
};

const char* kUsage =
    "usage: kt_bench [options]\n"
    "  --json               print one JSON document instead of the table\n"
    "  --quick              smoke run: T in {1,8}, a 16-expert slice, 1 rep\n"
    "  --models LIST|all    comma-separated model names (default qwen3-30b-a3b)\n"
    "  --tokens LIST        token counts T (default 1,8,32,128,512,2048)\n"
    "  --cases LIST         forward,train_dx,train_lora,train_full,optimizer (default all)\n"
    "  --optim-params LIST  optimizer case: parameter counts in millions, rounded to whole\n"
    "                       experts (at least top_k) of the first model (default 16,64)\n"
    "  --threads N          kt worker threads, and the threads of every measurement (0 = all "
    "CPUs)\n"
    "  --reps N             timed repetitions per result, median reported (default 5)\n"
    "  --warmup N           untimed calls before them (default 1)\n"
    "  --isa NAME           cap kt's kernels: ref, avx2, avx512bf16, amx\n"
    "  --backend NAME       kt's weight GEMMs: auto (default: on the amx table the faster of\n"
    "                       kt's tiles and oneDNN, measured once), native or onednn (kt_gemm_backend)\n"
    "  --max-weight-gb X    bf16 weights held per layer; larger models run a slice (default 1.25)\n"
    "  --profile            also report kt's per-stage profile (extra, untimed calls)\n"
    "  --no-onednn          skip the oneDNN baseline\n"
    "  --no-torch           skip the torch baseline\n"
    "  --python PATH        interpreter for the torch baseline (default /usr/bin/python3)\n"
    "  --torch-script PATH  torch_baseline.py to run (peers_baseline.py and torch_optim_baseline.py\n"
    "                       are taken from its directory)\n"
    "  --peers-python PATH  interpreter of the optional peers, each run where it imports:\n"
    "                       kt-kernel (forward beside kt's, int8/int4 with its own quantization),\n"
    "                       DeepSpeed's CPU Adam (optimizer case) and its torch when that is not\n"
    "                       --python's (default $KT_BENCH_PEERS_PYTHON, else\n"
    "                       " KT_BENCH_PEERS_PYTHON ")\n"
    "  --no-peers           skip those peers\n"
    "  --format LIST        also run kt with these weight storage formats, side by side with bf16\n"
    "                       on the same layer and workloads (not train_full: a quantized base is\n"
    "                       frozen): int8_channel, int4_g32, int4_g128 (kt quantizes the bf16\n"
    "                       weights at load), fp8_b128, mxfp4, int4_g32_zp, int4_g128_zp (the\n"
    "                       bf16 weights quantized into a synthetic checkpoint of that layout\n"
    "                       in $TMPDIR, loaded from it; _zp: compressed-tensors with zero "
    "points);\n"
    "                       int8_channel/int8, int4_g32/int8, int4_g128/int8, int4_g32_zp/int8,\n"
    "                       int4_g128_zp/int8, mxfp4/int8: the same base with int8 activations\n"
    "                       (KT_COMPUTE_INT8), forward only\n";

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream in(s);
  std::string part;
  while (std::getline(in, part, ','))
    if (!part.empty()) parts.push_back(part);
  return parts;
}

bool parse_options(int argc, char** argv, Options* o, std::string* error) {
  bool tokens_given = false, reps_given = false, optim_params_given = false;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&](std::string* v) {
      if (i + 1 >= argc) {
        *error = a + " needs a value";
        return false;
      }
      *v = argv[++i];
      return true;
    };
    std::string v;
    if (a == "--json") o->json = true;
    else if (a == "--quick") o->quick = true;
    else if (a == "--profile") o->profile = true;
    else if (a == "--no-onednn") o->onednn = false;
    else if (a == "--no-torch") o->torch = false;
    else if (a == "--no-peers") o->peers = false;
    else if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (!next(&v)) {
      return false;
    } else if (a == "--models") {
      o->models.clear();
      for (const std::string& m : split(v)) {
        if (m == "all") {
          for (const ModelShape& s : kModelShapes) o->models.push_back(s.name);
        } else {
          o->models.push_back(m);
        }
      }
    } else if (a == "--tokens") {
      o->tokens.clear();
      for (const std::string& t : split(v)) o->tokens.push_back(std::atoll(t.c_str()));
      tokens_given = true;
    } else if (a == "--cases") {
      o->cases.clear();
      o->optimizer = false;
      for (const std::string& c : split(v)) {
        if (c == "optimizer") {
          o->optimizer = true;
          continue;
        }
        const Case* found = std::find_if(std::begin(kAllCases), std::end(kAllCases), [&](Case k) { return c == case_key(k); });
        if (found == std::end(kAllCases)) {
          *error = "unknown case " + c;
          return false;
        }
        o->cases.push_back(*found);
      }
    } else if (a == "--optim-params") {
      o->optim_params.clear();
      for (const std::string& n : split(v)) o->optim_params.push_back(static_cast<int64_t>(std::atof(n.c_str()) * 1e6));
      optim_params_given = true;
    } else if (a == "--threads") o->threads = std::atoi(v.c_str());
    else if (a == "--reps") {
      o->reps = std::atoi(v.c_str());
      reps_given = true;
    } else if (a == "--warmup") o->warmup = std::atoi(v.c_str());
    else if (a == "--max-weight-gb") o->max_weight_gb = std::atof(v.c_str());
    else if (a == "--python") o->python = v;
    else if (a == "--torch-script") o->torch_script = v;
    else if (a == "--peers-python") o->peers_python = v;
    else if (a == "--backend") {
      if (v == "auto") {
        o->backend = KT_GEMM_AUTO;
      } else if (v == "native") {
        o->backend = KT_GEMM_NATIVE;
      } else if (v == "onednn") {
        o->backend = KT_GEMM_ONEDNN;
      } else {
        *error = "unknown GEMM backend " + v + " (auto, native, onednn)";
        return false;
      }
    } else if (a == "--format") {
      for (const std::string& entry : split(v)) {
        const size_t slash = entry.find('/');
        const std::string name = entry.substr(0, slash);
        const kt_weight_format all[] = {KT_FORMAT_BF16,      KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32,
                                        KT_FORMAT_INT4_G128,  KT_FORMAT_FP8_B128,     KT_FORMAT_MXFP4,
                                        KT_FORMAT_INT4_G32_ZP, KT_FORMAT_INT4_G128_ZP};
        const kt_weight_format* f =
            std::find_if(std::begin(all), std::end(all), [&](kt_weight_format x) { return name == kt_weight_format_name(x); });
        if (f == std::end(all)) {
          *error = "unknown weight format " + name;
          return false;
        }
        FormatChoice choice{*f, KT_COMPUTE_BF16};
        if (slash != std::string::npos) {
          // kt_moe_create's rule: every quantized format but fp8 (not integers).
          if (entry.substr(slash + 1) != "int8" || *f == KT_FORMAT_BF16 ||
              *f == KT_FORMAT_FP8_B128) {
            *error = "--format " + entry +
                     ": only the integer formats (int8_channel, int4_g32, int4_g128, int4_g32_zp, "
                     "int4_g128_zp, mxfp4) take /int8 (KT_COMPUTE_INT8)";
            return false;
          }
          choice.compute = KT_COMPUTE_INT8;
        }
        if (*f != KT_FORMAT_BF16) o->formats.push_back(choice);
      }
    } else if (a == "--isa") {
      const kt_isa all[] = {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX};
      const kt_isa* found = std::find_if(std::begin(all), std::end(all), [&](kt_isa x) { return v == kt_isa_name(x); });
      if (found == std::end(all)) {
        *error = "unknown ISA " + v;
        return false;
      }
      o->max_isa = *found;
    } else {
      *error = "unknown option " + a;
      return false;
    }
  }
  if (o->quick) {
    if (!tokens_given) o->tokens = {1, 8};
    if (!reps_given) o->reps = 1;
    if (!optim_params_given) o->optim_params = {1};
  }
  for (int64_t n : o->optim_params)
    if (n < 1) {
      *error = "--optim-params must be positive";
      return false;
    }
  for (int64_t t : o->tokens)
    if (t < 1) {
      *error = "token counts must be >= 1";
      return false;
    }
  for (const std::string& m : o->models)
    if (std::none_of(std::begin(kModelShapes), std::end(kModelShapes), [&](const ModelShape& s) { return m == s.name; })) {
      *error = "unknown model " + m;
      return false;
    }
  if (o->reps < 1 || o->warmup < 0 || o->tokens.empty() || (o->cases.empty() && !o->optimizer) || o->max_weight_gb <= 0) {
    *error = "need --reps >= 1, --warmup >= 0, --max-weight-gb > 0, and some tokens and cases";
    return false;
  }
  return true;
}

// ------------------------------------------------------------ measurements

std::string onednn_version() {
#if KT_BENCH_HAVE_ONEDNN
  return OneDnnBaseline::version();
#else
  return "";
#endif
}

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

[[maybe_unused]] double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return got.size() != ref.size() ? NAN : den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

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
  std::string peer, variant;  // "kt-kernel", "bf16" | "int8" | "int4"
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
Floors floors_of(double flops, double bytes, const Limits& lim) {
  return {lim.peak_gflops > 0 ? flops / (lim.peak_gflops * 1e9) : 0,
          lim.machine.dram_read_gbs > 0 ? bytes / (lim.machine.dram_read_gbs * 1e9) : 0};
}

// Whether the case's floor is its bytes rather than its FLOPs (the roofline's
// `*` in the table).
// kt's profile of a case after its timed calls: the kernels it ran (one
// call; with --profile the stages' times too, over --reps calls).
void profile(KtRunner& kt, Case which, const Workload& work, const Options& o, CaseProfile* out,
             std::string* error) {
  kt.profile_case(which, work, o.profile ? o.reps : 1, out, error);
  if (!o.profile) out->stage_ms.clear();
}

bool memory_bound(double flops, double bytes, const Limits& lim) {
  const Floors f = floors_of(flops, bytes, lim);
  return f.memory > f.compute;
}

constexpr ModelShape kMinimalLayer{"minimal", 64, 64, 8, 8, 1};

// Median microseconds of a T=1 forward on kMinimalLayer: what a layer call
// costs beyond its weights' bytes and FLOPs (argument checks, routing, the
// workers' hand-offs).
constexpr double kCallPause = 1e-3;

void measure_call_us(kt_engine* engine, Limits* lim) {
  const LayerWeights layer = make_layer_weights(kMinimalLayer, kMinimalLayer.experts, 11);
  const Workload work = make_workload(layer, 1, 11);
  KtRunner runner(engine, layer, 1);
  const double s = runner.time_case(Case::kForward, work, 50, 1001, &lim->call_error);
  lim->call_us = s < 0 ? NAN : s * 1e6;
  if (s < 0) return;
  const double p = runner.time_case(Case::kForward, work, 5, 201, &lim->call_error, kCallPause);
  lim->call_paused_us = p < 0 ? NAN : p * 1e6;
}

LinearFit fit_cost(const std::vector<Row>& rows, Case which) {
  double s_tt = 0, s_tr = 0, s_rr = 0, s_ty = 0, s_ry = 0;
  std::vector<const Row*> used;
  for (const Row& r : rows) {
    if (r.which != which || !std::isfinite(r.kt_s)) continue;
    const double y = r.kt_s * 1e3;
    s_tt += r.touched * r.touched;
    s_tr += r.touched * r.routes;
    s_rr += r.routes * r.routes;
    s_ty += r.touched * y;
    s_ry += r.routes * y;
    used.push_back(&r);
  }
  LinearFit fit;
  const double det = s_tt * s_rr - s_tr * s_tr;
  if (used.size() < 3 || std::fabs(det) < 1e-12 * s_tt * s_rr) return fit;
  const double a = (s_ty * s_rr - s_ry * s_tr) / det;
  const double b = (s_tt * s_ry - s_tr * s_ty) / det;
  fit.ms_per_expert = a;
  fit.us_per_route = b * 1e3;
  fit.max_rel_residual = 0;
  for (const Row* r : used) {
    const double y = r->kt_s * 1e3;
    fit.max_rel_residual = std::max(fit.max_rel_residual, std::fabs(a * r->touched + b * r->routes - y) / y);
  }
  return fit;
}

void add_skip(std::vector<PeerSkip>* skips, const std::string& peer, const std::string& what,
              const std::string& reason) {
  for (const PeerSkip& s : *skips)
    if (s.peer == peer && s.what == what) return;
  skips->push_back({peer, what, reason});
}

// kt's LoRA scale: kt_moe_options.lora_alpha / rank as KtRunner sets them.
constexpr double kLoraAlpha = 2.0 * kLoraRank;

// dx of the first `rows` tokens of batch b in double precision from the bf16
// weights: the backward for dy of y = sum_j w_j down(silu(gate x) * up x),
// each projection W + (alpha / r) B A where `lora` holds the factors (in
// lora_factors' order), W alone where it is null.
std::vector<double> reference_dx(const LayerWeights& layer, const Batch& b, int64_t rows,
                                 const std::vector<std::vector<float>>* lora) {
  const int64_t H = layer.shape.hidden, I = layer.shape.intermediate, k = layer.shape.top_k, R = kLoraRank;
  const double scale = kLoraAlpha / static_cast<double>(R);
  const uint16_t* x = static_cast<const uint16_t*>(b.x.dl()->data);
  const uint16_t* dy = static_cast<const uint16_t*>(b.dy.dl()->data);
  const int32_t* ids = static_cast<const int32_t*>(b.ids.dl()->data);
  const float* rw = static_cast<const float*>(b.route_weights.dl()->data);
  const uint16_t* gate = layer.gate.u16();
  const uint16_t* up = layer.up.u16();
  const uint16_t* down = layer.down.u16();
  std::vector<double> dx(static_cast<size_t>(rows * H), 0.0), xt(static_cast<size_t>(H)), wdy(static_cast<size_t>(H));
  std::vector<double> g(static_cast<size_t>(I)), u(static_cast<size_t>(I)), dh(static_cast<size_t>(I));
  std::vector<double> ag(static_cast<size_t>(R)), au(static_cast<size_t>(R)), t_r(static_cast<size_t>(R));
  // A [r,in] times v, and B [out,r] times v, of expert e's factor pair p.
  const auto a_times = [&](int p, int64_t e, int64_t in, const double* v, double* out) {
    const float* a = (*lora)[static_cast<size_t>(2 * p)].data() + e * R * in;
    for (int64_t q = 0; q < R; ++q) {
      double acc = 0;
      for (int64_t c = 0; c < in; ++c) acc += static_cast<double>(a[q * in + c]) * v[c];
      out[q] = acc;
    }
  };
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t c = 0; c < H; ++c) xt[static_cast<size_t>(c)] = from_bf16(x[t * H + c]);
    double* dxt = dx.data() + t * H;
    for (int64_t j = 0; j < k; ++j) {
      const int64_t e = ids[t * k + j];
      if (e < 0) continue;
      const double w = rw[t * k + j];
      for (int64_t c = 0; c < H; ++c) wdy[static_cast<size_t>(c)] = w * from_bf16(dy[t * H + c]);
      if (lora) {
        a_times(0, e, H, xt.data(), ag.data());
        a_times(1, e, H, xt.data(), au.data());
      }
      for (int64_t i = 0; i < I; ++i) {
        const uint16_t* gr = gate + (e * I + i) * H;
        const uint16_t* ur = up + (e * I + i) * H;
        double sg = 0, su = 0;
        for (int64_t c = 0; c < H; ++c) {
          sg += from_bf16(gr[c]) * xt[static_cast<size_t>(c)];
          su += from_bf16(ur[c]) * xt[static_cast<size_t>(c)];
        }
        if (lora) {
          const float* bg = (*lora)[1].data() + (e * I + i) * R;
          const float* bu = (*lora)[3].data() + (e * I + i) * R;
          for (int64_t q = 0; q < R; ++q) {
            sg += scale * bg[q] * ag[static_cast<size_t>(q)];
            su += scale * bu[q] * au[static_cast<size_t>(q)];
          }
        }
        g[static_cast<size_t>(i)] = sg;
        u[static_cast<size_t>(i)] = su;
      }
      // dh = down^T (w dy), + s A_d^T (B_d^T (w dy)).
      std::fill(dh.begin(), dh.end(), 0.0);
      for (int64_t c = 0; c < H; ++c) {
        const uint16_t* dr = down + (e * H + c) * I;
        const double v = wdy[static_cast<size_t>(c)];
        for (int64_t i = 0; i < I; ++i) dh[static_cast<size_t>(i)] += from_bf16(dr[i]) * v;
      }
      if (lora) {
        const float* bd = (*lora)[5].data() + e * H * R;
        std::fill(t_r.begin(), t_r.end(), 0.0);
        for (int64_t c = 0; c < H; ++c)
          for (int64_t q = 0; q < R; ++q) t_r[static_cast<size_t>(q)] += bd[c * R + q] * wdy[static_cast<size_t>(c)];
        const float* ad = (*lora)[4].data() + e * R * I;
        for (int64_t q = 0; q < R; ++q)
          for (int64_t i = 0; i < I; ++i) dh[static_cast<size_t>(i)] += scale * ad[q * I + i] * t_r[static_cast<size_t>(q)];
      }
      // dg, du into g, u; dx += gate^T dg + up^T du (+ LoRA).
      for (int64_t i = 0; i < I; ++i) {
        const double gi = g[static_cast<size_t>(i)], sig = 1 / (1 + std::exp(-gi));
        const double d = dh[static_cast<size_t>(i)];
        g[static_cast<size_t>(i)] = d * u[static_cast<size_t>(i)] * sig * (1 + gi * (1 - sig));
        u[static_cast<size_t>(i)] = d * gi * sig;
      }
      for (int64_t i = 0; i < I; ++i) {
        const uint16_t* gr = gate + (e * I + i) * H;
        const uint16_t* ur = up + (e * I + i) * H;
        const double dg = g[static_cast<size_t>(i)], du = u[static_cast<size_t>(i)];
        for (int64_t c = 0; c < H; ++c) dxt[c] += from_bf16(gr[c]) * dg + from_bf16(ur[c]) * du;
      }
      if (lora) {
        for (int p = 0; p < 2; ++p) {
          const double* dv = p == 0 ? g.data() : u.data();
          const float* bm = (*lora)[static_cast<size_t>(2 * p + 1)].data() + e * I * R;
          std::fill(t_r.begin(), t_r.end(), 0.0);
          for (int64_t i = 0; i < I; ++i)
            for (int64_t q = 0; q < R; ++q) t_r[static_cast<size_t>(q)] += bm[i * R + q] * dv[i];
          const float* am = (*lora)[static_cast<size_t>(2 * p)].data() + e * R * H;
          for (int64_t q = 0; q < R; ++q)
            for (int64_t c = 0; c < H; ++c) dxt[c] += scale * am[q * H + c] * t_r[static_cast<size_t>(q)];
        }
      }
    }
  }
  return dx;
}

// Writes what the training peers read beside write_layer_for_peer's files:
// dir/dy_T.bf16 (every batch's dy, in order) and, with `lora`, its factors
// rounded to bf16 as dir/lora_{gate,up,down}_{a,b}.bf16.
bool write_training_data_for_peer(const std::string& dir, const std::vector<Workload>& work,
                                  const std::vector<std::vector<float>>* lora, std::string* error) {
  for (const Workload& w : work) {
    const std::string path = dir + "/dy_" + std::to_string(w.tokens) + ".bf16";
    std::ofstream f(path, std::ios::binary);
    for (const Batch& b : w.batches)
      f.write(static_cast<const char*>(b.dy.dl()->data), static_cast<std::streamsize>(b.dy.numel() * 2));
    if (!f) {
      *error = "cannot write " + path;
      return false;
    }
  }
  if (!lora) return true;
  const char* names[] = {"gate_a", "gate_b", "up_a", "up_b", "down_a", "down_b"};
  for (size_t p = 0; p < 6; ++p) {
    std::vector<uint16_t> bf((*lora)[p].size());
    for (size_t i = 0; i < bf.size(); ++i) bf[i] = to_bf16((*lora)[p][i]);
    const std::string path = dir + "/lora_" + names[p] + ".bf16";
    std::ofstream f(path, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bf.data()), static_cast<std::streamsize>(bf.size() * 2));
    if (!f) {
      *error = "cannot write " + path;
      return false;
    }
  }
  return true;
}

// kt's case c and one kt-kernel call per round (the command `call` with the
// round's batch added), timed in alternation into r's times and ratio. Each
// call starts after the other side's workers have gone to sleep (kPeerGap
// before and after the peer's call): kt-kernel's spin for 20-30 ms after a
// call, kt's for at most 5 ms, and on as many cores as threads a spinning
// pool slows the other's call (up to 3x).
void time_beside_peer(KtRunner& kt, Case c, const Workload& w, const Options& o, PeerProcess* peer, Fields call,
                      PeerRow* r) {
  int batch = 0;
  std::string peer_error;
  const KtRunner::Alternating a = kt.time_alternating(nullptr, c, w, o.warmup, o.reps, &r->error, [&] {
    usleep(kPeerGapUs);
    call["batch"] = std::to_string(batch++);
    const double t = peer->seconds_of(call, &peer_error);
    usleep(kPeerGapUs);
    return t;
  });
  if (a.mine >= 0) {
    r->kt_s = a.mine;
    r->peer_s = a.beside;
    r->ratio = a.beside_ratio;
  }
  if (!peer_error.empty()) r->error = "kt-kernel: " + peer_error;
}

// A peer command naming the layer kt_bench wrote in peer_dir: its shape and
// the most tokens of a call.
Fields peer_layer_command(const char* cmd, const LayerWeights& layer, const std::string& peer_dir,
                          int64_t max_tokens) {
  return {{"cmd", cmd},
          {"dir", peer_dir},
          {"experts", std::to_string(layer.experts)},
          {"top_k", std::to_string(layer.shape.top_k)},
          {"hidden", std::to_string(layer.shape.hidden)},
          {"intermediate", std::to_string(layer.shape.intermediate)},
          {"max_tokens", std::to_string(max_tokens)}};
}

// The relative L2 of what the peer wrote for the first `rows` tokens of
// batch 0 at T (the command `output` with those added; fp32 at path) against
// ref; NaN when it wrote nothing.
double peer_output_error(PeerProcess* peer, Fields output, int64_t T, int64_t rows, const std::string& path,
                         const std::vector<double>& ref) {
  output["T"] = std::to_string(T);
  output["batch"] = "0";
  output["rows"] = std::to_string(rows);
  output["path"] = path;
  Fields out;
  std::string error;
  double err = std::nan("");
  if (peer->ask(output, &out, &error)) {
    std::vector<float> got(ref.size());
    std::ifstream f(path, std::ios::binary);
    f.read(reinterpret_cast<char*>(got.data()), static_cast<std::streamsize>(got.size() * 4));
    if (f) err = rel_l2_to(got.data(), ref);
    std::remove(path.c_str());
  }
  return err;
}

// kt-kernel's forward MoEs beside kt's forward: its bf16 MoE against kt's
// bf16 layer, and its int8 and int4 MoEs (which quantize the bf16 weights
// themselves at load and multiply int8 activations) against kt's
// int8_channel/int8 and int4_g32/int8 layers (KT_COMPUTE_INT8: int8
// activations too), where its build has them. False when the peer's
// process is gone.
bool bench_kt_kernel_forward(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o,
                             kt_engine* engine, KtRunner& bf16, int64_t max_tokens, PeerProcess* peer,
                             const std::string& peer_dir, ModelReport* rep, std::vector<PeerSkip>* skips) {
  const char* name = "kt-kernel";
  struct Variant {
    const char* name;
    kt_weight_format kt_format;
    kt_compute compute;
  };
  const Variant variants[] = {{"bf16", KT_FORMAT_BF16, KT_COMPUTE_BF16},
                              {"int8", KT_FORMAT_INT8_CHANNEL, KT_COMPUTE_INT8},
                              {"int4", KT_FORMAT_INT4_G32, KT_COMPUTE_INT8}};
  std::string error;
  for (const Variant& v : variants) {
    Fields reply;
    if (!o.json) std::fprintf(stderr, "kt_bench: %s: kt-kernel %s: loading\n", layer.shape.name, v.name);
    Fields load = peer_layer_command("moe_load", layer, peer_dir, max_tokens);
    load["variant"] = v.name;
    const bool asked = peer->ask(load, &reply, &error);
    if (!asked || !reply.count("ok")) {
      add_skip(skips, name, std::string("forward ") + v.name, asked ? reply["reason"] : error);
      if (!asked) return false;  // the process is gone
      continue;
    }
    std::unique_ptr<KtRunner> quantized;
    if (v.kt_format != KT_FORMAT_BF16)
      quantized = std::make_unique<KtRunner>(engine, layer, std::max<int64_t>(max_tokens, 16), v.kt_format, nullptr, 0,
                                             v.compute);
    KtRunner& kt = quantized ? *quantized : bf16;
    for (const Workload& w : work) {
      if (!o.json)
        std::fprintf(stderr, "kt_bench: %s: kt-kernel %s forward T=%lld beside kt\n", layer.shape.name, v.name,
                     static_cast<long long>(w.tokens));
      PeerRow r;
      r.peer = name;
      r.variant = v.name;
      r.peer_class = reply["class"];
      r.kt_format = std::string(kt_weight_format_name(v.kt_format)) + (v.compute == KT_COMPUTE_INT8 ? "/int8" : "");
      r.which = Case::kForward;
      r.tokens = w.tokens;
      time_beside_peer(kt, Case::kForward, w, o, peer,
                       {{"cmd", "moe_call"}, {"variant", v.name}, {"T", std::to_string(w.tokens)}}, &r);
      // Both against the double-precision reference, first rows of batch 0.
      r.rows_compared = std::min<int64_t>(w.tokens, o.quick ? 2 : 8);
      const std::vector<double> ref = reference_y(layer, w.batches.front(), r.rows_compared);
      std::vector<float> y, unused;
      if (kt.outputs(Case::kForward, w, &y, &unused, &r.error)) r.kt_rel_l2 = rel_l2_to(y.data(), ref);
      r.peer_rel_l2 = peer_output_error(peer, {{"cmd", "moe_output"}, {"variant", v.name}}, w.tokens,
                                        r.rows_compared, peer_dir + "/y.f32", ref);
      rep->peer_rows.push_back(r);
    }
    peer->ask({{"cmd", "moe_free"}, {"variant", v.name}}, &reply, &error);
  }
  return true;
}

// kt-kernel's bf16 SFT MoE beside kt's training case c (train_lora: LoRA
// r = kLoraRank with KtRunner's factors, alpha kLoraAlpha; train_dx: the
// frozen base, its SkipLoRA class): for each T a forward saving for
// backward and a backward of each per round; then dx of the first batch's
// first rows against the double-precision reference. False when the peer's
// process is gone.
bool bench_kt_kernel_train(Case c, const LayerWeights& layer, const std::vector<Workload>& work, const Options& o,
                           KtRunner& kt, int64_t max_tokens, PeerProcess* peer, const std::string& peer_dir,
                           const std::vector<std::vector<float>>* lora, ModelReport* rep,
                           std::vector<PeerSkip>* skips) {
  const char* name = "kt-kernel";
  const std::string key = case_key(c);
  Fields reply;
  std::string error;
  if (!o.json) std::fprintf(stderr, "kt_bench: %s: kt-kernel %s: loading\n", layer.shape.name, key.c_str());
  Fields load = peer_layer_command("sft_load", layer, peer_dir, max_tokens);
  load["case"] = key;
  if (c == Case::kTrainLora) {
    load["lora_rank"] = std::to_string(kLoraRank);
    char alpha[32];
    std::snprintf(alpha, sizeof alpha, "%g", kLoraAlpha);
    load["lora_alpha"] = alpha;
  }
  const bool asked = peer->ask(load, &reply, &error);
  if (!asked || !reply.count("ok")) {
    add_skip(skips, name, key, asked ? reply["reason"] : error);
    return asked;
  }
  for (const Workload& w : work) {
    if (!o.json)
      std::fprintf(stderr, "kt_bench: %s: kt-kernel %s T=%lld beside kt\n", layer.shape.name, key.c_str(),
                   static_cast<long long>(w.tokens));
    PeerRow r;
    r.peer = name;
    r.variant = "bf16";
    r.peer_class = reply["class"];
    r.kt_format = kt_weight_format_name(KT_FORMAT_BF16);
    r.which = c;
    r.tokens = w.tokens;
    if (c == Case::kTrainLora)
      r.note = "same LoRA factors as kt's (fp32 in kt, rounded to bf16 for kt-kernel, which keeps them in bf16); "
               "both compute dx and the six LoRA gradients";
    else
      r.note = "frozen base: dx (and the routing-weight gradient) only";
    time_beside_peer(kt, c, w, o, peer, {{"cmd", "sft_call"}, {"case", key}, {"T", std::to_string(w.tokens)}}, &r);
    // dx of both against the double-precision reference, first rows of batch 0.
    r.rows_compared = std::min<int64_t>(w.tokens, o.quick ? 2 : 8);
    const std::vector<double> ref = reference_dx(layer, w.batches.front(), r.rows_compared, lora);
    std::vector<float> y, dx;
    if (kt.outputs(c, w, &y, &dx, &r.error)) r.kt_rel_l2 = rel_l2_to(dx.data(), ref);
    r.peer_rel_l2 = peer_output_error(peer, {{"cmd", "sft_output"}, {"case", key}}, w.tokens, r.rows_compared,
                                      peer_dir + "/dx.f32", ref);
    rep->peer_rows.push_back(r);
  }
  peer->ask({{"cmd", "sft_free"}, {"case", key}}, &reply, &error);
  return true;
}

// kt-kernel beside kt on the same layer, routing and inputs, on the cases of
// --cases it has: the forward (bench_kt_kernel_forward) and, where its build
// has the bf16 SFT classes, train_lora and train_dx (bench_kt_kernel_train);
// a skip with the reason for each case it does not run.
void bench_kt_kernel(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o,
                     kt_engine* engine, KtRunner& bf16, int64_t max_tokens, PeerProcess* peer,
                     const std::string& peer_dir, ModelReport* rep, std::vector<PeerSkip>* skips) {
  const char* name = "kt-kernel";
  const auto asked = [&](Case c) { return std::find(o.cases.begin(), o.cases.end(), c) != o.cases.end(); };
  if (!asked(Case::kForward)) add_skip(skips, name, "forward", "not in --cases");
  const bool sft = !peer->said("kt_kernel_sft").empty();
  std::vector<Case> train;
  for (Case c : {Case::kTrainDx, Case::kTrainLora}) {
    if (!asked(c)) continue;
    if (sft) {
      train.push_back(c);
      continue;
    }
    const std::string reason = peer->said(std::string("kt_kernel_") + case_key(c) + "_reason");
    add_skip(skips, name, case_key(c), reason.empty() ? "not run by kt_bench" : reason);
  }
  if (asked(Case::kTrainFull))
    add_skip(skips, name, "train_full", "kt-kernel trains LoRA factors only (no full-weight gradients)");
  if (!asked(Case::kForward) && train.empty()) return;
  std::vector<std::vector<float>> lora;
  if (std::find(train.begin(), train.end(), Case::kTrainLora) != train.end()) lora = lora_factors(layer);
  std::string error;
  if (!write_layer_for_peer(peer_dir, layer, work, &error) ||
      (!train.empty() && !write_training_data_for_peer(peer_dir, work, lora.empty() ? nullptr : &lora, &error))) {
    if (asked(Case::kForward)) add_skip(skips, name, "forward", error);
    for (Case c : train) add_skip(skips, name, case_key(c), error);
    return;
  }
  if (asked(Case::kForward) &&
      !bench_kt_kernel_forward(layer, work, o, engine, bf16, max_tokens, peer, peer_dir, rep, skips))
    return;
  for (Case c : train)
    if (!bench_kt_kernel_train(c, layer, work, o, bf16, max_tokens, peer, peer_dir,
                               c == Case::kTrainLora ? &lora : nullptr, rep, skips))
      return;
}

ModelReport bench_model(const ModelShape& shape, const Options& o, kt_engine* engine, int threads,
                        const Limits& lim, const std::string& torch_reason, PeerProcess* peer,
                        const std::string& peer_dir, std::vector<PeerSkip>* skips) {
  ModelReport rep;
  rep.shape = shape;
  const double expert_bytes = 3.0 * shape.hidden * shape.intermediate * 2;
  const int64_t fits = static_cast<int64_t>(o.max_weight_gb * 1e9 / expert_bytes);
  rep.experts_held = std::min(shape.experts, std::max<int64_t>(shape.top_k, fits));
  if (o.quick) rep.experts_held = std::min<int64_t>(rep.experts_held, 16);
  rep.weight_bytes = expert_bytes * static_cast<double>(rep.experts_held);
  if (!o.json)
    std::fprintf(stderr, "kt_bench: %s: generating %.2f GB of bf16 weights\n", shape.name, rep.weight_bytes / 1e9);
  const LayerWeights layer = make_layer_weights(shape, rep.experts_held, 42);

  std::vector<Workload> work;
  for (size_t i = 0; i < o.tokens.size(); ++i) work.push_back(make_workload(layer, o.tokens[i], 1000 + i));
  for (Case c : o.cases) {
    for (const Workload& w : work) {
      Row r;
      r.which = c;
      r.tokens = w.tokens;
      r.routes = w.mean_routes();
      r.touched = w.mean_touched();
      r.flops = case_flops(c, shape, r.routes);
      r.bytes = case_bytes(c, layer, r.touched);
      rep.rows.push_back(r);
    }
  }
  auto row_of = [&](Case c, int64_t T) -> Row& {
    return *std::find_if(rep.rows.begin(), rep.rows.end(), [&](const Row& r) { return r.which == c && r.tokens == T; });
  };
  const int64_t max_tokens = *std::max_element(o.tokens.begin(), o.tokens.end());

  // kt's results on each workload's first batch, to check the oneDNN baseline against.
  std::map<std::pair<Case, int64_t>, std::vector<float>> kt_results;
  const bool compare_onednn = KT_BENCH_HAVE_ONEDNN && o.onednn;
  // A plain read of a case's bytes, timed beside kt's calls, call by call:
  // the DRAM bandwidth at that moment, for %rd. The buffer holds the
  // largest read of a memory-bound case, and is at least 1 GiB and four
  // times the last-level cache, so that every read comes from DRAM.
  size_t read_buffer =
      std::max(o.quick ? size_t{256} << 20 : size_t{1} << 30, 4 * lim.machine.l3_bytes);
  for (const Row& r : rep.rows)
    if (memory_bound(r.flops, r.bytes, lim))
      read_buffer = std::max(read_buffer, static_cast<size_t>(r.bytes));
  StreamReader reader(threads, read_buffer, __builtin_cpu_supports("avx2"));
  // kt: one layer per mode, released before the baselines allocate theirs.
  {
    KtRunner kt(engine, layer, std::max<int64_t>(max_tokens, 16));
    KtRunner& bf16 = kt;
    for (Case c : o.cases) {
      for (const Workload& w : work) {
        if (!o.json)
          std::fprintf(stderr, "kt_bench: %s: kt %s T=%lld\n", shape.name, case_label(c), static_cast<long long>(w.tokens));
        Row& r = row_of(c, w.tokens);
        std::string error;
        const double s = kt.time_case(c, w, o.warmup, o.reps, &error);
        if (s >= 0) r.kt_s = s;
        else r.kt_error = error;
        if (s >= 0 && memory_bound(r.flops, r.bytes, lim)) {
          // The same calls again, each followed by the read: kt's time in
          // those rounds against the read's.
          const KtRunner::Alternating a = kt.time_alternating(
              nullptr, c, w, o.warmup, o.reps, &error,
              [&] { return reader.read_seconds(static_cast<size_t>(r.bytes)); });
          if (a.mine >= 0) {
            r.kt_beside_read_s = a.mine;
            r.read_s = a.beside;
          }
        }
        if (s >= 0) profile(kt, c, w, o, &r.kt_profile, &error);
        if (compare_onednn && (c == Case::kForward || c == Case::kTrainDx)) {
          std::vector<float> y, dx;
          if (kt.outputs(c, w, &y, &dx, &error)) kt_results[{c, w.tokens}] = c == Case::kForward ? y : dx;
        }
      }
    }
    // Cost against touched experts at a fixed small T (the weight-streaming regime).
    if (std::find(o.cases.begin(), o.cases.end(), Case::kForward) != o.cases.end()) {
      const int64_t sweep_tokens = o.quick ? 4 : 16;
      for (int64_t n = shape.top_k; n <= rep.experts_held; n *= 2) {
        const Workload w = make_touched_workload(layer, sweep_tokens, n, 7 + static_cast<uint64_t>(n));
        TouchedRow t;
        t.touched = n;
        t.tokens = sweep_tokens;
        t.bytes = case_bytes(Case::kForward, layer, w.mean_touched());
        std::string error;
        const double s = kt.time_case(Case::kForward, w, o.warmup, o.reps, &error);
        if (s >= 0) t.kt_s = s;
        rep.sweep.push_back(t);
      }
    }
    // The same workloads with the base stored in each other format, one layer
    // at a time, each timed in alternation with the bf16 layer: the machine's
    // bandwidth and load drift over a run (seen here: 37-47 GB/s between runs
    // minutes apart), and a ratio of times taken minutes apart carried it.
    const double weights_per_expert = 3.0 * shape.hidden * shape.intermediate;
    for (const FormatChoice& choice : o.formats) {
      const kt_weight_format f = choice.format;
      const bool int8 = choice.compute == KT_COMPUTE_INT8;
      // fp8, MXFP4 and asymmetric int4 bases come from checkpoints: these weights quantized
      // into one, loaded as a host loads it.
      std::unique_ptr<QuantCheckpoint> source;
      std::string source_error;
      if (comes_from_checkpoint(f)) {
        if (!o.json)
          std::fprintf(stderr, "kt_bench: %s: writing the weights as a %s checkpoint\n", shape.name,
                       kt_weight_format_name(f));
        source = QuantCheckpoint::write(layer, f, threads, &source_error);
        if (source) {
          rep.checkpoints.push_back({f, source->file_bytes(), source->write_seconds()});
          if (!o.json)
            std::fprintf(stderr, "kt_bench: %s: %.2f GB written in %.1f s\n", shape.name, source->file_bytes() / 1e9,
                         source->write_seconds());
        }
      }
      KtRunner fmt_kt(engine, layer, std::max<int64_t>(max_tokens, 16), f,
                      source ? source->ckpt() : nullptr, QuantCheckpoint::kLayer, choice.compute);
      for (Case c : o.cases) {
        // A quantized base is frozen: full-weight training is bf16 only;
        // int8 activations have no backward.
        if (c == Case::kTrainFull || (int8 && c != Case::kForward)) continue;
        for (const Workload& w : work) {
          if (!o.json)
            std::fprintf(stderr, "kt_bench: %s: kt %s %s T=%lld\n", shape.name,
                         choice.label().c_str(), case_label(c), static_cast<long long>(w.tokens));
          FormatRow fr;
          fr.choice = choice;
          fr.which = c;
          fr.tokens = w.tokens;
          const Row& base = row_of(c, w.tokens);
          KtRunner::Alternating s;
          if (source_error.empty()) {
            s = fmt_kt.time_alternating(&bf16, c, w, o.warmup, o.reps, &fr.error, [&] {
              // The layer is made before the first round: its bytes are known.
              const double bytes =
                  base.bytes * fmt_kt.expert_weight_bytes() / layer.bytes_per_expert();
              return reader.read_seconds(static_cast<size_t>(bytes));
            });
          } else {
            fr.error = source_error;
          }
          if (s.mine >= 0) {
            fr.kt_s = s.mine;
            fr.bf16_s = s.other;
            fr.paired = s.ratio;
            fr.read_s = s.beside;
            fr.kt_best_s = s.mine_best;
            fr.read_best_s = s.beside_best;
            profile(fmt_kt, c, w, o, &fr.kt_profile, &fr.error);
          }
          // case_bytes counts bf16 weights: the same reads in this format's bytes.
          fr.bytes_per_weight = fmt_kt.expert_weight_bytes() / weights_per_expert;
          fr.bytes = base.bytes * fmt_kt.expert_weight_bytes() / layer.bytes_per_expert();
          rep.formats.push_back(fr);
        }
        if (c == Case::kForward && source_error.empty()) {
          std::string error;
          FormatError fe{choice, fmt_kt.weight_rel_l2(&error)};
          if (int8 && !work.empty() && error.empty()) {
            // The same base with bf16 activations on the largest batch: what
            // int8 activations change in y.
            KtRunner same_base(engine, layer, std::max<int64_t>(max_tokens, 16), f,
                               source ? source->ckpt() : nullptr, QuantCheckpoint::kLayer);
            std::vector<float> y_int8, y_bf16, unused;
            if (fmt_kt.outputs(c, work.back(), &y_int8, &unused, &error) &&
                same_base.outputs(c, work.back(), &y_bf16, &unused, &error)) {
              fe.activation_rel_l2 = rel_l2(y_int8, y_bf16);
              fe.activation_tokens = work.back().tokens;
            }
          }
          rep.format_errors.push_back(fe);
          if (!error.empty() && !o.json) std::fprintf(stderr, "kt_bench: %s\n", error.c_str());
        }
      }
      for (const auto& l : fmt_kt.loads())
        rep.loads.emplace_back(choice.label() + " " + l.first, l.second);
    }
    rep.loads.insert(rep.loads.begin(), bf16.loads().begin(), bf16.loads().end());
    if (peer && peer->ok() && !peer->said("kt_kernel").empty())
      bench_kt_kernel(layer, work, o, engine, bf16, std::max<int64_t>(max_tokens, 16), peer, peer_dir, &rep, skips);
  }
  for (Case c : o.cases) rep.fits[c] = fit_cost(rep.rows, c);

#if KT_BENCH_HAVE_ONEDNN
  if (o.onednn) {
    OneDnnBaseline dnnl(layer, threads);
    for (Case c : o.cases) {
      if (!OneDnnBaseline::supports(c)) continue;
      for (const Workload& w : work) {
        if (!o.json)
          std::fprintf(stderr, "kt_bench: %s: oneDNN %s T=%lld\n", shape.name, case_label(c), static_cast<long long>(w.tokens));
        Row& r = row_of(c, w.tokens);
        std::string error;
        const double s = dnnl.time_case(c, w, o.warmup, o.reps, &error);
        if (s >= 0) r.onednn_s = s;
        else r.onednn_error = error;
        const auto kt_result = kt_results.find({c, w.tokens});
        if (s >= 0 && kt_result != kt_results.end()) {
          std::vector<float> y, dx;
          if (dnnl.outputs(c, w, &y, &dx, &error))
            r.onednn_rel_l2 = rel_l2(c == Case::kForward ? y : dx, kt_result->second);
        }
      }
    }
  } else {
    rep.onednn_reason = "skipped (--no-onednn)";
  }
#else
  rep.onednn_reason = "not built: oneDNN (find_package(dnnl)) was not found at configure time";
#endif

  if (!o.torch) {
    rep.torch.reason = "skipped (--no-torch)";
  } else if (!torch_reason.empty()) {
    rep.torch.reason = torch_reason;
  } else {
    if (!o.json) std::fprintf(stderr, "kt_bench: %s: torch eager baseline\n", shape.name);
    rep.torch = run_torch_baseline(o.python, o.torch_script, layer, work, o.cases, threads, o.warmup, o.reps);
    for (Row& r : rep.rows) {
      const auto key = std::make_pair(std::string(case_key(r.which)), r.tokens);
      if (rep.torch.seconds.count(key)) r.torch_s = rep.torch.seconds[key];
      if (rep.torch.errors.count(key)) r.torch_error = rep.torch.errors[key];
    }
  }
  // torch 2 from the peers' interpreter, where it is not the torch above:
  // the same script, routing and threads.
  const std::string peer_torch = peer && peer->ok() ? peer->said("torch") : "";
  if (o.torch && !peer_torch.empty() && peer_torch != rep.torch.version) {
    if (!o.json) std::fprintf(stderr, "kt_bench: %s: torch %s eager (peers' interpreter)\n", shape.name, peer_torch.c_str());
    rep.torch2 = run_torch_baseline(o.peers_python, o.torch_script, layer, work, o.cases, threads, o.warmup, o.reps);
  }
  return rep;
}

// Removes `dir` and the files in it (the peers' data: weights, batches,
// outputs, their log).
void remove_directory(const std::string& dir) {
  if (DIR* d = opendir(dir.c_str())) {
    while (const dirent* e = readdir(d)) {
      const std::string name = e->d_name;
      if (name != "." && name != "..") std::remove((dir + "/" + name).c_str());
    }
    closedir(d);
  }
  rmdir(dir.c_str());
}

// ------------------------------------------------------------------ report

// A peer that ran, by name ("kt-kernel", "deepspeed", "torch"), its version
// and the interpreter it ran in.
struct PeerEntry {
  std::string name, version, python, role, detail;
};

// Which peers ran, and adds a skip for each one that did not (with why).
std::vector<PeerEntry> summarize_peers(const Options& o, PeerProcess* peer, const std::vector<ModelReport>& models,
                                       const OptimizerReport* optimizer, std::vector<PeerSkip>* skips) {
  std::vector<PeerEntry> ran;
  const bool started = peer && peer->ok();
  const std::string no_peer = !o.peers ? "--no-peers" : !started ? peer->reason() : "";
  // kt-kernel
  if (!started || peer->said("kt_kernel").empty()) {
    add_skip(skips, "kt-kernel", "all", started ? peer->said("kt_kernel_reason") : no_peer);
  } else {
    bool any = false;
    for (const ModelReport& m : models)
      for (const PeerRow& r : m.peer_rows) any = any || std::isfinite(r.peer_s);
    if (any) {
      ran.push_back({"kt-kernel", peer->said("kt_kernel"), o.peers_python, "peer",
                     peer->said("kt_kernel_variant") + " build, int8 kernel: " + peer->said("kt_kernel_int8")});
    } else if (models.empty()) {
      add_skip(skips, "kt-kernel", "all", "no MoE case in --cases");
    } else {
      std::string why;
      for (const ModelReport& m : models)
        for (const PeerRow& r : m.peer_rows)
          if (why.empty() && !r.error.empty()) why = r.error;
      add_skip(skips, "kt-kernel", "all", why.empty() ? "it did not run (see the other kt-kernel lines)" : why);
    }
  }
  // deepspeed
  if (!optimizer) {
    add_skip(skips, "deepspeed", "all", "the optimizer case is not in --cases");
  } else if (!optimizer->deepspeed_reason.empty() || optimizer->deepspeed_version.empty()) {
    add_skip(skips, "deepspeed", "all",
             optimizer->deepspeed_reason.empty() ? "not run" : optimizer->deepspeed_reason);
  } else {
    ran.push_back({"deepspeed", optimizer->deepspeed_version, o.peers_python, "peer",
                   "DeepSpeedCPUAdam, op built with " + optimizer->deepspeed_flags});
  }
  // torch: --python's, and the peers' interpreter's where it differs
  std::string torch_version, torch_reason = !o.torch ? "--no-torch" : "";
  for (const ModelReport& m : models) {
    if (m.torch.ran) torch_version = m.torch.version;
    else if (torch_reason.empty()) torch_reason = m.torch.reason;
  }
  if (optimizer && !optimizer->torch_version.empty()) torch_version = optimizer->torch_version;
  if (!torch_version.empty()) ran.push_back({"torch", torch_version, o.python, "baseline", "eager"});
  else add_skip(skips, "torch", "--python " + o.python, torch_reason.empty() ? "not run" : torch_reason);
  std::string torch2;
  for (const ModelReport& m : models)
    if (m.torch2.ran) torch2 = m.torch2.version;
  if (!torch2.empty()) {
    ran.push_back({"torch", torch2, o.peers_python, "peer", "eager"});
  } else if (o.torch) {
    const std::string said = started ? peer->said("torch") : "";
    if (said.empty())
      add_skip(skips, "torch", "--peers-python " + o.peers_python,
               started ? peer->said("torch_reason") : no_peer);
    else if (said != torch_version && !models.empty())
      add_skip(skips, "torch", "--peers-python " + o.peers_python, "torch " + said + " did not run");
  }
  return ran;
}

std::string skip_line(const std::vector<PeerSkip>& skips) {
  if (skips.empty()) return "peers skipped: none";
  std::string line = "peers skipped:";
  for (size_t i = 0; i < skips.size(); ++i)
    line += std::string(i ? ";" : "") + " " + skips[i].peer + (skips[i].what == "all" ? "" : " " + skips[i].what) +
            " (" + skips[i].reason + ")";
  return line;
}

struct Rates {
  double gflops, pct_peak, gbs, pct_bw, pct_roofline;
  bool compute_bound;
};

Rates rates_of(double flops, double bytes, double seconds, const Limits& lim) {
  Rates r{};
  r.gflops = flops / seconds / 1e9;
  r.gbs = bytes / seconds / 1e9;
  r.pct_peak = lim.peak_gflops > 0 ? 100 * r.gflops / lim.peak_gflops : NAN;
  r.pct_bw = lim.machine.dram_read_gbs > 0 ? 100 * r.gbs / lim.machine.dram_read_gbs : NAN;
  const Floors f = floors_of(flops, bytes, lim);
  r.compute_bound = f.compute >= f.memory;
  r.pct_roofline = 100 * std::max(f.compute, f.memory) / seconds;
  return r;
}

std::string slice_note(const ModelReport& m) {
  if (m.experts_held == m.shape.experts) return "all experts held";
  char buffer[200];
  std::snprintf(buffer, sizeof(buffer),
                "a slice: %lld of %lld experts held, routes to the others dropped (a full layer costs ~%.1fx)",
                static_cast<long long>(m.experts_held), static_cast<long long>(m.shape.experts),
                static_cast<double>(m.shape.experts) / static_cast<double>(m.experts_held));
  return buffer;
}

std::string fmt(const char* format, double v) {
  if (!std::isfinite(v)) return "-";
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), format, v);
  return buffer;
}

// Seconds the memory traffic of `bytes_per_param` per parameter takes at the
// measured DRAM read bandwidth (writes counted as reads: a lower bound).
double memory_floor_s(int64_t params, double bytes_per_param, const Limits& lim) {
  return lim.machine.dram_read_gbs > 0 ? static_cast<double>(params) * bytes_per_param / (lim.machine.dram_read_gbs * 1e9)
                                       : NAN;
}

double positive_or_nan(double seconds) { return seconds > 0 ? seconds : NAN; }

void print_optimizer(const OptimizerReport& rep, const Limits& lim) {
  const ModelShape& s = rep.shape;
  std::printf("\n== optimizer: AdamW over fp32 masters of %s experts (H=%lld I=%lld); torch: %s\n", s.name,
              static_cast<long long>(s.hidden), static_cast<long long>(s.intermediate),
              rep.torch_version.empty() ? rep.torch_reason.c_str()
                                        : ("torch " + rep.torch_version + ", " + std::to_string(rep.torch_threads) +
                                           " threads" + (rep.torch_reason.empty() ? "" : "; " + rep.torch_reason)).c_str());
  std::printf("%4s %8s %9s %8s %7s %9s %10s %6s %10s %6s %9s %7s %9s\n", "exp", "Mparams", "kt ms", "Gparam/s", "%floor",
              "floor ms", "loop ms", "xloop", "foreach ms", "xfore", "layer ms", "xplain", "repack ms");
  for (const OptimizerRow& r : rep.rows) {
    const double kt = positive_or_nan(r.kt_plain_s), layer = positive_or_nan(r.kt_layer_s);
    const double floor = memory_floor_s(r.params, kAdamwBytesPerParam, lim);
    const double loop = positive_or_nan(r.torch_forloop_s), fore = positive_or_nan(r.torch_foreach_s);
    std::printf("%4lld %8.1f %9s %8s %7s %9s %10s %6s %10s %6s %9s %7s %9s\n", static_cast<long long>(r.experts),
                static_cast<double>(r.params) / 1e6, fmt("%.2f", kt * 1e3).c_str(),
                fmt("%.2f", static_cast<double>(r.params) / kt / 1e9).c_str(), fmt("%.1f", 100 * floor / kt).c_str(),
                fmt("%.2f", floor * 1e3).c_str(), fmt("%.2f", loop * 1e3).c_str(), fmt("%.2f", loop / kt).c_str(),
                fmt("%.2f", fore * 1e3).c_str(), fmt("%.2f", fore / kt).c_str(), fmt("%.2f", layer * 1e3).c_str(),
                fmt("%.2f", layer / kt).c_str(), fmt("%.2f", positive_or_nan(r.repack_s) * 1e3).c_str());
  }
  if (std::any_of(rep.rows.begin(), rep.rows.end(), [](const OptimizerRow& r) { return r.deepspeed_s > 0; })) {
    std::printf("   DeepSpeed %s DeepSpeedCPUAdam (op built with %s) on the same tensors, a step of each per round\n"
                "   beside kt's (taking turns); x = DeepSpeed / kt (medians; pair: median of each round's ratio);\n"
                "   floor: a stream with the step's traffic (reads p, g, m, v; writes p, m, v) in the same rounds;\n"
                "   af: kt's step with assume_finite (the host checked the gradients: one pass over them):\n",
                rep.deepspeed_version.c_str(), rep.deepspeed_flags.c_str());
    std::printf("   %4s %8s %9s %9s %8s %7s %9s %8s %7s %6s %6s %9s %8s %6s %6s\n", "exp", "Mparams", "floor ms",
                "kt ms", "Gparam/s", "%floor", "DS ms", "Gparam/s", "%floor", "x", "pair", "kt af ms", "%floor",
                "x af", "pair");
    for (const OptimizerRow& r : rep.rows) {
      const double kt = positive_or_nan(r.kt_beside_deepspeed_s), ds = positive_or_nan(r.deepspeed_s);
      const double floor = positive_or_nan(r.floor_beside_s);
      const double af = positive_or_nan(r.kt_assume_finite_beside_s);
      const double p = static_cast<double>(r.params);
      std::printf("   %4lld %8.1f %9s %9s %8s %7s %9s %8s %7s %6s %6s %9s %8s %6s %6s\n",
                  static_cast<long long>(r.experts), p / 1e6, fmt("%.2f", floor * 1e3).c_str(),
                  fmt("%.2f", kt * 1e3).c_str(), fmt("%.3f", p / kt / 1e9).c_str(),
                  fmt("%.1f", 100 * floor / kt).c_str(), fmt("%.2f", ds * 1e3).c_str(),
                  fmt("%.3f", p / ds / 1e9).c_str(), fmt("%.1f", 100 * floor / ds).c_str(),
                  fmt("%.2f", ds / kt).c_str(), fmt("%.2f", positive_or_nan(r.deepspeed_ratio)).c_str(),
                  fmt("%.2f", af * 1e3).c_str(), fmt("%.1f", 100 * floor / af).c_str(), fmt("%.2f", ds / af).c_str(),
                  fmt("%.2f", positive_or_nan(r.deepspeed_ratio_assume_finite)).c_str());
    }
  } else {
    std::printf("   DeepSpeed: %s\n", rep.deepspeed_reason.empty() ? "not run" : rep.deepspeed_reason.c_str());
  }
  std::printf("   full fine-tune step of those experts at T=%lld (routes to other experts dropped):\n",
              static_cast<long long>(rep.tokens));
  for (const OptimizerRow& r : rep.rows) {
    const double fb = positive_or_nan(r.fwd_bwd_s), layer = positive_or_nan(r.kt_layer_s);
    const double torch_path = positive_or_nan(r.torch_forloop_s) + positive_or_nan(r.repack_s);
    std::printf("   %lld experts: fwd+bwd %s ms; kt step %s ms (%s%% of the step); torch AdamW + repack %s ms (%s%%)\n",
                static_cast<long long>(r.experts), fmt("%.1f", fb * 1e3).c_str(), fmt("%.1f", layer * 1e3).c_str(),
                fmt("%.1f", 100 * layer / (fb + layer)).c_str(), fmt("%.1f", torch_path * 1e3).c_str(),
                fmt("%.1f", 100 * torch_path / (fb + torch_path)).c_str());
    if (!r.error.empty()) std::printf("   %lld experts: %s\n", static_cast<long long>(r.experts), r.error.c_str());
  }
  std::printf("   kt ms: kt_optimizer_step over fp32 tensors; floor: %.0f B/param (read p, g, m, v; write p, m, v) at the\n"
              "   DRAM read bandwidth; loop/foreach: torch.optim.AdamW(foreach=False/True), x = torch / kt; layer: the\n"
              "   full-mode layer's step (bf16 params, fp32 masters, bf16 copy and panels written, %.0f B/param),\n"
              "   xplain = layer / kt; repack: kt_moe_params_changed, what a step outside kt needs after it.\n",
              kAdamwBytesPerParam, kLayerStepBytesPerParam);
}

// kt-kernel beside kt, and torch from the peers' interpreter, per row.
void print_peer_rows(const ModelReport& mr) {
  if (mr.peer_rows.empty() && !mr.torch2.ran) return;
  std::printf("peers on the same layer, routing and inputs (x = peer time / kt time: above 1, kt is faster):\n");
  if (!mr.peer_rows.empty()) {
    std::printf(
        "   kt-kernel, a call of each per round beside kt's (taking turns; same batches); x: medians, pair:\n"
        "   the median of each round's ratio; err: the relative L2 of y (forward) or dx (training) from the\n"
        "   double-precision reference (first rows of the first batch, from the bf16 weights):\n");
    std::printf("   %-10s %-5s %-17s %6s %9s %12s %6s %6s %9s %9s\n", "case", "kt-k", "kt layer", "T", "kt ms",
                "kt-kernel ms", "x", "pair", "err kt", "err kt-k");
    const std::string* last_note = nullptr;
    for (const PeerRow& r : mr.peer_rows) {
      std::printf("   %-10s %-5s %-17s %6lld %9s %12s %6s %6s %9s %9s\n", case_key(r.which), r.variant.c_str(),
                  r.kt_format.c_str(), static_cast<long long>(r.tokens), fmt("%.3f", r.kt_s * 1e3).c_str(),
                  fmt("%.3f", r.peer_s * 1e3).c_str(), fmt("%.2f", r.peer_s / r.kt_s).c_str(),
                  fmt("%.2f", r.ratio).c_str(), fmt("%.1e", r.kt_rel_l2).c_str(), fmt("%.1e", r.peer_rel_l2).c_str());
      if (!r.note.empty() && (!last_note || *last_note != r.note)) std::printf("      %s\n", r.note.c_str());
      last_note = &r.note;
      if (!r.error.empty()) std::printf("      %s\n", r.error.c_str());
    }
  }
  if (mr.torch2.ran) {
    std::printf("   torch %s eager (peers' interpreter, %d threads), run after kt, against kt's time above:\n",
                mr.torch2.version.c_str(), mr.torch2.threads);
    for (const Row& r : mr.rows) {
      const auto key = std::make_pair(std::string(case_key(r.which)), r.tokens);
      const auto t = mr.torch2.seconds.find(key);
      const double sec = t == mr.torch2.seconds.end() ? NAN : t->second;
      std::printf("   %-19s %6lld %9s ms  x%s\n", case_label(r.which), static_cast<long long>(r.tokens),
                  fmt("%.3f", sec * 1e3).c_str(), fmt("%.2f", sec / r.kt_s).c_str());
    }
  }
}

void print_table(const Options& o, const Limits& lim, const kt_engine_info& info, const std::vector<ModelReport>& models,
                 const OptimizerReport* optimizer, const std::vector<PeerEntry>& peers,
                 const std::vector<PeerSkip>& skips) {
  const MachineLimits& m = lim.machine;
  std::printf("kt %s (abi %d), kernels %s (%s), %d threads\n", kt_version(), kt_abi_version(), kt_isa_name(info.isa),
              info.kernel_name ? info.kernel_name : "?", info.num_threads);
  std::printf(
      "call overhead: %s (T=1 on a minimal layer: E=%lld k=%lld H=I=%lld)\n",
      lim.call_error.empty() ? (fmt("%.1f", lim.call_us) + " us per forward back to back, " +
                                fmt("%.1f", lim.call_paused_us) + " us after " +
                                fmt("%.0f", kCallPause * 1e3) + " ms pauses")
                                   .c_str()
                             : ("failed: " + lim.call_error).c_str(),
      static_cast<long long>(kMinimalLayer.experts), static_cast<long long>(kMinimalLayer.top_k),
      static_cast<long long>(kMinimalLayer.hidden));
  std::printf("machine, %d threads: AMX-BF16 %s, bf16 dot %s GFLOP/s, fp32 FMA avx512 %s / avx2 %s GFLOP/s, DRAM read %s GB/s (%.0f MiB buffer)\n",
              m.threads, m.has_amx_bf16 ? (fmt("%.0f", m.amx_bf16_gflops) + " GFLOP/s").c_str() : "none",
              fmt("%.0f", m.has_avx512bf16 ? m.bf16_dot_gflops : NAN).c_str(),
              fmt("%.0f", m.has_avx512f ? m.fp32_fma_avx512_gflops : NAN).c_str(),
              fmt("%.0f", m.has_avx2_fma ? m.fp32_fma_avx2_gflops : NAN).c_str(), fmt("%.1f", m.dram_read_gbs).c_str(),
              static_cast<double>(m.dram_buffer_bytes) / (1 << 20));
  // What int8 or int16 activations could gain: kt keeps bf16 activations
  // (their error bound), so these are the machine's, not kt's.
  const auto ratio_to_bf16 = [&](double gops) {
    return m.has_avx512bf16 && m.bf16_dot_gflops > 0
               ? fmt(" (%.2fx bf16 dot)", gops / m.bf16_dot_gflops)
               : std::string();
  };
  std::printf(
      "integer dot, %d threads: int8 vpdpbusd %s, int16 vpdpwssd %s, AMX-INT8 %s\n", m.threads,
      m.has_avx512vnni
          ? (fmt("%.0f GOP/s", m.int8_dot_gops) + ratio_to_bf16(m.int8_dot_gops)).c_str()
          : "none",
      m.has_avx512vnni
          ? (fmt("%.0f GOP/s", m.int16_dot_gops) + ratio_to_bf16(m.int16_dot_gops)).c_str()
          : "none",
      m.has_amx_int8 ? (fmt("%.0f GOP/s", m.amx_int8_gops) + ratio_to_bf16(m.amx_int8_gops)).c_str()
                     : "none");
  std::printf("peak used for %%peak: %s = %.0f GFLOP/s; medians of %d reps after %d warm-up%s\n", lim.peak_kind.c_str(),
              lim.peak_gflops, o.reps, o.warmup, o.quick ? " (quick: smoke only, not a measurement)" : "");
  std::string ran;
  for (const PeerEntry& p : peers)
    ran += (ran.empty() ? "" : "; ") + p.name + " " + p.version + " (" + p.role + ", " + p.python +
           (p.detail.empty() ? "" : ", " + p.detail) + ")";
  std::printf("peers: %s\n%s\n", ran.empty() ? "none ran" : ran.c_str(), skip_line(skips).c_str());
  for (const ModelReport& mr : models) {
    const ModelShape& s = mr.shape;
    std::printf("\n== %s: H=%lld I=%lld E=%lld k=%lld, bf16, %s, %.2f GB\n", s.name, static_cast<long long>(s.hidden),
                static_cast<long long>(s.intermediate), static_cast<long long>(s.experts), static_cast<long long>(s.top_k),
                slice_note(mr).c_str(), mr.weight_bytes / 1e9);
    std::printf("   oneDNN: %s   torch: %s\n",
                mr.onednn_reason.empty() ? ("oneDNN " + onednn_version()).c_str() : mr.onednn_reason.c_str(),
                mr.torch.ran ? ("torch " + mr.torch.version + ", " + std::to_string(mr.torch.threads) + " threads" +
                                (mr.torch.reason.empty() ? "" : "; " + mr.torch.reason)).c_str()
                             : mr.torch.reason.c_str());
    std::printf("%-19s %5s %6s %5s %9s %8s %7s %7s %5s %10s %7s %10s %7s\n", "case", "T", "routes",
                "exp", "kt ms", "GFLOP/s", "%peak", "%bw", "%rd", "oneDNN ms", "xoneDNN",
                "torch ms", "xtorch");
    for (const Row& r : mr.rows) {
      std::string kt_ms = fmt("%.3f", r.kt_s * 1e3), gf = "-", pp = "-", pb = "-";
      if (std::isfinite(r.kt_s)) {
        const Rates x = rates_of(r.flops, r.bytes, r.kt_s, lim);
        gf = fmt("%.1f", x.gflops);
        pp = fmt("%.1f", x.pct_peak) + (x.compute_bound ? "*" : " ");
        pb = fmt("%.1f", x.pct_bw) + (x.compute_bound ? " " : "*");
      } else if (!r.kt_error.empty()) {
        kt_ms = "error";
      }
      std::printf("%-19s %5lld %6.0f %5.0f %9s %8s %7s %7s %5s %10s %7s %10s %7s\n",
                  case_label(r.which), static_cast<long long>(r.tokens), r.routes, r.touched,
                  kt_ms.c_str(), gf.c_str(), pp.c_str(), pb.c_str(),
                  fmt("%.0f", 100 * r.read_s / r.kt_beside_read_s).c_str(),
                  fmt("%.3f", r.onednn_s * 1e3).c_str(), fmt("%.2f", r.onednn_s / r.kt_s).c_str(),
                  fmt("%.3f", r.torch_s * 1e3).c_str(), fmt("%.2f", r.torch_s / r.kt_s).c_str());
    }
    std::string agreement;
    for (const Row& r : mr.rows)
      if (std::isfinite(r.onednn_rel_l2))
        agreement += std::string(agreement.empty() ? "" : ", ") + (r.which == Case::kForward ? "y" : "dx") + " T=" +
                     std::to_string(r.tokens) + " " + fmt("%.1e", r.onednn_rel_l2);
    for (const Row& r : mr.rows) {
      if (!r.kt_profile.stage_ms.empty()) {
        std::printf("   profile %s T=%lld, ms per call:", case_key(r.which),
                    static_cast<long long>(r.tokens));
        for (const auto& st : r.kt_profile.stage_ms)
          std::printf(" %s %.3f", st.first.c_str(), st.second);
        std::printf("\n");
      }
      if (!r.kt_profile.kernels.empty())
        std::printf("   kernels %s T=%lld, share of the GEMM flops (calls per call): %s\n",
                    case_key(r.which), static_cast<long long>(r.tokens),
                    kernel_summary(r.kt_profile.kernels).c_str());
    }
    if (!agreement.empty()) std::printf("   oneDNN vs kt, relative L2 on the first batch: %s\n", agreement.c_str());
    for (const Row& r : mr.rows)
      if (!r.kt_error.empty()) std::printf("   kt %s T=%lld: %s\n", case_key(r.which), static_cast<long long>(r.tokens), r.kt_error.c_str());
    std::printf("linearity, kt time ~ a*touched experts + b*routes (least squares over T):\n");
    for (const auto& kv : mr.fits) {
      const LinearFit& f = kv.second;
      std::printf("   %-19s a = %s ms/expert, b = %s us/route, worst residual %s%%\n", case_label(kv.first),
                  fmt("%.3f", f.ms_per_expert).c_str(), fmt("%.2f", f.us_per_route).c_str(),
                  fmt("%.1f", 100 * f.max_rel_residual).c_str());
    }
    if (!mr.formats.empty()) {
      std::printf(
          "weight storage formats, side by side with bf16 in this run (kt only; B/wt: bytes kt "
          "stores\n"
          "per weight, scales included; GB/s and %%bw on the bytes of the touched experts in that "
          "format;\n"
          "t/t_bf16 against the bf16 layer timed in alternation with the format, call by call: its "
          "ms in\n"
          "the next column; pair: the median of each round's ratio of the two calls, side by side "
          "and taking\n"
          "turns at going first (each call against the one beside it); rd GB/s: a plain "
          "read of\n"
          "the same bytes by the same threads, the third call of each of those rounds, the DRAM "
          "bandwidth\n"
          "at that moment; %%rd: GB/s against it, medians; best: the same for the fastest call and "
          "the\n"
          "fastest read):\n");
      for (const FormatError& e : mr.format_errors) {
        std::printf("   %s: W' against the bf16 weights, relative L2 %s%%",
                    e.choice.label().c_str(), fmt("%.2f", 100 * e.weight_rel_l2).c_str());
        if (e.choice.compute == KT_COMPUTE_INT8)
          std::printf("; y against the same base with bf16 activations (T=%lld), relative L2 %s%%",
                      static_cast<long long>(e.activation_tokens),
                      fmt("%.2f", 100 * e.activation_rel_l2).c_str());
        std::printf("\n");
      }
      for (const CheckpointWritten& c : mr.checkpoints)
        std::printf("   %s: loaded from a synthetic checkpoint of these weights (%.2f GB, written in %.1f s)\n",
                    kt_weight_format_name(c.format), c.file_bytes / 1e9, c.seconds);
      std::printf("   %-19s %6s %-17s %7s %10s %8s %6s %9s %10s %5s %8s %5s %5s\n", "case", "T",
                  "format", "B/wt", "ms", "GB/s", "%bw", "t/t_bf16", "bf16 ms", "pair", "rd GB/s",
                  "%rd", "best");
      for (const Row& r : mr.rows) {
        std::printf("   %-19s %6lld %-17s %7.3f %10s %8s %6s %9s\n", case_label(r.which),
                    static_cast<long long>(r.tokens), "bf16", 2.0,
                    fmt("%.3f", r.kt_s * 1e3).c_str(), fmt("%.1f", r.bytes / r.kt_s / 1e9).c_str(),
                    fmt("%.0f", 100 * r.bytes / r.kt_s / 1e9 / lim.machine.dram_read_gbs).c_str(),
                    "1.00");
        for (const FormatRow& f : mr.formats) {
          if (f.which != r.which || f.tokens != r.tokens) continue;
          std::printf("   %-19s %6lld %-17s %7.3f %10s %8s %6s %9s %10s %5s %8s %5s %5s\n", "",
                      static_cast<long long>(f.tokens), f.choice.label().c_str(),
                      f.bytes_per_weight, fmt("%.3f", f.kt_s * 1e3).c_str(),
                      fmt("%.1f", f.bytes / f.kt_s / 1e9).c_str(),
                      fmt("%.0f", 100 * f.bytes / f.kt_s / 1e9 / lim.machine.dram_read_gbs).c_str(),
                      fmt("%.2f", f.kt_s / f.bf16_s).c_str(), fmt("%.3f", f.bf16_s * 1e3).c_str(),
                      fmt("%.2f", f.paired).c_str(), fmt("%.1f", f.bytes / f.read_s / 1e9).c_str(),
                      fmt("%.0f", 100 * f.read_s / f.kt_s).c_str(),
                      fmt("%.0f", 100 * f.read_best_s / f.kt_best_s).c_str());
          if (!f.kt_profile.stage_ms.empty()) {
            std::printf("      profile, ms per call:");
            for (const auto& st : f.kt_profile.stage_ms)
              std::printf(" %s %.3f", st.first.c_str(), st.second);
            std::printf("\n");
          }
          if (!f.kt_profile.kernels.empty())
            std::printf("      kernels: %s\n", kernel_summary(f.kt_profile.kernels).c_str());
          if (!f.error.empty()) std::printf("      %s\n", f.error.c_str());
        }
      }
      if (std::find(o.cases.begin(), o.cases.end(), Case::kTrainFull) != o.cases.end())
        std::printf("   fwd+bwd full grads: bf16 only (a quantized base is frozen)\n");
      if (std::any_of(o.formats.begin(), o.formats.end(),
                      [](const FormatChoice& fc) { return fc.compute == KT_COMPUTE_INT8; }))
        std::printf("   /int8 (KT_COMPUTE_INT8, int8 activations): forward only\n");
    }
    print_peer_rows(mr);
    if (!mr.sweep.empty()) {
      std::printf("   forward at T=%lld vs touched experts:", static_cast<long long>(mr.sweep.front().tokens));
      for (const TouchedRow& t : mr.sweep)
        std::printf("  %lld: %s ms (%s ms/expert, %s%% bw)", static_cast<long long>(t.touched), fmt("%.2f", t.kt_s * 1e3).c_str(),
                    fmt("%.3f", t.kt_s * 1e3 / static_cast<double>(t.touched)).c_str(),
                    fmt("%.0f", 100 * t.bytes / t.kt_s / 1e9 / lim.machine.dram_read_gbs).c_str());
      std::printf("\n");
    }
  }
  if (!models.empty())
    std::printf(
        "\n%%peak / %%bw: of the measured peak / DRAM read bandwidth; * marks the bound (roofline) "
        "of the case.\n"
        "%%rd (memory-bound cases): kt's calls timed again, each followed by a plain read of the "
        "same bytes by\n"
        "the same threads; kt's GB/s against the read's (medians of those rounds): the bandwidth "
        "at that moment.\n"
        "xoneDNN, xtorch: baseline time / kt time (above 1: kt is faster).\n");
  if (optimizer) print_optimizer(*optimizer, lim);
}

void write_optimizer_json(JsonWriter& j, const OptimizerReport& rep, const Limits& lim) {
  j.key("optimizer").begin_object();
  j.key("model").value(rep.shape.name);
  j.key("algorithm").value("adamw");
  j.key("tokens").value(rep.tokens);
  j.key("bytes_per_param").value(kAdamwBytesPerParam);
  j.key("layer_bytes_per_param").value(kLayerStepBytesPerParam);
  j.key("torch").begin_object();
  j.key("ran").value(!rep.torch_version.empty());
  if (!rep.torch_version.empty()) {
    j.key("version").value(rep.torch_version);
    j.key("threads").value(rep.torch_threads);
  }
  if (!rep.torch_reason.empty()) j.key("reason").value(rep.torch_reason);
  j.end_object();
  j.key("deepspeed").begin_object();
  j.key("ran").value(rep.deepspeed_reason.empty() && !rep.deepspeed_version.empty());
  if (!rep.deepspeed_version.empty()) j.key("version").value(rep.deepspeed_version);
  if (!rep.deepspeed_flags.empty()) j.key("build_flags").value(rep.deepspeed_flags);
  if (!rep.deepspeed_reason.empty()) j.key("reason").value(rep.deepspeed_reason);
  j.end_object();
  j.key("results").begin_array();
  for (const OptimizerRow& r : rep.rows) {
    const double kt = positive_or_nan(r.kt_plain_s);
    const double floor = memory_floor_s(r.params, kAdamwBytesPerParam, lim);
    j.begin_object();
    j.key("experts").value(r.experts);
    j.key("params").value(r.params);
    j.key("kt_ms").value(kt * 1e3);
    j.key("kt_gparams_per_s").value(static_cast<double>(r.params) / kt / 1e9);
    j.key("floor_ms").value(floor * 1e3);
    j.key("pct_floor").value(100 * floor / kt);
    j.key("torch_forloop_ms").value(positive_or_nan(r.torch_forloop_s) * 1e3);
    j.key("torch_foreach_ms").value(positive_or_nan(r.torch_foreach_s) * 1e3);
    j.key("layer_step_ms").value(positive_or_nan(r.kt_layer_s) * 1e3);
    j.key("layer_over_plain").value(positive_or_nan(r.kt_layer_s) / kt);
    j.key("repack_ms").value(positive_or_nan(r.repack_s) * 1e3);
    j.key("fwd_bwd_ms").value(positive_or_nan(r.fwd_bwd_s) * 1e3);
    // DeepSpeed beside kt, a step of each per round (NaN where it did not run).
    const double ds = positive_or_nan(r.deepspeed_s), kt_ds = positive_or_nan(r.kt_beside_deepspeed_s);
    j.key("deepspeed_ms").value(ds * 1e3);
    j.key("deepspeed_gparams_per_s").value(static_cast<double>(r.params) / ds / 1e9);
    j.key("deepspeed_pct_floor").value(100 * floor / ds);
    j.key("kt_beside_deepspeed_ms").value(kt_ds * 1e3);
    j.key("kt_beside_deepspeed_gparams_per_s").value(static_cast<double>(r.params) / kt_ds / 1e9);
    j.key("kt_beside_deepspeed_pct_floor").value(100 * floor / kt_ds);
    j.key("deepspeed_speedup_of_kt").value(ds / kt_ds);
    // The floor measured in those rounds (an AdamW-shaped stream, 28 B/param).
    const double floor_beside = positive_or_nan(r.floor_beside_s);
    j.key("floor_beside_ms").value(floor_beside * 1e3);
    j.key("deepspeed_pct_floor_beside").value(100 * floor_beside / ds);
    j.key("kt_beside_deepspeed_pct_floor_beside").value(100 * floor_beside / kt_ds);
    j.key("deepspeed_speedup_of_kt_paired").value(positive_or_nan(r.deepspeed_ratio));
    // kt's step with kt_optimizer_options.assume_finite, in the same rounds.
    const double af = positive_or_nan(r.kt_assume_finite_beside_s);
    j.key("kt_assume_finite_beside_deepspeed_ms").value(af * 1e3);
    j.key("kt_assume_finite_pct_floor_beside").value(100 * floor_beside / af);
    j.key("deepspeed_speedup_of_kt_assume_finite").value(ds / af);
    j.key("deepspeed_speedup_of_kt_assume_finite_paired").value(positive_or_nan(r.deepspeed_ratio_assume_finite));
    if (!r.error.empty()) j.key("error").value(r.error);
    j.end_object();
  }
  j.end_array();
  j.end_object();
}

// A case's stage times (with --profile) and kernels, per call.
void write_profile(JsonWriter& j, const CaseProfile& p) {
  if (!p.stage_ms.empty()) {
    j.key("stage_ms").begin_object();
    for (const auto& st : p.stage_ms) j.key(st.first).value(st.second);
    j.end_object();
  }
  j.key("kernels").begin_array();
  for (const KernelUse& k : p.kernels) {
    j.begin_object();
    j.key("stage").value(k.stage);
    j.key("kernel").value(k.kernel);
    j.key("calls").value(k.calls);
    j.key("gflop").value(k.gflop);
    j.end_object();
  }
  j.end_array();
}

void write_json(const Options& o, const Limits& lim, const kt_engine_info& info, const std::vector<ModelReport>& models,
                const OptimizerReport* optimizer, const std::vector<PeerEntry>& peers,
                const std::vector<PeerSkip>& skips) {
  JsonWriter j;
  const MachineLimits& m = lim.machine;
  j.begin_object();
  j.key("kt").begin_object();
  j.key("version").value(kt_version());
  j.key("abi").value(kt_abi_version());
  j.key("build_info").value(kt_build_info());
  j.key("isa").value(kt_isa_name(info.isa));
  j.key("cpu_isa").value(kt_isa_name(info.cpu_isa));
  j.key("kernel").value(info.kernel_name ? info.kernel_name : "");
  j.key("threads").value(info.num_threads);
  j.key("call_overhead_us").value(lim.call_us);
  j.key("call_overhead_paused_us").value(lim.call_paused_us);
  j.key("call_pause_us").value(kCallPause * 1e6);
  j.end_object();
  j.key("machine").begin_object();
  j.key("threads").value(m.threads);
  j.key("avx2_fma").value(m.has_avx2_fma);
  j.key("avx512f").value(m.has_avx512f);
  j.key("avx512_bf16").value(m.has_avx512bf16);
  j.key("bf16_dot_peak_gflops").value(m.has_avx512bf16 ? m.bf16_dot_gflops : NAN);
  j.key("amx_bf16").value(m.has_amx_bf16);
  j.key("amx_bf16_peak_gflops").value(m.has_amx_bf16 ? m.amx_bf16_gflops : NAN);
  j.key("avx512_vnni").value(m.has_avx512vnni);
  j.key("int8_dot_peak_gops").value(m.has_avx512vnni ? m.int8_dot_gops : NAN);
  j.key("int16_dot_peak_gops").value(m.has_avx512vnni ? m.int16_dot_gops : NAN);
  j.key("amx_int8").value(m.has_amx_int8);
  j.key("amx_int8_peak_gops").value(m.has_amx_int8 ? m.amx_int8_gops : NAN);
  j.key("fp32_fma_avx512_peak_gflops").value(m.has_avx512f ? m.fp32_fma_avx512_gflops : NAN);
  j.key("fp32_fma_avx2_peak_gflops").value(m.has_avx2_fma ? m.fp32_fma_avx2_gflops : NAN);
  j.key("peak_gflops").value(lim.peak_gflops);
  j.key("peak_kind").value(lim.peak_kind);
  j.key("dram_read_gbs").value(m.dram_read_gbs);
  j.key("dram_buffer_bytes").value(static_cast<int64_t>(m.dram_buffer_bytes));
  j.key("l3_bytes").value(static_cast<int64_t>(m.l3_bytes));
  j.end_object();
  j.key("settings").begin_object();
  j.key("quick").value(o.quick);
  j.key("reps").value(o.reps);
  j.key("warmup").value(o.warmup);
  j.key("statistic").value("median");
  j.key("tokens").begin_array();
  for (int64_t t : o.tokens) j.value(t);
  j.end_array();
  j.end_object();
  j.key("peers").begin_array();
  for (const PeerEntry& p : peers) {
    j.begin_object();
    j.key("name").value(p.name);
    j.key("version").value(p.version);
    j.key("python").value(p.python);
    j.key("role").value(p.role);
    j.key("detail").value(p.detail);
    j.end_object();
  }
  j.end_array();
  j.key("peers_skipped").begin_array();
  for (const PeerSkip& sk : skips) {
    j.begin_object();
    j.key("name").value(sk.peer);
    j.key("what").value(sk.what);
    j.key("reason").value(sk.reason);
    j.end_object();
  }
  j.end_array();
  j.key("models").begin_array();
  for (const ModelReport& mr : models) {
    const ModelShape& s = mr.shape;
    j.begin_object();
    j.key("name").value(s.name);
    j.key("hidden").value(s.hidden);
    j.key("intermediate").value(s.intermediate);
    j.key("experts").value(s.experts);
    j.key("top_k").value(s.top_k);
    j.key("experts_held").value(mr.experts_held);
    j.key("slice").value(mr.experts_held < s.experts);
    j.key("note").value(slice_note(mr));
    j.key("weight_bytes").value(mr.weight_bytes);
    j.key("kt_load_seconds").begin_object();
    for (const auto& l : mr.loads) j.key(l.first).value(l.second);
    j.end_object();
    j.key("baselines").begin_object();
    j.key("onednn").begin_object();
    j.key("ran").value(mr.onednn_reason.empty());
    if (mr.onednn_reason.empty()) j.key("version").value(onednn_version());
    else j.key("reason").value(mr.onednn_reason);
    j.end_object();
    j.key("torch").begin_object();
    j.key("ran").value(mr.torch.ran);
    if (mr.torch.ran) {
      j.key("version").value(mr.torch.version);
      j.key("threads").value(mr.torch.threads);
    }
    if (!mr.torch.reason.empty()) j.key("reason").value(mr.torch.reason);
    j.end_object();
    j.end_object();
    j.key("results").begin_array();
    for (const Row& r : mr.rows) {
      j.begin_object();
      j.key("case").value(case_key(r.which));
      j.key("tokens").value(r.tokens);
      j.key("routes").value(r.routes);
      j.key("touched_experts").value(r.touched);
      j.key("flops").value(r.flops);
      j.key("bytes").value(r.bytes);
      j.key("kt").begin_object();
      j.key("ms").value(r.kt_s * 1e3);
      if (std::isfinite(r.kt_s)) {
        const Rates x = rates_of(r.flops, r.bytes, r.kt_s, lim);
        j.key("gflops").value(x.gflops);
        j.key("pct_peak").value(x.pct_peak);
        j.key("gbs").value(x.gbs);
        j.key("pct_bandwidth").value(x.pct_bw);
        j.key("bound").value(x.compute_bound ? "compute" : "memory");
        j.key("pct_roofline").value(x.pct_roofline);
        // Memory-bound: kt's median in the rounds with the read, the read's
        // GB/s and kt's GB/s against it (null where not measured).
        j.key("ms_beside_read").value(r.kt_beside_read_s * 1e3);
        j.key("read_gbs_alternating").value(r.bytes / r.read_s / 1e9);
        j.key("pct_read_bandwidth").value(100 * r.read_s / r.kt_beside_read_s);
      }
      if (!r.kt_error.empty()) j.key("error").value(r.kt_error);
      write_profile(j, r.kt_profile);
      j.end_object();
      auto baseline = [&](const char* name, double seconds, const std::string& error, double rel_l2_vs_kt) {
        j.key(name).begin_object();
        j.key("ms").value(seconds * 1e3);
        j.key("gflops").value(r.flops / seconds / 1e9);
        j.key("speedup_of_kt").value(seconds / r.kt_s);
        if (std::isfinite(rel_l2_vs_kt)) j.key("rel_l2_vs_kt").value(rel_l2_vs_kt);
        if (!error.empty()) j.key("error").value(error);
        j.end_object();
      };
      baseline("onednn", r.onednn_s, r.onednn_error, r.onednn_rel_l2);
      baseline("torch", r.torch_s, r.torch_error, NAN);
      j.end_object();
    }
    j.end_array();
    j.key("linearity").begin_object();
    j.key("model").value("kt ms = a * touched_experts + b * routes, least squares over the token counts");
    for (const auto& kv : mr.fits) {
      j.key(case_key(kv.first)).begin_object();
      j.key("ms_per_touched_expert").value(kv.second.ms_per_expert);
      j.key("us_per_route").value(kv.second.us_per_route);
      j.key("max_rel_residual").value(kv.second.max_rel_residual);
      j.end_object();
    }
    j.key("touched_experts_sweep").begin_array();
    for (const TouchedRow& t : mr.sweep) {
      j.begin_object();
      j.key("tokens").value(t.tokens);
      j.key("touched_experts").value(t.touched);
      j.key("ms").value(t.kt_s * 1e3);
      j.key("ms_per_expert").value(t.kt_s * 1e3 / static_cast<double>(t.touched));
      j.key("pct_bandwidth").value(100 * t.bytes / t.kt_s / 1e9 / lim.machine.dram_read_gbs);
      j.end_object();
    }
    j.end_array();
    j.end_object();
    // Peers: kt-kernel timed call by call beside kt (timing "alternating"),
    // torch from the peers' interpreter run after kt ("separate").
    j.key("peer_results").begin_array();
    for (const PeerRow& r : mr.peer_rows) {
      j.begin_object();
      j.key("peer").value(r.peer);
      j.key("variant").value(r.variant);
      j.key("class").value(r.peer_class);
      j.key("kt_format").value(r.kt_format);
      j.key("case").value(case_key(r.which));
      j.key("tokens").value(r.tokens);
      j.key("timing").value("alternating");
      j.key("ms").value(r.peer_s * 1e3);
      j.key("kt_ms").value(r.kt_s * 1e3);
      j.key("speedup_of_kt").value(r.peer_s / r.kt_s);
      j.key("speedup_of_kt_paired").value(r.ratio);
      j.key("rows_compared").value(r.rows_compared);
      j.key("rel_l2_vs_f64").value(r.peer_rel_l2);
      j.key("kt_rel_l2_vs_f64").value(r.kt_rel_l2);
      if (!r.note.empty()) j.key("note").value(r.note);
      if (!r.error.empty()) j.key("error").value(r.error);
      j.end_object();
    }
    if (mr.torch2.ran) {
      for (const Row& r : mr.rows) {
        const auto key = std::make_pair(std::string(case_key(r.which)), r.tokens);
        const auto t = mr.torch2.seconds.find(key);
        j.begin_object();
        j.key("peer").value("torch");
        j.key("variant").value(mr.torch2.version);
        j.key("case").value(case_key(r.which));
        j.key("tokens").value(r.tokens);
        j.key("timing").value("separate");
        const double sec = t == mr.torch2.seconds.end() ? NAN : t->second;
        j.key("ms").value(sec * 1e3);
        j.key("kt_ms").value(r.kt_s * 1e3);
        j.key("speedup_of_kt").value(sec / r.kt_s);
        const auto e = mr.torch2.errors.find(key);
        if (e != mr.torch2.errors.end()) j.key("error").value(e->second);
        j.end_object();
      }
    }
    j.end_array();
    j.key("weight_formats").begin_array();
    for (const FormatRow& f : mr.formats) {
      j.begin_object();
      j.key("format").value(kt_weight_format_name(f.choice.format));
      j.key("compute").value(f.choice.compute == KT_COMPUTE_INT8 ? "int8" : "bf16");
      j.key("source").value(comes_from_checkpoint(f.choice.format) ? "checkpoint"
                                                                   : "quantized_at_load");
      j.key("case").value(case_key(f.which));
      j.key("tokens").value(f.tokens);
      j.key("bytes_per_weight").value(f.bytes_per_weight);
      j.key("ms").value(f.kt_s * 1e3);
      j.key("gbs").value(f.bytes / f.kt_s / 1e9);
      j.key("pct_bandwidth").value(100 * f.bytes / f.kt_s / 1e9 / lim.machine.dram_read_gbs);
      j.key("time_vs_bf16").value(f.kt_s / f.bf16_s);
      j.key("bf16_ms_alternating").value(f.bf16_s * 1e3);
      j.key("time_vs_bf16_paired").value(f.paired);
      j.key("read_gbs_alternating").value(f.bytes / f.read_s / 1e9);
      j.key("pct_read_bandwidth").value(100 * f.read_s / f.kt_s);
      j.key("read_gbs_alternating_best").value(f.bytes / f.read_best_s / 1e9);
      j.key("pct_read_bandwidth_best").value(100 * f.read_best_s / f.kt_best_s);
      write_profile(j, f.kt_profile);
      if (!f.error.empty()) j.key("error").value(f.error);
      j.end_object();
    }
    j.end_array();
    j.key("format_weight_error").begin_object();
    for (const FormatError& e : mr.format_errors) j.key(e.choice.label()).value(e.weight_rel_l2);
    j.end_object();
    j.key("format_activation_error").begin_object();
    for (const FormatError& e : mr.format_errors)
      if (e.choice.compute == KT_COMPUTE_INT8) j.key(e.choice.label()).value(e.activation_rel_l2);
    j.end_object();
    j.key("format_checkpoints").begin_array();
    for (const CheckpointWritten& c : mr.checkpoints) {
      j.begin_object();
      j.key("format").value(kt_weight_format_name(c.format));
      j.key("file_bytes").value(c.file_bytes);
      j.key("write_seconds").value(c.seconds);
      j.end_object();
    }
    j.end_array();
    j.end_object();
  }
  j.end_array();
  if (optimizer) write_optimizer_json(j, *optimizer, lim);
  j.end_object();
  std::printf("%s\n", j.str().c_str());
}

}  // namespace
}  // namespace kt_bench

int main(int argc, char** argv) {
  using namespace kt_bench;
  Options o;
  std::string error;
  if (!parse_options(argc, argv, &o, &error)) {
    std::fprintf(stderr, "kt_bench: %s\n%s", error.c_str(), kUsage);
    return 2;
  }
  if (kt_abi_version() != KT_ABI_VERSION) {
    std::fprintf(stderr, "kt_bench: built for kt ABI %d, loaded %d\n", KT_ABI_VERSION, kt_abi_version());
    return 1;
  }
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = o.threads;
  eo.max_isa = o.max_isa;

  kt_engine* engine = nullptr;
  kt_status st = kt_engine_create(&eo, &engine);
  if (st != KT_OK) {
    std::fprintf(stderr, "kt_bench: %s\n", kt_error("kt_engine_create", st).c_str());
    return 1;
  }
  st = kt_engine_set_gemm_backend(engine, o.backend);
  if (st != KT_OK) {
    std::fprintf(stderr, "kt_bench: %s\n", kt_error("kt_engine_set_gemm_backend", st).c_str());
    kt_engine_destroy(engine);
    return 1;
  }
  kt_engine_info info{};
  info.struct_size = sizeof(info);
  kt_engine_get_info(engine, &info);

  // Every measurement runs on as many threads as kt's workers.
  if (!o.json) std::fprintf(stderr, "kt_bench: measuring the machine on %d threads\n", info.num_threads);
  Limits lim;
  lim.machine = measure_machine_limits(info.num_threads, o.quick);
  measure_call_us(engine, &lim);
  if (info.isa >= KT_ISA_AMX && lim.machine.has_amx_bf16) {
    lim.peak_gflops = lim.machine.amx_bf16_gflops;
    lim.peak_kind = "AMX-BF16 tiles (tdpbf16ps)";
  } else if (info.isa >= KT_ISA_AVX512BF16 && lim.machine.has_avx512bf16) {
    lim.peak_gflops = lim.machine.bf16_dot_gflops;
    lim.peak_kind = "bf16 dot (vdpbf16ps)";
  } else {
    lim.peak_gflops = lim.machine.fp32_fma_avx2_gflops;
    lim.peak_kind = "fp32 FMA (avx2)";
  }

  const std::string torch_reason = o.torch ? torch_unavailable_reason(o.python) : "";
  if (o.torch && !torch_reason.empty() && !o.json) std::fprintf(stderr, "kt_bench: torch baseline skipped: %s\n", torch_reason.c_str());

  // The peers' subprocess and the directory it reads the shared data from.
  std::string peer_dir;
  std::unique_ptr<PeerProcess> peer;
  if (o.peers) {
    char dir_template[] = "/tmp/kt_bench_peers_XXXXXX";
    const char* dir = mkdtemp(dir_template);
    if (dir) peer_dir = dir;
    if (!o.json) std::fprintf(stderr, "kt_bench: peers: starting %s\n", o.peers_python.c_str());
    peer = std::make_unique<PeerProcess>(o.peers_python, peers_script_of(o.torch_script), info.num_threads,
                                         (peer_dir.empty() ? std::string("/tmp") : peer_dir) + "/peers.log");
  }
  std::vector<PeerSkip> skips;
  std::vector<ModelReport> models;
  auto shape_of = [](const std::string& name) -> const ModelShape& {
    return *std::find_if(std::begin(kModelShapes), std::end(kModelShapes), [&](const ModelShape& s) { return name == s.name; });
  };
  if (!o.cases.empty())
    for (const std::string& name : o.models)
      models.push_back(bench_model(shape_of(name), o, engine, info.num_threads, lim, torch_reason, peer.get(),
                                   peer_dir, &skips));
  OptimizerReport optimizer;
  if (o.optimizer) {
    OptimizerBenchOptions oo;
    oo.shape = shape_of(o.models.front());
    oo.param_counts = o.optim_params;
    oo.tokens = o.quick ? 8 : 512;
    oo.warmup = o.warmup;
    oo.reps = o.reps;
    oo.threads = info.num_threads;
    oo.torch = o.torch;
    oo.python = o.python;
    oo.torch_script = optimizer_script_of(o.torch_script);
    oo.peer = peer.get();
    oo.peer_dir = peer_dir;
    optimizer = run_optimizer_bench(engine, oo, torch_reason);
  }
  const std::vector<PeerEntry> peers = summarize_peers(o, peer.get(), models, o.optimizer ? &optimizer : nullptr, &skips);
  peer.reset();  // ends the subprocess
  if (!peer_dir.empty()) remove_directory(peer_dir);
  std::fprintf(stderr, "kt_bench: %s\n", skip_line(skips).c_str());
  if (o.json) write_json(o, lim, info, models, o.optimizer ? &optimizer : nullptr, peers, skips);
  else print_table(o, lim, info, models, o.optimizer ? &optimizer : nullptr, peers, skips);

  bool kt_failed = !lim.call_error.empty();
  for (const ModelReport& mr : models)
    for (const Row& r : mr.rows) kt_failed = kt_failed || !r.kt_error.empty();
  for (const OptimizerRow& r : optimizer.rows) kt_failed = kt_failed || !r.error.empty();
  for (const ModelReport& mr : models)
    for (const FormatRow& f : mr.formats) kt_failed = kt_failed || !f.error.empty();
  st = kt_engine_destroy(engine);
  if (st != KT_OK) {
    std::fprintf(stderr, "kt_bench: %s\n", kt_error("kt_engine_destroy", st).c_str());
    return 1;
  }
  return kt_failed ? 1 : 0;
}
