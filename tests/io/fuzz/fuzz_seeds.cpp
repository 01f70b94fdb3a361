// Writes the seed corpora of the fuzz targets with kt's own writers:
//   <out>/header   safetensors files (kt_ckpt_write_experts, kt_ckpt_adapter_write)
//   <out>/index    sharded and single-file checkpoints, as bundles (fuzz_bundle.h)
//   <out>/layout   checkpoints with config.json, as bundles
//   <out>/adapter  adapters, as bundles
//   <out>/packed   packed caches (kt_moe_save_packed) of the fuzz_packed shapes, in each weight format
//                  (fp8 and mxfp4 layers from synthetic checkpoints of tests/io/quant_ckpt_builder.h)
//   <out>/quant    the config.json of each of those quantized checkpoints (and layout gets them whole)
//   <out>/optim    optimizer state files (kt_optimizer_save) of fuzz_optim_setups.h after a step
//   <out>/dist_ckpt distributed checkpoints (kt_dist_ckpt_save) of fuzz_dist_setups.h, as bundles
// Usage: kt_fuzz_seeds OUT_DIR
#include <dirent.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "fuzz_bundle.h"
#include "fuzz_dist_setups.h"
#include "fuzz_optim_setups.h"
#include "kt_c_api.h"
#include "quant_ckpt_builder.h"

