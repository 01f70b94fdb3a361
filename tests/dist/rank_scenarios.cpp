// What each rank of a multi-process test does (ranks.h). Every rank builds
// the same problem from a seed: weights, and every rank's tokens. It runs
// the distributed layer on its own tokens and, as the oracle, one process's
// plain layer on all ranks' tokens concatenated (rank 0's first); results
// must be the same bits. Failure scenarios check that every rank returns
// the same status and message.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <chrono>
#include <cstdlib>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <thread>

#include "harness.h"
#include "moe/reference.h"
#include "ranks.h"
#include "tolerances.h"

namespace kt_dist_test {
namespace {

using kt_test::Tensor;
using kt_test::TensorPtr;

int g_failures = 0;

#define RCHECK(cond, what)                                                                   \
  do {                                                                                       \
    if (!(cond)) {                                                                           \
      std::fprintf(stderr, "rank check failed at %s:%d: %s: %s (last error: %s)\n", __FILE__, \
                   __LINE__, #cond, std::string(what).c_str(), kt_last_error());              \
      ++g_failures;                                                                          \
    }                                                                                        \
  } while (0)

struct Problem {
  int64_t E = 6, K = 2, H = 48, I = 40;
  kt_mode mode = KT_MODE_INFERENCE;
  bool bias = false;
  kt_activation act = KT_ACT_SILU;
  float limit = 0.f;
  int64_t lora_rank = 4;
  bool bf16 = false;       // x, y, dy, dx in bf16
  bool ids64 = false;
  int minus_one_every = 0;  // every n-th route of a rank is -1
  std::vector<int64_t> tokens;  // per rank
  kt_dist_mode dist_mode = KT_DIST_OWNER;
  int owner = 0;
  std::vector<int32_t> expert_ranks;  // empty: even split
  int narrow_rank = -1;  // this rank's tokens route among experts 0..K only
  kt_dist_grad_average average = KT_DIST_GRAD_SUM;
  float grad_scale = 1.f;
  uint32_t seed = 7;
  int64_t timeout_ms = 20000;

  int64_t in_dim(int p) const { return p == 2 ? I : H; }
  int64_t out_dim(int p) const { return p == 2 ? H : I; }
  int64_t total() const {
    int64_t t = 0;
    for (int64_t v : tokens) t += v;
    return t;
  }
  int64_t first(int rank) const {
    int64_t t = 0;
    for (int r = 0; r < rank; ++r) t += tokens[static_cast<size_t>(r)];
    return t;
  }
};

// The layer's parameters and every rank's tokens, generated alike on every rank.
struct Data {
  TensorPtr w[3], b[3], la[3], lb[3];  // [E,...]
  TensorPtr x, ids, rw, dy;            // all ranks' tokens, concatenated
};

Data make_data(const Problem& pb) {
  Data d;
  std::mt19937 rng(pb.seed);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int p = 0; p < 3; ++p) {
    const int64_t in = pb.in_dim(p), out = pb.out_dim(p);
    d.w[p] = Tensor::make(kt_test::kBF16, {pb.E, out, in});
    for (int64_t i = 0; i < d.w[p]->numel(); ++i) d.w[p]->set(i, normal(rng) / std::sqrt(double(in)));
    if (pb.bias) {
      d.b[p] = Tensor::make(kt_test::kF32, {pb.E, out});
      for (int64_t i = 0; i < d.b[p]->numel(); ++i) d.b[p]->set(i, 0.1 * normal(rng));
    }
    if (pb.mode == KT_MODE_LORA) {
      d.la[p] = Tensor::make(kt_test::kF32, {pb.E, pb.lora_rank, in});
      d.lb[p] = Tensor::make(kt_test::kF32, {pb.E, out, pb.lora_rank});
      for (int64_t i = 0; i < d.la[p]->numel(); ++i) d.la[p]->set(i, normal(rng) / std::sqrt(double(in)));
      for (int64_t i = 0; i < d.lb[p]->numel(); ++i) d.lb[p]->set(i, 0.3 * normal(rng));
    }
  }
  const int64_t T = pb.total();
  const DLDataType act = pb.bf16 ? kt_test::kBF16 : kt_test::kF32;
  d.x = Tensor::make(act, {T, pb.H});
  d.dy = Tensor::make(act, {T, pb.H});
  d.ids = Tensor::make(pb.ids64 ? kt_test::kI64 : kt_test::kI32, {T, pb.K});
  d.rw = Tensor::make(kt_test::kF32, {T, pb.K});
  for (int64_t i = 0; i < d.x->numel(); ++i) {
    d.x->set(i, normal(rng));
    d.dy->set(i, normal(rng));
  }
  std::vector<int> perm(static_cast<size_t>(pb.E));
  const int64_t narrow0 = pb.narrow_rank >= 0 ? pb.first(pb.narrow_rank) : 0;
  const int64_t narrow1 = pb.narrow_rank >= 0 ? narrow0 + pb.tokens[static_cast<size_t>(pb.narrow_rank)] : 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int e = 0; e < pb.E; ++e) perm[static_cast<size_t>(e)] = e;
    const bool narrow = t >= narrow0 && t < narrow1;
    std::shuffle(perm.begin(), narrow ? perm.begin() + pb.K + 1 : perm.end(), rng);
    for (int64_t j = 0; j < pb.K; ++j) {
      const int64_t route = t * pb.K + j;
      const bool none = pb.minus_one_every && route % pb.minus_one_every == 0;
      d.ids->set(route, none ? -1.0 : perm[static_cast<size_t>(j)]);
      d.rw->set(route, 0.2 + std::uniform_real_distribution<double>(0, 1)(rng));
    }
  }
  return d;
}

// Rows [t0, t0+n) of a 2-D tensor as a view (no copy).
struct Rows {
  int64_t shape[2];
  DLTensor t;
  Rows(Tensor& src, int64_t t0, int64_t n) : shape{n, src.shape[1]}, t(src.t) {
    t.shape = shape;
    t.byte_offset = static_cast<uint64_t>(t0 * src.shape[1] * src.t.dtype.bits / 8);
  }
};

// Experts [list] of a [E, ...] tensor, stacked into a new tensor.
TensorPtr pick_experts(const Tensor& src, const std::vector<int64_t>& experts) {
  std::vector<int64_t> shape = src.shape;
  shape[0] = static_cast<int64_t>(experts.size());
  TensorPtr out = Tensor::make(src.t.dtype, shape);
  const size_t per = static_cast<size_t>(src.numel() / src.shape[0] * src.t.dtype.bits / 8);
  for (size_t i = 0; i < experts.size(); ++i)
    std::memcpy(out->bytes.data() + i * per, src.bytes.data() + static_cast<size_t>(experts[i]) * per, per);
  return out;
}

bool same_bytes(const void* a, const void* b, size_t n) { return std::memcmp(a, b, n) == 0; }

kt_engine* make_engine() {
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 1;
  eo.pin_threads = 0;
  eo.verbosity = 0;
  kt_engine* e = nullptr;
  RCHECK(kt_engine_create(&eo, &e) == KT_OK, "engine");
  return e;
}

kt_moe_options layer_options(const Problem& pb, int64_t max_tokens) {
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = pb.E;
  mo.top_k = pb.K;
  mo.hidden = pb.H;
  mo.intermediate = pb.I;
  mo.max_tokens = std::max<int64_t>(max_tokens, 1);
  mo.has_bias = pb.bias;
  mo.activation = pb.act;
  mo.act_limit = pb.limit;
  mo.mode = pb.mode;
  mo.lora_rank = pb.lora_rank;
  mo.lora_alpha = 8.f;
  return mo;
}

// Gradient buffers of a layer over `experts` (fp32, [n, ...]).
struct Grads {
  TensorPtr g[6];  // LoRA: A,B per projection; full: W per projection, then biases
};

