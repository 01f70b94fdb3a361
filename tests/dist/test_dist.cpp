// Multi-process tests of owner-rank mode, expert parallelism and failures
// (ranks of this program on loopback Gloo; ranks.h), and single-process
// tests of backend strings and communicator options.
#include <gtest/gtest.h>
#include <signal.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kt_c_api.h"
#include "ranks.h"

namespace {

using kt_dist_test::RankResult;

bool have_gloo() { return std::strstr(kt_build_info(), "gloo") != nullptr; }

std::string describe(const std::vector<RankResult>& results) {
  std::string s;
  for (size_t r = 0; r < results.size(); ++r) {
    const RankResult& x = results[r];
    s += "rank " + std::to_string(r) + ": " +
         (x.killed_at_deadline ? std::string("killed at the deadline")
          : x.signal            ? "signal " + std::to_string(x.signal)
                                : "exit " + std::to_string(x.exit_code)) +
         "\n" + x.output + "\n";
  }
  return s;
}

// Runs the scenario on world ranks; every rank must pass.
void expect_ranks_pass(const std::string& scenario, int world) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  const std::vector<RankResult> results = kt_dist_test::run_ranks(scenario, world, 60.0);
  for (const RankResult& r : results) EXPECT_TRUE(!r.killed_at_deadline && r.signal == 0 && r.exit_code == 0) << describe(results);
}

// ----------------------------------------------------------- backend strings

kt_comm_backends parse(const char* s, kt_status* st) {
  kt_comm_backends b;
  std::memset(&b, 0, sizeof(b));
  b.struct_size = sizeof(b);
  *st = kt_comm_parse_backend(s, &b);
  return b;
}

TEST(Backends, PlainNamesAndDevicePairs) {
  kt_status st;
  kt_comm_backends b = parse("gloo", &st);
  ASSERT_EQ(st, KT_OK) << kt_last_error();
  EXPECT_EQ(b.cpu, KT_COMM_BACKEND_GLOO);
  EXPECT_EQ(b.cuda, KT_COMM_BACKEND_NONE);
  EXPECT_EQ(b.device, kDLCPU);
  b = parse("nccl", &st);
  ASSERT_EQ(st, KT_OK);
  EXPECT_EQ(b.cpu, KT_COMM_BACKEND_NONE);
  EXPECT_EQ(b.cuda, KT_COMM_BACKEND_NCCL);
  EXPECT_EQ(b.device, kDLCUDA);
  // The mixed group: the CPU co-backend for CPU tensors, CUDA preferred.
  for (const char* s : {"cuda:nccl,cpu:gloo", "cpu:gloo,cuda:nccl"}) {
    b = parse(s, &st);
    ASSERT_EQ(st, KT_OK) << s;
    EXPECT_EQ(b.cpu, KT_COMM_BACKEND_GLOO) << s;
    EXPECT_EQ(b.cuda, KT_COMM_BACKEND_NCCL) << s;
    EXPECT_EQ(b.device, kDLCUDA) << s;
  }
  b = parse("cpu:gloo", &st);
  ASSERT_EQ(st, KT_OK);
  EXPECT_EQ(b.device, kDLCPU);
  b = parse("cuda:nccl", &st);
  ASSERT_EQ(st, KT_OK);
  EXPECT_EQ(b.cpu, KT_COMM_BACKEND_NONE);
}

