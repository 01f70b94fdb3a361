// Writers: full-expert checkpoints and PEFT adapters round-trip exactly, are
// sharded with an index, and a written checkpoint loads into a layer that
// computes what the source tensors compute.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <vector>

#include "harness.h"
#include "kt_c_api.h"
#include "st_builder.h"

using kt_io_test::synth_value;
using kt_test::Tensor;
using kt_test::TensorPtr;

namespace {

std::string make_temp_dir() {
  char tmpl[] = "/tmp/kt_io_writer.XXXXXX";
  const char* d = mkdtemp(tmpl);
  return d ? d : "";
}

// Stacked [E, rows, cols] tensor with element (e, r, c) = synth(L, e, p, r, c).
TensorPtr stacked(DLDataType dt, int64_t L, int p, int64_t E, int64_t rows, int64_t cols) {
  TensorPtr t = Tensor::make(dt, {E, rows, cols});
  for (int64_t e = 0; e < E; ++e)
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t c = 0; c < cols; ++c) t->set((e * rows + r) * cols + c, synth_value(L, e, p, r, c));
  return t;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() &&
         std::memcmp(a.bytes.data(), b.bytes.data(), static_cast<size_t>(a.numel() * a.t.dtype.bits / 8)) == 0;
}

class Writers : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = make_temp_dir();
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }
  std::string dir_;
};

TEST_F(Writers, FullCheckpointShardedRoundTripIsExact) {
  const int64_t E = 3, H = 32, I = 16;
  struct Layer {
    int64_t L;
    TensorPtr g, u, d, bg, bu, bd;
  };
  std::vector<Layer> layers;
  for (int64_t L : {1, 2}) {
    Layer l{L, stacked(kt_test::kBF16, L, 0, E, I, H), stacked(kt_test::kBF16, L, 1, E, I, H),
            stacked(kt_test::kBF16, L, 2, E, H, I), Tensor::make(kt_test::kBF16, {E, I}),
            Tensor::make(kt_test::kBF16, {E, I}), Tensor::make(kt_test::kBF16, {E, H})};
    for (int64_t i = 0; i < E * I; ++i) {
      l.bg->set(i, synth_value(L, i, 3, 0, 0));
      l.bu->set(i, synth_value(L, i, 4, 0, 0));
    }
    for (int64_t i = 0; i < E * H; ++i) l.bd->set(i, synth_value(L, i, 5, 0, 0));
    layers.push_back(std::move(l));
  }
  std::vector<std::vector<kt_arg>> args;
  std::vector<kt_ckpt_layer_args> la;
  for (auto& l : layers) {
    args.push_back({{KT_ARG_W_GATE, l.g->dl()}, {KT_ARG_W_UP, l.u->dl()}, {KT_ARG_W_DOWN, l.d->dl()},
                    {KT_ARG_B_GATE, l.bg->dl()}, {KT_ARG_B_UP, l.bu->dl()}, {KT_ARG_B_DOWN, l.bd->dl()}});
  }
  for (size_t i = 0; i < layers.size(); ++i) la.push_back({layers[i].L, args[i].data(), args[i].size()});
  kt_ckpt_write_options o;
  kt_ckpt_write_options_init(&o);
  o.max_shard_bytes = 5000;  // several shards
  const std::string config = "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", "
                             "\"hidden_size\": 32, \"moe_intermediate_size\": 16, \"num_experts\": 3, "
                             "\"num_experts_per_tok\": 2}";
  o.config_json = config.c_str();
  const std::string out = dir_ + "/full";
  ASSERT_EQ(kt_ckpt_write_experts(out.c_str(), &o, la.data(), la.size()), KT_OK) << kt_last_error();
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors.index.json"));
  EXPECT_TRUE(std::filesystem::exists(out + "/config.json"));
  int shards = 0;
  for (const auto& f : std::filesystem::directory_iterator(out)) {
    const std::string n = f.path().filename().string();
    EXPECT_EQ(n.find(".tmp."), std::string::npos) << "temporary file left: " << n;
    shards += n.rfind("model-", 0) == 0;
  }
  EXPECT_GT(shards, 2);

  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(out.c_str(), &ck), KT_OK) << kt_last_error();
  kt_ckpt_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(kt_ckpt_get_info(ck, &info), KT_OK);
  EXPECT_EQ(info.num_moe_layers, 2);
  EXPECT_EQ(info.num_files, shards);
  EXPECT_EQ(info.top_k, 2);
  for (auto& l : layers) {
    TensorPtr g = Tensor::make(kt_test::kBF16, {E, I, H}), u = Tensor::make(kt_test::kBF16, {E, I, H}),
              d = Tensor::make(kt_test::kBF16, {E, H, I}), bg = Tensor::make(kt_test::kBF16, {E, I}),
              bu = Tensor::make(kt_test::kBF16, {E, I}), bd = Tensor::make(kt_test::kBF16, {E, H});
    kt_arg r[6] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, u->dl()}, {KT_ARG_W_DOWN, d->dl()},
                   {KT_ARG_B_GATE, bg->dl()}, {KT_ARG_B_UP, bu->dl()}, {KT_ARG_B_DOWN, bd->dl()}};
    ASSERT_EQ(kt_ckpt_read_layer(ck, l.L, r, 6), KT_OK) << kt_last_error();
    EXPECT_TRUE(same_bytes(*g, *l.g));
    EXPECT_TRUE(same_bytes(*u, *l.u));
    EXPECT_TRUE(same_bytes(*d, *l.d));
    EXPECT_TRUE(same_bytes(*bg, *l.bg));
    EXPECT_TRUE(same_bytes(*bu, *l.bu));
    EXPECT_TRUE(same_bytes(*bd, *l.bd));
  }
  // A wrong destination shape writes nothing.
  TensorPtr wrong = Tensor::make(kt_test::kF32, {E, I, H + 1});
  kt_arg bad = {KT_ARG_W_GATE, wrong->dl()};
  EXPECT_EQ(kt_ckpt_read_layer(ck, 1, &bad, 1), KT_ERR_SHAPE);
  for (int64_t i = 0; i < wrong->numel(); ++i) ASSERT_EQ(wrong->get(i), 0.0);
  kt_ckpt_close(ck);
}

