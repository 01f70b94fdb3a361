// Checkpoint reading: synthetic checkpoints of every layout (real key names
// and config.json fields) load into a layer that computes exactly what the
// same weights loaded from tensors compute; bad files fail with KT_ERR_IO
// naming the file and the tensor, and leave nothing open or loaded.
#include <algorithm>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "kt_c_api.h"
#include "st_builder.h"

using kt_io_test::StTensor;
using kt_io_test::synth_value;
using kt_test::Tensor;
using kt_test::TensorPtr;

namespace {

std::string make_temp_dir() {
  char tmpl[] = "/tmp/kt_io_test.XXXXXX";
  const char* d = mkdtemp(tmpl);
  return d ? d : "";
}

struct Shape {
  int64_t E = 4, H = 32, I = 16;
};

// Canonical weights of one layer: gate/up [E,I,H], down [E,H,I], biases.
struct Canonical {
  TensorPtr gate, up, down, bg, bu, bd;
  Canonical(int64_t L, const Shape& s) {
    gate = Tensor::make(kt_test::kF32, {s.E, s.I, s.H});
    up = Tensor::make(kt_test::kF32, {s.E, s.I, s.H});
    down = Tensor::make(kt_test::kF32, {s.E, s.H, s.I});
    bg = Tensor::make(kt_test::kF32, {s.E, s.I});
    bu = Tensor::make(kt_test::kF32, {s.E, s.I});
    bd = Tensor::make(kt_test::kF32, {s.E, s.H});
    for (int64_t e = 0; e < s.E; ++e) {
      for (int64_t r = 0; r < s.I; ++r)
        for (int64_t c = 0; c < s.H; ++c) {
          gate->set((e * s.I + r) * s.H + c, synth_value(L, e, 0, r, c));
          up->set((e * s.I + r) * s.H + c, synth_value(L, e, 1, r, c));
        }
      for (int64_t r = 0; r < s.H; ++r)
        for (int64_t c = 0; c < s.I; ++c) down->set((e * s.H + r) * s.I + c, synth_value(L, e, 2, r, c));
      for (int64_t j = 0; j < s.I; ++j) {
        bg->set(e * s.I + j, synth_value(L, e, 3, j, 0));
        bu->set(e * s.I + j, synth_value(L, e, 4, j, 0));
      }
      for (int64_t j = 0; j < s.H; ++j) bd->set(e * s.H + j, synth_value(L, e, 5, j, 0));
    }
  }
};

std::string layer_prefix(int64_t L) { return "model.layers." + std::to_string(L); }

// --------------------------------------------------------------- layouts

std::vector<StTensor> per_expert_tensors(int64_t L, const Shape& s, const std::string& dt, bool mixtral) {
  std::vector<StTensor> out;
  const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
  const char* mx[3] = {"w1", "w3", "w2"};
  for (int64_t e = 0; e < s.E; ++e)
    for (int p = 0; p < 3; ++p) {
      const std::string n = layer_prefix(L) + (mixtral ? ".block_sparse_moe.experts." : ".mlp.experts.") +
                            std::to_string(e) + "." + (mixtral ? mx[p] : names[p]) + ".weight";
      const int64_t rows = p == 2 ? s.H : s.I, cols = p == 2 ? s.I : s.H;
      out.push_back(kt_io_test::matrix(n, dt, rows, cols, [&](int64_t r, int64_t c) { return synth_value(L, e, p, r, c); }));
    }
  // The router and a dense part, which are not routed experts.
  out.push_back(kt_io_test::matrix(layer_prefix(L) + (mixtral ? ".block_sparse_moe.gate.weight" : ".mlp.gate.weight"),
                                   dt, s.E, s.H, [](int64_t, int64_t) { return 0.5f; }));
  return out;
}

// Fused: gate_up [E,2I,H] (gate rows first) and down [E,H,I], or the in x out
// transposes; gpt_oss interleaves gate/up and adds biases.
std::vector<StTensor> fused_tensors(int64_t L, const Shape& s, const std::string& dt, bool in_out, bool gpt_oss) {
  StTensor gu{layer_prefix(L) + ".mlp.experts.gate_up_proj", dt, {}, {}};
  StTensor dn{layer_prefix(L) + ".mlp.experts.down_proj", dt, {}, {}};
  gu.shape = in_out ? std::vector<int64_t>{s.E, s.H, 2 * s.I} : std::vector<int64_t>{s.E, 2 * s.I, s.H};
  dn.shape = in_out ? std::vector<int64_t>{s.E, s.I, s.H} : std::vector<int64_t>{s.E, s.H, s.I};
  auto gate_up_row = [&](int64_t e, int64_t row, int64_t col) {  // logical [2I, H]
    int p, r;
    if (gpt_oss) {
      p = row % 2;
      r = static_cast<int>(row / 2);
    } else {
      p = row < s.I ? 0 : 1;
      r = static_cast<int>(row < s.I ? row : row - s.I);
    }
    return synth_value(L, e, p, r, col);
  };
  for (int64_t e = 0; e < s.E; ++e) {
    if (in_out) {
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t j = 0; j < 2 * s.I; ++j) kt_io_test::put(gu.bytes, dt, gate_up_row(e, j, h));
      for (int64_t i = 0; i < s.I; ++i)
        for (int64_t h = 0; h < s.H; ++h) kt_io_test::put(dn.bytes, dt, synth_value(L, e, 2, h, i));
    } else {
      for (int64_t j = 0; j < 2 * s.I; ++j)
        for (int64_t h = 0; h < s.H; ++h) kt_io_test::put(gu.bytes, dt, gate_up_row(e, j, h));
      for (int64_t h = 0; h < s.H; ++h)
        for (int64_t i = 0; i < s.I; ++i) kt_io_test::put(dn.bytes, dt, synth_value(L, e, 2, h, i));
    }
  }
  std::vector<StTensor> out{gu, dn};
  if (gpt_oss) {
    StTensor gb{layer_prefix(L) + ".mlp.experts.gate_up_proj_bias", dt, {s.E, 2 * s.I}, {}};
    StTensor db{layer_prefix(L) + ".mlp.experts.down_proj_bias", dt, {s.E, s.H}, {}};
    for (int64_t e = 0; e < s.E; ++e) {
      for (int64_t j = 0; j < 2 * s.I; ++j) kt_io_test::put(gb.bytes, dt, synth_value(L, e, 3 + j % 2, j / 2, 0));
      for (int64_t j = 0; j < s.H; ++j) kt_io_test::put(db.bytes, dt, synth_value(L, e, 5, j, 0));
    }
    out.push_back(gb);
    out.push_back(db);
  }
  return out;
}

std::string config_json(const std::string& arch, const std::string& model_type, const Shape& s,
                        const std::string& experts_key, const std::string& inter_key, int top_k) {
  nlohmann::json c = {{"architectures", {arch}}, {"model_type", model_type}, {"hidden_size", s.H},
                      {experts_key, s.E}, {inter_key, s.I}, {"num_experts_per_tok", top_k},
                      {"hidden_act", "silu"}, {"num_hidden_layers", 4}, {"torch_dtype", "bfloat16"}};
  if (model_type == "gpt_oss") c["swiglu_limit"] = 7.0;
  return c.dump(2);
}

// ------------------------------------------------------------ the fixture