// Loads experts (global ids, in local order) into layer and binds its
// trainable parameters and gradient buffers.
Grads set_up_layer(kt_moe* layer, const Problem& pb, const Data& d, const std::vector<int64_t>& experts) {
  TensorPtr w[3], b[3];
  std::vector<kt_arg> load;
  for (int p = 0; p < 3; ++p) {
    w[p] = pick_experts(*d.w[p], experts);
    load.push_back({KT_ARG_W_GATE + p, w[p]->dl()});
    if (pb.bias) {
      b[p] = pick_experts(*d.b[p], experts);
      load.push_back({KT_ARG_B_GATE + p, b[p]->dl()});
    }
  }
  RCHECK(kt_moe_load_weights(layer, nullptr, load.data(), load.size()) == KT_OK, "load");
  Grads g;
  std::vector<kt_arg> bind;
  const int64_t n = static_cast<int64_t>(experts.size());
  static std::vector<TensorPtr> keep;  // LoRA factors are retained by the layer
  for (int p = 0; p < 3; ++p) {
    if (pb.mode == KT_MODE_LORA) {
      keep.push_back(pick_experts(*d.la[p], experts));
      bind.push_back({KT_ARG_LORA_A_GATE + 2 * p, keep.back()->dl()});
      keep.push_back(pick_experts(*d.lb[p], experts));
      bind.push_back({KT_ARG_LORA_B_GATE + 2 * p, keep.back()->dl()});
      g.g[2 * p] = Tensor::make(kt_test::kF32, {n, pb.lora_rank, pb.in_dim(p)});
      g.g[2 * p + 1] = Tensor::make(kt_test::kF32, {n, pb.out_dim(p), pb.lora_rank});
      bind.push_back({KT_ARG_GRAD_LORA_A_GATE + 2 * p, g.g[2 * p]->dl()});
      bind.push_back({KT_ARG_GRAD_LORA_B_GATE + 2 * p, g.g[2 * p + 1]->dl()});
    } else if (pb.mode == KT_MODE_FULL) {
      g.g[p] = Tensor::make(kt_test::kF32, {n, pb.out_dim(p), pb.in_dim(p)});
      bind.push_back({KT_ARG_GRAD_W_GATE + p, g.g[p]->dl()});
      if (pb.bias) {
        g.g[3 + p] = Tensor::make(kt_test::kF32, {n, pb.out_dim(p)});
        bind.push_back({KT_ARG_GRAD_B_GATE + p, g.g[3 + p]->dl()});
      }
    }
  }
  if (!bind.empty()) RCHECK(kt_moe_bind(layer, bind.data(), bind.size()) == KT_OK, "bind");
  return g;
}

struct Outputs {
  TensorPtr y, dx, dw;
};

Outputs outputs_for(const Problem& pb, int64_t T) {
  const DLDataType act = pb.bf16 ? kt_test::kBF16 : kt_test::kF32;
  return Outputs{Tensor::make(act, {T, pb.H}), Tensor::make(act, {T, pb.H}), Tensor::make(kt_test::kF32, {T, pb.K})};
}

kt_comm* make_comm(int rank, int world, const std::string& dir, int64_t timeout_ms) {
  kt_comm_options co;
  kt_comm_options_init(&co);
  co.rank = rank;
  co.world_size = world;
  co.store_path = dir.c_str();
  co.timeout_ms = timeout_ms;
  kt_comm* c = nullptr;
  const kt_status st = kt_comm_create(&co, &c);
  RCHECK(st == KT_OK, "kt_comm_create");
  return st == KT_OK ? c : nullptr;
}

kt_dist_moe_options dist_options(const Problem& pb) {
  kt_dist_moe_options o;
  kt_dist_moe_options_init(&o);
  o.mode = pb.dist_mode;
  o.owner_rank = pb.owner;
  o.grad_average = pb.average;
  o.expert_ranks = pb.expert_ranks.empty() ? nullptr : pb.expert_ranks.data();
  return o;
}

// ------------------------------------------------ distributed = one process

int run_matches_one_process(const Problem& pb, int rank, int world, const std::string& dir) {
  const Data d = make_data(pb);
  const int64_t T = pb.tokens[static_cast<size_t>(rank)], t0 = pb.first(rank), total = pb.total();
  const float scale = pb.grad_scale * (pb.average == KT_DIST_GRAD_MEAN ? 1.f / static_cast<float>(world) : 1.f);
  std::vector<int64_t> all(static_cast<size_t>(pb.E));
  for (int64_t e = 0; e < pb.E; ++e) all[static_cast<size_t>(e)] = e;

  // One process over every rank's tokens.
  kt_engine* engine = make_engine();
  kt_moe_options mo = layer_options(pb, total);
  kt_moe* one = nullptr;
  RCHECK(kt_moe_create(engine, &mo, &one) == KT_OK, "reference layer");
  const Grads ref_grads = set_up_layer(one, pb, d, all);
  Outputs ref = outputs_for(pb, total);
  {
    kt_arg f[] = {{KT_ARG_X, d.x->dl()}, {KT_ARG_IDS, d.ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, d.rw->dl()},
                  {KT_ARG_Y, ref.y->dl()}};
    kt_context* ctx = nullptr;
    RCHECK(kt_moe_forward(one, f, 4, &ctx) == KT_OK, "reference forward");
    kt_backward_options bo;
    kt_backward_options_init(&bo);
    bo.grad_scale = scale;
    kt_arg b[] = {{KT_ARG_DY, d.dy->dl()}, {KT_ARG_DX, ref.dx->dl()}, {KT_ARG_DROUTE_WEIGHTS, ref.dw->dl()}};
    RCHECK(kt_moe_backward(one, ctx, &bo, b, 3) == KT_OK, "reference backward");
    kt_context_release(ctx);
  }
  // The oracle itself against kt's double-precision reference.
  {
    kt::reference::Spec spec;
    spec.E = pb.E;
    spec.K = pb.K;
    spec.H = pb.H;
    spec.I = pb.I;
    spec.activation = pb.act;
    spec.alpha = 1.702;
    spec.limit = pb.limit;
    spec.bias = pb.bias;
    spec.rank = pb.mode == KT_MODE_LORA ? pb.lora_rank : 0;
    // alpha / r (layer_options: alpha 8, no rsLoRA), computed here; kt's own
    // scale must agree.
    if (pb.mode == KT_MODE_LORA) {
      spec.lora_scale = 8.0 / static_cast<double>(pb.lora_rank);
      float s = 0.f;
      RCHECK(kt_moe_lora_scale(one, &s) == KT_OK && std::fabs(s - spec.lora_scale) <= 1e-6 * spec.lora_scale,
             "kt's LoRA scale is alpha / r");
    }
    kt::reference::Params params;
    for (int p = 0; p < 3; ++p) {
      for (double v : d.w[p]->values()) params.w[p].push_back(static_cast<float>(v));
      if (pb.bias)
        for (double v : d.b[p]->values()) params.b[p].push_back(static_cast<float>(v));
      if (pb.mode == KT_MODE_LORA) {
        for (double v : d.la[p]->values()) params.la[p].push_back(static_cast<float>(v));
        for (double v : d.lb[p]->values()) params.lb[p].push_back(static_cast<float>(v));
      }
    }
    std::vector<int64_t> ids;
    for (double v : d.ids->values()) ids.push_back(static_cast<int64_t>(v));
    const std::vector<double> y = kt::reference::forward(spec, params, total, d.x->values(), ids, d.rw->values());
    kt_engine_info info;
    info.struct_size = sizeof(info);
    kt_engine_get_info(engine, &info);
    const double tol = kt_test::tolerance_for(info.isa, pb.bf16).forward;
    RCHECK(kt_test::rel_l2(ref.y->values(), y) <= tol, "one process's y against the reference");
  }

  // The same tokens over the ranks.
  kt_comm* comm = make_comm(rank, world, dir, pb.timeout_ms);
  if (!comm) return 1;
  const bool computes = pb.dist_mode == KT_DIST_EXPERT_PARALLEL || rank == pb.owner;
  kt_moe_options dmo = layer_options(pb, *std::max_element(pb.tokens.begin(), pb.tokens.end()));
  const kt_dist_moe_options dopt = dist_options(pb);
  kt_dist_moe* dist = nullptr;
  RCHECK(kt_dist_moe_create(comm, computes ? engine : nullptr, &dmo, &dopt, &dist) == KT_OK, "kt_dist_moe_create");
  int64_t count = -1;
  RCHECK(kt_dist_moe_local_experts(dist, nullptr, 0, &count) == KT_OK, "local experts");
  std::vector<int64_t> mine(static_cast<size_t>(std::max<int64_t>(count, 0)));
  RCHECK(kt_dist_moe_local_experts(dist, mine.data(), count, &count) == KT_OK, "local experts");
  kt_moe* local = nullptr;
  RCHECK(kt_dist_moe_layer(dist, &local) == KT_OK, "layer");
  RCHECK((local != nullptr) == !mine.empty(), "a layer exactly where experts are");
  if (pb.dist_mode == KT_DIST_OWNER) RCHECK(static_cast<int64_t>(mine.size()) == (computes ? pb.E : 0), "owner holds all");
  Grads grads;
  if (local) grads = set_up_layer(local, pb, d, mine);

  Outputs out = outputs_for(pb, T);
  Rows x(*d.x, t0, T), ids(*d.ids, t0, T), rw(*d.rw, t0, T), dy(*d.dy, t0, T);
  kt_arg f[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, &ids.t}, {KT_ARG_ROUTE_WEIGHTS, &rw.t}, {KT_ARG_Y, out.y->dl()}};
  kt_dist_context* ctx = nullptr;
  RCHECK(kt_dist_moe_forward(dist, f, 4, &ctx) == KT_OK, "kt_dist_moe_forward");
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  bo.grad_scale = pb.grad_scale;
  kt_arg b[] = {{KT_ARG_DY, &dy.t}, {KT_ARG_DX, out.dx->dl()}, {KT_ARG_DROUTE_WEIGHTS, out.dw->dl()}};
  RCHECK(kt_dist_moe_backward(dist, ctx, &bo, b, 3) == KT_OK, "kt_dist_moe_backward");
  kt_dist_context_release(ctx);

  const size_t xb = static_cast<size_t>(pb.H * (pb.bf16 ? 2 : 4));
  RCHECK(same_bytes(out.y->bytes.data(), ref.y->bytes.data() + static_cast<size_t>(t0) * xb, static_cast<size_t>(T) * xb),
         "y is one process's y, bit for bit");
  RCHECK(same_bytes(out.dx->bytes.data(), ref.dx->bytes.data() + static_cast<size_t>(t0) * xb, static_cast<size_t>(T) * xb),
         "dx is one process's dx, bit for bit");
  RCHECK(same_bytes(out.dw->bytes.data(), ref.dw->bytes.data() + static_cast<size_t>(t0 * pb.K) * 4,
                    static_cast<size_t>(T * pb.K) * 4),
         "routing-weight gradients are one process's, bit for bit");
  for (int i = 0; i < 6; ++i) {
    if (!grads.g[i]) continue;
    const TensorPtr expected = pick_experts(*ref_grads.g[i], mine);
    RCHECK(same_bytes(grads.g[i]->bytes.data(), expected->bytes.data(), static_cast<size_t>(expected->numel()) * 4),
           "parameter gradient " + std::to_string(i) + " of this rank's experts is one process's, bit for bit");
  }
  kt_dist_moe_destroy(dist);
  kt_comm_destroy(comm);
  kt_moe_destroy(one);
  RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// ------------------------------------------------------------------ failures