TEST_F(Writers, WrittenCheckpointLoadsLikeItsTensors) {
  const int64_t E = 4, H = 48, I = 32, L = 0;
  TensorPtr g = stacked(kt_test::kF32, L, 0, E, I, H), u = stacked(kt_test::kF32, L, 1, E, I, H),
            d = stacked(kt_test::kF32, L, 2, E, H, I);
  kt_arg a[3] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, u->dl()}, {KT_ARG_W_DOWN, d->dl()}};
  kt_ckpt_layer_args la = {L, a, 3};
  kt_ckpt_write_options o;
  kt_ckpt_write_options_init(&o);
  o.layout = KT_CKPT_LAYOUT_MIXTRAL;
  const std::string out = dir_ + "/single";
  ASSERT_EQ(kt_ckpt_write_experts(out.c_str(), &o, &la, 1), KT_OK) << kt_last_error();
  EXPECT_TRUE(std::filesystem::exists(out + "/model.safetensors"));
  EXPECT_FALSE(std::filesystem::exists(out + "/model.safetensors.index.json"));

  kt_engine* engine = nullptr;
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 2;
  eo.pin_threads = 0;
  ASSERT_EQ(kt_engine_create(&eo, &engine), KT_OK);
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(out.c_str(), &ck), KT_OK) << kt_last_error();
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  ASSERT_EQ(kt_ckpt_moe_options(ck, L, &mo), KT_OK);
  mo.top_k = 2;
  kt_moe *m1 = nullptr, *m2 = nullptr;
  ASSERT_EQ(kt_moe_create(engine, &mo, &m1), KT_OK);
  ASSERT_EQ(kt_moe_create(engine, &mo, &m2), KT_OK);
  ASSERT_EQ(kt_ckpt_load_layer(ck, L, m1, nullptr, nullptr), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_load_weights(m2, nullptr, a, 3), KT_OK) << kt_last_error();
  const int64_t T = 5;
  TensorPtr x = Tensor::make(kt_test::kF32, {T, H}), ids = Tensor::make(kt_test::kI32, {T, 2}),
            w = Tensor::make(kt_test::kF32, {T, 2}), y1 = Tensor::make(kt_test::kF32, {T, H}),
            y2 = Tensor::make(kt_test::kF32, {T, H});
  for (int64_t i = 0; i < T * H; ++i) x->set(i, ((i * 13) % 11 - 5) / 8.0);
  for (int64_t t = 0; t < T; ++t) {
    ids->set(t * 2, static_cast<double>(t % E));
    ids->set(t * 2 + 1, static_cast<double>((t + 1) % E));
    w->set(t * 2, 0.5);
    w->set(t * 2 + 1, 0.5);
  }
  kt_arg f1[4] = {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, w->dl()}, {KT_ARG_Y, y1->dl()}};
  kt_arg f2[4] = {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, w->dl()}, {KT_ARG_Y, y2->dl()}};
  ASSERT_EQ(kt_moe_forward(m1, f1, 4, nullptr), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_forward(m2, f2, 4, nullptr), KT_OK) << kt_last_error();
  EXPECT_TRUE(same_bytes(*y1, *y2));
  kt_moe_destroy(m1);
  kt_moe_destroy(m2);
  kt_ckpt_close(ck);
  kt_engine_destroy(engine);
}

