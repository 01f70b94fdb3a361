// kt_dist_bench: the owner-rank overhead on loopback. Rank 0 (the owner)
// and W-1 other ranks (forked processes) run kt_dist_moe_forward with T
// tokens each; the owner also runs one plain kt_moe_forward of the same W*T
// tokens on the same engine, side by side in the same run. Reported per T:
// both times, the overhead per call, the bytes the call moves over the
// loopback (from the wire format: x/ids/weights rows to the owner, y rows
// back, 1 KiB outcome headers) and those bytes divided by the loopback
// bandwidth measured in-run (a kt_comm_allgather of 16 MiB per rank).
// --mode expert times an expert-parallel layer instead (each rank holds
// E/W experts and computes the routes sent to it); rank 0's plain forward
// stays as the reference.
//   kt_dist_bench [--world W] [--tokens 1,32,512] [--iters N] [--threads n] [--hidden H]
//                 [--intermediate I] [--experts E] [--top-k K] [--mode owner|expert]
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kt_c_api.h"

namespace {

struct Options {
  int world = 2;
  std::vector<int64_t> tokens = {1, 32, 512};
  int iters = 20;
  int threads = 0;  // the owner's engine; 0 = one per CPU
  int64_t H = 2048, I = 768, E = 8, K = 8;  // Qwen3-30B-A3B expert shapes, 8 of its 128 experts
  bool expert_parallel = false;
};

void die(const char* what) {
  std::fprintf(stderr, "kt_dist_bench: %s: %s\n", what, kt_last_error());
  std::exit(1);
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Tensor2 {
  std::vector<unsigned char> bytes;
  int64_t shape[2];
  DLTensor t{};
  Tensor2(DLDataType dt, int64_t a, int64_t b) : bytes(static_cast<size_t>(a * b * dt.bits / 8) + 8), shape{a, b} {
    t.data = bytes.data();
    t.device = {kDLCPU, 0};
    t.ndim = 2;
    t.dtype = dt;
    t.shape = shape;
  }
};

constexpr DLDataType kBF16{kDLBfloat, 16, 1};
constexpr DLDataType kF32{kDLFloat, 32, 1};
constexpr DLDataType kI32{kDLInt, 32, 1};

void fill(Tensor2& x, Tensor2& ids, Tensor2& w, int64_t E, uint32_t seed) {
  std::mt19937 rng(seed);
  uint16_t* xb = reinterpret_cast<uint16_t*>(x.bytes.data());
  for (int64_t i = 0; i < x.shape[0] * x.shape[1]; ++i) xb[i] = static_cast<uint16_t>(0x3f00 + rng() % 256);
  int32_t* id = reinterpret_cast<int32_t*>(ids.bytes.data());
  float* wt = reinterpret_cast<float*>(w.bytes.data());
  std::vector<int32_t> perm(static_cast<size_t>(E));
  for (int64_t t = 0; t < ids.shape[0]; ++t) {
    for (int64_t e = 0; e < E; ++e) perm[static_cast<size_t>(e)] = static_cast<int32_t>(e);
    std::shuffle(perm.begin(), perm.end(), rng);
    for (int64_t j = 0; j < ids.shape[1]; ++j) {
      id[t * ids.shape[1] + j] = perm[static_cast<size_t>(j)];
      wt[t * ids.shape[1] + j] = 1.f / static_cast<float>(ids.shape[1]);
    }
  }
}

// Loads the same bf16 pattern into each of a layer's n experts.
void load_weights(kt_moe* m, int64_t n, const Options& o) {
  Tensor2 wg(kBF16, n * o.I, o.H), wu(kBF16, n * o.I, o.H), wd(kBF16, n * o.H, o.I);
  int64_t sg[3] = {n, o.I, o.H}, sd[3] = {n, o.H, o.I};
  wg.t.ndim = wu.t.ndim = wd.t.ndim = 3;
  wg.t.shape = wu.t.shape = sg;
  wd.t.shape = sd;
  for (Tensor2* w : {&wg, &wu, &wd}) {
    uint16_t* b = reinterpret_cast<uint16_t*>(w->bytes.data());
    for (size_t i = 0; i < w->bytes.size() / 2; ++i) b[i] = static_cast<uint16_t>(0x3c00 + i % 251);
  }
  const kt_arg load[] = {{KT_ARG_W_GATE, &wg.t}, {KT_ARG_W_UP, &wu.t}, {KT_ARG_W_DOWN, &wd.t}};
  if (kt_moe_load_weights(m, nullptr, load, 3) != KT_OK) die("load");
}

// Bytes an owner-rank forward moves: per other rank, to the owner its
// outcome (1 KiB), head (16 B) and rows, the first message padded to 16 KiB
// of rows; back the relay (8 B + 1 KiB) and its y rows.
int64_t owner_bytes(const Options& o, int64_t T) {
  const int64_t row = o.H * 2;
  const int64_t to_owner = 1024 + 16 + std::max<int64_t>(T * (row + o.K * 8), 16384);
  return (o.world - 1) * (to_owner + 8 + 1024 + T * row);
}

// Bytes an expert-parallel forward moves into each rank, from each other
// rank (fill routes every token to k distinct experts; with E = k a rank
// gets T*k/W of another's routes, which the count assumes): its dispatch (1
// KiB outcome, 16 B head, the routes' bf16 x rows with expert and weight,
// the first message padded to max(16 KiB, k routes) of routes), and back 1
// KiB of outcome and fp32 rows.
int64_t expert_bytes(const Options& o, int64_t T) {
  const int64_t routes = T * o.K / o.world, route = o.H * 2 + 8;
  const int64_t first = std::max<int64_t>(16384, o.K * route);
  return (o.world - 1) * (1024 + 16 + std::max(routes * route, first) + 1024 + routes * o.H * 4);
}

int run_rank(const Options& o, int rank, const std::string& dir) {
  kt_comm_options co;
  kt_comm_options_init(&co);
  co.rank = rank;
  co.world_size = o.world;
  co.store_path = dir.c_str();
  co.timeout_ms = 120000;
  kt_comm* comm = nullptr;
  if (kt_comm_create(&co, &comm) != KT_OK) die("kt_comm_create");

  // Loopback bandwidth: an allgather of 16 MiB per rank.
  const int64_t chunk = 16 << 20;
  std::vector<unsigned char> in(static_cast<size_t>(chunk), 1), out(static_cast<size_t>(chunk * o.world));
  int64_t s1[1] = {chunk}, s2[2] = {o.world, chunk};
  DLTensor ti{}, to{};
  ti.data = in.data();
  ti.device = {kDLCPU, 0};
  ti.ndim = 1;
  ti.dtype = {kDLUInt, 8, 1};
  ti.shape = s1;
  to = ti;
  to.data = out.data();
  to.ndim = 2;
  to.shape = s2;
  if (kt_comm_allgather(comm, &ti, &to) != KT_OK) die("allgather");
  double best_bw = 0;
  for (int i = 0; i < 5; ++i) {
    const double t0 = now_s();
    if (kt_comm_allgather(comm, &ti, &to) != KT_OK) die("allgather");
    // Each rank receives (W-1) chunks.
    best_bw = std::max(best_bw, static_cast<double>(chunk * (o.world - 1)) / (now_s() - t0));
  }

  // Loopback latency: the median of 50 barriers.
  std::vector<double> barriers;
  for (int i = 0; i < 50; ++i) {
    const double t0 = now_s();
    if (kt_comm_barrier(comm) != KT_OK) die("barrier");
    barriers.push_back(now_s() - t0);
  }
  std::sort(barriers.begin(), barriers.end());

  kt_engine* engine = nullptr;
  if (rank == 0 || o.expert_parallel) {
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.verbosity = 0;
    eo.num_threads = o.threads;
    if (kt_engine_create(&eo, &engine) != KT_OK) die("engine");
  }
  const int64_t maxT = *std::max_element(o.tokens.begin(), o.tokens.end());
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = o.E;
  mo.top_k = o.K;
  mo.hidden = o.H;
  mo.intermediate = o.I;
  mo.max_tokens = maxT;
  kt_dist_moe_options dopt;
  kt_dist_moe_options_init(&dopt);
  if (o.expert_parallel) dopt.mode = KT_DIST_EXPERT_PARALLEL;
  kt_dist_moe* dist = nullptr;
  if (kt_dist_moe_create(comm, engine, &mo, &dopt, &dist) != KT_OK) die("kt_dist_moe_create");
  kt_moe* local = nullptr;
  kt_dist_moe_layer(dist, &local);
  if (local) {
    int64_t n = 0;
    kt_dist_moe_local_experts(dist, nullptr, 0, &n);
    load_weights(local, n, o);
  }
  kt_moe* plain = nullptr;
  if (rank == 0) {
    mo.max_tokens = maxT * o.world;
    if (kt_moe_create(engine, &mo, &plain) != KT_OK) die("plain layer");
    load_weights(plain, o.E, o);
    std::printf("kt_dist_bench: %s forward, %d ranks on loopback Gloo, E=%lld k=%lld H=%lld I=%lld bf16, "
                "loopback bandwidth %.2f GB/s (allgather of 16 MiB per rank), barrier %.3f ms (median of 50)\n",
                o.expert_parallel ? "expert-parallel" : "owner-rank", o.world, static_cast<long long>(o.E),
                static_cast<long long>(o.K), static_cast<long long>(o.H), static_cast<long long>(o.I),
                best_bw / 1e9, barriers[barriers.size() / 2] * 1e3);
    std::printf("%6s %12s %12s %12s %10s %14s %14s\n", "T/rank", "one proc ms", "dist ms", "overhead ms",
                "overhead", "bytes moved", "bytes/bw ms");
  }
  for (int64_t T : o.tokens) {
    Tensor2 x(kBF16, T, o.H), ids(kI32, T, o.K), w(kF32, T, o.K), y(kBF16, T, o.H);
    fill(x, ids, w, o.E, static_cast<uint32_t>(rank * 1000 + T));
    const kt_arg f[] = {{KT_ARG_X, &x.t}, {KT_ARG_IDS, &ids.t}, {KT_ARG_ROUTE_WEIGHTS, &w.t}, {KT_ARG_Y, &y.t}};
    const int64_t total = T * o.world;
    Tensor2 xa(kBF16, total, o.H), ida(kI32, total, o.K), wa(kF32, total, o.K), ya(kBF16, total, o.H);
    fill(xa, ida, wa, o.E, static_cast<uint32_t>(7 + T));
    const kt_arg fa[] = {{KT_ARG_X, &xa.t}, {KT_ARG_IDS, &ida.t}, {KT_ARG_ROUTE_WEIGHTS, &wa.t}, {KT_ARG_Y, &ya.t}};
    // Alternating, so both see the same machine state; medians.
    std::vector<double> one, owner;
    for (int i = 0; i < o.iters + 2; ++i) {
      if (rank == 0) {
        const double t0 = now_s();
        if (kt_moe_forward(plain, fa, 4, nullptr) != KT_OK) die("plain forward");
        if (i >= 2) one.push_back(now_s() - t0);
      }
      if (kt_comm_barrier(comm) != KT_OK) die("barrier");
      const double t0 = now_s();
      if (kt_dist_moe_forward(dist, f, 4, nullptr) != KT_OK) die("kt_dist_moe_forward");
      if (i >= 2) owner.push_back(now_s() - t0);
    }
    if (rank != 0) continue;
    std::sort(one.begin(), one.end());
    std::sort(owner.begin(), owner.end());
    const double a = one[one.size() / 2], b = owner[owner.size() / 2];
    const double bytes = static_cast<double>(o.expert_parallel ? expert_bytes(o, T) : owner_bytes(o, T));
    std::printf("%6lld %12.3f %12.3f %12.3f %9.1f%% %14.0f %14.3f\n", static_cast<long long>(T), a * 1e3, b * 1e3,
                (b - a) * 1e3, 100.0 * (b - a) / a, bytes, bytes / best_bw * 1e3);
  }
  kt_dist_moe_destroy(dist);
  kt_moe_destroy(plain);
  if (engine) kt_engine_destroy(engine);
  kt_comm_destroy(comm);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string a = argv[i], v = argv[i + 1];
    if (a == "--world") o.world = std::atoi(v.c_str());
    else if (a == "--iters") o.iters = std::atoi(v.c_str());
    else if (a == "--threads") o.threads = std::atoi(v.c_str());
    else if (a == "--hidden") o.H = std::atoll(v.c_str());
    else if (a == "--intermediate") o.I = std::atoll(v.c_str());
    else if (a == "--experts") o.E = std::atoll(v.c_str());
    else if (a == "--top-k") o.K = std::atoll(v.c_str());
    else if (a == "--mode" && (v == "owner" || v == "expert")) o.expert_parallel = v == "expert";
    else if (a == "--tokens") {
      o.tokens.clear();
      size_t p = 0;
      while (p < v.size()) {
        const size_t q = v.find(',', p);
        o.tokens.push_back(std::atoll(v.substr(p, q - p).c_str()));
        p = q == std::string::npos ? v.size() : q + 1;
      }
    } else {
      std::fprintf(stderr, "kt_dist_bench: unknown option %s\n", a.c_str());
      return 2;
    }
  }
  if (o.world < 2 || o.iters < 1 || o.tokens.empty() || o.K > o.E) {
    std::fprintf(stderr, "kt_dist_bench: needs --world >= 2, --iters >= 1, tokens, top-k <= experts\n");
    return 2;
  }
  char templ[] = "/tmp/kt_dist_bench_XXXXXX";
  if (!mkdtemp(templ)) return 1;
  const std::string dir = templ;
  std::vector<pid_t> children;
  for (int r = 1; r < o.world; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(run_rank(o, r, dir));
    children.push_back(pid);
  }
  const int rc = run_rank(o, 0, dir);
  int bad = 0;
  for (pid_t p : children) {
    int status = 0;
    waitpid(p, &status, 0);
    bad += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  const std::string rm = "rm -rf '" + dir + "'";
  if (std::system(rm.c_str()) != 0) std::fprintf(stderr, "kt_dist_bench: could not remove %s\n", dir.c_str());
  return rc || bad ? 1 : 0;
}
