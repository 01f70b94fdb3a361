#include "kt_torch.h"

#include <ATen/ATen.h>
#include <torch/autograd.h>
#include <torch/library.h>
#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <mutex>

namespace kt_torch {
namespace {

// kt status -> a c10::Error carrying kt's message (a RuntimeError in Python).
void check(kt_status s) {
  if (s != KT_OK) TORCH_CHECK(false, kt_status_string(s), ": ", kt_last_error());
}

// A borrowed DLTensor over a CPU tensor; the shape/stride arrays live here.
struct DLView {
  DLTensor t{};
  std::vector<int64_t> shape, strides;
  explicit DLView(const at::Tensor& x) {
    shape = x.sizes().vec();
    strides = x.strides().vec();
    t.data = x.data_ptr();
    t.device = {x.device().is_cpu() ? kDLCPU : kDLCUDA, 0};
    t.ndim = static_cast<int32_t>(x.dim());
    switch (x.scalar_type()) {
      case at::kFloat: t.dtype = {kDLFloat, 32, 1}; break;
      case at::kHalf: t.dtype = {kDLFloat, 16, 1}; break;
      case at::kDouble: t.dtype = {kDLFloat, 64, 1}; break;
      case at::kBFloat16: t.dtype = {kDLBfloat, 16, 1}; break;
      case at::kInt: t.dtype = {kDLInt, 32, 1}; break;
      case at::kLong: t.dtype = {kDLInt, 64, 1}; break;
      default: TORCH_CHECK(false, "kt: tensor dtype ", x.scalar_type(), " has no kt equivalent");
    }
    t.shape = shape.data();
    t.strides = strides.data();
  }
};

struct ArgList {
  std::vector<std::unique_ptr<DLView>> views;
  std::vector<kt_arg> args;
  void add(int id, const at::Tensor& x) {
    views.push_back(std::make_unique<DLView>(x));
    args.push_back({id, &views.back()->t});
  }
};

// The engine of all layers with this thread count; destroyed with the last.
std::shared_ptr<kt_engine> shared_engine(int num_threads) {
  static std::mutex mutex;
  static std::map<int, std::weak_ptr<kt_engine>> engines;
  std::lock_guard<std::mutex> lock(mutex);
  if (auto e = engines[num_threads].lock()) return e;
  kt_engine_options eo;
  kt_engine_options_init(&eo);
  eo.num_threads = num_threads;
  kt_engine* raw = nullptr;
  check(kt_engine_create(&eo, &raw));
  std::shared_ptr<kt_engine> e(raw, [](kt_engine* p) { kt_engine_destroy(p); });
  engines[num_threads] = e;
  return e;
}

kt_activation parse_activation(const std::string& s) {
  if (s == "silu") return KT_ACT_SILU;
  if (s == "swiglu_oai") return KT_ACT_SWIGLU_OAI;
  TORCH_CHECK(false, "kt: activation must be silu or swiglu_oai, not ", s);
}

kt_mode parse_mode(const std::string& s) {
  if (s == "inference") return KT_MODE_INFERENCE;
  if (s == "lora") return KT_MODE_LORA;
  if (s == "full") return KT_MODE_FULL;
  TORCH_CHECK(false, "kt: mode must be inference, lora or full, not ", s);
}

}  // namespace

MoeLayer::MoeLayer(int64_t E, int64_t k, int64_t H, int64_t I, std::string activation,
                   double act_limit, std::string mode, int64_t rank, double alpha,
                   int64_t max_tokens, int64_t num_threads)
    : top_k_(k), hidden_(H), mode_(parse_mode(mode)) {
  engine_ = shared_engine(static_cast<int>(num_threads));
  kt_moe_options o;
  kt_moe_options_init(&o);
  o.num_experts = E;
  o.top_k = k;
  o.hidden = H;
  o.intermediate = I;
  o.max_tokens = max_tokens;
  o.activation = parse_activation(activation);
  o.act_limit = static_cast<float>(act_limit);
  o.mode = mode_;
  o.lora_rank = rank;
  o.lora_alpha = static_cast<float>(alpha);
  check(kt_moe_create(engine_.get(), &o, &moe_));
  auto add = [&](const char* name, int id, at::Tensor t) {
    param_names_.emplace_back(name);
    param_ids_.push_back(id);
    params_.push_back(t.requires_grad_(true));
  };
  if (mode_ == KT_MODE_LORA) {
    // PEFT's init: A ~ U(+-1/sqrt(in)), B = 0.
    const int64_t ins[3] = {H, H, I}, outs[3] = {I, I, H};
    const char* names[3][2] = {{"lora_A_gate", "lora_B_gate"}, {"lora_A_up", "lora_B_up"},
                               {"lora_A_down", "lora_B_down"}};
    for (int p = 0; p < 3; ++p) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(ins[p]));
      add(names[p][0], KT_ARG_LORA_A_GATE + 2 * p, at::empty({E, rank, ins[p]}).uniform_(-bound, bound));
      add(names[p][1], KT_ARG_LORA_B_GATE + 2 * p, at::zeros({E, outs[p], rank}));
    }
  } else if (mode_ == KT_MODE_FULL) {
    add("w_gate", KT_ARG_W_GATE, at::zeros({E, I, H}));
    add("w_up", KT_ARG_W_UP, at::zeros({E, I, H}));
    add("w_down", KT_ARG_W_DOWN, at::zeros({E, H, I}));
  }
  bound_ptr_.assign(params_.size(), nullptr);
  bound_version_.assign(params_.size(), -1);
  bound_grad_ptr_.assign(params_.size(), nullptr);
}