TEST_F(Writers, WriterRefusesBadInputAndWritesNothing) {
  const int64_t E = 2, H = 16, I = 16;
  TensorPtr g = stacked(kt_test::kF32, 0, 0, E, I, H), d = stacked(kt_test::kF32, 0, 2, E, H, I + 1);
  kt_arg a[3] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, g->dl()}, {KT_ARG_W_DOWN, d->dl()}};
  kt_ckpt_layer_args la = {0, a, 3};
  const std::string out = dir_ + "/refused";
  EXPECT_EQ(kt_ckpt_write_experts(out.c_str(), nullptr, &la, 1), KT_ERR_SHAPE);
  EXPECT_NE(std::string(kt_last_error()).find("KT_ARG_W_DOWN"), std::string::npos) << kt_last_error();
  EXPECT_FALSE(std::filesystem::exists(out));
  kt_ckpt_write_options o;
  kt_ckpt_write_options_init(&o);
  o.dtype = KT_CKPT_DTYPE_F8_E4M3;
  EXPECT_EQ(kt_ckpt_write_experts(out.c_str(), &o, &la, 1), KT_ERR_INVALID_ARGUMENT);
  o.dtype = KT_CKPT_DTYPE_BF16;
  o.config_json = "{not json";
  EXPECT_EQ(kt_ckpt_write_experts(out.c_str(), &o, &la, 1), KT_ERR_INVALID_ARGUMENT);
  EXPECT_FALSE(std::filesystem::exists(out));
}

