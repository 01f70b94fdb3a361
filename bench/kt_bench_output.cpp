// kt_bench's output: the table (default) and the JSON document (--json).
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
#include "kt_bench.h"
#include "quant_checkpoint.h"

namespace kt_bench {
namespace {

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

// One peer's rows beside kt (its name and its short name in the column
// headings, e.g. "kt-kernel ms", "err kt-k"; the ratio column "x<x_label>").
void print_peer_block(const ModelReport& mr, const std::string& peer, const char* title, const char* label,
                      const char* short_label, const char* x_label) {
  std::printf("   %s:\n"
              "   a call of each per round beside kt's (taking turns; same batches); x: medians, pair: the\n"
              "   median of each round's ratio; err: the relative L2 of y (forward) or dx (training) from the\n"
              "   double-precision reference (first rows of the first batch, from the bf16 weights):\n",
              title);
  std::printf("   %-10s %-5s %-17s %6s %9s %12s %6s %6s %9s %9s\n", "case", short_label, "kt layer", "T", "kt ms",
              (std::string(label) + " ms").c_str(), (std::string("x") + x_label).c_str(), "pair", "err kt",
              (std::string("err ") + short_label).c_str());
  const std::string* last_note = nullptr;
  for (const PeerRow& r : mr.peer_rows) {
    if (r.peer != peer) continue;
    std::printf("   %-10s %-5s %-17s %6lld %9s %12s %6s %6s %9s %9s\n", case_key(r.which), r.variant.c_str(),
                r.kt_format.c_str(), static_cast<long long>(r.tokens), fmt("%.3f", r.kt_s * 1e3).c_str(),
                fmt("%.3f", r.peer_s * 1e3).c_str(), fmt("%.2f", r.peer_s / r.kt_s).c_str(),
                fmt("%.2f", r.ratio).c_str(), fmt("%.1e", r.kt_rel_l2).c_str(), fmt("%.1e", r.peer_rel_l2).c_str());
    if (!r.note.empty() && (!last_note || *last_note != r.note)) std::printf("      %s\n", r.note.c_str());
    last_note = &r.note;
    if (!r.error.empty()) std::printf("      %s\n", r.error.c_str());
  }
}

// kt-kernel and vLLM beside kt, and torch from the peers' interpreter, per row.
void print_peer_rows(const ModelReport& mr) {
  if (mr.peer_rows.empty() && !mr.torch2.ran) return;
  std::printf("peers on the same layer, routing and inputs (x = peer time / kt time: above 1, kt is faster):\n");
  const auto has = [&](const char* peer) {
    return std::any_of(mr.peer_rows.begin(), mr.peer_rows.end(), [&](const PeerRow& r) { return r.peer == peer; });
  };
  if (has("kt-kernel")) print_peer_block(mr, "kt-kernel", "kt-kernel", "kt-kernel", "kt-k", "");
  if (has("vllm")) {
    const std::string cls = std::find_if(mr.peer_rows.begin(), mr.peer_rows.end(), [](const PeerRow& r) {
                              return r.peer == "vllm";
                            })->peer_class;
    print_peer_block(mr, "vllm", ("vLLM's cpu_fused_moe, " + cls).c_str(), "vLLM", "vLLM", "vLLM");
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

// The run's first lines: kt, the machine's limits, the peers.
void print_header(const Options& o, const Limits& lim, const kt_engine_info& info,
                  const std::vector<PeerEntry>& peers, const std::vector<PeerSkip>& skips) {
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
}

// A model's heading and its rows: kt and its baselines per case and T.
void print_rows(const ModelReport& mr, const Limits& lim) {
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
}

// What follows a model's rows: oneDNN's agreement, kt's profiles, errors
// and the cost fits.
void print_row_notes(const ModelReport& mr) {
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
}

// A model's storage formats beside bf16, row by row.
void print_formats(const Options& o, const ModelReport& mr, const Limits& lim) {
  if (mr.formats.empty()) return;
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

void print_sweep(const ModelReport& mr, const Limits& lim) {
  if (!mr.sweep.empty()) {
    std::printf("   forward at T=%lld vs touched experts:", static_cast<long long>(mr.sweep.front().tokens));
    for (const TouchedRow& t : mr.sweep)
      std::printf("  %lld: %s ms (%s ms/expert, %s%% bw)", static_cast<long long>(t.touched), fmt("%.2f", t.kt_s * 1e3).c_str(),
                  fmt("%.3f", t.kt_s * 1e3 / static_cast<double>(t.touched)).c_str(),
                  fmt("%.0f", 100 * t.bytes / t.kt_s / 1e9 / lim.machine.dram_read_gbs).c_str());
    std::printf("\n");
  }
}

}  // namespace

void print_table(const Options& o, const Limits& lim, const kt_engine_info& info, const std::vector<ModelReport>& models,
                 const OptimizerReport* optimizer, const std::vector<PeerEntry>& peers,
                 const std::vector<PeerSkip>& skips) {
  print_header(o, lim, info, peers, skips);
  for (const ModelReport& mr : models) {
    print_rows(mr, lim);
    print_row_notes(mr);
    print_formats(o, mr, lim);
    print_peer_rows(mr);
    print_sweep(mr, lim);
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

namespace {

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

// "kt" and "machine": the library, its kernels and call overhead; the
// machine's measured limits.
void write_kt_and_machine(JsonWriter& j, const Limits& lim, const kt_engine_info& info) {
  const MachineLimits& m = lim.machine;
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
}

// "settings", "peers" and "peers_skipped".
void write_settings_and_peers(JsonWriter& j, const Options& o, const std::vector<PeerEntry>& peers,
                              const std::vector<PeerSkip>& skips) {
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
}

// A model's "results": kt and its baselines per case and T.
void write_rows(JsonWriter& j, const ModelReport& mr, const Limits& lim) {
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
}

// A model's "linearity": the cost fits and the touched-experts sweep.
void write_linearity(JsonWriter& j, const ModelReport& mr, const Limits& lim) {
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
}

void write_peer_results(JsonWriter& j, const ModelReport& mr) {
  // Peers: kt-kernel and vLLM timed call by call beside kt (timing
  // "alternating"), torch from the peers' interpreter run after kt
  // ("separate").
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
}

// A model's storage formats: their rows, errors and checkpoints.
void write_formats(JsonWriter& j, const ModelReport& mr, const Limits& lim) {
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
}

void write_model(JsonWriter& j, const ModelReport& mr, const Limits& lim) {
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
  write_rows(j, mr, lim);
  write_linearity(j, mr, lim);
  write_peer_results(j, mr);
  write_formats(j, mr, lim);
  j.end_object();
}

}  // namespace

void write_json(const Options& o, const Limits& lim, const kt_engine_info& info, const std::vector<ModelReport>& models,
                const OptimizerReport* optimizer, const std::vector<PeerEntry>& peers,
                const std::vector<PeerSkip>& skips) {
  JsonWriter j;
  j.begin_object();
  write_kt_and_machine(j, lim, info);
  write_settings_and_peers(j, o, peers, skips);
  j.key("models").begin_array();
  for (const ModelReport& mr : models) write_model(j, mr, lim);
  j.end_array();
  if (optimizer) write_optimizer_json(j, *optimizer, lim);
  j.end_object();
  std::printf("%s\n", j.str().c_str());
}

}  // namespace kt_bench
