// kt_ab: two builds of libkt side by side in one process, the same layer in
// each, their forwards alternated call by call. On a shared, noisy machine
// the ratio of two such timings is what holds still: both see the same
// memory and frequency phases, where two runs minutes apart do not.
// Each library is opened with dlopen (RTLD_LOCAL) and reached through its C
// ABI only, so the builds may differ in anything but the ABI.
#include <dlfcn.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "checkpoint_writer.h"
#include "kt_c_api.h"

namespace {

const char kUsage[] =
    "usage: kt_ab LIB_A LIB_B [options]\n"
    "  Times the same MoE layer on two builds of libkt (paths to the shared\n"
    "  objects, e.g. copies of libkt.so.1 from two commits), forwards alternated\n"
    "  call by call (taking turns at going first), fresh routing per call; prints\n"
    "  per round the median of each, B/A (and B/A's median over the calls where\n"
    "  A ran first and where B did), and whether B's outputs (y, and dx with\n"
    "  --dx) are A's bits.\n"
    "  --format NAME     weight format (default bf16; int8_channel, int4_g32,\n"
    "                    int4_g128: quantized by kt at load; fp8_b128, mxfp4,\n"
    "                    int4_g32_zp, int4_g128_zp: the layer quantized and\n"
    "                    written as a one-layer checkpoint in $TMPDIR, which\n"
    "                    both libraries load with kt_ckpt_load_layer)\n"
    "  --int8            int8 activations (KT_COMPUTE_INT8, integer formats)\n"
    "  --backend B       weight GEMMs by native (default) or onednn in both\n"
    "  --dx              time forward + backward for dx (the frozen base's\n"
    "                    training step without parameter gradients)\n"
    "  --lora R          time LoRA training steps at rank R on every projection:\n"
    "                    forward + backward for dx and the factors' gradients\n"
    "                    (fp32 factors and gradients, as a trainer binds them;\n"
    "                    the gradients are compared too)\n"
    "  --tokens T        tokens per forward (default 32)\n"
    "  --shape E,K,H,I   experts, top-k, hidden, intermediate (default\n"
    "                    128,8,2048,768: Qwen3-30B-A3B)\n"
    "  --threads N       worker threads per engine (default 2)\n"
    "  --calls N         calls per library and round (default from T)\n"
    "  --pause-us P      sleep P microseconds before each call, untimed (a host's\n"
    "                    work between layer calls: kt's idle workers may fall\n"
    "                    asleep, and their waking counts; default 0)\n"
    "  --rounds N        rounds (default 3)\n";

struct Api {
  void* handle = nullptr;
  decltype(&kt_engine_options_defaults) engine_defaults = nullptr;
  decltype(&kt_engine_create) engine_create = nullptr;
  decltype(&kt_engine_destroy) engine_destroy = nullptr;
  decltype(&kt_moe_options_defaults) moe_defaults = nullptr;
  decltype(&kt_moe_create) moe_create = nullptr;
  decltype(&kt_moe_destroy) moe_destroy = nullptr;
  decltype(&kt_moe_load_weights) load_weights = nullptr;
  decltype(&kt_moe_forward) forward = nullptr;
  decltype(&kt_moe_backward) backward = nullptr;
  decltype(&kt_backward_options_defaults) backward_defaults = nullptr;
  decltype(&kt_context_release) context_release = nullptr;
  decltype(&kt_last_error) last_error = nullptr;
  decltype(&kt_weight_format_name) format_name = nullptr;
  decltype(&kt_version) version = nullptr;
  decltype(&kt_engine_set_gemm_backend) set_gemm_backend = nullptr;
  decltype(&kt_moe_bind) bind = nullptr;
  decltype(&kt_ckpt_open) ckpt_open = nullptr;
  decltype(&kt_ckpt_close) ckpt_close = nullptr;
  decltype(&kt_ckpt_load_layer) ckpt_load_layer = nullptr;
};

template <typename F>
bool bind(void* handle, const char* name, F* out) {
  *out = reinterpret_cast<F>(dlsym(handle, name));
  if (!*out) std::fprintf(stderr, "kt_ab: the library has no %s\n", name);
  return *out != nullptr;
}

bool open_api(const char* path, Api* api) {
  api->handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (!api->handle) {
    std::fprintf(stderr, "kt_ab: %s\n", dlerror());
    return false;
  }
  void* h = api->handle;
  return bind(h, "kt_engine_options_defaults", &api->engine_defaults) &&
         bind(h, "kt_engine_create", &api->engine_create) &&
         bind(h, "kt_engine_destroy", &api->engine_destroy) &&
         bind(h, "kt_moe_options_defaults", &api->moe_defaults) &&
         bind(h, "kt_moe_create", &api->moe_create) &&
         bind(h, "kt_moe_destroy", &api->moe_destroy) &&
         bind(h, "kt_moe_load_weights", &api->load_weights) &&
         bind(h, "kt_moe_forward", &api->forward) && bind(h, "kt_moe_backward", &api->backward) &&
         bind(h, "kt_backward_options_defaults", &api->backward_defaults) &&
         bind(h, "kt_context_release", &api->context_release) &&
         bind(h, "kt_last_error", &api->last_error) &&
         bind(h, "kt_weight_format_name", &api->format_name) &&
         bind(h, "kt_version", &api->version) &&
         bind(h, "kt_engine_set_gemm_backend", &api->set_gemm_backend) &&
         bind(h, "kt_moe_bind", &api->bind) && bind(h, "kt_ckpt_open", &api->ckpt_open) &&
         bind(h, "kt_ckpt_close", &api->ckpt_close) && bind(h, "kt_ckpt_load_layer", &api->ckpt_load_layer);
}

DLTensor tensor(void* data, DLDataTypeCode code, int bits, int ndim, int64_t* shape) {
  DLTensor t{};
  t.data = data;
  t.device = {kDLCPU, 0};
  t.ndim = ndim;
  t.dtype = {static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
  t.shape = shape;
  return t;
}

struct Options {
  std::string lib[2];
  std::string format = "bf16";
  bool int8 = false;
  bool dx = false;
  bool onednn = false;
  int64_t lora_rank = 0;  // > 0: LoRA training steps
  int64_t tokens = 32, experts = 128, top_k = 8, hidden = 2048, intermediate = 768;
  int threads = 2, calls = 0, rounds = 3;
  int64_t pause_us = 0;
};

bool parse(int argc, char** argv, Options* o) {
  int libs = 0;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    const auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "kt_ab: %s needs a value\n", name);
        return nullptr;
      }
      return argv[++i];
    };
    // An integer of at least `least` (1 unless said).
    const auto number = [&](const char* name, int64_t* out, int64_t least = 1) {
      const char* v = value(name);
      if (!v) return false;
      char* end = nullptr;
      *out = std::strtoll(v, &end, 10);
      if (*end != '\0' || *out < least) {
        std::fprintf(stderr, "kt_ab: %s takes an integer of at least %lld, not '%s'\n", name,
                     static_cast<long long>(least), v);
        return false;
      }
      return true;
    };
    int64_t n = 0;
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    } else if (a == "--format") {
      const char* v = value("--format");
      if (!v) return false;
      o->format = v;
    } else if (a == "--int8") {
      o->int8 = true;
    } else if (a == "--backend") {
      const char* v = value("--backend");
      if (!v) return false;
      if (std::strcmp(v, "onednn") != 0 && std::strcmp(v, "native") != 0) {
        std::fprintf(stderr, "kt_ab: --backend takes native or onednn, not '%s'\n", v);
        return false;
      }
      o->onednn = std::strcmp(v, "onednn") == 0;
    } else if (a == "--lora") {
      if (!number("--lora", &o->lora_rank)) return false;
      o->dx = true;
    } else if (a == "--dx") {
      o->dx = true;
    } else if (a == "--tokens") {
      if (!number("--tokens", &o->tokens)) return false;
    } else if (a == "--threads") {
      if (!number("--threads", &n)) return false;
      o->threads = static_cast<int>(n);
    } else if (a == "--calls") {
      if (!number("--calls", &n)) return false;
      o->calls = static_cast<int>(n);
    } else if (a == "--pause-us") {
      if (!number("--pause-us", &n, 0)) return false;
      o->pause_us = n;
    } else if (a == "--rounds") {
      if (!number("--rounds", &n)) return false;
      o->rounds = static_cast<int>(n);
    } else if (a == "--shape") {
      const char* v = value("--shape");
      long long e, k, h, in;
      char extra;
      if (!v || std::sscanf(v, "%lld,%lld,%lld,%lld%c", &e, &k, &h, &in, &extra) != 4 || e <= 0 ||
          k <= 0 || k > e || h <= 0 || in <= 0) {
        std::fprintf(stderr, "kt_ab: --shape takes E,K,H,I (positive, K <= E)\n");
        return false;
      }
      o->experts = e, o->top_k = k, o->hidden = h, o->intermediate = in;
    } else if (!a.empty() && a[0] != '-' && libs < 2) {
      o->lib[libs++] = a;
    } else {
      std::fprintf(stderr, "kt_ab: unknown argument '%s'\n%s", a.c_str(), kUsage);
      return false;
    }
  }
  if (libs != 2) {
    std::fprintf(stderr, "%s", kUsage);
    return false;
  }
  if (o->calls == 0) o->calls = o->tokens >= 256 ? 20 : o->tokens >= 32 ? 100 : 400;
  return true;
}