TEST_F(Writers, AdapterRoundTripIsExact) {
  const int64_t E = 3, H = 32, I = 16, r = 4;
  struct Lora {
    TensorPtr a[3], b[3];
  };
  std::vector<Lora> lora(2);
  std::vector<std::vector<kt_arg>> args(2);
  const int kA[3] = {KT_ARG_LORA_A_GATE, KT_ARG_LORA_A_UP, KT_ARG_LORA_A_DOWN};
  const int kB[3] = {KT_ARG_LORA_B_GATE, KT_ARG_LORA_B_UP, KT_ARG_LORA_B_DOWN};
  for (int l = 0; l < 2; ++l)
    for (int p = 0; p < 3; ++p) {
      const int64_t in = p == 2 ? I : H, out = p == 2 ? H : I;
      lora[static_cast<size_t>(l)].a[p] = Tensor::make(kt_test::kF32, {E, r, in});
      lora[static_cast<size_t>(l)].b[p] = Tensor::make(kt_test::kF32, {E, out, r});
      Tensor& ta = *lora[static_cast<size_t>(l)].a[p];
      Tensor& tb = *lora[static_cast<size_t>(l)].b[p];
      // Values that bf16 cannot hold: the round trip must keep fp32 bits.
      for (int64_t i = 0; i < ta.numel(); ++i) ta.set(i, std::sin(0.1 * static_cast<double>(i + 7 * l + 3 * p)) / 3.0);
      for (int64_t i = 0; i < tb.numel(); ++i) tb.set(i, std::cos(0.07 * static_cast<double>(i + 5 * l + p)) / 7.0);
      args[static_cast<size_t>(l)].push_back({kA[p], ta.dl()});
      args[static_cast<size_t>(l)].push_back({kB[p], tb.dl()});
    }
  kt_ckpt_layer_args la[2] = {{0, args[0].data(), args[0].size()}, {5, args[1].data(), args[1].size()}};
  kt_ckpt_adapter_config c;
  kt_ckpt_adapter_config_init(&c);
  c.rank = r;
  c.alpha = 8.f;
  c.use_rslora = 1;
  c.base_model = "Qwen/Qwen3-30B-A3B";
  const std::string out = dir_ + "/adapter";
  ASSERT_EQ(kt_ckpt_adapter_write(out.c_str(), &c, la, 2), KT_OK) << kt_last_error();

  kt_ckpt_adapter_config back;
  back.struct_size = sizeof(back);
  ASSERT_EQ(kt_ckpt_adapter_read_config(out.c_str(), &back), KT_OK) << kt_last_error();
  EXPECT_EQ(back.rank, r);
  EXPECT_FLOAT_EQ(back.alpha, 8.f);
  EXPECT_EQ(back.use_rslora, 1);
  EXPECT_EQ(back.targets, KT_PROJ_ALL);
  EXPECT_EQ(back.layout, KT_CKPT_LAYOUT_PER_EXPERT);
  EXPECT_EQ(back.dtype, KT_CKPT_DTYPE_F32);

  // PEFT's key names, one tensor per expert and projection.
  kt_ckpt* ck = nullptr;
  ASSERT_EQ(kt_ckpt_open(out.c_str(), &ck), KT_OK) << kt_last_error();
  kt_ckpt_tensor t;
  t.struct_size = sizeof(t);
  ASSERT_EQ(kt_ckpt_find_tensor(ck, "base_model.model.model.layers.5.mlp.experts.2.down_proj.lora_B.weight", &t), KT_OK)
      << kt_last_error();
  EXPECT_EQ(t.shape[0], H);
  EXPECT_EQ(t.shape[1], r);
  kt_ckpt_info info;
  info.struct_size = sizeof(info);
  ASSERT_EQ(kt_ckpt_get_info(ck, &info), KT_OK);
  EXPECT_EQ(info.num_tensors, 2 * 3 * E * 2);
  kt_ckpt_close(ck);

  for (int l = 0; l < 2; ++l) {
    Lora got;
    std::vector<kt_arg> ra;
    for (int p = 0; p < 3; ++p) {
      got.a[p] = Tensor::make(kt_test::kF32, lora[static_cast<size_t>(l)].a[p]->shape);
      got.b[p] = Tensor::make(kt_test::kF32, lora[static_cast<size_t>(l)].b[p]->shape);
      ra.push_back({kA[p], got.a[p]->dl()});
      ra.push_back({kB[p], got.b[p]->dl()});
    }
    ASSERT_EQ(kt_ckpt_adapter_read(out.c_str(), l == 0 ? 0 : 5, ra.data(), ra.size()), KT_OK) << kt_last_error();
    for (int p = 0; p < 3; ++p) {
      EXPECT_TRUE(same_bytes(*got.a[p], *lora[static_cast<size_t>(l)].a[p])) << "layer " << l << " proj " << p;
      EXPECT_TRUE(same_bytes(*got.b[p], *lora[static_cast<size_t>(l)].b[p])) << "layer " << l << " proj " << p;
    }
  }
  // A layer the adapter does not have is an argument error; a rank or an
  // expert count that does not match the destination is a shape error (the
  // file is fine). Each names the call; nothing is written.
  TensorPtr a3 = Tensor::make(kt_test::kF32, {E, r + 1, H});
  kt_arg one = {KT_ARG_LORA_A_GATE, a3->dl()};
  EXPECT_EQ(kt_ckpt_adapter_read(out.c_str(), 3, &one, 1), KT_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(kt_last_error()).rfind("kt_ckpt_adapter_read: ", 0), 0u) << kt_last_error();
  EXPECT_NE(std::string(kt_last_error()).find("layer 3"), std::string::npos) << kt_last_error();
  EXPECT_EQ(kt_ckpt_adapter_read(out.c_str(), 0, &one, 1), KT_ERR_SHAPE);
  EXPECT_EQ(std::string(kt_last_error()).rfind("kt_ckpt_adapter_read: ", 0), 0u) << kt_last_error();
  EXPECT_NE(std::string(kt_last_error()).find("experts.0.gate_proj.lora_A.weight"), std::string::npos) << kt_last_error();
  EXPECT_NE(std::string(kt_last_error()).find("wants [5,32]"), std::string::npos) << kt_last_error();
  for (int64_t i = 0; i < a3->numel(); ++i) ASSERT_EQ(a3->get(i), 0.0);
  TensorPtr a4 = Tensor::make(kt_test::kF32, {E + 1, r, H});
  kt_arg more = {KT_ARG_LORA_A_GATE, a4->dl()};
  EXPECT_EQ(kt_ckpt_adapter_read(out.c_str(), 0, &more, 1), KT_ERR_SHAPE);
  EXPECT_NE(std::string(kt_last_error()).find("holds 4 experts, the adapter 3"), std::string::npos) << kt_last_error();
  for (int64_t i = 0; i < a4->numel(); ++i) ASSERT_EQ(a4->get(i), 0.0);
  // The config struct may not be NULL: a null-pointer error, before any file is read.
  EXPECT_EQ(kt_ckpt_adapter_read_config(out.c_str(), nullptr), KT_ERR_NULL_POINTER);
  EXPECT_EQ(std::string(kt_last_error()), "kt_ckpt_adapter_read_config: config is NULL");
  EXPECT_EQ(kt_ckpt_adapter_read_config((dir_ + "/none").c_str(), nullptr), KT_ERR_NULL_POINTER);
}

