// NUMA inside one engine. On the machine's own nodes (whatever they are):
// discovery covers the affinity mask, kt_engine_get_info reports them, and
// KT_NUMA_AUTO gives the same bits as KT_NUMA_OFF. On a simulated topology
// (the machine's CPUs split into two nodes, given through
// kt::engine_create_on): workers and experts are split by node, each
// expert's weights are asked to live on the node whose workers compute it,
// only those workers run its GEMMs, and the bits are still those of
// KT_NUMA_OFF. Memory binding itself is checked on node 0, which every
// machine has. Linked with the library's objects (kt_internal).
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <memory>
#include <set>
#include <string>
#include <vector>

#if __has_include(<numaif.h>)
#include <numaif.h>
#define KT_TEST_NUMAIF 1
#endif

#include "api/engine_create.h"
#include "api/live.h"
#include "cases.h"
#include "harness.h"
#include "runtime/numa.h"
#include "runtime/thread_pool.h"

namespace kt_test {
namespace {

kt_engine* make_engine(kt_numa_mode mode, int threads, const kt::Topology* topology = nullptr) {
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = threads;
  eo.numa = mode;
  kt_engine* engine = nullptr;
  EXPECT_EQ(kt::engine_create_on(&eo, topology, &engine), KT_OK) << kt_last_error();
  return engine;
}

// The machine's CPUs in the affinity mask as two simulated nodes (one CPU
// each on a 2-CPU machine); both halves the same CPU where there is one.
kt::Topology two_simulated_nodes() {
  const std::vector<int> cpus = kt::allowed_cpus();
  kt::Topology t;
  t.simulated = true;
  const size_t half = std::max<size_t>(cpus.size() / 2, 1);
  t.nodes.push_back({0, std::vector<int>(cpus.begin(), cpus.begin() + static_cast<long>(half))});
  t.nodes.push_back({1, cpus.size() > 1 ? std::vector<int>(cpus.begin() + static_cast<long>(half), cpus.end())
                                        : cpus});
  return t;
}

// Layers that take every path of the forward and backward: LoRA, many
// tokens (token ranges), full mode with biases, decode, a quantized base
// at decode (whole experts) and at 6 tokens with int8 operands (forward).
std::vector<Case> numa_cases() {
  std::vector<Case> v;
  for (const Case& c : core_cases())
    if (c.name == "lora_r16" || c.name == "many_tokens" || c.name == "full_bias_swiglu" || c.name == "one_token" ||
        c.name == "skipped_experts" || c.name == "awkward_odd_dims")
      v.push_back(c);
  Case q = qwen3_30b_a3b_slice();
  q.name = "int4_g32_" + q.name;
  q.format = KT_FORMAT_INT4_G32;
  v.push_back(q);
  q.name = "int4_g32_decode";
  q.T = 1;
  v.push_back(q);
  q.name = "int8_channel_int8_compute";
  q.T = 6;
  q.format = KT_FORMAT_INT8_CHANNEL;
  q.compute = KT_COMPUTE_INT8;
  q.mode = KT_MODE_INFERENCE;
  v.push_back(q);
  return v;
}

// Forward (saving a context), then backward with every output; int8
// operands (inference only): the forward.
void forward_backward(Runner& run) {
  run.fill_inputs(100);
  if (run.c().compute == KT_COMPUTE_INT8) {
    ASSERT_EQ(run.forward(nullptr), KT_OK) << kt_last_error();
    return;
  }
  kt_context* ctx = nullptr;
  ASSERT_EQ(run.forward(&ctx), KT_OK) << kt_last_error();
  ASSERT_EQ(run.backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
  kt_context_release(ctx);
}

// Every host tensor after a forward and backward on an engine made by
// `make` (the runner's layer watched by `watch` when given).
Runner::Snapshot run_case(const Case& c, kt_engine* engine, kt::ExpertWorkers* watch = nullptr,
                          std::shared_ptr<kt_moe>* layer = nullptr) {
  Runner run(c, KT_ISA_AUTO, 2, KT_GEMM_NATIVE, engine);
  std::shared_ptr<kt_moe> m = kt::live_moe(run.moe(), "test");
  if (watch) m->watch_workers(watch);
  forward_backward(run);
  m->watch_workers(nullptr);
  if (layer) *layer = m;
  return run.snapshot();
}

TEST(NumaTopology, DiscoveryCoversTheAffinityMask) {
  const std::vector<int> cpus = kt::allowed_cpus();
  const kt::Topology t = kt::discover_topology(cpus);
  ASSERT_FALSE(t.nodes.empty());
  EXPECT_FALSE(t.simulated);
  std::vector<int> all;
  for (size_t n = 0; n < t.nodes.size(); ++n) {
    if (n > 0) {
      EXPECT_LT(t.nodes[n - 1].id, t.nodes[n].id);
    }
    EXPECT_FALSE(t.nodes[n].cpus.empty());
    all.insert(all.end(), t.nodes[n].cpus.begin(), t.nodes[n].cpus.end());
  }
  EXPECT_EQ(std::set<int>(all.begin(), all.end()), std::set<int>(cpus.begin(), cpus.end()));
  EXPECT_EQ(all.size(), cpus.size());
  std::printf("this machine: %zu NUMA node(s) in the affinity mask (libnuma %s)\n", t.nodes.size(),
              kt::numa_built() ? "built in" : "absent");
}

TEST(NumaLayout, WorkersAndExpertsInProportionToEachNode) {
  kt::Topology t;
  t.simulated = true;
  t.nodes = {{0, {0, 1}}, {3, {2, 3, 4, 5}}};
  const kt::NumaLayout six(t, 6);
  ASSERT_EQ(six.nodes(), 2);
  EXPECT_EQ(six.workers_per_node(), (std::vector<int>{2, 4}));
  EXPECT_EQ(six.worker_nodes(), (std::vector<int>{0, 0, 1, 1, 1, 1}));
  EXPECT_EQ(six.worker_cpus(), (std::vector<int>{0, 1, 2, 3, 4, 5}));
  EXPECT_EQ(six.node_id(1), 3);
  EXPECT_EQ(six.first_expert(0, 12), 0);
  EXPECT_EQ(six.first_expert(1, 12), 4);
  EXPECT_EQ(six.first_expert(2, 12), 12);
  for (int64_t e = 0; e < 12; ++e) EXPECT_EQ(six.expert_node(e, 12), e < 4 ? 0 : 1) << e;
  // More workers than CPUs: a node's CPUs are reused in turn.
  const kt::NumaLayout eight(t, 8);
  EXPECT_EQ(eight.workers_per_node(), (std::vector<int>{3, 5}));
  EXPECT_EQ(eight.worker_cpus(), (std::vector<int>{0, 1, 0, 2, 3, 4, 5, 2}));
  // Each node keeps a worker; one thread, or one node, is not split.
  EXPECT_EQ(kt::NumaLayout(t, 2).workers_per_node(), (std::vector<int>{1, 1}));
  EXPECT_FALSE(kt::NumaLayout(t, 1).split());
  kt::Topology three = t;
  three.nodes.push_back({5, {6}});
  EXPECT_EQ(kt::NumaLayout(three, 2).workers_per_node(), (std::vector<int>{1, 1}));
  kt::Topology one;
  one.nodes = {{0, {0, 1, 2}}};
  const kt::NumaLayout single(one, 3);
  EXPECT_FALSE(single.split());
  EXPECT_EQ(single.workers_per_node(), (std::vector<int>{3}));
  EXPECT_EQ(single.expert_node(7, 8), 0);
  std::vector<int> asked;
  std::vector<char> block(64);
  single.place_experts(block.data(), 8, 8, &asked);
  EXPECT_EQ(asked, std::vector<int>(8, -1));
}

TEST(NumaBind, PagesOfNodeZeroArePreferredThere) {
  if (!kt::numa_built()) GTEST_SKIP() << "built without libnuma: nothing is bound";
#if KT_TEST_NUMAIF
  const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  void* p = mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(p, MAP_FAILED);
  // Rounded inward: the partial first and last pages are left alone.
  ASSERT_TRUE(kt::bind_to_node(static_cast<char*>(p) + 1, 4 * page - 2, 0));
  static_cast<char*>(p)[page] = 1;
  int mode = -1;
  unsigned long mask[16] = {};
  ASSERT_EQ(get_mempolicy(&mode, mask, 16 * 8 * sizeof(unsigned long), static_cast<char*>(p) + page, MPOL_F_ADDR), 0);
  EXPECT_EQ(mode, MPOL_PREFERRED);
  EXPECT_EQ(mask[0] & 1ul, 1ul);
  ASSERT_EQ(get_mempolicy(&mode, mask, 16 * 8 * sizeof(unsigned long), p, MPOL_F_ADDR), 0);
  EXPECT_EQ(mode, MPOL_DEFAULT);
  munmap(p, 4 * page);
#else
  GTEST_SKIP() << "no numaif.h for the test";
#endif
}

TEST(NumaEngine, InfoReportsTheNodesInUse) {
  for (kt_numa_mode mode : {KT_NUMA_OFF, KT_NUMA_AUTO}) {
    kt_engine* engine = make_engine(mode, 2);
    ASSERT_NE(engine, nullptr);
    kt_engine_info info;
    info.struct_size = sizeof(info);
    ASSERT_EQ(kt_engine_get_info(engine, &info), KT_OK) << kt_last_error();
    const size_t machine = kt::discover_topology(kt::allowed_cpus()).nodes.size();
    const int expect = mode == KT_NUMA_AUTO && kt::numa_built() ? static_cast<int>(std::min<size_t>(machine, 2)) : 1;
    EXPECT_EQ(info.numa_nodes, expect) << mode;
    ASSERT_NE(info.numa_node_workers, nullptr);
    int workers = 0;
    for (int n = 0; n < info.numa_nodes; ++n) workers += info.numa_node_workers[n];
    EXPECT_EQ(workers, info.num_threads);
    EXPECT_EQ(kt_engine_destroy(engine), KT_OK);
  }
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  EXPECT_EQ(eo.numa, KT_NUMA_OFF);
  eo.numa = static_cast<kt_numa_mode>(2);
  kt_engine* engine = nullptr;
  EXPECT_EQ(kt_engine_create(&eo, &engine), KT_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(engine, nullptr);
}

TEST(NumaEngine, SimulatedNodesShowInInfo) {
  if (!kt::numa_built()) GTEST_SKIP() << "built without libnuma: engines use one node";
  const kt::Topology t = two_simulated_nodes();
  kt_engine* engine = make_engine(KT_NUMA_AUTO, 2, &t);
  kt_engine_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(kt_engine_get_info(engine, &info), KT_OK) << kt_last_error();
  EXPECT_EQ(info.numa_nodes, 2);
  EXPECT_EQ(info.numa_node_workers[0], 1);
  EXPECT_EQ(info.numa_node_workers[1], 1);
  EXPECT_EQ(kt_engine_destroy(engine), KT_OK);
  // KT_NUMA_OFF ignores the topology.
  engine = make_engine(KT_NUMA_OFF, 2, &t);
  ASSERT_EQ(kt_engine_get_info(engine, &info), KT_OK);
  EXPECT_EQ(info.numa_nodes, 1);
  EXPECT_EQ(kt_engine_destroy(engine), KT_OK);
}

// On the machine's own nodes: KT_NUMA_AUTO gives KT_NUMA_OFF's bits.
TEST(NumaEngine, AutoOnThisMachineKeepsTheBitsOfOff) {
  kt_engine* off = make_engine(KT_NUMA_OFF, 2);
  kt_engine* on = make_engine(KT_NUMA_AUTO, 2);
  for (const Case& c : numa_cases()) {
    const Runner::Snapshot a = run_case(c, off);
    const Runner::Snapshot b = run_case(c, on);
    EXPECT_TRUE(a == b) << c.name;
  }
  EXPECT_EQ(kt_engine_destroy(off), KT_OK);
  EXPECT_EQ(kt_engine_destroy(on), KT_OK);
}

// Two simulated nodes of one worker each: expert e (of E) is owned by node
// e < E/2 ? 0 : 1, its weights were asked to live there, only that node's
// worker ran its GEMMs, and every output is KT_NUMA_OFF's.
TEST(NumaEngine, SimulatedTwoNodesSplitByExpertWithTheSameBits) {
  if (!kt::numa_built()) GTEST_SKIP() << "built without libnuma: engines use one node";
  const kt::Topology t = two_simulated_nodes();
  kt_engine* off = make_engine(KT_NUMA_OFF, 2);
  kt_engine* split = make_engine(KT_NUMA_AUTO, 2, &t);
  {
    const std::shared_ptr<kt_engine> eng = kt::live_engine(split, "test");
    ASSERT_EQ(eng->pool->groups(), 2);
    EXPECT_EQ(eng->pool->group_of(0), 0);
    EXPECT_EQ(eng->pool->group_of(1), 1);
  }
  for (const Case& c : numa_cases()) {
    SCOPED_TRACE(c.name);
    const Runner::Snapshot a = run_case(c, off);
    kt::ExpertWorkers watch(c.E);
    std::shared_ptr<kt_moe> layer;
    const Runner::Snapshot b = run_case(c, split, &watch, &layer);
    EXPECT_TRUE(a == b) << "differs from KT_NUMA_OFF";
    bool node_worked[2] = {false, false};
    for (int64_t e = 0; e < c.E; ++e) {
      const int node = e < c.E / 2 ? 0 : 1;
      EXPECT_EQ(layer->expert_node(e), node) << e;
      for (int p = 0; p < 3; ++p) EXPECT_EQ(layer->weights_node(p)[static_cast<size_t>(e)], node) << e << " " << p;
      const uint64_t workers = watch.by_expert[static_cast<size_t>(e)].load();
      // Worker tid is on node tid.
      EXPECT_EQ(workers & ~(uint64_t{1} << node), 0u) << "expert " << e << " ran on workers " << workers;
      if (workers) node_worked[node] = true;
    }
    if (c.E > 1 && c.T >= 6) {
      EXPECT_TRUE(node_worked[0]);
      EXPECT_TRUE(node_worked[1]);
    }
  }
  EXPECT_EQ(kt_engine_destroy(off), KT_OK);
  EXPECT_EQ(kt_engine_destroy(split), KT_OK);
}

}  // namespace
}  // namespace kt_test
