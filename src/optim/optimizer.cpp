// kt_optimizer's core: parameter set-up (host pairs or a layer's bindings),
// the step in two passes (check every gradient, then update; one with
// assume_finite), the gradient norm, and the state file.
#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>

#include "core/checked.h"
#include "core/ckpt_names.h"
#include "core/error.h"
#include "formats/packed_bf16.h"
#include "io/safetensors.h"
#include "io/writer.h"
#include "moe/args.h"
#include "moe/moe_layer.h"
#include "runtime/engine.h"

namespace kt {
namespace optim {

void set_options_defaults(kt_optimizer_options& o) {
  o.algorithm = KT_OPTIM_ADAMW;
  o.lr = 1e-3;
  o.weight_decay = 1e-2;
  o.beta1 = 0.9;
  o.beta2 = 0.999;
  o.eps = 1e-8;
  o.amsgrad = 0;
  o.momentum = 0.0;
  o.dampening = 0.0;
  o.nesterov = 0;
  o.arithmetic = KT_OPTIM_TORCH1;
  o.assume_finite = 0;
}

void validate_options(const kt_optimizer_options& o, const char* where) {
  const std::string w = std::string(where) + ": options->";
  check_enum(o.algorithm, KT_OPTIM_ADAMW, KT_OPTIM_SGD, w + "algorithm", "kt_optim_algorithm");
  check_enum(o.arithmetic, KT_OPTIM_TORCH1, KT_OPTIM_TORCH2, w + "arithmetic", "kt_optim_arithmetic");
  auto finite_at_least = [&](double v, double lo, const char* name) {
    KT_CHECK(std::isfinite(v) && v >= lo, KT_ERR_INVALID_ARGUMENT,
             w + name + " = " + std::to_string(v) + " must be finite and >= " + std::to_string(lo));
  };
  finite_at_least(o.lr, 0.0, "lr");
  finite_at_least(o.weight_decay, 0.0, "weight_decay");
  finite_at_least(o.eps, 0.0, "eps");
  finite_at_least(o.momentum, 0.0, "momentum");
  KT_CHECK(std::isfinite(o.dampening), KT_ERR_INVALID_ARGUMENT, w + "dampening must be finite");
  for (const auto& b : {std::make_pair(o.beta1, "beta1"), std::make_pair(o.beta2, "beta2")})
    KT_CHECK(b.first >= 0.0 && b.first < 1.0, KT_ERR_INVALID_ARGUMENT,
             w + b.second + " = " + std::to_string(b.first) + " is outside [0, 1)");
  KT_CHECK(o.amsgrad == 0 || o.amsgrad == 1, KT_ERR_INVALID_ARGUMENT, w + "amsgrad must be 0 or 1");
  KT_CHECK(o.nesterov == 0 || o.nesterov == 1, KT_ERR_INVALID_ARGUMENT,
           w + "nesterov must be 0 or 1");
  KT_CHECK(o.assume_finite == 0 || o.assume_finite == 1, KT_ERR_INVALID_ARGUMENT,
           w + "assume_finite must be 0 or 1");
  if (o.algorithm == KT_OPTIM_SGD && o.nesterov)
    KT_CHECK(o.momentum > 0.0 && o.dampening == 0.0, KT_ERR_INVALID_ARGUMENT,
             w + "nesterov needs momentum > 0 and dampening 0 (as torch.optim.SGD)");
}

}  // namespace optim
}  // namespace kt

using kt::optim::Span;

void kt_optimizer::job_ended(kt_job* job) {
  std::lock_guard<std::mutex> lock(state_mutex);
  jobs.erase(job);
  if (jobs.empty()) jobs_done.notify_all();
}

std::unique_lock<std::mutex> kt_optimizer::lock_compute() {
  return std::unique_lock<std::mutex>(engine ? engine->compute_mutex : own_mutex);
}

