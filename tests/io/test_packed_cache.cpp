// The packed cache: a layer saved with kt_moe_save_packed and mapped back
// with kt_moe_load_packed computes bit-identically on every ISA the CPU
// runs; broken, foreign or mismatched caches are refused with a message
// naming the file, and the layer stays as it was; kt-moe convert packs every
// MoE layer of a checkpoint into caches that load back. Quantized layers are
// saved as they are held (kt's int8/int4 codes, or a checkpoint's fp8, int4
// and MXFP4 codes and scales as stored).
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "harness.h"
#include "kt_c_api.h"
#include "quant_ckpt_builder.h"
#include "st_builder.h"

using kt_test::Tensor;
using kt_test::TensorPtr;

namespace {

std::vector<uint8_t> read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
}

// xxHash64, written here apart from src/io, to patch header fields and
// reseal the header the way a cache of another kt would be sealed.
uint64_t xxh64(const uint8_t* p, size_t n) {
  const uint64_t P1 = 11400714785074694791ull, P2 = 14029467366897019727ull, P3 = 1609587929392839161ull,
                 P4 = 9650029242287828579ull, P5 = 2870177450012600261ull;
  auto rotl = [](uint64_t x, int r) { return (x << r) | (x >> (64 - r)); };
  auto rd64 = [](const uint8_t* q) { uint64_t v; std::memcpy(&v, q, 8); return v; };
  auto round = [&](uint64_t acc, uint64_t in) { return rotl(acc + in * P2, 31) * P1; };
  const uint8_t* end = p + n;
  uint64_t h;
  if (n >= 32) {
    uint64_t v[4] = {P1 + P2, P2, 0, 0 - P1};
    while (end - p >= 32) {
      for (int i = 0; i < 4; ++i) v[i] = round(v[i], rd64(p + 8 * i));
      p += 32;
    }
    h = rotl(v[0], 1) + rotl(v[1], 7) + rotl(v[2], 12) + rotl(v[3], 18);
    for (int i = 0; i < 4; ++i) h = (h ^ round(0, v[i])) * P1 + P4;
  } else {
    h = P5;
  }
  h += n;
  for (; end - p >= 8; p += 8) h = rotl(h ^ round(0, rd64(p)), 27) * P1 + P4;
  if (end - p >= 4) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    h = rotl(h ^ (uint64_t{v} * P1), 23) * P2 + P3;
    p += 4;
  }
  for (; p < end; ++p) h = rotl(h ^ (*p * P5), 11) * P1;
  h ^= h >> 33;
  h *= P2;
  h ^= h >> 29;
  h *= P3;
  return h ^ (h >> 32);
}

// Header fields the tests patch (the file layout of src/io/packed_cache.h).
constexpr size_t kOffVersion = 8, kOffAbi = 12, kOffLayout = 16, kOffFormat = 24, kOffHeaderSum = 504, kHeader = 512;
constexpr size_t kOffSections = 72, kSectionBytes = 40;

void reseal(std::vector<uint8_t>& bytes) {
  const uint64_t h = xxh64(bytes.data(), kOffHeaderSum);
  std::memcpy(bytes.data() + kOffHeaderSum, &h, 8);
}

struct Weights {
  TensorPtr gate, up, down, bg, bu, bd;
  Weights(const kt_moe_options& o, uint32_t seed) {
    const int64_t E = o.num_experts, H = o.hidden, I = o.intermediate;
    gate = Tensor::make(kt_test::kF32, {E, I, H});
    up = Tensor::make(kt_test::kF32, {E, I, H});
    down = Tensor::make(kt_test::kF32, {E, H, I});
    bg = Tensor::make(kt_test::kF32, {E, I});
    bu = Tensor::make(kt_test::kF32, {E, I});
    bd = Tensor::make(kt_test::kF32, {E, H});
    uint32_t s = seed * 2654435761u + 7u;
    auto fill = [&](Tensor& t, double scale) {
      for (int64_t i = 0; i < t.numel(); ++i) {
        s = s * 1664525u + 1013904223u;
        t.set(i, (static_cast<double>(s >> 8) / 16777216.0 * 2.0 - 1.0) * scale);
      }
    };
    fill(*gate, 0.25);
    fill(*up, 0.25);
    fill(*down, 0.25);
    fill(*bg, 0.1);
    fill(*bu, 0.1);
    fill(*bd, 0.1);
  }
  std::vector<kt_arg> args(bool bias) const {
    std::vector<kt_arg> a = {{KT_ARG_W_GATE, gate->dl()}, {KT_ARG_W_UP, up->dl()}, {KT_ARG_W_DOWN, down->dl()}};
    if (bias) a.insert(a.end(), {{KT_ARG_B_GATE, bg->dl()}, {KT_ARG_B_UP, bu->dl()}, {KT_ARG_B_DOWN, bd->dl()}});
    return a;
  }
};

struct Outputs {
  std::vector<float> y, dx;
  kt_status status = KT_OK;
};

// Forward (saving a context) and backward of a fixed batch that routes to
// every expert; y and dx as fp32.
Outputs run(kt_moe* moe, const kt_moe_options& o) {
  const int64_t T = 13, K = o.top_k, H = o.hidden;
  TensorPtr x = Tensor::make(kt_test::kF32, {T, H});
  TensorPtr ids = Tensor::make(kt_test::kI32, {T, K});
  TensorPtr w = Tensor::make(kt_test::kF32, {T, K});
  TensorPtr y = Tensor::make(kt_test::kF32, {T, H});
  TensorPtr dy = Tensor::make(kt_test::kF32, {T, H});
  TensorPtr dx = Tensor::make(kt_test::kF32, {T, H});
  for (int64_t i = 0; i < T * H; ++i) {
    x->set(i, static_cast<double>((i * 37) % 23 - 11) / 16.0);
    dy->set(i, static_cast<double>((i * 29) % 19 - 9) / 32.0);
  }
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < K; ++j) {
      ids->set(t * K + j, static_cast<double>((t + 3 * j) % o.num_experts));
      w->set(t * K + j, j == 0 ? 0.75 : 0.25 / static_cast<double>(K - 1));
    }
  Outputs out;
  kt_arg fa[4] = {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, w->dl()}, {KT_ARG_Y, y->dl()}};
  kt_context* ctx = nullptr;
  out.status = kt_moe_forward(moe, fa, 4, &ctx);
  if (out.status != KT_OK) return out;
  kt_arg ba[2] = {{KT_ARG_DY, dy->dl()}, {KT_ARG_DX, dx->dl()}};
  kt_backward_options bo;
  kt_backward_options_init(&bo);
  bo.param_grads = 0;
  out.status = kt_moe_backward(moe, ctx, &bo, ba, 2);
  kt_context_release(ctx);
  out.y.assign(y->f32(), y->f32() + T * H);
  out.dx.assign(dx->f32(), dx->f32() + T * H);
  return out;
}