class Checkpoints : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = make_temp_dir();
    ASSERT_FALSE(dir_.empty());
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.num_threads = 2;
    eo.pin_threads = 0;
    ASSERT_EQ(kt_engine_create(&eo, &engine_), KT_OK) << kt_last_error();
  }
  void TearDown() override {
    kt_engine_destroy(engine_);
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string sub(const std::string& name) {
    const std::string d = dir_ + "/" + name;
    std::filesystem::create_directories(d);
    return d;
  }

  // Runs a forward of T tokens through moe, returns Y (fp32 bytes).
  std::vector<float> forward(kt_moe* moe, const kt_moe_options& o) {
    const int64_t T = 8, K = o.top_k, H = o.hidden;
    TensorPtr x = Tensor::make(kt_test::kF32, {T, H});
    TensorPtr ids = Tensor::make(kt_test::kI32, {T, K});
    TensorPtr w = Tensor::make(kt_test::kF32, {T, K});
    TensorPtr y = Tensor::make(kt_test::kF32, {T, H});
    for (int64_t i = 0; i < T * H; ++i) x->set(i, static_cast<double>((i * 37) % 23 - 11) / 16.0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < K; ++j) {
        ids->set(t * K + j, static_cast<double>((t + j) % o.num_experts));
        w->set(t * K + j, j == 0 ? 0.75 : 0.25 / static_cast<double>(K - 1));
      }
    kt_arg args[4] = {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, w->dl()}, {KT_ARG_Y, y->dl()}};
    EXPECT_EQ(kt_moe_forward(moe, args, 4, nullptr), KT_OK) << kt_last_error();
    std::vector<float> out(static_cast<size_t>(T * H));
    std::memcpy(out.data(), y->f32(), out.size() * 4);
    return out;
  }

  // Loads layer L from the checkpoint in dir and from canonical tensors, and
  // checks both layers compute bit-identical outputs.
  void expect_same_as_tensors(const std::string& dir, int64_t L, const Shape& s, bool bias) {
    kt_ckpt* ck = nullptr;
    ASSERT_EQ(kt_ckpt_open(dir.c_str(), &ck), KT_OK) << kt_last_error();
    kt_moe_options o;
    kt_moe_options_init(&o);
    ASSERT_EQ(kt_ckpt_moe_options(ck, L, &o), KT_OK) << kt_last_error();
    EXPECT_EQ(o.num_experts, s.E);
    EXPECT_EQ(o.hidden, s.H);
    EXPECT_EQ(o.intermediate, s.I);
    EXPECT_EQ(o.has_bias, bias ? 1 : 0);
    kt_moe* from_ckpt = nullptr;
    kt_moe* from_tensors = nullptr;
    ASSERT_EQ(kt_moe_create(engine_, &o, &from_ckpt), KT_OK) << kt_last_error();
    ASSERT_EQ(kt_moe_create(engine_, &o, &from_tensors), KT_OK) << kt_last_error();
    std::vector<int64_t> progress;
    auto record = [](int64_t done, int64_t total, void* user) {
      auto* v = static_cast<std::vector<int64_t>*>(user);
      v->push_back(done);
      v->push_back(total);
    };
    ASSERT_EQ(kt_ckpt_load_layer(ck, L, from_ckpt, record, &progress), KT_OK) << kt_last_error();
    ASSERT_GE(progress.size(), 2u);
    EXPECT_EQ(progress[progress.size() - 2], s.E);
    EXPECT_EQ(progress.back(), s.E);
    int64_t loaded = 0;
    ASSERT_EQ(kt_moe_num_loaded(from_ckpt, &loaded), KT_OK);
    EXPECT_EQ(loaded, s.E);

    Canonical c(L, s);
    std::vector<kt_arg> args = {{KT_ARG_W_GATE, c.gate->dl()}, {KT_ARG_W_UP, c.up->dl()}, {KT_ARG_W_DOWN, c.down->dl()}};
    if (bias) {
      args.push_back({KT_ARG_B_GATE, c.bg->dl()});
      args.push_back({KT_ARG_B_UP, c.bu->dl()});
      args.push_back({KT_ARG_B_DOWN, c.bd->dl()});
    }
    ASSERT_EQ(kt_moe_load_weights(from_tensors, nullptr, args.data(), args.size()), KT_OK) << kt_last_error();
    const std::vector<float> a = forward(from_ckpt, o), b = forward(from_tensors, o);
    ASSERT_EQ(a.size(), b.size());
    EXPECT_EQ(0, std::memcmp(a.data(), b.data(), a.size() * 4)) << "layer " << L << " of " << dir;
    double norm = 0;
    for (float v : a) norm += static_cast<double>(v) * v;
    EXPECT_GT(norm, 0.0);

    // The stored weights read back as the canonical values, exactly.
    TensorPtr g = Tensor::make(kt_test::kF32, {s.E, s.I, s.H});
    TensorPtr d = Tensor::make(kt_test::kF32, {s.E, s.H, s.I});
    std::vector<kt_arg> rargs = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_DOWN, d->dl()}};
    TensorPtr bu = Tensor::make(kt_test::kF32, {s.E, s.I});
    if (bias) rargs.push_back({KT_ARG_B_UP, bu->dl()});
    ASSERT_EQ(kt_ckpt_read_layer(ck, L, rargs.data(), rargs.size()), KT_OK) << kt_last_error();
    EXPECT_EQ(0, std::memcmp(g->f32(), c.gate->f32(), static_cast<size_t>(g->numel()) * 4));
    EXPECT_EQ(0, std::memcmp(d->f32(), c.down->f32(), static_cast<size_t>(d->numel()) * 4));
    if (bias) {
      EXPECT_EQ(0, std::memcmp(bu->f32(), c.bu->f32(), static_cast<size_t>(bu->numel()) * 4));
    }

    kt_moe_destroy(from_ckpt);
    kt_moe_destroy(from_tensors);
    kt_ckpt_close(ck);
  }

  std::string dir_;
  kt_engine* engine_ = nullptr;
};

kt_ckpt_layer_info layer_info(kt_ckpt* ck, int64_t index) {
  kt_ckpt_layer_info li;
  std::memset(&li, 0, sizeof(li));
  li.struct_size = sizeof(li);
  EXPECT_EQ(kt_ckpt_get_layer_info(ck, index, &li), KT_OK) << kt_last_error();
  return li;
}

// The names kt_ckpt_layer_tensor_at gives for layer L, in its order.
std::vector<std::string> layer_tensor_names(kt_ckpt* ck, int64_t index, int64_t L) {
  std::vector<std::string> out;
  const int64_t n = layer_info(ck, index).num_tensors;
  for (int64_t i = 0; i < n; ++i) {
    kt_ckpt_tensor t;
    t.struct_size = sizeof(t);
    EXPECT_EQ(kt_ckpt_layer_tensor_at(ck, L, i, &t), KT_OK) << kt_last_error();
    if (t.name) out.push_back(t.name);
  }
  return out;
}

kt_ckpt_info ckpt_info(kt_ckpt* ck) {
  kt_ckpt_info info;
  std::memset(&info, 0, sizeof(info));
  info.struct_size = sizeof(info);
  EXPECT_EQ(kt_ckpt_get_info(ck, &info), KT_OK) << kt_last_error();
  return info;
}

// ------------------------------------------------------------------ tests

