#include "dist/dist_ckpt_plan.h"

#include <algorithm>
#include <cstring>

#include "core/ckpt_names.h"
#include "core/tensor.h"
#include "dist/comm.h"
#include "dist/dist_ckpt.h"
#include "formats/formats.h"
#include "io/elements.h"
#include "io/exporters.h"

namespace kt::dist::ckpt {

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? "," : "") + str(s[i]);
  return t + "]";
}

// The weights a rank saves: the bound trainable tensors (full mode), or the
// layer's own (a bf16 layer's, read exactly).
bool weights_bound(const kt_moe& m) {
  return m.options().mode == KT_MODE_FULL && m.bound_view(KT_ARG_W_GATE) && m.bound_view(KT_ARG_W_UP) &&
         m.bound_view(KT_ARG_W_DOWN) &&
         (!m.options().has_bias ||
          (m.bound_view(KT_ARG_B_GATE) && m.bound_view(KT_ARG_B_UP) && m.bound_view(KT_ARG_B_DOWN)));
}

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

// The layer's own weights (and biases) of the local experts, read as bf16
// (f32 biases) into buffers of the plan (kt_moe_read_weights).
std::array<View, 6> read_layer_weights(SavePlan& plan, const Local& l) {
  const kt_moe_options& o = l.moe->options();
  const int64_t n = static_cast<int64_t>(l.experts->size());
  std::array<View, 6> views{};
  std::vector<kt_arg> args;
  DLTensor dls[6];
  for (int p = 0; p < 3; ++p) {
    std::vector<int64_t> shape = expert_shape(o, kWeightId[p]);
    shape.insert(shape.begin(), n);
    views[usize(p)] = plan_buffer(plan, DType::kBF16, shape);
    if (o.has_bias) {
      std::vector<int64_t> bshape = expert_shape(o, kBiasId[p]);
      bshape.insert(bshape.begin(), n);
      views[usize(3 + p)] = plan_buffer(plan, DType::kF32, bshape);
    }
  }
  for (int i = 0; i < (o.has_bias ? 6 : 3); ++i) {
    dls[i] = dl_of(views[usize(i)]);
    args.push_back(kt_arg{i < 3 ? kWeightId[i] : kBiasId[i - 3], &dls[i]});
  }
  layer_call("kt_moe_read_weights", l.dist->local,
             [&](const kt_moe& m) { m.read_weights(args.data(), args.size()); });
  return views;
}

// The weights part: the bound trainable tensors in their dtype (full mode),
// or the layer's own, read as bf16; biases as f32.
void plan_weights(SavePlan& plan, const Local& l, LayerRecord& rec) {
  const kt_moe& m = *l.moe;
  const bool bias = m.options().has_bias != 0;
  std::array<View, 6> views{};
  if (weights_bound(m)) {
    for (int p = 0; p < 3; ++p) {
      views[usize(p)] = *m.bound_view(kWeightId[p]);
      if (bias) views[usize(3 + p)] = *m.bound_view(kBiasId[p]);
    }
  } else {
    views = read_layer_weights(plan, l);
  }
  for (int p = 0; p < 3; ++p) {
    const View& v = views[usize(p)];
    rec.weight_dtype = io::from_dtype(v.dtype);
    add_slices(plan, l, v, io::from_dtype(v.dtype), std::string(kProjKey[p]) + ".weight");
    if (bias) add_slices(plan, l, views[usize(3 + p)], KT_CKPT_DTYPE_F32, std::string(kProjKey[p]) + ".bias");
  }
}

// The adapter part: the bound LoRA factors of the targeted projections.
void plan_adapter(SavePlan& plan, const Local& l, LayerRecord& rec, const char* where) {
  const kt_moe& m = *l.moe;
  const kt_moe_options& o = m.options();
  for (int i = 0; i < 6; ++i) {
    if (!((o.lora_targets >> (i / 2)) & 1u)) continue;
    const View* v = m.bound_view(kLoraId[i]);
    KT_CHECK(v != nullptr, KT_ERR_NOT_BOUND,
             std::string(where) + ": layer " + str(l.number) + ": " + arg_name(kLoraId[i]) +
                 " is not bound on rank " + str(l.dist->comm->rank) +
                 " (the adapter saves the bound LoRA factors)");
    rec.lora_dtype[i] = io::from_dtype(v->dtype);
    add_slices(plan, l, *v, io::from_dtype(v->dtype), lora_suffix(i));
  }
}

