// kt_bench's cases: kt, its storage formats, oneDNN per expert and torch
// eager on one model's layer, and kt's call overhead.
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
#include "quant_checkpoint.h"

#if KT_BENCH_HAVE_ONEDNN
#include "onednn_baseline.h"
#endif

namespace kt_bench {
std::string onednn_version() {
#if KT_BENCH_HAVE_ONEDNN
  return OneDnnBaseline::version();
#else
  return "";
#endif
}

Floors floors_of(double flops, double bytes, const Limits& lim) {
  return {lim.peak_gflops > 0 ? flops / (lim.peak_gflops * 1e9) : 0,
          lim.machine.dram_read_gbs > 0 ? bytes / (lim.machine.dram_read_gbs * 1e9) : 0};
}

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

namespace {

[[maybe_unused]] double rel_l2(const std::vector<float>& got, const std::vector<float>& ref) {
  double num = 0, den = 0;
  for (size_t i = 0; i < ref.size() && i < got.size(); ++i) {
    const double d = static_cast<double>(got[i]) - ref[i];
    num += d * d;
    den += static_cast<double>(ref[i]) * ref[i];
  }
  return got.size() != ref.size() ? NAN : den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

// kt's profile of a case after its timed calls: the kernels it ran (one
// call; with --profile the stages' times too, over --reps calls).
void profile(KtRunner& kt, Case which, const Workload& work, const Options& o, CaseProfile* out,
             std::string* error) {
  kt.profile_case(which, work, o.profile ? o.reps : 1, out, error);
  if (!o.profile) out->stage_ms.clear();
}

// Whether the case's floor is its bytes rather than its FLOPs (the roofline's
// `*` in the table).
bool memory_bound(double flops, double bytes, const Limits& lim) {
  const Floors f = floors_of(flops, bytes, lim);
  return f.memory > f.compute;
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

Row& row_of(ModelReport* rep, Case c, int64_t T) {
  return *std::find_if(rep->rows.begin(), rep->rows.end(),
                       [&](const Row& r) { return r.which == c && r.tokens == T; });
}

// One row per case and workload, with the counts the rates are taken on.
void make_rows(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o, ModelReport* rep) {
  for (Case c : o.cases) {
    for (const Workload& w : work) {
      Row r;
      r.which = c;
      r.tokens = w.tokens;
      r.routes = w.mean_routes();
      r.touched = w.mean_touched();
      r.flops = case_flops(c, layer.shape, r.routes);
      r.bytes = case_bytes(c, layer, r.touched);
      rep->rows.push_back(r);
    }
  }
}

// The buffer of the plain read timed beside kt's calls, call by call (the
// DRAM bandwidth at that moment, for %rd): the largest read of a
// memory-bound case, and at least 1 GiB and four times the last-level
// cache, so that every read comes from DRAM.
size_t read_buffer_bytes(const ModelReport& rep, const Options& o, const Limits& lim) {
  size_t read_buffer = std::max(o.quick ? size_t{256} << 20 : size_t{1} << 30, 4 * lim.machine.l3_bytes);
  for (const Row& r : rep.rows)
    if (memory_bound(r.flops, r.bytes, lim)) read_buffer = std::max(read_buffer, static_cast<size_t>(r.bytes));
  return read_buffer;
}

// kt's results on a workload's first batch (y for forward, dx for train_dx),
// to check the oneDNN baseline against.
using KtResults = std::map<std::pair<Case, int64_t>, std::vector<float>>;

// kt's bf16 layer on every case and workload; memory-bound ones again beside
// the read.
void bench_kt_rows(KtRunner& kt, const std::vector<Workload>& work, const Options& o, const Limits& lim,
                   StreamReader& reader, ModelReport* rep, KtResults* kt_results) {
  const bool compare_onednn = KT_BENCH_HAVE_ONEDNN && o.onednn;
  for (Case c : o.cases) {
    for (const Workload& w : work) {
      if (!o.json)
        std::fprintf(stderr, "kt_bench: %s: kt %s T=%lld\n", rep->shape.name, case_label(c),
                     static_cast<long long>(w.tokens));
      Row& r = row_of(rep, c, w.tokens);
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
        if (kt.outputs(c, w, &y, &dx, &error)) (*kt_results)[{c, w.tokens}] = c == Case::kForward ? y : dx;
      }
    }
  }
}

// Cost against touched experts at a fixed small T (the weight-streaming regime).
void bench_touched_sweep(KtRunner& kt, const LayerWeights& layer, const Options& o, ModelReport* rep) {
  if (std::find(o.cases.begin(), o.cases.end(), Case::kForward) == o.cases.end()) return;
  const int64_t sweep_tokens = o.quick ? 4 : 16;
  for (int64_t n = layer.shape.top_k; n <= rep->experts_held; n *= 2) {
    const Workload w = make_touched_workload(layer, sweep_tokens, n, 7 + static_cast<uint64_t>(n));
    TouchedRow t;
    t.touched = n;
    t.tokens = sweep_tokens;
    t.bytes = case_bytes(Case::kForward, layer, w.mean_touched());
    std::string error;
    const double s = kt.time_case(Case::kForward, w, o.warmup, o.reps, &error);
    if (s >= 0) t.kt_s = s;
    rep->sweep.push_back(t);
  }
}

// fp8, MXFP4 and asymmetric int4 bases come from checkpoints: the layer's
// weights quantized into one, loaded as a host loads it. Null for the
// formats kt quantizes at load, and where writing failed (with *error).
std::unique_ptr<QuantCheckpoint> format_source(const LayerWeights& layer, kt_weight_format f, const Options& o,
                                               int threads, ModelReport* rep, std::string* error) {
  if (!comes_from_checkpoint(f)) return nullptr;
  if (!o.json)
    std::fprintf(stderr, "kt_bench: %s: writing the weights as a %s checkpoint\n", rep->shape.name,
                 kt_weight_format_name(f));
  std::unique_ptr<QuantCheckpoint> source = QuantCheckpoint::write(layer, f, threads, error);
  if (source) {
    rep->checkpoints.push_back({f, source->file_bytes(), source->write_seconds()});
    if (!o.json)
      std::fprintf(stderr, "kt_bench: %s: %.2f GB written in %.1f s\n", rep->shape.name, source->file_bytes() / 1e9,
                   source->write_seconds());
  }
  return source;
}

// One format's row of case c at w, timed in alternation with the bf16 layer
// and the read of the bytes the format stores.
FormatRow format_row(const FormatChoice& choice, Case c, const Workload& w, const LayerWeights& layer,
                     const Options& o, KtRunner& fmt_kt, KtRunner& bf16, StreamReader& reader, const Row& base,
                     const std::string& source_error) {
  if (!o.json)
    std::fprintf(stderr, "kt_bench: %s: kt %s %s T=%lld\n", layer.shape.name, choice.label().c_str(), case_label(c),
                 static_cast<long long>(w.tokens));
  FormatRow fr;
  fr.choice = choice;
  fr.which = c;
  fr.tokens = w.tokens;
  KtRunner::Alternating s;
  if (source_error.empty()) {
    s = fmt_kt.time_alternating(&bf16, c, w, o.warmup, o.reps, &fr.error, [&] {
      // The layer is made before the first round: its bytes are known.
      const double bytes = base.bytes * fmt_kt.expert_weight_bytes() / layer.bytes_per_expert();
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
  const double weights_per_expert = 3.0 * layer.shape.hidden * layer.shape.intermediate;
  fr.bytes_per_weight = fmt_kt.expert_weight_bytes() / weights_per_expert;
  fr.bytes = base.bytes * fmt_kt.expert_weight_bytes() / layer.bytes_per_expert();
  return fr;
}

// A format's quantization error: W' against the bf16 weights and, with int8
// activations, y against the same base with bf16 activations on the largest
// batch (what int8 activations change in y).
void format_error(const FormatChoice& choice, const LayerWeights& layer, const std::vector<Workload>& work,
                  const Options& o, kt_engine* engine, int64_t max_tokens, KtRunner& fmt_kt,
                  const QuantCheckpoint* source, ModelReport* rep) {
  std::string error;
  FormatError fe{choice, fmt_kt.weight_rel_l2(&error)};
  if (choice.compute == KT_COMPUTE_INT8 && !work.empty() && error.empty()) {
    KtRunner same_base(engine, layer, std::max<int64_t>(max_tokens, 16), choice.format,
                       source ? source->ckpt() : nullptr, QuantCheckpoint::kLayer);
    std::vector<float> y_int8, y_bf16, unused;
    if (fmt_kt.outputs(Case::kForward, work.back(), &y_int8, &unused, &error) &&
        same_base.outputs(Case::kForward, work.back(), &y_bf16, &unused, &error)) {
      fe.activation_rel_l2 = rel_l2(y_int8, y_bf16);
      fe.activation_tokens = work.back().tokens;
    }
  }
  rep->format_errors.push_back(fe);
  if (!error.empty() && !o.json) std::fprintf(stderr, "kt_bench: %s\n", error.c_str());
}

// The same workloads with the base stored in another format, timed in
// alternation with the bf16 layer: the machine's bandwidth and load drift
// over a run (seen here: 37-47 GB/s between runs minutes apart), and a ratio
// of times taken minutes apart carried it.
void bench_format(const FormatChoice& choice, const LayerWeights& layer, const std::vector<Workload>& work,
                  const Options& o, kt_engine* engine, int threads, int64_t max_tokens, KtRunner& bf16,
                  StreamReader& reader, ModelReport* rep) {
  const bool int8 = choice.compute == KT_COMPUTE_INT8;
  std::string source_error;
  const std::unique_ptr<QuantCheckpoint> source = format_source(layer, choice.format, o, threads, rep, &source_error);
  KtRunner fmt_kt(engine, layer, std::max<int64_t>(max_tokens, 16), choice.format, source ? source->ckpt() : nullptr,
                  QuantCheckpoint::kLayer, choice.compute);
  for (Case c : o.cases) {
    // A quantized base is frozen: full-weight training is bf16 only;
    // int8 activations have no backward.
    if (c == Case::kTrainFull || (int8 && c != Case::kForward)) continue;
    for (const Workload& w : work)
      rep->formats.push_back(
          format_row(choice, c, w, layer, o, fmt_kt, bf16, reader, row_of(rep, c, w.tokens), source_error));
    if (c == Case::kForward && source_error.empty())
      format_error(choice, layer, work, o, engine, max_tokens, fmt_kt, source.get(), rep);
  }
  for (const auto& l : fmt_kt.loads()) rep->loads.emplace_back(choice.label() + " " + l.first, l.second);
}

// oneDNN per expert on the cases it supports, checked against kt's results.
void bench_onednn(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o, int threads,
                  const KtResults& kt_results, ModelReport* rep) {
#if KT_BENCH_HAVE_ONEDNN
  if (!o.onednn) {
    rep->onednn_reason = "skipped (--no-onednn)";
    return;
  }
  OneDnnBaseline dnnl(layer, threads);
  for (Case c : o.cases) {
    if (!OneDnnBaseline::supports(c)) continue;
    for (const Workload& w : work) {
      if (!o.json)
        std::fprintf(stderr, "kt_bench: %s: oneDNN %s T=%lld\n", layer.shape.name, case_label(c),
                     static_cast<long long>(w.tokens));
      Row& r = row_of(rep, c, w.tokens);
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
#else
  (void)layer, (void)work, (void)o, (void)threads, (void)kt_results;
  rep->onednn_reason = "not built: oneDNN (find_package(dnnl)) was not found at configure time";
#endif
}

// torch eager from --python and, where it is another torch, from the peers'
// interpreter: the same script, routing and threads.
void bench_torch(const LayerWeights& layer, const std::vector<Workload>& work, const Options& o, int threads,
                 const std::string& torch_reason, PeerProcess* peer, ModelReport* rep) {
  if (!o.torch) {
    rep->torch.reason = "skipped (--no-torch)";
  } else if (!torch_reason.empty()) {
    rep->torch.reason = torch_reason;
  } else {
    if (!o.json) std::fprintf(stderr, "kt_bench: %s: torch eager baseline\n", layer.shape.name);
    rep->torch = run_torch_baseline(o.python, o.torch_script, layer, work, o.cases, threads, o.warmup, o.reps);
    for (Row& r : rep->rows) {
      const auto key = std::make_pair(std::string(case_key(r.which)), r.tokens);
      if (rep->torch.seconds.count(key)) r.torch_s = rep->torch.seconds[key];
      if (rep->torch.errors.count(key)) r.torch_error = rep->torch.errors[key];
    }
  }
  const std::string peer_torch = peer && peer->ok() ? peer->said("torch") : "";
  if (o.torch && !peer_torch.empty() && peer_torch != rep->torch.version) {
    if (!o.json)
      std::fprintf(stderr, "kt_bench: %s: torch %s eager (peers' interpreter)\n", layer.shape.name,
                   peer_torch.c_str());
    rep->torch2 = run_torch_baseline(o.peers_python, o.torch_script, layer, work, o.cases, threads, o.warmup, o.reps);
  }
}

}  // namespace

ModelReport bench_model(const ModelShape& shape, const Options& o, kt_engine* engine, int threads,
                        const Limits& lim, const std::string& torch_reason, PeerProcess* peer, PeerProcess* vllm,
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
  make_rows(layer, work, o, &rep);
  const int64_t max_tokens = *std::max_element(o.tokens.begin(), o.tokens.end());
  KtResults kt_results;
  StreamReader reader(threads, read_buffer_bytes(rep, o, lim), __builtin_cpu_supports("avx2"));
  // kt: one layer per mode, released before the baselines allocate theirs.
  {
    KtRunner bf16(engine, layer, std::max<int64_t>(max_tokens, 16));
    bench_kt_rows(bf16, work, o, lim, reader, &rep, &kt_results);
    bench_touched_sweep(bf16, layer, o, &rep);
    for (const FormatChoice& choice : o.formats)
      bench_format(choice, layer, work, o, engine, threads, max_tokens, bf16, reader, &rep);
    rep.loads.insert(rep.loads.begin(), bf16.loads().begin(), bf16.loads().end());
    // The peers read the layer and batches from peer_dir, written once for both.
    bool layer_written = false;
    if (peer && peer->ok() && !peer->said("kt_kernel").empty())
      bench_kt_kernel(layer, work, o, engine, bf16, std::max<int64_t>(max_tokens, 16), peer, peer_dir,
                      &layer_written, &rep, skips);
    if (vllm && vllm->ok() && !vllm->said("vllm_class").empty())
      bench_vllm(layer, work, o, bf16, std::max<int64_t>(max_tokens, 16), vllm, peer_dir, &layer_written, &rep,
                 skips);
  }
  for (Case c : o.cases) rep.fits[c] = fit_cost(rep.rows, c);
  bench_onednn(layer, work, o, threads, kt_results, &rep);
  bench_torch(layer, work, o, threads, torch_reason, peer, &rep);
  return rep;
}

}  // namespace kt_bench
