// kt_bench: kt on real MoE shapes against this machine's measured limits and
// against oneDNN-per-expert and torch eager, all in one run.
//
//   kt_bench [--json] [--quick] [--models LIST|all] [--tokens LIST] [--cases LIST]
//            [--threads N] [--reps N] [--warmup N] [--isa NAME] [--max-weight-gb X]
//            [--profile] [--no-onednn] [--no-torch] [--python PATH] [--torch-script PATH]
//            [--optim-params LIST] [--no-peers] [--peers-python PATH]
//            [--vllm-python PATH] [--format LIST]
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

#include "kt_bench.h"

namespace kt_bench {

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

std::string default_peers_python() {
  const char* env = std::getenv("KT_BENCH_PEERS_PYTHON");
  return env && *env ? env : KT_BENCH_PEERS_PYTHON;
}

std::string default_vllm_python() {
  const char* env = std::getenv("KT_BENCH_VLLM_PYTHON");
  return env ? env : "";
}

namespace {

// torch_optim_baseline.py, found like torch_baseline.py.
std::string optimizer_script_of(const std::string& torch_script) {
  return torch_script.substr(0, torch_script.find_last_of('/') + 1) + "torch_optim_baseline.py";
}

// peers_baseline.py, found like torch_baseline.py.
std::string peers_script_of(const std::string& torch_script) {
  return torch_script.substr(0, torch_script.find_last_of('/') + 1) + "peers_baseline.py";
}

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
    "  --vllm-python PATH   interpreter of vLLM's venv (its CPU build): vLLM's CPU fused MoE\n"
    "                       (torch.ops._C.cpu_fused_moe, weights prepacked as vLLM loads them)\n"
    "                       beside kt's bf16 forward, in a second peers' process (default\n"
    "                       $KT_BENCH_VLLM_PYTHON, else not run)\n"
    "  --no-peers           skip those peers (vLLM's too)\n"
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

// The options that take no value; false when a is not one of them.
bool parse_switch(const std::string& a, Options* o) {
  if (a == "--json") o->json = true;
  else if (a == "--quick") o->quick = true;
  else if (a == "--profile") o->profile = true;
  else if (a == "--no-onednn") o->onednn = false;
  else if (a == "--no-torch") o->torch = false;
  else if (a == "--no-peers") o->peers = false;
  else if (a == "--help" || a == "-h") {
    std::fputs(kUsage, stdout);
    std::exit(0);
  } else {
    return false;
  }
  return true;
}

bool parse_cases(const std::string& v, Options* o, std::string* error) {
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
  return true;
}

bool parse_formats(const std::string& v, Options* o, std::string* error) {
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
      if (entry.substr(slash + 1) != "int8" || *f == KT_FORMAT_BF16 || *f == KT_FORMAT_FP8_B128) {
        *error = "--format " + entry +
                 ": only the integer formats (int8_channel, int4_g32, int4_g128, int4_g32_zp, "
                 "int4_g128_zp, mxfp4) take /int8 (KT_COMPUTE_INT8)";
        return false;
      }
      choice.compute = KT_COMPUTE_INT8;
    }
    if (*f != KT_FORMAT_BF16) o->formats.push_back(choice);
  }
  return true;
}

bool parse_backend(const std::string& v, Options* o, std::string* error) {
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
  return true;
}

bool parse_isa(const std::string& v, Options* o, std::string* error) {
  const kt_isa all[] = {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX};
  const kt_isa* found = std::find_if(std::begin(all), std::end(all), [&](kt_isa x) { return v == kt_isa_name(x); });
  if (found == std::end(all)) {
    *error = "unknown ISA " + v;
    return false;
  }
  o->max_isa = *found;
  return true;
}

// Which of the options whose defaults --quick changes were given.
struct Given {
  bool tokens = false, reps = false, optim_params = false;
};