void kt_optimizer::allocate_state() {
  const bool adamw = opt.algorithm == KT_OPTIM_ADAMW;
  constexpr size_t kAlign = 64 / sizeof(float);
  std::vector<size_t> offsets;
  size_t total = 0;
  for (Param& p : params) {
    p.shape.assign(p.param.shape, p.param.shape + p.param.ndim);
    offsets.push_back(total);
    total += (static_cast<size_t>(p.numel) + kAlign - 1) / kAlign * kAlign;
  }
  auto arena = [&](kt::Buffer<float>& b, kt_optimizer::StateSlice Param::*slice) {
    b.resize(total);
    if (total) std::memset(b.data(), 0, total * sizeof(float));
    for (size_t i = 0; i < params.size(); ++i)
      params[i].*slice = {b.data() + offsets[i], static_cast<size_t>(params[i].numel)};
  };
  arena(m_arena, &Param::m);
  if (adamw) arena(v_arena, &Param::v);
  if (adamw && opt.amsgrad) arena(vmax_arena, &Param::vmax);
  plan_items();
}

void kt_optimizer::plan_items() {
  items.clear();
  for (size_t i = 0; i < params.size(); ++i) {
    const Param& p = params[i];
    if (p.proj >= 0 && !p.is_bias) {
      // Whole panels of one expert, about kChunkElements at a time.
      const int64_t per_expert = p.rows * p.cols;
      const int64_t panel_rows = kt::kPanelRows;
      const int64_t step_rows =
          std::max<int64_t>(panel_rows, kt::optim::kChunkElements / std::max<int64_t>(p.cols, 1) / panel_rows * panel_rows);
      for (int64_t e = 0; per_expert > 0 && e < p.numel / per_expert; ++e)
        for (int64_t r = 0; r < p.rows; r += step_rows)
          items.push_back({i, e * per_expert + r * p.cols, std::min(step_rows, p.rows - r) * p.cols});
      continue;
    }
    for (int64_t o = 0; o < p.numel; o += kt::optim::kChunkElements)
      items.push_back({i, o, std::min(kt::optim::kChunkElements, p.numel - o)});
  }
}

template <class F>
void kt_optimizer::for_chunks(F&& fn, bool backwards) {
  const int64_t n = static_cast<int64_t>(items.size());
  auto run = [&](int64_t order) {
    const int64_t index = backwards ? n - 1 - order : order;
    const Item& item = items[static_cast<size_t>(index)];
    const Param& p = params[item.param];
    const int64_t o = item.offset;
    Span s;
    s.n = item.n;
    s.p = p.master + o;
    s.g_bf16 = p.grad.dtype == kt::DType::kBF16;
    s.g = p.grad.data + o * static_cast<int64_t>(p.grad.elem_size());
    s.m = p.m.ptr + o;
    if (p.v.ptr) s.v = p.v.ptr + o;
    if (p.vmax.ptr) s.vmax = p.vmax.ptr + o;
    if (p.bf16_copy) s.p_bf16 = p.bf16_copy + o;
    fn(static_cast<size_t>(index), s);
  };
  if (engine && n > 1) {
    engine->pool->run(n, [&](int64_t index, int) { run(index); });
  } else {
    for (int64_t i = 0; i < n; ++i) run(i);
  }
}

void kt_optimizer::write_layer_item(const Item& item, kt::bf16_t* const packed[3], float* const biases[3]) const {
  const Param& p = params[item.param];
  if (p.proj < 0) return;
  if (p.is_bias) {
    // The layer keeps what it would read from the bound tensor.
    float* dst = biases[p.proj] + item.offset;
    for (int64_t i = 0; i < item.n; ++i)
      dst[i] = p.bf16_copy ? kt::bf16_to_f32(p.bf16_copy[item.offset + i]) : p.master[item.offset + i];
    return;
  }
  const int64_t per_expert = p.rows * p.cols;
  const int64_t e = item.offset / per_expert, r0 = item.offset % per_expert / p.cols, rows = item.n / p.cols;
  const kt::PanelShape whole = kt::PanelShape::of(p.rows, p.cols);
  kt::bf16_t* base = packed[p.proj] + e * whole.elements();
  for (int64_t r = r0; r < r0 + rows; r += kt::kPanelRows)
    kernels->pack_panel(p.master + e * per_expert + r * p.cols, std::min<int64_t>(kt::kPanelRows, p.rows - r), p.cols,
                        base + r / kt::kPanelRows * whole.panel_stride());
}