void expect_identical(const Outputs& a, const Outputs& b, const std::string& what) {
  ASSERT_EQ(a.status, KT_OK) << what;
  ASSERT_EQ(b.status, KT_OK) << what;
  ASSERT_EQ(a.y.size(), b.y.size());
  EXPECT_EQ(std::memcmp(a.y.data(), b.y.data(), a.y.size() * 4), 0) << what << ": Y differs";
  EXPECT_EQ(std::memcmp(a.dx.data(), b.dx.data(), a.dx.size() * 4), 0) << what << ": dX differs";
}

class PackedCache : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/kt_packed_test.XXXXXX";
    const char* d = mkdtemp(tmpl);
    ASSERT_NE(d, nullptr);
    dir_ = d;
  }
  void TearDown() override {
    for (kt_moe* m : layers_) kt_moe_destroy(m);
    for (kt_engine* e : engines_) kt_engine_destroy(e);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  // An engine capped at isa, or nullptr when the CPU lacks it or the
  // environment (KT_MAX_ISA, under which the whole suite may run) caps it lower.
  kt_engine* engine(kt_isa isa) {
    if (isa != KT_ISA_AUTO && kt_cpu_isa() < isa) return nullptr;
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.num_threads = 2;
    eo.pin_threads = 0;
    eo.max_isa = isa;
    kt_engine* e = nullptr;
    EXPECT_EQ(kt_engine_create(&eo, &e), KT_OK) << kt_last_error();
    engines_.push_back(e);
    kt_engine_info info;
    info.struct_size = sizeof(info);
    EXPECT_EQ(kt_engine_get_info(e, &info), KT_OK);
    if (isa != KT_ISA_AUTO && info.isa != isa) {
      const char* cap = std::getenv("KT_MAX_ISA");
      EXPECT_TRUE(cap != nullptr && info.isa < isa)
          << "engine capped at " << kt_isa_name(isa) << " runs " << kt_isa_name(info.isa);
      std::printf("note: %s not run: KT_MAX_ISA=%s caps the kernels at %s\n", kt_isa_name(isa), cap ? cap : "",
                  kt_isa_name(info.isa));
      return nullptr;
    }
    return e;
  }
  kt_moe* layer(kt_engine* e, const kt_moe_options& o) {
    kt_moe* m = nullptr;
    EXPECT_EQ(kt_moe_create(e, &o, &m), KT_OK) << kt_last_error();
    layers_.push_back(m);
    return m;
  }
  static kt_moe_options options(bool bias, kt_mode mode = KT_MODE_INFERENCE) {
    kt_moe_options o;
    kt_moe_options_init(&o);
    o.num_experts = 5;
    o.top_k = 2;
    o.hidden = 40;  // not a multiple of the 16-row panels: padding is saved too
    o.intermediate = 24;
    o.max_tokens = 64;
    o.has_bias = bias ? 1 : 0;
    if (bias) {
      o.activation = KT_ACT_SWIGLU_OAI;
      o.act_limit = 7.f;
    }
    o.mode = mode;
    return o;
  }
  kt_moe* loaded_layer(kt_engine* e, const kt_moe_options& o, const Weights& w) {
    kt_moe* m = layer(e, o);
    const std::vector<kt_arg> a = w.args(o.has_bias != 0);
    EXPECT_EQ(kt_moe_load_weights(m, nullptr, a.data(), a.size()), KT_OK) << kt_last_error();
    return m;
  }
  std::string path(const std::string& name) const { return dir_ + "/" + name; }

  std::string dir_;
  std::vector<kt_engine*> engines_;
  std::vector<kt_moe*> layers_;
};

TEST_F(PackedCache, RoundTripIsBitIdenticalOnEveryIsa) {
  const kt_isa isas[] = {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX};
  for (bool bias : {false, true}) {
    const kt_moe_options o = options(bias);
    const Weights w(o, bias ? 11 : 5);
    // Written once, by the reference engine: the layout is the same for all.
    kt_engine* ref = engine(KT_ISA_REF);
    const std::string file = path(bias ? "bias.ktpack" : "plain.ktpack");
    ASSERT_EQ(kt_moe_save_packed(loaded_layer(ref, o, w), file.c_str()), KT_OK) << kt_last_error();
    int ran = 0;
    for (kt_isa isa : isas) {
      kt_engine* e = engine(isa);
      if (!e) continue;
      ++ran;
      const Outputs fresh = run(loaded_layer(e, o, w), o);
      kt_moe* mapped = layer(e, o);
      ASSERT_EQ(kt_moe_load_packed(mapped, file.c_str(), 0), KT_OK) << kt_last_error();
      int64_t n = 0;
      ASSERT_EQ(kt_moe_num_loaded(mapped, &n), KT_OK);
      EXPECT_EQ(n, o.num_experts);
      expect_identical(fresh, run(mapped, o), std::string(kt_isa_name(isa)) + (bias ? " with biases" : ""));
      // A cache saved from a mapped layer is the same file.
      const std::string again = path("again.ktpack");
      ASSERT_EQ(kt_moe_save_packed(mapped, again.c_str()), KT_OK) << kt_last_error();
      EXPECT_EQ(read_bytes(again), read_bytes(file));
    }
    EXPECT_GE(ran, 1);
  }
}

TEST_F(PackedCache, MappedLayerOutlivesTheFileAndTakesNewExperts) {
  const kt_moe_options o = options(true);
  const Weights w(o, 3), other(o, 4);
  kt_engine* e = engine(KT_ISA_AUTO);
  const std::string file = path("layer.ktpack");
  ASSERT_EQ(kt_moe_save_packed(loaded_layer(e, o, w), file.c_str()), KT_OK) << kt_last_error();
  kt_moe* mapped = layer(e, o);
  ASSERT_EQ(kt_moe_load_packed(mapped, file.c_str(), 0), KT_OK) << kt_last_error();
  ASSERT_EQ(std::remove(file.c_str()), 0);  // the mapping keeps the data
  // Expert 2 replaced from tensors: the others must keep the cached weights.
  kt_moe* expected = loaded_layer(e, o, w);
  const int64_t I = o.intermediate, H = o.hidden;
  TensorPtr g = Tensor::make(kt_test::kF32, {I, H}), u = Tensor::make(kt_test::kF32, {I, H});
  TensorPtr d = Tensor::make(kt_test::kF32, {H, I});
  TensorPtr bg = Tensor::make(kt_test::kF32, {I}), bu = Tensor::make(kt_test::kF32, {I});
  TensorPtr bd = Tensor::make(kt_test::kF32, {H});
  std::memcpy(g->f32(), other.gate->f32() + 2 * I * H, static_cast<size_t>(I * H) * 4);
  std::memcpy(u->f32(), other.up->f32() + 2 * I * H, static_cast<size_t>(I * H) * 4);
  std::memcpy(d->f32(), other.down->f32() + 2 * I * H, static_cast<size_t>(I * H) * 4);
  std::memcpy(bg->f32(), other.bg->f32() + 2 * I, static_cast<size_t>(I) * 4);
  std::memcpy(bu->f32(), other.bu->f32() + 2 * I, static_cast<size_t>(I) * 4);
  std::memcpy(bd->f32(), other.bd->f32() + 2 * H, static_cast<size_t>(H) * 4);
  kt_arg one[6] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, u->dl()}, {KT_ARG_W_DOWN, d->dl()},
                   {KT_ARG_B_GATE, bg->dl()}, {KT_ARG_B_UP, bu->dl()}, {KT_ARG_B_DOWN, bd->dl()}};
  ASSERT_EQ(kt_moe_load_expert(mapped, 2, nullptr, one, 6), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_load_expert(expected, 2, nullptr, one, 6), KT_OK) << kt_last_error();
  expect_identical(run(expected, o), run(mapped, o), "after replacing expert 2");
}

