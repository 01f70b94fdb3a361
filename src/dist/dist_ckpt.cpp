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

namespace {

using nlohmann::json;

constexpr const char* kFormat = "kt_dist_checkpoint";
const char* const kProjKey[3] = {"gate_proj", "up_proj", "down_proj"};
const int kWeightId[3] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
const int kBiasId[3] = {KT_ARG_B_GATE, KT_ARG_B_UP, KT_ARG_B_DOWN};
const int kLoraId[6] = {KT_ARG_LORA_A_GATE, KT_ARG_LORA_B_GATE, KT_ARG_LORA_A_UP,
                        KT_ARG_LORA_B_UP,   KT_ARG_LORA_A_DOWN, KT_ARG_LORA_B_DOWN};
constexpr unsigned kAllParts = KT_DIST_CKPT_WEIGHTS | KT_DIST_CKPT_ADAPTER | KT_DIST_CKPT_OPTIMIZER;
constexpr size_t kPathBytes = 4096;

size_t usize(int64_t v) { return static_cast<size_t>(v); }

// A call on a local layer under the engine's compute lock, its failure
// reported as the ABI call `where` reports it.
template <class F>
void layer_call(const char* where, kt_moe* handle, F&& fn) {
  as_call(where, [&] {
    const std::shared_ptr<kt_moe> m = live(handle, HandleKind::kMoe, where, "moe");
    std::lock_guard<std::mutex> lock(m->engine()->compute_mutex);
    fn(*m);
  });
}
std::string str(int64_t v) { return std::to_string(v); }

std::string expert_key(int64_t layer, int64_t expert) {
  return "layers." + str(layer) + ".experts." + str(expert) + ".";
}
// "gate_proj.lora_A" for LoRA tensor i (A/B of gate, up, down).
std::string lora_suffix(int i) { return std::string(kProjKey[i / 2]) + (i % 2 ? ".lora_B" : ".lora_A"); }
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

// Per-expert shape of a layer argument ([E, ...] without E).
std::vector<int64_t> expert_shape(const kt_moe_options& o, int id) {
  const int64_t H = o.hidden, I = o.intermediate, r = o.lora_rank;
  switch (id) {
    case KT_ARG_W_GATE: case KT_ARG_W_UP: return {I, H};
    case KT_ARG_W_DOWN: return {H, I};
    case KT_ARG_B_GATE: case KT_ARG_B_UP: return {I};
    case KT_ARG_B_DOWN: return {H};
    case KT_ARG_LORA_A_GATE: case KT_ARG_LORA_A_UP: return {r, H};
    case KT_ARG_LORA_A_DOWN: return {r, I};
    case KT_ARG_LORA_B_GATE: case KT_ARG_LORA_B_UP: return {I, r};
    default: return {H, r};  // KT_ARG_LORA_B_DOWN
  }
}

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? "," : "") + str(s[i]);
  return t + "]";
}

uint64_t fnv(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) h = (h ^ ((v >> (8 * i)) & 0xff)) * 1099511628211ull;
  return h;
}

// One entry of `layers`, resolved on this rank.
struct Local {
  int64_t number = 0;
  std::shared_ptr<kt_dist_moe> dist;
  std::shared_ptr<kt_moe> moe;        // the local layer, or null
  std::shared_ptr<kt_optimizer> opt;  // or null
  const std::vector<int64_t>* experts = nullptr;  // global ids in local order
  bool holds() const { return moe != nullptr && !experts->empty(); }
  const kt_moe_options& options() const { return dist->layer_options; }
};

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

// The parts of layer l a save writes (the same on every rank: layer
// options agree; the optimizer part is settled after the records).
unsigned save_parts(const kt_moe_options& o, unsigned requested, int64_t number, const char* where) {
  const std::string lname = std::string(where) + ": layer " + str(number);
  const bool bf16 = o.weight_format == KT_FORMAT_BF16, lora = o.mode == KT_MODE_LORA;
  if (requested == 0) return (bf16 ? KT_DIST_CKPT_WEIGHTS : 0u) | (lora ? KT_DIST_CKPT_ADAPTER : 0u) | KT_DIST_CKPT_OPTIMIZER;
  KT_CHECK(!(requested & KT_DIST_CKPT_WEIGHTS) || bf16, KT_ERR_UNSUPPORTED,
           lname + " stores its base as " + weight_format_name(o.weight_format) +
               ": a quantized base is frozen and is not saved (reload it from its source "
               "checkpoint); leave "
               "KT_DIST_CKPT_WEIGHTS out of options->parts");
  KT_CHECK(
      !(requested & KT_DIST_CKPT_ADAPTER) || lora, KT_ERR_MODE,
      lname + ": options->parts names KT_DIST_CKPT_ADAPTER but the layer is not in KT_MODE_LORA");
  return requested;
}