MoeLayer::~MoeLayer() {
  kt_moe_destroy(moe_);  // before the engine it runs on (engine_ is released after)
}

double MoeLayer::lora_scale() const {
  float s = 0.f;
  check(kt_moe_lora_scale(moe_, &s));
  return s;
}

void MoeLayer::bind(const std::vector<std::pair<int, at::Tensor>>& args) {
  ArgList list;
  for (const auto& a : args) list.add(a.first, a.second);
  check(kt_moe_bind(moe_, list.args.data(), list.args.size()));
}

void MoeLayer::load_weights(const at::Tensor& gate, const at::Tensor& up, const at::Tensor& down) {
  at::NoGradGuard no_grad;
  if (mode_ == KT_MODE_FULL) {
    params_[0].copy_(gate);
    params_[1].copy_(up);
    params_[2].copy_(down);
    needs_reload_ = true;
    return;
  }
  ArgList list;
  list.add(KT_ARG_W_GATE, gate.cpu());
  list.add(KT_ARG_W_UP, up.cpu());
  list.add(KT_ARG_W_DOWN, down.cpu());
  check(kt_moe_load_weights(moe_, nullptr, list.args.data(), list.args.size()));
}

// Rebinds replaced parameters; re-reads the ones the optimizer changed in place.
void MoeLayer::sync_parameters() {
  std::vector<std::pair<int, at::Tensor>> rebind;
  bool changed = needs_reload_;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    TORCH_CHECK(p.device().is_cpu(), "kt: ", param_names_[i], " must stay in CPU memory");
    if (p.data_ptr() != bound_ptr_[i]) rebind.emplace_back(param_ids_[i], p.detach());
    changed = changed || static_cast<int64_t>(p._version()) != bound_version_[i];
  }
  if (!rebind.empty()) bind(rebind);
  if (mode_ == KT_MODE_FULL ? (changed || !rebind.empty()) : (changed && rebind.empty()))
    check(kt_moe_params_changed(moe_));
  for (size_t i = 0; i < params_.size(); ++i) {
    bound_ptr_[i] = params_[i].data_ptr();
    bound_version_[i] = static_cast<int64_t>(params_[i]._version());
  }
  needs_reload_ = false;
}