namespace {

std::string g_out;

void must(kt_status st, const char* what) {
  if (st != KT_OK) {
    std::fprintf(stderr, "kt_fuzz_seeds: %s: %s\n", what, kt_last_error());
    std::exit(1);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

void write_seed(const std::string& corpus, const std::string& name, const std::string& bytes) {
  const std::string dir = g_out + "/" + corpus;
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary) << bytes;
}

// The files of a directory as a bundle.
std::string bundle_of(const std::string& dir) {
  std::vector<kt_fuzz::Entry> entries;
  DIR* d = opendir(dir.c_str());
  while (const dirent* e = d ? readdir(d) : nullptr) {
    const std::string n = e->d_name;
    if (n[0] == '.') continue;
    entries.push_back({n, read_file(dir + "/" + n), false});
  }
  if (d) closedir(d);
  return kt_fuzz::encode_bundle(entries);
}

// fp32 stacks of sin values: the seeds' weights.
struct Stack : kt_fuzz::Filled {
  Stack(std::vector<int64_t> s, float seed) : Filled(std::move(s), kt_fuzz::kF32, seed) {}
};

void checkpoints(const std::string& scratch) {
  const int64_t E = 2, H = 16, I = 8;
  Stack g({E, I, H}, 1), u({E, I, H}, 2), d({E, H, I}, 3), bg({E, I}, 4), bu({E, I}, 5), bd({E, H}, 6);
  kt_arg with_bias[6] = {{KT_ARG_W_GATE, &g.t}, {KT_ARG_W_UP, &u.t}, {KT_ARG_W_DOWN, &d.t},
                         {KT_ARG_B_GATE, &bg.t}, {KT_ARG_B_UP, &bu.t}, {KT_ARG_B_DOWN, &bd.t}};
  struct Case {
    const char* name;
    kt_ckpt_layout layout;
    kt_ckpt_dtype dtype;
    int64_t shard;
    bool bias, config;
  } cases[] = {
      {"per_expert_bf16", KT_CKPT_LAYOUT_PER_EXPERT, KT_CKPT_DTYPE_BF16, int64_t{1} << 30, false, true},
      {"mixtral_f32_sharded", KT_CKPT_LAYOUT_MIXTRAL, KT_CKPT_DTYPE_F32, 1500, false, true},
      {"per_expert_f16_bias_sharded", KT_CKPT_LAYOUT_PER_EXPERT, KT_CKPT_DTYPE_F16, 700, true, false},
      {"per_expert_bf16_bias", KT_CKPT_LAYOUT_PER_EXPERT, KT_CKPT_DTYPE_BF16, int64_t{1} << 30, true, true},
  };
  const char* config = "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"model_type\": \"qwen3_moe\", "
                       "\"hidden_size\": 16, \"moe_intermediate_size\": 8, \"num_experts\": 2, "
                       "\"num_experts_per_tok\": 2}";
  for (const Case& c : cases) {
    kt_ckpt_layer_args layers[2] = {{0, with_bias, static_cast<size_t>(c.bias ? 6 : 3)},
                                    {3, with_bias, static_cast<size_t>(c.bias ? 6 : 3)}};
    kt_ckpt_write_options o;
    kt_ckpt_write_options_init(&o);
    o.layout = c.layout;
    o.dtype = c.dtype;
    o.max_shard_bytes = c.shard;
    o.config_json = c.config ? config : nullptr;
    const std::string dir = scratch + "/" + c.name;
    must(kt_ckpt_write_experts(dir.c_str(), &o, layers, 2), c.name);
    const std::string b = bundle_of(dir);
    write_seed("index", c.name, b);
    write_seed("layout", c.name, b);
    const std::string single = read_file(dir + "/model.safetensors");
    if (!single.empty()) write_seed("header", std::string(c.name) + ".safetensors", single);
  }
}

void adapters(const std::string& scratch) {
  const int64_t E = 2, H = 16, I = 8, r = 2;
  Stack ag({E, r, H}, 1), bg({E, I, r}, 2), au({E, r, H}, 3), bu({E, I, r}, 4), ad({E, r, I}, 5), bd({E, H, r}, 6);
  kt_arg all[6] = {{KT_ARG_LORA_A_GATE, &ag.t}, {KT_ARG_LORA_B_GATE, &bg.t}, {KT_ARG_LORA_A_UP, &au.t},
                   {KT_ARG_LORA_B_UP, &bu.t},   {KT_ARG_LORA_A_DOWN, &ad.t}, {KT_ARG_LORA_B_DOWN, &bd.t}};
  struct Case {
    const char* name;
    unsigned targets;
    kt_ckpt_layout layout;
    kt_ckpt_dtype dtype;
    int rslora;
  } cases[] = {
      {"all_f32", KT_PROJ_ALL, KT_CKPT_LAYOUT_PER_EXPERT, KT_CKPT_DTYPE_F32, 0},
      {"down_bf16_mixtral", KT_PROJ_DOWN, KT_CKPT_LAYOUT_MIXTRAL, KT_CKPT_DTYPE_BF16, 1},
  };
  for (const Case& c : cases) {
    kt_ckpt_layer_args layer = {c.targets == KT_PROJ_ALL ? 1 : 4, c.targets == KT_PROJ_ALL ? all : all + 4,
                                static_cast<size_t>(c.targets == KT_PROJ_ALL ? 6 : 2)};
    kt_ckpt_adapter_config ac;
    kt_ckpt_adapter_config_init(&ac);
    ac.rank = r;
    ac.alpha = 4.f;
    ac.targets = c.targets;
    ac.layout = c.layout;
    ac.dtype = c.dtype;
    ac.use_rslora = c.rslora;
    ac.base_model = "org/base";
    const std::string dir = scratch + "/" + c.name;
    must(kt_ckpt_adapter_write(dir.c_str(), &ac, &layer, 1), c.name);
    write_seed("adapter", c.name, bundle_of(dir));
    write_seed("header", std::string("adapter_") + c.name + ".safetensors", read_file(dir + "/adapter_model.safetensors"));
  }
}

void packed_caches(const std::string& scratch, kt_engine* engine) {
  const int64_t E = 2, H = 32, I = 32;
  // Formats kt quantizes to from the weights below.
  const kt_weight_format formats[4] = {KT_FORMAT_BF16, KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32,
                                       KT_FORMAT_INT4_G128};
  for (kt_weight_format format : formats)
  for (int bias = 0; bias < 2; ++bias)
    for (int partial = 0; partial < 2; ++partial) {
      kt_moe_options o;
      kt_moe_options_init(&o);
      o.num_experts = E, o.hidden = H, o.intermediate = I, o.top_k = 1, o.max_tokens = 2, o.has_bias = bias;
      o.weight_format = format;
      kt_moe* m = nullptr;
      must(kt_moe_create(engine, &o, &m), "kt_moe_create");
      const int64_t n = partial ? 1 : E;
      Stack g({n, I, H}, 1), u({n, I, H}, 2), d({n, H, I}, 3), bg({n, I}, 4), bu({n, I}, 5), bd({n, H}, 6);
      std::vector<int64_t> map_v = {1};
      int64_t map_shape[1] = {1};
      DLTensor map{map_v.data(), {kDLCPU, 0}, 1, {kDLInt, 64, 1}, map_shape, nullptr, 0};
      std::vector<kt_arg> args = {{KT_ARG_W_GATE, &g.t}, {KT_ARG_W_UP, &u.t}, {KT_ARG_W_DOWN, &d.t}};
      if (bias) {
        args.push_back({KT_ARG_B_GATE, &bg.t});
        args.push_back({KT_ARG_B_UP, &bu.t});
        args.push_back({KT_ARG_B_DOWN, &bd.t});
      }
      if (partial) args.push_back({KT_ARG_EXPERT_MAP, &map});
      must(kt_moe_load_weights(m, nullptr, args.data(), args.size()), "kt_moe_load_weights");
      const std::string path = scratch + "/layer.ktpack";
      must(kt_moe_save_packed(m, path.c_str()), "kt_moe_save_packed");
      write_seed("packed", std::string(kt_weight_format_name(format)) + (bias ? "_bias" : "_nobias") +
                               (partial ? "_partial" : "") + ".ktpack",
                 read_file(path));
      kt_moe_destroy(m);
    }
  // fp8, mxfp4 and asymmetric int4 layers as checkpoints store them
  // (DeepSeek-V3 blocks, gpt-oss with biases, DeepSeek-V4, compressed-tensors
  // with zero points), loaded and saved as they are.
  using namespace kt_io_test::quant;
  const struct {
    const char* name;
    QuantCkpt ckpt;
  } stored[] = {{"fp8_b128_nobias", fp8_ckpt(0, E, H, I, 1)},
                {"mxfp4_bias", gpt_oss_ckpt(0, E, H, I, 2)},
                {"mxfp4_nobias", dsv4_ckpt(0, E, H, I, 3)},
                {"int4_g32_zp_nobias", int4_ckpt(0, E, H, I, 32, false, 4)},
                {"int4_g128_zp_nobias", int4_ckpt(0, E, H, I, 128, false, 5)}};
  for (const auto& c : stored) {
    const std::string dir = scratch + "/" + c.name;
    c.ckpt.write(dir);
    kt_ckpt* ck = nullptr;
    must(kt_ckpt_open(dir.c_str(), &ck), "kt_ckpt_open");
    kt_moe_options o;
    kt_moe_options_init(&o);
    must(kt_ckpt_moe_options(ck, 0, &o), "kt_ckpt_moe_options");
    o.max_tokens = 2;
    kt_moe* m = nullptr;
    must(kt_moe_create(engine, &o, &m), "kt_moe_create");
    must(kt_ckpt_load_layer(ck, 0, m, nullptr, nullptr), "kt_ckpt_load_layer");
    kt_ckpt_close(ck);
    const std::string path = scratch + "/layer.ktpack";
    must(kt_moe_save_packed(m, path.c_str()), "kt_moe_save_packed");
    write_seed("packed", std::string(c.name) + ".ktpack", read_file(path));
    kt_moe_destroy(m);
    write_seed("quant", std::string(c.name) + ".json", c.ckpt.config);
    write_seed("layout", c.name, bundle_of(dir));
  }
}

void optimizer_states(const std::string& scratch, kt_engine* engine) {
  const std::string path = scratch + "/optimizer.safetensors";
  for (const auto& s : kt_fuzz::optim_setups(engine)) {
    must(kt_optimizer_step(s->opt, nullptr), "kt_optimizer_step");
    must(kt_optimizer_save(s->opt, path.c_str()), "kt_optimizer_save");
    write_seed("optim", std::string(s->name) + ".safetensors", read_file(path));
  }
}

void dist_checkpoints(const std::string& scratch, kt_engine* engine) {
  const auto setup = kt_fuzz::dist_setup(engine);
  if (!setup) {
    std::printf("kt_fuzz_seeds: no dist_ckpt seeds: %s\n", kt_last_error());
    return;
  }
  for (const auto& l : setup->layers) must(kt_optimizer_step(l->opt, nullptr), "kt_optimizer_step");
  const struct {
    const char* name;
    std::vector<size_t> layers;
    unsigned parts;
  } cases[] = {{"both_layers_all_parts", {0, 1}, 0u},
               {"lora_adapter_only", {0}, KT_DIST_CKPT_ADAPTER},
               {"full_weights_and_optimizer", {1}, KT_DIST_CKPT_WEIGHTS | KT_DIST_CKPT_OPTIMIZER}};
  for (const auto& c : cases) {
    const std::vector<kt_dist_ckpt_layer> layers = setup->ckpt_layers(c.layers);
    kt_dist_ckpt_options o;
    kt_dist_ckpt_options_init(&o);
    o.parts = c.parts;
    const std::string dir = scratch + "/" + c.name;
    must(kt_dist_ckpt_save(setup->comm, dir.c_str(), layers.data(), layers.size(), &o), c.name);
    write_seed("dist_ckpt", c.name, bundle_of(dir));
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: kt_fuzz_seeds OUT_DIR\n");
    return 2;
  }
  g_out = argv[1];
  mkdir(g_out.c_str(), 0755);
  char tmpl[] = "/tmp/kt_fuzz_seeds.XXXXXX";
  const char* scratch = mkdtemp(tmpl);
  if (!scratch) return 1;
  checkpoints(scratch);
  adapters(scratch);
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = 1;
  eo.pin_threads = 0;
  kt_engine* engine = nullptr;
  must(kt_engine_create(&eo, &engine), "kt_engine_create");
  packed_caches(scratch, engine);
  optimizer_states(scratch, engine);
  dist_checkpoints(scratch, engine);
  must(kt_engine_destroy(engine), "kt_engine_destroy");
  std::system((std::string("rm -rf ") + scratch).c_str());
  return 0;
}
