#include "onednn_baseline.h"

#include <omp.h>

#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include <oneapi/dnnl/dnnl.hpp>

namespace kt_bench {

struct OneDnnBaseline::Impl {
  const LayerWeights& layer;
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  // Primitives by (M, N, K, A transposed, B transposed, accumulate): created
  // on first use (during warm-up), reused afterwards.
  std::map<std::tuple<int64_t, int64_t, int64_t, bool, bool, bool>, dnnl::matmul> primitives;

  explicit Impl(const LayerWeights& l) : layer(l) {}

  // C[M,N] (fp32, row-major) = or += A[M,K] * B[K,N], bf16 operands.
  // A is stored [M,K] row-major, or [K,M] when a_transposed; B is stored
  // [K,N], or [N,K] (an nn.Linear weight) when b_transposed.
  void gemm(int64_t M, int64_t N, int64_t K, const uint16_t* A, bool a_transposed, const uint16_t* B,
            bool b_transposed, float* C, bool accumulate) {
    using tag = dnnl::memory::format_tag;
    using dt = dnnl::memory::data_type;
    const dnnl::memory::desc a_md({M, K}, dt::bf16, a_transposed ? tag::ba : tag::ab);
    const dnnl::memory::desc b_md({K, N}, dt::bf16, b_transposed ? tag::ba : tag::ab);
    const dnnl::memory::desc c_md({M, N}, dt::f32, tag::ab);
    const auto key = std::make_tuple(M, N, K, a_transposed, b_transposed, accumulate);
    auto it = primitives.find(key);
    if (it == primitives.end()) {
      dnnl::primitive_attr attr;
      if (accumulate) {
        dnnl::post_ops ops;
        ops.append_sum(1.f);
        attr.set_post_ops(ops);
      }
      const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(a_md, b_md, c_md), attr, engine);
      it = primitives.emplace(key, dnnl::matmul(pd)).first;
    }
    dnnl::memory a(a_md, engine, const_cast<uint16_t*>(A));
    dnnl::memory b(b_md, engine, const_cast<uint16_t*>(B));
    dnnl::memory c(c_md, engine, C);
    it->second.execute(stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    stream.wait();
  }
};

OneDnnBaseline::OneDnnBaseline(const LayerWeights& layer, int threads) : impl_(new Impl(layer)) {
  omp_set_num_threads(threads);
}

OneDnnBaseline::~OneDnnBaseline() = default;

std::string OneDnnBaseline::version() {
  const dnnl_version_t* v = dnnl_version();
  return std::to_string(v->major) + "." + std::to_string(v->minor) + "." + std::to_string(v->patch);
}

namespace {

float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

// Routes grouped by expert (a counting sort), the plain way a framework
// prepares per-expert GEMMs.
struct Grouping {
  std::vector<int64_t> offset;  // [E+1] first sorted row of each expert
  std::vector<int64_t> token;   // [R] token of each sorted row
  std::vector<float> weight;    // [R] routing weight of each sorted row
  std::vector<int64_t> row_of;  // [T*k] sorted row of each route, -1 for none
};

void group_routes(const Batch& b, int64_t experts, int64_t top_k, Grouping& g) {
  const int64_t routes = b.tokens * top_k;
  g.offset.assign(static_cast<size_t>(experts + 1), 0);
  for (int64_t i = 0; i < routes; ++i)
    if (b.ids.i32()[i] >= 0) ++g.offset[static_cast<size_t>(b.ids.i32()[i] + 1)];
  for (int64_t e = 0; e < experts; ++e) g.offset[static_cast<size_t>(e + 1)] += g.offset[static_cast<size_t>(e)];
  std::vector<int64_t> next(g.offset.begin(), g.offset.end() - 1);
  g.token.resize(static_cast<size_t>(g.offset.back()));
  g.weight.resize(g.token.size());
  g.row_of.assign(static_cast<size_t>(routes), -1);
  for (int64_t i = 0; i < routes; ++i) {
    const int32_t e = b.ids.i32()[i];
    if (e < 0) continue;
    const int64_t row = next[static_cast<size_t>(e)]++;
    g.token[static_cast<size_t>(row)] = i / top_k;
    g.weight[static_cast<size_t>(row)] = b.route_weights.f32()[i];
    g.row_of[static_cast<size_t>(i)] = row;
  }
}

}  // namespace

// Buffers of one call, sized for the largest batch before the timed calls.
struct OneDnnBaseline::Workspace {
  std::vector<uint16_t> xs, act, dys, wdys, dg, du;   // per sorted route row
  std::vector<float> gate, up, out, da, droute;
  std::vector<uint16_t> y, dx;                       // [T,H] outputs
  std::vector<float> droute_weights;                 // [T,k]
  std::vector<float> grad_gate, grad_up, grad_down;  // full mode, [E,out,in]
  Grouping grouping;
};

void OneDnnBaseline::size_workspace(Case which, const Workload& work, Workspace& ws) const {
  const ModelShape& s = impl_->layer.shape;
  const size_t H = static_cast<size_t>(s.hidden), I = static_cast<size_t>(s.intermediate);
  const size_t T = static_cast<size_t>(work.tokens), k = static_cast<size_t>(s.top_k);
  int64_t max_routes = 0;
  for (const Batch& b : work.batches) max_routes = std::max(max_routes, b.routes);
  const size_t R = static_cast<size_t>(max_routes);
  for (auto* v : {&ws.xs, &ws.dys, &ws.wdys}) v->resize(R * H);
  for (auto* v : {&ws.act, &ws.dg, &ws.du}) v->resize(R * I);
  for (auto* v : {&ws.gate, &ws.up, &ws.da}) v->resize(R * I);
  ws.out.resize(R * H);
  ws.droute.resize(R);
  ws.y.resize(T * H);
  ws.dx.resize(T * H);
  ws.droute_weights.resize(T * k);
  if (which == Case::kTrainFull) {
    const size_t n = static_cast<size_t>(impl_->layer.experts) * I * H;
    ws.grad_gate.resize(n);
    ws.grad_up.resize(n);
    ws.grad_down.resize(n);
  }
}

void OneDnnBaseline::run(Case which, const Batch& b, Workspace& ws) {
  Impl& m = *impl_;
  const ModelShape& s = m.layer.shape;
  const int64_t H = s.hidden, I = s.intermediate, E = m.layer.experts, k = s.top_k, T = b.tokens;
  const uint16_t* wg = m.layer.gate.u16();
  const uint16_t* wu = m.layer.up.u16();
  const uint16_t* wd = m.layer.down.u16();
  Grouping& g = ws.grouping;
  auto at = [](auto& v, int64_t i) { return &v[static_cast<size_t>(i)]; };
  group_routes(b, E, k, g);
  const int64_t routes = g.offset.back();

  // ---- forward
#pragma omp parallel for
  for (int64_t r = 0; r < routes; ++r)
    std::memcpy(at(ws.xs, r * H), b.x.u16() + g.token[static_cast<size_t>(r)] * H, static_cast<size_t>(H) * 2);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = g.offset[static_cast<size_t>(e)], n = g.offset[static_cast<size_t>(e + 1)] - r0;
    if (n == 0) continue;
    m.gemm(n, I, H, at(ws.xs, r0 * H), false, wg + e * I * H, true, at(ws.gate, r0 * I), false);
    m.gemm(n, I, H, at(ws.xs, r0 * H), false, wu + e * I * H, true, at(ws.up, r0 * I), false);
#pragma omp parallel for
    for (int64_t i = r0 * I; i < (r0 + n) * I; ++i) {
      const float gv = ws.gate[static_cast<size_t>(i)];
      ws.act[static_cast<size_t>(i)] = to_bf16(gv * sigmoid(gv) * ws.up[static_cast<size_t>(i)]);
    }
    m.gemm(n, H, I, at(ws.act, r0 * I), false, wd + e * H * I, true, at(ws.out, r0 * H), false);
  }
#pragma omp parallel for
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = g.row_of[static_cast<size_t>(t * k + j)];
        if (row >= 0) sum += g.weight[static_cast<size_t>(row)] * ws.out[static_cast<size_t>(row * H + h)];
      }
      ws.y[static_cast<size_t>(t * H + h)] = to_bf16(sum);
    }
  }
  if (which == Case::kForward) return;

  // ---- backward: da = w * Wd^T dy, dg/du, dx = Wg^T dg + Wu^T du