TEST_F(PackedCache, PartialLayersKeepTheirLoadedFlags) {
  const kt_moe_options o = options(false);
  const Weights w(o, 8);
  kt_engine* e = engine(KT_ISA_AUTO);
  kt_moe* empty = layer(e, o);
  const std::string file = path("partial.ktpack");
  EXPECT_EQ(kt_moe_save_packed(empty, file.c_str()), KT_ERR_NOT_LOADED);
  EXPECT_FALSE(std::filesystem::exists(file));
  // Experts 0..4 stacked with a map of {1, 3}: only those two are loaded.
  const int64_t I = o.intermediate, H = o.hidden;
  TensorPtr map = Tensor::make(kt_test::kI64, {2});
  map->set(0, 1);
  map->set(1, 3);
  TensorPtr g = Tensor::make(kt_test::kF32, {2, I, H}), u = Tensor::make(kt_test::kF32, {2, I, H});
  TensorPtr d = Tensor::make(kt_test::kF32, {2, H, I});
  kt_arg a[4] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, u->dl()}, {KT_ARG_W_DOWN, d->dl()}, {KT_ARG_EXPERT_MAP, map->dl()}};
  ASSERT_EQ(kt_moe_load_weights(empty, nullptr, a, 4), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_save_packed(empty, file.c_str()), KT_OK) << kt_last_error();
  kt_moe* back = loaded_layer(e, o, w);  // fully loaded before: the cache replaces all
  ASSERT_EQ(kt_moe_load_packed(back, file.c_str(), 0), KT_OK) << kt_last_error();
  int64_t n = 0;
  ASSERT_EQ(kt_moe_num_loaded(back, &n), KT_OK);
  EXPECT_EQ(n, 2);
  EXPECT_EQ(run(back, o).status, KT_ERR_NOT_LOADED);  // the batch routes to expert 0
}

TEST_F(PackedCache, FullModeCopiesAndRepacksLater) {
  const kt_moe_options o = options(false, KT_MODE_FULL);
  const Weights w(o, 21), w2(o, 22);
  kt_engine* e = engine(KT_ISA_AUTO);
  const std::string file = path("full.ktpack");
  ASSERT_EQ(kt_moe_save_packed(loaded_layer(e, o, w), file.c_str()), KT_OK) << kt_last_error();
  kt_moe* from_cache = layer(e, o);
  ASSERT_EQ(kt_moe_load_packed(from_cache, file.c_str(), 0), KT_OK) << kt_last_error();
  ASSERT_EQ(std::remove(file.c_str()), 0);
  expect_identical(run(loaded_layer(e, o, w), o), run(from_cache, o), "full mode");
  // The optimizer's weights are repacked over the copy.
  const std::vector<kt_arg> bound = w2.args(false);
  ASSERT_EQ(kt_moe_bind(from_cache, bound.data(), bound.size()), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_params_changed(from_cache), KT_OK) << kt_last_error();
  expect_identical(run(loaded_layer(e, o, w2), o), run(from_cache, o), "full mode after params_changed");
}

