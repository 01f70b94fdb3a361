#include "optimizer_bench.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <new>
#include <thread>

#include "bench_common.h"
#include "kt_runner.h"
#include "torch_runner.h"
#include "workload.h"

namespace kt_bench {
namespace {

void fill(HostTensor& t, Rng& rng, float scale) {
  float* p = t.f32();
  for (int64_t i = 0; i < t.numel(); ++i) p[i] = scale * rng.normal();
}

std::vector<std::vector<int64_t>> weight_shapes(const ModelShape& s, int64_t experts) {
  return {{experts, s.intermediate, s.hidden}, {experts, s.intermediate, s.hidden}, {experts, s.hidden, s.intermediate}};
}

// kt_optimizer_step over fp32 host tensors shaped like the layer's weights.
double time_plain_step(kt_engine* engine, const ModelShape& shape, int64_t experts, int warmup, int reps,
                       std::string* error) {
  Rng rng(11);
  std::vector<HostTensor> params, grads;
  std::vector<kt_optimizer_param> pairs;
  for (const std::vector<int64_t>& dims : weight_shapes(shape, experts)) {
    params.emplace_back(kDLFloat, 32, dims);
    grads.emplace_back(kDLFloat, 32, dims);
    fill(params.back(), rng, 0.02f);
    fill(grads.back(), rng, 1e-3f);
  }
  for (size_t i = 0; i < params.size(); ++i) pairs.push_back({params[i].dl(), grads[i].dl()});
  kt_optimizer* opt = nullptr;
  kt_status st = kt_optimizer_create(engine, nullptr, pairs.data(), pairs.size(), &opt);
  if (st != KT_OK) {
    *error = kt_error("kt_optimizer_create", st);
    return -1;
  }
  const double s = median_seconds(warmup, reps, [&](int) {
    st = kt_optimizer_step(opt, nullptr);
    if (st != KT_OK) *error = kt_error("kt_optimizer_step", st);
    return st == KT_OK;
  });
  kt_optimizer_destroy(opt);
  return s;
}

// A full-mode layer with the host's bf16 weights bound: the optimizer keeps
// fp32 masters and each step writes the bf16 copy and the packed panels.
// Also times kt_moe_params_changed, the repack a host optimizer would need.
bool time_layer_step(kt_engine* engine, const LayerWeights& layer, int warmup, int reps, OptimizerRow* row) {
  const ModelShape& s = layer.shape;
  kt_moe_options options;
  kt_moe_options_init(&options);
  options.num_experts = layer.experts;
  options.top_k = s.top_k;
  options.hidden = s.hidden;
  options.intermediate = s.intermediate;
  options.max_tokens = 16;
  options.mode = KT_MODE_FULL;
  kt_moe* moe = nullptr;
  kt_status st = kt_moe_create(engine, &options, &moe);
  if (st != KT_OK) {
    row->error = kt_error("kt_moe_create", st);
    return false;
  }
  Rng rng(13);
  std::vector<HostTensor> grads;
  for (const std::vector<int64_t>& dims : weight_shapes(s, layer.experts)) {
    grads.emplace_back(kDLFloat, 32, dims);
    fill(grads.back(), rng, 1e-3f);
  }
  const kt_arg args[] = {{KT_ARG_W_GATE, layer.gate.dl()},   {KT_ARG_W_UP, layer.up.dl()},
                         {KT_ARG_W_DOWN, layer.down.dl()},   {KT_ARG_GRAD_W_GATE, grads[0].dl()},
                         {KT_ARG_GRAD_W_UP, grads[1].dl()},  {KT_ARG_GRAD_W_DOWN, grads[2].dl()}};
  kt_optimizer* opt = nullptr;
  const char* call = "kt_moe_load_weights";
  st = kt_moe_load_weights(moe, nullptr, args, 3);
  if (st == KT_OK) {
    call = "kt_moe_bind";
    st = kt_moe_bind(moe, args, 6);
  }
  if (st == KT_OK) {
    call = "kt_optimizer_create_for_layer";
    st = kt_optimizer_create_for_layer(moe, nullptr, &opt);
  }
  if (st == KT_OK) {
    row->kt_layer_s = median_seconds(warmup, reps, [&](int) {
      st = kt_optimizer_step(opt, nullptr);
      call = "kt_optimizer_step";
      return st == KT_OK;
    });
  }
  if (st == KT_OK) {
    row->repack_s = median_seconds(warmup, reps, [&](int) {
      st = kt_moe_params_changed(moe);
      call = "kt_moe_params_changed";
      return st == KT_OK;
    });
  }
  if (st != KT_OK) row->error = kt_error(call, st);
  kt_optimizer_destroy(opt);
  kt_moe_destroy(moe);
  return st == KT_OK;
}


// The traffic of an fp32 AdamW step with none of its arithmetic: reads p,
// g, m, v and writes p, m, v in place, 28 bytes per element, on `threads`
// threads (as optim_peers.py's stream). A plain read reaches about half
// this rate on the 2-core VMs, so it is no floor for a step that writes.
// The arrays lie in transparent huge pages where the OS gives them, as kt's
// own state does (core/buffer.h; on a VM a 4 KiB page costs a nested page
// walk, and hardware prefetchers stop at page ends), with their starts a few
// cache lines apart so the four streams do not share cache sets: the best
// case of this traffic, which a floor must be.
class AdamwStream {
 public:
  AdamwStream(int64_t n, int threads) : n_(n), threads_(std::max(threads, 1)) {
    float** arrays[4] = {&p_, &g_, &m_, &v_};
    const size_t huge = size_t{2} << 20;
    const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 4 * 1024 + huge - 1) / huge * huge;
    for (int a = 0; a < 4; ++a) {
      void* raw = std::aligned_alloc(huge, bytes);
      if (!raw) throw std::bad_alloc();
      madvise(raw, bytes, MADV_HUGEPAGE);
      blocks_[a] = raw;
      *arrays[a] = static_cast<float*>(raw) + 16 * 5 * a;  // 320 bytes apart
      std::fill(*arrays[a], *arrays[a] + n, a == 1 ? 1e-3f : 0.f);
    }
  }
  ~AdamwStream() {
    for (void* b : blocks_) std::free(b);
  }
  AdamwStream(const AdamwStream&) = delete;
  AdamwStream& operator=(const AdamwStream&) = delete;
  double seconds() {
    const double start = now_seconds();
    std::vector<std::thread> workers;
    for (int t = 0; t < threads_; ++t)
      workers.emplace_back([this, t] {
        // Distinct arrays: restrict lets the compiler vectorise the loop (a
        // scalar one is bound by its instructions, not by the memory).
        float* __restrict__ p = p_;
        const float* __restrict__ g = g_;
        float* __restrict__ m = m_;
        float* __restrict__ v = v_;
        // Chunks of 32 Ki elements dealt round-robin, as kt's step hands out
        // its chunks: the threads stream neighbouring addresses (two halves,
        // one a thread, read 20-25 % slower here).
        constexpr int64_t kChunk = int64_t{1} << 15;
        for (int64_t b = t * kChunk; b < n_; b += threads_ * kChunk) {
          const int64_t e = std::min(n_, b + kChunk);
          for (int64_t i = b; i < e; ++i) {
            const float gi = g[i];
            m[i] = 0.5f * m[i] + gi;
            v[i] = 0.5f * v[i] + gi;
            p[i] = 0.5f * p[i] + gi;
          }
        }
      });
    for (std::thread& w : workers) w.join();
    return now_seconds() - start;
  }