void kt_optimizer::check_layer(const char* where) {
  if (!layer_mode) return;
  KT_CHECK(moe != nullptr, KT_ERR_INVALID_HANDLE,
           std::string(where) + ": the optimizer's layer was destroyed");
  for (Param& p : params) {
    const kt::View* now = moe->bound_view(p.param_id);
    KT_CHECK(now && now->data == p.param.data && now->dtype == p.param.dtype,
             KT_ERR_INVALID_ARGUMENT,
             std::string(where) + ": " + p.name +
                 " was bound again since the optimizer was created (create a new optimizer)");
    // Gradient buffers may be rebound (same shape, checked by kt_moe_bind).
    const kt::View* g = moe->bound_view(p.grad_id);
    KT_CHECK(g != nullptr, KT_ERR_NOT_BOUND,
             std::string(where) + ": " + kt::arg_name(p.grad_id) + " is not bound");
    KT_CHECK(kt::optim::is_compact(*g), KT_ERR_STRIDE,
             std::string(where) + ": " + kt::arg_name(p.grad_id) + " must be compact row-major");
    p.grad = *g;
  }
}

void kt_optimizer::layer_params_changed() {
  if (layer_mode && moe) moe->params_changed();
}

bool kt_optimizer::step_now(float unscale, float clip, const char* where) {
  check_layer(where);
  if (!opt.assume_finite) {
    // Every gradient is read before anything changes. Last item first: the
    // update pass then starts on gradients this pass has just left in the
    // caches.
    std::vector<uint8_t> finite(items.size(), 0);
    for_chunks([&](size_t item, const Span& s) { finite[item] = kernels->all_finite(s, unscale, clip); },
               /*backwards=*/true);
    for (uint8_t f : finite)
      if (!f) return false;
  }
  const int64_t t = step + 1;
  // Full mode: each work item packs the rows it updated while they are in
  // cache, instead of a separate repack of every weight.
  const bool pack = packs_in_step();
  kt::bf16_t* packed[3] = {nullptr, nullptr, nullptr};
  float* biases[3] = {nullptr, nullptr, nullptr};
  if (pack)
    for (int p = 0; p < 3; ++p) {
      packed[p] = moe->writable_packed(p);
      if (moe->options().has_bias) biases[p] = moe->writable_biases(p);
    }
  if (opt.algorithm == KT_OPTIM_ADAMW) {
    kt::optim::AdamWScalars c;
    c.unscale = unscale;
    c.clip = clip;
    c.decay = static_cast<float>(1.0 - opt.lr * opt.weight_decay);
    c.b1 = static_cast<float>(opt.beta1);
    c.one_minus_b1 = static_cast<float>(1.0 - opt.beta1);
    c.moment_rule = opt.arithmetic != KT_OPTIM_TORCH2 ? 0 : c.one_minus_b1 < 0.5f ? 1 : 2;
    c.lerp_coeff = c.moment_rule == 2 ? c.one_minus_b1 - 1.0f : c.one_minus_b1;
    c.b2 = static_cast<float>(opt.beta2);
    c.one_minus_b2 = static_cast<float>(1.0 - opt.beta2);
    const double bc1 = 1.0 - std::pow(opt.beta1, static_cast<double>(t));
    const double bc2 = 1.0 - std::pow(opt.beta2, static_cast<double>(t));
    c.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
    c.neg_step_size = static_cast<float>(-(opt.lr / bc1));
    c.eps = static_cast<float>(opt.eps);
    for_chunks([&](size_t i, const Span& s) {
      kernels->adamw(s, c);
      if (pack) write_layer_item(items[i], packed, biases);
    });
  } else {
    kt::optim::SgdScalars c;
    c.unscale = unscale;
    c.clip = clip;
    c.decay = opt.weight_decay != 0.0;
    c.wd = static_cast<float>(opt.weight_decay);
    c.momentum_mode = opt.momentum == 0.0 ? 0 : (momentum_started ? 2 : 1);
    c.nesterov = opt.nesterov != 0;
    c.mu = static_cast<float>(opt.momentum);
    c.one_minus_dampening = static_cast<float>(1.0 - opt.dampening);
    c.neg_lr = static_cast<float>(-opt.lr);
    for_chunks([&](size_t i, const Span& s) {
      kernels->sgd(s, c);
      if (pack) write_layer_item(items[i], packed, biases);
    });
    if (opt.momentum != 0.0) momentum_started = true;
  }
  step = t;
  if (pack) {
    moe->weights_written();
  } else {
    layer_params_changed();
  }
  return true;
}

double kt_optimizer::grad_sq_norm(const char* where) {
  check_layer(where);
  std::vector<double> parts(items.size(), 0.0);
  for_chunks([&](size_t item, const Span& s) { parts[item] = kernels->sum_squares(s); });
  double sum = 0.0;
  for (double x : parts) sum += x;  // fixed order: independent of threads
  return sum;
}