// A directory removed, with what it holds, when it goes out of scope.
struct TempDir {
  std::string path;
  ~TempDir() { remove(); }
  void remove() {
    std::error_code ec;
    if (!path.empty()) std::filesystem::remove_all(path, ec);
    path.clear();
  }
};

kt_weight_format format_of(const Api& api, const std::string& name, bool* ok) {
  for (int f = 0; f < 64; ++f) {
    const char* n = api.format_name(static_cast<kt_weight_format>(f));
    if (name == n) {
      *ok = true;
      return static_cast<kt_weight_format>(f);
    }
  }
  *ok = false;
  return KT_FORMAT_BF16;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  if (!parse(argc, argv, &o)) return 2;
  Api api[2];
  for (int q = 0; q < 2; ++q)
    if (!open_api(o.lib[q].c_str(), &api[q])) return 1;
  const int64_t E = o.experts, K = o.top_k, H = o.hidden, I = o.intermediate, T = o.tokens;
  bool known = false;
  const kt_weight_format format = format_of(api[0], o.format, &known);
  if (!known) {
    std::fprintf(stderr, "kt_ab: unknown weight format '%s'\n", o.format.c_str());
    return 2;
  }
  // bf16 weights near 1 with random low bits and signs, as kt_bench's.
  std::mt19937 rng(1);
  std::vector<uint16_t> wg(static_cast<size_t>(E * I * H)), wu(wg.size()), wd(wg.size());
  for (auto* v : {&wg, &wu, &wd})
    for (auto& x : *v) x = static_cast<uint16_t>(0x3c00 | (rng() & 0x7f) | ((rng() & 1) << 15));
  int64_t s_gu[3] = {E, I, H}, s_d[3] = {E, H, I};
  DLTensor tg = tensor(wg.data(), kDLBfloat, 16, 3, s_gu),
           tu = tensor(wu.data(), kDLBfloat, 16, 3, s_gu),
           td = tensor(wd.data(), kDLBfloat, 16, 3, s_d);
  const kt_arg load[] = {{KT_ARG_W_GATE, &tg}, {KT_ARG_W_UP, &tu}, {KT_ARG_W_DOWN, &td}};
  // Checkpoint formats: written once, loaded by both libraries, removed
  // when both hold the layer (or on any way out).
  TempDir checkpoint;
  if (kt_bench::comes_from_checkpoint(format)) {
    std::string error;
    checkpoint.path = kt_bench::make_temp_dir(&error);
    const kt_bench::CheckpointLayer layer{wg.data(), wu.data(), wd.data(), E, K, H, I};
    if (checkpoint.path.empty() ||
        !kt_bench::write_quant_checkpoint(layer, format, o.threads, checkpoint.path, &error)) {
      std::fprintf(stderr, "kt_ab: %s\n", error.c_str());
      return 1;
    }
  }
  kt_engine* engine[2] = {nullptr, nullptr};
  kt_moe* moe[2] = {nullptr, nullptr};
  for (int q = 0; q < 2; ++q) {
    kt_engine_options eo;
    api[q].engine_defaults(&eo, sizeof(eo));
    eo.num_threads = o.threads;
    kt_moe_options mo;
    api[q].moe_defaults(&mo, sizeof(mo));
    mo.num_experts = E, mo.top_k = K, mo.hidden = H, mo.intermediate = I, mo.max_tokens = T;
    mo.weight_format = format;
    if (o.int8) mo.compute = KT_COMPUTE_INT8;
    if (o.lora_rank > 0) {
      mo.mode = KT_MODE_LORA;
      mo.lora_rank = o.lora_rank;
      mo.lora_alpha = 2.f * static_cast<float>(o.lora_rank);
    }
    kt_ckpt* ckpt = nullptr;
    const bool ok = api[q].engine_create(&eo, &engine[q]) == KT_OK &&
                    (!o.onednn || api[q].set_gemm_backend(engine[q], KT_GEMM_ONEDNN) == KT_OK) &&
                    api[q].moe_create(engine[q], &mo, &moe[q]) == KT_OK &&
                    (checkpoint.path.empty() ? api[q].load_weights(moe[q], nullptr, load, 3) == KT_OK
                                             : api[q].ckpt_open(checkpoint.path.c_str(), &ckpt) == KT_OK &&
                                              api[q].ckpt_load_layer(ckpt, kt_bench::kCheckpointLayer, moe[q],
                                                                     nullptr, nullptr) == KT_OK);
    if (!ok) std::fprintf(stderr, "kt_ab: %s: %s\n", o.lib[q].c_str(), api[q].last_error());
    api[q].ckpt_close(ckpt);
    if (!ok) return 1;
  }
  checkpoint.remove();
  // LoRA: each library its own factors (the same values: A ~ N(0, 1/in),
  // B non-zero as a trained adapter's) and gradient buffers, fp32.
  const int64_t R = o.lora_rank;
  std::vector<float> factors[2][6], grads[2][6];
  std::vector<DLTensor> lora_tensors[2];
  std::vector<std::vector<int64_t>> lora_shapes;
  if (R > 0) {
    std::normal_distribution<float> nd;
    for (int p = 0; p < 3; ++p) {
      const int64_t in = p == 2 ? I : H, out = p == 2 ? H : I;
      lora_shapes.push_back({E, R, in});
      lora_shapes.push_back({E, out, R});
    }
    for (int f = 0; f < 6; ++f) {
      const std::vector<int64_t>& sh = lora_shapes[static_cast<size_t>(f)];
      const size_t n = static_cast<size_t>(sh[0] * sh[1] * sh[2]);
      factors[0][f].resize(n);
      for (auto& v : factors[0][f])
        v = f % 2 == 0 ? nd(rng) / std::sqrt(static_cast<float>(sh[2])) : 0.02f * nd(rng);
      factors[1][f] = factors[0][f];
      grads[0][f].assign(n, 0.f);
      grads[1][f].assign(n, 0.f);
    }
    for (int q = 0; q < 2; ++q) {
      std::vector<kt_arg> bind;
      lora_tensors[q].reserve(12);
      for (int f = 0; f < 6; ++f) {
        int64_t* sh = lora_shapes[static_cast<size_t>(f)].data();
        lora_tensors[q].push_back(tensor(factors[q][f].data(), kDLFloat, 32, 3, sh));
        lora_tensors[q].push_back(tensor(grads[q][f].data(), kDLFloat, 32, 3, sh));
      }
      for (int p = 0; p < 3; ++p)
        for (int which = 0; which < 2; ++which) {
          const int f = 2 * p + which;
          bind.push_back({KT_ARG_LORA_A_GATE + f, &lora_tensors[q][static_cast<size_t>(2 * f)]});
          bind.push_back(
              {KT_ARG_GRAD_LORA_A_GATE + f, &lora_tensors[q][static_cast<size_t>(2 * f + 1)]});
        }
      if (api[q].bind(moe[q], bind.data(), bind.size()) != KT_OK) {
        std::fprintf(stderr, "kt_ab: %s: %s\n", o.lib[q].c_str(), api[q].last_error());
        return 1;
      }
    }
  }
  std::vector<uint16_t> x(static_cast<size_t>(T * H)), y(x.size()), dy(x.size()), dx(x.size());
  for (auto* v : {&x, &dy})
    for (auto& e : *v) e = static_cast<uint16_t>(0x3f80 | (rng() & 0x7f));
  std::vector<int32_t> ids(static_cast<size_t>(T * K));
  std::vector<float> weights(ids.size(), 1.f / static_cast<float>(K));
  int64_t s_x[2] = {T, H}, s_ids[2] = {T, K};
  DLTensor tx = tensor(x.data(), kDLBfloat, 16, 2, s_x),
           ty = tensor(y.data(), kDLBfloat, 16, 2, s_x),
           ti = tensor(ids.data(), kDLInt, 32, 2, s_ids),
           tw = tensor(weights.data(), kDLFloat, 32, 2, s_ids),
           tdy = tensor(dy.data(), kDLBfloat, 16, 2, s_x), tdx = tensor(dx.data(), kDLBfloat, 16, 2, s_x);
  const kt_arg args[] = {
      {KT_ARG_X, &tx}, {KT_ARG_IDS, &ti}, {KT_ARG_ROUTE_WEIGHTS, &tw}, {KT_ARG_Y, &ty}};
  const kt_arg backward_args[] = {{KT_ARG_DY, &tdy}, {KT_ARG_DX, &tdx}};
  std::printf(
      "A %s (%s)\nB %s (%s)\nlayer E=%lld k=%lld H=%lld I=%lld, %s%s, T=%lld, %d threads, %d %s "
      "per round%s\n",
      o.lib[0].c_str(), api[0].version(), o.lib[1].c_str(), api[1].version(),
      static_cast<long long>(E), static_cast<long long>(K), static_cast<long long>(H),
      static_cast<long long>(I), o.format.c_str(), o.int8 ? "/int8" : "", static_cast<long long>(T),
      o.threads, o.calls,
      R > 0 ? ("LoRA r" + std::to_string(R) +
               " steps (forward + backward: dx, the factors' gradients)")
                  .c_str()
      : o.dx ? "forward + backward (dx) steps"
             : "calls",
      o.pause_us > 0 ? (", " + std::to_string(o.pause_us) + " us pause before each").c_str() : "");
  std::vector<int> perm(static_cast<size_t>(E));
  for (int64_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = static_cast<int>(e);
  // Each library's outputs of the current call.
  std::vector<uint16_t> outs[2][2] = {{y, dx}, {y, dx}};
  const auto bf16_value = [](uint16_t b) {
    const uint32_t u = static_cast<uint32_t>(b) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return static_cast<double>(f);
  };
  for (int round = 0; round < o.rounds; ++round) {
    std::vector<double> t[2];
    std::vector<double> ratio[2];  // B/A of each call, by which library ran first
    int64_t differ = 0, compared = 0;
    double worst = 0;  // largest |B - A| / max(|A|, 1e-30)
    double diff2 = 0, norm2 = 0;  // sums of (B - A)^2 and A^2: the relative L2 difference
    for (int call = 0; call < o.calls; ++call) {
      for (int64_t tok = 0; tok < T;
           ++tok) {  // fresh routing: the experts' weights come from memory
        std::shuffle(perm.begin(), perm.end(), rng);
        for (int64_t j = 0; j < K; ++j)
          ids[static_cast<size_t>(tok * K + j)] = perm[static_cast<size_t>(j)];
      }
      // The libraries take turns at running first: within one process the
      // second of two calls has been seen up to 10 % faster, whichever it was.
      for (int turn = 0; turn < 2; ++turn) {
        const int q = call % 2 == 0 ? turn : 1 - turn;
        if (o.pause_us > 0) std::this_thread::sleep_for(std::chrono::microseconds(o.pause_us));
        const auto t0 = std::chrono::steady_clock::now();
        kt_context* saved = nullptr;
        bool ok = api[q].forward(moe[q], args, 4, o.dx ? &saved : nullptr) == KT_OK;
        if (ok && o.dx) {
          kt_backward_options bo;
          api[q].backward_defaults(&bo, sizeof(bo));
          bo.param_grads = R > 0 ? 1 : 0;
          ok = api[q].backward(moe[q], saved, &bo, backward_args, 2) == KT_OK;
        }
        if (saved) api[q].context_release(saved);
        if (!ok) {
          std::fprintf(stderr, "kt_ab: %s: %s\n", o.lib[q].c_str(), api[q].last_error());
          return 1;
        }
        t[q].push_back(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
        outs[q][0] = y;
        if (o.dx) outs[q][1] = dx;
      }
      ratio[call % 2].push_back(t[1].back() / t[0].back());
      const auto compare = [&](double a, double b, bool same) {
        ++compared;
        const double d = std::abs(b - a);
        norm2 += a * a;
        if (same) return;
        ++differ;
        diff2 += d * d;
        worst = std::max(worst, d / std::max(std::abs(a), 1e-30));
      };
      for (int i = 0; i < (o.dx ? 2 : 1); ++i)
        for (size_t j = 0; j < outs[0][i].size(); ++j) {
          const uint16_t av = outs[0][i][j], bv = outs[1][i][j];
          compare(bf16_value(av), bf16_value(bv), av == bv);
        }
      if (R > 0 && call == o.calls - 1)  // the last step's gradients (each call overwrites them)
        for (int f = 0; f < 6; ++f)
          for (size_t j = 0; j < grads[0][f].size(); ++j) {
            const float av = grads[0][f][j], bv = grads[1][f][j];
            compare(av, bv, std::memcmp(&av, &bv, sizeof(float)) == 0);
          }
    }
    const auto median = [](std::vector<double>& v) {
      std::sort(v.begin(), v.end());
      return v.empty() ? 0.0 : v[v.size() / 2];
    };
    const double a = median(t[0]), b = median(t[1]);
    std::printf("round %d: A %.3f ms  B %.3f ms  B/A %.3f (A first %.3f, B first %.3f)", round + 1,
                a * 1e3, b * 1e3, b / a, median(ratio[0]), median(ratio[1]));
    if (differ == 0) {
      std::printf("  outputs: the same bits\n");
    } else {
      std::printf(
          "  outputs: %lld of %lld values differ (relative L2 %.2e, largest |B-A|/|A| %.2e)\n",
          static_cast<long long>(differ), static_cast<long long>(compared),
          std::sqrt(diff2 / std::max(norm2, 1e-300)), worst);
    }
  }
  for (int q = 0; q < 2; ++q) {
    api[q].moe_destroy(moe[q]);
    api[q].engine_destroy(engine[q]);
  }
  return 0;
}