TEST_F(PackedCache, BadCachesAreRefusedAndTheLayerStaysAsItWas) {
  const kt_moe_options o = options(true);
  const Weights w(o, 31), w_other(o, 32);
  kt_engine* e = engine(KT_ISA_AUTO);
  const std::string good = path("good.ktpack");
  ASSERT_EQ(kt_moe_save_packed(loaded_layer(e, o, w_other), good.c_str()), KT_OK) << kt_last_error();
  const std::vector<uint8_t> bytes = read_bytes(good);
  ASSERT_GT(bytes.size(), 8192u);
  // The victim holds other weights, once from tensors and once mapped.
  kt_moe* victim = loaded_layer(e, o, w);
  const Outputs before = run(victim, o);
  ASSERT_EQ(before.status, KT_OK);

  struct Case {
    std::string name;
    std::vector<uint8_t> bytes;
    kt_status status;
    std::string message;
  };
  std::vector<Case> cases;
  auto patched = [&](size_t at, uint8_t xor_with, bool seal) {
    std::vector<uint8_t> b = bytes;
    b[at] ^= xor_with;
    if (seal) reseal(b);
    return b;
  };
  uint64_t down_offset;
  std::memcpy(&down_offset, bytes.data() + kOffSections + 2 * kSectionBytes + 8, 8);
  cases.push_back({"flipped weight byte", patched(static_cast<size_t>(down_offset) + 77, 0x10, false), KT_ERR_IO,
                   "checksum mismatch in section 'down'"});
  cases.push_back({"flipped header byte", patched(40, 0x01, false), KT_ERR_IO, "header checksum"});
  cases.push_back({"flipped padding after the header", patched(3224, 0x08, false), KT_ERR_IO,
                   "byte 3224 of the padding before section 'gate' is not zero"});
  cases.push_back({"flipped padding before 'down'", patched(static_cast<size_t>(down_offset) - 1, 0x01, false),
                   KT_ERR_IO, "of the padding before section 'down' is not zero"});
  cases.push_back({"bad magic", patched(0, 0x20, false), KT_ERR_IO, "not a kt packed cache"});
  cases.push_back({"other format version", patched(kOffVersion, 0x02, true), KT_ERR_IO, "format version"});
  cases.push_back({"other ABI version", patched(kOffAbi, 0x04, true), KT_ERR_IO, "ABI"});
  cases.push_back({"other panel layout", patched(kOffLayout, 0x01, true), KT_ERR_IO, "panel layout"});
  cases.push_back({"truncated", std::vector<uint8_t>(bytes.begin(), bytes.end() - 100), KT_ERR_IO, "truncated"});
  cases.push_back({"truncated header", std::vector<uint8_t>(bytes.begin(), bytes.begin() + 300), KT_ERR_IO,
                   "truncated"});
  cases.push_back({"empty", {}, KT_ERR_IO, "not a kt packed cache"});
  std::vector<uint8_t> grown = bytes;
  grown.resize(grown.size() + 64, 0);
  cases.push_back({"extended", grown, KT_ERR_IO, "truncated or extended"});
  for (const Case& c : cases) {
    const std::string file = path("bad.ktpack");
    kt_io_test::write_file(file, c.bytes);
    EXPECT_EQ(kt_moe_load_packed(victim, file.c_str(), 0), c.status) << c.name;
    const std::string msg = kt_last_error();
    EXPECT_NE(msg.find(file), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.name << ": " << msg;
    expect_identical(before, run(victim, o), "after refusing: " + c.name);
  }
  // A flipped weight byte passes when checksums are skipped (header only).
  const std::string flipped = path("flipped.ktpack");
  kt_io_test::write_file(flipped, cases[0].bytes);
  EXPECT_EQ(kt_moe_load_packed(victim, flipped.c_str(), KT_PACKED_SKIP_CHECKSUMS), KT_OK) << kt_last_error();

  // Wrong shape: a layer of another H, and one without biases.
  kt_moe_options wider = o;
  wider.hidden = 48;
  kt_moe* other_shape = layer(e, wider);
  EXPECT_EQ(kt_moe_load_packed(other_shape, good.c_str(), 0), KT_ERR_SHAPE);
  EXPECT_NE(std::string(kt_last_error()).find(good), std::string::npos) << kt_last_error();
  EXPECT_NE(std::string(kt_last_error()).find("H=40"), std::string::npos) << kt_last_error();
  kt_moe* no_bias = layer(e, options(false));
  EXPECT_EQ(kt_moe_load_packed(no_bias, good.c_str(), 0), KT_ERR_SHAPE);
  int64_t n = -1;
  ASSERT_EQ(kt_moe_num_loaded(no_bias, &n), KT_OK);
  EXPECT_EQ(n, 0);

  // Mapped victim: a refused cache leaves the mapped weights in use.
  kt_moe* mapped = layer(e, o);
  ASSERT_EQ(kt_moe_load_packed(mapped, good.c_str(), 0), KT_OK) << kt_last_error();
  const Outputs mapped_before = run(mapped, o);
  kt_io_test::write_file(path("bad.ktpack"), cases[0].bytes);
  EXPECT_EQ(kt_moe_load_packed(mapped, path("bad.ktpack").c_str(), 0), KT_ERR_IO);
  expect_identical(mapped_before, run(mapped, o), "mapped layer after a refused cache");

  // Argument checks.
  EXPECT_EQ(kt_moe_load_packed(nullptr, good.c_str(), 0), KT_ERR_INVALID_HANDLE);
  EXPECT_EQ(kt_moe_load_packed(victim, nullptr, 0), KT_ERR_NULL_POINTER);
  EXPECT_EQ(kt_moe_load_packed(victim, good.c_str(), 0x80u), KT_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(kt_moe_load_packed(victim, dir_.c_str(), 0), KT_ERR_IO);
  EXPECT_EQ(kt_moe_save_packed(victim, ""), KT_ERR_INVALID_ARGUMENT);
  const std::string unwritable = dir_ + "/no/such/dir/x.ktpack";
  EXPECT_EQ(kt_moe_save_packed(victim, unwritable.c_str()), KT_ERR_IO);
  // The message names the call and the destination, not a temporary name.
  const std::string msg = kt_last_error();
  EXPECT_EQ(msg.rfind("kt_moe_save_packed: " + unwritable + ": cannot create a temporary file in ", 0), 0u) << msg;
  EXPECT_EQ(msg.find(".tmp."), std::string::npos) << msg;
}


// ------------------------------------------------------ quantized layers

kt_moe_options quantized_options(kt_weight_format format, bool bias) {
  kt_moe_options o;
  kt_moe_options_init(&o);
  o.num_experts = 5;
  o.top_k = 2;
  o.hidden = 40;  // not a multiple of the 32-column groups: padded codes are saved too
  o.intermediate = 24;
  o.max_tokens = 64;
  o.has_bias = bias ? 1 : 0;
  o.weight_format = format;
  return o;
}

// The weights a layer computes with (dequantized), as fp32 [E,...] tensors.
std::vector<float> read_back(kt_moe* m, const kt_moe_options& o) {
  const int64_t E = o.num_experts, H = o.hidden, I = o.intermediate;
  TensorPtr g = Tensor::make(kt_test::kF32, {E, I, H}), u = Tensor::make(kt_test::kF32, {E, I, H});
  TensorPtr d = Tensor::make(kt_test::kF32, {E, H, I});
  kt_arg a[3] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, u->dl()}, {KT_ARG_W_DOWN, d->dl()}};
  EXPECT_EQ(kt_moe_read_weights(m, a, 3), KT_OK) << kt_last_error();
  std::vector<float> all(g->f32(), g->f32() + g->numel());
  all.insert(all.end(), u->f32(), u->f32() + u->numel());
  all.insert(all.end(), d->f32(), d->f32() + d->numel());
  return all;
}

TEST_F(PackedCache, QuantizedLayersRoundTripBitIdenticalOnEveryIsa) {
  const kt_isa isas[] = {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX};
  for (kt_weight_format format : {KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32, KT_FORMAT_INT4_G128})
    for (bool bias : {false, true}) {
      const kt_moe_options o = quantized_options(format, bias);
      const std::string what = std::string(kt_weight_format_name(format)) + (bias ? " with biases" : "");
      const Weights w(o, bias ? 51 : 52);
      kt_engine* ref = engine(KT_ISA_REF);
      const std::string file = path(what + ".ktpack");
      kt_moe* saved = loaded_layer(ref, o, w);
      ASSERT_EQ(kt_moe_save_packed(saved, file.c_str()), KT_OK) << what << ": " << kt_last_error();
      kt_moe_info info;
      info.struct_size = sizeof(info);
      ASSERT_EQ(kt_moe_get_info(saved, &info), KT_OK);
      // The file holds the stored bytes (codes and scales), not bf16 panels.
      EXPECT_LT(std::filesystem::file_size(file), static_cast<uintmax_t>(info.weight_bytes + 5 * 4096 + 4096))
          << what;
      EXPECT_GE(std::filesystem::file_size(file), static_cast<uintmax_t>(info.weight_bytes)) << what;
      const std::vector<float> weights = read_back(saved, o);
      int ran = 0;
      for (kt_isa isa : isas) {
        kt_engine* e = engine(isa);
        if (!e) continue;
        ++ran;
        kt_moe* mapped = layer(e, o);
        ASSERT_EQ(kt_moe_load_packed(mapped, file.c_str(), 0), KT_OK) << what << ": " << kt_last_error();
        kt_moe_info mi;
        mi.struct_size = sizeof(mi);
        ASSERT_EQ(kt_moe_get_info(mapped, &mi), KT_OK);
        EXPECT_EQ(mi.weight_format, format);
        EXPECT_EQ(mi.weight_bytes, info.weight_bytes);
        EXPECT_EQ(mi.num_loaded, o.num_experts);
        EXPECT_EQ(read_back(mapped, o), weights) << what << ": the mapped weights are the saved ones";
        expect_identical(run(loaded_layer(e, o, w), o), run(mapped, o), what + " on " + kt_isa_name(isa));
        const std::string again = path("again.ktpack");
        ASSERT_EQ(kt_moe_save_packed(mapped, again.c_str()), KT_OK) << kt_last_error();
        EXPECT_EQ(read_bytes(again), read_bytes(file)) << what << ": a mapped layer saves the same file";
      }
      EXPECT_GE(ran, 1);
    }
}

