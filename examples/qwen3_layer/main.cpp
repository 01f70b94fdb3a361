// kt's main job on a built-in default: one synthetic Qwen3-30B-A3B MoE layer
// (128 experts, top-8, hidden 2048, expert intermediate 768, bf16 weights).
// Creates an engine, loads the layer, runs inference (decode and prefill
// sizes) and a LoRA training step (forward + backward), checks every result
// against the double-precision reference, and prints timings.
//
//   kt_qwen3_layer [--experts N] [--threads N] [--tokens T] [--reps N]
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "kt_c_api.h"
#include "moe/reference.h"

namespace {

// The default shape: Qwen3-30B-A3B's routed experts.
struct Shape {
  int64_t E = 128, K = 8, H = 2048, I = 768;
};

uint16_t to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float from_bf16(uint16_t b) {
  uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// Deterministic, fast pseudo-normal numbers (sum of uniforms).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float normal() {
    const uint64_t r = next();
    float acc = 0;
    for (int i = 0; i < 4; ++i) acc += static_cast<float>((r >> (16 * i)) & 0xffff) / 65535.f;
    return (acc - 2.f) * 1.7320508f;  // variance 1
  }
};

struct Tensor {
  std::vector<uint8_t> bytes;
  std::vector<int64_t> shape;
  DLTensor t{};
  Tensor(DLDataTypeCode code, int bits, std::vector<int64_t> s) : shape(std::move(s)) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    bytes.assign(static_cast<size_t>(n * bits / 8), 0);
    t.data = bytes.data();
    t.device = {kDLCPU, 0};
    t.ndim = static_cast<int>(shape.size());
    t.dtype = {static_cast<uint8_t>(code), static_cast<uint8_t>(bits), 1};
    t.shape = shape.data();
  }
  uint16_t* u16() { return reinterpret_cast<uint16_t*>(bytes.data()); }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
  int32_t* i32() { return reinterpret_cast<int32_t*>(bytes.data()); }
};

bool ok(kt_status s, const char* what) {
  if (s == KT_OK) return true;
  std::fprintf(stderr, "kt: %s failed: %s: %s\n", what, kt_status_string(s), kt_last_error());
  return false;
}

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

double rel_l2(const std::vector<double>& got, const std::vector<double>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size(); ++i) {
    num += (got[i] - ref[i]) * (got[i] - ref[i]);
    den += ref[i] * ref[i];
  }
  return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

struct Batch {
  int64_t T;
  Tensor x, ids, w, y, dy, dx, dw;
  Batch(const Shape& s, int64_t T_, uint64_t seed)
      : T(T_), x(kDLBfloat, 16, {T_, s.H}), ids(kDLInt, 32, {T_, s.K}), w(kDLFloat, 32, {T_, s.K}),
        y(kDLBfloat, 16, {T_, s.H}), dy(kDLFloat, 32, {T_, s.H}), dx(kDLBfloat, 16, {T_, s.H}),
        dw(kDLFloat, 32, {T_, s.K}) {
    Rng rng(seed);
    for (int64_t i = 0; i < T * s.H; ++i) {
      x.u16()[i] = to_bf16(rng.normal());
      // The loss gradient as a host computes it: fp32, not bf16-representable
      // (kt rounds it where its kernels take bf16 operands; the reference
      // below uses these exact values, so that rounding counts as error).
      dy.f32()[i] = rng.normal();
    }
    for (int64_t t = 0; t < T; ++t) {
      // k distinct experts per token, weights normalised like a softmax top-k.
      std::vector<int32_t> chosen;
      while (static_cast<int64_t>(chosen.size()) < s.K) {
        const int32_t e = static_cast<int32_t>(rng.next() % static_cast<uint64_t>(s.E));
        if (std::find(chosen.begin(), chosen.end(), e) == chosen.end()) chosen.push_back(e);
      }
      float sum = 0;
      for (int64_t j = 0; j < s.K; ++j) sum += (w.f32()[t * s.K + j] = 0.2f + static_cast<float>(rng.next() % 1000) / 1000.f);
      for (int64_t j = 0; j < s.K; ++j) {
        ids.i32()[t * s.K + j] = chosen[static_cast<size_t>(j)];
        w.f32()[t * s.K + j] /= sum;
      }
    }
  }
  std::vector<kt_arg> forward_args() {
    return {{KT_ARG_X, &x.t}, {KT_ARG_IDS, &ids.t}, {KT_ARG_ROUTE_WEIGHTS, &w.t}, {KT_ARG_Y, &y.t}};
  }
  std::vector<kt_arg> backward_args() { return {{KT_ARG_DY, &dy.t}, {KT_ARG_DX, &dx.t}, {KT_ARG_DROUTE_WEIGHTS, &dw.t}}; }
};