TEST(Backends, MalformedStringsAreRefusedSayingWhy) {
  const struct {
    const char* text;
    const char* why;
  } bad[] = {
      {"", "empty"},
      {"mpi", "'mpi' is not a backend"},
      {"Gloo", "'G' is not allowed"},
      {"cuda:nccl;cpu:gloo", "';' is not allowed"},
      {"cuda:nccl, cpu:gloo", "' ' is not allowed"},
      {"cuda:nccl,", "an empty entry"},
      {",cpu:gloo", "an empty entry"},
      {"cuda:", "lacks its device or its backend"},
      {":gloo", "lacks its device or its backend"},
      {"cpu:gloo:x", "not one device:backend pair"},
      {"gloo,nccl", "needs device:backend pairs"},
      {"gloo,cuda:nccl", "not one device:backend pair"},
      {"cpu:gloo,cpu:gloo", "cpu is named twice"},
      {"cuda:nccl,cuda:nccl", "cuda is named twice"},
      {"cpu:nccl", "cpu tensors take gloo"},
      {"cuda:gloo", "cuda tensors take nccl"},
      {"tpu:gloo", "'tpu' is not a device"},
      {"cuda:ucc", "'ucc' is not a backend"},
  };
  for (const auto& c : bad) {
    kt_status st;
    parse(c.text, &st);
    EXPECT_EQ(st, KT_ERR_INVALID_ARGUMENT) << c.text;
    const std::string msg = kt_last_error();
    EXPECT_NE(msg.find("kt_comm_parse_backend: backend \"" + std::string(c.text) + "\": "), std::string::npos) << msg;
    EXPECT_NE(msg.find(c.why), std::string::npos) << c.text << ": " << msg;
    EXPECT_NE(msg.find("cuda:nccl,cpu:gloo"), std::string::npos) << "the message shows the accepted forms: " << msg;
  }
  kt_comm_backends b;
  b.struct_size = sizeof(b);
  EXPECT_EQ(kt_comm_parse_backend(nullptr, &b), KT_ERR_NULL_POINTER);
  EXPECT_EQ(kt_comm_parse_backend("gloo", nullptr), KT_ERR_NULL_POINTER);
}

// ----------------------------------------------------- communicator options

struct TempDir {
  std::string path;
  TempDir() {
    char t[] = "/tmp/kt_comm_XXXXXX";
    path = mkdtemp(t) ? t : "";
  }
  ~TempDir() {
    const std::string rm = "rm -rf '" + path + "'";
    if (!path.empty() && std::system(rm.c_str()) != 0) ADD_FAILURE() << "could not remove " << path;
  }
};

TEST(Comm, OptionsAreCheckedBeforeAnythingStarts) {
  TempDir dir;
  kt_comm_options o;
  kt_comm_options_init(&o);
  EXPECT_STREQ(o.backend, "gloo");
  EXPECT_EQ(o.world_size, 1);
  EXPECT_EQ(o.timeout_ms, 30000);
  EXPECT_EQ(o.cuda_device, -1);
  o.store_path = dir.path.c_str();
  kt_comm* c = nullptr;
  o.backend = "cuda:nccl;cpu:gloo";
  EXPECT_EQ(kt_comm_create(&o, &c), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("kt_comm_create: options->backend"), std::string::npos) << kt_last_error();
  o.backend = "gloo";
  o.rank = 2;
  o.world_size = 2;
  EXPECT_EQ(kt_comm_create(&o, &c), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("options->rank = 2"), std::string::npos) << kt_last_error();
  o.rank = 0;
  o.world_size = 0;
  EXPECT_EQ(kt_comm_create(&o, &c), KT_ERR_INVALID_ARGUMENT);
  o.world_size = 1;
  o.timeout_ms = 0;
  EXPECT_EQ(kt_comm_create(&o, &c), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("timeout_ms"), std::string::npos);
  o.timeout_ms = 1000;
  o.store_path = nullptr;
  EXPECT_EQ(kt_comm_create(&o, &c), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("give exactly one"), std::string::npos) << kt_last_error();
  EXPECT_EQ(c, nullptr);
  EXPECT_EQ(kt_comm_create(&o, nullptr), KT_ERR_NULL_POINTER);
}