// Every rank's last error, gathered: all must be `message`'s.
void expect_same_message_everywhere(kt_comm* comm, const std::string& message) {
  std::vector<char> mine(1024, 0), all;
  std::memcpy(mine.data(), message.data(), std::min<size_t>(message.size(), 1023));
  kt_comm_info info;
  info.struct_size = sizeof(info);
  kt_comm_get_info(comm, &info);
  all.resize(mine.size() * static_cast<size_t>(info.world_size));
  int64_t s1[1] = {1024}, s2[2] = {info.world_size, 1024};
  DLTensor in{}, out{};
  in.data = mine.data();
  in.device = {kDLCPU, 0};
  in.ndim = 1;
  in.dtype = {kDLUInt, 8, 1};
  in.shape = s1;
  out = in;
  out.data = all.data();
  out.ndim = 2;
  out.shape = s2;
  RCHECK(kt_comm_allgather(comm, &in, &out) == KT_OK, "allgather of messages");
  for (int r = 0; r < info.world_size; ++r)
    RCHECK(std::memcmp(all.data() + r * 1024, mine.data(), 1024) == 0,
           "rank " + std::to_string(r) + " has another message than '" + message + "'");
}

bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

// A failure on one rank's arguments reaches every rank: its status, its message.
int run_argument_failures(int rank, int world, const std::string& dir) {
  Problem pb;
  pb.tokens.assign(static_cast<size_t>(world), 4);
  const Data d = make_data(pb);
  kt_engine* engine = rank == 0 ? make_engine() : nullptr;
  kt_comm* comm = make_comm(rank, world, dir, 20000);
  if (!comm) return 1;
  kt_moe_options mo = layer_options(pb, 4);
  const kt_dist_moe_options dopt = dist_options(pb);
  kt_dist_moe* dist = nullptr;
  RCHECK(kt_dist_moe_create(comm, engine, &mo, &dopt, &dist) == KT_OK, "create");
  kt_moe* local = nullptr;
  kt_dist_moe_layer(dist, &local);
  std::vector<int64_t> all(static_cast<size_t>(pb.E));
  for (int64_t e = 0; e < pb.E; ++e) all[static_cast<size_t>(e)] = e;
  if (local) set_up_layer(local, pb, d, all);
  const int64_t t0 = pb.first(rank);
  Rows x(*d.x, t0, 4), rw(*d.rw, t0, 4), dy(*d.dy, t0, 4);
  TensorPtr ids = Tensor::make(kt_test::kI32, {4, pb.K});
  for (int64_t i = 0; i < 4 * pb.K; ++i) ids->set(i, d.ids->get(t0 * pb.K + i));
  Outputs out = outputs_for(pb, 4);
  kt_arg f[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, &rw.t}, {KT_ARG_Y, out.y->dl()}};

  // 1. The last rank routes to an expert that does not exist.
  const int bad = world - 1;
  if (rank == bad) ids->set(3, 99.0);
  kt_status st = kt_dist_moe_forward(dist, f, 4, nullptr);
  std::string msg = kt_last_error();
  RCHECK(st == KT_ERR_EXPERT_ID, "every rank gets the bad rank's status");
  RCHECK(contains(msg, "kt_dist_moe_forward: rank " + std::to_string(bad) + ": ") && contains(msg, "= 99 is outside"),
         "the message names the rank and its own message: " + msg);
  expect_same_message_everywhere(comm, msg);
  if (rank == bad) ids->set(3, 1.0);

  // 2. Rank 0's Y has the wrong dtype.
  TensorPtr wrong_y = Tensor::make(kt_test::kBF16, {4, pb.H});
  kt_arg f2[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, &rw.t},
                 {KT_ARG_Y, rank == 0 ? wrong_y->dl() : out.y->dl()}};
  st = kt_dist_moe_forward(dist, f2, 4, nullptr);
  msg = kt_last_error();
  RCHECK(st == KT_ERR_DTYPE && contains(msg, "rank 0: ") && contains(msg, "KT_ARG_Y"), msg);
  expect_same_message_everywhere(comm, msg);

  // 3. The communicator is still usable: two forwards with contexts, then
  //    the ranks pass contexts of different forwards to backward.
  kt_dist_context* c1 = nullptr;
  kt_dist_context* c2 = nullptr;
  RCHECK(kt_dist_moe_forward(dist, f, 4, &c1) == KT_OK, "forward after failures");
  RCHECK(kt_dist_moe_forward(dist, f, 4, &c2) == KT_OK, "second forward");
  kt_arg b[] = {{KT_ARG_DY, &dy.t}, {KT_ARG_DX, out.dx->dl()}};
  st = kt_dist_moe_backward(dist, rank == 0 ? c2 : c1, nullptr, b, 2);
  msg = kt_last_error();
  RCHECK(st == KT_ERR_CONTEXT && contains(msg, "disagree") && contains(msg, "rank 0 has 4, rank 1 has 3"), msg);
  expect_same_message_everywhere(comm, msg);

  // 4. Backward options must agree.
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  bo.grad_scale = rank == bad ? 0.5f : 1.f;
  st = kt_dist_moe_backward(dist, c1, &bo, b, 2);
  msg = kt_last_error();
  RCHECK(st == KT_ERR_INVALID_ARGUMENT && contains(msg, "options->grad_scale"), msg);
  expect_same_message_everywhere(comm, msg);
  RCHECK(kt_dist_moe_backward(dist, c1, nullptr, b, 2) == KT_OK, "backward after failures");

  // 5. A released context on one rank.
  if (rank == bad) kt_dist_context_release(c2);
  st = kt_dist_moe_backward(dist, c2, nullptr, b, 2);
  msg = kt_last_error();
  RCHECK(st == KT_ERR_CONTEXT && contains(msg, "rank " + std::to_string(bad) + ": ") && contains(msg, "not a live"), msg);
  expect_same_message_everywhere(comm, msg);
  kt_dist_context_release(c1);
  if (rank != bad) kt_dist_context_release(c2);

  kt_dist_moe_destroy(dist);
  kt_comm_destroy(comm);
  if (engine) RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// A failure inside one rank's computation (an expert not loaded) reaches every rank.