TEST_F(Checkpoints, PerExpertQwenBf16) {
  const Shape s;
  const std::string d = sub("qwen");
  std::vector<StTensor> ts = per_expert_tensors(1, s, "BF16", false);
  for (auto& t : per_expert_tensors(3, s, "BF16", false)) ts.push_back(t);
  ts.push_back(kt_io_test::matrix("model.embed_tokens.weight", "BF16", 10, s.H, [](int64_t, int64_t) { return 1.f; }));
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(ts));
  kt_io_test::write_text(d + "/config.json", config_json("Qwen3MoeForCausalLM", "qwen3_moe", s, "num_experts",
                                                         "moe_intermediate_size", 2));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  const kt_ckpt_info info = ckpt_info(ck);
  EXPECT_STREQ(info.architecture, "Qwen3MoeForCausalLM");
  EXPECT_STREQ(info.model_type, "qwen3_moe");
  EXPECT_EQ(info.layout, KT_CKPT_LAYOUT_PER_EXPERT);
  EXPECT_EQ(info.num_moe_layers, 2);
  EXPECT_EQ(info.num_tensors, static_cast<int64_t>(ts.size()));
  EXPECT_EQ(info.num_files, 1);
  EXPECT_EQ(info.top_k, 2);
  const kt_ckpt_layer_info l0 = layer_info(ck, 0), l1 = layer_info(ck, 1);
  EXPECT_EQ(l0.layer, 1);
  EXPECT_EQ(l1.layer, 3);
  EXPECT_EQ(l1.num_experts, s.E);
  EXPECT_EQ(l1.hidden, s.H);
  EXPECT_EQ(l1.intermediate, s.I);
  EXPECT_EQ(l1.weight_dtype, KT_CKPT_DTYPE_BF16);
  EXPECT_EQ(l1.format, KT_CKPT_FORMAT_DENSE);
  EXPECT_EQ(l1.loadable, 1);
  EXPECT_EQ(l1.bytes, s.E * 3 * s.I * s.H * 2);
  kt_ckpt_tensor t;
  t.struct_size = sizeof(t);
  ASSERT_EQ(kt_ckpt_find_tensor(ck, "model.layers.3.mlp.experts.2.down_proj.weight", &t), KT_OK);
  EXPECT_EQ(t.dtype, KT_CKPT_DTYPE_BF16);
  EXPECT_EQ(t.ndim, 2);
  EXPECT_EQ(t.shape[0], s.H);
  EXPECT_EQ(t.nbytes, s.H * s.I * 2);
  uint16_t first;
  std::memcpy(&first, t.data, 2);
  EXPECT_EQ(kt::bf16_to_f32(first), synth_value(3, 2, 2, 0, 0));
  EXPECT_EQ(kt_ckpt_find_tensor(ck, "model.layers.3.mlp.experts.9.down_proj.weight", &t), KT_ERR_IO);
  EXPECT_NE(std::string(kt_last_error()).find("experts.9.down_proj"), std::string::npos);
  // Layer 3's expert tensors: its 3 x E weights, not the router, the
  // embedding or layer 1's.
  std::vector<std::string> want;
  for (const auto& st : per_expert_tensors(3, s, "BF16", false))
    if (st.name.find(".experts.") != std::string::npos) want.push_back(st.name);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(want.size(), static_cast<size_t>(3 * s.E));
  EXPECT_EQ(layer_tensor_names(ck, 1, 3), want);
  ASSERT_EQ(kt_ckpt_layer_tensor_at(ck, 3, 0, &t), KT_OK);
  EXPECT_EQ(t.nbytes, s.I * s.H * 2);
  EXPECT_EQ(layer_tensor_names(ck, 0, 1).size(), static_cast<size_t>(3 * s.E));
  EXPECT_EQ(kt_ckpt_layer_tensor_at(ck, 3, 3 * s.E, &t), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("outside [0, " + std::to_string(3 * s.E) + ")"), std::string::npos);
  kt_ckpt_close(ck);
  expect_same_as_tensors(d, 1, s, false);
  expect_same_as_tensors(d, 3, s, false);
}

TEST_F(Checkpoints, MixtralFp16Sharded) {
  const Shape s{3, 48, 32};
  const std::string d = sub("mixtral");
  std::vector<StTensor> all = per_expert_tensors(0, s, "F16", true);
  // Two shards; the second starts with a 1-byte tensor, so every tensor after
  // it sits at an odd offset (the loader must copy those, not misread them).
  std::vector<StTensor> a(all.begin(), all.begin() + 4), b{{"model.norm.step", "U8", {1}, {7}}};
  b.insert(b.end(), all.begin() + 4, all.end());
  kt_io_test::write_file(d + "/model-00001-of-00002.safetensors", kt_io_test::safetensors_bytes(a));
  kt_io_test::write_file(d + "/model-00002-of-00002.safetensors", kt_io_test::safetensors_bytes(b));
  nlohmann::json index = {{"metadata", {{"total_size", 0}}}, {"weight_map", nlohmann::json::object()}};
  for (const auto& t : a) index["weight_map"][t.name] = "model-00001-of-00002.safetensors";
  for (const auto& t : b) index["weight_map"][t.name] = "model-00002-of-00002.safetensors";
  kt_io_test::write_text(d + "/model.safetensors.index.json", index.dump());
  kt_io_test::write_text(d + "/config.json", config_json("MixtralForCausalLM", "mixtral", s, "num_local_experts",
                                                         "intermediate_size", 2));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(ckpt_info(ck).num_files, 2);
  EXPECT_EQ(ckpt_info(ck).layout, KT_CKPT_LAYOUT_MIXTRAL);
  EXPECT_EQ(layer_info(ck, 0).weight_dtype, KT_CKPT_DTYPE_F16);
  kt_ckpt_close(ck);
  expect_same_as_tensors(d, 0, s, false);
}

TEST_F(Checkpoints, FusedOutInFp32) {
  const Shape s{4, 32, 16};
  const std::string d = sub("fused");
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(fused_tensors(2, s, "F32", false, false)));
  kt_io_test::write_text(d + "/config.json", config_json("Qwen3_5MoeForCausalLM", "qwen3_5_moe", s, "num_experts",
                                                         "moe_intermediate_size", 2));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(layer_info(ck, 0).layout, KT_CKPT_LAYOUT_FUSED);
  kt_ckpt_close(ck);
  expect_same_as_tensors(d, 2, s, false);
}

TEST_F(Checkpoints, FusedInOutBf16) {
  const Shape s{4, 32, 48};
  const std::string d = sub("fused_in_out");
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(fused_tensors(0, s, "BF16", true, false)));
  kt_ckpt* ck = nullptr;  // no config.json: names and shapes alone decide
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(layer_info(ck, 0).layout, KT_CKPT_LAYOUT_FUSED_IN_OUT);
  EXPECT_EQ(layer_info(ck, 0).intermediate, 48);
  kt_ckpt_close(ck);
  expect_same_as_tensors(d, 0, s, false);
}