TEST_F(Writers, AdapterBf16AndTargetsSubset) {
  const int64_t E = 2, H = 16, I = 32, r = 2;
  TensorPtr a = Tensor::make(kt_test::kBF16, {E, r, I}), b = Tensor::make(kt_test::kBF16, {E, H, r});
  for (int64_t i = 0; i < a->numel(); ++i) a->set(i, synth_value(0, i, 0, 0, 0));
  for (int64_t i = 0; i < b->numel(); ++i) b->set(i, synth_value(0, i, 1, 0, 0));
  kt_arg args[2] = {{KT_ARG_LORA_A_DOWN, a->dl()}, {KT_ARG_LORA_B_DOWN, b->dl()}};
  kt_ckpt_layer_args la = {7, args, 2};
  kt_ckpt_adapter_config c;
  kt_ckpt_adapter_config_init(&c);
  c.rank = r;
  c.targets = KT_PROJ_DOWN;
  c.dtype = KT_CKPT_DTYPE_BF16;
  c.layout = KT_CKPT_LAYOUT_MIXTRAL;
  const std::string out = dir_ + "/adapter_bf16";
  ASSERT_EQ(kt_ckpt_adapter_write(out.c_str(), &c, &la, 1), KT_OK) << kt_last_error();
  kt_ckpt_adapter_config back;
  back.struct_size = sizeof(back);
  ASSERT_EQ(kt_ckpt_adapter_read_config(out.c_str(), &back), KT_OK) << kt_last_error();
  EXPECT_EQ(back.targets, KT_PROJ_DOWN);
  EXPECT_EQ(back.layout, KT_CKPT_LAYOUT_MIXTRAL);
  EXPECT_EQ(back.dtype, KT_CKPT_DTYPE_BF16);
  TensorPtr a2 = Tensor::make(kt_test::kF32, {E, r, I});
  kt_arg ra = {KT_ARG_LORA_A_DOWN, a2->dl()};
  ASSERT_EQ(kt_ckpt_adapter_read(out.c_str(), 7, &ra, 1), KT_OK) << kt_last_error();
  for (int64_t i = 0; i < a2->numel(); ++i) EXPECT_EQ(a2->get(i), a->get(i));
  // Targets without their tensors are refused.
  c.targets = KT_PROJ_ALL;
  EXPECT_EQ(kt_ckpt_adapter_write((dir_ + "/refused").c_str(), &c, &la, 1), KT_ERR_INVALID_ARGUMENT);
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/refused/adapter_model.safetensors"));
}