// The optimizer part: its settings and step in the record, and each
// parameter's states per local expert, copied under its lock when written.
void plan_optimizer(SavePlan& plan, const Local& l, LayerRecord& rec, const char* where) {
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
  const int64_t n = static_cast<int64_t>(l.experts->size());
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

}  // namespace

void plan_layer(SavePlan& plan, const Local& l, unsigned parts, const char* where) {
  LayerRecord rec{};
  rec.holds = l.holds();
  if (l.holds()) {
    if (parts & KT_DIST_CKPT_WEIGHTS) plan_weights(plan, l, rec);
    if (parts & KT_DIST_CKPT_ADAPTER) plan_adapter(plan, l, rec, where);
    if ((parts & KT_DIST_CKPT_OPTIMIZER) && l.opt) plan_optimizer(plan, l, rec, where);
  }
  plan.records.push_back(rec);
}

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

namespace {

const io::TensorEntry* find_entry(const io::SafetensorsFile& f, const std::string& name) {
  const auto& ts = f.header().tensors;
  auto it = std::lower_bound(ts.begin(), ts.end(), name,
                             [](const io::TensorEntry& e, const std::string& n) { return e.name < n; });
  return it != ts.end() && it->name == name ? &*it : nullptr;
}

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
void plan_load_optimizer(Opened& c, const json& j, const Local& l, const std::vector<int>& saved_rank,
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

// The weights part of layer l's load: a copy per local expert of each
// projection's weight (and bias), into the bound trainable tensors where
// the layer binds them all.
void plan_load_weights(Opened& c, const Local& l, const std::vector<int>& saved_rank, const std::string& lname,
                       LayerLoad& load) {
  const kt_moe& m = *l.moe;
  const kt_moe_options& o = l.options();
  load.weights_into_bound = weights_bound(m);
  KT_CHECK(m.options().mode != KT_MODE_FULL || load.weights_into_bound || !m.bound_view(KT_ARG_W_GATE),
           KT_ERR_NOT_BOUND,
           lname + ": the layer binds some of its trainable weights and biases but not all");
  for (int64_t g : *l.experts) {
    const std::string key = expert_key(l.number, g);
    std::array<Copy, 6> w{};
    for (int p = 0; p < 3; ++p) {
      w[usize(p)] = stored(c, saved_rank[usize(g)], key + kProjKey[p] + ".weight", expert_shape(o, kWeightId[p]),
                           false, lname);
      if (o.has_bias)
        w[usize(3 + p)] = stored(c, saved_rank[usize(g)], key + kProjKey[p] + ".bias",
                                 expert_shape(o, kBiasId[p]), false, lname);
    }
    load.weights.push_back(w);
  }
}

// The adapter part of layer l's load: a copy per local expert of each
// targeted LoRA factor, into the bound factors.
void plan_load_adapter(Opened& c, const Local& l, const std::vector<int>& saved_rank, const std::string& lname,
                       LayerLoad& load) {
  const kt_moe& m = *l.moe;
  const kt_moe_options& o = l.options();
  for (int i = 0; i < 6; ++i)
    if ((o.lora_targets >> (i / 2)) & 1u)
      KT_CHECK(m.bound_view(kLoraId[i]) != nullptr, KT_ERR_NOT_BOUND,
               lname + ": " + arg_name(kLoraId[i]) +
                   " is not bound (the adapter is loaded into the bound tensors)");
  for (int64_t g : *l.experts) {
    std::array<Copy, 6> f{};
    for (int i = 0; i < 6; ++i)
      if ((o.lora_targets >> (i / 2)) & 1u)
        f[usize(i)] = stored(c, saved_rank[usize(g)], expert_key(l.number, g) + lora_suffix(i),
                             expert_shape(o, kLoraId[i]), false, lname);
    load.lora.push_back(f);
  }
}

// The manifest's entry of layer `number`.
const json& saved_layer(const Opened& c, int64_t number, const char* where) {
  const json* found = nullptr;
  for (const json& j : field(c.manifest, "layers", c.label))
    if (int_field(j, "layer", c.label) == number) found = &j;
  KT_CHECK(found != nullptr, KT_ERR_INVALID_ARGUMENT,
           std::string(where) + ": " + c.label + " holds no layer " + str(number));
  return *found;
}

// The parts layer j of the checkpoint holds.
unsigned saved_parts(const Opened& c, const json& j) {
  unsigned have = 0;
  for (const json& p : field(j, "parts", c.label)) {
    if (p == "weights") have |= KT_DIST_CKPT_WEIGHTS;
    if (p == "adapter") have |= KT_DIST_CKPT_ADAPTER;
    if (p == "optimizer") have |= KT_DIST_CKPT_OPTIMIZER;
  }
  return have;
}

// The parts a load of layer l copies: those requested, each held by the
// checkpoint; by default what it holds of the layer's mode (the optimizer
// state where the rank gives an optimizer).
unsigned load_parts(const Local& l, unsigned requested, unsigned have, const std::string& lname) {
  const bool lora = l.options().mode == KT_MODE_LORA;
  const char* kPartWord[3] = {"weights", "adapter", "optimizer state"};
  for (int b = 0; b < 3; ++b)
    KT_CHECK(!(requested & (1u << b)) || (have & (1u << b)), KT_ERR_INVALID_ARGUMENT,
             lname + ": options->parts asks for the " + kPartWord[b] +
                 ", which the checkpoint does not hold");
  KT_CHECK(
      !(requested & KT_DIST_CKPT_ADAPTER) || lora, KT_ERR_MODE,
      lname + ": options->parts names KT_DIST_CKPT_ADAPTER but the layer is not in KT_MODE_LORA");
  if (requested) return requested;
  unsigned parts = have & (KT_DIST_CKPT_WEIGHTS | (lora ? KT_DIST_CKPT_ADAPTER : 0u));
  if (l.opt) parts |= have & KT_DIST_CKPT_OPTIMIZER;
  return parts;
}

}  // namespace

LayerLoad plan_load(Opened& c, const Local& l, unsigned requested, const char* where) {
  const std::string lname = std::string(where) + ": " + c.label + ": layer " + str(l.number);
  const json& j = saved_layer(c, l.number, where);
  const kt_moe_options& o = l.options();
  check_saved_layer(c, j, o, lname);
  const std::vector<int> saved_rank = saved_expert_ranks(c, j, l.number, o.num_experts);
  const unsigned have = saved_parts(c, j);
  LayerLoad load;
  load.local = &l;
  load.parts = load_parts(l, requested, have, lname);
  if (load.parts & (KT_DIST_CKPT_ADAPTER | KT_DIST_CKPT_OPTIMIZER)) {
    // The adapter's and the optimizer's tensors are the LoRA factors' shapes.
    if (o.mode == KT_MODE_LORA && (have & KT_DIST_CKPT_ADAPTER)) check_saved_lora(c, j, o, lname);
  }
  if (!l.holds()) return load;

  for (int64_t g : *l.experts) {
    const int r = saved_rank[usize(g)];
    if (!c.mapped.count(r)) c.mapped[r] = nullptr;
  }
  // The files are opened by the caller (inside the consistent read), which
  // then plans again.
  if (!c.mapped_ready) return load;
  if (load.parts & KT_DIST_CKPT_WEIGHTS) plan_load_weights(c, l, saved_rank, lname, load);
  if (load.parts & KT_DIST_CKPT_ADAPTER) plan_load_adapter(c, l, saved_rank, lname, load);
  if (load.parts & KT_DIST_CKPT_OPTIMIZER) {
    KT_CHECK(
        l.opt != nullptr, KT_ERR_NULL_POINTER,
        lname + ": options->parts names KT_DIST_CKPT_OPTIMIZER but this rank's optimizer is NULL");
    plan_load_optimizer(c, j, l, saved_rank, lname, where, &load);
  }
  return load;
}

}  // namespace kt::dist::ckpt