TEST(Comm, NcclWithoutADeviceIsUnsupportedNotAHang) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  TempDir dir;
  kt_comm_options o;
  kt_comm_options_init(&o);
  o.backend = "cuda:nccl,cpu:gloo";
  o.store_path = dir.path.c_str();
  o.timeout_ms = 5000;
  kt_comm* c = nullptr;
  const kt_status st = kt_comm_create(&o, &c);
  if (std::strstr(kt_build_info(), "nccl") == nullptr) {
    EXPECT_EQ(st, KT_ERR_UNSUPPORTED);
    EXPECT_NE(std::string(kt_last_error()).find("built without NCCL"), std::string::npos) << kt_last_error();
    return;
  }
  if (st == KT_OK) {  // a machine with a CUDA device and NCCL
    kt_comm_info info;
    info.struct_size = sizeof(info);
    ASSERT_EQ(kt_comm_get_info(c, &info), KT_OK);
    EXPECT_EQ(info.backends.device, kDLCUDA);
    EXPECT_EQ(kt_comm_barrier(c), KT_OK) << kt_last_error();
    kt_comm_destroy(c);
    return;
  }
  EXPECT_EQ(st, KT_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(kt_last_error()).find("kt_comm_create: rank 0: NCCL"), std::string::npos) << kt_last_error();
}

TEST(Comm, CudaTensorsNeedACudaBackend) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  TempDir dir;
  kt_comm_options o;
  kt_comm_options_init(&o);
  o.store_path = dir.path.c_str();
  kt_comm* c = nullptr;
  ASSERT_EQ(kt_comm_create(&o, &c), KT_OK) << kt_last_error();
  float v[2] = {1, 2};
  int64_t shape[1] = {2};
  DLTensor t{};
  t.data = v;
  t.device = {kDLCUDA, 0};
  t.ndim = 1;
  t.dtype = {kDLFloat, 32, 1};
  t.shape = shape;
  EXPECT_EQ(kt_comm_broadcast(c, &t, 0), KT_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(kt_last_error()).find("no CUDA backend"), std::string::npos) << kt_last_error();
  t.device = {kDLCPU, 0};
  int64_t strides[1] = {2};
  t.strides = strides;
  EXPECT_EQ(kt_comm_broadcast(c, &t, 0), KT_ERR_STRIDE);
  kt_comm_destroy(c);
}

// A host store whose get says "not there" at once, as a plain key-value map
// does: the rendezvous waits for the keys the other rank has yet to set.
struct MapStore {
  std::mutex m;
  std::map<std::string, std::string> kv;
  static int set(const char* key, const void* value, size_t size, void* user) {
    auto* s = static_cast<MapStore*>(user);
    std::lock_guard<std::mutex> g(s->m);
    s->kv[key] = std::string(static_cast<const char*>(value), size);
    return 0;
  }
  static int get(const char* key, void* buffer, size_t capacity, size_t* size, void* user) {
    auto* s = static_cast<MapStore*>(user);
    std::lock_guard<std::mutex> g(s->m);
    auto it = s->kv.find(key);
    if (it == s->kv.end()) return 1;
    *size = it->second.size();
    std::memcpy(buffer, it->second.data(), std::min(capacity, it->second.size()));
    return 0;
  }
};

TEST(Comm, HostStoreWhoseGetDoesNotWaitStillMeetsALateRank) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  MapStore map;
  kt_comm_store store{};
  store.set = &MapStore::set;
  store.get = &MapStore::get;
  store.user = &map;
  float gathered[2][2] = {{-1, -1}, {-1, -1}};
  kt_status status[2] = {KT_ERR_INTERNAL, KT_ERR_INTERNAL};
  std::string error[2];
  auto rank = [&](int r) {
    if (r == 0) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    kt_comm_options o;
    kt_comm_options_init(&o);
    o.rank = r;
    o.world_size = 2;
    o.store = &store;
    o.timeout_ms = 20000;
    kt_comm* c = nullptr;
    status[r] = kt_comm_create(&o, &c);
    if (status[r] != KT_OK) {
      error[r] = kt_last_error();
      return;
    }
    float mine = 10.0f + r;
    int64_t one[1] = {1}, two[2] = {2, 1};
    DLTensor in{}, out{};
    in.data = &mine;
    in.device = out.device = {kDLCPU, 0};
    in.ndim = 1;
    out.ndim = 2;
    in.dtype = out.dtype = {kDLFloat, 32, 1};
    in.shape = one;
    out.data = gathered[r];
    out.shape = two;
    status[r] = kt_comm_allgather(c, &in, &out);
    if (status[r] != KT_OK) error[r] = kt_last_error();
    kt_comm_destroy(c);
  };
  std::thread second(rank, 1);
  rank(0);
  second.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(status[r], KT_OK) << "rank " << r << ": " << error[r];
    EXPECT_EQ(gathered[r][0], 10.0f);
    EXPECT_EQ(gathered[r][1], 11.0f);
  }
}