TEST_F(Writers, AdapterLoadedBackReproducesTheForward) {
  const int64_t E = 4, H = 32, I = 48, r = 8, K = 2, T = 6;
  kt_engine* engine = nullptr;
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 2;
  eo.pin_threads = 0;
  ASSERT_EQ(kt_engine_create(&eo, &engine), KT_OK);
  kt_moe_options mo;
  kt_moe_options_init(&mo);
  mo.num_experts = E, mo.top_k = K, mo.hidden = H, mo.intermediate = I;
  mo.mode = KT_MODE_LORA, mo.lora_rank = r, mo.lora_alpha = 16.f;
  TensorPtr g = stacked(kt_test::kBF16, 0, 0, E, I, H), u = stacked(kt_test::kBF16, 0, 1, E, I, H),
            d = stacked(kt_test::kBF16, 0, 2, E, H, I);
  kt_arg w[3] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, u->dl()}, {KT_ARG_W_DOWN, d->dl()}};
  const int kA[3] = {KT_ARG_LORA_A_GATE, KT_ARG_LORA_A_UP, KT_ARG_LORA_A_DOWN};
  const int kB[3] = {KT_ARG_LORA_B_GATE, KT_ARG_LORA_B_UP, KT_ARG_LORA_B_DOWN};
  TensorPtr trained[6], loaded[6];
  std::vector<kt_arg> trained_args, loaded_args;
  for (int p = 0; p < 3; ++p) {
    const int64_t in = p == 2 ? I : H, out = p == 2 ? H : I;
    trained[2 * p] = Tensor::make(kt_test::kF32, {E, r, in});
    trained[2 * p + 1] = Tensor::make(kt_test::kF32, {E, out, r});
    loaded[2 * p] = Tensor::make(kt_test::kF32, {E, r, in});
    loaded[2 * p + 1] = Tensor::make(kt_test::kF32, {E, out, r});
    for (int q = 0; q < 2; ++q)
      for (int64_t i = 0; i < trained[2 * p + q]->numel(); ++i)
        trained[2 * p + q]->set(i, std::sin(0.37 * static_cast<double>(i) + p + 3 * q) * 0.05);
    trained_args.push_back({kA[p], trained[2 * p]->dl()});
    trained_args.push_back({kB[p], trained[2 * p + 1]->dl()});
    loaded_args.push_back({kA[p], loaded[2 * p]->dl()});
    loaded_args.push_back({kB[p], loaded[2 * p + 1]->dl()});
  }
  kt_ckpt_layer_args la = {12, trained_args.data(), trained_args.size()};
  kt_ckpt_adapter_config c;
  kt_ckpt_adapter_config_init(&c);
  c.rank = r;
  c.alpha = 16.f;
  const std::string out = dir_ + "/trained_adapter";
  ASSERT_EQ(kt_ckpt_adapter_write(out.c_str(), &c, &la, 1), KT_OK) << kt_last_error();
  kt_ckpt_adapter_config back;
  back.struct_size = sizeof(back);
  ASSERT_EQ(kt_ckpt_adapter_read_config(out.c_str(), &back), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_ckpt_adapter_read(out.c_str(), 12, loaded_args.data(), loaded_args.size()), KT_OK) << kt_last_error();

  // The layer that trained, and a fresh one configured from adapter_config.json.
  kt_moe *m1 = nullptr, *m2 = nullptr;
  ASSERT_EQ(kt_moe_create(engine, &mo, &m1), KT_OK) << kt_last_error();
  mo.lora_rank = back.rank, mo.lora_alpha = back.alpha, mo.use_rslora = back.use_rslora, mo.lora_targets = back.targets;
  ASSERT_EQ(kt_moe_create(engine, &mo, &m2), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_load_weights(m1, nullptr, w, 3), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_load_weights(m2, nullptr, w, 3), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_bind(m1, trained_args.data(), trained_args.size()), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_bind(m2, loaded_args.data(), loaded_args.size()), KT_OK) << kt_last_error();
  TensorPtr x = Tensor::make(kt_test::kBF16, {T, H}), ids = Tensor::make(kt_test::kI64, {T, K}),
            rw = Tensor::make(kt_test::kF32, {T, K}), y1 = Tensor::make(kt_test::kBF16, {T, H}),
            y2 = Tensor::make(kt_test::kBF16, {T, H});
  for (int64_t i = 0; i < T * H; ++i) x->set(i, std::cos(0.21 * static_cast<double>(i)));
  for (int64_t t = 0; t < T; ++t) {
    ids->set(t * K, static_cast<double>(t % E));
    ids->set(t * K + 1, static_cast<double>((t + 2) % E));
    rw->set(t * K, 0.7);
    rw->set(t * K + 1, 0.3);
  }
  kt_arg f1[4] = {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, rw->dl()}, {KT_ARG_Y, y1->dl()}};
  kt_arg f2[4] = {{KT_ARG_X, x->dl()}, {KT_ARG_IDS, ids->dl()}, {KT_ARG_ROUTE_WEIGHTS, rw->dl()}, {KT_ARG_Y, y2->dl()}};
  ASSERT_EQ(kt_moe_forward(m1, f1, 4, nullptr), KT_OK) << kt_last_error();
  ASSERT_EQ(kt_moe_forward(m2, f2, 4, nullptr), KT_OK) << kt_last_error();
  EXPECT_TRUE(same_bytes(*y1, *y2));
  double norm = 0;
  for (double v : y1->values()) norm += v * v;
  EXPECT_GT(norm, 0.0);
  float s1 = 0, s2 = 0;
  ASSERT_EQ(kt_moe_lora_scale(m1, &s1), KT_OK);
  ASSERT_EQ(kt_moe_lora_scale(m2, &s2), KT_OK);
  EXPECT_EQ(s1, s2);
  kt_moe_destroy(m1);
  kt_moe_destroy(m2);
  kt_engine_destroy(engine);
}

}  // namespace