TEST_F(PackedCache, MappedQuantizedLayerTakesNewExperts) {
  const kt_moe_options o = quantized_options(KT_FORMAT_INT4_G32, false);
  const Weights w(o, 61), other(o, 62);
  kt_engine* e = engine(KT_ISA_AUTO);
  const std::string file = path("int4.ktpack");
  ASSERT_EQ(kt_moe_save_packed(loaded_layer(e, o, w), file.c_str()), KT_OK) << kt_last_error();
  kt_moe* mapped = layer(e, o);
  ASSERT_EQ(kt_moe_load_packed(mapped, file.c_str(), 0), KT_OK) << kt_last_error();
  ASSERT_EQ(std::remove(file.c_str()), 0);
  const int64_t I = o.intermediate, H = o.hidden;
  TensorPtr g = Tensor::make(kt_test::kF32, {I, H}), u = Tensor::make(kt_test::kF32, {I, H});
  TensorPtr d = Tensor::make(kt_test::kF32, {H, I});
  std::memcpy(g->f32(), other.gate->f32() + 3 * I * H, static_cast<size_t>(I * H) * 4);
  std::memcpy(u->f32(), other.up->f32() + 3 * I * H, static_cast<size_t>(I * H) * 4);
  std::memcpy(d->f32(), other.down->f32() + 3 * I * H, static_cast<size_t>(I * H) * 4);
  kt_arg one[3] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, u->dl()}, {KT_ARG_W_DOWN, d->dl()}};
  kt_moe* expected = loaded_layer(e, o, w);
  ASSERT_EQ(kt_moe_load_expert(mapped, 3, nullptr, one, 3), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_load_expert(expected, 3, nullptr, one, 3), KT_OK) << kt_last_error();
  expect_identical(run(expected, o), run(mapped, o), "int4 after replacing expert 3 of a mapped layer");
  EXPECT_EQ(read_back(mapped, o), read_back(expected, o));
}

TEST_F(PackedCache, CachesOfAnotherFormatAreRefusedClearly) {
  kt_engine* e = engine(KT_ISA_AUTO);
  const kt_moe_options o4 = quantized_options(KT_FORMAT_INT4_G32, true);
  const Weights w(o4, 71);
  const std::string int4 = path("int4.ktpack"), bf16 = path("bf16.ktpack");
  ASSERT_EQ(kt_moe_save_packed(loaded_layer(e, o4, w), int4.c_str()), KT_OK) << kt_last_error();
  kt_moe_options ob = o4;
  ob.weight_format = KT_FORMAT_BF16;
  ASSERT_EQ(kt_moe_save_packed(loaded_layer(e, ob, w), bf16.c_str()), KT_OK) << kt_last_error();
  kt_moe_options o8 = o4;
  o8.weight_format = KT_FORMAT_INT8_CHANNEL;
  const struct {
    kt_moe_options layer;
    std::string file, held, stores;
  } cases[] = {{ob, int4, "int4_g32", "bf16"}, {o8, int4, "int4_g32", "int8_channel"}, {o4, bf16, "bf16", "int4_g32"}};
  for (const auto& c : cases) {
    kt_moe* victim = loaded_layer(e, c.layer, w);
    const Outputs before = run(victim, c.layer);
    EXPECT_EQ(kt_moe_load_packed(victim, c.file.c_str(), 0), KT_ERR_INVALID_ARGUMENT) << c.stores;
    const std::string msg = kt_last_error();
    EXPECT_NE(msg.find("kt_moe_load_packed: " + c.file + ": the cache holds " + c.held + " weights, the layer stores " +
                       c.stores),
              std::string::npos)
        << msg;
    expect_identical(before, run(victim, c.layer), "after refusing a " + c.held + " cache");
  }
  // Damaged quantized caches: refused, naming the file and what is wrong.
  const std::vector<uint8_t> bytes = read_bytes(int4);
  kt_moe* victim = loaded_layer(e, o4, w);
  const Outputs before = run(victim, o4);
  uint64_t gate_offset;
  std::memcpy(&gate_offset, bytes.data() + kOffSections + 8, 8);
  struct Bad {
    std::string name;
    std::vector<uint8_t> bytes;
    kt_status status;
    std::string message;
  };
  std::vector<Bad> bad;
  std::vector<uint8_t> b = bytes;
  b[static_cast<size_t>(gate_offset) + 3] ^= 0x40;  // a code nibble
  bad.push_back({"flipped code", b, KT_ERR_IO, "checksum mismatch in section 'gate'"});
  b = bytes;
  b[kOffFormat] = 1;  // says int8 while its panel layout is int4's
  reseal(b);
  bad.push_back({"format field contradicting the layout", b, KT_ERR_IO,
                 "this kt packs int8_channel weights in layout"});
  b = bytes;
  b[kOffFormat] = 9;
  reseal(b);
  bad.push_back({"unknown format", b, KT_ERR_IO, "weight format 9, which this kt does not know"});
  b = bytes;
  b[kOffLayout] ^= 0x01;
  reseal(b);
  bad.push_back({"other panel layout", b, KT_ERR_IO, "panel layout"});
  bad.push_back({"truncated", std::vector<uint8_t>(bytes.begin(), bytes.end() - 10), KT_ERR_IO, "truncated"});
  for (const Bad& c : bad) {
    const std::string file = path("bad.ktpack");
    kt_io_test::write_file(file, c.bytes);
    EXPECT_EQ(kt_moe_load_packed(victim, file.c_str(), 0), c.status) << c.name;
    const std::string msg = kt_last_error();
    EXPECT_NE(msg.find(file), std::string::npos) << c.name << ": " << msg;
    EXPECT_NE(msg.find(c.message), std::string::npos) << c.name << ": " << msg;
    expect_identical(before, run(victim, o4), "after refusing: " + c.name);
  }
}

// ------------------------------------- quantized checkpoints, as stored

// A checkpoint in each quantized layout kt holds as stored, with the layer
// number its tensors carry.
struct StoredCase {
  std::string name;
  kt_io_test::quant::QuantCkpt q;
  int64_t layer;
  kt_weight_format format;
};

std::vector<StoredCase> stored_cases() {
  using namespace kt_io_test::quant;
  // Odd sizes against the 128-blocks and groups: partial blocks and padded
  // codes are saved too.
  return {{"fp8_b128 DeepSeek-V3 blocks", fp8_ckpt(3, 3, 136, 200, 5), 3, KT_FORMAT_FP8_B128},
          {"int4_g128 compressed-tensors", int4_ckpt(1, 3, 160, 96, 128, true, 6), 1, KT_FORMAT_INT4_G128},
          {"int4_g32 compressed-tensors", int4_ckpt(1, 3, 84, 40, 32, true, 7), 1, KT_FORMAT_INT4_G32},
          {"mxfp4 gpt-oss with biases", gpt_oss_ckpt(0, 3, 64, 32, 8), 0, KT_FORMAT_MXFP4},
          {"mxfp4 DeepSeek-V4", dsv4_ckpt(2, 3, 80, 48, 9), 2, KT_FORMAT_MXFP4},
          {"int4_g32_zp compressed-tensors asymmetric", int4_ckpt(1, 3, 84, 40, 32, false, 10), 1,
           KT_FORMAT_INT4_G32_ZP},
          {"int4_g128_zp compressed-tensors asymmetric", int4_ckpt(1, 3, 160, 96, 128, false, 11), 1,
           KT_FORMAT_INT4_G128_ZP}};
}