 private:
  int64_t n_;
  int threads_;
  float *p_ = nullptr, *g_ = nullptr, *m_ = nullptr, *v_ = nullptr;
  void* blocks_[4] = {nullptr, nullptr, nullptr, nullptr};
};

double median_of(std::vector<double> v) {
  if (v.empty()) return -1;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// kt_optimizer_step and DeepSpeed's CPU Adam on the same tensors (written
// to o.peer_dir for it, before either has stepped), a step of each per
// round, taking turns at going first: the two see the machine in the same
// state. kt steps twice a round, with its default check of every gradient
// and with assume_finite (a host that checked them: one pass).
// Hyperparameters: kt's defaults (lr 1e-3, betas 0.9/0.999, eps 1e-8,
// weight decay 1e-2), which DeepSpeed is given.
void time_beside_deepspeed(kt_engine* engine, const OptimizerBenchOptions& o, int64_t experts, OptimizerRow* row,
                           OptimizerReport* rep) {
  Rng rng(11);
  std::vector<HostTensor> params, grads;
  std::vector<kt_optimizer_param> pairs;
  Fields load{{"cmd", "adam_load"}, {"dir", o.peer_dir}, {"lr", "0.001"}, {"wd", "0.01"}};
  int index = 0;
  for (const std::vector<int64_t>& dims : weight_shapes(o.shape, experts)) {
    params.emplace_back(kDLFloat, 32, dims);
    grads.emplace_back(kDLFloat, 32, dims);
    fill(params.back(), rng, 0.02f);
    fill(grads.back(), rng, 1e-3f);
    std::string shape;
    for (int64_t d : dims) shape += (shape.empty() ? "" : "x") + std::to_string(d);
    load["shape_" + std::to_string(index)] = shape;
    const std::string i = std::to_string(index++);
    std::ofstream p(o.peer_dir + "/p_" + i + ".f32", std::ios::binary), g(o.peer_dir + "/g_" + i + ".f32", std::ios::binary);
    p.write(static_cast<const char*>(params.back().dl()->data), params.back().numel() * 4);
    g.write(static_cast<const char*>(grads.back().dl()->data), grads.back().numel() * 4);
    if (!p || !g) {
      rep->deepspeed_reason = "cannot write the tensors to " + o.peer_dir;
      return;
    }
  }
  load["count"] = std::to_string(index);
  std::fprintf(stderr, "kt_bench: optimizer: DeepSpeedCPUAdam on the same tensors (its op is built on first use)\n");
  Fields reply;
  std::string error;
  const bool asked = o.peer->ask(load, &reply, &error);
  for (int i = 0; i < index; ++i) {
    std::remove((o.peer_dir + "/p_" + std::to_string(i) + ".f32").c_str());
    std::remove((o.peer_dir + "/g_" + std::to_string(i) + ".f32").c_str());
  }
  if (!asked || !reply.count("ok")) {
    rep->deepspeed_reason = asked ? reply["reason"] : error;
    return;
  }
  rep->deepspeed_flags = reply["build_flags"];
  for (size_t i = 0; i < params.size(); ++i) pairs.push_back({params[i].dl(), grads[i].dl()});
  kt_optimizer* opt = nullptr;
  kt_status st = kt_optimizer_create(engine, nullptr, pairs.data(), pairs.size(), &opt);
  if (st != KT_OK) {
    row->error = kt_error("kt_optimizer_create", st);
    return;
  }
  AdamwStream stream(static_cast<int64_t>(row->params), o.threads);
  kt_optimizer_options checked, assumed;
  kt_optimizer_options_init(&checked);
  kt_optimizer_get_options(opt, &checked);
  assumed = checked;
  assumed.assume_finite = 1;
  std::vector<double> kt_times, kt_assumed_times, ds_times, ratios, assumed_ratios, floors;
  for (int i = 0; i < o.warmup + o.reps; ++i) {
    double t_kt = -1, t_kt_assumed = -1, t_ds = -1;
    const auto kt_one = [&](const kt_optimizer_options& options, double* t) {
      st = kt_optimizer_set_options(opt, &options);
      if (st != KT_OK) return false;
      const double start = now_seconds();
      st = kt_optimizer_step(opt, nullptr);
      *t = now_seconds() - start;
      return st == KT_OK;
    };
    // Both of kt's steps, taking turns at going first.
    const auto kt_step = [&] {
      return i / 2 % 2 ? kt_one(assumed, &t_kt_assumed) && kt_one(checked, &t_kt)
                       : kt_one(checked, &t_kt) && kt_one(assumed, &t_kt_assumed);
    };
    const auto ds_step = [&] {
      usleep(kPeerGapUs);  // after kt's workers, and before kt's next step after DeepSpeed's
      t_ds = o.peer->seconds_of({{"cmd", "adam_step"}}, &error);
      usleep(kPeerGapUs);
      return t_ds >= 0;
    };
    // kt's step, DeepSpeed's, then the stream, each after the other's
    // workers have gone idle; kt and DeepSpeed take turns at going first.
    const bool ok = i % 2 ? (ds_step() && kt_step() && usleep(kPeerGapUs) == 0) : (kt_step() && ds_step());
    if (!ok) {
      if (st != KT_OK) row->error = kt_error("kt_optimizer_step", st);
      else rep->deepspeed_reason = "DeepSpeedCPUAdam failed: " + error;
      kt_optimizer_destroy(opt);
      return;
    }
    const double t_floor = stream.seconds();  // the gap after DeepSpeed's step is behind
    if (i < o.warmup) continue;
    floors.push_back(t_floor);
    kt_times.push_back(t_kt);
    kt_assumed_times.push_back(t_kt_assumed);
    ds_times.push_back(t_ds);
    ratios.push_back(t_ds / t_kt);
    assumed_ratios.push_back(t_ds / t_kt_assumed);
  }
  kt_optimizer_destroy(opt);
  o.peer->ask({{"cmd", "adam_free"}}, &reply, &error);
  row->kt_beside_deepspeed_s = median_of(kt_times);
  row->deepspeed_s = median_of(ds_times);
  row->deepspeed_ratio = median_of(ratios);
  row->floor_beside_s = median_of(floors);
  row->kt_assume_finite_beside_s = median_of(kt_assumed_times);
  row->deepspeed_ratio_assume_finite = median_of(assumed_ratios);
  const double count = static_cast<double>(row->params), floor = row->floor_beside_s;
  std::fprintf(stderr,
               "kt_bench: optimizer: %lld experts, the same rounds (medians): floor %.2f ms; kt %.2f ms (%.0f %% of "
               "the floor, x DeepSpeed %.2f, pair %.2f); kt assume_finite %.2f ms (%.0f %%, x DeepSpeed %.2f, pair "
               "%.2f); DeepSpeed %.2f ms (%.0f %%); Gparam/s %.3f / %.3f / %.3f\n",
               static_cast<long long>(row->experts), floor * 1e3, row->kt_beside_deepspeed_s * 1e3,
               100 * floor / row->kt_beside_deepspeed_s, row->deepspeed_s / row->kt_beside_deepspeed_s,
               row->deepspeed_ratio, row->kt_assume_finite_beside_s * 1e3, 100 * floor / row->kt_assume_finite_beside_s,
               row->deepspeed_s / row->kt_assume_finite_beside_s, row->deepspeed_ratio_assume_finite,
               row->deepspeed_s * 1e3, 100 * floor / row->deepspeed_s, count / row->kt_beside_deepspeed_s / 1e9,
               count / row->kt_assume_finite_beside_s / 1e9, count / row->deepspeed_s / 1e9);
}

}  // namespace

OptimizerReport run_optimizer_bench(kt_engine* engine, const OptimizerBenchOptions& o, const std::string& torch_reason) {
  OptimizerReport rep;
  rep.shape = o.shape;
  rep.tokens = o.tokens;
  const int64_t per_expert = 3 * o.shape.hidden * o.shape.intermediate;
  std::vector<int64_t> expert_counts;
  for (int64_t n : o.param_counts) {
    // A layer needs at least top_k experts.
    const int64_t e = std::max<int64_t>(o.shape.top_k, (n + per_expert / 2) / per_expert);
    if (std::find(expert_counts.begin(), expert_counts.end(), e) == expert_counts.end()) expert_counts.push_back(e);
  }
  if (o.peer && o.peer->ok()) {
    rep.deepspeed_version = o.peer->said("deepspeed");
    if (rep.deepspeed_version.empty()) rep.deepspeed_reason = o.peer->said("deepspeed_reason");
  }
  for (int64_t e : expert_counts) {
    OptimizerRow row;
    row.experts = e;
    row.params = e * per_expert;
    std::fprintf(stderr, "kt_bench: optimizer: %lld experts of %s (%.1f M params)\n", static_cast<long long>(e),
                 o.shape.name, static_cast<double>(row.params) / 1e6);
    std::string error;
    row.kt_plain_s = time_plain_step(engine, o.shape, e, o.warmup, o.reps, &error);
    if (row.kt_plain_s < 0) row.error = error;
    const LayerWeights layer = make_layer_weights(o.shape, e, 42);
    if (time_layer_step(engine, layer, o.warmup, o.reps, &row)) {
      // The rest of a full fine-tune step on the same layer: routes to the
      // model's other experts are dropped, so the forward and backward cost
      // scales with the experts held, as the optimizer's does.
      KtRunner kt(engine, layer, o.tokens);
      const Workload work = make_workload(layer, o.tokens, 2024);
      row.fwd_bwd_s = kt.time_case(Case::kTrainFull, work, o.warmup, o.reps, &error);
      if (row.fwd_bwd_s < 0) row.error = error;
    }
    if (!rep.deepspeed_version.empty() && rep.deepspeed_reason.empty()) time_beside_deepspeed(engine, o, e, &row, &rep);
    rep.rows.push_back(row);
  }
  if (!o.peer) {
    rep.deepspeed_reason = "no peers' interpreter (--no-peers)";
  } else if (!o.peer->ok()) {
    rep.deepspeed_reason = o.peer->reason();
  }
  if (!o.torch) {
    rep.torch_reason = "skipped (--no-torch)";
  } else if (!torch_reason.empty()) {
    rep.torch_reason = torch_reason;
  } else {
    std::fprintf(stderr, "kt_bench: optimizer: torch.optim.AdamW\n");
    TorchRun run = run_torch_optimizer_baseline(o.python, o.torch_script, o.shape, expert_counts, o.threads, o.warmup,
                                                o.reps);
    rep.torch_version = run.version;
    rep.torch_threads = run.threads;
    rep.torch_reason = run.reason;
    for (OptimizerRow& row : rep.rows) {
      const auto forloop = run.seconds.find({"adamw_forloop", row.experts});
      const auto foreach_ = run.seconds.find({"adamw_foreach", row.experts});
      if (forloop != run.seconds.end()) row.torch_forloop_s = forloop->second;
      if (foreach_ != run.seconds.end()) row.torch_foreach_s = foreach_->second;
      const auto failed = run.errors.find({"adamw_forloop", row.experts});
      if (failed != run.errors.end() && rep.torch_reason.empty()) rep.torch_reason = failed->second;
    }
  }
  return rep;
}

}  // namespace kt_bench