namespace {

// Runs body in a forked child under a 10 s alarm: a reader that blocks (on a
// FIFO) fails the test instead of hanging the suite. The child's exit code
// is the number of failed expectations.
int run_with_watchdog(const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(10);
    _exit(body());
  }
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) return 1000 + WTERMSIG(status);
  return WEXITSTATUS(status);
}

int expect_refused(kt_status st, kt_status want, const std::string& call, const std::string& what) {
  const std::string msg = kt_last_error();
  const bool ok = st == want && msg.rfind(call + ": ", 0) == 0 && msg.find(what) != std::string::npos;
  if (!ok) std::fprintf(stderr, "%s: status %s, message: %s\n", call.c_str(), kt_status_string(st), msg.c_str());
  return ok ? 0 : 1;
}

TEST_F(Writers, ReadersRefuseFifosWithoutBlocking) {
  const int64_t E = 2, H = 16, I = 16;
  TensorPtr g = stacked(kt_test::kF32, 0, 0, E, I, H), d = stacked(kt_test::kF32, 0, 2, E, H, I);
  kt_arg a[3] = {{KT_ARG_W_GATE, g->dl()}, {KT_ARG_W_UP, g->dl()}, {KT_ARG_W_DOWN, d->dl()}};
  kt_ckpt_layer_args la = {0, a, 3};
  kt_ckpt_write_options o;
  kt_ckpt_write_options_init(&o);
  o.config_json = "{\"model_type\": \"qwen3_moe\"}";
  // model.safetensors as a FIFO.
  const std::string fifo_model = dir_ + "/fifo_model";
  ASSERT_EQ(kt_ckpt_write_experts(fifo_model.c_str(), &o, &la, 1), KT_OK) << kt_last_error();
  ASSERT_EQ(::unlink((fifo_model + "/model.safetensors").c_str()), 0);
  ASSERT_EQ(::mkfifo((fifo_model + "/model.safetensors").c_str(), 0644), 0);
  // config.json as a FIFO.
  const std::string fifo_config = dir_ + "/fifo_config";
  ASSERT_EQ(kt_ckpt_write_experts(fifo_config.c_str(), &o, &la, 1), KT_OK) << kt_last_error();
  ASSERT_EQ(::unlink((fifo_config + "/config.json").c_str()), 0);
  ASSERT_EQ(::mkfifo((fifo_config + "/config.json").c_str(), 0644), 0);
  // adapter_config.json as a FIFO.
  TensorPtr la_a = Tensor::make(kt_test::kF32, {E, 2, I}), la_b = Tensor::make(kt_test::kF32, {E, H, 2});
  kt_arg lora[2] = {{KT_ARG_LORA_A_DOWN, la_a->dl()}, {KT_ARG_LORA_B_DOWN, la_b->dl()}};
  kt_ckpt_layer_args ll = {0, lora, 2};
  kt_ckpt_adapter_config c;
  kt_ckpt_adapter_config_init(&c);
  c.rank = 2;
  c.targets = KT_PROJ_DOWN;
  const std::string fifo_adapter = dir_ + "/fifo_adapter";
  ASSERT_EQ(kt_ckpt_adapter_write(fifo_adapter.c_str(), &c, &ll, 1), KT_OK) << kt_last_error();
  ASSERT_EQ(::unlink((fifo_adapter + "/adapter_config.json").c_str()), 0);
  ASSERT_EQ(::mkfifo((fifo_adapter + "/adapter_config.json").c_str(), 0644), 0);
  // A packed cache path that is a FIFO.
  const std::string fifo_pack = dir_ + "/layer.ktpack";
  ASSERT_EQ(::mkfifo(fifo_pack.c_str(), 0644), 0);

  const int failures = run_with_watchdog([&] {
    int bad = 0;
    kt_ckpt* ck = nullptr;
    bad += expect_refused(kt_ckpt_open(fifo_model.c_str(), &ck), KT_ERR_IO, "kt_ckpt_open",
                          "model.safetensors: not a regular file (a FIFO)");
    bad += expect_refused(kt_ckpt_open(fifo_config.c_str(), &ck), KT_ERR_IO, "kt_ckpt_open",
                          "config.json: not a regular file (a FIFO)");
    kt_ckpt_adapter_config back;
    back.struct_size = sizeof(back);
    bad += expect_refused(kt_ckpt_adapter_read_config(fifo_adapter.c_str(), &back), KT_ERR_IO,
                          "kt_ckpt_adapter_read_config", "adapter_config.json: not a regular file (a FIFO)");
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.num_threads = 1;
    eo.pin_threads = 0;
    kt_engine* engine = nullptr;
    kt_moe* moe = nullptr;
    kt_moe_options mo;
    kt_moe_options_init(&mo);
    mo.num_experts = E, mo.hidden = H, mo.intermediate = I, mo.top_k = 1;
    if (kt_engine_create(&eo, &engine) != KT_OK || kt_moe_create(engine, &mo, &moe) != KT_OK) return 100;
    bad += expect_refused(kt_moe_load_packed(moe, fifo_pack.c_str(), 0), KT_ERR_IO, "kt_moe_load_packed",
                          "not a regular file (a FIFO)");
    // A directory in place of the cache file, too.
    bad += expect_refused(kt_moe_load_packed(moe, dir_.c_str(), 0), KT_ERR_IO, "kt_moe_load_packed",
                          "not a regular file (a directory)");
    kt_moe_destroy(moe);
    kt_engine_destroy(engine);
    return bad;
  });
  EXPECT_EQ(failures, 0) << "1000 + signal: a reader blocked (14 = SIGALRM after 10 s)";
}