int run_compute_failure(int rank, int world, const std::string& dir) {
  Problem pb;
  pb.dist_mode = KT_DIST_EXPERT_PARALLEL;
  pb.tokens.assign(static_cast<size_t>(world), 6);
  const Data d = make_data(pb);
  kt_engine* engine = make_engine();
  kt_comm* comm = make_comm(rank, world, dir, 20000);
  if (!comm) return 1;
  kt_moe_options mo = layer_options(pb, 6);
  const kt_dist_moe_options dopt = dist_options(pb);
  kt_dist_moe* dist = nullptr;
  RCHECK(kt_dist_moe_create(comm, engine, &mo, &dopt, &dist) == KT_OK, "create");
  kt_moe* local = nullptr;
  kt_dist_moe_layer(dist, &local);
  int64_t n = 0;
  std::vector<int64_t> mine(static_cast<size_t>(pb.E));
  kt_dist_moe_local_experts(dist, mine.data(), pb.E, &n);
  mine.resize(static_cast<size_t>(n));
  const int bad = world - 1;
  // The last rank loads all but its last expert.
  if (rank == bad) {
    std::vector<int64_t> some(mine.begin(), mine.end() - 1);
    TensorPtr w[3];
    std::vector<kt_arg> load;
    for (int p = 0; p < 3; ++p) {
      w[p] = pick_experts(*d.w[p], some);
      load.push_back({KT_ARG_W_GATE + p, w[p]->dl()});
    }
    TensorPtr map = Tensor::make(kt_test::kI64, {static_cast<int64_t>(some.size())});
    for (size_t i = 0; i < some.size(); ++i) map->set(static_cast<int64_t>(i), static_cast<double>(i));
    load.push_back({KT_ARG_EXPERT_MAP, map->dl()});
    RCHECK(kt_moe_load_weights(local, nullptr, load.data(), load.size()) == KT_OK, "partial load");
  } else {
    set_up_layer(local, pb, d, mine);
  }
  // Every rank routes one token to the missing expert.
  const int64_t t0 = pb.first(rank);
  Rows x(*d.x, t0, 6), rw(*d.rw, t0, 6);
  TensorPtr ids = Tensor::make(kt_test::kI32, {6, pb.K});
  for (int64_t i = 0; i < 6 * pb.K; ++i) ids->set(i, d.ids->get(t0 * pb.K + i));
  ids->set(0, static_cast<double>(pb.E - 1));
  ids->set(1, 0.0);
  Outputs out = outputs_for(pb, 6);
  kt_arg f[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, &rw.t}, {KT_ARG_Y, out.y->dl()}};
  const kt_status st = kt_dist_moe_forward(dist, f, 4, nullptr);
  const std::string msg = kt_last_error();
  RCHECK(st == KT_ERR_NOT_LOADED, "every rank gets the computing rank's status");
  RCHECK(contains(msg, "rank " + std::to_string(bad) + ": kt_moe_forward: expert") && contains(msg, "no weights loaded"),
         msg);
  expect_same_message_everywhere(comm, msg);
  kt_dist_moe_destroy(dist);
  kt_comm_destroy(comm);
  RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// Ranks set up with different configurations are refused at creation.