// ------------------------------------------------------------ state file

namespace {

const char* kFormat = "kt_optimizer";
const char* kFormatVersion = "1";

std::string exact(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.17g", v);
  return buf;
}

const char* algorithm_name(kt_optim_algorithm a) { return a == KT_OPTIM_SGD ? "sgd" : "adamw"; }

// The state tensors of one parameter, in file-name order: (suffix, buffer).
std::vector<std::pair<std::string, kt_optimizer::StateSlice*>> state_buffers(kt_optimizer::Param& p,
                                                                              const kt_optimizer_options& o) {
  std::vector<std::pair<std::string, kt_optimizer::StateSlice*>> out;
  if (o.algorithm == KT_OPTIM_ADAMW) {
    out.emplace_back("exp_avg", &p.m);
    out.emplace_back("exp_avg_sq", &p.v);
    if (o.amsgrad) out.emplace_back("max_exp_avg_sq", &p.vmax);
  } else {
    out.emplace_back("momentum_buffer", &p.m);
  }
  return out;
}

std::vector<int64_t> shape_of(const kt::View& v) {
  return std::vector<int64_t>(v.shape, v.shape + v.ndim);
}

}  // namespace

void kt_optimizer::save(const std::string& path, const char* where) {
  check_layer(where);
  std::vector<kt::io::TensorToWrite> tensors;
  for (Param& p : params) {
    const size_t bytes = static_cast<size_t>(p.numel) * sizeof(float);
    kt::io::TensorToWrite master;
    master.name = p.name + ".master";
    master.shape = shape_of(p.param);
    const float* src = p.master;
    master.fill = [src, bytes](uint8_t* dst) { std::memcpy(dst, src, bytes); };
    tensors.push_back(std::move(master));
    for (auto& s : state_buffers(p, opt)) {
      kt::io::TensorToWrite t;
      t.name = p.name + "." + s.first;
      t.shape = shape_of(p.param);
      const float* data = s.second->data();
      t.fill = [data, bytes](uint8_t* dst) { std::memcpy(dst, data, bytes); };
      tensors.push_back(std::move(t));
    }
  }
  std::map<std::string, std::string> meta = {
      {"format", kFormat},
      {"format_version", kFormatVersion},
      {"algorithm", algorithm_name(opt.algorithm)},
      {"step", std::to_string(step)},
      {"momentum_started", momentum_started ? "1" : "0"},
      {"lr", exact(opt.lr)},
      {"weight_decay", exact(opt.weight_decay)},
      {"beta1", exact(opt.beta1)},
      {"beta2", exact(opt.beta2)},
      {"eps", exact(opt.eps)},
      {"amsgrad", std::to_string(opt.amsgrad)},
      {"momentum", exact(opt.momentum)},
      {"dampening", exact(opt.dampening)},
      {"nesterov", std::to_string(opt.nesterov)},
      {"arithmetic", std::to_string(static_cast<int>(opt.arithmetic))},
  };
  kt::io::write_safetensors(path, std::move(tensors), meta);  // temp + fsync + rename
}