// ---------------------------------------------------------------- owner rank

TEST(DistOwner, LoraBf16TwoRanksMatchOneProcess) { expect_ranks_pass("owner_lora_bf16", 2); }
TEST(DistOwner, LoraBf16ThreeRanksMatchOneProcess) { expect_ranks_pass("owner_lora_bf16", 3); }
TEST(DistOwner, FullBiasWithARankOfNoTokensMatchesOneProcess) { expect_ranks_pass("owner_full_bias_zero_tokens", 3); }
TEST(DistOwner, RowsPastTheFirstMessageMatchOneProcess) { expect_ranks_pass("owner_many_tokens", 3); }

// ----------------------------------------------------------- expert parallel

TEST(DistExpertParallel, FullBf16TwoRanks) { expect_ranks_pass("ep_full_even", 2); }
TEST(DistExpertParallel, FullBf16ThreeRanks) { expect_ranks_pass("ep_full_even", 3); }
TEST(DistExpertParallel, FullBf16FourRanks) { expect_ranks_pass("ep_full_even", 4); }
TEST(DistExpertParallel, LoraExplicitMapTwoRanks) { expect_ranks_pass("ep_lora_map", 2); }
TEST(DistExpertParallel, LoraExplicitMapThreeRanks) { expect_ranks_pass("ep_lora_map", 3); }
TEST(DistExpertParallel, LoraExplicitMapFourRanks) { expect_ranks_pass("ep_lora_map", 4); }
TEST(DistExpertParallel, BiasWithARankHoldingNoExperts) { expect_ranks_pass("ep_bias_inference", 4); }
TEST(DistExpertParallel, RoutesPastTheFirstMessageAndNoneToARankMatchOneProcess) {
  expect_ranks_pass("ep_many_tokens", 3);
}

// ------------------------------------------------------------------ failures

TEST(DistFailures, ArgumentErrorOfOneRankReachesEveryRank) { expect_ranks_pass("fail_arguments", 3); }
TEST(DistFailures, ComputeErrorOfOneRankReachesEveryRank) { expect_ranks_pass("fail_compute", 3); }
TEST(DistFailures, ExpertParallelRefusalsPastTheFirstMessageReachEveryRank) {
  expect_ranks_pass("fail_expert_parallel", 3);
}
TEST(DistFailures, MismatchedConfigurationIsFoundAtSetup) { expect_ranks_pass("fail_config", 3); }

void expect_victim_killed_others_pass(const std::string& scenario, int world) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  const std::vector<RankResult> results = kt_dist_test::run_ranks(scenario, world, 60.0);
  for (int r = 0; r + 1 < world; ++r) {
    const RankResult& x = results[static_cast<size_t>(r)];
    EXPECT_TRUE(!x.killed_at_deadline && x.signal == 0 && x.exit_code == 0) << describe(results);
  }
  EXPECT_EQ(results.back().signal, SIGKILL) << describe(results);
}

TEST(DistFailures, KilledRankEndsOwnerModeCallsOnEveryRank) { expect_victim_killed_others_pass("kill_owner", 3); }
TEST(DistFailures, KilledRankEndsExpertParallelCallsOnEveryRank) {
  expect_victim_killed_others_pass("kill_expert_parallel", 3);
}
TEST(DistFailures, StalledRankMakesOthersTimeOut) { expect_ranks_pass("stall_owner", 2); }


// ---------------------------------------------------- distributed checkpoints