int run_config_mismatch(int rank, int world, const std::string& dir) {
  Problem pb;
  pb.dist_mode = KT_DIST_EXPERT_PARALLEL;
  kt_engine* engine = make_engine();
  kt_comm* comm = make_comm(rank, world, dir, 20000);
  if (!comm) return 1;
  const int odd = world - 1;
  struct Case {
    const char* field;
    std::function<void(kt_moe_options&)> change;
  };
  const Case cases[] = {
      {"num_experts (E)", [](kt_moe_options& o) { o.num_experts = 8; }},
      {"top_k (k)", [](kt_moe_options& o) { o.top_k = 3; }},
      {"hidden (H)", [](kt_moe_options& o) { o.hidden = 64; }},
      {"weight_format (the weights' dtype)", [](kt_moe_options& o) { o.weight_format = static_cast<kt_weight_format>(1); }},
  };
  for (const Case& c : cases) {
    kt_moe_options mo = layer_options(pb, 4);
    if (rank == odd) c.change(mo);
    const kt_dist_moe_options dopt = dist_options(pb);
    kt_dist_moe* dist = nullptr;
    const kt_status st = kt_dist_moe_create(comm, engine, &mo, &dopt, &dist);
    const std::string msg = kt_last_error();
    RCHECK(st == KT_ERR_INVALID_ARGUMENT, std::string("a different ") + c.field + " is refused");
    RCHECK(contains(msg, std::string("disagree on layer_options->") + c.field) &&
               contains(msg, "rank " + std::to_string(odd) + " has"),
           msg);
    expect_same_message_everywhere(comm, msg);
    RCHECK(dist == nullptr, "nothing was created");
  }
  // The activations' dtype is per call: a rank with bf16 X is refused there.
  kt_moe_options mo = layer_options(pb, 4);
  const kt_dist_moe_options dopt = dist_options(pb);
  kt_dist_moe* dist = nullptr;
  RCHECK(kt_dist_moe_create(comm, engine, &mo, &dopt, &dist) == KT_OK, "create");
  pb.tokens.assign(static_cast<size_t>(world), 2);
  pb.bf16 = rank == odd;
  const Data d = make_data(pb);
  Outputs out = outputs_for(pb, 2);
  kt_arg f[] = {{KT_ARG_X, d.x->dl()}, {KT_ARG_IDS, d.ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, d.rw->dl()},
                {KT_ARG_Y, out.y->dl()}};
  Rows x(*d.x, 0, 2), ids(*d.ids, 0, 2), rw(*d.rw, 0, 2);
  f[0].tensor = &x.t;
  f[1].tensor = &ids.t;
  f[2].tensor = &rw.t;
  const kt_status st = kt_dist_moe_forward(dist, f, 4, nullptr);
  const std::string msg = kt_last_error();
  RCHECK(st == KT_ERR_DTYPE && contains(msg, "disagree on KT_ARG_X's dtype"), msg);
  expect_same_message_everywhere(comm, msg);
  kt_dist_moe_destroy(dist);
  kt_comm_destroy(comm);
  RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// The last rank dies (SIGKILL from another of its threads) while the ranks
// run forwards; every other rank's call must return KT_ERR_COMM within the
// timeout, and the communicator stays unusable afterwards.
int run_killed_rank(kt_dist_mode mode, int rank, int world, const std::string& dir, bool stall) {
  Problem pb;
  pb.dist_mode = mode;
  pb.tokens.assign(static_cast<size_t>(world), 8);
  const int64_t timeout_ms = stall ? 1000 : 2000;
  const Data d = make_data(pb);
  const bool computes = mode == KT_DIST_EXPERT_PARALLEL || rank == 0;
  kt_engine* engine = computes ? make_engine() : nullptr;
  kt_comm* comm = make_comm(rank, world, dir, timeout_ms);
  if (!comm) return 1;
  kt_moe_options mo = layer_options(pb, 8);
  const kt_dist_moe_options dopt = dist_options(pb);
  kt_dist_moe* dist = nullptr;
  RCHECK(kt_dist_moe_create(comm, engine, &mo, &dopt, &dist) == KT_OK, "create");
  kt_moe* local = nullptr;
  kt_dist_moe_layer(dist, &local);
  int64_t n = 0;
  std::vector<int64_t> mine(static_cast<size_t>(pb.E));
  kt_dist_moe_local_experts(dist, mine.data(), pb.E, &n);
  mine.resize(static_cast<size_t>(n));
  if (local) set_up_layer(local, pb, d, mine);
  const int64_t t0 = pb.first(rank);
  Rows x(*d.x, t0, 8), ids(*d.ids, t0, 8), rw(*d.rw, t0, 8);
  Outputs out = outputs_for(pb, 8);
  kt_arg f[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, &ids.t}, {KT_ARG_ROUTE_WEIGHTS, &rw.t}, {KT_ARG_Y, out.y->dl()}};
  RCHECK(kt_dist_moe_forward(dist, f, 4, nullptr) == KT_OK, "a first forward works");
  const int victim = world - 1;
  if (rank == victim) {
    if (stall) {
      // Alive, but never calls again: the others must time out.
      std::this_thread::sleep_for(std::chrono::milliseconds(timeout_ms + 1000));
      return g_failures ? 1 : 0;
    }
    std::thread killer([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(40));
      kill(getpid(), SIGKILL);
    });
    killer.detach();
    for (;;) kt_dist_moe_forward(dist, f, 4, nullptr);
  }
  kt_status st = KT_OK;
  double slowest_ms = 0;
  for (int i = 0; i < 100000 && st == KT_OK; ++i) {
    const auto start = std::chrono::steady_clock::now();
    st = kt_dist_moe_forward(dist, f, 4, nullptr);
    slowest_ms = std::max(
        slowest_ms, std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start).count());
  }
  const std::string msg = kt_last_error();
  RCHECK(st == KT_ERR_COMM, "a dead peer is KT_ERR_COMM: " + msg);
  RCHECK(contains(msg, "kt_dist_moe_forward") && contains(msg, "gloo"), msg);
  RCHECK(slowest_ms < static_cast<double>(timeout_ms) + 1500, "returned within the timeout: " + std::to_string(slowest_ms) + " ms");
  std::printf("rank %d: %s after at most %.0f ms: %s\n", rank, kt_status_string(st), slowest_ms, msg.c_str());
  RCHECK(kt_dist_moe_forward(dist, f, 4, nullptr) == KT_ERR_COMM && contains(kt_last_error(), "unusable"),
         "the communicator stays unusable");
  kt_comm_info info;
  info.struct_size = sizeof(info);
  RCHECK(kt_comm_get_info(comm, &info) == KT_OK && info.usable == 0, "info.usable is 0");
  kt_dist_moe_destroy(dist);
  kt_comm_destroy(comm);
  if (engine) RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// ------------------------------------------------- distributed checkpoints
//
// A LoRA training run with kt's AdamW over 4 steps of 12 tokens each,
// saved after step 2 by one set of ranks and resumed by another (other
// world size, mode or expert map). The oracle is one process running the
// 4 steps uninterrupted: a resumed rank's LoRA factors after step 4 and
// every rank's y at step 4 must be its bits. The checkpoint directory is
// $KT_TEST_CKPT_DIR/ckpt, shared by the runs of one test.

constexpr int kSavedStep = 2, kLastStep = 4, kCheckpointLayer = 3;

Problem ckpt_problem(int world, kt_dist_mode mode, kt_mode layer_mode = KT_MODE_LORA) {
  Problem pb;
  pb.mode = layer_mode;
  pb.dist_mode = mode;
  pb.owner = world - 1;
  pb.tokens.assign(static_cast<size_t>(world), 12 / world);
  return pb;
}

// The tokens of training step s (every rank's, concatenated).
Data step_data(const Problem& pb, int s) {
  Problem p = pb;
  p.seed = pb.seed + 1000 + static_cast<uint32_t>(s);
  return make_data(p);
}

kt_optimizer* make_optimizer(kt_moe* layer) {
  kt_optimizer_options oo;
  kt_optimizer_options_init(&oo);
  oo.lr = 1e-2;
  kt_optimizer* opt = nullptr;
  RCHECK(kt_optimizer_create_for_layer(layer, &oo, &opt) == KT_OK, "optimizer");
  return opt;
}

// A layer's trainable parameters (fp32, bound) and gradient buffers: LoRA
// A and B per projection, or in full mode the weights per projection.
struct Lora {
  TensorPtr f[6], g[6];
};

// d: the values to start from, or null for zeros (a layer for a checkpoint
// to fill; in full mode it then has no weights until the load).
Lora bind_lora(kt_moe* layer, const Problem& pb, const Data* d, const std::vector<int64_t>& experts) {
  Lora l;
  std::vector<kt_arg> bind;
  const int64_t n = static_cast<int64_t>(experts.size());
  const bool full = pb.mode == KT_MODE_FULL;
  for (int p = 0; p < 3; ++p)
    for (int b = 0; b < (full ? 1 : 2); ++b) {
      const int i = full ? p : 2 * p + b;
      std::vector<int64_t> shape = full ? std::vector<int64_t>{n, pb.out_dim(p), pb.in_dim(p)}
                                   : b  ? std::vector<int64_t>{n, pb.out_dim(p), pb.lora_rank}
                                        : std::vector<int64_t>{n, pb.lora_rank, pb.in_dim(p)};
      l.f[i] = Tensor::make(kt_test::kF32, shape);
      if (d) {
        const TensorPtr src = pick_experts(*(full ? d->w[p] : b ? d->lb[p] : d->la[p]), experts);
        for (int64_t k = 0; k < src->numel(); ++k) l.f[i]->set(k, src->get(k));
      }
      l.g[i] = Tensor::make(kt_test::kF32, shape);
      bind.push_back({(full ? KT_ARG_W_GATE : KT_ARG_LORA_A_GATE) + i, l.f[i]->dl()});
      bind.push_back({(full ? KT_ARG_GRAD_W_GATE : KT_ARG_GRAD_LORA_A_GATE) + i, l.g[i]->dl()});
    }
  RCHECK(kt_moe_bind(layer, bind.data(), bind.size()) == KT_OK, "bind the trainable parameters");
  if (full && d) RCHECK(kt_moe_params_changed(layer) == KT_OK, "params_changed");
  return l;
}

// One process, 4 steps: LoRA factors after the last, y of the last step.
struct Uninterrupted {
  Lora lora;
  TensorPtr y_last;
};

