// kt_bench's peers: kt-kernel's forward and SFT MoEs and vLLM's CPU fused MoE
// timed call by call beside kt's, both against a double-precision reference,
// and which peers ran.
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

#include "bench_common.h"
#include "kt_bench.h"

namespace kt_bench {
namespace {

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
  if (!peer_error.empty()) r->error = r->peer + ": " + peer_error;
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

// A peer's forward MoE (the moe_* commands of peers_baseline.py) and the kt
// layer it runs beside.
struct ForwardVariant {
  const char* name;
  kt_weight_format kt_format;
  kt_compute compute;
};

// The forward MoEs of peer `name` beside kt's forward, each variant against
// its kt layer (bf16: the layer bf16 runs; a quantized one is made here),
// where the peer loads it, else a skip with its reason; `note`, where not
// empty, is every row's. False when the peer's process is gone.
bool bench_peer_forward(const char* name, const std::vector<ForwardVariant>& variants, const std::string& note,
                        const LayerWeights& layer, const std::vector<Workload>& work, const Options& o,
                        kt_engine* engine, KtRunner& bf16, int64_t max_tokens, PeerProcess* peer,
                        const std::string& peer_dir, ModelReport* rep, std::vector<PeerSkip>* skips) {
  std::string error;
  for (const ForwardVariant& v : variants) {
    Fields reply;
    if (!o.json) std::fprintf(stderr, "kt_bench: %s: %s %s: loading\n", layer.shape.name, name, v.name);
    Fields load = peer_layer_command("moe_load", layer, peer_dir, max_tokens);
    load["peer"] = name;
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
        std::fprintf(stderr, "kt_bench: %s: %s %s forward T=%lld beside kt\n", layer.shape.name, name, v.name,
                     static_cast<long long>(w.tokens));
      PeerRow r;
      r.peer = name;
      r.variant = v.name;
      r.peer_class = reply["class"];
      r.kt_format = std::string(kt_weight_format_name(v.kt_format)) + (v.compute == KT_COMPUTE_INT8 ? "/int8" : "");
      r.which = Case::kForward;
      r.tokens = w.tokens;
      r.note = note;
      time_beside_peer(kt, Case::kForward, w, o, peer,
                       {{"cmd", "moe_call"}, {"peer", name}, {"variant", v.name}, {"T", std::to_string(w.tokens)}},
                       &r);
      // Both against the double-precision reference, first rows of batch 0.
      r.rows_compared = std::min<int64_t>(w.tokens, o.quick ? 2 : 8);
      const std::vector<double> ref = reference_y(layer, w.batches.front(), r.rows_compared);
      std::vector<float> y, unused;
      if (kt.outputs(Case::kForward, w, &y, &unused, &r.error)) r.kt_rel_l2 = rel_l2_to(y.data(), ref);
      r.peer_rel_l2 = peer_output_error(peer, {{"cmd", "moe_output"}, {"peer", name}, {"variant", v.name}},
                                        w.tokens, r.rows_compared, peer_dir + "/y.f32", ref);
      rep->peer_rows.push_back(r);
    }
    peer->ask({{"cmd", "moe_free"}, {"peer", name}, {"variant", v.name}}, &reply, &error);
  }
  return true;
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
  return bench_peer_forward("kt-kernel",
                            {{"bf16", KT_FORMAT_BF16, KT_COMPUTE_BF16},
                             {"int8", KT_FORMAT_INT8_CHANNEL, KT_COMPUTE_INT8},
                             {"int4", KT_FORMAT_INT4_G32, KT_COMPUTE_INT8}},
                            "", layer, work, o, engine, bf16, max_tokens, peer, peer_dir, rep, skips);
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
}  // namespace

void bench_kt_kernel(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o,
                     kt_engine* engine, KtRunner& bf16, int64_t max_tokens, PeerProcess* peer,
                     const std::string& peer_dir, bool* layer_written, ModelReport* rep,
                     std::vector<PeerSkip>* skips) {
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
  *layer_written = *layer_written || write_layer_for_peer(peer_dir, layer, work, &error);
  if (!*layer_written ||
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

void bench_vllm(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o, KtRunner& bf16,
                int64_t max_tokens, PeerProcess* vllm, const std::string& peer_dir, bool* layer_written,
                ModelReport* rep, std::vector<PeerSkip>* skips) {
  const char* name = "vllm";
  for (Case c : o.cases)
    if (c != Case::kForward)
      add_skip(skips, name, case_key(c), "vLLM serves inference: its CPU fused MoE has no backward");
  if (std::find(o.cases.begin(), o.cases.end(), Case::kForward) == o.cases.end()) {
    add_skip(skips, name, "forward", "not in --cases");
    return;
  }
  std::string error;
  *layer_written = *layer_written || write_layer_for_peer(peer_dir, layer, work, &error);
  if (!*layer_written) {
    add_skip(skips, name, "forward", error);
    return;
  }
  // kt skips the routes to experts outside a slice (id -1); vLLM's op has
  // no such route, so peers_baseline.py sends them to expert 0 with weight 0.
  const std::string note = layer.experts < layer.shape.experts
                               ? "a slice: vLLM's op has no dropped route, so the routes kt skips go to expert 0 "
                                 "with weight 0 (more work)"
                               : "";
  bench_peer_forward(name, {{"bf16", KT_FORMAT_BF16, KT_COMPUTE_BF16}}, note, layer, work, o, nullptr, bf16,
                     max_tokens, vllm, peer_dir, rep, skips);
}

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

// Which peers ran, and adds a skip for each one that did not (with why).
namespace {

// Whether the MoE peer `name` ran (a timed row); else adds a skip with why.
bool moe_peer_ran(const std::string& name, const std::vector<ModelReport>& models, std::vector<PeerSkip>* skips) {
  std::string why;
  for (const ModelReport& m : models)
    for (const PeerRow& r : m.peer_rows) {
      if (r.peer != name) continue;
      if (std::isfinite(r.peer_s)) return true;
      if (why.empty() && !r.error.empty()) why = r.error;
    }
  add_skip(skips, name, "all",
           models.empty() ? "no MoE case in --cases"
                          : why.empty() ? "it did not run (see the other " + name + " lines)" : why);
  return false;
}

}  // namespace

std::vector<PeerEntry> summarize_peers(const Options& o, PeerProcess* peer, PeerProcess* vllm,
                                       const std::vector<ModelReport>& models, const OptimizerReport* optimizer,
                                       std::vector<PeerSkip>* skips) {
  std::vector<PeerEntry> ran;
  const bool started = peer && peer->ok();
  const std::string no_peer = !o.peers ? "--no-peers" : !started ? peer->reason() : "";
  // kt-kernel
  if (!started || peer->said("kt_kernel").empty()) {
    add_skip(skips, "kt-kernel", "all", started ? peer->said("kt_kernel_reason") : no_peer);
  } else if (moe_peer_ran("kt-kernel", models, skips)) {
    ran.push_back({"kt-kernel", peer->said("kt_kernel"), o.peers_python, "peer",
                   peer->said("kt_kernel_variant") + " build, int8 kernel: " + peer->said("kt_kernel_int8")});
  }
  // vLLM, from its own interpreter
  if (!o.peers) {
    add_skip(skips, "vllm", "all", "--no-peers");
  } else if (o.vllm_python.empty()) {
    add_skip(skips, "vllm", "all", "no --vllm-python (the interpreter of vLLM's venv) given");
  } else if (!vllm || !vllm->ok()) {
    add_skip(skips, "vllm", "all", vllm ? vllm->reason() : "not started");
  } else if (vllm->said("vllm_class").empty()) {
    const std::string why = vllm->said("vllm_reason");
    add_skip(skips, "vllm", "all", "--vllm-python " + o.vllm_python + ": " + (why.empty() ? "no vLLM" : why));
  } else if (moe_peer_ran("vllm", models, skips)) {
    ran.push_back({"vllm", vllm->said("vllm"), o.vllm_python, "peer",
                   "torch.ops._C.cpu_fused_moe of " + vllm->said("vllm_class") + ", torch " + vllm->said("torch")});
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

}  // namespace kt_bench