std::tuple<at::Tensor, int64_t> MoeLayer::forward(const at::Tensor& x, const at::Tensor& ids,
                                                  const at::Tensor& weights, bool save) {
  sync_parameters();
  at::Tensor y = at::empty(x.sizes(), x.options());
  ArgList list;
  list.add(KT_ARG_X, x);
  list.add(KT_ARG_IDS, ids);
  list.add(KT_ARG_ROUTE_WEIGHTS, weights);
  list.add(KT_ARG_Y, y);
  kt_context* ctx = nullptr;
  check(kt_moe_forward(moe_, list.args.data(), list.args.size(), save ? &ctx : nullptr));
  return {y, static_cast<int64_t>(reinterpret_cast<intptr_t>(ctx))};
}

std::tuple<at::Tensor, at::Tensor> MoeLayer::backward(int64_t context, const at::Tensor& dy,
                                                      bool param_grads) {
  auto* ctx = reinterpret_cast<kt_context*>(static_cast<intptr_t>(context));
  kt_backward_options o;
  kt_backward_options_init(&o);
  o.grad_scale = static_cast<float>(grad_scale_);
  o.param_grads = param_grads && !params_.empty();
  // torch's rule: a parameter without grad() gets a fresh gradient, one with
  // grad() gets it added.
  std::vector<std::pair<size_t, at::Tensor>> install;
  if (o.param_grads) {
    bool any_defined = false;
    for (const auto& p : params_) any_defined = any_defined || p.grad().defined();
    o.accumulate = any_defined ? KT_GRAD_ACCUMULATE : KT_GRAD_OVERWRITE;
    std::vector<std::pair<int, at::Tensor>> grads;
    for (size_t i = 0; i < params_.size(); ++i) {
      at::Tensor g = params_[i].grad();
      if (!g.defined()) {
        g = any_defined ? at::zeros_like(params_[i]) : at::empty_like(params_[i]);
        install.emplace_back(i, g);
      }
      if (g.data_ptr() != bound_grad_ptr_[i]) {
        grads.emplace_back(grad_id(i), g);
        bound_grad_ptr_[i] = g.data_ptr();
      }
    }
    if (!grads.empty()) bind(grads);
  }
  at::Tensor dyc = dy.contiguous();
  // The saved dtypes: dx has x's, the routing grad is fp32 (the caller casts).
  at::Tensor dx = at::empty(dyc.sizes(), dyc.options());
  at::Tensor dw = at::empty({dyc.size(0), top_k_}, dyc.options().dtype(at::kFloat));
  ArgList list;
  list.add(KT_ARG_DY, dyc);
  list.add(KT_ARG_DX, dx);
  list.add(KT_ARG_DROUTE_WEIGHTS, dw);
  check(kt_moe_backward(moe_, ctx, &o, list.args.data(), list.args.size()));
  for (auto& [i, g] : install) params_[i].mutable_grad() = g;
  return {dx, dw};
}

void MoeLayer::release(int64_t context) {
  kt_context_release(reinterpret_cast<kt_context*>(static_cast<intptr_t>(context)));
}

int MoeLayer::grad_id(size_t i) const {
  return mode_ == KT_MODE_FULL ? param_ids_[i] - KT_ARG_W_GATE + KT_ARG_GRAD_W_GATE
                               : param_ids_[i] + (KT_ARG_GRAD_LORA_A_GATE - KT_ARG_LORA_A_GATE);
}

kt_moe* MoeLayer::prepare_optimizer_step() {
  TORCH_CHECK(!params_.empty(), "kt: an inference layer has no parameters to optimize");
  sync_parameters();
  std::vector<std::pair<int, at::Tensor>> grads;
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& g = params_[i].grad();
    TORCH_CHECK(g.defined(), "kt: ", param_names_[i], " has no grad() (run backward first)");
    TORCH_CHECK(g.device().is_cpu() && g.is_contiguous(), "kt: ", param_names_[i],
                ".grad() must be a contiguous CPU tensor");
    if (g.data_ptr() != bound_grad_ptr_[i]) {
      grads.emplace_back(grad_id(i), g);
      bound_grad_ptr_[i] = g.data_ptr();
    }
  }
  if (!grads.empty()) bind(grads);
  return moe_;
}