// The checkpoint's weights as read_back gives them: gate, up, down [E][out][in].
std::vector<float> decoded(const kt_io_test::quant::QuantCkpt& q, bool bf16) {
  std::vector<float> all;
  for (int p = 0; p < 3; ++p)
    for (float v : q.w[p]) all.push_back(bf16 ? kt::bf16_to_f32(kt::f32_to_bf16(v)) : v);
  return all;
}

class PackedStored : public PackedCache {
 protected:
  // The layer options the checkpoint gives (its native format).
  kt_moe_options options_of(const std::string& dir, int64_t L) {
    kt_ckpt* ck = nullptr;
    EXPECT_EQ(kt_ckpt_open(dir.c_str(), &ck), KT_OK) << kt_last_error();
    kt_moe_options o;
    kt_moe_options_init(&o);
    EXPECT_EQ(kt_ckpt_moe_options(ck, L, &o), KT_OK) << kt_last_error();
    kt_ckpt_close(ck);
    o.max_tokens = 64;
    return o;
  }
  // Layer L of dir loaded into a layer of o's format (dequantized into bf16).
  kt_moe* from_ckpt(kt_engine* e, const std::string& dir, int64_t L, const kt_moe_options& o) {
    kt_moe* m = layer(e, o);
    kt_ckpt* ck = nullptr;
    EXPECT_EQ(kt_ckpt_open(dir.c_str(), &ck), KT_OK) << kt_last_error();
    kt_ckpt_load_options lo;
    kt_ckpt_load_options_init(&lo);
    lo.dequantize = o.weight_format == KT_FORMAT_BF16;
    EXPECT_EQ(kt_ckpt_load_layer_with(ck, L, m, &lo, nullptr, nullptr), KT_OK) << kt_last_error();
    kt_ckpt_close(ck);
    return m;
  }
};

TEST_F(PackedStored, CheckpointFormatsRoundTripAsStoredBitIdenticalOnEveryIsa) {
  const kt_isa isas[] = {KT_ISA_REF, KT_ISA_AVX2, KT_ISA_AVX512BF16, KT_ISA_AMX};
  for (const StoredCase& c : stored_cases()) {
    const std::string ckpt = path(std::to_string(c.layer) + "_" + kt_weight_format_name(c.format) + "_" +
                                  std::to_string(c.q.H));
    c.q.write(ckpt);
    const kt_moe_options o = options_of(ckpt, c.layer);
    ASSERT_EQ(o.weight_format, c.format) << c.name;
    const std::string file = path("stored.ktpack");
    kt_moe* saved = from_ckpt(engine(KT_ISA_AUTO), ckpt, c.layer, o);
    ASSERT_EQ(kt_moe_save_packed(saved, file.c_str()), KT_OK) << c.name << ": " << kt_last_error();
    kt_moe_info info;
    info.struct_size = sizeof(info);
    ASSERT_EQ(kt_moe_get_info(saved, &info), KT_OK);
    kt_packed_info pi;
    pi.struct_size = sizeof(pi);
    ASSERT_EQ(kt_packed_read_info(file.c_str(), &pi), KT_OK) << kt_last_error();
    EXPECT_EQ(pi.weight_format, c.format) << c.name;
    EXPECT_EQ(pi.weight_bytes, info.weight_bytes) << c.name;
    EXPECT_EQ(pi.num_experts, c.q.E);
    EXPECT_EQ(pi.num_loaded, c.q.E);
    EXPECT_EQ(pi.has_bias, o.has_bias);
    // Codes and scales as the layer holds them, not bf16 panels.
    EXPECT_GE(std::filesystem::file_size(file), static_cast<uintmax_t>(info.weight_bytes)) << c.name;
    EXPECT_LT(std::filesystem::file_size(file), static_cast<uintmax_t>(info.weight_bytes + 6 * 4096 + 4096)) << c.name;
    int ran = 0;
    for (kt_isa isa : isas) {
      kt_engine* e = engine(isa);
      if (!e) continue;
      ++ran;
      const std::string what = c.name + " on " + kt_isa_name(isa);
      kt_moe* mapped = layer(e, o);
      ASSERT_EQ(kt_moe_load_packed(mapped, file.c_str(), 0), KT_OK) << what << ": " << kt_last_error();
      kt_moe_info mi;
      mi.struct_size = sizeof(mi);
      ASSERT_EQ(kt_moe_get_info(mapped, &mi), KT_OK);
      EXPECT_EQ(mi.weight_format, c.format) << what;
      EXPECT_EQ(mi.weight_bytes, info.weight_bytes) << what;
      EXPECT_EQ(read_back(mapped, o), decoded(c.q, false)) << what << ": the checkpoint's values, exactly";
      expect_identical(run(from_ckpt(e, ckpt, c.layer, o), o), run(mapped, o), what);
      const std::string again = path("again.ktpack");
      ASSERT_EQ(kt_moe_save_packed(mapped, again.c_str()), KT_OK) << kt_last_error();
      EXPECT_EQ(read_bytes(again), read_bytes(file)) << what << ": a mapped layer saves the same file";
    }
    EXPECT_GE(ran, 1);
  }
}

TEST_F(PackedStored, CachesOfAnotherFormatAreRefusedNamingBoth) {
  kt_engine* e = engine(KT_ISA_AUTO);
  for (const StoredCase& c : stored_cases()) {
    const std::string ckpt = path("ckpt_" + std::to_string(c.q.H));
    c.q.write(ckpt);
    const kt_moe_options o = options_of(ckpt, c.layer);
    kt_moe_options ob = o;
    ob.weight_format = KT_FORMAT_BF16;
    // Another quantized format of the same shape: int4_g32 (or int8 for an int4_g32 checkpoint).
    kt_moe_options oq = o;
    oq.weight_format = c.format == KT_FORMAT_INT4_G32 ? KT_FORMAT_INT8_CHANNEL : KT_FORMAT_INT4_G32;
    const std::string stored = path("stored.ktpack"), bf16 = path("bf16.ktpack");
    ASSERT_EQ(kt_moe_save_packed(from_ckpt(e, ckpt, c.layer, o), stored.c_str()), KT_OK) << kt_last_error();
    ASSERT_EQ(kt_moe_save_packed(from_ckpt(e, ckpt, c.layer, ob), bf16.c_str()), KT_OK) << kt_last_error();
    kt_moe* quantized_other = layer(e, oq);
    struct Refusal {
      kt_moe* victim;
      kt_moe_options options;
      std::string file, held, stores;
    } refusals[] = {
        {from_ckpt(e, ckpt, c.layer, ob), ob, stored, kt_weight_format_name(c.format), "bf16"},
        {from_ckpt(e, ckpt, c.layer, o), o, bf16, "bf16", kt_weight_format_name(c.format)},
        {quantized_other, oq, stored, kt_weight_format_name(c.format), kt_weight_format_name(oq.weight_format)},
    };
    for (const Refusal& r : refusals) {
      const std::string what = c.name + ": a " + r.held + " cache into a " + r.stores + " layer";
      const bool loaded = r.victim != quantized_other;
      const Outputs before = loaded ? run(r.victim, r.options) : Outputs{};
      EXPECT_EQ(kt_moe_load_packed(r.victim, r.file.c_str(), 0), KT_ERR_INVALID_ARGUMENT) << what;
      const std::string msg = kt_last_error();
      EXPECT_NE(msg.find("kt_moe_load_packed: " + r.file + ": the cache holds " + r.held +
                         " weights, the layer stores " + r.stores),
                std::string::npos)
          << what << ": " << msg;
      if (loaded) {
        expect_identical(before, run(r.victim, r.options), what + ": the layer is as it was");
      } else {
        kt_moe_info mi;
        mi.struct_size = sizeof(mi);
        ASSERT_EQ(kt_moe_get_info(r.victim, &mi), KT_OK);
        EXPECT_EQ(mi.num_loaded, 0) << what << ": nothing was loaded";
      }
    }
    // A damaged header: the format field says another quantized format than
    // the panel layout it records.
    std::vector<uint8_t> b = read_bytes(stored);
    b[kOffFormat] = static_cast<uint8_t>(oq.weight_format);
    reseal(b);
    const std::string bad = path("bad.ktpack");
    kt_io_test::write_file(bad, b);
    kt_packed_info pi;
    pi.struct_size = sizeof(pi);
    EXPECT_EQ(kt_packed_read_info(bad.c_str(), &pi), KT_ERR_IO) << c.name;
    EXPECT_NE(std::string(kt_last_error()).find(std::string("this kt packs ") + kt_weight_format_name(oq.weight_format) +
                                                " weights in layout"),
              std::string::npos)
        << c.name << ": " << kt_last_error();
  }
}