std::vector<double> values(Tensor& t, int64_t n) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    v[static_cast<size_t>(i)] = t.t.dtype.code == kDLBfloat ? from_bf16(t.u16()[i]) : t.f32()[i];
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  Shape s;
  int threads = 0, reps = 5;
  int64_t train_tokens = 256;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i];
    const long v = std::atol(argv[i + 1]);
    if (a == "--experts") s.E = v;
    else if (a == "--threads") threads = static_cast<int>(v);
    else if (a == "--tokens") train_tokens = v;
    else if (a == "--reps") reps = static_cast<int>(v);
    else {
      std::fprintf(stderr, "usage: %s [--experts N] [--threads N] [--tokens T] [--reps N]\n", argv[0]);
      return 2;
    }
  }
  if (s.E < s.K || reps < 1 || train_tokens < 8) {
    std::fprintf(stderr, "need experts >= 8, reps >= 1, tokens >= 8\n");
    return 2;
  }
  std::printf("kt %s (abi %d) — %s\n", kt_version(), kt_abi_version(), kt_build_info());
  if (kt_abi_version() != KT_ABI_VERSION) return 1;

  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = threads;
  kt_engine* engine = nullptr;
  if (!ok(kt_engine_create(&eo, &engine), "kt_engine_create")) return 1;
  kt_engine_info info;
  info.struct_size = sizeof(info);
  kt_engine_get_info(engine, &info);
  std::printf("engine: cpu isa %s, kernels %s (%s), %d threads\n", kt_isa_name(info.cpu_isa),
              kt_isa_name(info.isa), info.kernel_name, info.num_threads);
  std::printf("layer: Qwen3-30B-A3B routed experts, E=%lld k=%lld H=%lld I=%lld, bf16 weights (%.2f GB)\n",
              static_cast<long long>(s.E), static_cast<long long>(s.K), static_cast<long long>(s.H),
              static_cast<long long>(s.I), 3.0 * s.E * s.H * s.I * 2 / 1e9);

  // Synthetic bf16 weights, scaled 1/sqrt(fan_in) like a trained layer.
  double t0 = now();
  Tensor wg(kDLBfloat, 16, {s.E, s.I, s.H}), wu(kDLBfloat, 16, {s.E, s.I, s.H}), wd(kDLBfloat, 16, {s.E, s.H, s.I});
  {
    // One generator per expert, experts spread over a few host threads.
    const float sh = 1.f / std::sqrt(static_cast<float>(s.H)), si = 1.f / std::sqrt(static_cast<float>(s.I));
    const int64_t per = s.I * s.H;
    auto fill = [&](int64_t e0, int64_t step) {
      for (int64_t e = e0; e < s.E; e += step) {
        Rng rng(42 + static_cast<uint64_t>(e));
        for (int64_t i = e * per; i < (e + 1) * per; ++i) {
          wg.u16()[i] = to_bf16(sh * rng.normal());
          wu.u16()[i] = to_bf16(sh * rng.normal());
          wd.u16()[i] = to_bf16(si * rng.normal());
        }
      }
    };
    const int64_t n_threads = std::max<int64_t>(1, std::min<int64_t>(8, std::thread::hardware_concurrency()));
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < n_threads; ++t) pool.emplace_back(fill, t, n_threads);
    for (auto& t : pool) t.join();
  }
  const double t_gen = now() - t0;

  const int64_t max_tokens = std::max<int64_t>(512, train_tokens);
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = s.E; mo.top_k = s.K; mo.hidden = s.H; mo.intermediate = s.I;
  mo.max_tokens = max_tokens;
  mo.mode = KT_MODE_LORA; mo.lora_rank = 16; mo.lora_alpha = 32.f;
  kt_moe* moe = nullptr;
  if (!ok(kt_moe_create(engine, &mo, &moe), "kt_moe_create")) return 1;
  kt_arg load[] = {{KT_ARG_W_GATE, &wg.t}, {KT_ARG_W_UP, &wu.t}, {KT_ARG_W_DOWN, &wd.t}};
  t0 = now();
  if (!ok(kt_moe_load_weights(moe, nullptr, load, 3), "kt_moe_load_weights")) return 1;
  const double t_load = now() - t0;
  std::printf("weights: generated in %.2f s, packed by kt in %.2f s (%.2f GB/s)\n", t_gen, t_load,
              3.0 * s.E * s.H * s.I * 2 / 1e9 / t_load);

  // LoRA r=16 on gate/up/down, fp32 parameters and gradient buffers owned here.
  const int64_t r = 16;
  std::vector<std::unique_ptr<Tensor>> lora;
  std::vector<kt_arg> bind;
  Rng lrng(7);
  for (int p = 0; p < 3; ++p) {
    const int64_t in = p == 2 ? s.I : s.H, out = p == 2 ? s.H : s.I;
    lora.emplace_back(new Tensor(kDLFloat, 32, {s.E, r, in}));
    lora.emplace_back(new Tensor(kDLFloat, 32, {s.E, out, r}));
    lora.emplace_back(new Tensor(kDLFloat, 32, {s.E, r, in}));
    lora.emplace_back(new Tensor(kDLFloat, 32, {s.E, out, r}));
    Tensor& A = *lora[lora.size() - 4];
    Tensor& B = *lora[lora.size() - 3];
    for (int64_t i = 0; i < s.E * r * in; ++i) A.f32()[i] = lrng.normal() / std::sqrt(static_cast<float>(in));
    // B starts at zero in PEFT; a trained adapter is non-zero, which the check needs.
    for (int64_t i = 0; i < s.E * out * r; ++i) B.f32()[i] = 0.02f * lrng.normal();
    bind.push_back({KT_ARG_LORA_A_GATE + 2 * p, &A.t});
    bind.push_back({KT_ARG_LORA_B_GATE + 2 * p, &B.t});
    bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, &lora[lora.size() - 2]->t});
    bind.push_back({KT_ARG_GRAD_LORA_B_GATE + 2 * p, &lora[lora.size() - 1]->t});
  }
  if (!ok(kt_moe_bind(moe, bind.data(), bind.size()), "kt_moe_bind")) return 1;

  // ---- correctness: a small batch against the double-precision reference.
  Batch check(s, 6, 99);
  kt_context* ctx = nullptr;
  auto fa = check.forward_args();
  auto ba = check.backward_args();
  if (!ok(kt_moe_forward(moe, fa.data(), fa.size(), &ctx), "kt_moe_forward")) return 1;
  if (!ok(kt_moe_backward(moe, ctx, nullptr, ba.data(), ba.size()), "kt_moe_backward")) return 1;
  kt_context_release(ctx);
  {
    // The reference over just the experts this batch touches.
    std::map<int32_t, int64_t> local;
    for (int64_t i = 0; i < check.T * s.K; ++i) local.emplace(check.ids.i32()[i], 0);
    int64_t n = 0;
    for (auto& kv : local) kv.second = n++;
    kt::reference::Spec spec;
    spec.E = n; spec.K = s.K; spec.H = s.H; spec.I = s.I;
    spec.rank = r;
    float scale = 0;
    kt_moe_lora_scale(moe, &scale);
    spec.lora_scale = scale;
    kt::reference::Params P;
    Tensor* W[3] = {&wg, &wu, &wd};
    for (int p = 0; p < 3; ++p) {
      const int64_t in = p == 2 ? s.I : s.H, out = p == 2 ? s.H : s.I;
      for (auto& kv : local) {
        const int64_t e = kv.first;
        for (int64_t i = 0; i < out * in; ++i) P.w[p].push_back(from_bf16(W[p]->u16()[e * out * in + i]));
        P.la[p].insert(P.la[p].end(), lora[static_cast<size_t>(4 * p)]->f32() + e * r * in,
                       lora[static_cast<size_t>(4 * p)]->f32() + (e + 1) * r * in);
        P.lb[p].insert(P.lb[p].end(), lora[static_cast<size_t>(4 * p + 1)]->f32() + e * out * r,
                       lora[static_cast<size_t>(4 * p + 1)]->f32() + (e + 1) * out * r);
      }
    }
    std::vector<int64_t> ids;
    for (int64_t i = 0; i < check.T * s.K; ++i) ids.push_back(local[check.ids.i32()[i]]);
    const std::vector<double> x = values(check.x, check.T * s.H), w = values(check.w, check.T * s.K),
                              dy = values(check.dy, check.T * s.H);
    const std::vector<double> y = kt::reference::forward(spec, P, check.T, x, ids, w);
    const kt::reference::Grads g = kt::reference::backward(spec, P, check.T, x, ids, w, dy);
    // The six LoRA gradients of the touched experts, in the reference's local
    // order; the largest error is reported.
    double e_lora = 0;
    for (int p = 0; p < 3; ++p) {
      const int64_t in = p == 2 ? s.I : s.H, out = p == 2 ? s.H : s.I;
      for (int b = 0; b < 2; ++b) {
        const int64_t n = b ? out * r : r * in;
        const std::vector<double>& ref = b ? g.dlb[p] : g.dla[p];
        std::vector<double> got, want;
        for (auto& kv : local) {
          const float* kt_grad = lora[static_cast<size_t>(4 * p + 2 + b)]->f32() + kv.first * n;
          for (int64_t i = 0; i < n; ++i) {
            got.push_back(kt_grad[i]);
            want.push_back(ref[static_cast<size_t>(kv.second * n + i)]);
          }
        }
        e_lora = std::max(e_lora, rel_l2(got, want));
      }
    }
    const double e_y = rel_l2(values(check.y, check.T * s.H), y);
    const double e_dx = rel_l2(values(check.dx, check.T * s.H), g.dx);
    const double e_dw = rel_l2(values(check.dw, check.T * s.K), g.dw);
    // Bounds of the bf16-operand kernels with bf16 x and an fp32 dy (each
    // operand rounded to bf16 once; tests/unit/tolerances.h gives the reasons).
    const bool pass = e_y <= 3e-3 && e_dx <= 6e-3 && e_dw <= 1e-2 && e_lora <= 6e-3;
    std::printf("check vs double reference (relative L2; bf16 x, fp32 dy): forward %.2e, dx %.2e, "
                "routing grad %.2e, LoRA grads (worst of 6) %.2e  -> %s\n",
                e_y, e_dx, e_dw, e_lora, pass ? "PASS" : "FAIL");
    if (!pass) return 1;
  }

  // ---- timings: medians over reps after a warm-up.
  auto median_time = [&](auto&& fn) {
    fn();
    std::vector<double> ts;
    for (int i = 0; i < reps; ++i) {
      const double a = now();
      fn();
      ts.push_back(now() - a);
    }
    std::sort(ts.begin(), ts.end());
    return ts[ts.size() / 2];
  };
  const double flops_per_route = 2.0 * 3 * s.H * s.I;
  std::printf("\n%-34s %10s %12s\n", "run", "ms", "GFLOP/s");
  for (int64_t T : {int64_t{1}, int64_t{32}, int64_t{512}}) {
    if (T > max_tokens) continue;
    std::vector<Batch> batches;  // several batches: other experts each time, as in a real model
    for (int i = 0; i < 4; ++i) batches.emplace_back(s, T, 1000 + static_cast<uint64_t>(T) * 10 + static_cast<uint64_t>(i));
    int which = 0;
    const double t = median_time([&] {
      auto a = batches[static_cast<size_t>(which++ % 4)].forward_args();
      ok(kt_moe_forward(moe, a.data(), a.size(), nullptr), "kt_moe_forward");
    });
    char name[64];
    std::snprintf(name, sizeof(name), "inference forward T=%lld", static_cast<long long>(T));
    std::printf("%-34s %10.2f %12.1f\n", name, t * 1e3, flops_per_route * T * s.K / t / 1e9);
  }
  {
    Batch b(s, train_tokens, 5);
    auto a = b.forward_args();
    auto bb = b.backward_args();
    const double t = median_time([&] {
      kt_context* c = nullptr;
      ok(kt_moe_forward(moe, a.data(), a.size(), &c), "kt_moe_forward");
      ok(kt_moe_backward(moe, c, nullptr, bb.data(), bb.size()), "kt_moe_backward");
      kt_context_release(c);
    });
    // Useful FLOPs: forward + dx (2x forward), LoRA r=16 excluded.
    char name[64];
    std::snprintf(name, sizeof(name), "LoRA r=16 train step T=%lld", static_cast<long long>(train_tokens));
    std::printf("%-34s %10.2f %12.1f\n", name, t * 1e3, 3 * flops_per_route * train_tokens * s.K / t / 1e9);
  }
  kt_moe_destroy(moe);
  return ok(kt_engine_destroy(engine), "kt_engine_destroy") ? 0 : 1;
}