LayerOptimizer::LayerOptimizer(c10::intrusive_ptr<MoeLayer> layer, std::string algorithm, double lr,
                               double weight_decay, double beta1, double beta2, double eps,
                               double momentum, bool nesterov)
    : layer_(std::move(layer)) {
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  TORCH_CHECK(algorithm == "adamw" || algorithm == "sgd", "kt: algorithm must be adamw or sgd, not ", algorithm);
  o.algorithm = algorithm == "adamw" ? KT_OPTIM_ADAMW : KT_OPTIM_SGD;
  o.lr = lr;
  o.weight_decay = weight_decay;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.momentum = momentum;
  o.nesterov = nesterov ? 1 : 0;
  // The steps reproduce the optimizers of the torch this plugin is built with.
  o.arithmetic = TORCH_VERSION_MAJOR >= 2 ? KT_OPTIM_TORCH2 : KT_OPTIM_TORCH1;
  check(kt_optimizer_create_for_layer(layer_->prepare_optimizer_step(), &o, &opt_));
}

LayerOptimizer::~LayerOptimizer() { kt_optimizer_destroy(opt_); }

bool LayerOptimizer::step(double grad_unscale, double clip_coef) {
  layer_->prepare_optimizer_step();
  kt_optimizer_step_options o;
  kt_optimizer_step_options_init(&o);
  int nonfinite = 0;
  o.grad_unscale = static_cast<float>(grad_unscale);
  o.clip_coef = static_cast<float>(clip_coef);
  o.found_nonfinite = &nonfinite;
  check(kt_optimizer_step(opt_, &o));
  return nonfinite == 0;
}

void LayerOptimizer::set_lr(double lr) {
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  check(kt_optimizer_get_options(opt_, &o));
  o.lr = lr;
  check(kt_optimizer_set_options(opt_, &o));
}

double LayerOptimizer::lr() const {
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  check(kt_optimizer_get_options(opt_, &o));
  return o.lr;
}

double LayerOptimizer::grad_sq_norm() {
  layer_->prepare_optimizer_step();
  double out = 0;
  check(kt_optimizer_grad_sq_norm(opt_, &out));
  return out;
}

int64_t LayerOptimizer::steps() const {
  int64_t n = 0;
  check(kt_optimizer_get_step(opt_, &n));
  return n;
}

void LayerOptimizer::save(const std::string& path) { check(kt_optimizer_save(opt_, path.c_str())); }
void LayerOptimizer::load(const std::string& path) { check(kt_optimizer_load(opt_, path.c_str())); }

namespace {

using LayerPtr = c10::intrusive_ptr<MoeLayer>;

// A forward's saved kt context inside an autograd graph: released after its
// backward, or when the graph is dropped without one.
struct SavedContext : public torch::CustomClassHolder {
  LayerPtr layer;
  int64_t context = 0;
  SavedContext(LayerPtr l, int64_t c) : layer(std::move(l)), context(c) {}
  ~SavedContext() override { release(); }
  void release() {
    if (context) layer->release(context);
    context = 0;
  }
};

// y = experts(x); the layer's parameters are inputs so that backward runs
// even when x needs no gradient; kt writes their grad() itself.
struct MoeFunction : public torch::autograd::Function<MoeFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, LayerPtr layer,
                            const at::Tensor& x, const at::Tensor& ids, const at::Tensor& weights,
                            at::TensorList params) {
    const bool save = x.requires_grad() || weights.requires_grad() ||
                      std::any_of(params.begin(), params.end(),
                                  [](const at::Tensor& p) { return p.requires_grad(); });
    auto [y, context] = layer->forward(x.contiguous(), ids.contiguous(), weights.contiguous(), save);
    ctx->saved_data["context"] = c10::make_intrusive<SavedContext>(layer, context);
    ctx->saved_data["weights_dtype"] = static_cast<int64_t>(weights.scalar_type());
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->saved_data["context"].toCustomClass<SavedContext>();
    const LayerPtr& layer = saved->layer;
    // A second backward passes a NULL context, which kt refuses with its message.
    auto [dx, dw] = layer->backward(saved->context, grads[0], true);
    saved->release();
    const auto wtype = static_cast<at::ScalarType>(ctx->saved_data["weights_dtype"].toInt());
    torch::autograd::variable_list out = {at::Tensor(), dx, at::Tensor(), dw.to(wtype)};
    out.resize(out.size() + layer->parameters().size());
    return out;
  }
};