#ifdef KT_CLI_PATH
// `kt-moe convert` keeps a quantized checkpoint's layers as stored, dequantizes
// them on request (--format bf16), never re-quantizes them; `kt-moe info`
// reports each cache's format.
TEST_F(PackedStored, ConvertKeepsQuantizedCheckpointsAsStored) {
  const std::string cli = KT_CLI_PATH;
  kt_engine* e = engine(KT_ISA_AUTO);
  for (const StoredCase& c : stored_cases()) {
    const std::string ckpt = path("ckpt_" + std::to_string(c.q.H)), out = path("out_" + std::to_string(c.q.H));
    const std::string name = kt_weight_format_name(c.format), file = "layer-" + std::to_string(c.layer) + ".ktpack";
    c.q.write(ckpt);
    ASSERT_EQ(std::system((cli + " convert " + ckpt + " " + out + " --json > " + path("convert.json")).c_str()), 0)
        << c.name;
    EXPECT_EQ(nlohmann::json::parse(read_bytes(path("convert.json")))["weight_format"], name) << c.name;
    const nlohmann::json manifest = nlohmann::json::parse(read_bytes(out + "/manifest.json"));
    ASSERT_EQ(manifest["layers"].size(), 1u);
    EXPECT_EQ(manifest["layers"][0]["weight_format"], name) << c.name;
    EXPECT_EQ(manifest["layers"][0]["file"], file);
    const kt_moe_options o = options_of(ckpt, c.layer);
    kt_moe* reference = from_ckpt(e, ckpt, c.layer, o);
    const std::string saved = path("saved.ktpack");
    ASSERT_EQ(kt_moe_save_packed(reference, saved.c_str()), KT_OK) << kt_last_error();
    EXPECT_EQ(read_bytes(out + "/" + file), read_bytes(saved)) << c.name << ": convert writes what the layer holds";
    kt_moe* mapped = layer(e, o);
    ASSERT_EQ(kt_moe_load_packed(mapped, (out + "/" + file).c_str(), 0), KT_OK) << kt_last_error();
    expect_identical(run(reference, o), run(mapped, o), c.name + " converted");

    ASSERT_EQ(std::system((cli + " info " + out + " --json > " + path("info.json")).c_str()), 0);
    const nlohmann::json info = nlohmann::json::parse(read_bytes(path("info.json")));
    ASSERT_EQ(info["layers"].size(), 1u);
    EXPECT_EQ(info["layers"][0]["weight_format"], name) << c.name;
    EXPECT_EQ(info["layers"][0]["experts"], c.q.E);

    // Asked for another quantized format: refused, naming both, nothing written.
    const std::string requant = path("requant_" + std::to_string(c.q.H));
    const std::string other = c.format == KT_FORMAT_INT8_CHANNEL ? "int4_g32" : "int8_channel";
    EXPECT_NE(std::system((cli + " convert " + ckpt + " " + requant + " --format " + other + " 2> " + path("err.txt"))
                              .c_str()),
              0)
        << c.name;
    const std::vector<uint8_t> err = read_bytes(path("err.txt"));
    const std::string err_text(err.begin(), err.end());
    EXPECT_NE(err_text.find("the kt_moe stores " + other), std::string::npos) << err_text;
    EXPECT_NE(err_text.find("never re-quantized"), std::string::npos) << err_text;
    EXPECT_FALSE(std::filesystem::exists(requant)) << c.name;

    // --format bf16: dequantized on request, each weight rounded to bf16 once.
    const std::string dense = path("dense_" + std::to_string(c.q.H));
    ASSERT_EQ(std::system((cli + " convert " + ckpt + " " + dense + " --format bf16 > /dev/null").c_str()), 0) << c.name;
    kt_moe_options ob = o;
    ob.weight_format = KT_FORMAT_BF16;
    kt_moe* dequantized = layer(e, ob);
    ASSERT_EQ(kt_moe_load_packed(dequantized, (dense + "/" + file).c_str(), 0), KT_OK) << kt_last_error();
    EXPECT_EQ(read_back(dequantized, ob), decoded(c.q, true)) << c.name;
  }
}
#endif