// An option a with its value v.
bool parse_valued(const std::string& a, const std::string& v, Options* o, Given* given, std::string* error) {
  if (a == "--models") {
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
    given->tokens = true;
  } else if (a == "--cases") {
    return parse_cases(v, o, error);
  } else if (a == "--optim-params") {
    o->optim_params.clear();
    for (const std::string& n : split(v)) o->optim_params.push_back(static_cast<int64_t>(std::atof(n.c_str()) * 1e6));
    given->optim_params = true;
  } else if (a == "--threads") o->threads = std::atoi(v.c_str());
  else if (a == "--reps") {
    o->reps = std::atoi(v.c_str());
    given->reps = true;
  } else if (a == "--warmup") o->warmup = std::atoi(v.c_str());
  else if (a == "--max-weight-gb") o->max_weight_gb = std::atof(v.c_str());
  else if (a == "--python") o->python = v;
  else if (a == "--torch-script") o->torch_script = v;
  else if (a == "--peers-python") o->peers_python = v;
  else if (a == "--vllm-python") o->vllm_python = v;
  else if (a == "--backend") return parse_backend(v, o, error);
  else if (a == "--format") return parse_formats(v, o, error);
  else if (a == "--isa") return parse_isa(v, o, error);
  else {
    *error = "unknown option " + a;
    return false;
  }
  return true;
}