TEST_F(Checkpoints, GptOssDequantizedWithBiases) {
  const Shape s{4, 32, 32};
  const std::string d = sub("gpt_oss");
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(fused_tensors(1, s, "BF16", true, true)));
  kt_io_test::write_text(d + "/config.json", config_json("GptOssForCausalLM", "gpt_oss", s, "num_local_experts",
                                                         "intermediate_size", 2));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  const kt_ckpt_layer_info li = layer_info(ck, 0);
  EXPECT_EQ(li.layout, KT_CKPT_LAYOUT_GPT_OSS);
  EXPECT_EQ(li.has_bias, 1);
  kt_moe_options o;
  kt_moe_options_init(&o);
  ASSERT_EQ(kt_ckpt_moe_options(ck, 1, &o), KT_OK);
  EXPECT_EQ(o.activation, KT_ACT_SWIGLU_OAI);
  EXPECT_FLOAT_EQ(o.act_limit, 7.f);
  EXPECT_FLOAT_EQ(o.act_alpha, 1.702f);
  kt_ckpt_close(ck);
  expect_same_as_tensors(d, 1, s, true);
}

// The weights and biases a layer holds: [E][out][in] per projection, then
// [E][out] per projection's biases (empty without biases).
std::vector<std::vector<float>> held(kt_moe* moe, int64_t E, int64_t H, int64_t I, bool bias) {
  std::vector<std::vector<float>> out;
  for (int p = 0; p < (bias ? 6 : 3); ++p) {
    const int proj = p % 3;
    const int64_t rows = proj == 2 ? H : I, cols = proj == 2 ? I : H;
    TensorPtr t = p < 3 ? Tensor::make(kt_test::kF32, {E, rows, cols}) : Tensor::make(kt_test::kF32, {E, rows});
    kt_arg a{(p < 3 ? KT_ARG_W_GATE : KT_ARG_B_GATE) + proj, t->dl()};
    EXPECT_EQ(kt_moe_read_weights(moe, &a, 1), KT_OK) << kt_last_error();
    out.emplace_back(t->f32(), t->f32() + t->numel());
  }
  return out;
}

// A share (experts, slice [i0, i1), zero_down_bias) of layer L of the
// checkpoint in dir holds exactly the whole layer's values of its experts
// and slice: gate and up rows, down columns, gate and up biases cut to the
// slice, down biases whole or zero.
void expect_share_holds_its_part(kt_engine* engine, const std::string& dir, int64_t L,
                                 const std::vector<int64_t>& experts, int64_t i0, int64_t i1, int zero_down_bias) {
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(dir.c_str(), &ck), KT_OK) << kt_last_error();
  kt_moe_options o;
  kt_moe_options_init(&o);
  ASSERT_EQ(kt_ckpt_moe_options(ck, L, &o), KT_OK) << kt_last_error();
  const int64_t E = o.num_experts, H = o.hidden, I = o.intermediate;
  const bool bias = o.has_bias != 0;
  kt_moe* whole = nullptr;
  ASSERT_EQ(kt_moe_create(engine, &o, &whole), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_ckpt_load_layer(ck, L, whole, nullptr, nullptr), KT_OK) << kt_last_error();
  kt_moe_options so = o;
  so.num_experts = static_cast<int64_t>(experts.size());
  so.intermediate = i1 - i0;
  kt_moe* share = nullptr;
  ASSERT_EQ(kt_moe_create(engine, &so, &share), KT_OK) << kt_last_error();
  kt_ckpt_load_options lo;
  kt_ckpt_load_options_init(&lo);
  lo.experts = experts.data();
  lo.num_experts = so.num_experts;
  lo.intermediate_begin = i0;
  lo.intermediate_end = i1;
  lo.zero_down_bias = zero_down_bias;
  std::vector<int64_t> progress;
  auto record = [](int64_t done, int64_t total, void* user) {
    static_cast<std::vector<int64_t>*>(user)->push_back(done * 1000 + total);
  };
  ASSERT_EQ(kt_ckpt_load_layer_with(ck, L, share, &lo, record, &progress), KT_OK) << kt_last_error();
  ASSERT_FALSE(progress.empty());
  EXPECT_EQ(progress.back(), so.num_experts * 1000 + so.num_experts);
  int64_t loaded = 0;
  ASSERT_EQ(kt_moe_num_loaded(share, &loaded), KT_OK);
  EXPECT_EQ(loaded, so.num_experts);

  const auto w = held(whole, E, H, I, bias), s = held(share, so.num_experts, H, so.intermediate, bias);
  const int64_t Is = so.intermediate;
  int64_t bad = 0, checked = 0;
  auto same = [&](float got, float want, const char* what, int64_t k) {
    ++checked;
    if (got != want && bad++ < 3) ADD_FAILURE() << what << " of share expert " << k << ": " << got << " != " << want;
  };
  for (size_t k = 0; k < experts.size(); ++k) {
    const int64_t e = experts[k], kk = static_cast<int64_t>(k);
    for (int p = 0; p < 2; ++p)
      for (int64_t r = 0; r < Is; ++r)
        for (int64_t c = 0; c < H; ++c)
          same(s[p][static_cast<size_t>((kk * Is + r) * H + c)], w[p][static_cast<size_t>((e * I + i0 + r) * H + c)],
               p ? "up" : "gate", kk);
    for (int64_t r = 0; r < H; ++r)
      for (int64_t c = 0; c < Is; ++c)
        same(s[2][static_cast<size_t>((kk * H + r) * Is + c)], w[2][static_cast<size_t>((e * H + r) * I + i0 + c)],
             "down", kk);
    if (!bias) continue;
    for (int p = 3; p < 5; ++p)
      for (int64_t r = 0; r < Is; ++r)
        same(s[p][static_cast<size_t>(kk * Is + r)], w[p][static_cast<size_t>(e * I + i0 + r)], "gate/up bias", kk);
    for (int64_t r = 0; r < H; ++r)
      same(s[5][static_cast<size_t>(kk * H + r)], zero_down_bias ? 0.f : w[5][static_cast<size_t>(e * H + r)],
           "down bias", kk);
  }
  EXPECT_EQ(bad, 0) << dir << " layer " << L;
  EXPECT_GT(checked, 0);
  kt_moe_destroy(share);
  kt_moe_destroy(whole);
  kt_ckpt_close(ck);
}

TEST_F(Checkpoints, SharesOfEveryLayoutHoldTheirExpertsAndSlice) {
  struct Layout {
    std::string name;
    Shape s;
    std::vector<StTensor> tensors;
    int64_t L;
  };
  const Shape s{4, 32, 16};
  std::vector<Layout> layouts = {
      {"per_expert_bf16", s, per_expert_tensors(1, s, "BF16", false), 1},
      {"mixtral_f16", s, per_expert_tensors(0, s, "F16", true), 0},
      {"fused_f32", s, fused_tensors(2, s, "F32", false, false), 2},
      {"fused_in_out_bf16", s, fused_tensors(0, s, "BF16", true, false), 0},
      {"gpt_oss_bf16", s, fused_tensors(1, s, "BF16", true, true), 1},
  };
  // A 1-byte tensor first puts every expert tensor at an odd offset: the
  // share's views are then copied, not mapped.
  std::vector<StTensor> odd{{"model.norm.step", "U8", {1}, {7}}};
  for (const StTensor& t : per_expert_tensors(3, s, "BF16", false)) odd.push_back(t);
  layouts.push_back({"per_expert_bf16_unaligned", s, odd, 3});
  for (const Layout& l : layouts) {
    SCOPED_TRACE(l.name);
    const std::string d = sub(l.name);
    kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(l.tensors));
    // Expert parallel: two experts, out of order; tensor parallel: the
    // second half of the intermediate dimension, without the down biases
    // (another rank adds them); both at once.
    expect_share_holds_its_part(engine_, d, l.L, {3, 1}, 0, 16, 0);
    expect_share_holds_its_part(engine_, d, l.L, {0, 1, 2, 3}, 8, 16, 1);
    expect_share_holds_its_part(engine_, d, l.L, {2}, 3, 11, 0);
  }
}