#pragma omp parallel for
  for (int64_t r = 0; r < routes; ++r) {
    const uint16_t* src = b.dy.u16() + g.token[static_cast<size_t>(r)] * H;
    std::memcpy(at(ws.dys, r * H), src, static_cast<size_t>(H) * 2);
    if (which == Case::kTrainFull) {
      const float w = g.weight[static_cast<size_t>(r)];
      for (int64_t h = 0; h < H; ++h) ws.wdys[static_cast<size_t>(r * H + h)] = to_bf16(w * from_bf16(src[h]));
    }
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t r0 = g.offset[static_cast<size_t>(e)], n = g.offset[static_cast<size_t>(e + 1)] - r0;
    if (n == 0) {
      if (which == Case::kTrainFull) {  // the contract: untouched experts' grads are zero
        const size_t bytes = static_cast<size_t>(I * H) * 4;
        std::memset(at(ws.grad_gate, e * I * H), 0, bytes);
        std::memset(at(ws.grad_up, e * I * H), 0, bytes);
        std::memset(at(ws.grad_down, e * I * H), 0, bytes);
      }
      continue;
    }
    m.gemm(n, I, H, at(ws.dys, r0 * H), false, wd + e * H * I, false, at(ws.da, r0 * I), false);
#pragma omp parallel for
    for (int64_t r = r0; r < r0 + n; ++r) {
      const float w = g.weight[static_cast<size_t>(r)];
      float dot = 0;
      for (int64_t i = r * I; i < (r + 1) * I; ++i) {
        const float gv = ws.gate[static_cast<size_t>(i)], uv = ws.up[static_cast<size_t>(i)];
        const float sg = sigmoid(gv), silu = gv * sg;
        const float d = ws.da[static_cast<size_t>(i)];
        dot += d * silu * uv;
        const float dav = w * d;
        ws.dg[static_cast<size_t>(i)] = to_bf16(dav * uv * sg * (1.f + gv * (1.f - sg)));
        ws.du[static_cast<size_t>(i)] = to_bf16(dav * silu);
      }
      ws.droute[static_cast<size_t>(r)] = dot;
    }
    m.gemm(n, H, I, at(ws.dg, r0 * I), false, wg + e * I * H, false, at(ws.out, r0 * H), false);
    m.gemm(n, H, I, at(ws.du, r0 * I), false, wu + e * I * H, false, at(ws.out, r0 * H), true);
    if (which == Case::kTrainFull) {
      // dWd = (w dy)^T a, dWg = dg^T x, dWu = du^T x: M = out, K = the expert's rows.
      m.gemm(H, I, n, at(ws.wdys, r0 * H), true, at(ws.act, r0 * I), false, at(ws.grad_down, e * H * I), false);
      m.gemm(I, H, n, at(ws.dg, r0 * I), true, at(ws.xs, r0 * H), false, at(ws.grad_gate, e * I * H), false);
      m.gemm(I, H, n, at(ws.du, r0 * I), true, at(ws.xs, r0 * H), false, at(ws.grad_up, e * I * H), false);
    }
  }