namespace {

// The options, step count and momentum flag a state file was saved with,
// checked against the optimizer loading it (current): same format, same
// algorithm and amsgrad, valid options. w names the call and the file.
struct SavedState {
  kt_optimizer_options options;
  int64_t step = 0;
  bool momentum_started = false;
};

SavedState read_saved_state(const kt::io::SafetensorsFile& file, const kt_optimizer_options& current,
                            const std::string& w, const char* where) {
  const auto& meta = file.header().metadata;
  auto field = [&](const char* key) -> const std::string& {
    auto it = meta.find(key);
    KT_CHECK(it != meta.end(), KT_ERR_IO,
             w + ": not a kt optimizer state file (no metadata '" + key + "')");
    return it->second;
  };
  KT_CHECK(field("format") == kFormat && field("format_version") == kFormatVersion, KT_ERR_IO,
           w + ": not a kt optimizer state file of format version " + kFormatVersion);
  auto number = [&](const char* key) {
    const std::string& text = field(key);
    char* end = nullptr;
    const double v = std::strtod(text.c_str(), &end);
    KT_CHECK(!text.empty() && end && *end == '\0', KT_ERR_IO,
             w + ": metadata '" + key + "' = '" + text + "' is not a number");
    return v;
  };
  KT_CHECK(field("algorithm") == algorithm_name(current.algorithm), KT_ERR_INVALID_ARGUMENT,
           w + ": saved by a '" + field("algorithm") + "' optimizer, this one is '" +
               algorithm_name(current.algorithm) + "'");
  SavedState saved;
  kt_optimizer_options& loaded = saved.options;
  loaded = current;
  loaded.lr = number("lr");
  loaded.weight_decay = number("weight_decay");
  loaded.beta1 = number("beta1");
  loaded.beta2 = number("beta2");
  loaded.eps = number("eps");
  auto flag = [&](const char* key) {
    const double v = number(key);
    KT_CHECK(v == 0.0 || v == 1.0, KT_ERR_IO, w + ": metadata '" + key + "' is not 0 or 1");
    return static_cast<int>(v);
  };
  loaded.amsgrad = flag("amsgrad");
  loaded.momentum = number("momentum");
  loaded.dampening = number("dampening");
  loaded.nesterov = flag("nesterov");
  // Files written before the field existed were torch 1 arithmetic.
  if (meta.count("arithmetic"))
    loaded.arithmetic = flag("arithmetic") ? KT_OPTIM_TORCH2 : KT_OPTIM_TORCH1;
  else
    loaded.arithmetic = KT_OPTIM_TORCH1;
  KT_CHECK(loaded.amsgrad == current.amsgrad, KT_ERR_INVALID_ARGUMENT,
           w + ": saved with amsgrad = " + std::to_string(loaded.amsgrad) +
               ", this optimizer has " + std::to_string(current.amsgrad));
  kt::optim::validate_options(loaded, where);
  const double step = number("step");
  KT_CHECK(step >= 0 && step < 9.0e15 && step == std::floor(step), KT_ERR_IO,
           w + ": metadata 'step' is not a step count");
  saved.step = static_cast<int64_t>(step);
  saved.momentum_started = flag("momentum_started") != 0;
  return saved;
}

}  // namespace

void kt_optimizer::load(const std::string& path, const char* where) {
  check_layer(where);
  const kt::io::SafetensorsFile file(std::make_unique<kt::io::MappedFile>(path));
  const std::string w = std::string(where) + ": " + path;
  const SavedState saved = read_saved_state(file, opt, w, where);

  // Every tensor: present, fp32, the parameter's shape; and nothing else.
  struct Copy {
    float* dst;
    const uint8_t* src;
    size_t bytes;
    kt_optimizer::Param* param;  // set for masters
  };
  std::vector<Copy> copies;
  size_t expected = 0;
  for (Param& p : params) {
    struct Name {
      std::string first;
      float* second;
      bool master;
    };
    std::vector<Name> names = {{p.name + ".master", p.master, true}};
    for (auto& s : state_buffers(p, opt)) names.push_back({p.name + "." + s.first, s.second->data(), false});
    for (auto& n : names) {
      ++expected;
      const kt::io::TensorEntry* e = nullptr;
      for (const auto& t : file.header().tensors)
        if (t.name == n.first) e = &t;
      KT_CHECK(e != nullptr, KT_ERR_INVALID_ARGUMENT,
               w + ": has no tensor '" + n.first + "': it was saved from another optimizer");
      KT_CHECK(
          e->dtype == KT_CKPT_DTYPE_F32, KT_ERR_DTYPE,
          w + ": tensor '" + n.first + "' is " + kt::io::dtype_name(e->dtype) + ", expected F32");
      const std::vector<int64_t> want = shape_of(p.param);
      KT_CHECK(
          e->shape == want, KT_ERR_SHAPE,
          w + ": tensor '" + n.first + "' has shape " + kt::shape_string(p.param) +
              " in this optimizer but another in the file (saved from another layer or shape)");
      copies.push_back({n.second, file.tensor_data(*e), static_cast<size_t>(p.numel) * sizeof(float),
                        n.master ? &p : nullptr});
    }
  }
  KT_CHECK(file.header().tensors.size() == expected, KT_ERR_INVALID_ARGUMENT,
           w + ": holds " + std::to_string(file.header().tensors.size()) +
               " tensors, this optimizer has " + std::to_string(expected) +
               ": it was saved from another optimizer");

  // Checked: nothing below fails.
  for (const Copy& c : copies) {
    if (c.bytes) std::memcpy(c.dst, c.src, c.bytes);
    if (c.param && c.param->bf16_copy)
      for (int64_t i = 0; i < c.param->numel; ++i) c.param->bf16_copy[i] = kt::f32_to_bf16(c.dst[i]);
  }
  opt = saved.options;
  step = saved.step;
  momentum_started = saved.momentum_started;
  layer_params_changed();
}