// --quick's defaults, then the checks of the values together.
bool check_options(const Given& given, Options* o, std::string* error) {
  if (o->quick) {
    if (!given.tokens) o->tokens = {1, 8};
    if (!given.reps) o->reps = 1;
    if (!given.optim_params) o->optim_params = {1};
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

bool parse_options(int argc, char** argv, Options* o, std::string* error) {
  Given given;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (parse_switch(a, o)) continue;
    if (i + 1 >= argc) {
      *error = a + " needs a value";
      return false;
    }
    if (!parse_valued(a, argv[++i], o, &given, error)) return false;
  }
  return check_options(given, o, error);
}

// kt's engine as the options ask for it, and what it chose; null after
// printing why when it cannot be made.
kt_engine* make_engine(const Options& o, kt_engine_info* info) {
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = o.threads;
  eo.max_isa = o.max_isa;
  kt_engine* engine = nullptr;
  kt_status st = kt_engine_create(&eo, &engine);
  if (st != KT_OK) {
    std::fprintf(stderr, "kt_bench: %s\n", kt_error("kt_engine_create", st).c_str());
    return nullptr;
  }
  st = kt_engine_set_gemm_backend(engine, o.backend);
  if (st != KT_OK) {
    std::fprintf(stderr, "kt_bench: %s\n", kt_error("kt_engine_set_gemm_backend", st).c_str());
    kt_engine_destroy(engine);
    return nullptr;
  }
  *info = kt_engine_info{};
  info->struct_size = sizeof(*info);
  kt_engine_get_info(engine, info);
  return engine;
}

// The machine's limits on as many threads as kt's workers, kt's call
// overhead, and the peak the %peak column is taken against.
Limits measure_limits(kt_engine* engine, const kt_engine_info& info, const Options& o) {
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
  return lim;
}

// The peers' subprocess, reading the shared data from a new directory
// (*peer_dir); null with --no-peers.
std::unique_ptr<PeerProcess> start_peers(const Options& o, const kt_engine_info& info, std::string* peer_dir) {
  if (!o.peers) return nullptr;
  char dir_template[] = "/tmp/kt_bench_peers_XXXXXX";
  const char* dir = mkdtemp(dir_template);
  if (dir) *peer_dir = dir;
  if (!o.json) std::fprintf(stderr, "kt_bench: peers: starting %s\n", o.peers_python.c_str());
  return std::make_unique<PeerProcess>(o.peers_python, peers_script_of(o.torch_script), info.num_threads,
                                       (peer_dir->empty() ? std::string("/tmp") : *peer_dir) + "/peers.log");
}

// vLLM's peer: peers_baseline.py once more, from vLLM's venv, importing
// vLLM only; null with --no-peers or without --vllm-python.
std::unique_ptr<PeerProcess> start_vllm_peer(const Options& o, const kt_engine_info& info,
                                             const std::string& peer_dir) {
  if (!o.peers || o.vllm_python.empty()) return nullptr;
  if (!o.json) std::fprintf(stderr, "kt_bench: peers: starting %s for vLLM\n", o.vllm_python.c_str());
  return std::make_unique<PeerProcess>(o.vllm_python, peers_script_of(o.torch_script), info.num_threads,
                                       (peer_dir.empty() ? std::string("/tmp") : peer_dir) + "/vllm.log",
                                       std::vector<std::string>{"--peers", "vllm"});
}

const ModelShape& shape_of(const std::string& name) {
  return *std::find_if(std::begin(kModelShapes), std::end(kModelShapes),
                       [&](const ModelShape& s) { return name == s.name; });
}

OptimizerReport bench_optimizer(kt_engine* engine, const Options& o, const kt_engine_info& info,
                                const std::string& torch_reason, PeerProcess* peer, const std::string& peer_dir) {
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
  oo.peer = peer;
  oo.peer_dir = peer_dir;
  return run_optimizer_bench(engine, oo, torch_reason);
}

// Whether a call of kt failed anywhere in the run.
bool kt_failed(const Limits& lim, const std::vector<ModelReport>& models, const OptimizerReport& optimizer) {
  bool failed = !lim.call_error.empty();
  for (const ModelReport& mr : models)
    for (const Row& r : mr.rows) failed = failed || !r.kt_error.empty();
  for (const OptimizerRow& r : optimizer.rows) failed = failed || !r.error.empty();
  for (const ModelReport& mr : models)
    for (const FormatRow& f : mr.formats) failed = failed || !f.error.empty();
  return failed;
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
  kt_engine_info info{};
  kt_engine* engine = make_engine(o, &info);
  if (!engine) return 1;
  // Every measurement runs on as many threads as kt's workers.
  const Limits lim = measure_limits(engine, info, o);

  const std::string torch_reason = o.torch ? torch_unavailable_reason(o.python) : "";
  if (o.torch && !torch_reason.empty() && !o.json) std::fprintf(stderr, "kt_bench: torch baseline skipped: %s\n", torch_reason.c_str());

  std::string peer_dir;
  std::unique_ptr<PeerProcess> peer = start_peers(o, info, &peer_dir);
  std::unique_ptr<PeerProcess> vllm = start_vllm_peer(o, info, peer_dir);
  std::vector<PeerSkip> skips;
  std::vector<ModelReport> models;
  if (!o.cases.empty())
    for (const std::string& name : o.models)
      models.push_back(bench_model(shape_of(name), o, engine, info.num_threads, lim, torch_reason, peer.get(),
                                   vllm.get(), peer_dir, &skips));
  OptimizerReport optimizer;
  if (o.optimizer) optimizer = bench_optimizer(engine, o, info, torch_reason, peer.get(), peer_dir);
  const OptimizerReport* optimizer_ran = o.optimizer ? &optimizer : nullptr;
  const std::vector<PeerEntry> peers = summarize_peers(o, peer.get(), vllm.get(), models, optimizer_ran, &skips);
  peer.reset();  // ends the subprocesses
  vllm.reset();
  if (!peer_dir.empty()) remove_directory(peer_dir);
  std::fprintf(stderr, "kt_bench: %s\n", skip_line(skips).c_str());
  if (o.json) write_json(o, lim, info, models, optimizer_ran, peers, skips);
  else print_table(o, lim, info, models, optimizer_ran, peers, skips);

  const bool failed = kt_failed(lim, models, optimizer);
  const kt_status st = kt_engine_destroy(engine);
  if (st != KT_OK) {
    std::fprintf(stderr, "kt_bench: %s\n", kt_error("kt_engine_destroy", st).c_str());
    return 1;
  }
  return failed ? 1 : 0;
}