// An adapter folder whose index maps no tensors at all: a clean error naming
// the call and the folder, no crash.
TEST_F(Writers, AdapterWithAnEmptyIndexIsRefused) {
  const int64_t E = 2, H = 16, I = 16;
  TensorPtr la_a = Tensor::make(kt_test::kF32, {E, 2, I}), la_b = Tensor::make(kt_test::kF32, {E, H, 2});
  kt_arg lora[2] = {{KT_ARG_LORA_A_DOWN, la_a->dl()}, {KT_ARG_LORA_B_DOWN, la_b->dl()}};
  kt_ckpt_layer_args ll = {0, lora, 2};
  kt_ckpt_adapter_config c;
  kt_ckpt_adapter_config_init(&c);
  c.rank = 2;
  c.targets = KT_PROJ_DOWN;
  const std::string out = dir_ + "/empty_index";
  ASSERT_EQ(kt_ckpt_adapter_write(out.c_str(), &c, &ll, 1), KT_OK) << kt_last_error();
  std::ofstream(out + "/model.safetensors.index.json") << "{\"weight_map\":{}}";
  TensorPtr a = Tensor::make(kt_test::kF32, {E, 2, I});
  kt_arg one = {KT_ARG_LORA_A_DOWN, a->dl()};
  EXPECT_EQ(kt_ckpt_adapter_read(out.c_str(), 0, &one, 1), KT_ERR_INVALID_ARGUMENT);
  const std::string msg = kt_last_error();
  EXPECT_EQ(msg.rfind("kt_ckpt_adapter_read: " + out + " holds no LoRA tensors of layer 0", 0), 0u) << msg;
  for (int64_t i = 0; i < a->numel(); ++i) ASSERT_EQ(a->get(i), 0.0);
}

}  // namespace
