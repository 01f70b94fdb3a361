// The distributed checkpoint's planner: what a rank writes of each layer on
// a save (its record and the tensors of its file), and on a load which
// stored tensor goes where, every one checked against the manifest and the
// layer before anything is copied. The exchange between the ranks and the
// files themselves are dist_ckpt.cpp's. Private to src/dist.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "dist/dist_ckpt_types.h"
#include "io/safetensors.h"
#include "io/writer.h"

namespace kt::dist::ckpt {

using nlohmann::json;

// ------------------------------------------------------------------- save

// This rank's part of a save: its record of each layer and the tensors of
// its file.
struct SavePlan {
  std::vector<LayerRecord> records;
  std::vector<io::TensorToWrite> tensors;
  std::vector<std::shared_ptr<std::vector<char>>> buffers;  // weights read from the layers
  std::vector<unsigned> parts;                              // per layer
};

// The parts of a layer a save writes (the same on every rank: layer
// options agree; the optimizer part is settled after the records).
unsigned save_parts(const kt_moe_options& o, unsigned requested, int64_t number, const char* where);

// Appends layer l's record and, where this rank holds its experts, the
// tensors of `parts` to plan.
void plan_layer(SavePlan& plan, const Local& l, unsigned parts, const char* where);

// ------------------------------------------------------------------- load

// The manifest's fields, each read or failed as KT_ERR_IO naming label.
[[noreturn]] void bad_manifest(const std::string& label, const std::string& what);
const json& field(const json& j, const char* key, const std::string& label);
int64_t int_field(const json& j, const char* key, const std::string& label);
double number_field(const json& j, const char* key, const std::string& label);
std::string text_field(const json& j, const char* key, const std::string& label);

// The checkpoint as one rank reads it: the manifest and the files holding
// this rank's experts (mapped).
struct Opened {
  json manifest;
  std::string label;  // the manifest's path, for messages
  uint64_t id = 0;
  std::vector<std::string> files;
  std::map<int, std::unique_ptr<io::SafetensorsFile>> mapped;  // by saving rank
  bool mapped_ready = false;  // the files of `mapped` are open
};

// One copy of a load: a stored per-expert tensor into its destination.
struct Copy {
  const uint8_t* src = nullptr;
  kt_ckpt_dtype dtype = KT_CKPT_DTYPE_UNKNOWN;
  int64_t bytes = 0;
  const io::TensorEntry* entry = nullptr;
};

// What a load does on this rank for one layer.
struct LayerLoad {
  const Local* local = nullptr;
  unsigned parts = 0;
  bool weights_into_bound = false;
  // [local expert][gate, up, down, bias gate, bias up, bias down]
  std::vector<std::array<Copy, 6>> weights;
  std::vector<std::array<Copy, 6>> lora;  // [local expert][LoRA tensor]
  // [param][state][local expert]
  std::vector<std::vector<std::vector<Copy>>> optim;
  kt_optimizer_options opt_options{};
  int64_t step = 0;
  int momentum_started = 0;
};

// Layer l's load out of checkpoint c. Before c.mapped_ready it only marks in
// c.mapped the files this rank's experts are in; once they are mapped it
// plans every copy, checked.
LayerLoad plan_load(Opened& c, const Local& l, unsigned requested, const char* where);

}  // namespace kt::dist::ckpt