Uninterrupted run_uninterrupted(const Problem& pb, kt_engine* engine) {
  const Data d = make_data(pb);
  kt_moe_options mo = layer_options(pb, pb.total());
  kt_moe* one = nullptr;
  RCHECK(kt_moe_create(engine, &mo, &one) == KT_OK, "one-process layer");
  std::vector<int64_t> all(static_cast<size_t>(pb.E));
  for (int64_t e = 0; e < pb.E; ++e) all[static_cast<size_t>(e)] = e;
  std::vector<kt_arg> load;
  for (int p = 0; p < 3; ++p) load.push_back({KT_ARG_W_GATE + p, d.w[p]->dl()});
  RCHECK(kt_moe_load_weights(one, nullptr, load.data(), load.size()) == KT_OK, "load");
  Uninterrupted u;
  u.lora = bind_lora(one, pb, &d, all);
  kt_optimizer* opt = make_optimizer(one);
  for (int s = 1; s <= kLastStep; ++s) {
    const Data sd = step_data(pb, s);
    Outputs out = outputs_for(pb, pb.total());
    kt_arg f[] = {{KT_ARG_X, sd.x->dl()}, {KT_ARG_IDS, sd.ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, sd.rw->dl()},
                  {KT_ARG_Y, out.y->dl()}};
    kt_context* ctx = nullptr;
    RCHECK(kt_moe_forward(one, f, 4, &ctx) == KT_OK, "forward");
    kt_arg b[] = {{KT_ARG_DY, sd.dy->dl()}};
    RCHECK(kt_moe_backward(one, ctx, nullptr, b, 1) == KT_OK, "backward");
    kt_context_release(ctx);
    RCHECK(kt_optimizer_step(opt, nullptr) == KT_OK, "step");
    u.y_last = std::move(out.y);
  }
  kt_optimizer_destroy(opt);
  kt_moe_destroy(one);
  return u;
}

// One rank of the distributed run.
struct TrainRank {
  kt_comm* comm = nullptr;
  kt_dist_moe* dist = nullptr;
  kt_moe* local = nullptr;
  kt_optimizer* opt = nullptr;
  std::vector<int64_t> mine;
  Lora lora;
  TensorPtr y;  // this rank's y of the last step run
};

// fresh: an empty layer with zero LoRA factors, for a checkpoint to fill.
// comm: one to reuse, or null for a new one.
TrainRank start_rank(const Problem& pb, int rank, int world, const std::string& dir, kt_engine* engine, bool fresh,
                     kt_comm* comm = nullptr) {
  TrainRank t;
  t.comm = comm ? comm : make_comm(rank, world, dir, pb.timeout_ms);
  if (!t.comm) return t;
  kt_moe_options mo = layer_options(pb, pb.tokens[0]);
  const kt_dist_moe_options dopt = dist_options(pb);
  RCHECK(kt_dist_moe_create(t.comm, engine, &mo, &dopt, &t.dist) == KT_OK, "kt_dist_moe_create");
  kt_dist_moe_layer(t.dist, &t.local);
  int64_t n = 0;
  t.mine.resize(static_cast<size_t>(pb.E));
  kt_dist_moe_local_experts(t.dist, t.mine.data(), pb.E, &n);
  t.mine.resize(static_cast<size_t>(n));
  if (!t.local) return t;
  const Data d = make_data(pb);
  if (!fresh) {
    std::vector<kt_arg> load;
    TensorPtr w[3];
    for (int p = 0; p < 3; ++p) {
      w[p] = pick_experts(*d.w[p], t.mine);
      load.push_back({KT_ARG_W_GATE + p, w[p]->dl()});
    }
    RCHECK(kt_moe_load_weights(t.local, nullptr, load.data(), load.size()) == KT_OK, "load");
  }
  t.lora = bind_lora(t.local, pb, fresh ? nullptr : &d, t.mine);
  t.opt = make_optimizer(t.local);
  return t;
}

void train_step(TrainRank& t, const Problem& pb, int rank, int s) {
  const Data sd = step_data(pb, s);
  const int64_t T = pb.tokens[static_cast<size_t>(rank)], t0 = pb.first(rank);
  Rows x(*sd.x, t0, T), ids(*sd.ids, t0, T), rw(*sd.rw, t0, T), dy(*sd.dy, t0, T);
  Outputs out = outputs_for(pb, T);
  kt_arg f[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, &ids.t}, {KT_ARG_ROUTE_WEIGHTS, &rw.t}, {KT_ARG_Y, out.y->dl()}};
  kt_dist_context* ctx = nullptr;
  RCHECK(kt_dist_moe_forward(t.dist, f, 4, &ctx) == KT_OK, "kt_dist_moe_forward");
  kt_arg b[] = {{KT_ARG_DY, &dy.t}};
  RCHECK(kt_dist_moe_backward(t.dist, ctx, nullptr, b, 1) == KT_OK, "kt_dist_moe_backward");
  kt_dist_context_release(ctx);
  if (t.opt) RCHECK(kt_optimizer_step(t.opt, nullptr) == KT_OK, "optimizer step");
  t.y = std::move(out.y);
}

void end_rank(TrainRank& t, bool keep_comm = false) {
  kt_optimizer_destroy(t.opt);
  kt_dist_moe_destroy(t.dist);
  if (!keep_comm) kt_comm_destroy(t.comm);
}

std::string checkpoint_dir() {
  const char* d = std::getenv("KT_TEST_CKPT_DIR");
  return std::string(d ? d : "/nonexistent") + "/ckpt";
}

kt_status save_or_load(TrainRank& t, bool save, const kt_dist_ckpt_options* o = nullptr) {
  const kt_dist_ckpt_layer L = {kCheckpointLayer, t.dist, t.opt};
  const std::string dir = checkpoint_dir();
  return save ? kt_dist_ckpt_save(t.comm, dir.c_str(), &L, 1, o) : kt_dist_ckpt_load(t.comm, dir.c_str(), &L, 1, o);
}