// A checkpoint directory shared by the runs of one test (the ranks find it
// in KT_TEST_CKPT_DIR).
struct CheckpointDir {
  TempDir root;
  CheckpointDir() { setenv("KT_TEST_CKPT_DIR", root.path.c_str(), 1); }
  ~CheckpointDir() { unsetenv("KT_TEST_CKPT_DIR"); }
  std::string manifest() const {
    std::ifstream in(root.path + "/ckpt/kt_dist_checkpoint.json");
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
  }
  // Entries of the checkpoint's parent other than the checkpoint itself
  // (staging directories left behind).
  std::vector<std::string> strays() const {
    std::vector<std::string> out;
    for (const auto& e : std::filesystem::directory_iterator(root.path))
      if (e.path().filename() != "ckpt") out.push_back(e.path().filename().string());
    return out;
  }
};

TEST(DistCheckpoint, FourExpertParallelRanksSaveTwoRanksResumeBitIdentical) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  CheckpointDir ckpt;
  expect_ranks_pass("ckpt_save_ep", 4);
  const std::string m = ckpt.manifest();
  EXPECT_NE(m.find("\"world_size\": 4"), std::string::npos) << m;
  EXPECT_NE(m.find("rank-00003-of-00004.safetensors"), std::string::npos) << m;
  EXPECT_NE(m.find("\"expert_parallel\""), std::string::npos) << m;
  EXPECT_NE(m.find("\"gate_proj.lora_A\""), std::string::npos) << m;
  EXPECT_NE(m.find("\"optim.LORA_B_DOWN.exp_avg_sq\""), std::string::npos) << m;
  EXPECT_NE(m.find("\"step\": 2"), std::string::npos) << m;
  EXPECT_TRUE(ckpt.strays().empty());
  expect_ranks_pass("ckpt_resume_ep_map", 2);
}

TEST(DistCheckpoint, TwoOwnerModeRanksSaveFourExpertParallelRanksResumeBitIdentical) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  CheckpointDir ckpt;
  expect_ranks_pass("ckpt_save_owner", 2);
  const std::string m = ckpt.manifest();
  EXPECT_NE(m.find("\"owner\""), std::string::npos) << m;
  expect_ranks_pass("ckpt_resume_ep", 4);
  expect_ranks_pass("ckpt_resume_owner", 3);
}

TEST(DistCheckpoint, FullTrainingOfThreeExpertParallelRanksResumesOnTwoOwnerModeRanks) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  CheckpointDir ckpt;
  expect_ranks_pass("ckpt_save_ep_full", 3);
  const std::string m = ckpt.manifest();
  EXPECT_NE(m.find("\"optim.W_DOWN.master\""), std::string::npos) << m;
  EXPECT_NE(m.find("\"mode\": \"full\""), std::string::npos) << m;
  expect_ranks_pass("ckpt_resume_owner_full", 2);
}

TEST(DistCheckpoint, RankKilledMidSaveLeavesThePreviousCheckpoint) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  CheckpointDir ckpt;
  expect_ranks_pass("ckpt_save_ep", 2);
  const std::string before = ckpt.manifest();
  const std::vector<RankResult> results = kt_dist_test::run_ranks("ckpt_killed_mid_save", 3, 60.0);
  EXPECT_EQ(results[1].signal, SIGKILL) << describe(results);
  for (int r : {0, 2})
    EXPECT_TRUE(!results[static_cast<size_t>(r)].killed_at_deadline && results[static_cast<size_t>(r)].exit_code == 0)
        << describe(results);
  EXPECT_EQ(ckpt.manifest(), before) << "the checkpoint in place is the previous one";
  EXPECT_TRUE(ckpt.strays().empty()) << "rank 0 removed the staging directory: " << ckpt.strays().front();
  // The previous checkpoint resumes as if nothing had happened.
  expect_ranks_pass("ckpt_resume_ep_map", 2);
}

TEST(DistCheckpoint, CheckpointsThatDoNotFitAreRefusedOnEveryRank) {
  if (!have_gloo()) GTEST_SKIP() << "kt built without Gloo";
  CheckpointDir ckpt;
  expect_ranks_pass("ckpt_save_ep", 2);
  expect_ranks_pass("ckpt_mismatch", 3);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc == 6 && std::string(argv[1]) == "--rank")
    return kt_dist_test::rank_main(argv[2], std::atoi(argv[3]), std::atoi(argv[4]), argv[5]);
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