#ifdef KT_CLI_PATH
TEST_F(PackedCache, ConvertPacksEveryLayerOfACheckpoint) {
  // A two-layer checkpoint with kt's writer (fp32 weights, two shards).
  kt_moe_options o = options(false);
  const Weights w1(o, 41), w3(o, 43);
  const std::vector<kt_arg> a1 = w1.args(false), a3 = w3.args(false);
  kt_ckpt_layer_args layers[2] = {{1, a1.data(), a1.size()}, {3, a3.data(), a3.size()}};
  kt_ckpt_write_options wo;
  kt_ckpt_write_options_init(&wo);
  wo.dtype = KT_CKPT_DTYPE_F32;
  wo.max_shard_bytes = 40000;
  wo.config_json = "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", "
                   "\"num_experts_per_tok\": 2}";
  const std::string ckpt = path("ckpt"), out = path("packed");
  ASSERT_EQ(kt_ckpt_write_experts(ckpt.c_str(), &wo, layers, 2), KT_OK) << kt_last_error();
  const std::string cmd = std::string(KT_CLI_PATH) + " convert " + ckpt + " " + out + " --json > " + path("convert.json");
  ASSERT_EQ(std::system(cmd.c_str()), 0) << cmd;
  const nlohmann::json reply = nlohmann::json::parse(read_bytes(path("convert.json")));
  EXPECT_EQ(reply["ok"], true);
  EXPECT_EQ(reply["layers"], 2);
  const nlohmann::json manifest = nlohmann::json::parse(read_bytes(out + "/manifest.json"));
  ASSERT_EQ(manifest["layers"].size(), 2u);
  EXPECT_EQ(manifest["model_type"], "qwen3_moe");

  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(ckpt.c_str(), &ck), KT_OK) << kt_last_error();
  kt_engine* e = engine(KT_ISA_AUTO);
  for (const auto& entry : manifest["layers"]) {
    const int64_t L = entry["layer"].get<int64_t>();
    EXPECT_EQ(entry["file"], "layer-" + std::to_string(L) + ".ktpack");
    EXPECT_EQ(entry["experts"], o.num_experts);
    kt_moe_options lo;
    kt_moe_options_init(&lo);
    ASSERT_EQ(kt_ckpt_moe_options(ck, L, &lo), KT_OK) << kt_last_error();
    lo.max_tokens = 64;
    kt_moe* from_ckpt = layer(e, lo);
    ASSERT_EQ(kt_ckpt_load_layer(ck, L, from_ckpt, nullptr, nullptr), KT_OK) << kt_last_error();
    kt_moe* from_cache = layer(e, lo);
    const std::string file = out + "/" + entry["file"].get<std::string>();
    EXPECT_EQ(static_cast<int64_t>(std::filesystem::file_size(file)), entry["bytes"].get<int64_t>());
    ASSERT_EQ(kt_moe_load_packed(from_cache, file.c_str(), 0), KT_OK) << kt_last_error();
    expect_identical(run(from_ckpt, lo), run(from_cache, lo), "layer " + std::to_string(L));
  }
  kt_ckpt_close(ck);

  // --layers picks layers; an unknown layer fails and writes no manifest.
  const std::string out2 = path("packed3");
  ASSERT_EQ(std::system((std::string(KT_CLI_PATH) + " convert " + ckpt + " " + out2 + " --layers 3 > /dev/null").c_str()), 0);
  EXPECT_TRUE(std::filesystem::exists(out2 + "/layer-3.ktpack"));
  EXPECT_FALSE(std::filesystem::exists(out2 + "/layer-1.ktpack"));
  const std::string out9 = path("packed9");
  EXPECT_NE(std::system((std::string(KT_CLI_PATH) + " convert " + ckpt + " " + out9 + " --layers 9 2> /dev/null").c_str()), 0);
  EXPECT_FALSE(std::filesystem::exists(out9 + "/manifest.json"));
}
TEST_F(PackedCache, ConvertQuantizesAndInfoReportsEachLayersFormat) {
  kt_moe_options o = options(true);
  const Weights w1(o, 81), w2(o, 82);
  const std::vector<kt_arg> a1 = w1.args(true), a2 = w2.args(true);
  kt_ckpt_layer_args layers[2] = {{0, a1.data(), a1.size()}, {2, a2.data(), a2.size()}};
  const std::string ckpt = path("ckpt"), out = path("int8");
  ASSERT_EQ(kt_ckpt_write_experts(ckpt.c_str(), nullptr, layers, 2), KT_OK) << kt_last_error();
  const std::string cli = KT_CLI_PATH;
  ASSERT_EQ(std::system((cli + " convert " + ckpt + " " + out + " --format int8_channel --json > " +
                         path("convert.json")).c_str()),
            0);
  EXPECT_EQ(nlohmann::json::parse(read_bytes(path("convert.json")))["weight_format"], "int8_channel");
  const nlohmann::json manifest = nlohmann::json::parse(read_bytes(out + "/manifest.json"));
  for (const auto& entry : manifest["layers"]) EXPECT_EQ(entry["weight_format"], "int8_channel");

  // kt-moe info on the converted cache and on one of its files: each layer's format.
  ASSERT_EQ(std::system((cli + " info " + out + " --json > " + path("info.json")).c_str()), 0);
  const nlohmann::json info = nlohmann::json::parse(read_bytes(path("info.json")));
  ASSERT_EQ(info["layers"].size(), 2u);
  EXPECT_EQ(info["layers"][0]["file"], out + "/layer-0.ktpack");
  EXPECT_EQ(info["layers"][1]["file"], out + "/layer-2.ktpack");
  for (const auto& l : info["layers"]) {
    EXPECT_EQ(l["weight_format"], "int8_channel");
    EXPECT_EQ(l["experts"], o.num_experts);
    EXPECT_EQ(l["loaded"], o.num_experts);
    EXPECT_EQ(l["bias"], true);
  }
  ASSERT_EQ(std::system((cli + " info " + out + "/layer-2.ktpack > " + path("info.txt")).c_str()), 0);
  const std::vector<uint8_t> text = read_bytes(path("info.txt"));
  EXPECT_NE(std::string(text.begin(), text.end()).find("int8_channel"), std::string::npos);
  // The checkpoint itself: what it holds (dense F32 here).
  ASSERT_EQ(std::system((cli + " info " + ckpt + " --json > " + path("ckpt.json")).c_str()), 0);
  const nlohmann::json held = nlohmann::json::parse(read_bytes(path("ckpt.json")));
  EXPECT_EQ(held["layers"][0]["format"], "dense");
  EXPECT_EQ(held["layers"][0]["dtype"], "BF16");

  // The cache loads into an int8 layer as kt would quantize the checkpoint,
  // and is refused by a bf16 one.
  kt_engine* e = engine(KT_ISA_AUTO);
  kt_moe_options q = o;
  q.weight_format = KT_FORMAT_INT8_CHANNEL;
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(ckpt.c_str(), &ck), KT_OK) << kt_last_error();
  kt_moe* from_ckpt = layer(e, q);
  ASSERT_EQ(kt_ckpt_load_layer(ck, 2, from_ckpt, nullptr, nullptr), KT_OK) << kt_last_error();
  kt_ckpt_close(ck);
  kt_moe* from_cache = layer(e, q);
  ASSERT_EQ(kt_moe_load_packed(from_cache, (out + "/layer-2.ktpack").c_str(), 0), KT_OK) << kt_last_error();
  expect_identical(run(from_ckpt, q), run(from_cache, q), "int8 layer 2");
  EXPECT_EQ(kt_moe_load_packed(layer(e, o), (out + "/layer-2.ktpack").c_str(), 0), KT_ERR_INVALID_ARGUMENT);
  kt_packed_info pi;
  pi.struct_size = sizeof(pi);
  ASSERT_EQ(kt_packed_read_info((out + "/layer-0.ktpack").c_str(), &pi), KT_OK) << kt_last_error();
  EXPECT_EQ(pi.weight_format, KT_FORMAT_INT8_CHANNEL);
  kt_moe_info mi;
  mi.struct_size = sizeof(mi);
  ASSERT_EQ(kt_moe_get_info(from_cache, &mi), KT_OK);
  EXPECT_EQ(pi.weight_bytes, mi.weight_bytes);
  EXPECT_NE(std::system((cli + " convert " + ckpt + " " + path("x") + " --format fp4 2> /dev/null").c_str()), 0);
}
#endif

}  // namespace