// The weights a rank saves: the bound trainable tensors (full mode), or the
// layer's own (a bf16 layer's, read exactly).
bool weights_bound(const kt_moe& m) {
  return m.options().mode == KT_MODE_FULL && m.bound_view(KT_ARG_W_GATE) && m.bound_view(KT_ARG_W_UP) &&
         m.bound_view(KT_ARG_W_DOWN) &&
         (!m.options().has_bias ||
          (m.bound_view(KT_ARG_B_GATE) && m.bound_view(KT_ARG_B_UP) && m.bound_view(KT_ARG_B_DOWN)));
}

// A rank's record of one layer, exchanged before the files are written.
struct LayerRecord {
  int32_t holds;
  int32_t has_opt;
  int32_t weight_dtype;   // kt_ckpt_dtype of the saved weights, 0: none
  int32_t lora_dtype[6];  // 0: not saved
  int32_t algorithm, amsgrad, nesterov, momentum_started;
  int32_t arithmetic;  // kt_optim_arithmetic
  int64_t step;
  double hyper[7];  // lr, weight_decay, beta1, beta2, eps, momentum, dampening
};

const char* const kHyperNames[7] = {"lr", "weight_decay", "beta1", "beta2", "eps", "momentum", "dampening"};

const char* algorithm_word(int a) { return a == KT_OPTIM_SGD ? "sgd" : "adamw"; }
const char* arithmetic_word(int a) { return a == KT_OPTIM_TORCH2 ? "torch2" : "torch1"; }

// The optimizer's state tensors of one parameter, as (file suffix, data).
std::vector<std::pair<std::string, float*>> state_of(kt_optimizer::Param& p, int algorithm, int amsgrad) {
  std::vector<std::pair<std::string, float*>> s = {{"master", p.master}};
  if (algorithm == KT_OPTIM_ADAMW) {
    s.emplace_back("exp_avg", p.m.data());
    s.emplace_back("exp_avg_sq", p.v.data());
    if (amsgrad) s.emplace_back("max_exp_avg_sq", p.vmax.data());
  } else {
    s.emplace_back("momentum_buffer", p.m.data());
  }
  return s;
}

std::vector<std::string> state_names(int algorithm, int amsgrad) {
  if (algorithm == KT_OPTIM_SGD) return {"master", "momentum_buffer"};
  std::vector<std::string> s = {"master", "exp_avg", "exp_avg_sq"};
  if (amsgrad) s.push_back("max_exp_avg_sq");
  return s;
}

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

// This rank's part of a save: its record of each layer and the tensors of
// its file.
struct SavePlan {
  std::vector<LayerRecord> records;
  std::vector<io::TensorToWrite> tensors;
  std::vector<std::shared_ptr<std::vector<char>>> buffers;  // weights read from the layers
  std::vector<unsigned> parts;                              // per layer
};

void add_slices(SavePlan& plan, const Local& l, const View& v, kt_ckpt_dtype dt, const std::string& suffix) {
  const std::vector<int64_t>& ex = *l.experts;
  for (size_t li = 0; li < ex.size(); ++li) {
    std::vector<int64_t> shape(v.shape + 1, v.shape + v.ndim);
    const int64_t e = static_cast<int64_t>(li);
    plan.tensors.push_back(io::TensorToWrite{expert_key(l.number, ex[li]) + suffix, dt, shape,
                                             [v, e, dt](uint8_t* dst) { io::write_expert_slice(v, e, dt, dst); }});
  }
}

// A compact tensor over a buffer of the plan (for kt_moe_read_weights).
View plan_buffer(SavePlan& plan, DType dtype, std::vector<int64_t> shape) {
  View v;
  v.dtype = dtype;
  v.ndim = static_cast<int>(shape.size());
  int64_t n = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    v.shape[d] = shape[usize(d)];
    v.strides[d] = n;
    n *= shape[usize(d)];
  }
  auto buf = std::make_shared<std::vector<char>>(usize(std::max<int64_t>(n, 1)) * dtype_size(dtype));
  plan.buffers.push_back(buf);
  v.data = buf->data();
  return v;
}