at::Tensor moe(const LayerPtr& layer, const at::Tensor& x, const at::Tensor& ids,
               const at::Tensor& weights) {
  const auto shape = x.sizes().vec();
  at::Tensor x2 = x.reshape({-1, layer->hidden()});
  at::Tensor ids2 = ids.reshape({-1, layer->top_k()});
  at::Tensor w2 = weights.reshape({-1, layer->top_k()});
  const bool moved = !x.device().is_cpu();
  if (moved) {
    x2 = x2.cpu();
    ids2 = ids2.cpu();
    w2 = w2.cpu();
  }
  auto params = layer->parameters();
  at::Tensor y = MoeFunction::apply(layer, x2, ids2, w2, at::TensorList(params));
  if (moved) y = y.to(x.device());
  return y.reshape(shape);
}

std::tuple<at::Tensor, int64_t> moe_forward(const LayerPtr& layer, const at::Tensor& x,
                                            const at::Tensor& ids, const at::Tensor& weights,
                                            bool save) {
  return layer->forward(x, ids, weights, save);
}

std::tuple<at::Tensor, at::Tensor> moe_backward(const LayerPtr& layer, int64_t context,
                                                const at::Tensor& dy, bool param_grads) {
  return layer->backward(context, dy, param_grads);
}

void context_release(const LayerPtr& layer, int64_t context) { layer->release(context); }

}  // namespace
}  // namespace kt_torch

TORCH_LIBRARY(kt, m) {
  using kt_torch::MoeLayer;
  m.class_<MoeLayer>("MoeLayer")
      .def(torch::init<int64_t, int64_t, int64_t, int64_t, std::string, double, std::string,
                       int64_t, double, int64_t, int64_t>())
      .def("load_weights", &MoeLayer::load_weights)
      .def("parameters", &MoeLayer::parameters)
      .def("parameter_names", &MoeLayer::parameter_names)
      .def("lora_scale", &MoeLayer::lora_scale)
      .def("grad_scale", &MoeLayer::grad_scale)
      .def("set_grad_scale", &MoeLayer::set_grad_scale);
  m.class_<kt_torch::SavedContext>("SavedContext");
  using kt_torch::LayerOptimizer;
  m.class_<LayerOptimizer>("LayerOptimizer")
      .def(torch::init<c10::intrusive_ptr<MoeLayer>, std::string, double, double, double, double, double,
                       double, bool>())
      .def("step", &LayerOptimizer::step)
      .def("set_lr", &LayerOptimizer::set_lr)
      .def("lr", &LayerOptimizer::lr)
      .def("grad_sq_norm", &LayerOptimizer::grad_sq_norm)
      .def("steps", &LayerOptimizer::steps)
      .def("save", &LayerOptimizer::save)
      .def("load", &LayerOptimizer::load);
  m.def("moe(__torch__.torch.classes.kt.MoeLayer layer, Tensor x, Tensor ids, Tensor weights) -> Tensor",
        &kt_torch::moe);
  m.def("moe_forward(__torch__.torch.classes.kt.MoeLayer layer, Tensor x, Tensor ids, "
        "Tensor weights, bool save) -> (Tensor, int)",
        &kt_torch::moe_forward);
  m.def("moe_backward(__torch__.torch.classes.kt.MoeLayer layer, int context, Tensor dy, "
        "bool param_grads) -> (Tensor, Tensor)",
        &kt_torch::moe_backward);
  m.def("context_release(__torch__.torch.classes.kt.MoeLayer layer, int context) -> ()",
        &kt_torch::context_release);
}