// Steps 1-2, then the checkpoint.
int run_ckpt_save(kt_dist_mode mode, kt_mode layer_mode, int rank, int world, const std::string& dir) {
  const Problem pb = ckpt_problem(world, mode, layer_mode);
  const bool computes = mode == KT_DIST_EXPERT_PARALLEL || rank == pb.owner;
  kt_engine* engine = computes ? make_engine() : nullptr;
  TrainRank t = start_rank(pb, rank, world, dir, engine, false);
  if (!t.comm) return 1;
  for (int s = 1; s <= kSavedStep; ++s) train_step(t, pb, rank, s);
  int64_t calls = 0, last = 0, total = 0;
  struct Count {
    int64_t *calls, *last, *total;
  } count{&calls, &last, &total};
  kt_dist_ckpt_options o;
  kt_dist_ckpt_options_init(&o);
  o.progress = [](int64_t done, int64_t all, void* user) {
    Count* c = static_cast<Count*>(user);
    ++*c->calls;
    *c->last = done;
    *c->total = all;
  };
  o.progress_user = &count;
  RCHECK(save_or_load(t, true, &o) == KT_OK, "kt_dist_ckpt_save");
  RCHECK(t.local == nullptr || (calls > 0 && last == total && total > 0), "progress reached the whole file");
  end_rank(t);
  if (engine) RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// Loads the checkpoint into empty layers, runs steps 3-4, compares with
// one process's uninterrupted run.
int run_ckpt_resume(kt_dist_mode mode, bool explicit_map, kt_mode layer_mode, int rank, int world,
                    const std::string& dir) {
  Problem pb = ckpt_problem(world, mode, layer_mode);
  if (explicit_map)
    for (int64_t e = 0; e < pb.E; ++e) pb.expert_ranks.push_back(static_cast<int32_t>((e * 5 + 2) % world));
  const bool computes = mode == KT_DIST_EXPERT_PARALLEL || rank == pb.owner;
  kt_engine* engine = make_engine();
  const Uninterrupted ref = run_uninterrupted(pb, engine);
  TrainRank t = start_rank(pb, rank, world, dir, computes ? engine : nullptr, true);
  if (!t.comm) return 1;
  if (t.local) {
    int64_t loaded = -1;
    kt_moe_num_loaded(t.local, &loaded);
    RCHECK(loaded == 0, "the layer starts empty");
  }
  RCHECK(save_or_load(t, false) == KT_OK, "kt_dist_ckpt_load");
  if (t.opt) {
    int64_t step = -1;
    kt_optimizer_get_step(t.opt, &step);
    RCHECK(step == kSavedStep, "the optimizer resumes at the saved step: " + std::to_string(step));
    kt_optimizer_options oo;
    oo.struct_size = sizeof(oo);
    kt_optimizer_get_options(t.opt, &oo);
    RCHECK(oo.lr == 1e-2, "the saved learning rate");
  }
  for (int s = kSavedStep + 1; s <= kLastStep; ++s) train_step(t, pb, rank, s);
  const int64_t T = pb.tokens[static_cast<size_t>(rank)], t0 = pb.first(rank);
  RCHECK(same_bytes(t.y->bytes.data(), ref.y_last->bytes.data() + static_cast<size_t>(t0 * pb.H) * 4,
                    static_cast<size_t>(T * pb.H) * 4),
         "y of the last step is the uninterrupted run's, bit for bit");
  for (int i = 0; t.local && i < 6; ++i) {
    if (!t.lora.f[i]) continue;
    const TensorPtr expected = pick_experts(*ref.lora.f[i], t.mine);
    RCHECK(same_bytes(t.lora.f[i]->bytes.data(), expected->bytes.data(), static_cast<size_t>(expected->numel()) * 4),
           "trainable parameter " + std::to_string(i) + " after the last step is the uninterrupted run's, bit for bit");
  }
  end_rank(t);
  RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// Resumes from the checkpoint, runs step 3, and saves again; rank 1 is
// killed halfway through writing its file. The others return KT_ERR_COMM;
// the checkpoint in place stays the one of step 2.
int run_ckpt_killed_mid_save(int rank, int world, const std::string& dir) {
  Problem pb = ckpt_problem(world, KT_DIST_EXPERT_PARALLEL);
  pb.timeout_ms = 3000;
  kt_engine* engine = make_engine();
  TrainRank t = start_rank(pb, rank, world, dir, engine, true);
  if (!t.comm) return 1;
  RCHECK(save_or_load(t, false) == KT_OK, "kt_dist_ckpt_load");
  train_step(t, pb, rank, kSavedStep + 1);
  kt_dist_ckpt_options o;
  kt_dist_ckpt_options_init(&o);
  if (rank == 1)
    o.progress = [](int64_t done, int64_t total, void*) {
      if (2 * done >= total) kill(getpid(), SIGKILL);
    };
  const kt_status st = save_or_load(t, true, &o);
  const std::string msg = kt_last_error();
  RCHECK(st == KT_ERR_COMM, "a rank dying mid-save is KT_ERR_COMM on the others: " + msg);
  RCHECK(contains(msg, "kt_dist_ckpt_save"), msg);
  end_rank(t);
  RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// Checkpoints that do not fit the layers are refused on every rank, with
// the same message, and nothing changes.
int run_ckpt_mismatch(int rank, int world, const std::string& dir) {
  Problem pb = ckpt_problem(world, KT_DIST_EXPERT_PARALLEL);
  kt_engine* engine = make_engine();
  kt_comm* comm = make_comm(rank, world, dir, pb.timeout_ms);
  if (!comm) return 1;
  {
    Problem other = pb;
    other.H = 32;
    TrainRank t = start_rank(other, rank, world, dir, engine, false, comm);
    std::vector<int64_t> local_ids(t.mine.size());
    for (size_t i = 0; i < local_ids.size(); ++i) local_ids[i] = static_cast<int64_t>(i);
    const TensorPtr before = pick_experts(*t.lora.f[0], local_ids);
    const kt_status st = save_or_load(t, false);
    const std::string msg = kt_last_error();
    RCHECK(st == KT_ERR_SHAPE && contains(msg, "kt_dist_ckpt_load: rank 0: ") &&
               contains(msg, "layer 3: saved with hidden (H) = 48, this layer has 32"),
           msg);
    expect_same_message_everywhere(comm, msg);
    RCHECK(same_bytes(t.lora.f[0]->bytes.data(), before->bytes.data(), static_cast<size_t>(before->numel()) * 4),
           "nothing changed");
    int64_t step = -1;
    kt_optimizer_get_step(t.opt, &step);
    RCHECK(step == 0, "the optimizer is as it was");
    end_rank(t, true);
  }
  {
    Problem other = pb;
    other.lora_rank = 8;
    TrainRank t = start_rank(other, rank, world, dir, engine, false, comm);
    const kt_status st = save_or_load(t, false);
    const std::string msg = kt_last_error();
    RCHECK(st == KT_ERR_SHAPE && contains(msg, "saved with lora_rank = 4, this layer has 8"), msg);
    expect_same_message_everywhere(comm, msg);
    end_rank(t, true);
  }
  {
    TrainRank t = start_rank(pb, rank, world, dir, engine, false, comm);
    // A layer number the checkpoint lacks, on one rank only: the ranks disagree.
    const kt_dist_ckpt_layer L = {rank == world - 1 ? 7 : kCheckpointLayer, t.dist, t.opt};
    const std::string d = checkpoint_dir();
    kt_status st = kt_dist_ckpt_load(comm, d.c_str(), &L, 1, nullptr);
    std::string msg = kt_last_error();
    RCHECK(st == KT_ERR_INVALID_ARGUMENT && contains(msg, "holds no layer 7"), msg);
    expect_same_message_everywhere(comm, msg);
    // One rank's optimizer is missing while options->parts asks for it.
    kt_dist_ckpt_options o;
    kt_dist_ckpt_options_init(&o);
    o.parts = KT_DIST_CKPT_ADAPTER | KT_DIST_CKPT_OPTIMIZER;
    const kt_dist_ckpt_layer L2 = {kCheckpointLayer, t.dist, rank == 0 ? nullptr : t.opt};
    st = kt_dist_ckpt_save(comm, d.c_str(), &L2, 1, &o);
    msg = kt_last_error();
    RCHECK(st == KT_ERR_NULL_POINTER && contains(msg, "rank 0: ") && contains(msg, "layers[0].optimizer is NULL"), msg);
    expect_same_message_everywhere(comm, msg);
    o.parts = 8;
    st = kt_dist_ckpt_save(comm, d.c_str(), &L2, 1, &o);
    RCHECK(st == KT_ERR_INVALID_ARGUMENT && contains(kt_last_error(), "options->parts = 8"), kt_last_error());
    // The communicator is still usable: the checkpoint loads.
    RCHECK(save_or_load(t, false) == KT_OK, "a load after the refusals");
    int64_t step = -1;
    kt_optimizer_get_step(t.opt, &step);
    RCHECK(step == kSavedStep, "the optimizer's step after the load");
    end_rank(t, true);
  }
  kt_comm_destroy(comm);
  RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

// Expert parallel, with routes past the dispatch's first message: a failure
// on one rank's arguments, X's dtype, backward options or context still
// reaches every rank as the same error (the others' rows to it are taken in
// first), and the calls after it work.
int run_expert_parallel_refusals(int rank, int world, const std::string& dir) {
  Problem pb;
  pb.dist_mode = KT_DIST_EXPERT_PARALLEL;
  pb.mode = KT_MODE_LORA;
  const int64_t T = 150;
  pb.tokens.assign(static_cast<size_t>(world), T);
  const Data d = make_data(pb);
  kt_engine* engine = make_engine();
  TrainRank t = start_rank(pb, rank, world, dir, engine, false);
  if (!t.comm) return 1;
  kt_comm* comm = t.comm;
  kt_dist_moe* dist = t.dist;
  const int64_t t0 = pb.first(rank);
  Rows x(*d.x, t0, T), rw(*d.rw, t0, T), dy(*d.dy, t0, T);
  TensorPtr ids = Tensor::make(kt_test::kI32, {T, pb.K});
  for (int64_t i = 0; i < T * pb.K; ++i) ids->set(i, d.ids->get(t0 * pb.K + i));
  Outputs out = outputs_for(pb, T);
  kt_arg f[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, &rw.t}, {KT_ARG_Y, out.y->dl()}};
  const int bad = world - 1;

  // 1. The last rank routes to an expert that does not exist.
  if (rank == bad) ids->set(T * pb.K - 1, 99.0);
  kt_status st = kt_dist_moe_forward(dist, f, 4, nullptr);
  std::string msg = kt_last_error();
  RCHECK(st == KT_ERR_EXPERT_ID && contains(msg, "kt_dist_moe_forward: rank " + std::to_string(bad) + ": ") &&
             contains(msg, "= 99 is outside"),
         msg);
  expect_same_message_everywhere(comm, msg);
  if (rank == bad) ids->set(T * pb.K - 1, d.ids->get((t0 + T) * pb.K - 1));

  // 2. The last rank's X (and Y) are bf16: its rows are half as long.
  TensorPtr x16 = Tensor::make(kt_test::kBF16, {T, pb.H}), y16 = Tensor::make(kt_test::kBF16, {T, pb.H});
  for (int64_t i = 0; i < T * pb.H; ++i) x16->set(i, d.x->get(t0 * pb.H + i));
  kt_arg f16[] = {{KT_ARG_X, rank == bad ? x16->dl() : &x.t}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, &rw.t},
                  {KT_ARG_Y, rank == bad ? y16->dl() : out.y->dl()}};
  st = kt_dist_moe_forward(dist, f16, 4, nullptr);
  msg = kt_last_error();
  RCHECK(st == KT_ERR_DTYPE && contains(msg, "disagree on KT_ARG_X's dtype"), msg);
  expect_same_message_everywhere(comm, msg);

  // 3. Backward options that differ on the last rank, then calls that work.
  kt_dist_context* ctx = nullptr;
  RCHECK(kt_dist_moe_forward(dist, f, 4, &ctx) == KT_OK, "forward after the refusals");
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  bo.grad_scale = rank == bad ? 0.5f : 1.f;
  kt_arg b[] = {{KT_ARG_DY, &dy.t}, {KT_ARG_DX, out.dx->dl()}};
  st = kt_dist_moe_backward(dist, ctx, &bo, b, 2);
  msg = kt_last_error();
  RCHECK(st == KT_ERR_INVALID_ARGUMENT && contains(msg, "options->grad_scale"), msg);
  expect_same_message_everywhere(comm, msg);
  RCHECK(kt_dist_moe_backward(dist, ctx, nullptr, b, 2) == KT_OK, "backward after the refusal");
  kt_dist_context_release(ctx);

  // 4. A context released on the last rank (it sends no rows; the others do).
  RCHECK(kt_dist_moe_forward(dist, f, 4, &ctx) == KT_OK, "forward");
  if (rank == bad) kt_dist_context_release(ctx);
  st = kt_dist_moe_backward(dist, ctx, nullptr, b, 2);
  msg = kt_last_error();
  RCHECK(st == KT_ERR_CONTEXT && contains(msg, "rank " + std::to_string(bad) + ": ") && contains(msg, "not a live"), msg);
  expect_same_message_everywhere(comm, msg);
  if (rank != bad) kt_dist_context_release(ctx);
  end_rank(t);
  RCHECK(kt_engine_destroy(engine) == KT_OK, "engine destroy");
  return g_failures ? 1 : 0;
}

Problem scenario(const std::string& name, int world) {
  Problem pb;
  for (int r = 0; r < world; ++r) pb.tokens.push_back(3 + 2 * r);
  if (name == "owner_lora_bf16") {
    pb.mode = KT_MODE_LORA;
    pb.bf16 = true;
    pb.average = KT_DIST_GRAD_MEAN;
  } else if (name == "owner_full_bias_zero_tokens") {
    pb.mode = KT_MODE_FULL;
    pb.bias = true;
    pb.act = KT_ACT_SWIGLU_OAI;
    pb.limit = 2.f;
    pb.ids64 = true;
    pb.minus_one_every = 5;
    pb.owner = world - 1;
    pb.tokens[1] = 0;
    pb.grad_scale = 0.5f;
  } else if (name == "owner_many_tokens") {
    // Rows past the first message's 16 KiB (400 bytes a token): each rank
    // sends the rest in a second one; the owner is a middle rank.
    pb.mode = KT_MODE_LORA;
    pb.H = 96;
    pb.owner = 1;
    for (int r = 0; r < world; ++r) pb.tokens[static_cast<size_t>(r)] = 70 + 9 * r;
  } else if (name == "ep_full_even") {
    pb.dist_mode = KT_DIST_EXPERT_PARALLEL;
    pb.mode = KT_MODE_FULL;
    pb.bf16 = true;
    pb.K = 3;
    pb.average = KT_DIST_GRAD_MEAN;
  } else if (name == "ep_lora_map") {
    pb.dist_mode = KT_DIST_EXPERT_PARALLEL;
    pb.mode = KT_MODE_LORA;
    pb.E = 7;
    pb.K = 4;  // fp32 sums of up to 4 routes: the summation order shows in the bits
    pb.ids64 = true;
    pb.minus_one_every = 4;
    pb.tokens[1] = 0;
    pb.grad_scale = 2.f;
    for (int64_t e = 0; e < pb.E; ++e) pb.expert_ranks.push_back(static_cast<int32_t>((e * 3 + 1) % world));
  } else if (name == "ep_many_tokens") {
    // Routes past the dispatch's first message (16 KiB, 200 bytes a route,
    // 192 a dy row) from ranks 1 and 2, within it from rank 0; rank 1's
    // tokens route among experts 0-3 only, so it sends rank 2 no route.
    pb.dist_mode = KT_DIST_EXPERT_PARALLEL;
    pb.mode = KT_MODE_LORA;
    pb.K = 3;
    pb.narrow_rank = 1;
    pb.tokens = {5, 160, 170};
  } else if (name == "ep_bias_inference") {
    pb.dist_mode = KT_DIST_EXPERT_PARALLEL;
    pb.bias = true;
    pb.E = 3;  // fewer experts than 4 ranks: a rank holds none
    pb.K = 2;
  } else {
    pb.tokens.clear();
  }
  return pb;
}

}  // namespace

int rank_main(const std::string& name, int rank, int world, const std::string& dir) {
  if (name == "fail_arguments") return run_argument_failures(rank, world, dir);
  if (name == "fail_compute") return run_compute_failure(rank, world, dir);
  if (name == "fail_expert_parallel") return run_expert_parallel_refusals(rank, world, dir);
  if (name == "fail_config") return run_config_mismatch(rank, world, dir);
  if (name == "kill_owner") return run_killed_rank(KT_DIST_OWNER, rank, world, dir, false);
  if (name == "kill_expert_parallel") return run_killed_rank(KT_DIST_EXPERT_PARALLEL, rank, world, dir, false);
  if (name == "stall_owner") return run_killed_rank(KT_DIST_OWNER, rank, world, dir, true);
  if (name == "ckpt_save_ep") return run_ckpt_save(KT_DIST_EXPERT_PARALLEL, KT_MODE_LORA, rank, world, dir);
  if (name == "ckpt_save_owner") return run_ckpt_save(KT_DIST_OWNER, KT_MODE_LORA, rank, world, dir);
  if (name == "ckpt_save_ep_full") return run_ckpt_save(KT_DIST_EXPERT_PARALLEL, KT_MODE_FULL, rank, world, dir);
  if (name == "ckpt_resume_ep") return run_ckpt_resume(KT_DIST_EXPERT_PARALLEL, false, KT_MODE_LORA, rank, world, dir);
  if (name == "ckpt_resume_ep_map")
    return run_ckpt_resume(KT_DIST_EXPERT_PARALLEL, true, KT_MODE_LORA, rank, world, dir);
  if (name == "ckpt_resume_owner") return run_ckpt_resume(KT_DIST_OWNER, false, KT_MODE_LORA, rank, world, dir);
  if (name == "ckpt_resume_owner_full") return run_ckpt_resume(KT_DIST_OWNER, false, KT_MODE_FULL, rank, world, dir);
  if (name == "ckpt_killed_mid_save") return run_ckpt_killed_mid_save(rank, world, dir);
  if (name == "ckpt_mismatch") return run_ckpt_mismatch(rank, world, dir);
  const Problem pb = scenario(name, world);
  if (pb.tokens.empty()) {
    std::fprintf(stderr, "unknown scenario %s\n", name.c_str());
    return 2;
  }
  return run_matches_one_process(pb, rank, world, dir);
}

}  // namespace kt_dist_test
