#include "dist/dist_ckpt.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/ckpt_names.h"
#include "core/sized_struct.h"
#include "core/tensor.h"
#include "dist/comm.h"
#include "dist/dist_ckpt_plan.h"
#include "dist/dist_moe.h"
#include "formats/formats.h"
#include "io/elements.h"
#include "io/exporters.h"
#include "io/publish.h"
#include "io/safetensors.h"
#include "io/writer.h"
#include "moe/args.h"
#include "moe/moe_layer.h"
#include "optim/optimizer.h"
#include "runtime/handles.h"

namespace kt::dist {

using namespace ckpt;

namespace {

constexpr const char* kFormat = "kt_dist_checkpoint";
constexpr unsigned kAllParts = KT_DIST_CKPT_WEIGHTS | KT_DIST_CKPT_ADAPTER | KT_DIST_CKPT_OPTIMIZER;
constexpr size_t kPathBytes = 4096;

// The optimizer's name of a layer parameter ("LORA_A_GATE", "W_DOWN").
std::string param_name(int id) { return std::string(arg_name(id)).substr(7); }

std::string rank_file(int rank, int world) {
  char name[64];
  std::snprintf(name, sizeof(name), "rank-%05d-of-%05d.safetensors", rank, world);
  return name;
}

bool is_rank_file(const std::string& n) {
  int r = 0, w = 0;
  char tail[32] = {};
  return n.size() == 31 && std::sscanf(n.c_str(), "rank-%5d-of-%5d%20s", &r, &w, tail) == 3 &&
         std::strcmp(tail, ".safetensors") == 0;
}

uint64_t fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

std::vector<Local> resolve(kt_comm& comm, const char* dir, const kt_dist_ckpt_layer* layers, size_t n,
                           unsigned parts, const char* where) {
  const std::string w = where;
  KT_CHECK(dir != nullptr, KT_ERR_NULL_POINTER, w + ": dir is NULL");
  KT_CHECK(*dir != '\0', KT_ERR_INVALID_ARGUMENT, w + ": dir is empty");
  KT_CHECK((parts & ~kAllParts) == 0, KT_ERR_INVALID_ARGUMENT,
           w + ": options->parts = " + str(parts) +
               " has bits outside KT_DIST_CKPT_WEIGHTS | _ADAPTER | _OPTIMIZER");
  KT_CHECK(n >= 1, KT_ERR_INVALID_ARGUMENT, w + ": num_layers is 0");
  KT_CHECK(layers != nullptr, KT_ERR_NULL_POINTER, w + ": layers is NULL");
  std::vector<Local> out(n);
  for (size_t i = 0; i < n; ++i) {
    const std::string name = "layers[" + std::to_string(i) + "]";
    const kt_dist_ckpt_layer& L = layers[i];
    KT_CHECK(L.layer >= 0, KT_ERR_INVALID_ARGUMENT,
             w + ": " + name + ".layer = " + str(L.layer) + " must be >= 0");
    for (size_t j = 0; j < i; ++j)
      KT_CHECK(layers[j].layer != L.layer, KT_ERR_INVALID_ARGUMENT,
               w + ": layer " + str(L.layer) + " is given twice");
    Local& l = out[i];
    l.number = L.layer;
    const std::string dist_name = name + ".dist", opt_name = name + ".optimizer";
    l.dist = live(L.dist, HandleKind::kDistMoe, where, dist_name.c_str());
    KT_CHECK(l.dist->comm.get() == &comm, KT_ERR_INVALID_ARGUMENT,
             w + ": " + dist_name + " was created on another communicator than comm");
    l.experts = &l.dist->local_experts;
    if (l.dist->local) l.moe = live(l.dist->local, HandleKind::kMoe, where, "the local layer");
    if (L.optimizer) {
      l.opt = live(L.optimizer, HandleKind::kOptimizer, where, opt_name.c_str());
      KT_CHECK(l.holds(), KT_ERR_INVALID_ARGUMENT,
               w + ": rank " + str(comm.rank) + " holds no experts of layer " + str(L.layer) +
                   ": " + opt_name + " must be NULL");
      KT_CHECK(l.opt->layer_mode && l.opt->moe == l.moe.get(), KT_ERR_INVALID_ARGUMENT,
               w + ": " + opt_name + " is not an optimizer over this rank's layer of layer " +
                   str(L.layer) + " (kt_optimizer_create_for_layer of kt_dist_moe_layer)");
    } else {
      KT_CHECK(!(parts & KT_DIST_CKPT_OPTIMIZER) || !l.holds(), KT_ERR_NULL_POINTER,
               w + ": options->parts names KT_DIST_CKPT_OPTIMIZER but " + opt_name +
                   " is NULL on rank " + str(comm.rank) + ", which holds experts of layer " +
                   str(L.layer));
    }
  }
  return out;
}

// What the ranks agree on first.
struct CallHead {
  int64_t num_layers;
  uint64_t layers_hash;  // layer numbers, in order
  uint32_t parts;
  uint32_t unused;
  uint64_t checkpoint;   // load: the id of the checkpoint this rank read
};

CallHead head_of(const std::vector<Local>& locals, unsigned parts, uint64_t checkpoint) {
  CallHead h{};
  h.num_layers = static_cast<int64_t>(locals.size());
  h.layers_hash = 1469598103934665603ull;
  for (const Local& l : locals) h.layers_hash = fnv(h.layers_hash, static_cast<uint64_t>(l.number));
  h.parts = parts;
  h.checkpoint = checkpoint;
  return h;
}

void check_heads(const std::vector<char>& all, int world, const char* where) {
  CallHead first;
  std::memcpy(&first, all.data(), sizeof(first));
  for (int r = 1; r < world; ++r) {
    CallHead h;
    std::memcpy(&h, all.data() + usize(r) * sizeof(h), sizeof(h));
    const std::string rank = "rank " + str(r);
    KT_CHECK(h.num_layers == first.num_layers && h.layers_hash == first.layers_hash,
             KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": the ranks disagree on the layers: rank 0 passes " +
                 str(first.num_layers) + ", " + rank + " " + str(h.num_layers) +
                 " (every rank must pass the same layer numbers, in one order)");
    KT_CHECK(h.parts == first.parts, KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": the ranks disagree on options->parts: rank 0 has " +
                 str(first.parts) + ", " + rank + " has " + str(h.parts));
    KT_CHECK(h.checkpoint == first.checkpoint, KT_ERR_IO,
             std::string(where) + ": the ranks read different checkpoints (rank 0 and " + rank +
                 "): the directory was replaced while they opened it, or it is not on one shared "
                 "file system");
  }
}

const char* arithmetic_word(int a) { return a == KT_OPTIM_TORCH2 ? "torch2" : "torch1"; }

// The layer parameters an optimizer over a layer of these options holds.
std::vector<int> optimizer_params(const kt_moe_options& o) {
  std::vector<int> ids;
  if (o.mode == KT_MODE_LORA) {
    for (int i = 0; i < 6; ++i)
      if ((o.lora_targets >> (i / 2)) & 1u) ids.push_back(kLoraId[i]);
  } else if (o.mode == KT_MODE_FULL) {
    for (int p = 0; p < 3; ++p) ids.push_back(kWeightId[p]);
    if (o.has_bias)
      for (int p = 0; p < 3; ++p) ids.push_back(kBiasId[p]);
  }
  return ids;
}

LayerRecord record_at(const std::vector<char>& all, size_t stride, int rank, size_t index) {
  LayerRecord r;
  std::memcpy(&r, all.data() + usize(rank) * stride + index * sizeof(LayerRecord), sizeof(r));
  return r;
}

// Every rank holding experts of a layer must save it alike; returns the
// record of the first such rank (with has_opt settled).
LayerRecord agreed_record(const std::vector<char>& all, size_t stride, int world, size_t index, int64_t number,
                          const char* where) {
  const std::string lname = std::string(where) + ": layer " + str(number);
  int first = -1;
  LayerRecord ref{};
  for (int r = 0; r < world; ++r) {
    const LayerRecord rec = record_at(all, stride, r, index);
    if (!rec.holds) continue;
    if (first < 0) {
      first = r;
      ref = rec;
      continue;
    }
    const std::string pair = "rank " + str(first) + " and rank " + str(r);
    KT_CHECK(
        rec.has_opt == ref.has_opt, KT_ERR_INVALID_ARGUMENT,
        lname + ": " + pair +
            " disagree on whether an optimizer is given (every rank holding experts passes one, "
            "or none)");
    KT_CHECK(rec.weight_dtype == ref.weight_dtype, KT_ERR_INVALID_ARGUMENT,
             lname + ": " + pair + " hold their trainable weights in different dtypes");
    for (int i = 0; i < 6; ++i)
      KT_CHECK(rec.lora_dtype[i] == ref.lora_dtype[i], KT_ERR_INVALID_ARGUMENT,
               lname + ": " + pair + " bind " + arg_name(kLoraId[i]) + " in different dtypes");
    if (!ref.has_opt) continue;
    KT_CHECK(rec.algorithm == ref.algorithm && rec.amsgrad == ref.amsgrad &&
                 rec.nesterov == ref.nesterov && rec.arithmetic == ref.arithmetic,
             KT_ERR_INVALID_ARGUMENT,
             lname + ": " + pair + " have optimizers of different algorithms or settings");
    KT_CHECK(rec.step == ref.step && rec.momentum_started == ref.momentum_started,
             KT_ERR_INVALID_ARGUMENT,
             lname + ": " + pair + " have optimizers at different step counts (" + str(ref.step) +
                 " and " + str(rec.step) + ")");
    for (int h = 0; h < 7; ++h)
      KT_CHECK(rec.hyper[h] == ref.hyper[h], KT_ERR_INVALID_ARGUMENT,
               lname + ": " + pair + " have optimizers with different " + kHyperNames[h]);
  }
  KT_CHECK(first >= 0, KT_ERR_INTERNAL, lname + ": no rank holds its experts");
  return ref;
}

std::string dtype_word(int32_t d) { return io::dtype_name(static_cast<kt_ckpt_dtype>(d)); }

json manifest_layer(const Local& l, const LayerRecord& rec, unsigned parts, int world) {
  const kt_moe_options& o = l.options();
  const kt_dist_moe& d = *l.dist;
  json j;
  j["layer"] = l.number;
  j["num_experts"] = o.num_experts;
  j["top_k"] = o.top_k;
  j["hidden"] = o.hidden;
  j["intermediate"] = o.intermediate;
  j["has_bias"] = o.has_bias != 0;
  j["activation"] = o.activation == KT_ACT_SWIGLU_OAI ? "swiglu_oai" : "silu";
  j["act_alpha"] = o.act_alpha;
  j["act_limit"] = o.act_limit;
  j["mode"] = o.mode == KT_MODE_LORA ? "lora" : o.mode == KT_MODE_FULL ? "full" : "inference";
  j["weight_format"] = weight_format_name(o.weight_format);
  if (o.mode == KT_MODE_LORA)
    j["lora"] = {{"rank", o.lora_rank}, {"alpha", o.lora_alpha}, {"use_rslora", o.use_rslora != 0},
                 {"targets", o.lora_targets}};
  j["dist_mode"] = d.owner_mode() ? "owner" : "expert_parallel";
  std::vector<int64_t> map(usize(o.num_experts));
  for (int64_t e = 0; e < o.num_experts; ++e) map[usize(e)] = d.owner_mode() ? d.options.owner_rank : d.expert_rank[usize(e)];
  j["expert_ranks"] = map;
  j["world_size"] = world;
  json p = json::array();
  json tensors = json::object();
  if (parts & KT_DIST_CKPT_WEIGHTS) {
    p.push_back("weights");
    for (int q = 0; q < 3; ++q) {
      tensors[std::string(kProjKey[q]) + ".weight"] = {{"dtype", dtype_word(rec.weight_dtype)},
                                                       {"shape", expert_shape(o, kWeightId[q])}};
      if (o.has_bias)
        tensors[std::string(kProjKey[q]) + ".bias"] = {{"dtype", "F32"}, {"shape", expert_shape(o, kBiasId[q])}};
    }
  }
  if (parts & KT_DIST_CKPT_ADAPTER) {
    p.push_back("adapter");
    for (int i = 0; i < 6; ++i)
      if (rec.lora_dtype[i])
        tensors[lora_suffix(i)] = {{"dtype", dtype_word(rec.lora_dtype[i])}, {"shape", expert_shape(o, kLoraId[i])}};
  }
  if ((parts & KT_DIST_CKPT_OPTIMIZER) && rec.has_opt) {
    p.push_back("optimizer");
    json opt = {{"algorithm", algorithm_word(rec.algorithm)}, {"amsgrad", rec.amsgrad}, {"nesterov", rec.nesterov},
                {"arithmetic", arithmetic_word(rec.arithmetic)}, {"step", rec.step}, {"momentum_started", rec.momentum_started}};
    for (int h = 0; h < 7; ++h) opt[kHyperNames[h]] = rec.hyper[h];
    j["optimizer"] = opt;
    for (int id : optimizer_params(o))
      for (const std::string& s : state_names(rec.algorithm, rec.amsgrad))
        tensors["optim." + param_name(id) + "." + s] = {{"dtype", "F32"}, {"shape", expert_shape(o, id)}};
  }
  j["parts"] = p;
  j["tensors"] = tensors;
  return j;
}

std::string hex64(uint64_t v) {
  char b[24];
  std::snprintf(b, sizeof(b), "%016llx", static_cast<unsigned long long>(v));
  return b;
}

uint64_t new_checkpoint_id() {
  std::random_device rd;
  const uint64_t t = static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  return fnv(fnv((uint64_t{rd()} << 32) | rd(), t), static_cast<uint64_t>(::getpid()));
}

// Progress over the bytes of this rank's part.
struct Progress {
  kt_ckpt_progress_fn fn = nullptr;
  void* user = nullptr;
  int64_t done = 0, total = 0;
  void add(int64_t bytes) {
    done += bytes;
    if (fn) fn(done, total, user);
  }
};

}  // namespace

void set_checkpoint_options_defaults(kt_dist_ckpt_options& o) { o.parts = 0; }

void save_checkpoint(kt_comm& comm, const char* dir, const kt_dist_ckpt_layer* layers, size_t n,
                     const kt_dist_ckpt_options* given, const char* where) {
  std::lock_guard<std::mutex> lock(comm.mutex);
  comm.check_usable(where);
  const int W = comm.world, me = comm.rank;
  std::vector<Local> locals;
  CallHead head{};
  kt_dist_ckpt_options options{};
  const Outcome checked = attempt([&] {
    options = read_sized(given, set_checkpoint_options_defaults, where, "options");
    locals = resolve(comm, dir, layers, n, options.parts, where);
    head = head_of(locals, options.parts, 0);
  });
  check_heads(agree(comm, where, checked, &head, sizeof(head)), W, where);

  // Each rank's plan, and the staging directory (rank 0).
  SavePlan plan;
  std::unique_ptr<io::StagedDir> staged;
  struct Staging {
    uint64_t checkpoint;
    char path[kPathBytes];
  } staging{};
  const Outcome planned = attempt([&] {
    for (const Local& l : locals) {
      plan.parts.push_back(save_parts(l.options(), options.parts, l.number, where));
      plan_layer(plan, l, plan.parts.back(), where);
    }
    if (me == 0) {
      staged = std::make_unique<io::StagedDir>(dir, io::owned_with_temporaries([](const std::string& name) {
        return name == kCheckpointManifest || is_rank_file(name);
      }));
      const std::string& path = staged->staging_path();
      KT_CHECK(path.size() < kPathBytes, KT_ERR_IO,
               std::string(where) + ": " + path + ": the path is too long");
      std::memcpy(staging.path, path.c_str(), path.size() + 1);
      staging.checkpoint = new_checkpoint_id();
    }
  });
  const size_t stride = n * sizeof(LayerRecord) + sizeof(Staging);
  std::vector<char> mine(stride);
  if (planned.ok()) {
    std::memcpy(mine.data(), plan.records.data(), n * sizeof(LayerRecord));
    std::memcpy(mine.data() + n * sizeof(LayerRecord), &staging, sizeof(Staging));
  }
  const std::vector<char> all = agree(comm, where, planned, mine.data(), stride);
  std::memcpy(&staging, all.data() + n * sizeof(LayerRecord), sizeof(Staging));  // rank 0's
  std::vector<LayerRecord> agreed(n);
  for (size_t i = 0; i < n; ++i) {
    agreed[i] = agreed_record(all, stride, W, i, locals[i].number, where);
    if (!agreed[i].has_opt) plan.parts[i] &= ~KT_DIST_CKPT_OPTIMIZER;
  }

  // Every rank writes its file into the staging directory.
  const Outcome written = attempt([&] {
    Progress progress{options.progress, options.progress_user};
    for (const io::TensorToWrite& t : plan.tensors) progress.total += static_cast<int64_t>(t.nbytes());
    for (io::TensorToWrite& t : plan.tensors) {
      const int64_t bytes = static_cast<int64_t>(t.nbytes());
      t.fill = [inner = std::move(t.fill), bytes, &progress](uint8_t* dst) {
        inner(dst);
        progress.add(bytes);
      };
    }
    const std::map<std::string, std::string> meta = {{"format", kFormat},
                                                     {"rank", str(me)},
                                                     {"world_size", str(W)},
                                                     {"checkpoint_id", hex64(staging.checkpoint)}};
    io::write_safetensors(std::string(staging.path) + "/" + rank_file(me, W), std::move(plan.tensors), meta,
                          io::AtomicFile::kCreate);
  });
  agree(comm, where, written, nullptr, 0);

  // Every file is complete: rank 0 adds the manifest and publishes.
  const Outcome published = attempt([&] {
    if (me != 0) return;
    json files = json::array();
    for (int r = 0; r < W; ++r) files.push_back(rank_file(r, W));
    json layers_json = json::array();
    for (size_t i = 0; i < n; ++i) layers_json.push_back(manifest_layer(locals[i], agreed[i], plan.parts[i], W));
    const json manifest = {{"format", kFormat},       {"format_version", kCheckpointFormatVersion},
                           {"checkpoint_id", hex64(staging.checkpoint)}, {"world_size", W},
                           {"files", files},          {"layers", layers_json}};
    io::write_text(staged->file(kCheckpointManifest), manifest.dump(2) + "\n", io::AtomicFile::kCreate);
    staged->publish();
  });
  agree(comm, where, published, nullptr, 0);
}

// ------------------------------------------------------------------- load

namespace {


// Reads the manifest and maps the files this rank's experts are in; the
// plans reference the mapped files. Runs inside one consistent read.
Opened open_checkpoint(const std::string& dir, std::vector<Local>& locals, unsigned parts,
                       std::vector<LayerLoad>& loads, const char* where) {
  return io::read_consistent(dir, [&](std::shared_ptr<const io::DirHandle> d) {
    Opened c;
    c.label = d->label(kCheckpointManifest);
    c.manifest = json::parse(io::read_text_file(*d, kCheckpointManifest), nullptr, false);
    if (c.manifest.is_discarded() || !c.manifest.is_object()) bad_manifest(c.label, "not a JSON object");
    if (text_field(c.manifest, "format", c.label) != kFormat) bad_manifest(c.label, "'format' is not " + std::string(kFormat));
    if (int_field(c.manifest, "format_version", c.label) != kCheckpointFormatVersion)
      bad_manifest(c.label, "another 'format_version'");
    const std::string id = text_field(c.manifest, "checkpoint_id", c.label);
    c.id = std::strtoull(id.c_str(), nullptr, 16);
    for (const json& f : field(c.manifest, "files", c.label)) {
      if (!f.is_string() || !is_rank_file(f.get<std::string>())) bad_manifest(c.label, "'files' names " + f.dump());
      c.files.push_back(f.get<std::string>());
    }
    // First pass: which files are needed (plan_load marks them); then map
    // them and plan again against their tensors.
    for (Local& l : locals) plan_load(c, l, parts, where);
    for (auto& kv : c.mapped)
      kv.second = std::make_unique<io::SafetensorsFile>(
          std::make_unique<io::MappedFile>(*d, c.files[usize(kv.first)], c.label));
    c.mapped_ready = true;
    loads.clear();
    for (Local& l : locals) loads.push_back(plan_load(c, l, parts, where));
    return c;
  });
}

// The bytes a layer's load copies (for the progress callback).
int64_t load_bytes(const LayerLoad& ld) {
  int64_t total = 0;
  for (const auto& w : ld.weights)
    for (const Copy& cp : w) total += cp.bytes;
  for (const auto& f : ld.lora)
    for (const Copy& cp : f) total += cp.bytes;
  for (const auto& p : ld.optim)
    for (const auto& s : p)
      for (const Copy& cp : s) total += cp.bytes;
  return total;
}

// Local expert li's weights (and biases): read straight into the host's
// bound tensors, or loaded through the layer as kt_moe_load_expert does.
void apply_expert_weights(const Local& l, const LayerLoad& ld, size_t li) {
  kt_moe& m = *l.moe;
  const bool bias = m.options().has_bias != 0;
  const std::array<Copy, 6>& w = ld.weights[li];
  if (ld.weights_into_bound) {
    for (int p = 0; p < (bias ? 6 : 3); ++p)
      io::read_expert_slice(w[usize(p)].src, w[usize(p)].dtype,
                            *m.bound_view(p < 3 ? kWeightId[p] : kBiasId[p - 3]), static_cast<int64_t>(li));
    return;
  }
  int64_t shapes[6][2];
  DLTensor t[6];
  kt_arg args[6];
  for (int p = 0; p < (bias ? 6 : 3); ++p) {
    const std::vector<int64_t>& s = w[usize(p)].entry->shape;
    for (size_t d = 0; d < s.size(); ++d) shapes[p][d] = s[d];
    t[p] = DLTensor{};
    t[p].data = const_cast<uint8_t*>(w[usize(p)].src);
    t[p].device = {kDLCPU, 0};
    t[p].ndim = static_cast<int32_t>(s.size());
    t[p].dtype = io::dl_dtype(w[usize(p)].dtype);
    t[p].shape = shapes[p];
    args[p] = kt_arg{p < 3 ? kWeightId[p] : kBiasId[p - 3], &t[p]};
  }
  layer_call("kt_moe_load_expert", l.dist->local, [&](kt_moe& layer) {
    layer.load(defaults_of<kt_load_options>(set_load_options_defaults), args, bias ? 6 : 3,
               static_cast<int64_t>(li), "kt_moe_load_expert");
  });
}

// The optimizer's state of the local experts, its options and step.
void apply_optimizer_state(const Local& l, const LayerLoad& ld, Progress& progress) {
  kt_optimizer& op = *l.opt;
  auto held = op.lock_compute();
  for (size_t pi = 0; pi < op.params.size(); ++pi) {
    kt_optimizer::Param& p = op.params[pi];
    const int64_t per = p.numel / static_cast<int64_t>(l.experts->size());
    const auto states = state_of(p, op.opt.algorithm, op.opt.amsgrad);
    for (size_t si = 0; si < states.size(); ++si)
      for (size_t li = 0; li < ld.optim[pi][si].size(); ++li) {
        const Copy& cp = ld.optim[pi][si][li];
        std::memcpy(states[si].second + static_cast<int64_t>(li) * per, cp.src, usize(per) * sizeof(float));
        progress.add(cp.bytes);
      }
    if (p.bf16_copy)
      for (int64_t i = 0; i < p.numel; ++i) p.bf16_copy[i] = f32_to_bf16(p.master[i]);
  }
  op.opt = ld.opt_options;
  op.step = ld.step;
  op.momentum_started = ld.momentum_started != 0;
}

// One layer's planned copies (checked before: nothing here fails on the
// checkpoint's account), then the layer told its parameters changed.
void apply_load(const LayerLoad& ld, Progress& progress) {
  const Local& l = *ld.local;
  if (!l.holds()) return;
  kt_moe& m = *l.moe;
  bool changed = false;
  for (size_t li = 0; li < ld.weights.size(); ++li) {
    apply_expert_weights(l, ld, li);
    changed = changed || ld.weights_into_bound;
    int64_t bytes = 0;
    for (const Copy& cp : ld.weights[li]) bytes += cp.bytes;
    progress.add(bytes);
  }
  for (size_t li = 0; li < ld.lora.size(); ++li) {
    int64_t bytes = 0;
    for (int i = 0; i < 6; ++i) {
      const Copy& cp = ld.lora[li][usize(i)];
      if (!cp.src) continue;
      io::read_expert_slice(cp.src, cp.dtype, *m.bound_view(kLoraId[i]), static_cast<int64_t>(li));
      bytes += cp.bytes;
    }
    changed = true;
    progress.add(bytes);
  }
  if (!ld.optim.empty()) {
    apply_optimizer_state(l, ld, progress);
    changed = true;
  }
  if (changed) layer_call("kt_moe_params_changed", l.dist->local, [](kt_moe& layer) { layer.params_changed(); });
}

}  // namespace

void load_checkpoint(kt_comm& comm, const char* dir, const kt_dist_ckpt_layer* layers, size_t n,
                     const kt_dist_ckpt_options* given, const char* where) {
  std::lock_guard<std::mutex> lock(comm.mutex);
  comm.check_usable(where);
  std::vector<Local> locals;
  std::vector<LayerLoad> loads;
  Opened c;
  CallHead head{};
  kt_dist_ckpt_options options{};
  const Outcome checked = attempt([&] {
    options = read_sized(given, set_checkpoint_options_defaults, where, "options");
    locals = resolve(comm, dir, layers, n, options.parts, where);
    c = open_checkpoint(dir, locals, options.parts, loads, where);
    head = head_of(locals, options.parts, c.id);
  });
  check_heads(agree(comm, where, checked, &head, sizeof(head)), comm.world, where);

  // Checked on every rank: the copies below change the layers.
  const Outcome applied = attempt([&] {
    Progress progress{options.progress, options.progress_user};
    for (const LayerLoad& ld : loads) progress.total += load_bytes(ld);
    for (LayerLoad& ld : loads) apply_load(ld, progress);
  });
  agree(comm, where, applied, nullptr, 0);
}

}  // namespace kt::dist