#pragma omp parallel for
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t j = 0; j < k; ++j) {
      const int64_t row = g.row_of[static_cast<size_t>(t * k + j)];
      ws.droute_weights[static_cast<size_t>(t * k + j)] = row >= 0 ? ws.droute[static_cast<size_t>(row)] : 0.f;
    }
    for (int64_t h = 0; h < H; ++h) {
      float sum = 0;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t row = g.row_of[static_cast<size_t>(t * k + j)];
        if (row >= 0) sum += ws.out[static_cast<size_t>(row * H + h)];
      }
      ws.dx[static_cast<size_t>(t * H + h)] = to_bf16(sum);
    }
  }
}

double OneDnnBaseline::time_case(Case which, const Workload& work, int warmup, int reps, std::string* error) {
  if (!supports(which)) {
    *error = "no oneDNN counterpart";
    return -1;
  }
  Workspace ws;
  size_workspace(which, work, ws);
  try {
    return median_seconds(warmup, reps, [&](int call) {
      run(which, work.batches[static_cast<size_t>(call) % work.batches.size()], ws);
      return true;
    });
  } catch (const dnnl::error& e) {
    *error = std::string("oneDNN: ") + e.what();
    return -1;
  }
}

bool OneDnnBaseline::outputs(Case which, const Workload& work, std::vector<float>* y, std::vector<float>* dx,
                             std::string* error) {
  Workspace ws;
  size_workspace(which, work, ws);
  try {
    run(which, work.batches.front(), ws);
  } catch (const dnnl::error& e) {
    *error = std::string("oneDNN: ") + e.what();
    return false;
  }
  y->resize(ws.y.size());
  for (size_t i = 0; i < ws.y.size(); ++i) (*y)[i] = from_bf16(ws.y[i]);
  dx->clear();
  if (which != Case::kForward) {
    dx->resize(ws.dx.size());
    for (size_t i = 0; i < ws.dx.size(); ++i) (*dx)[i] = from_bf16(ws.dx[i]);
  }
  return true;
}

}  // namespace kt_bench
