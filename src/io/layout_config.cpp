#include "io/layout_parts.h"

// config.json: the model's type, top-k and activation, its
// quantization_config, and the shapes it states.

namespace kt {
namespace io {

namespace {

int64_t config_int(const json& c, std::initializer_list<const char*> keys) {
  for (const char* k : keys) {
    if (c.contains(k) && c[k].is_number_integer()) return c[k].get<int64_t>();
    if (c.contains("text_config") && c["text_config"].is_object() && c["text_config"].contains(k) &&
        c["text_config"][k].is_number_integer())
      return c["text_config"][k].get<int64_t>();
  }
  return -1;
}

}  // namespace

json read_model_config(const std::string& config_text, const std::string& config_path, ModelInfo* info_out) {
  ModelInfo& info = *info_out;
  json config = json::object();
  if (!config_text.empty()) {
    config = json::parse(config_text, nullptr, false);
    if (config.is_discarded() || !config.is_object())
      io_fail(config_path + ": not a JSON object");
    if (config.contains("architectures") && config["architectures"].is_array() &&
        !config["architectures"].empty() && config["architectures"][0].is_string())
      info.architecture = config["architectures"][0].get<std::string>();
    if (config.contains("model_type") && config["model_type"].is_string())
      info.model_type = config["model_type"].get<std::string>();
    const int64_t k = config_int(config, {"num_experts_per_tok", "experts_per_token", "moe_topk"});
    info.top_k = k > 0 ? k : 0;
  }
  if (info.model_type == "gpt_oss") {
    info.activation = KT_ACT_SWIGLU_OAI;
    info.act_alpha = 1.702f;
    info.act_limit = 7.f;
    if (config.contains("swiglu_limit") && config["swiglu_limit"].is_number())
      info.act_limit = config["swiglu_limit"].get<float>();
  }
  return config;
}

QuantConfig read_quant_config(const json& config, const std::string& config_path) {
  QuantConfig qc;
  qc.path = config_path + ": quantization_config";
  const json* q = nullptr;
  if (config.contains("quantization_config")) q = &config["quantization_config"];
  else if (config.contains("text_config") && config["text_config"].is_object() &&
           config["text_config"].contains("quantization_config"))
    q = &config["text_config"]["quantization_config"];
  if (!q || q->is_null()) return qc;
  if (!q->is_object()) io_fail(qc.path + " is not a JSON object");
  qc.q = q;
  if (q->contains("quant_method") && (*q)["quant_method"].is_string())
    qc.method = (*q)["quant_method"].get<std::string>();
  if (q->contains("format") && (*q)["format"].is_string()) qc.ct_format = (*q)["format"].get<std::string>();
  if (qc.method == "compressed-tensors" && q->contains("config_groups") && (*q)["config_groups"].is_object()) {
    // The group that quantizes the experts: one whose targets name Linear
    // layers or experts, else the first with weights.
    for (const auto& g : (*q)["config_groups"].items()) {
      const json& grp = g.value();
      if (!grp.is_object() || !grp.contains("weights") || !grp["weights"].is_object()) continue;
      bool targets_experts = false;
      if (grp.contains("targets") && grp["targets"].is_array())
        for (const auto& t : grp["targets"])
          if (t.is_string() && (t.get<std::string>() == "Linear" || t.get<std::string>().find("expert") != std::string::npos))
            targets_experts = true;
      if (!qc.weights || targets_experts) {
        qc.weights = &grp["weights"];
        if (grp.contains("format") && grp["format"].is_string()) qc.ct_format = grp["format"].get<std::string>();
        if (targets_experts) break;
      }
    }
  }
  return qc;
}

void check_config_agrees(const json& config, const ModelInfo& info, const std::map<int64_t, Collected>& by_layer,
                         const std::string& dir, const std::string& config_path) {
  const int64_t cfg_h = config_int(config, {"hidden_size", "dim"});
  const int64_t cfg_e = config_int(config, {"num_experts", "n_routed_experts", "num_local_experts"});
  const int64_t cfg_i = config_int(config, {"moe_intermediate_size"});
  for (const auto& m : info.layers) {
    if (m.E == 0 && (cfg_h > 0 || cfg_e > 0 || cfg_i > 0))
      io_fail(dir + ": layer " + std::to_string(m.layer) + " has no recognised expert tensors: '" +
              by_layer.at(m.layer).seen + "' and the others under its experts are none of " + kExpertNames);
    auto mismatch = [&](const char* key, int64_t cfg, int64_t got) {
      io_fail(config_path + ": " + key + " = " + std::to_string(cfg) + " but layer " +
              std::to_string(m.layer) + "'s expert tensors ('" + m.prefix + "') give " + std::to_string(got));
    };
    if (cfg_h > 0 && cfg_h != m.H) mismatch("hidden_size", cfg_h, m.H);
    if (cfg_e > 0 && cfg_e != m.E) mismatch("the expert count", cfg_e, m.E);
    if (cfg_i > 0 && cfg_i != m.I) mismatch("moe_intermediate_size", cfg_i, m.I);
  }
}

}  // namespace io
}  // namespace kt