TEST_F(Checkpoints, TensorParallelSharesSumToTheWholeLayer) {
  // Two ranks of half the intermediate dimension each (the second without
  // the down biases) compute partial outputs whose sum is the whole layer's
  // output, as a tensor-parallel host's all-reduce makes it.
  const Shape s{4, 32, 16};
  const std::string d = sub("tp");
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(fused_tensors(1, s, "BF16", true, true)));
  kt_io_test::write_text(d + "/config.json", config_json("GptOssForCausalLM", "gpt_oss", s, "num_local_experts",
                                                         "intermediate_size", 2));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  kt_moe_options o;
  kt_moe_options_init(&o);
  ASSERT_EQ(kt_ckpt_moe_options(ck, 1, &o), KT_OK) << kt_last_error();
  o.act_limit = 0.f;  // the clamp is not linear across the slices' sum: SwiGLU-OAI unclamped
  kt_moe* whole = nullptr;
  ASSERT_EQ(kt_moe_create(engine_, &o, &whole), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_ckpt_load_layer(ck, 1, whole, nullptr, nullptr), KT_OK) << kt_last_error();
  const std::vector<float> want = forward(whole, o);
  std::vector<float> sum(want.size(), 0.f);
  for (int rank = 0; rank < 2; ++rank) {
    kt_moe_options so = o;
    so.intermediate = s.I / 2;
    kt_moe* part = nullptr;
    ASSERT_EQ(kt_moe_create(engine_, &so, &part), KT_OK) << kt_last_error();
    kt_ckpt_load_options lo;
    kt_ckpt_load_options_init(&lo);
    lo.intermediate_begin = rank * s.I / 2;
    lo.intermediate_end = (rank + 1) * s.I / 2;
    lo.zero_down_bias = rank;
    ASSERT_EQ(kt_ckpt_load_layer_with(ck, 1, part, &lo, nullptr, nullptr), KT_OK) << kt_last_error();
    const std::vector<float> y = forward(part, so);
    for (size_t i = 0; i < y.size(); ++i) sum[i] += y[i];
    kt_moe_destroy(part);
  }
  double num = 0, den = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    num += (static_cast<double>(sum[i]) - want[i]) * (static_cast<double>(sum[i]) - want[i]);
    den += static_cast<double>(want[i]) * want[i];
  }
  EXPECT_GT(den, 0.0);
  EXPECT_LE(std::sqrt(num / den), 1e-6) << "the ranks' sum against the whole layer (fp32 sums in another order)";
  kt_moe_destroy(whole);
  kt_ckpt_close(ck);
}

TEST_F(Checkpoints, BadSharesAreRefusedAndLeaveTheLayerEmpty) {
  const Shape s{4, 32, 16};
  const std::string d = sub("bad_share");
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(per_expert_tensors(0, s, "BF16", false)));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  kt_moe_options o;
  kt_moe_options_init(&o);
  ASSERT_EQ(kt_ckpt_moe_options(ck, 0, &o), KT_OK) << kt_last_error();
  o.num_experts = 2;
  o.intermediate = 8;
  kt_moe* moe = nullptr;
  ASSERT_EQ(kt_moe_create(engine_, &o, &moe), KT_OK) << kt_last_error();
  struct Bad {
    std::vector<int64_t> experts;
    int64_t n, i0, i1;
    int zero_down_bias;
    kt_status status;
    const char* says;
  };
  const std::vector<Bad> cases = {
      {{0, 4}, 2, 0, 8, 0, KT_ERR_INVALID_ARGUMENT, "experts[1] = 4 is not an expert of the layer [0, 4)"},
      {{1, 1}, 2, 0, 8, 0, KT_ERR_INVALID_ARGUMENT, "experts[1] = 1 is listed twice"},
      {{}, 2, 0, 8, 0, KT_ERR_INVALID_ARGUMENT, "num_experts = 2 without an experts list"},
      {{0, 1, 2, 3, 0}, 5, 0, 8, 0, KT_ERR_INVALID_ARGUMENT, "num_experts = 5 is not in [1, 4]"},
      {{0, 1}, 2, 8, 4, 0, KT_ERR_INVALID_ARGUMENT, "intermediate_begin, _end = 8, 4 is not a slice"},
      {{0, 1}, 2, 12, 20, 0, KT_ERR_INVALID_ARGUMENT, "intermediate_begin, _end = 12, 20"},
      {{0, 1}, 2, 0, 8, 2, KT_ERR_INVALID_ARGUMENT, "zero_down_bias = 2 is not 0 or 1"},
      {{0, 1, 2}, 3, 0, 8, 0, KT_ERR_SHAPE, "num_experts (in the share loaded) = 3 but the kt_moe was created with 2"},
      {{0, 1}, 2, 0, 16, 0, KT_ERR_SHAPE, "intermediate (in the share loaded) = 16 but the kt_moe was created with 8"},
  };
  for (const Bad& b : cases) {
    kt_ckpt_load_options lo;
    kt_ckpt_load_options_init(&lo);
    lo.experts = b.experts.empty() ? nullptr : b.experts.data();
    lo.num_experts = b.n;
    lo.intermediate_begin = b.i0;
    lo.intermediate_end = b.i1;
    lo.zero_down_bias = b.zero_down_bias;
    EXPECT_EQ(kt_ckpt_load_layer_with(ck, 0, moe, &lo, nullptr, nullptr), b.status) << b.says;
    EXPECT_NE(std::string(kt_last_error()).find(b.says), std::string::npos) << kt_last_error();
    int64_t loaded = -1;
    ASSERT_EQ(kt_moe_num_loaded(moe, &loaded), KT_OK);
    EXPECT_EQ(loaded, 0) << b.says;
  }
  kt_moe_destroy(moe);
  kt_ckpt_close(ck);
}