// ------------------------------------------------------------ creation

namespace kt {
namespace optim {

bool is_compact(const View& v) {
  int64_t expect = 1;
  for (int d = v.ndim - 1; d >= 0; --d) {
    if (v.shape[d] != 1 && v.strides[d] != expect) return false;
    expect *= v.shape[d];
  }
  return true;
}

namespace {

View check_any_rank(const DLTensor* t, const char* name, std::initializer_list<DType> dtypes, const char* where) {
  KT_CHECK(t != nullptr, KT_ERR_NULL_POINTER, std::string(where) + ": " + name + " is NULL");
  KT_CHECK(t->ndim >= 0 && t->ndim <= kMaxRank, KT_ERR_SHAPE,
           std::string(where) + ": " + name + " has rank " + std::to_string(t->ndim) +
               "; at most " + std::to_string(kMaxRank) + " is supported");
  switch (t->ndim) {
    case 0: return check_tensor(t, {name, dtypes, {}}, where);
    case 1: return check_tensor(t, {name, dtypes, {-1}}, where);
    case 2: return check_tensor(t, {name, dtypes, {-1, -1}}, where);
    case 3: return check_tensor(t, {name, dtypes, {-1, -1, -1}}, where);
    default: return check_tensor(t, {name, dtypes, {-1, -1, -1, -1}}, where);
  }
}

const UpdateKernels& kernels_for_engine(const kt_engine* engine, const char* where) {
  // The engine's kernel table, or without one the table an engine would
  // take (the same bits either way).
  return *(engine ? engine->kernels : &select_kernels(effective_isa_cap(KT_ISA_AUTO, where)))->optimizer;
}

}  // namespace

View check_grad(const DLTensor* grad, const View& param, const std::string& name, const char* where) {
  View g = check_any_rank(grad, name.c_str(), {DType::kF32, DType::kBF16}, where);
  KT_CHECK(g.ndim == param.ndim && std::equal(g.shape, g.shape + g.ndim, param.shape), KT_ERR_SHAPE,
           std::string(where) + ": " + name + " has shape " + shape_string(g) + ", its parameter " +
               shape_string(param));
  KT_CHECK(is_compact(g), KT_ERR_STRIDE,
           std::string(where) + ": " + name + " must be compact row-major");
  return g;
}

kt_optimizer* create_for_tensors(kt_engine* engine, const kt_optimizer_options& o,
                                 const kt_optimizer_param* params, size_t n, const char* where) {
  KT_CHECK(n >= 1, KT_ERR_INVALID_ARGUMENT, std::string(where) + ": num_params is 0");
  KT_CHECK(params != nullptr, KT_ERR_NULL_POINTER, std::string(where) + ": params is NULL");
  std::unique_ptr<kt_optimizer> op(new kt_optimizer);
  op->engine = engine;
  op->opt = o;
  op->kernels = &kernels_for_engine(engine, where);
  op->params.resize(n);
  for (size_t i = 0; i < n; ++i) {
    kt_optimizer::Param& p = op->params[i];
    const std::string pname = "params[" + std::to_string(i) + "].param";
    p.param = check_any_rank(params[i].param, pname.c_str(), {DType::kF32}, where);
    KT_CHECK(is_compact(p.param), KT_ERR_STRIDE,
             std::string(where) + ": " + pname + " must be compact row-major");
    p.grad = check_grad(params[i].grad, p.param, "params[" + std::to_string(i) + "].grad", where);
    p.name = "param." + std::to_string(i);
    p.numel = p.param.numel();
    p.master = reinterpret_cast<float*>(p.param.data);
  }
  // kt writes every param: none may share memory with another tensor.
  for (size_t i = 0; i < n; ++i) {
    const std::string pi = "params[" + std::to_string(i) + "].param";
    check_disjoint(op->params[i].param, pi.c_str(), op->params[i].grad,
                   ("params[" + std::to_string(i) + "].grad").c_str(), where);
    for (size_t j = i + 1; j < n; ++j) {
      check_disjoint(op->params[i].param, pi.c_str(), op->params[j].param,
                     ("params[" + std::to_string(j) + "].param").c_str(), where);
      check_disjoint(op->params[i].param, pi.c_str(), op->params[j].grad,
                     ("params[" + std::to_string(j) + "].grad").c_str(), where);
      check_disjoint(op->params[j].param, ("params[" + std::to_string(j) + "].param").c_str(),
                     op->params[i].grad, ("params[" + std::to_string(i) + "].grad").c_str(), where);
    }
  }
  op->allocate_state();
  return op.release();
}

kt_optimizer* create_for_layer(kt_moe* moe, const kt_optimizer_options& o, const char* where) {
  const kt_mode mode = moe->options().mode;
  KT_CHECK(
      mode == KT_MODE_LORA || mode == KT_MODE_FULL, KT_ERR_MODE,
      std::string(where) + ": the layer is in KT_MODE_INFERENCE: it has no trainable parameters");
  std::vector<std::pair<int, int>> ids;  // (param, grad)
  if (mode == KT_MODE_LORA) {
    for (int p = 0; p < 3; ++p)
      if ((moe->options().lora_targets >> p) & 1u) {
        ids.emplace_back(KT_ARG_LORA_A_GATE + 2 * p, KT_ARG_GRAD_LORA_A_GATE + 2 * p);
        ids.emplace_back(KT_ARG_LORA_B_GATE + 2 * p, KT_ARG_GRAD_LORA_B_GATE + 2 * p);
      }
  } else {
    for (int p = 0; p < 3; ++p) ids.emplace_back(KT_ARG_W_GATE + p, KT_ARG_GRAD_W_GATE + p);
    if (moe->options().has_bias)
      for (int p = 0; p < 3; ++p) ids.emplace_back(KT_ARG_B_GATE + p, KT_ARG_GRAD_B_GATE + p);
  }
  std::unique_ptr<kt_optimizer> op(new kt_optimizer);
  op->engine = moe->engine();
  op->moe = moe;
  op->layer_mode = true;
  op->opt = o;
  op->kernels = &kernels_for_engine(moe->engine(), where);
  for (const auto& id : ids) {
    const char* pname = arg_name(id.first);
    const View* pv = moe->bound_view(id.first);
    KT_CHECK(pv != nullptr, KT_ERR_NOT_BOUND, std::string(where) + ": " + pname + " is not bound");
    KT_CHECK(pv->dtype == DType::kF32 || pv->dtype == DType::kBF16, KT_ERR_DTYPE,
             std::string(where) + ": " + pname + " is " + dtype_name(pv->dtype) +
                 "; the optimizer updates fp32 or bf16 parameters");
    KT_CHECK(is_compact(*pv), KT_ERR_STRIDE,
             std::string(where) + ": " + pname + " must be compact row-major");
    const View* gv = moe->bound_view(id.second);
    KT_CHECK(gv != nullptr, KT_ERR_NOT_BOUND,
             std::string(where) + ": " + arg_name(id.second) + " is not bound");
    KT_CHECK(is_compact(*gv), KT_ERR_STRIDE,
             std::string(where) + ": " + arg_name(id.second) + " must be compact row-major");
    op->params.emplace_back();
    kt_optimizer::Param& p = op->params.back();
    p.name = std::string(pname).substr(7);  // without "KT_ARG_"
    p.param_id = id.first;
    p.grad_id = id.second;
    p.param = *pv;
    p.grad = *gv;
    p.numel = pv->numel();
    if (mode == KT_MODE_FULL) {
      p.is_bias = id.first >= KT_ARG_B_GATE;
      p.proj = id.first - (p.is_bias ? KT_ARG_B_GATE : KT_ARG_W_GATE);
      p.rows = pv->shape[1];
      p.cols = p.is_bias ? 1 : pv->shape[2];
    }
    if (pv->dtype == DType::kF32) {
      p.master = reinterpret_cast<float*>(pv->data);
    } else {
      p.own_master.resize(static_cast<size_t>(p.numel));
      p.master = p.own_master.data();
      p.bf16_copy = reinterpret_cast<uint16_t*>(pv->data);
      for (int64_t i = 0; i < p.numel; ++i) p.master[i] = bf16_to_f32(p.bf16_copy[i]);
    }
  }
  op->allocate_state();
  return op.release();
}

}  // namespace optim
}  // namespace kt