DLTensor dl_of(const View& v) {
  DLTensor t{};
  t.data = v.data;
  t.device = {kDLCPU, 0};
  t.ndim = v.ndim;
  t.dtype = io::dl_dtype(io::from_dtype(v.dtype));
  t.shape = const_cast<int64_t*>(v.shape);
  t.strides = const_cast<int64_t*>(v.strides);
  return t;
}

void plan_layer(SavePlan& plan, const Local& l, unsigned parts, const char* where) {
  LayerRecord rec{};
  rec.holds = l.holds();
  if (!l.holds()) {
    plan.records.push_back(rec);
    return;
  }
  const std::string lname = std::string(where) + ": layer " + str(l.number);
  kt_moe& m = *l.moe;
  const kt_moe_options& o = m.options();
  const int64_t n = static_cast<int64_t>(l.experts->size());
  if (parts & KT_DIST_CKPT_WEIGHTS) {
    if (weights_bound(m)) {
      for (int p = 0; p < 3; ++p) {
        const View& v = *m.bound_view(kWeightId[p]);
        rec.weight_dtype = io::from_dtype(v.dtype);
        add_slices(plan, l, v, io::from_dtype(v.dtype), std::string(kProjKey[p]) + ".weight");
        if (o.has_bias) add_slices(plan, l, *m.bound_view(kBiasId[p]), KT_CKPT_DTYPE_F32, std::string(kProjKey[p]) + ".bias");
      }
    } else {
      std::vector<kt_arg> args;
      View views[6];
      DLTensor dls[6];
      for (int p = 0; p < 3; ++p) {
        std::vector<int64_t> shape = expert_shape(o, kWeightId[p]);
        shape.insert(shape.begin(), n);
        views[p] = plan_buffer(plan, DType::kBF16, shape);
        if (o.has_bias) {
          std::vector<int64_t> bshape = expert_shape(o, kBiasId[p]);
          bshape.insert(bshape.begin(), n);
          views[3 + p] = plan_buffer(plan, DType::kF32, bshape);
        }
      }
      for (int i = 0; i < (o.has_bias ? 6 : 3); ++i) {
        dls[i] = dl_of(views[i]);
        args.push_back(kt_arg{i < 3 ? kWeightId[i] : kBiasId[i - 3], &dls[i]});
      }
      layer_call("kt_moe_read_weights", l.dist->local,
                 [&](const kt_moe& m) { m.read_weights(args.data(), args.size()); });
      rec.weight_dtype = KT_CKPT_DTYPE_BF16;
      for (int p = 0; p < 3; ++p) {
        add_slices(plan, l, views[p], KT_CKPT_DTYPE_BF16, std::string(kProjKey[p]) + ".weight");
        if (o.has_bias) add_slices(plan, l, views[3 + p], KT_CKPT_DTYPE_F32, std::string(kProjKey[p]) + ".bias");
      }
    }
  }
  if (parts & KT_DIST_CKPT_ADAPTER) {
    for (int i = 0; i < 6; ++i) {
      if (!((o.lora_targets >> (i / 2)) & 1u)) continue;
      const View* v = m.bound_view(kLoraId[i]);
      KT_CHECK(v != nullptr, KT_ERR_NOT_BOUND,
               lname + ": " + arg_name(kLoraId[i]) + " is not bound on rank " +
                   str(l.dist->comm->rank) + " (the adapter saves the bound LoRA factors)");
      rec.lora_dtype[i] = io::from_dtype(v->dtype);
      add_slices(plan, l, *v, io::from_dtype(v->dtype), lora_suffix(i));
    }
  }
  if ((parts & KT_DIST_CKPT_OPTIMIZER) && l.opt) {
    kt_optimizer& op = *l.opt;
    auto lock = op.lock_compute();
    op.check_layer(where);
    rec.has_opt = 1;
    rec.algorithm = op.opt.algorithm;
    rec.amsgrad = op.opt.amsgrad;
    rec.nesterov = op.opt.nesterov;
    rec.arithmetic = op.opt.arithmetic;
    rec.momentum_started = op.momentum_started;
    rec.step = op.step;
    const double hyper[7] = {op.opt.lr, op.opt.weight_decay, op.opt.beta1, op.opt.beta2,
                             op.opt.eps, op.opt.momentum, op.opt.dampening};
    std::copy(hyper, hyper + 7, rec.hyper);
    const std::shared_ptr<kt_optimizer> keep = l.opt;
    for (size_t pi = 0; pi < op.params.size(); ++pi) {
      kt_optimizer::Param& p = op.params[pi];
      const int64_t per = p.numel / n;
      std::vector<int64_t> shape(p.shape.begin() + 1, p.shape.end());
      const auto states = state_of(p, op.opt.algorithm, op.opt.amsgrad);
      for (size_t si = 0; si < states.size(); ++si)
        for (int64_t li = 0; li < n; ++li) {
          const float* src = states[si].second + li * per;
          plan.tensors.push_back(io::TensorToWrite{
              expert_key(l.number, (*l.experts)[usize(li)]) + "optim." + p.name + "." + states[si].first,
              KT_CKPT_DTYPE_F32, shape, [keep, src, per](uint8_t* dst) {
                auto held = keep->lock_compute();
                std::memcpy(dst, src, usize(per) * sizeof(float));
              }});
        }
    }
  }
  plan.records.push_back(rec);
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

[[noreturn]] void bad_manifest(const std::string& label, const std::string& what) {
  fail(KT_ERR_IO, label + ": " + what + " (not a kt distributed checkpoint manifest of format version " +
                      str(kCheckpointFormatVersion) + ")");
}

const json& field(const json& j, const char* key, const std::string& label) {
  if (!j.is_object() || !j.contains(key)) bad_manifest(label, std::string("no '") + key + "'");
  return j[key];
}

int64_t int_field(const json& j, const char* key, const std::string& label) {
  const json& v = field(j, key, label);
  if (!v.is_number_integer()) bad_manifest(label, std::string("'") + key + "' is not an integer");
  return v.get<int64_t>();
}

double number_field(const json& j, const char* key, const std::string& label) {
  const json& v = field(j, key, label);
  if (!v.is_number()) bad_manifest(label, std::string("'") + key + "' is not a number");
  return v.get<double>();
}

std::string text_field(const json& j, const char* key, const std::string& label) {
  const json& v = field(j, key, label);
  if (!v.is_string()) bad_manifest(label, std::string("'") + key + "' is not a string");
  return v.get<std::string>();
}

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

const io::TensorEntry* find_entry(const io::SafetensorsFile& f, const std::string& name) {
  const auto& ts = f.header().tensors;
  auto it = std::lower_bound(ts.begin(), ts.end(), name,
                             [](const io::TensorEntry& e, const std::string& n) { return e.name < n; });
  return it != ts.end() && it->name == name ? &*it : nullptr;
}

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

kt_activation activation_of(const std::string& s, const std::string& label) {
  if (s == "silu") return KT_ACT_SILU;
  if (s == "swiglu_oai") return KT_ACT_SWIGLU_OAI;
  bad_manifest(label, "activation '" + s + "' is not one kt knows");
}

// Checks a stored tensor against what the destination takes.
Copy stored(Opened& c, int rank, const std::string& key, const std::vector<int64_t>& shape, bool float_only_f32,
            const std::string& lname) {
  const io::SafetensorsFile& f = *c.mapped.at(rank);
  const io::TensorEntry* e = find_entry(f, key);
  KT_CHECK(e != nullptr, KT_ERR_IO, lname + ": " + f.path() + " has no tensor '" + key + "'");
  const bool ok_dtype = float_only_f32 ? e->dtype == KT_CKPT_DTYPE_F32
                                       : (e->dtype == KT_CKPT_DTYPE_F32 || e->dtype == KT_CKPT_DTYPE_BF16 ||
                                          e->dtype == KT_CKPT_DTYPE_F16);
  KT_CHECK(ok_dtype, KT_ERR_IO,
           lname + ": " + f.path() + ": tensor '" + key + "' is " + io::dtype_name(e->dtype) +
               (float_only_f32 ? ", expected F32" : ", expected F32, BF16 or F16"));
  KT_CHECK(e->shape == shape, KT_ERR_SHAPE,
           lname + ": " + f.path() + ": tensor '" + key + "' has shape " + shape_text(e->shape) +
               ", this layer takes " + shape_text(shape));
  Copy cp;
  cp.src = f.tensor_data(*e);
  cp.dtype = e->dtype;
  cp.bytes = static_cast<int64_t>(e->nbytes());
  cp.entry = e;
  return cp;
}

void compare(bool same, kt_status status, const std::string& lname, const std::string& what, const std::string& saved,
             const std::string& here) {
  KT_CHECK(same, status,
           lname + ": saved with " + what + " = " + saved + ", this layer has " + here);
}

// The manifest's layer j against this layer's options: shape, bias and
// activation.
void check_saved_layer(const Opened& c, const json& j, const kt_moe_options& o, const std::string& lname) {
  const int64_t E = int_field(j, "num_experts", c.label), H = int_field(j, "hidden", c.label),
                I = int_field(j, "intermediate", c.label);
  compare(E == o.num_experts, KT_ERR_SHAPE, lname, "num_experts (E)", str(E), str(o.num_experts));
  compare(H == o.hidden, KT_ERR_SHAPE, lname, "hidden (H)", str(H), str(o.hidden));
  compare(I == o.intermediate, KT_ERR_SHAPE, lname, "intermediate (I)", str(I), str(o.intermediate));
  const json& bias = field(j, "has_bias", c.label);
  if (!bias.is_boolean()) bad_manifest(c.label, "'has_bias' is not a boolean");
  compare(bias.get<bool>() == (o.has_bias != 0), KT_ERR_INVALID_ARGUMENT, lname, "has_bias",
          bias.get<bool>() ? "1" : "0", str(o.has_bias));
  const std::string act = text_field(j, "activation", c.label);
  const kt_activation a = activation_of(act, c.label);
  compare(a == o.activation, KT_ERR_INVALID_ARGUMENT, lname, "activation", act,
          o.activation == KT_ACT_SWIGLU_OAI ? "swiglu_oai" : "silu");
  const float limit = static_cast<float>(number_field(j, "act_limit", c.label));
  compare(limit == o.act_limit, KT_ERR_INVALID_ARGUMENT, lname, "act_limit", std::to_string(limit),
          std::to_string(o.act_limit));
}

// The rank whose file holds each of the layer's E experts.
std::vector<int> saved_expert_ranks(const Opened& c, const json& j, int64_t layer, int64_t E) {
  const json& map = field(j, "expert_ranks", c.label);
  if (!map.is_array() || static_cast<int64_t>(map.size()) != E)
    bad_manifest(c.label, "layer " + str(layer) + ": 'expert_ranks' is not a list of " + str(E) + " ranks");
  std::vector<int> saved_rank(usize(E));
  for (int64_t e = 0; e < E; ++e) {
    if (!map[usize(e)].is_number_integer()) bad_manifest(c.label, "'expert_ranks' holds a non-integer");
    const int64_t r = map[usize(e)].get<int64_t>();
    if (r < 0 || r >= static_cast<int64_t>(c.files.size()))
      bad_manifest(c.label, "layer " + str(layer) + ": expert " + str(e) + " is on rank " + str(r) + ", outside the " +
                                str(c.files.size()) + " files");
    saved_rank[usize(e)] = static_cast<int>(r);
  }
  return saved_rank;
}

// The saved adapter's configuration against this layer's LoRA: the
// adapter's and the optimizer's tensors are the LoRA factors' shapes.
void check_saved_lora(const Opened& c, const json& j, const kt_moe_options& o, const std::string& lname) {
  const json& lj = field(j, "lora", c.label);
  const int64_t r = int_field(lj, "rank", c.label), targets = int_field(lj, "targets", c.label);
  compare(r == o.lora_rank, KT_ERR_SHAPE, lname, "lora_rank", str(r), str(o.lora_rank));
  compare(targets == static_cast<int64_t>(o.lora_targets), KT_ERR_INVALID_ARGUMENT, lname, "lora_targets",
          str(targets), str(o.lora_targets));
  const float alpha = static_cast<float>(number_field(lj, "alpha", c.label));
  compare(alpha == o.lora_alpha, KT_ERR_INVALID_ARGUMENT, lname, "lora_alpha", std::to_string(alpha),
          std::to_string(o.lora_alpha));
  const json& rs = field(lj, "use_rslora", c.label);
  compare(rs.is_boolean() && rs.get<bool>() == (o.use_rslora != 0), KT_ERR_INVALID_ARGUMENT, lname, "use_rslora",
          rs.dump(), str(o.use_rslora));
}

// The optimizer part of layer j's load: the saved algorithm and amsgrad
// against this rank's optimizer, the saved options and step, and a copy per
// parameter, state and local expert.
void plan_optimizer_state(Opened& c, const json& j, const Local& l, const std::vector<int>& saved_rank,
                          const std::string& lname, const char* where, LayerLoad* load_out) {
  LayerLoad& load = *load_out;
  const std::vector<int64_t>& ex = *l.experts;
  const auto key = [&](int64_t g) { return expert_key(l.number, g); };
  const json& oj = field(j, "optimizer", c.label);
  const std::string alg = text_field(oj, "algorithm", c.label);
  kt_optimizer& op = *l.opt;
  KT_CHECK(alg == algorithm_word(op.opt.algorithm), KT_ERR_INVALID_ARGUMENT,
           lname + ": the optimizer state was saved by a '" + alg + "' optimizer, this one is '" +
               algorithm_word(op.opt.algorithm) + "'");
  const int64_t amsgrad = int_field(oj, "amsgrad", c.label);
  compare(amsgrad == op.opt.amsgrad, KT_ERR_INVALID_ARGUMENT, lname, "the optimizer's amsgrad", str(amsgrad),
          str(op.opt.amsgrad));
  load.opt_options = op.opt;
  double* hyper[7] = {&load.opt_options.lr,  &load.opt_options.weight_decay, &load.opt_options.beta1,
                      &load.opt_options.beta2, &load.opt_options.eps, &load.opt_options.momentum,
                      &load.opt_options.dampening};
  for (int h = 0; h < 7; ++h) *hyper[h] = number_field(oj, kHyperNames[h], c.label);
  load.opt_options.nesterov = static_cast<int>(int_field(oj, "nesterov", c.label));
  // Manifests written before the field existed were torch 1 arithmetic.
  const std::string arith = oj.contains("arithmetic") ? text_field(oj, "arithmetic", c.label) : "torch1";
  if (arith != "torch1" && arith != "torch2")
    bad_manifest(c.label, "the optimizer's arithmetic '" + arith + "' is not torch1 or torch2");
  load.opt_options.arithmetic = arith == "torch2" ? KT_OPTIM_TORCH2 : KT_OPTIM_TORCH1;
  optim::validate_options(load.opt_options, where);
  load.step = int_field(oj, "step", c.label);
  if (load.step < 0) bad_manifest(c.label, "the optimizer's step is negative");
  load.momentum_started = int_field(oj, "momentum_started", c.label) != 0;
  const std::vector<std::string> states = state_names(op.opt.algorithm, op.opt.amsgrad);
  for (kt_optimizer::Param& p : op.params) {
    std::vector<int64_t> shape(p.shape.begin() + 1, p.shape.end());
    std::vector<std::vector<Copy>> per_state;
    for (const std::string& s : states) {
      std::vector<Copy> per_expert;
      for (int64_t g : ex)
        per_expert.push_back(stored(c, saved_rank[usize(g)], key(g) + "optim." + p.name + "." + s, shape, true, lname));
      per_state.push_back(std::move(per_expert));
    }
    load.optim.push_back(std::move(per_state));
  }
}

LayerLoad plan_load(Opened& c, const Local& l, unsigned requested, const char* where) {
  const std::string lname = std::string(where) + ": " + c.label + ": layer " + str(l.number);
  const json* found = nullptr;
  for (const json& j : field(c.manifest, "layers", c.label))
    if (int_field(j, "layer", c.label) == l.number) found = &j;
  KT_CHECK(found != nullptr, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + c.label + " holds no layer " + str(l.number));
  const json& j = *found;
  const kt_moe_options& o = l.options();
  check_saved_layer(c, j, o, lname);
  const int64_t E = o.num_experts;
  const std::vector<int> saved_rank = saved_expert_ranks(c, j, l.number, E);
  unsigned have = 0;
  for (const json& p : field(j, "parts", c.label)) {
    if (p == "weights") have |= KT_DIST_CKPT_WEIGHTS;
    if (p == "adapter") have |= KT_DIST_CKPT_ADAPTER;
    if (p == "optimizer") have |= KT_DIST_CKPT_OPTIMIZER;
  }
  const bool lora = o.mode == KT_MODE_LORA;
  const char* kPartWord[3] = {"weights", "adapter", "optimizer state"};
  for (int b = 0; b < 3; ++b)
    KT_CHECK(!(requested & (1u << b)) || (have & (1u << b)), KT_ERR_INVALID_ARGUMENT,
             lname + ": options->parts asks for the " + kPartWord[b] +
                 ", which the checkpoint does not hold");
  KT_CHECK(
      !(requested & KT_DIST_CKPT_ADAPTER) || lora, KT_ERR_MODE,
      lname + ": options->parts names KT_DIST_CKPT_ADAPTER but the layer is not in KT_MODE_LORA");
  LayerLoad load;
  load.local = &l;
  if (requested) {
    load.parts = requested;
  } else {
    load.parts = have & (KT_DIST_CKPT_WEIGHTS | (lora ? KT_DIST_CKPT_ADAPTER : 0u));
    if (l.opt) load.parts |= have & KT_DIST_CKPT_OPTIMIZER;
  }
  if (load.parts & (KT_DIST_CKPT_ADAPTER | KT_DIST_CKPT_OPTIMIZER)) {
    // The adapter's and the optimizer's tensors are the LoRA factors' shapes.
    if (lora && (have & KT_DIST_CKPT_ADAPTER)) check_saved_lora(c, j, o, lname);
  }
  if (!l.holds()) return load;

  kt_moe& m = *l.moe;
  const std::vector<int64_t>& ex = *l.experts;
  for (int64_t g : ex) {
    const int r = saved_rank[usize(g)];
    if (!c.mapped.count(r)) c.mapped[r] = nullptr;
  }
  // The files are opened by the caller (inside the consistent read), which
  // then plans again.
  if (!c.mapped_ready) return load;
  const auto key = [&](int64_t g) { return expert_key(l.number, g); };
  if (load.parts & KT_DIST_CKPT_WEIGHTS) {
    load.weights_into_bound = weights_bound(m);
    KT_CHECK(m.options().mode != KT_MODE_FULL || load.weights_into_bound || !m.bound_view(KT_ARG_W_GATE),
             KT_ERR_NOT_BOUND,
             lname + ": the layer binds some of its trainable weights and biases but not all");
    for (int64_t g : ex) {
      std::array<Copy, 6> w{};
      for (int p = 0; p < 3; ++p) {
        w[usize(p)] = stored(c, saved_rank[usize(g)], key(g) + kProjKey[p] + ".weight", expert_shape(o, kWeightId[p]),
                             false, lname);
        if (o.has_bias)
          w[usize(3 + p)] = stored(c, saved_rank[usize(g)], key(g) + kProjKey[p] + ".bias",
                                   expert_shape(o, kBiasId[p]), false, lname);
      }
      load.weights.push_back(w);
    }
  }
  if (load.parts & KT_DIST_CKPT_ADAPTER) {
    for (int i = 0; i < 6; ++i)
      if ((o.lora_targets >> (i / 2)) & 1u)
        KT_CHECK(m.bound_view(kLoraId[i]) != nullptr, KT_ERR_NOT_BOUND,
                 lname + ": " + arg_name(kLoraId[i]) +
                     " is not bound (the adapter is loaded into the bound tensors)");
    for (int64_t g : ex) {
      std::array<Copy, 6> f{};
      for (int i = 0; i < 6; ++i)
        if ((o.lora_targets >> (i / 2)) & 1u)
          f[usize(i)] = stored(c, saved_rank[usize(g)], key(g) + lora_suffix(i), expert_shape(o, kLoraId[i]), false, lname);
      load.lora.push_back(f);
    }
  }
  if ((load.parts & KT_DIST_CKPT_OPTIMIZER)) {
    KT_CHECK(
        l.opt != nullptr, KT_ERR_NULL_POINTER,
        lname + ": options->parts names KT_DIST_CKPT_OPTIMIZER but this rank's optimizer is NULL");
    plan_optimizer_state(c, j, l, saved_rank, lname, where, &load);
  }
  return load;
}

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