TEST_F(Checkpoints, QuantizedFormatsAreDescribed) {
  const Shape s{2, 256, 128};
  const std::string d = sub("gpt_oss_mxfp4");
  const std::string p = "model.layers.0.mlp.experts.";
  std::vector<StTensor> ts = {
      {p + "gate_up_proj_blocks", "U8", {s.E, 2 * s.I, s.H / 32, 16}, std::vector<uint8_t>(static_cast<size_t>(s.E * 2 * s.I * s.H / 2), 0x21)},
      {p + "gate_up_proj_scales", "F8_E8M0", {s.E, 2 * s.I, s.H / 32}, std::vector<uint8_t>(static_cast<size_t>(s.E * 2 * s.I * s.H / 32), 127)},
      {p + "down_proj_blocks", "U8", {s.E, s.H, s.I / 32, 16}, std::vector<uint8_t>(static_cast<size_t>(s.E * s.H * s.I / 2), 0x21)},
      {p + "down_proj_scales", "F8_E8M0", {s.E, s.H, s.I / 32}, std::vector<uint8_t>(static_cast<size_t>(s.E * s.H * s.I / 32), 127)},
      {p + "gate_up_proj_bias", "BF16", {s.E, 2 * s.I}, std::vector<uint8_t>(static_cast<size_t>(s.E * 2 * s.I * 2), 0)},
      {p + "down_proj_bias", "BF16", {s.E, s.H}, std::vector<uint8_t>(static_cast<size_t>(s.E * s.H * 2), 0)},
  };
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(ts));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  const kt_ckpt_layer_info li = layer_info(ck, 0);
  EXPECT_EQ(li.layout, KT_CKPT_LAYOUT_GPT_OSS);
  EXPECT_EQ(li.format, KT_CKPT_FORMAT_MXFP4);
  EXPECT_EQ(li.hidden, s.H);
  EXPECT_EQ(li.intermediate, s.I);
  EXPECT_EQ(li.num_experts, s.E);
  EXPECT_EQ(li.loadable, 1);
  EXPECT_EQ(li.weight_format, KT_FORMAT_MXFP4);
  EXPECT_EQ(li.group_size, 32);
  kt_ckpt_tensor t;
  t.struct_size = sizeof(t);
  ASSERT_EQ(kt_ckpt_find_tensor(ck, (p + "down_proj_scales").c_str(), &t), KT_OK);
  EXPECT_EQ(t.dtype, KT_CKPT_DTYPE_E8M0);
  // Blocks, scales and biases, in name order.
  std::vector<std::string> want;
  for (const auto& st : ts) want.push_back(st.name);
  std::sort(want.begin(), want.end());
  EXPECT_EQ(layer_tensor_names(ck, 0, 0), want);
  kt_moe_options o;
  kt_moe_options_init(&o);
  ASSERT_EQ(kt_ckpt_moe_options(ck, 0, &o), KT_OK);
  kt_moe* moe = nullptr;
  EXPECT_EQ(o.weight_format, KT_FORMAT_MXFP4);
  ASSERT_EQ(kt_moe_create(engine_, &o, &moe), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_ckpt_load_layer(ck, 0, moe, nullptr, nullptr), KT_OK) << kt_last_error();
  kt_moe_destroy(moe);
  // Into a bf16 layer only when the host asks for dequantization.
  o.weight_format = KT_FORMAT_BF16;
  ASSERT_EQ(kt_moe_create(engine_, &o, &moe), KT_OK) << kt_last_error();
  EXPECT_EQ(kt_ckpt_load_layer(ck, 0, moe, nullptr, nullptr), KT_ERR_UNSUPPORTED);
  EXPECT_NE(std::string(kt_last_error()).find("mxfp4"), std::string::npos) << kt_last_error();
  EXPECT_NE(std::string(kt_last_error()).find("dequantize"), std::string::npos) << kt_last_error();
  kt_moe_destroy(moe);
  kt_ckpt_close(ck);

  // DeepSeek-V3 style fp8 blocks with weight_scale_inv.
  const std::string f = sub("fp8");
  std::vector<StTensor> f8;
  for (int64_t e = 0; e < 2; ++e)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const bool down = std::string(proj) == "down_proj";
      const int64_t out = down ? 256 : 128, in = down ? 128 : 256;
      const std::string n = "model.layers.5.mlp.experts." + std::to_string(e) + "." + proj;
      f8.push_back({n + ".weight", "F8_E4M3", {out, in}, std::vector<uint8_t>(static_cast<size_t>(out * in), 0x38)});
      f8.push_back({n + ".weight_scale_inv", "F32", {out / 128, in / 128}, std::vector<uint8_t>(static_cast<size_t>(out / 128 * in / 128 * 4), 0)});
    }
  kt_io_test::write_file(f + "/model.safetensors", kt_io_test::safetensors_bytes(f8));
  ASSERT_EQ(kt_ckpt_open(f.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(layer_info(ck, 0).format, KT_CKPT_FORMAT_FP8_BLOCK);
  EXPECT_EQ(layer_info(ck, 0).weight_dtype, KT_CKPT_DTYPE_F8_E4M3);
  EXPECT_EQ(layer_info(ck, 0).hidden, 256);
  EXPECT_EQ(layer_info(ck, 0).intermediate, 128);
  EXPECT_EQ(layer_info(ck, 0).bytes, 2 * (3 * 128 * 256 + 3 * 2 * 4));
  kt_ckpt_close(ck);

  // Kimi-K2-Thinking style compressed-tensors int4 (weight_packed int32
  // [out, in/8], weight_scale bf16 [out, in/32], weight_shape) and
  // DeepSeek-V4 style MXFP4 (ffn.experts.{e}.w1/w3/w2, e2m1 pairs + e8m0).
  const std::string q = sub("int4");
  std::vector<StTensor> i4, mx;
  for (int64_t e = 0; e < 3; ++e)
    for (int p = 0; p < 3; ++p) {
      const int64_t out = p == 2 ? 64 : 32, in = p == 2 ? 32 : 64;
      const char* names[3] = {"gate_proj", "up_proj", "down_proj"};
      const char* ws[3] = {"w1", "w3", "w2"};
      const std::string n = "model.layers.1.mlp.experts." + std::to_string(e) + "." + names[p];
      i4.push_back({n + ".weight_packed", "I32", {out, in / 8}, std::vector<uint8_t>(static_cast<size_t>(out * in / 2), 0x88)});
      i4.push_back({n + ".weight_scale", "BF16", {out, in / 32}, std::vector<uint8_t>(static_cast<size_t>(out * in / 16), 0)});
      std::vector<uint8_t> shape_bytes(16, 0);
      std::memcpy(shape_bytes.data(), &out, 8);
      std::memcpy(shape_bytes.data() + 8, &in, 8);
      i4.push_back({n + ".weight_shape", "I64", {2}, shape_bytes});
      const std::string m = "layers.4.ffn.experts." + std::to_string(e) + "." + ws[p];
      mx.push_back({m + ".weight", "U8", {out, in / 2}, std::vector<uint8_t>(static_cast<size_t>(out * in / 2), 0x11)});
      mx.push_back({m + ".scale", "F8_E8M0", {out, in / 32}, std::vector<uint8_t>(static_cast<size_t>(out * in / 32), 127)});
    }
  kt_io_test::write_file(q + "/model.safetensors", kt_io_test::safetensors_bytes(i4));
  ASSERT_EQ(kt_ckpt_open(q.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(layer_info(ck, 0).format, KT_CKPT_FORMAT_INT4_GROUP);
  EXPECT_EQ(layer_info(ck, 0).weight_dtype, KT_CKPT_DTYPE_I32);
  EXPECT_EQ(layer_info(ck, 0).hidden, 64);
  EXPECT_EQ(layer_info(ck, 0).intermediate, 32);
  EXPECT_EQ(layer_info(ck, 0).num_experts, 3);
  EXPECT_EQ(layer_info(ck, 0).loadable, 1);
  EXPECT_EQ(layer_info(ck, 0).weight_format, KT_FORMAT_INT4_G32);
  {  // packed weights, scales and shape tensors, all 27
    std::vector<std::string> want;
    for (const auto& st : i4) want.push_back(st.name);
    std::sort(want.begin(), want.end());
    EXPECT_EQ(layer_tensor_names(ck, 0, 1), want);
  }
  kt_ckpt_close(ck);
  // A format kt does not know (per-tensor fp8 scales, as ModelOpt writes)
  // is described as "other", and the checkpoint still opens.
  const std::string o8 = sub("fp8_per_tensor");
  std::vector<StTensor> pt;
  for (int64_t e = 0; e < 2; ++e)
    for (const char* proj : {"gate_proj", "up_proj", "down_proj"}) {
      const std::string n = "model.layers.0.mlp.experts." + std::to_string(e) + "." + proj;
      const bool down = std::string(proj) == "down_proj";
      pt.push_back({n + ".weight", "F8_E4M3", {down ? 32 : 16, down ? 16 : 32}, std::vector<uint8_t>(512, 0x38)});
      pt.push_back({n + ".weight_scale", "F32", {}, std::vector<uint8_t>(4, 0)});
    }
  kt_io_test::write_file(o8 + "/model.safetensors", kt_io_test::safetensors_bytes(pt));
  ASSERT_EQ(kt_ckpt_open(o8.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(layer_info(ck, 0).format, KT_CKPT_FORMAT_OTHER);
  EXPECT_STREQ(kt_ckpt_format_name(layer_info(ck, 0).format), "other");
  EXPECT_EQ(layer_info(ck, 0).loadable, 0);
  kt_ckpt_close(ck);
  const std::string v4 = sub("dsv4");
  kt_io_test::write_file(v4 + "/model.safetensors", kt_io_test::safetensors_bytes(mx));
  ASSERT_EQ(kt_ckpt_open(v4.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(layer_info(ck, 0).layer, 4);
  EXPECT_EQ(layer_info(ck, 0).layout, KT_CKPT_LAYOUT_MIXTRAL);
  EXPECT_EQ(layer_info(ck, 0).format, KT_CKPT_FORMAT_MXFP4);
  EXPECT_EQ(layer_info(ck, 0).hidden, 64);
  EXPECT_EQ(layer_info(ck, 0).intermediate, 32);
  kt_ckpt_close(ck);
}

TEST_F(Checkpoints, HubCacheBlobLinksAreInside) {
  // The Hugging Face hub cache: snapshots/<rev>/<file> links to ../../blobs/<hash>.
  const Shape s{2, 16, 16};
  const std::string repo = sub("models--org--name");
  std::filesystem::create_directories(repo + "/blobs");
  const std::string snap = sub("models--org--name/snapshots/0123abcd");
  kt_io_test::write_file(repo + "/blobs/9f86d081", kt_io_test::safetensors_bytes(per_expert_tensors(0, s, "BF16", false)));
  ASSERT_EQ(::symlink("../../blobs/9f86d081", (snap + "/model-00001-of-00001.safetensors").c_str()), 0);
  nlohmann::json index = {{"weight_map", nlohmann::json::object()}};
  for (const auto& t : per_expert_tensors(0, s, "BF16", false)) index["weight_map"][t.name] = "model-00001-of-00001.safetensors";
  kt_io_test::write_text(snap + "/model.safetensors.index.json", index.dump());
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(snap.c_str(), &ck), KT_OK) << kt_last_error();
  EXPECT_EQ(ckpt_info(ck).num_moe_layers, 1);
  kt_ckpt_close(ck);
  // A link to a blob of another repository is still outside.
  const std::string other = sub("models--other--name/blobs");
  kt_io_test::write_file(other + "/aa", kt_io_test::safetensors_bytes(per_expert_tensors(0, s, "BF16", false)));
  ASSERT_EQ(::unlink((snap + "/model-00001-of-00001.safetensors").c_str()), 0);
  ASSERT_EQ(::symlink("../../../models--other--name/blobs/aa", (snap + "/model-00001-of-00001.safetensors").c_str()), 0);
  EXPECT_EQ(kt_ckpt_open(snap.c_str(), &ck), KT_ERR_IO);
  EXPECT_NE(std::string(kt_last_error()).find("outside the checkpoint directory"), std::string::npos) << kt_last_error();
}

TEST_F(Checkpoints, LayerMismatchLeavesTheLayerEmpty) {
  const Shape s;
  const std::string d = sub("mismatch");
  kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(per_expert_tensors(0, s, "BF16", false)));
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_OK) << kt_last_error();
  kt_moe_options o;
  kt_moe_options_init(&o);
  ASSERT_EQ(kt_ckpt_moe_options(ck, 0, &o), KT_OK);
  o.hidden = s.H * 2;
  kt_moe* moe = nullptr;
  ASSERT_EQ(kt_moe_create(engine_, &o, &moe), KT_OK);
  EXPECT_EQ(kt_ckpt_load_layer(ck, 0, moe, nullptr, nullptr), KT_ERR_SHAPE);
  EXPECT_NE(std::string(kt_last_error()).find("hidden"), std::string::npos) << kt_last_error();
  int64_t loaded = -1;
  ASSERT_EQ(kt_moe_num_loaded(moe, &loaded), KT_OK);
  EXPECT_EQ(loaded, 0);
  EXPECT_EQ(kt_ckpt_load_layer(ck, 7, moe, nullptr, nullptr), KT_ERR_INVALID_ARGUMENT);
  EXPECT_NE(std::string(kt_last_error()).find("layer 7"), std::string::npos);
  kt_moe_destroy(moe);
  kt_ckpt_close(ck);
}

// -------------------------------------------------------------- bad input

struct BadCase {
  std::string name;
  std::function<void(const std::string& dir)> make;
  std::vector<std::string> message_parts;  // each must appear in kt_last_error()
};

class BadInput : public ::testing::TestWithParam<int> {};

std::vector<BadCase> bad_cases() {
  const Shape s{2, 16, 16};
  auto good = [s](int64_t L) { return kt_io_test::safetensors_bytes(per_expert_tensors(L, s, "BF16", false)); };
  const std::string w0 = "model.layers.0.mlp.experts.0.gate_proj.weight";
  std::vector<BadCase> c;
  c.push_back({"truncated_file", [good](const std::string& d) {
                 auto b = good(0);
                 b.resize(b.size() - 100);
                 kt_io_test::write_file(d + "/model.safetensors", b);
               },
               {"model.safetensors", "run past the data area"}});
  c.push_back({"shorter_than_length", [](const std::string& d) { kt_io_test::write_file(d + "/model.safetensors", {1, 2, 3}); },
               {"model.safetensors", "shorter than the 8-byte"}});
  c.push_back({"header_length_past_file", [good](const std::string& d) {
                 auto b = good(0);
                 b[0] = 0xff, b[1] = 0xff, b[2] = 0xff;
                 kt_io_test::write_file(d + "/model.safetensors", b);
               },
               {"model.safetensors", "header length", "past the end of the file"}});
  c.push_back({"malformed_json", [](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors", kt_io_test::raw_file("{\"a\": {\"dtype\": \"F32\",", 16));
               },
               {"model.safetensors", "header is malformed"}});
  c.push_back({"dtype_shape_mismatch", [w0](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors",
                                        kt_io_test::raw_file("{\"" + w0 + "\":{\"dtype\":\"F32\",\"shape\":[4,4],\"data_offsets\":[0,32]}}", 32));
               },
               {"model.safetensors", w0, "need 64 bytes", "span 32"}});
  c.push_back({"unknown_dtype", [w0](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors",
                                        kt_io_test::raw_file("{\"" + w0 + "\":{\"dtype\":\"Q4_K\",\"shape\":[4],\"data_offsets\":[0,4]}}", 4));
               },
               {"model.safetensors", w0, "unknown dtype 'Q4_K'"}});
  c.push_back({"overlapping_offsets", [](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors",
                                        kt_io_test::raw_file("{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[0,16]},"
                                                             "\"b.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 24));
               },
               {"model.safetensors", "'b.weight'", "overlaps tensor 'a.weight'"}});
  c.push_back({"offsets_out_of_file", [](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors",
                                        kt_io_test::raw_file("{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[16,32]}}", 20));
               },
               {"model.safetensors", "'a.weight'", "past the data area"}});
  c.push_back({"negative_offset", [](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors",
                                        kt_io_test::raw_file("{\"a.weight\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[-4,0]}}", 20));
               },
               {"model.safetensors", "'a.weight'", "not non-negative"}});
  c.push_back({"duplicate_tensor", [](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors",
                                        kt_io_test::raw_file("{\"a.weight\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1]},"
                                                             "\"a.weight\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2));
               },
               {"model.safetensors", "'a.weight' twice"}});
  c.push_back({"missing_expert_tensor", [s](const std::string& d) {
                 auto ts = per_expert_tensors(0, s, "BF16", false);
                 ts.erase(ts.begin() + 4);  // expert 1's up_proj
                 kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(ts));
               },
               {"model.layers.0.mlp.experts.1.up_proj.weight", "missing"}});
  c.push_back({"expert_shape_mismatch", [s](const std::string& d) {
                 auto ts = per_expert_tensors(0, s, "BF16", false);
                 ts[5] = kt_io_test::matrix(ts[5].name, "BF16", s.H, s.I + 2, [](int64_t, int64_t) { return 0.f; });
                 kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(ts));
               },
               {"model.safetensors", "model.layers.0.mlp.experts.1.down_proj.weight", "does not match"}});
  c.push_back({"config_disagrees", [good, s](const std::string& d) {
                 kt_io_test::write_file(d + "/model.safetensors", good(0));
                 kt_io_test::write_text(d + "/config.json", config_json("Qwen3MoeForCausalLM", "qwen3_moe", Shape{s.E + 1, s.H, s.I},
                                                                        "num_experts", "moe_intermediate_size", 2));
               },
               {"config.json", "expert count", "model.layers.0.mlp.experts"}});
  // Tensors under a layer's experts that kt does not recognise: said so,
  // not as a shape of 0 that disagrees with config.json.
  c.push_back({"no_recognised_experts", [s](const std::string& d) {
                 auto ts = per_expert_tensors(0, s, "BF16", false);
                 for (auto& t : ts) {
                   const size_t at = t.name.find("_proj.weight");
                   if (at != std::string::npos) t.name.replace(at, 12, "_linear.weight");
                 }
                 kt_io_test::write_file(d + "/model.safetensors", kt_io_test::safetensors_bytes(ts));
                 kt_io_test::write_text(d + "/config.json", config_json("Qwen3MoeForCausalLM", "qwen3_moe", s,
                                                                        "num_experts", "moe_intermediate_size", 2));
               },
               {"layer 0 has no recognised expert tensors", "'model.layers.0.mlp.experts.0.", "_linear.weight'",
                "mlp.experts.{e}.{gate_proj,up_proj,down_proj}.weight"}});
  auto index_with = [good](const std::string& d, const std::string& file) {
    kt_io_test::write_file(d + "/model-00001-of-00001.safetensors", good(0));
    nlohmann::json index = {{"weight_map", nlohmann::json::object()}};
    for (const auto& t : per_expert_tensors(0, Shape{2, 16, 16}, "BF16", false)) index["weight_map"][t.name] = file;
    kt_io_test::write_text(d + "/model.safetensors.index.json", index.dump());
  };
  c.push_back({"missing_shard", [index_with](const std::string& d) { index_with(d, "model-00002-of-00002.safetensors"); },
               {"model.safetensors.index.json", "model-00002-of-00002.safetensors", "No such file"}});
  c.push_back({"index_dotdot", [index_with](const std::string& d) { index_with(d, "../model-00001-of-00001.safetensors"); },
               {"model.safetensors.index.json", "not a plain relative path", "mlp.experts.0."}});
  c.push_back({"index_absolute", [index_with](const std::string& d) { index_with(d, "/etc/passwd"); },
               {"model.safetensors.index.json", "absolute path"}});
  c.push_back({"index_symlink_escape", [index_with, good](const std::string& d) {
                 const std::string outside = d + "_outside.safetensors";
                 kt_io_test::write_file(outside, good(0));
                 ::symlink(outside.c_str(), (d + "/linked.safetensors").c_str());
                 index_with(d, "linked.safetensors");
               },
               {"model.safetensors.index.json", "linked.safetensors", "outside the checkpoint directory"}});
  c.push_back({"index_tensor_not_in_shard", [good](const std::string& d) {
                 kt_io_test::write_file(d + "/a.safetensors", good(0));
                 nlohmann::json index = {{"weight_map", nlohmann::json::object()}};
                 for (const auto& t : per_expert_tensors(0, Shape{2, 16, 16}, "BF16", false)) index["weight_map"][t.name] = "a.safetensors";
                 index["weight_map"]["model.layers.0.mlp.experts.2.up_proj.weight"] = "a.safetensors";
                 kt_io_test::write_text(d + "/model.safetensors.index.json", index.dump());
               },
               {"model.safetensors.index.json", "experts.2.up_proj.weight", "does not hold it"}});
  c.push_back({"malformed_index", [](const std::string& d) {
                 kt_io_test::write_text(d + "/model.safetensors.index.json", "{\"weight_map\": [1, 2");
               },
               {"model.safetensors.index.json", "malformed"}});
  c.push_back({"no_checkpoint", [](const std::string&) {}, {"holds no model.safetensors"}});
  return c;
}

TEST_P(BadInput, FailsWithIoErrorNamingFileAndTensor) {
  const BadCase bc = bad_cases()[static_cast<size_t>(GetParam())];
  const std::string d = make_temp_dir();
  ASSERT_FALSE(d.empty());
  bc.make(d);
  kt_ckpt* ck = reinterpret_cast<kt_ckpt*>(0x1);
  kt_clear_error();
  EXPECT_EQ(kt_ckpt_open(d.c_str(), &ck), KT_ERR_IO) << bc.name;
  EXPECT_EQ(ck, reinterpret_cast<kt_ckpt*>(0x1)) << bc.name << ": output written on failure";
  const std::string msg = kt_last_error();
  for (const auto& part : bc.message_parts)
    EXPECT_NE(msg.find(part), std::string::npos) << bc.name << ": message lacks '" << part << "': " << msg;
  std::error_code ec;
  std::filesystem::remove_all(d, ec);
  std::filesystem::remove(d + "_outside.safetensors", ec);
}

INSTANTIATE_TEST_SUITE_P(Checkpoints, BadInput, ::testing::Range(0, static_cast<int>(bad_cases().size())),
                         [](const ::testing::TestParamInfo<int>& i) { return bad_cases()[static_cast<size_t>(i.param)].name; });

}  // namespace
