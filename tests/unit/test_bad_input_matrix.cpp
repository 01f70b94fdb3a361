// The bad-input matrix: every ABI function against NULL, dtype, shape, stride
// (0, negative, overlapping), device, size overflow, out-of-range enum, wrong
// state and destroyed handle. Cases are generated from tables; each one is a
// test of its own that asserts
//   - the exact status,
//   - a message that starts with the call's name and names the argument,
//   - that everything still works afterwards: a forward and a backward on the
//     layer match the reference, and (where the case used one) a checkpoint
//     read gives back the weights it holds.
// Destroyed-handle cases run too: handles are looked up in kt's table, never
// dereferenced (src/runtime/handles.h).
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <type_traits>

#include "harness.h"
#include "raw_enum_calls.h"
#include "tolerances.h"

namespace kt_test {
namespace {

constexpr int64_t kHuge = int64_t{1} << 62;

// Writes an integer into an enum-typed field without forming an
// out-of-range enum value in C++ (the library must read it as an integer).
template <class E>
void set_raw(E& field, int64_t value) {
  typename std::underlying_type<E>::type u = static_cast<typename std::underlying_type<E>::type>(value);
  std::memcpy(&field, &u, sizeof(u));
}

enum class Layer { kLora, kFull };

// One case's world: an engine and a layer with loaded weights (LoRA mode
// with every projection targeted, or full mode with weights and gradients
// bound), its inputs, and on demand a checkpoint of the same weights.
class World {
 public:
  explicit World(Layer layer) : layer_(layer) {
    Case c;
    c.name = "matrix";
    c.E = 4; c.K = 2; c.H = 32; c.I = 24; c.T = 6;
    c.mode = layer == Layer::kLora ? KT_MODE_LORA : KT_MODE_FULL;
    c.rank = 4;
    run_ = std::make_unique<Runner>(c, KT_ISA_AUTO);
    kt_engine_info info;
    info.struct_size = sizeof(info);
    EXPECT_EQ(kt_engine_get_info(run_->engine(), &info), KT_OK);
    tol_ = tolerance_for(info.isa, false);
    if (layer == Layer::kFull) {
      kt_arg w[] = {{KT_ARG_W_GATE, r().W_[0]->dl()}, {KT_ARG_W_UP, r().W_[1]->dl()},
                    {KT_ARG_W_DOWN, r().W_[2]->dl()}};
      EXPECT_EQ(kt_moe_bind(moe(), w, 3), KT_OK) << kt_last_error();
    }
  }
  ~World() {
    // Optimizers and distributed layers before the layer and the engine they use.
    kt_dist_moe_destroy(dist_);
    kt_comm_destroy(comm_);
    kt_optimizer_destroy(host_opt_);
    kt_optimizer_destroy(layer_opt_);
    kt_ckpt_close(ckpt_);
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  Runner& r() { return *run_; }
  kt_moe* moe() { return run_->moe(); }
  kt_engine* engine() { return run_->engine(); }
  Layer layer() const { return layer_; }

  // A scratch directory, removed with the world.
  const std::string& dir() {
    if (dir_.empty()) {
      const char* tmp = std::getenv("TMPDIR");
      std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/kt_bad_input_XXXXXX";
      std::vector<char> buf(pattern.begin(), pattern.end());
      buf.push_back('\0');
      EXPECT_NE(mkdtemp(buf.data()), nullptr);
      dir_ = buf.data();
    }
    return dir_;
  }
  // Tensors a case needs alive until it ends, made once per name.
  Tensor* named(const std::string& name, DLDataType dt, std::vector<int64_t> shape) {
    auto& t = named_[name];
    if (!t) t = Tensor::make(dt, std::move(shape));
    return t.get();
  }
  // Expert 0's slice of a stacked [E, ...] tensor, as a tensor of its own.
  const DLTensor* slice0(const DLTensor& stacked) {
    slices_.emplace_back(new DLTensor(stacked));
    DLTensor* t = slices_.back().get();
    t->ndim = stacked.ndim - 1;
    t->shape = stacked.shape + 1;
    t->strides = nullptr;
    return t;
  }
  // Weights args of the layer, for writers.
  std::vector<kt_arg> weight_args() {
    return {{KT_ARG_W_GATE, r().W_[0]->dl()}, {KT_ARG_W_UP, r().W_[1]->dl()}, {KT_ARG_W_DOWN, r().W_[2]->dl()}};
  }
  // The layer's weights as checkpoint layer 3 in dir()/ckpt, opened.
  kt_ckpt* ckpt() {
    if (!ckpt_) {
      const std::string path = dir() + "/ckpt";
      std::vector<kt_arg> a = weight_args();
      kt_ckpt_layer_args layer{3, a.data(), a.size()};
      EXPECT_EQ(kt_ckpt_write_experts(path.c_str(), nullptr, &layer, 1), KT_OK) << kt_last_error();
      EXPECT_EQ(kt_ckpt_open(path.c_str(), &ckpt_), KT_OK) << kt_last_error();
    }
    return ckpt_;
  }
  // An AdamW over two host fp32 parameters [3,5] and [7], on the engine.
  kt_optimizer* host_opt() {
    if (!host_opt_) {
      const std::vector<std::vector<int64_t>> shapes{{3, 5}, {7}};
      for (const auto& shape : shapes) {
        opt_params_.push_back(Tensor::make(kF32, shape));
        opt_grads_.push_back(Tensor::make(kF32, shape));
        for (int64_t i = 0; i < opt_params_.back()->numel(); ++i) {
          opt_params_.back()->set(i, 0.1 * static_cast<double>(i + 1));
          opt_grads_.back()->set(i, 0.01 * static_cast<double>(i % 3) - 0.01);
        }
      }
      kt_optimizer_param pairs[2] = {{opt_params_[0]->dl(), opt_grads_[0]->dl()}, {opt_params_[1]->dl(), opt_grads_[1]->dl()}};
      EXPECT_EQ(kt_optimizer_create(engine(), nullptr, pairs, 2, &host_opt_), KT_OK) << kt_last_error();
    }
    return host_opt_;
  }
  DLTensor* host_param(int i) {
    host_opt();
    return opt_params_[static_cast<size_t>(i)]->dl();
  }
  DLTensor* host_grad(int i) {
    host_opt();
    return opt_grads_[static_cast<size_t>(i)]->dl();
  }
  // An AdamW over the layer's trainable parameters.
  kt_optimizer* layer_opt() {
    if (!layer_opt_) {
      EXPECT_EQ(kt_optimizer_create_for_layer(moe(), nullptr, &layer_opt_), KT_OK) << kt_last_error();
    }
    return layer_opt_;
  }
  // A state file of the host optimizer, saved before any step.
  std::string host_state() {
    const std::string path = dir() + "/host_state.safetensors";
    if (!std::filesystem::exists(path)) {
      EXPECT_EQ(kt_optimizer_save(host_opt(), path.c_str()), KT_OK) << kt_last_error();
    }
    return path;
  }

  // An adapter of the LoRA factors in dir()/adapter.
  std::string adapter() {
    const std::string path = dir() + "/adapter";
    if (!adapter_written_) {
      std::vector<kt_arg> a = lora_args();
      kt_ckpt_layer_args layer{3, a.data(), a.size()};
      kt_ckpt_adapter_config c;
      kt_ckpt_adapter_config_init(&c);
      c.rank = 4;
      EXPECT_EQ(kt_ckpt_adapter_write(path.c_str(), &c, &layer, 1), KT_OK) << kt_last_error();
      adapter_written_ = true;
    }
    return path;
  }
  std::vector<kt_arg> lora_args() {
    std::vector<kt_arg> a;
    for (int p = 0; p < 3; ++p) {
      a.push_back({KT_ARG_LORA_A_GATE + 2 * p, r().la_[p]->dl()});
      a.push_back({KT_ARG_LORA_B_GATE + 2 * p, r().lb_[p]->dl()});
    }
    return a;
  }

  // A forward and an overwriting backward, so the outputs and gradient
  // buffers hold what good calls write (a case's own set-up calls then
  // rewrite the same bytes) before the caller's tensors are snapshot.
  void prime() {
    kt_context* ctx = nullptr;
    ASSERT_EQ(r().forward(&ctx), KT_OK) << kt_last_error();
    ASSERT_EQ(r().backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
    kt_context_release(ctx);
  }

  // A communicator of one rank (Gloo's file store in dir()); null in a
  // build without Gloo (the cases that need it are skipped, saying so).
  kt_comm* comm() {
    if (!comm_ && have_gloo()) {
      kt_comm_options o;
      kt_comm_options_init(&o);
      o.world_size = 1;
      const std::string store = dir() + "/store";
      std::filesystem::create_directories(store);
      o.store_path = store.c_str();
      EXPECT_EQ(kt_comm_create(&o, &comm_), KT_OK) << kt_last_error();
    }
    return comm_;
  }
  static bool have_gloo() { return std::strstr(kt_build_info(), "gloo") != nullptr; }
  // An owner-mode distributed layer of the world's shapes on comm().
  kt_dist_moe* dist() {
    if (!dist_ && comm()) {
      kt_moe_options o;
      kt_moe_options_init(&o);
      o.num_experts = 4; o.top_k = 2; o.hidden = 32; o.intermediate = 24; o.max_tokens = 6;
      EXPECT_EQ(kt_dist_moe_create(comm(), engine(), &o, nullptr, &dist_), KT_OK) << kt_last_error();
    }
    return dist_;
  }

  // A forward that saves a context (for backward cases).
  kt_context* saved_forward() {
    kt_context* ctx = nullptr;
    EXPECT_EQ(r().forward(&ctx), KT_OK) << kt_last_error();
    return ctx;
  }

  // Everything still works: forward + backward match the reference, and a
  // checkpoint the case used still reads back the weights it holds.
  void expect_still_works() {
    kt_context* ctx = nullptr;
    ASSERT_EQ(r().forward(&ctx), KT_OK) << kt_last_error();
    EXPECT_LE(rel_l2(r().y(), r().ref_forward()), tol_.forward);
    ASSERT_EQ(r().backward(ctx, 1.f, KT_GRAD_OVERWRITE), KT_OK) << kt_last_error();
    kt_context_release(ctx);
    kt::reference::Grads g = r().ref_backward();
    EXPECT_LE(rel_l2(r().dx(), g.dx), tol_.dx);
    EXPECT_LE(rel_l2(r().dw(), g.dw), tol_.droute);
    for (int p = 0; p < 3; ++p) {
      if (layer_ == Layer::kLora) {
        EXPECT_LE(rel_l2(r().grad_lora(p, false), g.dla[p]), tol_.lora) << "projection " << p;
        EXPECT_LE(rel_l2(r().grad_lora(p, true), g.dlb[p]), tol_.lora) << "projection " << p;
      } else {
        EXPECT_LE(rel_l2(r().grad_full(p, false), g.dW[p]), tol_.full) << "projection " << p;
      }
    }
    // A refused optimizer call changed nothing: no step was made, the
    // parameters are as created, and the next step works.
    if (host_opt_) {
      int64_t step = -1;
      ASSERT_EQ(kt_optimizer_get_step(host_opt_, &step), KT_OK);
      EXPECT_EQ(step, 0);
      for (int64_t i = 0; i < opt_params_[0]->numel(); ++i)
        ASSERT_EQ(opt_params_[0]->get(i), static_cast<double>(static_cast<float>(0.1 * static_cast<double>(i + 1))));
      ASSERT_EQ(kt_optimizer_step(host_opt_, nullptr), KT_OK) << kt_last_error();
      EXPECT_NE(opt_params_[0]->get(0), static_cast<double>(0.1f));
    }
    if (layer_opt_) {
      int64_t step = -1;
      ASSERT_EQ(kt_optimizer_get_step(layer_opt_, &step), KT_OK);
      EXPECT_EQ(step, 0);
      ASSERT_EQ(kt_optimizer_step(layer_opt_, nullptr), KT_OK) << kt_last_error();
    }
    if (ckpt_) {
      TensorPtr back = Tensor::make(kF32, {4, 24, 32});
      kt_arg a[] = {{KT_ARG_W_GATE, back->dl()}};
      ASSERT_EQ(kt_ckpt_read_layer(ckpt_, 3, a, 1), KT_OK) << kt_last_error();
      EXPECT_EQ(back->values(), r().W_[0]->values());
    }
  }

 private:
  Layer layer_;
  std::unique_ptr<Runner> run_;
  Tolerance tol_{};
  std::string dir_;
  kt_ckpt* ckpt_ = nullptr;
  kt_optimizer* host_opt_ = nullptr;
  kt_optimizer* layer_opt_ = nullptr;
  kt_comm* comm_ = nullptr;
  kt_dist_moe* dist_ = nullptr;
  std::vector<TensorPtr> opt_params_, opt_grads_;
  bool adapter_written_ = false;
  std::map<std::string, TensorPtr> named_;
  std::vector<std::unique_ptr<DLTensor>> slices_;
};

struct BadCase {
  std::string name;  // call/argument/what
  Layer layer;
  kt_status status;
  std::string call;    // the message starts with "<call>:"
  std::string needle;  // and contains this (the argument)
  std::function<kt_status(World&)> run;
  bool needs_gloo = false;  // runs on World::comm()
};

std::ostream& operator<<(std::ostream& o, const BadCase& c) { return o << c.name; }

// ------------------------------------------------------------ tensor arguments

// How a good tensor is spoiled.
enum class Spoil {
  kNull, kDtypeUnknown, kDtypeWrong, kLanes, kRank, kExtent, kNegativeExtent, kNullShape,
  kNullData, kDevice, kStrideNegative, kInnerStrideZero, kRowStrideZero, kOverflowShape,
  kOverflowStride, kOffsetWraps, kOverlap
};

struct SpoilInfo {
  Spoil spoil;
  const char* word;
  kt_status status;
};

const SpoilInfo kSpoils[] = {
    {Spoil::kNull, "null", KT_ERR_NULL_POINTER},
    {Spoil::kDtypeUnknown, "dtype_unknown", KT_ERR_DTYPE},
    {Spoil::kDtypeWrong, "dtype_wrong", KT_ERR_DTYPE},
    {Spoil::kLanes, "dtype_lanes", KT_ERR_DTYPE},
    {Spoil::kRank, "shape_rank", KT_ERR_SHAPE},
    {Spoil::kExtent, "shape_extent", KT_ERR_SHAPE},
    {Spoil::kNegativeExtent, "shape_negative", KT_ERR_SHAPE},
    {Spoil::kNullShape, "shape_null", KT_ERR_NULL_POINTER},
    {Spoil::kNullData, "data_null", KT_ERR_NULL_POINTER},
    {Spoil::kDevice, "device_cuda", KT_ERR_DEVICE},
    {Spoil::kStrideNegative, "stride_negative", KT_ERR_STRIDE},
    {Spoil::kInnerStrideZero, "stride_inner_zero", KT_ERR_STRIDE},
    {Spoil::kRowStrideZero, "stride_rows_zero", KT_ERR_STRIDE},
    {Spoil::kOverflowShape, "overflow_shape", KT_ERR_SHAPE},
    {Spoil::kOverflowStride, "overflow_stride", KT_ERR_STRIDE},
    {Spoil::kOffsetWraps, "overflow_byte_offset", KT_ERR_STRIDE},
    {Spoil::kOverlap, "overlap", KT_ERR_INVALID_ARGUMENT},
};

// A spoiled copy of a tensor, with its own shape and stride storage.
struct Spoiled {
  DLTensor t{};
  int64_t shape[6] = {};
  int64_t strides[6] = {};
  const DLTensor* ptr = nullptr;

  Spoiled(const DLTensor& good, Spoil s, bool integer_arg, void* overlap_target) {
    t = good;
    for (int i = 0; i < good.ndim; ++i) {
      shape[i] = good.shape[i];
      strides[i] = 1;
    }
    for (int i = good.ndim - 2; i >= 0; --i) strides[i] = strides[i + 1] * shape[i + 1];
    t.shape = shape;
    t.strides = strides;
    ptr = &t;
    const int last = good.ndim - 1;
    switch (s) {
      case Spoil::kNull: ptr = nullptr; break;
      case Spoil::kDtypeUnknown: t.dtype = DLDataType{kDLComplex, 64, 1}; break;
      case Spoil::kDtypeWrong: t.dtype = integer_arg ? kF16 : kI32; break;
      case Spoil::kLanes: t.dtype.lanes = 2; break;
      case Spoil::kRank:
        shape[good.ndim] = 1;
        strides[good.ndim] = 1;
        t.ndim = good.ndim + 1;
        break;
      case Spoil::kExtent: shape[last] += 1; break;
      case Spoil::kNegativeExtent: shape[0] = -1; break;
      case Spoil::kNullShape: t.shape = nullptr; break;
      case Spoil::kNullData: t.data = nullptr; break;
      case Spoil::kDevice: t.device = DLDevice{kDLCUDA, 0}; break;
      case Spoil::kStrideNegative: strides[0] = -strides[0]; break;
      case Spoil::kInnerStrideZero: strides[last] = 0; break;
      case Spoil::kRowStrideZero: strides[last - 1] = 0; break;
      case Spoil::kOverflowShape: shape[0] = kHuge; break;
      case Spoil::kOverflowStride: strides[0] = kHuge; break;
      case Spoil::kOffsetWraps: t.byte_offset = ~uint64_t{0} - 8; break;
      case Spoil::kOverlap: t.data = overlap_target; break;
    }
  }
};

// One tensor argument of one call.
struct TensorArg {
  const char* call;
  int id;
  const char* name;
  Layer layer;
  bool output;        // written by the call: stride 0 and overlaps are refused
  bool inner_unit;    // needs unit inner stride (stride-0 inner refused even as input)
  bool integer_arg;   // ids, maps, masks
  bool rank1;         // [n]: no row stride
  // The good tensor, and memory of another argument the output may not share.
  std::function<const DLTensor*(World&)> good;
  std::function<void*(World&)> overlap_target;
  // Runs the call with `t` in place of the argument.
  std::function<kt_status(World&, const DLTensor* t)> invoke;
};

kt_arg with(kt_arg a, int id, const DLTensor* t) {
  if (a.id == id) a.tensor = t;
  return a;
}

kt_status forward_with(World& w, int id, const DLTensor* t, bool submit) {
  Runner& r = w.r();
  kt_arg args[] = {with({KT_ARG_X, r.x_->dl()}, id, t), with({KT_ARG_IDS, r.ids_->dl()}, id, t),
                   with({KT_ARG_ROUTE_WEIGHTS, r.w_->dl()}, id, t), with({KT_ARG_Y, r.y_->dl()}, id, t)};
  if (!submit) return kt_moe_forward(w.moe(), args, 4, nullptr);
  kt_job* job = nullptr;
  const kt_status st = kt_moe_forward_submit(w.moe(), args, 4, nullptr, 0, &job);
  if (st == KT_OK) {
    EXPECT_EQ(kt_job_wait(job), KT_OK) << kt_last_error();
  }
  kt_job_destroy(job);
  return st;
}

kt_status backward_with(World& w, int id, const DLTensor* t, bool submit) {
  Runner& r = w.r();
  kt_context* ctx = w.saved_forward();
  kt_arg args[] = {with({KT_ARG_DY, r.dy_->dl()}, id, t), with({KT_ARG_DX, r.dx_->dl()}, id, t),
                   with({KT_ARG_DROUTE_WEIGHTS, r.dw_->dl()}, id, t)};
  kt_status st;
  if (!submit) {
    st = kt_moe_backward(w.moe(), ctx, nullptr, args, 3);
  } else {
    kt_job* job = nullptr;
    st = kt_moe_backward_submit(w.moe(), ctx, nullptr, args, 3, 0, &job);
    if (st == KT_OK) {
    EXPECT_EQ(kt_job_wait(job), KT_OK) << kt_last_error();
  }
    kt_job_destroy(job);
  }
  kt_context_release(ctx);
  return st;
}

std::vector<TensorArg> tensor_args() {
  std::vector<TensorArg> v;
  const bool in = false, out = true;
  for (bool submit : {false, true}) {
    const char* fcall = submit ? "kt_moe_forward_submit" : "kt_moe_forward";
    auto fwd = [submit](World& w, int id, const DLTensor* t) { return forward_with(w, id, t, submit); };
    auto finv = [fwd](int id) {
      return [fwd, id](World& w, const DLTensor* t) { return fwd(w, id, t); };
    };
    v.push_back({fcall, KT_ARG_X, "KT_ARG_X", Layer::kLora, in, true, false, false,
                 [](World& w) { return w.r().x_->dl(); }, nullptr, finv(KT_ARG_X)});
    v.push_back({fcall, KT_ARG_IDS, "KT_ARG_IDS", Layer::kLora, in, false, true, false,
                 [](World& w) { return w.r().ids_->dl(); }, nullptr, finv(KT_ARG_IDS)});
    v.push_back({fcall, KT_ARG_ROUTE_WEIGHTS, "KT_ARG_ROUTE_WEIGHTS", Layer::kLora, in, false, false, false,
                 [](World& w) { return w.r().w_->dl(); }, nullptr, finv(KT_ARG_ROUTE_WEIGHTS)});
    v.push_back({fcall, KT_ARG_Y, "KT_ARG_Y", Layer::kLora, out, true, false, false,
                 [](World& w) { return w.r().y_->dl(); }, [](World& w) -> void* { return w.r().x_->dl()->data; },
                 finv(KT_ARG_Y)});

    const char* bcall = submit ? "kt_moe_backward_submit" : "kt_moe_backward";
    auto binv = [submit](int id) {
      return [submit, id](World& w, const DLTensor* t) { return backward_with(w, id, t, submit); };
    };
    v.push_back({bcall, KT_ARG_DY, "KT_ARG_DY", Layer::kLora, in, true, false, false,
                 [](World& w) { return w.r().dy_->dl(); }, nullptr, binv(KT_ARG_DY)});
    v.push_back({bcall, KT_ARG_DX, "KT_ARG_DX", Layer::kLora, out, true, false, false,
                 [](World& w) { return w.r().dx_->dl(); }, [](World& w) -> void* { return w.r().dy_->dl()->data; },
                 binv(KT_ARG_DX)});
    v.push_back({bcall, KT_ARG_DROUTE_WEIGHTS, "KT_ARG_DROUTE_WEIGHTS", Layer::kLora, out, false, false, false,
                 [](World& w) { return w.r().dw_->dl(); },
                 [](World& w) -> void* { return w.r().dx_->dl()->data; }, binv(KT_ARG_DROUTE_WEIGHTS)});
  }
  // Loading: stacked and per expert.
  for (int p = 0; p < 3; ++p) {
    static const int kIds[3] = {KT_ARG_W_GATE, KT_ARG_W_UP, KT_ARG_W_DOWN};
    static const char* kNames[3] = {"KT_ARG_W_GATE", "KT_ARG_W_UP", "KT_ARG_W_DOWN"};
    const int id = kIds[p];
    v.push_back({"kt_moe_load_weights", id, kNames[p], Layer::kLora, in, false, false, false,
                 [p](World& w) { return w.r().W_[p]->dl(); }, nullptr,
                 [id](World& w, const DLTensor* t) {
                   std::vector<kt_arg> a = w.weight_args();
                   for (auto& x : a) x = with(x, id, t);
                   return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
                 }});
  }
  // Per expert: expert 0's slices (loading them again changes nothing).
  v.push_back({"kt_moe_load_expert", KT_ARG_W_DOWN, "KT_ARG_W_DOWN", Layer::kLora, in, false, false, false,
               [](World& w) { return w.slice0(*w.r().W_[2]->dl()); }, nullptr,
               [](World& w, const DLTensor* t) {
                 kt_arg a[] = {{KT_ARG_W_GATE, w.slice0(*w.r().W_[0]->dl())},
                               {KT_ARG_W_UP, w.slice0(*w.r().W_[1]->dl())}, {KT_ARG_W_DOWN, t}};
                 return kt_moe_load_expert(w.moe(), 0, nullptr, a, 3);
               }});
  v.push_back({"kt_moe_load_weights", KT_ARG_EXPERT_MAP, "KT_ARG_EXPERT_MAP", Layer::kLora, in, false, true, true,
               [](World& w) {
                 Tensor* map = w.named("map", kI64, {4});
                 for (int i = 0; i < 4; ++i) map->set(i, i);
                 return map->dl();
               },
               nullptr,
               [](World& w, const DLTensor* t) {
                 std::vector<kt_arg> a = w.weight_args();
                 a.push_back({KT_ARG_EXPERT_MAP, t});
                 return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
               }});
  v.push_back({"kt_moe_set_skipped", 0, "mask", Layer::kLora, in, false, true, true,
               [](World& w) { return w.named("mask", kU8, {4})->dl(); },
               nullptr, [](World& w, const DLTensor* t) { return kt_moe_set_skipped(w.moe(), t); }});

  // Binding: parameters are read, gradient buffers written.
  auto bind1 = [](int id) {
    return [id](World& w, const DLTensor* t) {
      kt_arg a[] = {{id, t}};
      return kt_moe_bind(w.moe(), a, 1);
    };
  };
  v.push_back({"kt_moe_bind", KT_ARG_LORA_A_GATE, "KT_ARG_LORA_A_GATE", Layer::kLora, in, false, false, false,
               [](World& w) { return w.r().la_[0]->dl(); }, nullptr, bind1(KT_ARG_LORA_A_GATE)});
  v.push_back({"kt_moe_bind", KT_ARG_LORA_B_DOWN, "KT_ARG_LORA_B_DOWN", Layer::kLora, in, false, false, false,
               [](World& w) { return w.r().lb_[2]->dl(); }, nullptr, bind1(KT_ARG_LORA_B_DOWN)});
  v.push_back({"kt_moe_bind", KT_ARG_GRAD_LORA_A_GATE, "KT_ARG_GRAD_LORA_A_GATE", Layer::kLora, out, false, false,
               false, [](World& w) { return w.r().gla_[0]->dl(); },
               [](World& w) -> void* { return w.r().la_[0]->dl()->data; }, bind1(KT_ARG_GRAD_LORA_A_GATE)});
  v.push_back({"kt_moe_bind", KT_ARG_GRAD_LORA_B_UP, "KT_ARG_GRAD_LORA_B_UP", Layer::kLora, out, false, false,
               false, [](World& w) { return w.r().glb_[1]->dl(); },
               [](World& w) -> void* { return w.r().glb_[0]->dl()->data; }, bind1(KT_ARG_GRAD_LORA_B_UP)});
  v.push_back({"kt_moe_bind", KT_ARG_W_UP, "KT_ARG_W_UP", Layer::kFull, in, false, false, false,
               [](World& w) { return w.r().W_[1]->dl(); }, nullptr, bind1(KT_ARG_W_UP)});
  v.push_back({"kt_moe_bind", KT_ARG_GRAD_W_GATE, "KT_ARG_GRAD_W_GATE", Layer::kFull, out, false, false, false,
               [](World& w) { return w.r().gW_[0]->dl(); },
               [](World& w) -> void* { return w.r().W_[0]->dl()->data; }, bind1(KT_ARG_GRAD_W_GATE)});
  v.push_back({"kt_moe_bind", KT_ARG_GRAD_W_DOWN, "KT_ARG_GRAD_W_DOWN", Layer::kFull, out, false, false, false,
               [](World& w) { return w.r().gW_[2]->dl(); },
               [](World& w) -> void* { return w.r().gW_[1]->dl()->data; }, bind1(KT_ARG_GRAD_W_DOWN)});

  // Checkpoints: read_layer writes host tensors; the writers read them.
  // The overlap case points W_UP at W_GATE's destination.
  v.push_back({"kt_ckpt_read_layer", KT_ARG_W_UP, "KT_ARG_W_UP", Layer::kLora, out, false, false, false,
               [](World& w) { return w.named("up", kF32, {4, 24, 32})->dl(); },
               [](World& w) -> void* { return w.named("gate", kF32, {4, 24, 32})->dl()->data; },
               [](World& w, const DLTensor* t) {
                 kt_arg a[] = {{KT_ARG_W_GATE, w.named("gate", kF32, {4, 24, 32})->dl()}, {KT_ARG_W_UP, t}};
                 return kt_ckpt_read_layer(w.ckpt(), 3, a, 2);
               }});
  v.push_back({"kt_ckpt_write_experts", KT_ARG_W_DOWN, "KT_ARG_W_DOWN", Layer::kLora, in, false, false, false,
               [](World& w) { return w.r().W_[2]->dl(); }, nullptr,
               [](World& w, const DLTensor* t) {
                 std::vector<kt_arg> a = w.weight_args();
                 for (auto& x : a) x = with(x, KT_ARG_W_DOWN, t);
                 kt_ckpt_layer_args layer{3, a.data(), a.size()};
                 return kt_ckpt_write_experts((w.dir() + "/written").c_str(), nullptr, &layer, 1);
               }});
  v.push_back({"kt_ckpt_adapter_write", KT_ARG_LORA_A_UP, "KT_ARG_LORA_A_UP", Layer::kLora, in, false, false, false,
               [](World& w) { return w.r().la_[1]->dl(); }, nullptr,
               [](World& w, const DLTensor* t) {
                 std::vector<kt_arg> a = w.lora_args();
                 for (auto& x : a) x = with(x, KT_ARG_LORA_A_UP, t);
                 kt_ckpt_layer_args layer{3, a.data(), a.size()};
                 kt_ckpt_adapter_config c;
                 kt_ckpt_adapter_config_init(&c);
                 c.rank = 4;
                 return kt_ckpt_adapter_write((w.dir() + "/written_adapter").c_str(), &c, &layer, 1);
               }});
  return v;
}


bool spoil_applies(const TensorArg& a, Spoil s) {
  switch (s) {
    case Spoil::kInnerStrideZero: return a.output || a.inner_unit;  // inputs may broadcast
    case Spoil::kRowStrideZero: return a.output && !a.rank1;
    case Spoil::kOverlap: return a.output && a.overlap_target != nullptr;
    case Spoil::kExtent: return a.id != KT_ARG_EXPERT_MAP;  // any length is a valid map
    default: return true;
  }
}

std::string case_name(std::string s) {
  for (char& c : s)
    if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
  return s;
}

void add_tensor_cases(std::vector<BadCase>* cases) {
  for (const TensorArg& a : tensor_args()) {
    for (const SpoilInfo& si : kSpoils) {
      if (!spoil_applies(a, si.spoil)) continue;
      BadCase c;
      c.name = std::string(a.call) + "/" + a.name + "/" + si.word;
      c.layer = a.layer;
      c.status = si.status;
      c.call = a.call;
      c.needle = a.name;
      c.run = [a, si](World& w) {
        const DLTensor* good = a.good(w);
        Spoiled bad(*good, si.spoil, a.integer_arg, a.overlap_target ? a.overlap_target(w) : nullptr);
        return a.invoke(w, bad.ptr);
      };
      cases->push_back(std::move(c));
    }
  }
}

// ------------------------------------------------------ all other arguments

struct Adder {
  std::vector<BadCase>* cases;
  void operator()(const std::string& what, Layer layer, kt_status status, const std::string& call,
                  const std::string& needle, std::function<kt_status(World&)> run) const {
    cases->push_back(BadCase{call + "/" + what, layer, status, call, needle, std::move(run)});
  }
  // A case on a communicator of one rank (skipped without Gloo).
  void on_comm(const std::string& what, kt_status status, const std::string& call, const std::string& needle,
               std::function<kt_status(World&)> run) const {
    (*this)(what, Layer::kLora, status, call, needle, std::move(run));
    cases->back().needs_gloo = true;
  }
  // A destroyed or released handle: the call must see it is not live.
  void destroyed(const std::string& what, Layer layer, kt_status status, const std::string& call,
                 const std::string& needle, std::function<kt_status(World&)> run) const {
    (*this)(what, layer, status, call, needle, std::move(run));
  }
};

kt_moe_options layer_options(World& w) {
  kt_moe_options o;
  kt_moe_options_init(&o);
  o.num_experts = 4; o.top_k = 2; o.hidden = 32; o.intermediate = 24; o.max_tokens = 6;
  o.mode = w.layer() == Layer::kLora ? KT_MODE_LORA : KT_MODE_FULL;
  o.lora_rank = 4;
  return o;
}

// kt_moe_create with options changed by `change`; a layer made by mistake
// is destroyed.
kt_status create_with(World& w, const std::function<void(kt_moe_options&)>& change) {
  kt_moe_options o = layer_options(w);
  change(o);
  kt_moe* m = nullptr;
  const kt_status st = kt_moe_create(w.engine(), &o, &m);
  kt_moe_destroy(m);
  return st;
}

kt_status engine_with(const std::function<void(kt_engine_options&)>& change) {
  kt_engine_options o;
  kt_engine_options_init(&o);
  o.num_threads = 1;
  change(o);
  kt_engine* e = nullptr;
  const kt_status st = kt_engine_create(&o, &e);
  kt_engine_destroy(e);
  return st;
}

kt_status backward_opts(World& w, const std::function<void(unsigned char*)>& change, size_t size) {
  kt_context* ctx = w.saved_forward();
  std::vector<unsigned char> raw(std::max(size, sizeof(kt_backward_options)) + 64, 0);
  kt_backward_options o;
  kt_backward_options_init(&o);
  o.struct_size = size;
  std::memcpy(raw.data(), &o, sizeof(o));
  change(raw.data());
  kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
  const kt_status st =
      kt_moe_backward(w.moe(), ctx, reinterpret_cast<const kt_backward_options*>(raw.data()), a, 1);
  kt_context_release(ctx);
  return st;
}

kt_status load_opts(World& w, const std::function<void(kt_load_options&)>& change) {
  kt_load_options o;
  kt_load_options_init(&o);
  change(o);
  std::vector<kt_arg> a = w.weight_args();
  return kt_moe_load_weights(w.moe(), &o, a.data(), a.size());
}

kt_status write_opts(World& w, const std::function<void(kt_ckpt_write_options&)>& change) {
  kt_ckpt_write_options o;
  kt_ckpt_write_options_init(&o);
  change(o);
  std::vector<kt_arg> a = w.weight_args();
  kt_ckpt_layer_args layer{3, a.data(), a.size()};
  return kt_ckpt_write_experts((w.dir() + "/written").c_str(), &o, &layer, 1);
}

kt_status adapter_with(World& w, const std::function<void(kt_ckpt_adapter_config&)>& change) {
  kt_ckpt_adapter_config c;
  kt_ckpt_adapter_config_init(&c);
  c.rank = 4;
  change(c);
  std::vector<kt_arg> a = w.lora_args();
  kt_ckpt_layer_args layer{3, a.data(), a.size()};
  return kt_ckpt_adapter_write((w.dir() + "/written_adapter").c_str(), &c, &layer, 1);
}

void add_engine_cases(const Adder& add) {
  const Layer L = Layer::kLora;
  const kt_status INV = KT_ERR_INVALID_ARGUMENT;
  add("engine_null", L, KT_ERR_NULL_POINTER, "kt_engine_create", "engine is NULL",
      [](World&) { return kt_engine_create(nullptr, nullptr); });
  add("struct_size_small", L, INV, "kt_engine_create", "options->struct_size",
      [](World&) { return engine_with([](kt_engine_options& o) { o.struct_size = 4; }); });
  add("struct_size_huge", L, INV, "kt_engine_create", "options->struct_size",
      [](World&) { return engine_with([](kt_engine_options& o) { o.struct_size = size_t{1} << 40; }); });
  add("unknown_fields", L, KT_ERR_UNSUPPORTED, "kt_engine_create", "options sets fields", [](World&) {
    std::vector<unsigned char> raw(sizeof(kt_engine_options) + 16, 0);
    kt_engine_options o;
    kt_engine_options_init(&o);
    o.num_threads = 1;
    o.struct_size = raw.size();
    std::memcpy(raw.data(), &o, sizeof(o));
    raw[sizeof(o) + 3] = 1;
    kt_engine* e = nullptr;
    const kt_status st = kt_engine_create(reinterpret_cast<const kt_engine_options*>(raw.data()), &e);
    kt_engine_destroy(e);
    return st;
  });
  add("num_threads_negative", L, INV, "kt_engine_create", "options->num_threads",
      [](World&) { return engine_with([](kt_engine_options& o) { o.num_threads = -1; }); });
  add("num_threads_huge", L, INV, "kt_engine_create", "options->num_threads",
      [](World&) { return engine_with([](kt_engine_options& o) { o.num_threads = 1 << 20; }); });
  add("pin_threads_2", L, INV, "kt_engine_create", "options->pin_threads",
      [](World&) { return engine_with([](kt_engine_options& o) { o.pin_threads = 2; }); });
  for (int64_t v : {5, 9, 1 << 20, -1}) {
    add("max_isa_enum_" + std::to_string(v < 0 ? 0 : v) + (v < 0 ? "_negative" : ""), L, INV, "kt_engine_create",
        "options->max_isa", [v](World&) { return engine_with([v](kt_engine_options& o) { set_raw(o.max_isa, v); }); });
  }
  add("layers_exist", L, INV, "kt_engine_destroy", "destroy them first",
      [](World& w) { return kt_engine_destroy(w.engine()); });
  add("engine_null", L, KT_ERR_INVALID_HANDLE, "kt_engine_get_info", "engine is NULL", [](World&) {
    kt_engine_info i;
    i.struct_size = sizeof(i);
    return kt_engine_get_info(nullptr, &i);
  });
  add("info_null", L, KT_ERR_NULL_POINTER, "kt_engine_get_info", "info is NULL",
      [](World& w) { return kt_engine_get_info(w.engine(), nullptr); });
  add("struct_size_zero", L, INV, "kt_engine_get_info", "info->struct_size", [](World& w) {
    kt_engine_info i;
    std::memset(&i, 0, sizeof(i));
    return kt_engine_get_info(w.engine(), &i);
  });
  add("engine_null", L, KT_ERR_INVALID_HANDLE, "kt_engine_set_gemm_backend", "engine is NULL",
      [](World&) { return kt_engine_set_gemm_backend(nullptr, KT_GEMM_NATIVE); });
  for (int v : {3, 7, 1000, -1})
    add("backend_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), L, INV,
        "kt_engine_set_gemm_backend", "backend", [v](World& w) { return raw_set_gemm_backend(w.engine(), v); });
  add("layers_exist", L, INV, "kt_engine_set_gemm_backend", "set the backend first",
      [](World& w) { return kt_engine_set_gemm_backend(w.engine(), KT_GEMM_NATIVE); });
  add("engine_null", L, KT_ERR_INVALID_HANDLE, "kt_engine_set_profiling", "engine is NULL",
      [](World&) { return kt_engine_set_profiling(nullptr, 1); });
  add("engine_null", L, KT_ERR_INVALID_HANDLE, "kt_engine_reset_profile", "engine is NULL",
      [](World&) { return kt_engine_reset_profile(nullptr); });
  add("engine_null", L, KT_ERR_INVALID_HANDLE, "kt_engine_profile_stage", "engine is NULL",
      [](World&) { return kt_engine_profile_stage(nullptr, 0, nullptr, nullptr); });
  for (int stage : {-1, KT_STAGE_EXPERTS + 1, 1 << 30})  // one past the last stage
    add("stage_" + std::to_string(stage < 0 ? 1 : stage) + (stage < 0 ? "_negative" : ""), L, INV,
        "kt_engine_profile_stage", "stage",
        [stage](World& w) { return kt_engine_profile_stage(w.engine(), stage, nullptr, nullptr); });
  add("engine_null", L, KT_ERR_INVALID_HANDLE, "kt_engine_profile_kernel", "engine is NULL",
      [](World&) { return kt_engine_profile_kernel(nullptr, 0, 0, nullptr, nullptr); });
  for (int stage : {-1, KT_STAGE_EXPERTS + 1})
    add("stage_" + std::to_string(stage < 0 ? 1 : stage) + (stage < 0 ? "_negative" : ""), L, INV,
        "kt_engine_profile_kernel", "stage", [stage](World& w) {
          return kt_engine_profile_kernel(w.engine(), stage, 0, nullptr, nullptr);
        });
  {
    int kernels = 0;
    while (kt_kernel_name(kernels)) ++kernels;
    for (int kernel : {-1, kernels})  // one past the last kernel
      add("kernel_" + std::to_string(kernel < 0 ? 1 : kernel) + (kernel < 0 ? "_negative" : ""), L,
          INV, "kt_engine_profile_kernel", "kernel", [kernel](World& w) {
            return kt_engine_profile_kernel(w.engine(), 0, kernel, nullptr, nullptr);
          });
  }
  // Destroyed engine: needs handles checked without reading freed memory.
  add.destroyed("engine_destroyed", L, KT_ERR_INVALID_HANDLE, "kt_engine_get_info", "engine", [](World&) {
    kt_engine* e = nullptr;
    kt_engine_options o;
    kt_engine_options_init(&o);
    o.num_threads = 1;
    EXPECT_EQ(kt_engine_create(&o, &e), KT_OK);
    kt_engine_destroy(e);
    kt_engine_info i;
    i.struct_size = sizeof(i);
    return kt_engine_get_info(e, &i);
  });
}

void add_create_cases(const Adder& add) {
  const kt_status INV = KT_ERR_INVALID_ARGUMENT;
  const char* C = "kt_moe_create";
  for (Layer L : {Layer::kLora, Layer::kFull}) {
    const std::string m = L == Layer::kLora ? "lora/" : "full/";
    auto opt = [&](const std::string& what, kt_status st, const std::string& needle,
                   std::function<void(kt_moe_options&)> change) {
      add(m + what, L, st, C, needle, [change](World& w) { return create_with(w, change); });
    };
    opt("num_experts_zero", INV, "options->num_experts", [](kt_moe_options& o) { o.num_experts = 0; });
    opt("num_experts_huge", INV, "options->num_experts", [](kt_moe_options& o) { o.num_experts = kHuge; });
    opt("top_k_above_experts", INV, "options->top_k", [](kt_moe_options& o) { o.top_k = 5; });
    opt("hidden_negative", INV, "options->hidden", [](kt_moe_options& o) { o.hidden = -32; });
    opt("intermediate_huge", INV, "options->intermediate", [](kt_moe_options& o) { o.intermediate = kHuge; });
    opt("max_tokens_zero", INV, "options->max_tokens", [](kt_moe_options& o) { o.max_tokens = 0; });
    opt("max_tokens_huge", INV, "options->max_tokens", [](kt_moe_options& o) { o.max_tokens = kHuge; });
    for (int64_t v : {2, 1000, -1})
      opt("activation_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), INV,
          "options->activation", [v](kt_moe_options& o) { set_raw(o.activation, v); });
    for (int64_t v : {3, 7, -1})
      opt("mode_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), INV, "options->mode",
          [v](kt_moe_options& o) { set_raw(o.mode, v); });
    for (int64_t v : {8, 1000, -1})
      opt("weight_format_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), KT_ERR_UNSUPPORTED,
          "options->weight_format", [v](kt_moe_options& o) { set_raw(o.weight_format, v); });
    for (kt_weight_format f : {KT_FORMAT_INT8_CHANNEL, KT_FORMAT_INT4_G32, KT_FORMAT_FP8_B128, KT_FORMAT_MXFP4,
                               KT_FORMAT_INT4_G128, KT_FORMAT_INT4_G32_ZP, KT_FORMAT_INT4_G128_ZP})
      opt(std::string("full_mode_on_") + kt_weight_format_name(f), KT_ERR_MODE, "frozen quantized base",
          [f](kt_moe_options& o) {
            o.weight_format = f;
            o.mode = KT_MODE_FULL;
          });
    opt("act_alpha_nan", INV, "options->act_alpha", [](kt_moe_options& o) { o.act_alpha = std::nanf(""); });
    opt("act_limit_inf", INV, "options->act_limit", [](kt_moe_options& o) { o.act_limit = INFINITY; });
    opt("has_bias_2", INV, "options->has_bias", [](kt_moe_options& o) { o.has_bias = 2; });
    opt("struct_size_small", INV, "options->struct_size", [](kt_moe_options& o) { o.struct_size = 4; });
    opt("struct_size_huge", INV, "options->struct_size", [](kt_moe_options& o) { o.struct_size = ~size_t{0}; });
    // Huge layers: refused before anything is allocated.
    opt("layer_2e60_elements", INV, "physical memory", [](kt_moe_options& o) {
      o.num_experts = 1 << 20; o.hidden = 1 << 20; o.intermediate = 1 << 20;
    });
    opt("layer_above_memory", INV, "physical memory", [](kt_moe_options& o) {
      o.num_experts = 4096; o.hidden = 8192; o.intermediate = 8192;
    });
    opt("workspace_above_memory", INV, "physical memory", [](kt_moe_options& o) {
      o.hidden = 1 << 20; o.intermediate = 1 << 20; o.max_tokens = 8192;
    });
  }
  const Layer L = Layer::kLora;
  auto lora = [&](const std::string& what, const std::string& needle, std::function<void(kt_moe_options&)> change) {
    add("lora/" + what, L, INV, C, needle, [change](World& w) { return create_with(w, change); });
  };
  lora("lora_rank_zero", "options->lora_rank", [](kt_moe_options& o) { o.lora_rank = 0; });
  lora("lora_rank_1025", "options->lora_rank", [](kt_moe_options& o) { o.lora_rank = 1025; });
  lora("lora_targets_8", "options->lora_targets", [](kt_moe_options& o) { o.lora_targets = 8; });
  lora("lora_targets_none", "options->lora_targets", [](kt_moe_options& o) { o.lora_targets = 0; });
  lora("use_rslora_2", "options->use_rslora", [](kt_moe_options& o) { o.use_rslora = 2; });
  lora("lora_alpha_nan", "options->lora_alpha", [](kt_moe_options& o) { o.lora_alpha = std::nanf(""); });
  add("engine_null", L, KT_ERR_INVALID_HANDLE, C, "engine is NULL", [](World& w) {
    kt_moe_options o = layer_options(w);
    kt_moe* m = nullptr;
    return kt_moe_create(nullptr, &o, &m);
  });
  add("moe_null", L, KT_ERR_NULL_POINTER, C, "moe is NULL", [](World& w) {
    kt_moe_options o = layer_options(w);
    return kt_moe_create(w.engine(), &o, nullptr);
  });
  add("options_null", L, KT_ERR_NULL_POINTER, C, "options is NULL", [](World& w) {
    kt_moe* m = nullptr;
    return kt_moe_create(w.engine(), nullptr, &m);
  });
  add("unknown_fields", L, KT_ERR_UNSUPPORTED, C, "options sets fields", [](World& w) {
    std::vector<unsigned char> raw(sizeof(kt_moe_options) + 8, 0);
    kt_moe_options o = layer_options(w);
    o.struct_size = raw.size();
    std::memcpy(raw.data(), &o, sizeof(o));
    raw.back() = 1;
    kt_moe* m = nullptr;
    const kt_status st = kt_moe_create(w.engine(), reinterpret_cast<const kt_moe_options*>(raw.data()), &m);
    kt_moe_destroy(m);
    return st;
  });
}

void add_layer_cases(const Adder& add) {
  const Layer L = Layer::kLora;
  const kt_status INV = KT_ERR_INVALID_ARGUMENT;
  // Handles and out-pointers of the small calls.
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_lora_scale", "moe is NULL", [](World&) {
    float s = 0;
    return kt_moe_lora_scale(nullptr, &s);
  });
  add("scale_null", L, KT_ERR_NULL_POINTER, "kt_moe_lora_scale", "scale is NULL",
      [](World& w) { return kt_moe_lora_scale(w.moe(), nullptr); });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_num_loaded", "moe is NULL", [](World&) {
    int64_t n = 0;
    return kt_moe_num_loaded(nullptr, &n);
  });
  add("count_null", L, KT_ERR_NULL_POINTER, "kt_moe_num_loaded", "count is NULL",
      [](World& w) { return kt_moe_num_loaded(w.moe(), nullptr); });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_set_skipped", "moe is NULL",
      [](World& w) { return kt_moe_set_skipped(nullptr, w.named("mask", kU8, {4})->dl()); });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_set_grad_hook", "moe is NULL",
      [](World&) { return kt_moe_set_grad_hook(nullptr, nullptr, nullptr); });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_params_changed", "moe is NULL",
      [](World&) { return kt_moe_params_changed(nullptr); });

  // Loading.
  const char* LW = "kt_moe_load_weights";
  add("moe_null", L, KT_ERR_INVALID_HANDLE, LW, "moe is NULL", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    return kt_moe_load_weights(nullptr, nullptr, a.data(), a.size());
  });
  add("args_null", L, KT_ERR_NULL_POINTER, LW, "args is NULL",
      [](World& w) { return kt_moe_load_weights(w.moe(), nullptr, nullptr, 3); });
  add("id_unknown", L, INV, LW, "argument id 1000", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    a[0].id = 1000;
    return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
  });
  add("id_negative", L, INV, LW, "argument id -5", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    a[0].id = -5;
    return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
  });
  add("id_twice", L, INV, LW, "KT_ARG_W_UP given twice", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    a.push_back(a[1]);
    return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
  });
  add("id_of_forward", L, INV, LW, "KT_ARG_X is not an argument", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    a.push_back({KT_ARG_X, w.r().x_->dl()});
    return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
  });
  add("w_down_missing", L, KT_ERR_NULL_POINTER, LW, "KT_ARG_W_DOWN is required", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    return kt_moe_load_weights(w.moe(), nullptr, a.data(), 2);
  });
  add("bias_without_biases", L, INV, LW, "KT_ARG_B_GATE", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    a.push_back({KT_ARG_B_GATE, w.named("bias", kF32, {4, 24})->dl()});
    return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
  });
  for (int64_t v : {2, 77, -1}) {
    const std::string n = std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : "");
    add("orientation_enum_" + n, L, INV, LW, "options->orientation",
        [v](World& w) { return load_opts(w, [v](kt_load_options& o) { set_raw(o.orientation, v); }); });
    add("gate_up_order_enum_" + n, L, INV, LW, "options->gate_up_order",
        [v](World& w) { return load_opts(w, [v](kt_load_options& o) { set_raw(o.gate_up_order, v); }); });
  }
  add("struct_size_small", L, INV, LW, "options->struct_size",
      [](World& w) { return load_opts(w, [](kt_load_options& o) { o.struct_size = 2; }); });
  for (int64_t e : {4, -1, 1000}) {
    add("map_entry_" + std::to_string(e < 0 ? 1 : e) + (e < 0 ? "_negative" : ""), L, KT_ERR_EXPERT_ID, LW,
        "KT_ARG_EXPERT_MAP", [e](World& w) {
          Tensor* map = w.named("map", kI64, {4});
          for (int i = 0; i < 4; ++i) map->set(i, i == 2 ? static_cast<double>(e) : i);
          std::vector<kt_arg> a = w.weight_args();
          a.push_back({KT_ARG_EXPERT_MAP, map->dl()});
          return kt_moe_load_weights(w.moe(), nullptr, a.data(), a.size());
        });
  }
  const char* LE = "kt_moe_load_expert";
  for (int64_t e : {int64_t{4}, int64_t{-1}, kHuge})
    add("expert_" + std::string(e == kHuge ? "huge" : e < 0 ? "negative" : "E"), L, KT_ERR_EXPERT_ID, LE,
        "expert", [e](World& w) {
          kt_arg a[] = {{KT_ARG_W_GATE, w.slice0(*w.r().W_[0]->dl())}, {KT_ARG_W_UP, w.slice0(*w.r().W_[1]->dl())},
                        {KT_ARG_W_DOWN, w.slice0(*w.r().W_[2]->dl())}};
          return kt_moe_load_expert(w.moe(), e, nullptr, a, 3);
        });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, LE, "moe is NULL",
      [](World&) { return kt_moe_load_expert(nullptr, 0, nullptr, nullptr, 0); });

  // Binding.
  const char* B = "kt_moe_bind";
  add("moe_null", L, KT_ERR_INVALID_HANDLE, B, "moe is NULL", [](World& w) {
    kt_arg a[] = {{KT_ARG_LORA_A_GATE, w.r().la_[0]->dl()}};
    return kt_moe_bind(nullptr, a, 1);
  });
  add("args_null", L, KT_ERR_NULL_POINTER, B, "args is NULL", [](World& w) { return kt_moe_bind(w.moe(), nullptr, 2); });
  add("id_of_forward", L, INV, B, "KT_ARG_X cannot be bound", [](World& w) {
    kt_arg a[] = {{KT_ARG_X, w.r().x_->dl()}};
    return kt_moe_bind(w.moe(), a, 1);
  });
  add("id_unknown", L, INV, B, "argument id 70", [](World& w) {
    kt_arg a[] = {{70, w.r().la_[0]->dl()}};
    return kt_moe_bind(w.moe(), a, 1);
  });
  add("id_huge", L, INV, B, "argument id 100000", [](World& w) {
    kt_arg a[] = {{100000, w.r().la_[0]->dl()}};
    return kt_moe_bind(w.moe(), a, 1);
  });
  add("id_twice", L, INV, B, "given twice", [](World& w) {
    kt_arg a[] = {{KT_ARG_LORA_A_GATE, w.r().la_[0]->dl()}, {KT_ARG_LORA_A_GATE, w.r().la_[0]->dl()}};
    return kt_moe_bind(w.moe(), a, 2);
  });
  add("full_id_in_lora_mode", L, KT_ERR_MODE, B, "KT_ARG_GRAD_W_GATE", [](World& w) {
    kt_arg a[] = {{KT_ARG_GRAD_W_GATE, w.named("gw", kF32, {4, 24, 32})->dl()}};
    return kt_moe_bind(w.moe(), a, 1);
  });
  add("lora_id_in_full_mode", Layer::kFull, KT_ERR_MODE, B, "KT_ARG_LORA_A_GATE", [](World& w) {
    kt_arg a[] = {{KT_ARG_LORA_A_GATE, w.named("la", kF32, {4, 4, 32})->dl()}};
    return kt_moe_bind(w.moe(), a, 1);
  });
  add("grad_into_own_parameter", L, KT_ERR_INVALID_ARGUMENT, B, "KT_ARG_GRAD_LORA_B_GATE", [](World& w) {
    kt_arg a[] = {{KT_ARG_GRAD_LORA_B_GATE, w.r().lb_[0]->dl()}};
    return kt_moe_bind(w.moe(), a, 1);
  });
  add("grad_into_own_parameter_in_one_call", L, INV, B, "KT_ARG_GRAD_LORA_B_GATE", [](World& w) {
    kt_arg a[] = {{KT_ARG_LORA_B_GATE, w.r().lb_[0]->dl()}, {KT_ARG_GRAD_LORA_B_GATE, w.r().lb_[0]->dl()}};
    return kt_moe_bind(w.moe(), a, 2);
  });
  add("two_grads_one_buffer", L, INV, B, "KT_ARG_GRAD_LORA_A_UP", [](World& w) {
    Tensor* g = w.named("g", kF32, {4, 4, 32});
    kt_arg a[] = {{KT_ARG_GRAD_LORA_A_UP, g->dl()}, {KT_ARG_GRAD_LORA_A_GATE, g->dl()}};
    return kt_moe_bind(w.moe(), a, 2);
  });
  add("grad_bias_without_biases", Layer::kFull, INV, B, "KT_ARG_GRAD_B_GATE", [](World& w) {
    kt_arg a[] = {{KT_ARG_GRAD_B_GATE, w.named("gb", kF32, {4, 24})->dl()}};
    return kt_moe_bind(w.moe(), a, 1);
  });
  // Wrong state: full mode repacks from bound weights; a fresh layer has none.
  add("weights_not_bound", Layer::kFull, KT_ERR_NOT_BOUND, "kt_moe_params_changed", "KT_ARG_W_GATE is not bound",
      [](World& w) {
        kt_moe_options o = layer_options(w);
        kt_moe* m = nullptr;
        EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
        const kt_status st = kt_moe_params_changed(m);
        kt_moe_destroy(m);
        return st;
      });
  add("lora_not_bound", L, KT_ERR_NOT_BOUND, "kt_moe_params_changed", "LoRA factors", [](World& w) {
    kt_moe_options o = layer_options(w);
    kt_moe* m = nullptr;
    EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
    const kt_status st = kt_moe_params_changed(m);
    kt_moe_destroy(m);
    return st;
  });
  add.destroyed("moe_destroyed", L, KT_ERR_INVALID_HANDLE, "kt_moe_num_loaded", "moe", [](World& w) {
    kt_moe_options o = layer_options(w);
    kt_moe* m = nullptr;
    EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
    kt_moe_destroy(m);
    int64_t n = 0;
    return kt_moe_num_loaded(m, &n);
  });
}

kt_status fresh_forward(World& w, bool load, bool bind) {
  kt_moe_options o = layer_options(w);
  kt_moe* m = nullptr;
  EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
  if (load) {
    std::vector<kt_arg> a = w.weight_args();
    EXPECT_EQ(kt_moe_load_weights(m, nullptr, a.data(), a.size()), KT_OK);
  }
  if (bind) {
    std::vector<kt_arg> a = w.lora_args();
    EXPECT_EQ(kt_moe_bind(m, a.data(), a.size()), KT_OK);
  }
  Runner& r = w.r();
  kt_arg args[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                   {KT_ARG_Y, w.named("y", kF32, {6, 32})->dl()}};
  const kt_status st = kt_moe_forward(m, args, 4, nullptr);
  kt_moe_destroy(m);
  return st;
}

void add_compute_cases(const Adder& add) {
  const Layer L = Layer::kLora;
  const kt_status INV = KT_ERR_INVALID_ARGUMENT;
  for (const char* F : {"kt_moe_forward", "kt_moe_forward_submit"}) {
    const bool submit = std::string(F) == "kt_moe_forward_submit";
    auto call = [submit](World& w, kt_moe* m, const kt_arg* a, size_t n) {
      if (!submit) return kt_moe_forward(m, a, n, nullptr);
      kt_job* job = nullptr;
      const kt_status st = kt_moe_forward_submit(m, a, n, nullptr, 0, &job);
      if (st == KT_OK) kt_job_wait(job);
      kt_job_destroy(job);
      (void)w;
      return st;
    };
    auto fargs = [](World& w) {
      Runner& r = w.r();
      return std::vector<kt_arg>{{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()},
                                 {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()}, {KT_ARG_Y, r.y_->dl()}};
    };
    add("moe_null", L, KT_ERR_INVALID_HANDLE, F, "moe is NULL", [call, fargs](World& w) {
      auto a = fargs(w);
      return call(w, nullptr, a.data(), a.size());
    });
    add("args_null", L, KT_ERR_NULL_POINTER, F, "args is NULL",
        [call](World& w) { return call(w, w.moe(), nullptr, 4); });
    add("id_of_backward", L, INV, F, "KT_ARG_DY is not an argument", [call, fargs](World& w) {
      auto a = fargs(w);
      a[3].id = KT_ARG_DY;
      return call(w, w.moe(), a.data(), a.size());
    });
    add("id_huge", L, INV, F, "argument id 2147483647", [call, fargs](World& w) {
      auto a = fargs(w);
      a[3].id = 2147483647;
      return call(w, w.moe(), a.data(), a.size());
    });
    add("y_missing", L, KT_ERR_NULL_POINTER, F, "KT_ARG_Y is required", [call, fargs](World& w) {
      auto a = fargs(w);
      return call(w, w.moe(), a.data(), 3);
    });
    add("too_many_tokens", L, KT_ERR_TOO_MANY_TOKENS, F, "max_tokens", [call, fargs](World& w) {
      auto a = fargs(w);
      a[0].tensor = w.named("x7", kF32, {7, 32})->dl();
      return call(w, w.moe(), a.data(), a.size());
    });
    for (int64_t e : {int64_t{4}, int64_t{-2}, kHuge}) {
      add("expert_id_" + std::string(e == kHuge ? "huge" : e < 0 ? "minus_2" : "E"), L, KT_ERR_EXPERT_ID, F,
          "KT_ARG_IDS", [call, fargs, e](World& w) {
            Tensor* ids = w.named("ids", kI64, {6, 2});
            for (int64_t i = 0; i < 12; ++i) ids->set(i, i % 4);
            ids->set(5, static_cast<double>(e));
            auto a = fargs(w);
            a[1].tensor = ids->dl();
            return call(w, w.moe(), a.data(), a.size());
          });
    }
  }
  add("flags_unknown", L, INV, "kt_moe_forward_submit", "flags", [](World& w) {
    Runner& r = w.r();
    kt_arg a[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                  {KT_ARG_Y, r.y_->dl()}};
    kt_job* job = nullptr;
    return kt_moe_forward_submit(w.moe(), a, 4, nullptr, 2, &job);
  });
  add("job_null", L, KT_ERR_NULL_POINTER, "kt_moe_forward_submit", "job is NULL", [](World& w) {
    Runner& r = w.r();
    kt_arg a[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                  {KT_ARG_Y, r.y_->dl()}};
    return kt_moe_forward_submit(w.moe(), a, 4, nullptr, 0, nullptr);
  });
  // Wrong state: experts without weights, LoRA factors not bound.
  add("not_loaded", L, KT_ERR_NOT_LOADED, "kt_moe_forward", "has no weights loaded",
      [](World& w) { return fresh_forward(w, false, true); });
  add("lora_not_bound", L, KT_ERR_NOT_BOUND, "kt_moe_forward", "KT_ARG_LORA_A",
      [](World& w) { return fresh_forward(w, true, false); });

  // Backward.
  for (const char* Bw : {"kt_moe_backward", "kt_moe_backward_submit"}) {
    const bool submit = std::string(Bw) == "kt_moe_backward_submit";
    auto call = [submit](kt_moe* m, kt_context* ctx, const kt_backward_options* o, const kt_arg* a, size_t n) {
      if (!submit) return kt_moe_backward(m, ctx, o, a, n);
      kt_job* job = nullptr;
      const kt_status st = kt_moe_backward_submit(m, ctx, o, a, n, 0, &job);
      if (st == KT_OK) kt_job_wait(job);
      kt_job_destroy(job);
      return st;
    };
    add("ctx_null", L, KT_ERR_CONTEXT, Bw, "ctx is NULL", [call](World& w) {
      kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
      return call(w.moe(), nullptr, nullptr, a, 1);
    });
    add("moe_null", L, KT_ERR_INVALID_HANDLE, Bw, "moe is NULL", [call](World& w) {
      kt_context* ctx = w.saved_forward();
      kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
      const kt_status st = call(nullptr, ctx, nullptr, a, 1);
      kt_context_release(ctx);
      return st;
    });
    add("ctx_spent", L, KT_ERR_CONTEXT, Bw, "spent", [call](World& w) {
      kt_context* ctx = w.saved_forward();
      kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
      EXPECT_EQ(kt_moe_backward(w.moe(), ctx, nullptr, a, 1), KT_OK);
      const kt_status st = call(w.moe(), ctx, nullptr, a, 1);
      kt_context_release(ctx);
      return st;
    });
    add("ctx_released", L, KT_ERR_CONTEXT, Bw, "ctx", [call](World& w) {
      kt_context* ctx = w.saved_forward();
      kt_context_release(ctx);
      kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
      return call(w.moe(), ctx, nullptr, a, 1);
    });
    add("ctx_of_another_layer", L, KT_ERR_CONTEXT, Bw, "does not belong to this layer", [call](World& w) {
      kt_moe_options o = layer_options(w);
      kt_moe* m = nullptr;
      EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
      std::vector<kt_arg> wa = w.weight_args(), la = w.lora_args();
      EXPECT_EQ(kt_moe_load_weights(m, nullptr, wa.data(), wa.size()), KT_OK);
      EXPECT_EQ(kt_moe_bind(m, la.data(), la.size()), KT_OK);
      Runner& r = w.r();
      kt_arg f[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                    {KT_ARG_Y, w.named("y", kF32, {6, 32})->dl()}};
      kt_context* ctx = nullptr;
      EXPECT_EQ(kt_moe_forward(m, f, 4, &ctx), KT_OK);
      kt_arg a[] = {{KT_ARG_DY, r.dy_->dl()}};
      const kt_status st = call(w.moe(), ctx, nullptr, a, 1);
      kt_context_release(ctx);
      kt_moe_destroy(m);
      return st;
    });
    add("dy_missing", L, KT_ERR_NULL_POINTER, Bw, "KT_ARG_DY is required", [call](World& w) {
      kt_context* ctx = w.saved_forward();
      kt_arg a[] = {{KT_ARG_DX, w.r().dx_->dl()}};
      const kt_status st = call(w.moe(), ctx, nullptr, a, 1);
      kt_context_release(ctx);
      return st;
    });
    auto opts = [call](std::function<void(kt_backward_options&)> change) {
      return [call, change](World& w) {
        kt_context* ctx = w.saved_forward();
        kt_backward_options o;
        kt_backward_options_init(&o);
        change(o);
        kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
        const kt_status st = call(w.moe(), ctx, &o, a, 1);
        kt_context_release(ctx);
        return st;
      };
    };
    add("grad_scale_nan", L, INV, Bw, "options->grad_scale", opts([](kt_backward_options& o) { o.grad_scale = std::nanf(""); }));
    add("grad_scale_inf", L, INV, Bw, "options->grad_scale", opts([](kt_backward_options& o) { o.grad_scale = -INFINITY; }));
    for (int64_t v : {2, 9, -1})
      add("accumulate_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), L, INV, Bw,
          "options->accumulate", opts([v](kt_backward_options& o) { set_raw(o.accumulate, v); }));
    for (int v : {7, 2, -1})
      add("param_grads_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), L, INV, Bw,
          "options->param_grads", opts([v](kt_backward_options& o) { o.param_grads = v; }));
    add("struct_size_small", L, INV, Bw, "options->struct_size", opts([](kt_backward_options& o) { o.struct_size = 4; }));
    add("struct_size_huge", L, INV, Bw, "options->struct_size",
        opts([](kt_backward_options& o) { o.struct_size = size_t{1} << 33; }));
  }
  add("unknown_fields", L, KT_ERR_UNSUPPORTED, "kt_moe_backward", "options sets fields", [](World& w) {
    return backward_opts(w, [](unsigned char* raw) { raw[sizeof(kt_backward_options) + 5] = 7; },
                         sizeof(kt_backward_options) + 8);
  });
  add("grads_not_bound", L, KT_ERR_NOT_BOUND, "kt_moe_backward", "KT_ARG_GRAD_LORA_A_GATE is not bound",
      [](World& w) {
        kt_moe_options o = layer_options(w);
        kt_moe* m = nullptr;
        EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
        std::vector<kt_arg> wa = w.weight_args(), la = w.lora_args();
        EXPECT_EQ(kt_moe_load_weights(m, nullptr, wa.data(), wa.size()), KT_OK);
        EXPECT_EQ(kt_moe_bind(m, la.data(), la.size()), KT_OK);
        Runner& r = w.r();
        kt_arg f[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                      {KT_ARG_Y, w.named("y", kF32, {6, 32})->dl()}};
        kt_context* ctx = nullptr;
        EXPECT_EQ(kt_moe_forward(m, f, 4, &ctx), KT_OK);
        kt_arg a[] = {{KT_ARG_DY, r.dy_->dl()}};
        const kt_status st = kt_moe_backward(m, ctx, nullptr, a, 1);
        kt_context_release(ctx);
        kt_moe_destroy(m);
        return st;
      });
  // Outputs written into a bound gradient buffer, which backward writes too.
  add("dx_into_bound_gradient", L, INV, "kt_moe_backward", "KT_ARG_GRAD_LORA_A_UP", [](World& w) {
    kt_context* ctx = w.saved_forward();
    DLTensor dx = *w.r().dx_->dl();  // [6,32] f32 = 192 floats; the gradient holds 4*4*32
    dx.data = w.r().gla_[1]->dl()->data;
    kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}, {KT_ARG_DX, &dx}};
    const kt_status st = kt_moe_backward(w.moe(), ctx, nullptr, a, 2);
    kt_context_release(ctx);
    return st;
  });
  add("flags_unknown", L, INV, "kt_moe_backward_submit", "flags", [](World& w) {
    kt_context* ctx = w.saved_forward();
    kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
    kt_job* job = nullptr;
    const kt_status st = kt_moe_backward_submit(w.moe(), ctx, nullptr, a, 1, 4, &job);
    kt_context_release(ctx);
    return st;
  });
  add("job_null", L, KT_ERR_INVALID_HANDLE, "kt_job_wait", "job is NULL", [](World&) { return kt_job_wait(nullptr); });
  add.destroyed("ctx_of_destroyed_layer", L, KT_ERR_CONTEXT, "kt_moe_backward", "ctx", [](World& w) {
    kt_moe_options o = layer_options(w);
    kt_moe* m = nullptr;
    EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
    std::vector<kt_arg> wa = w.weight_args(), la = w.lora_args();
    EXPECT_EQ(kt_moe_load_weights(m, nullptr, wa.data(), wa.size()), KT_OK);
    EXPECT_EQ(kt_moe_bind(m, la.data(), la.size()), KT_OK);
    Runner& r = w.r();
    kt_arg f[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                  {KT_ARG_Y, w.named("y", kF32, {6, 32})->dl()}};
    kt_context* ctx = nullptr;
    EXPECT_EQ(kt_moe_forward(m, f, 4, &ctx), KT_OK);
    kt_moe_destroy(m);
    kt_arg a[] = {{KT_ARG_DY, r.dy_->dl()}};
    return kt_moe_backward(w.moe(), ctx, nullptr, a, 1);
  });
  add.destroyed("job_destroyed", L, KT_ERR_INVALID_HANDLE, "kt_job_wait", "job", [](World& w) {
    Runner& r = w.r();
    kt_arg a[] = {{KT_ARG_X, r.x_->dl()}, {KT_ARG_IDS, r.ids_->dl()}, {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()},
                  {KT_ARG_Y, r.y_->dl()}};
    kt_job* job = nullptr;
    EXPECT_EQ(kt_moe_forward_submit(w.moe(), a, 4, nullptr, 0, &job), KT_OK);
    kt_job_destroy(job);
    return kt_job_wait(job);
  });
}

void add_file_cases(const Adder& add) {
  const Layer L = Layer::kLora;
  const kt_status INV = KT_ERR_INVALID_ARGUMENT;
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_save_packed", "moe", [](World& w) {
    return kt_moe_save_packed(nullptr, (w.dir() + "/p.ktpack").c_str());
  });
  add("path_null", L, KT_ERR_NULL_POINTER, "kt_moe_save_packed", "path",
      [](World& w) { return kt_moe_save_packed(w.moe(), nullptr); });
  add("path_null", L, KT_ERR_NULL_POINTER, "kt_moe_load_packed", "path",
      [](World& w) { return kt_moe_load_packed(w.moe(), nullptr, 0); });
  add("flags_unknown", L, INV, "kt_moe_load_packed", "flags",
      [](World& w) { return kt_moe_load_packed(w.moe(), (w.dir() + "/p.ktpack").c_str(), 6); });

  add("dir_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_open", "dir", [](World&) {
    kt_ckpt* c = nullptr;
    return kt_ckpt_open(nullptr, &c);
  });
  add("dir_empty", L, INV, "kt_ckpt_open", "dir", [](World&) {
    kt_ckpt* c = nullptr;
    return kt_ckpt_open("", &c);
  });
  add("ckpt_out_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_open", "ckpt is NULL",
      [](World& w) { return kt_ckpt_open(w.dir().c_str(), nullptr); });
  add("ckpt_null", L, KT_ERR_INVALID_HANDLE, "kt_ckpt_get_info", "ckpt is NULL", [](World&) {
    kt_ckpt_info i;
    i.struct_size = sizeof(i);
    return kt_ckpt_get_info(nullptr, &i);
  });
  add("info_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_get_info", "info", [](World& w) { return kt_ckpt_get_info(w.ckpt(), nullptr); });
  add("struct_size_zero", L, INV, "kt_ckpt_get_info", "info->struct_size", [](World& w) {
    kt_ckpt_info i;
    std::memset(&i, 0, sizeof(i));
    return kt_ckpt_get_info(w.ckpt(), &i);
  });
  for (int64_t idx : {int64_t{-1}, int64_t{1}, kHuge})
    add("index_" + std::string(idx == kHuge ? "huge" : idx < 0 ? "negative" : "past_end"), L, INV,
        "kt_ckpt_get_layer_info", "index", [idx](World& w) {
          kt_ckpt_layer_info i;
          i.struct_size = sizeof(i);
          return kt_ckpt_get_layer_info(w.ckpt(), idx, &i);
        });
  add("options_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_moe_options", "options",
      [](World& w) { return kt_ckpt_moe_options(w.ckpt(), 3, nullptr); });
  add("layer_absent", L, INV, "kt_ckpt_moe_options", "layer 99", [](World& w) {
    kt_moe_options o;
    kt_moe_options_init(&o);
    return kt_ckpt_moe_options(w.ckpt(), 99, &o);
  });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_ckpt_load_layer", "moe",
      [](World& w) { return kt_ckpt_load_layer(w.ckpt(), 3, nullptr, nullptr, nullptr); });
  add("moe_of_other_shape", L, KT_ERR_SHAPE, "kt_ckpt_load_layer", "num_experts", [](World& w) {
    kt_moe_options o = layer_options(w);
    o.num_experts = 5;
    kt_moe* m = nullptr;
    EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
    const kt_status st = kt_ckpt_load_layer(w.ckpt(), 3, m, nullptr, nullptr);
    kt_moe_destroy(m);
    return st;
  });
  add("layer_absent", L, INV, "kt_ckpt_load_layer", "layer -1",
      [](World& w) { return kt_ckpt_load_layer(w.ckpt(), -1, w.moe(), nullptr, nullptr); });
  add("args_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_read_layer", "args",
      [](World& w) { return kt_ckpt_read_layer(w.ckpt(), 3, nullptr, 1); });
  add("id_of_forward", L, INV, "kt_ckpt_read_layer", "argument id 1", [](World& w) {
    kt_arg a[] = {{KT_ARG_X, w.named("gate", kF32, {4, 24, 32})->dl()}};
    return kt_ckpt_read_layer(w.ckpt(), 3, a, 1);
  });
  add("bias_without_biases", L, INV, "kt_ckpt_read_layer", "no biases", [](World& w) {
    kt_arg a[] = {{KT_ARG_B_GATE, w.named("bias", kF32, {4, 24})->dl()}};
    return kt_ckpt_read_layer(w.ckpt(), 3, a, 1);
  });
  for (int64_t idx : {int64_t{-1}, int64_t{12}, kHuge})  // the checkpoint holds 12 tensors
    add("index_" + std::string(idx == kHuge ? "huge" : idx < 0 ? "negative" : "past_end"), L, INV,
        "kt_ckpt_tensor_at", "index", [idx](World& w) {
          kt_ckpt_tensor t;
          t.struct_size = sizeof(t);
          return kt_ckpt_tensor_at(w.ckpt(), idx, &t);
        });
  add("tensor_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_tensor_at", "tensor",
      [](World& w) { return kt_ckpt_tensor_at(w.ckpt(), 0, nullptr); });
  for (int64_t idx : {int64_t{-1}, int64_t{12}, kHuge})  // layer 3 has 4 experts x 3 weights
    add("layer_tensor_index_" + std::string(idx == kHuge ? "huge" : idx < 0 ? "negative" : "past_end"), L,
        INV, "kt_ckpt_layer_tensor_at", "index", [idx](World& w) {
          kt_ckpt_tensor t;
          t.struct_size = sizeof(t);
          return kt_ckpt_layer_tensor_at(w.ckpt(), 3, idx, &t);
        });
  add("layer_tensor_of_absent_layer", L, INV, "kt_ckpt_layer_tensor_at", "layer 2", [](World& w) {
    kt_ckpt_tensor t;
    t.struct_size = sizeof(t);
    return kt_ckpt_layer_tensor_at(w.ckpt(), 2, 0, &t);
  });
  add("layer_tensor_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_layer_tensor_at", "tensor",
      [](World& w) { return kt_ckpt_layer_tensor_at(w.ckpt(), 3, 0, nullptr); });
  add("name_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_find_tensor", "name", [](World& w) {
    kt_ckpt_tensor t;
    t.struct_size = sizeof(t);
    return kt_ckpt_find_tensor(w.ckpt(), nullptr, &t);
  });
  const char* WE = "kt_ckpt_write_experts";
  add("dir_null", L, KT_ERR_NULL_POINTER, WE, "dir", [](World& w) {
    std::vector<kt_arg> a = w.weight_args();
    kt_ckpt_layer_args layer{3, a.data(), a.size()};
    return kt_ckpt_write_experts(nullptr, nullptr, &layer, 1);
  });
  add("layers_null", L, KT_ERR_NULL_POINTER, WE, "layers",
      [](World& w) { return kt_ckpt_write_experts((w.dir() + "/written").c_str(), nullptr, nullptr, 1); });
  for (int64_t v : {7, 1000, -1})
    add("layout_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), L, INV, WE,
        "options->layout", [v](World& w) { return write_opts(w, [v](kt_ckpt_write_options& o) { set_raw(o.layout, v); }); });
  for (int64_t v : {17, 1000, -1})
    add("dtype_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), L, INV, WE,
        "options->dtype", [v](World& w) { return write_opts(w, [v](kt_ckpt_write_options& o) { set_raw(o.dtype, v); }); });
  add("dtype_i8", L, INV, WE, "options->dtype",
      [](World& w) { return write_opts(w, [](kt_ckpt_write_options& o) { o.dtype = KT_CKPT_DTYPE_I8; }); });
  add("layout_fused", L, INV, WE, "options->layout",
      [](World& w) { return write_opts(w, [](kt_ckpt_write_options& o) { o.layout = KT_CKPT_LAYOUT_FUSED; }); });
  add("max_shard_bytes_zero", L, INV, WE, "options->max_shard_bytes",
      [](World& w) { return write_opts(w, [](kt_ckpt_write_options& o) { o.max_shard_bytes = 0; }); });
  add("struct_size_huge", L, INV, WE, "options->struct_size",
      [](World& w) { return write_opts(w, [](kt_ckpt_write_options& o) { o.struct_size = size_t{1} << 50; }); });
  const char* AW = "kt_ckpt_adapter_write";
  add("config_null", L, KT_ERR_NULL_POINTER, AW, "config", [](World& w) {
    std::vector<kt_arg> a = w.lora_args();
    kt_ckpt_layer_args layer{3, a.data(), a.size()};
    return kt_ckpt_adapter_write((w.dir() + "/written_adapter").c_str(), nullptr, &layer, 1);
  });
  add("rank_zero", L, INV, AW, "config->rank", [](World& w) { return adapter_with(w, [](kt_ckpt_adapter_config& c) { c.rank = 0; }); });
  for (int64_t v : {6, -1})
    add("layout_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), L, INV, AW,
        "config->layout", [v](World& w) { return adapter_with(w, [v](kt_ckpt_adapter_config& c) { set_raw(c.layout, v); }); });
  for (int64_t v : {99, -1})
    add("dtype_enum_" + std::to_string(v < 0 ? 1 : v) + (v < 0 ? "_negative" : ""), L, INV, AW,
        "config->dtype", [v](World& w) { return adapter_with(w, [v](kt_ckpt_adapter_config& c) { set_raw(c.dtype, v); }); });
  add("config_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_adapter_read_config", "config",
      [](World& w) { return kt_ckpt_adapter_read_config(w.adapter().c_str(), nullptr); });
  add("dir_null", L, KT_ERR_NULL_POINTER, "kt_ckpt_adapter_read", "dir",
      [](World&) { return kt_ckpt_adapter_read(nullptr, 3, nullptr, 0); });
  add.destroyed("ckpt_closed", L, KT_ERR_INVALID_HANDLE, "kt_ckpt_get_info", "ckpt", [](World& w) {
    kt_ckpt* c = nullptr;
    w.ckpt();
    EXPECT_EQ(kt_ckpt_open((w.dir() + "/ckpt").c_str(), &c), KT_OK);
    kt_ckpt_close(c);
    kt_ckpt_info i;
    i.struct_size = sizeof(i);
    return kt_ckpt_get_info(c, &i);
  });
}

// kt_optimizer_create over the world's host tensors with one pair changed.
kt_status create_optimizer_with(World& w, const std::function<void(kt_optimizer_param*, kt_optimizer_options&)>& change) {
  w.host_opt();
  kt_optimizer_param pairs[2] = {{w.host_param(0), w.host_grad(0)}, {w.host_param(1), w.host_grad(1)}};
  kt_optimizer_options o;
  kt_optimizer_options_init(&o);
  change(pairs, o);
  kt_optimizer* opt = nullptr;
  const kt_status st = kt_optimizer_create(w.engine(), &o, pairs, 2, &opt);
  kt_optimizer_destroy(opt);
  return st;
}

void add_optimizer_cases(const Adder& add) {
  const Layer L = Layer::kLora, F = Layer::kFull;
  const kt_status INV = KT_ERR_INVALID_ARGUMENT, NUL = KT_ERR_NULL_POINTER, HANDLE = KT_ERR_INVALID_HANDLE;
  const char* create = "kt_optimizer_create";
  add("opt_out_null", L, NUL, create, "opt", [](World& w) {
    kt_optimizer_param pair{w.host_param(0), w.host_grad(0)};
    return kt_optimizer_create(nullptr, nullptr, &pair, 1, nullptr);
  });
  add("params_null", L, NUL, create, "params", [](World&) {
    kt_optimizer* opt = nullptr;
    return kt_optimizer_create(nullptr, nullptr, nullptr, 1, &opt);
  });
  add("num_params_zero", L, INV, create, "num_params", [](World& w) {
    kt_optimizer_param pair{w.host_param(0), w.host_grad(0)};
    kt_optimizer* opt = nullptr;
    return kt_optimizer_create(nullptr, nullptr, &pair, 0, &opt);
  });
  add("engine_destroyed", L, HANDLE, create, "engine", [](World& w) {
    kt_engine* e = nullptr;
    EXPECT_EQ(kt_engine_create(nullptr, &e), KT_OK);
    kt_engine_destroy(e);
    kt_optimizer_param pair{w.host_param(0), w.host_grad(0)};
    kt_optimizer* opt = nullptr;
    return kt_optimizer_create(e, nullptr, &pair, 1, &opt);
  });
  add("param_bf16", L, KT_ERR_DTYPE, create, "params[0].param", [](World& w) {
    TensorPtr bf16 = Tensor::make(kBF16, {3, 5});
    return create_optimizer_with(w, [&](kt_optimizer_param* p, kt_optimizer_options&) { p[0].param = bf16->dl(); });
  });
  add("grad_null", L, NUL, create, "params[1].grad", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param* p, kt_optimizer_options&) { p[1].grad = nullptr; });
  });
  add("grad_shape", L, KT_ERR_SHAPE, create, "params[0].grad", [](World& w) {
    TensorPtr g = Tensor::make(kF32, {5, 3});
    return create_optimizer_with(w, [&](kt_optimizer_param* p, kt_optimizer_options&) { p[0].grad = g->dl(); });
  });
  add("grad_is_param", L, INV, create, "params[0].param", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param* p, kt_optimizer_options&) { p[0].grad = p[0].param; });
  });
  add("param_shared_by_two", L, INV, create, "params[1].param", [](World& w) {
    TensorPtr g = Tensor::make(kF32, {3, 5});
    return create_optimizer_with(w, [&](kt_optimizer_param* p, kt_optimizer_options&) {
      p[1].param = p[0].param;
      p[1].grad = g->dl();
    });
  });
  add("options_struct_size_zero", L, INV, create, "options->struct_size", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) { o.struct_size = 0; });
  });
  add("algorithm_unknown", L, INV, create, "algorithm", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) { set_raw(o.algorithm, 7); });
  });
  add("lr_negative", L, INV, create, "lr", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) { o.lr = -1e-3; });
  });
  add("lr_nan", L, INV, create, "lr", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) { o.lr = std::nan(""); });
  });
  add("beta1_one", L, INV, create, "beta1", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) { o.beta1 = 1.0; });
  });
  add("amsgrad_two", L, INV, create, "amsgrad", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) { o.amsgrad = 2; });
  });
  add("arithmetic_unknown", L, INV, create, "options->arithmetic", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) {
      o.arithmetic = static_cast<kt_optim_arithmetic>(2);
    });
  });
  add("nesterov_without_momentum", L, INV, create, "nesterov", [](World& w) {
    return create_optimizer_with(w, [](kt_optimizer_param*, kt_optimizer_options& o) {
      o.algorithm = KT_OPTIM_SGD;
      o.nesterov = 1;
    });
  });

  const char* for_layer = "kt_optimizer_create_for_layer";
  add("moe_null", L, HANDLE, for_layer, "moe", [](World&) {
    kt_optimizer* opt = nullptr;
    return kt_optimizer_create_for_layer(nullptr, nullptr, &opt);
  });
  add("opt_out_null", F, NUL, for_layer, "opt", [](World& w) { return kt_optimizer_create_for_layer(w.moe(), nullptr, nullptr); });
  add("inference_layer", L, KT_ERR_MODE, for_layer, "KT_MODE_INFERENCE", [](World& w) {
    kt_moe_options o = layer_options(w);
    o.mode = KT_MODE_INFERENCE;
    kt_moe* m = nullptr;
    EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
    kt_optimizer* opt = nullptr;
    const kt_status st = kt_optimizer_create_for_layer(m, nullptr, &opt);
    kt_moe_destroy(m);
    return st;
  });
  add("grads_not_bound", F, KT_ERR_NOT_BOUND, for_layer, "KT_ARG_GRAD_W_GATE", [](World& w) {
    kt_moe_options o = layer_options(w);
    kt_moe* m = nullptr;
    EXPECT_EQ(kt_moe_create(w.engine(), &o, &m), KT_OK);
    kt_arg a[] = {{KT_ARG_W_GATE, w.r().W_[0]->dl()}, {KT_ARG_W_UP, w.r().W_[1]->dl()}, {KT_ARG_W_DOWN, w.r().W_[2]->dl()}};
    EXPECT_EQ(kt_moe_bind(m, a, 3), KT_OK) << kt_last_error();
    kt_optimizer* opt = nullptr;
    const kt_status st = kt_optimizer_create_for_layer(m, nullptr, &opt);
    kt_moe_destroy(m);
    return st;
  });

  add("opt_null", L, HANDLE, "kt_optimizer_step", "opt", [](World&) { return kt_optimizer_step(nullptr, nullptr); });
  add.destroyed("opt_destroyed", L, HANDLE, "kt_optimizer_step", "opt", [](World& w) {
    kt_optimizer_param pair{w.host_param(0), w.host_grad(0)};
    kt_optimizer* opt = nullptr;
    EXPECT_EQ(kt_optimizer_create(nullptr, nullptr, &pair, 1, &opt), KT_OK);
    kt_optimizer_destroy(opt);
    return kt_optimizer_step(opt, nullptr);
  });
  add("struct_size_zero", L, INV, "kt_optimizer_step", "options->struct_size", [](World& w) {
    kt_optimizer_step_options o;
    kt_optimizer_step_options_init(&o);
    o.struct_size = 0;
    return kt_optimizer_step(w.host_opt(), &o);
  });
  add("unscale_inf", L, INV, "kt_optimizer_step", "grad_unscale", [](World& w) {
    kt_optimizer_step_options o;
    kt_optimizer_step_options_init(&o);
    o.grad_unscale = INFINITY;
    return kt_optimizer_step(w.host_opt(), &o);
  });
  add("layer_rebound", F, INV, "kt_optimizer_step", "W_UP was bound again", [](World& w) {
    w.layer_opt();
    TensorPtr other = Tensor::make(kF32, {4, 24, 32});
    for (int64_t i = 0; i < other->numel(); ++i) other->set(i, w.r().W_[1]->get(i));
    kt_arg a[] = {{KT_ARG_W_UP, other->dl()}};
    EXPECT_EQ(kt_moe_bind(w.moe(), a, 1), KT_OK) << kt_last_error();
    const kt_status st = kt_optimizer_step(w.layer_opt(), nullptr);
    kt_arg back[] = {{KT_ARG_W_UP, w.r().W_[1]->dl()}};
    EXPECT_EQ(kt_moe_bind(w.moe(), back, 1), KT_OK) << kt_last_error();
    return st;
  });
  add("job_null", L, NUL, "kt_optimizer_step_submit", "job",
      [](World& w) { return kt_optimizer_step_submit(w.host_opt(), nullptr, 0, nullptr); });
  add("flags_unknown", L, INV, "kt_optimizer_step_submit", "flags", [](World& w) {
    kt_job* job = nullptr;
    return kt_optimizer_step_submit(w.host_opt(), nullptr, 8, &job);
  });
  add("without_engine", L, KT_ERR_UNSUPPORTED, "kt_optimizer_step_submit", "engine", [](World& w) {
    kt_optimizer_param pair{w.host_param(0), w.host_grad(0)};
    kt_optimizer* opt = nullptr;
    EXPECT_EQ(kt_optimizer_create(nullptr, nullptr, &pair, 1, &opt), KT_OK);
    kt_job* job = nullptr;
    const kt_status st = kt_optimizer_step_submit(opt, nullptr, 0, &job);
    kt_optimizer_destroy(opt);
    return st;
  });

  add("options_null", L, NUL, "kt_optimizer_set_options", "options",
      [](World& w) { return kt_optimizer_set_options(w.host_opt(), nullptr); });
  add("algorithm_changed", L, INV, "kt_optimizer_set_options", "algorithm", [](World& w) {
    kt_optimizer_options o;
    kt_optimizer_options_init(&o);
    o.algorithm = KT_OPTIM_SGD;
    return kt_optimizer_set_options(w.host_opt(), &o);
  });
  add("eps_negative", L, INV, "kt_optimizer_set_options", "eps", [](World& w) {
    kt_optimizer_options o;
    kt_optimizer_options_init(&o);
    o.eps = -1;
    return kt_optimizer_set_options(w.host_opt(), &o);
  });
  add("options_null", L, NUL, "kt_optimizer_get_options", "options",
      [](World& w) { return kt_optimizer_get_options(w.host_opt(), nullptr); });
  add("index_past_end", L, INV, "kt_optimizer_set_grad", "index",
      [](World& w) { return kt_optimizer_set_grad(w.host_opt(), 2, w.host_grad(0)); });
  add("grad_shape", L, KT_ERR_SHAPE, "kt_optimizer_set_grad", "grad",
      [](World& w) { return kt_optimizer_set_grad(w.host_opt(), 1, w.host_grad(0)); });
  add("of_a_layer", F, KT_ERR_MODE, "kt_optimizer_set_grad", "layer",
      [](World& w) { return kt_optimizer_set_grad(w.layer_opt(), 0, w.r().gW_[0]->dl()); });
  add("out_null", L, NUL, "kt_optimizer_grad_sq_norm", "out",
      [](World& w) { return kt_optimizer_grad_sq_norm(w.host_opt(), nullptr); });
  add("count_null", L, NUL, "kt_optimizer_num_params", "count",
      [](World& w) { return kt_optimizer_num_params(w.host_opt(), nullptr); });
  add("step_null", L, NUL, "kt_optimizer_get_step", "step", [](World& w) { return kt_optimizer_get_step(w.host_opt(), nullptr); });
  add("step_negative", L, INV, "kt_optimizer_set_step", "step", [](World& w) { return kt_optimizer_set_step(w.host_opt(), -1); });
  add("out_null", L, NUL, "kt_optimizer_state", "out",
      [](World& w) { return kt_optimizer_state(w.host_opt(), 0, KT_OPTIM_STATE_EXP_AVG, nullptr); });
  add("index_past_end", L, INV, "kt_optimizer_state", "index", [](World& w) {
    DLTensor t;
    return kt_optimizer_state(w.host_opt(), 2, KT_OPTIM_STATE_EXP_AVG, &t);
  });
  add("state_not_kept", L, INV, "kt_optimizer_state", "which = 4", [](World& w) {
    DLTensor t;
    return kt_optimizer_state(w.host_opt(), 0, KT_OPTIM_STATE_MOMENTUM, &t);
  });
  add("state_unknown", L, INV, "kt_optimizer_state", "which", [](World& w) {
    DLTensor t;
    return raw_optimizer_state(w.host_opt(), 0, 99, &t);
  });
  add("path_null", L, NUL, "kt_optimizer_save", "path", [](World& w) { return kt_optimizer_save(w.host_opt(), nullptr); });
  add("directory_missing", L, KT_ERR_IO, "kt_optimizer_save", "no_such_dir",
      [](World& w) { return kt_optimizer_save(w.host_opt(), (w.dir() + "/no_such_dir/state").c_str()); });
  add("path_null", L, NUL, "kt_optimizer_load", "path", [](World& w) { return kt_optimizer_load(w.host_opt(), nullptr); });
  add("file_missing", L, KT_ERR_IO, "kt_optimizer_load", "missing",
      [](World& w) { return kt_optimizer_load(w.host_opt(), (w.dir() + "/missing").c_str()); });
  add("of_other_parameters", F, KT_ERR_INVALID_ARGUMENT, "kt_optimizer_load", "another optimizer",
      [](World& w) { return kt_optimizer_load(w.layer_opt(), w.host_state().c_str()); });
}

// Layer and cache queries.
void add_query_cases(const Adder& add) {
  const Layer L = Layer::kLora;
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_get_info", "moe", [](World&) {
    kt_moe_info i;
    i.struct_size = sizeof(i);
    return kt_moe_get_info(nullptr, &i);
  });
  add("info_null", L, KT_ERR_NULL_POINTER, "kt_moe_get_info", "info",
      [](World& w) { return kt_moe_get_info(w.moe(), nullptr); });
  add("struct_size_zero", L, KT_ERR_INVALID_ARGUMENT, "kt_moe_get_info", "info->struct_size", [](World& w) {
    kt_moe_info i;
    std::memset(&i, 0, sizeof(i));
    return kt_moe_get_info(w.moe(), &i);
  });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_moe_read_weights", "moe", [](World& w) {
    kt_arg a[] = {{KT_ARG_W_GATE, w.named("gate", kF32, {4, 24, 32})->dl()}};
    return kt_moe_read_weights(nullptr, a, 1);
  });
  add("args_null", L, KT_ERR_NULL_POINTER, "kt_moe_read_weights", "args",
      [](World& w) { return kt_moe_read_weights(w.moe(), nullptr, 1); });
  add("gate_shape", L, KT_ERR_SHAPE, "kt_moe_read_weights", "KT_ARG_W_GATE", [](World& w) {
    kt_arg a[] = {{KT_ARG_W_GATE, w.named("gate", kF32, {4, 24, 31})->dl()}};
    return kt_moe_read_weights(w.moe(), a, 1);
  });
  add("id_of_forward", L, KT_ERR_INVALID_ARGUMENT, "kt_moe_read_weights", "KT_ARG_X", [](World& w) {
    kt_arg a[] = {{KT_ARG_X, w.named("gate", kF32, {4, 24, 32})->dl()}};
    return kt_moe_read_weights(w.moe(), a, 1);
  });
  add("path_null", L, KT_ERR_NULL_POINTER, "kt_packed_read_info", "path", [](World&) {
    kt_packed_info i;
    i.struct_size = sizeof(i);
    return kt_packed_read_info(nullptr, &i);
  });
  add("info_null", L, KT_ERR_NULL_POINTER, "kt_packed_read_info", "info", [](World& w) {
    const std::string path = w.dir() + "/p.ktpack";
    EXPECT_EQ(kt_moe_save_packed(w.moe(), path.c_str()), KT_OK) << kt_last_error();
    return kt_packed_read_info(path.c_str(), nullptr);
  });
  add("file_missing", L, KT_ERR_IO, "kt_packed_read_info", "missing.ktpack", [](World& w) {
    kt_packed_info i;
    i.struct_size = sizeof(i);
    return kt_packed_read_info((w.dir() + "/missing.ktpack").c_str(), &i);
  });
  add("moe_null", L, KT_ERR_INVALID_HANDLE, "kt_ckpt_load_layer_with", "moe",
      [](World& w) { return kt_ckpt_load_layer_with(w.ckpt(), 3, nullptr, nullptr, nullptr, nullptr); });
  add("layer_absent", L, KT_ERR_INVALID_ARGUMENT, "kt_ckpt_load_layer_with", "layer -1",
      [](World& w) { return kt_ckpt_load_layer_with(w.ckpt(), -1, w.moe(), nullptr, nullptr, nullptr); });
  add("struct_size_zero", L, KT_ERR_INVALID_ARGUMENT, "kt_ckpt_load_layer_with", "options->struct_size",
      [](World& w) {
        kt_ckpt_load_options o;
        std::memset(&o, 0, sizeof(o));
        return kt_ckpt_load_layer_with(w.ckpt(), 3, w.moe(), &o, nullptr, nullptr);
      });
}

// Communicators and distributed layers: handles, options and tensors, on a
// communicator of one rank where the call needs a live one.
void add_dist_cases(const Adder& add) {
  const Layer L = Layer::kLora;
  const kt_status INV = KT_ERR_INVALID_ARGUMENT, NUL = KT_ERR_NULL_POINTER, HND = KT_ERR_INVALID_HANDLE;
  add("backend_unknown", L, INV, "kt_comm_parse_backend", "backend", [](World&) {
    kt_comm_backends b;
    b.struct_size = sizeof(b);
    return kt_comm_parse_backend("cpu:nccl", &b);
  });
  add("out_null", L, NUL, "kt_comm_parse_backend", "out", [](World&) { return kt_comm_parse_backend("gloo", nullptr); });
  add("comm_null", L, NUL, "kt_comm_create", "comm", [](World&) {
    kt_comm_options o;
    kt_comm_options_init(&o);
    return kt_comm_create(&o, nullptr);
  });
  add("world_size_zero", L, INV, "kt_comm_create", "options->world_size", [](World& w) {
    kt_comm_options o;
    kt_comm_options_init(&o);
    o.world_size = 0;
    o.store_path = w.dir().c_str();
    kt_comm* c = nullptr;
    return kt_comm_create(&o, &c);
  });
  add("rank_past_world", L, INV, "kt_comm_create", "options->rank", [](World& w) {
    kt_comm_options o;
    kt_comm_options_init(&o);
    o.world_size = 1;
    o.rank = 1;
    o.store_path = w.dir().c_str();
    kt_comm* c = nullptr;
    return kt_comm_create(&o, &c);
  });
  add("id_null", L, NUL, "kt_comm_nccl_unique_id", "id",
      [](World&) { return kt_comm_nccl_unique_id(nullptr, KT_NCCL_UNIQUE_ID_BYTES); });
  add("size_short", L, INV, "kt_comm_nccl_unique_id", "size", [](World&) {
    unsigned char id[KT_NCCL_UNIQUE_ID_BYTES];
    return kt_comm_nccl_unique_id(id, KT_NCCL_UNIQUE_ID_BYTES - 1);
  });
  add("comm_null", L, HND, "kt_comm_get_info", "comm", [](World&) {
    kt_comm_info i;
    i.struct_size = sizeof(i);
    return kt_comm_get_info(nullptr, &i);
  });
  add("comm_null", L, HND, "kt_comm_barrier", "comm", [](World&) { return kt_comm_barrier(nullptr); });
  add("comm_null", L, HND, "kt_comm_broadcast", "comm",
      [](World& w) { return kt_comm_broadcast(nullptr, w.named("t", kF32, {3})->dl(), 0); });
  add("comm_null", L, HND, "kt_comm_allgather", "comm", [](World& w) {
    return kt_comm_allgather(nullptr, w.named("in", kF32, {3})->dl(), w.named("out", kF32, {1, 3})->dl());
  });
  add("comm_null", L, HND, "kt_dist_moe_create", "comm", [](World& w) {
    kt_moe_options o = layer_options(w);
    kt_dist_moe* d = nullptr;
    return kt_dist_moe_create(nullptr, w.engine(), &o, nullptr, &d);
  });
  add("dist_null", L, HND, "kt_dist_moe_layer", "dist", [](World&) {
    kt_moe* m = nullptr;
    return kt_dist_moe_layer(nullptr, &m);
  });
  add("dist_null", L, HND, "kt_dist_moe_local_experts", "dist", [](World&) {
    int64_t n = 0;
    return kt_dist_moe_local_experts(nullptr, nullptr, 0, &n);
  });
  add("dist_null", L, HND, "kt_dist_moe_forward", "dist", [](World& w) {
    kt_arg a[] = {{KT_ARG_X, w.r().x_->dl()}};
    return kt_dist_moe_forward(nullptr, a, 1, nullptr);
  });
  add("dist_null", L, HND, "kt_dist_moe_backward", "dist", [](World& w) {
    kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
    return kt_dist_moe_backward(nullptr, nullptr, nullptr, a, 1);
  });
  add("comm_null", L, HND, "kt_dist_ckpt_save", "comm",
      [](World& w) { return kt_dist_ckpt_save(nullptr, w.dir().c_str(), nullptr, 0, nullptr); });
  add("comm_null", L, HND, "kt_dist_ckpt_load", "comm",
      [](World& w) { return kt_dist_ckpt_load(nullptr, w.dir().c_str(), nullptr, 0, nullptr); });

  // On a live communicator of one rank.
  add.on_comm("info_null", NUL, "kt_comm_get_info", "info", [](World& w) { return kt_comm_get_info(w.comm(), nullptr); });
  add.on_comm("root_past_world", INV, "kt_comm_broadcast", "root",
              [](World& w) { return kt_comm_broadcast(w.comm(), w.named("t", kF32, {3})->dl(), 1); });
  add.on_comm("tensor_on_cuda", KT_ERR_UNSUPPORTED, "kt_comm_broadcast", "no CUDA backend", [](World& w) {
    DLTensor t = *w.named("t", kF32, {3})->dl();
    t.device = DLDevice{kDLCUDA, 0};
    return kt_comm_broadcast(w.comm(), &t, 0);
  });
  add.on_comm("out_shape", KT_ERR_SHAPE, "kt_comm_allgather", "out", [](World& w) {
    return kt_comm_allgather(w.comm(), w.named("in", kF32, {3})->dl(), w.named("out", kF32, {1, 4})->dl());
  });
  add.on_comm("out_dtype", KT_ERR_DTYPE, "kt_comm_allgather", "out", [](World& w) {
    return kt_comm_allgather(w.comm(), w.named("in", kF32, {3})->dl(), w.named("out32", kI32, {1, 3})->dl());
  });
  add.on_comm("layer_options_null", NUL, "kt_dist_moe_create", "layer_options", [](World& w) {
    kt_dist_moe* d = nullptr;
    return kt_dist_moe_create(w.comm(), w.engine(), nullptr, nullptr, &d);
  });
  add.on_comm("dist_out_null", NUL, "kt_dist_moe_create", "dist", [](World& w) {
    kt_moe_options o = layer_options(w);
    return kt_dist_moe_create(w.comm(), w.engine(), &o, nullptr, nullptr);
  });
  add.on_comm("layer_null", NUL, "kt_dist_moe_layer", "layer", [](World& w) { return kt_dist_moe_layer(w.dist(), nullptr); });
  add.on_comm("count_null", NUL, "kt_dist_moe_local_experts", "count",
              [](World& w) { return kt_dist_moe_local_experts(w.dist(), nullptr, 0, nullptr); });
  add.on_comm("capacity_negative", INV, "kt_dist_moe_local_experts", "capacity", [](World& w) {
    int64_t n = 0;
    return kt_dist_moe_local_experts(w.dist(), nullptr, -1, &n);
  });
  add.on_comm("x_shape", KT_ERR_SHAPE, "kt_dist_moe_forward", "KT_ARG_X", [](World& w) {
    Runner& r = w.r();
    kt_arg a[] = {{KT_ARG_X, w.named("x31", kF32, {6, 31})->dl()}, {KT_ARG_IDS, r.ids_->dl()},
                  {KT_ARG_ROUTE_WEIGHTS, r.w_->dl()}, {KT_ARG_Y, w.named("y", kF32, {6, 32})->dl()}};
    return kt_dist_moe_forward(w.dist(), a, 4, nullptr);
  });
  add.on_comm("ctx_null", KT_ERR_CONTEXT, "kt_dist_moe_backward", "ctx", [](World& w) {
    kt_arg a[] = {{KT_ARG_DY, w.r().dy_->dl()}};
    return kt_dist_moe_backward(w.dist(), nullptr, nullptr, a, 1);
  });
  add.on_comm("dir_null", NUL, "kt_dist_ckpt_save", "dir",
              [](World& w) { return kt_dist_ckpt_save(w.comm(), nullptr, nullptr, 0, nullptr); });
  add.on_comm("dir_missing", KT_ERR_IO, "kt_dist_ckpt_load", "no_such_dir", [](World& w) {
    kt_dist_ckpt_layer l{};
    l.layer = 0;
    l.dist = w.dist();
    return kt_dist_ckpt_load(w.comm(), (w.dir() + "/no_such_dir").c_str(), &l, 1, nullptr);
  });
}

std::vector<BadCase> all_cases() {
  std::vector<BadCase> cases;
  add_tensor_cases(&cases);
  const Adder add{&cases};
  add_engine_cases(add);
  add_create_cases(add);
  add_layer_cases(add);
  add_compute_cases(add);
  add_file_cases(add);
  add_optimizer_cases(add);
  add_query_cases(add);
  add_dist_cases(add);
  return cases;
}

class BadInput : public ::testing::TestWithParam<BadCase> {};

TEST_P(BadInput, RefusedNamedAndHarmless) {
  const BadCase& c = GetParam();
  if (c.needs_gloo && !World::have_gloo()) GTEST_SKIP() << "kt built without Gloo: no communicator to refuse on";
  World w(c.layer);
  w.prime();
  // The caller's tensors, byte for byte: the refused call writes none of
  // them (the reference below is recomputed from these same tensors, so
  // it cannot see damage to them).
  const Runner::Snapshot before = w.r().snapshot();
  kt_clear_error();
  const kt_status st = c.run(w);
  const std::string message = kt_last_error();
  EXPECT_EQ(st, c.status) << kt_status_string(st) << ": " << message;
  EXPECT_EQ(message.rfind(c.call + ": ", 0), 0u) << "message does not start with '" << c.call << ": ': " << message;
  EXPECT_NE(message.find(c.needle), std::string::npos) << "message lacks '" << c.needle << "': " << message;
  for (const std::string& name : w.r().changed_since(before)) ADD_FAILURE() << "the refused call wrote the caller's " << name;
  w.expect_still_works();
}

INSTANTIATE_TEST_SUITE_P(Matrix, BadInput, ::testing::ValuesIn(all_cases()),
                         [](const ::testing::TestParamInfo<BadCase>& info) { return case_name(info.param.name); });

// The functions of the header that return a kt_status, read from the
// header itself (as tests/abi/check_exports.py reads the exports).
std::set<std::string> header_calls_with_status() {
  std::ifstream f(KT_PUBLIC_HEADER);
  EXPECT_TRUE(f.good()) << "cannot read " << KT_PUBLIC_HEADER;
  std::stringstream text;
  text << f.rdbuf();
  // Declarations read "KT_API kt_status kt_name(" (whitespace between the
  // words may vary); scanned by hand (GCC 12's <regex> trips -Werror under
  // the sanitizers).
  const std::string s = text.str();
  auto skip_space = [&](size_t i) {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
    return i;
  };
  auto word_at = [&](size_t i) {
    size_t j = i;
    while (j < s.size() && (std::isalnum(static_cast<unsigned char>(s[j])) || s[j] == '_')) ++j;
    return s.substr(i, j - i);
  };
  std::set<std::string> calls;
  for (size_t at = s.find("KT_API"); at != std::string::npos; at = s.find("KT_API", at + 6)) {
    size_t i = skip_space(at + 6);
    if (word_at(i) != "kt_status") continue;
    i = skip_space(i + 9);
    const std::string name = word_at(i);
    if (name.rfind("kt_", 0) == 0 && skip_space(i + name.size()) < s.size() && s[skip_space(i + name.size())] == '(')
      calls.insert(name);
  }
  return calls;
}

// Calls returning a status that the matrix does not run, each with why.
const std::map<std::string, std::string> kNotInTheMatrix = {};

// The matrix covers every function of the header that can fail.
TEST(BadInputMatrix, CoversEveryCallThatCanFail) {
  std::set<std::string> covered;
  for (const BadCase& c : all_cases()) covered.insert(c.call);
  const std::set<std::string> declared = header_calls_with_status();
  EXPECT_GT(declared.size(), 60u) << "the header's declarations were not found";
  for (const std::string& f : declared) {
    if (!kNotInTheMatrix.count(f)) {
      EXPECT_EQ(covered.count(f), 1u) << f << " has no bad-input case";
    }
  }
  for (const auto& e : kNotInTheMatrix) EXPECT_EQ(covered.count(e.first), 0u) << e.first << " is excluded yet covered";
  for (const std::string& f : covered) EXPECT_EQ(declared.count(f), 1u) << f << " is not a kt_status call of the header";
  std::cout << "bad-input matrix: " << all_cases().size() << " cases over " << covered.size() << " of the header's "
            << declared.size() << " calls that return a status\n";
}

// Calls without a status: out-of-range enum values get their documented
// fallback names (read as integers: no undefined behaviour on the way).
TEST(BadInputMatrix, EnumNamesOfOutOfRangeValues) {
  for (int v : {-1, 5, 8, 1000}) EXPECT_STREQ(raw_isa_name(v), "unknown") << v;
  for (int v : {-1, 19, 32, 999}) EXPECT_STREQ(raw_status_string(v), "KT_ERR_UNKNOWN") << v;
  for (int v : {-1, 0, 17, 1000}) EXPECT_STREQ(raw_ckpt_dtype_name(v), "unknown") << v;
  for (int v : {-1, 6, 1000}) EXPECT_STREQ(raw_ckpt_layout_name(v), "unknown") << v;
  for (int v : {-1, 5, 1000}) EXPECT_STREQ(raw_ckpt_format_name(v), "unknown") << v;
  for (int v : {-1, 8, 1000}) EXPECT_STREQ(raw_weight_format_name(v), "unknown") << v;
  EXPECT_STREQ(raw_weight_format_name(KT_FORMAT_INT4_G32_ZP), "int4_g32_zp");
  EXPECT_STREQ(raw_weight_format_name(KT_FORMAT_INT4_G128_ZP), "int4_g128_zp");
  EXPECT_STREQ(raw_isa_name(KT_ISA_AMX), "amx");
  EXPECT_STREQ(raw_status_string(KT_ERR_INTERNAL), "KT_ERR_INTERNAL");
  EXPECT_STREQ(raw_status_string(KT_ERR_COMM), "KT_ERR_COMM");
  EXPECT_STREQ(raw_ckpt_layout_name(KT_CKPT_LAYOUT_GPT_OSS), "gpt_oss");
}


// ------------------------------------------- sizes from files and allocations

// A safetensors file of zero-byte tensors: the header check lets any extent
// through when another extent is 0, so extents near 2^62 reach the layout code.
void write_safetensors(const std::string& path, const std::string& header) {
  std::string h = header;
  while (h.size() % 8) h += ' ';
  FILE* f = std::fopen(path.c_str(), "wb");
  ASSERT_NE(f, nullptr);
  uint64_t n = h.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  ASSERT_EQ(std::fwrite(len, 1, 8, f), 8u);
  ASSERT_EQ(std::fwrite(h.data(), 1, h.size(), f), h.size());
  std::fclose(f);
}

class HugeExtents : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = std::string(tmp && *tmp ? tmp : "/tmp") + "/kt_huge_extents_XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    ASSERT_NE(mkdtemp(buf.data()), nullptr);
    dir_ = buf.data();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_;
};

constexpr const char* k2e62 = "4611686018427387904";

TEST_F(HugeExtents, FusedLayoutComparesExtentsWithoutOverflow) {
  // gate_up [2, 0, 2^62] and down [2, 2^62, 0]: 2 * 2^62 does not fit.
  write_safetensors(dir_ + "/model.safetensors",
                    std::string("{\"model.layers.0.mlp.experts.gate_up_proj\":{\"dtype\":\"BF16\",\"shape\":[2,0,") +
                        k2e62 + "],\"data_offsets\":[0,0]},\"model.layers.0.mlp.experts.down_proj\":{\"dtype\":"
                        "\"BF16\",\"shape\":[2," + k2e62 + ",0],\"data_offsets\":[0,0]}}");
  kt_ckpt* c = nullptr;
  ASSERT_EQ(kt_ckpt_open(dir_.c_str(), &c), KT_OK) << kt_last_error();
  kt_ckpt_layer_info li;
  li.struct_size = sizeof(li);
  ASSERT_EQ(kt_ckpt_get_layer_info(c, 0, &li), KT_OK) << kt_last_error();
  EXPECT_EQ(li.hidden, int64_t{1} << 62);
  EXPECT_EQ(li.intermediate, 0);
  kt_moe_options o;
  kt_moe_options_init(&o);
  ASSERT_EQ(kt_ckpt_moe_options(c, 0, &o), KT_OK) << kt_last_error();
  // Such a layer cannot be created; the refusal names the call and field.
  kt_engine* e = nullptr;
  ASSERT_EQ(kt_engine_create(nullptr, &e), KT_OK);
  kt_moe* m = nullptr;
  EXPECT_EQ(kt_moe_create(e, &o, &m), KT_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(std::string(kt_last_error()).rfind("kt_moe_create: options->hidden", 0), 0u) << kt_last_error();
  // Reading the (empty) layer into empty tensors copies nothing and ends.
  int64_t shape[3] = {2, 0, int64_t{1} << 62};
  DLTensor t{};
  t.device = {kDLCPU, 0};
  t.ndim = 3;
  t.dtype = kF32;
  t.shape = shape;
  kt_arg a[] = {{KT_ARG_W_GATE, &t}};
  EXPECT_EQ(kt_ckpt_read_layer(c, 0, a, 1), KT_OK) << kt_last_error();
  kt_ckpt_close(c);
  EXPECT_EQ(kt_engine_destroy(e), KT_OK);
}

TEST_F(HugeExtents, PackedInt4ExtentThatOverflowsIsAFormatError) {
  // weight_packed int32 [0, 2^62] holds in/8 columns: in = 2^65.
  std::string h = "{";
  const char* projs[] = {"gate_proj", "up_proj", "down_proj"};
  for (int p = 0; p < 3; ++p) {
    const std::string base = std::string("model.layers.0.mlp.experts.0.") + projs[p];
    h += std::string(p ? "," : "") + "\"" + base + ".weight_packed\":{\"dtype\":\"I32\",\"shape\":[0," + k2e62 +
         "],\"data_offsets\":[0,0]},\"" + base + ".weight_scale\":{\"dtype\":\"BF16\",\"shape\":[0,4],"
         "\"data_offsets\":[0,0]}";
  }
  write_safetensors(dir_ + "/model.safetensors", h + "}");
  kt_ckpt* c = nullptr;
  EXPECT_EQ(kt_ckpt_open(dir_.c_str(), &c), KT_ERR_IO);
  EXPECT_EQ(std::string(kt_last_error()).rfind("kt_ckpt_open: ", 0), 0u) << kt_last_error();
  EXPECT_NE(std::string(kt_last_error()).find("weight_packed': extent 4611686018427387904 times 8 overflows"),
            std::string::npos)
      << kt_last_error();
  EXPECT_EQ(c, nullptr);
}

// A layer that passes the size bound but cannot be allocated: the message
// names the call. The address-space limit is set in a child process.
TEST(HugeLayers, RealOutOfMemoryNamesTheCall) {
#if defined(__SANITIZE_ADDRESS__)
  GTEST_SKIP() << "AddressSanitizer reserves more address space than the limit this test sets";
#else
  fflush(nullptr);
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child's own engine (engines do not cross a fork).
    kt_engine_options eo;
    kt_engine_options_init(&eo);
    eo.num_threads = 1;
    kt_engine* e = nullptr;
    if (kt_engine_create(&eo, &e) != KT_OK) _exit(3);
    long pages = 0;
    FILE* f = std::fopen("/proc/self/statm", "r");
    if (!f || std::fscanf(f, "%ld", &pages) != 1) _exit(3);
    std::fclose(f);
    struct rlimit lim;
    lim.rlim_cur = lim.rlim_max = static_cast<rlim_t>(pages) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE)) +
                                  (rlim_t{256} << 20);
    if (setrlimit(RLIMIT_AS, &lim) != 0) _exit(3);
    kt_moe_options o;  // ~3 GiB of packed weights: under physical memory, over the limit
    kt_moe_options_init(&o);
    o.num_experts = 64; o.top_k = 2; o.hidden = 4096; o.intermediate = 2048;
    kt_moe* m = nullptr;
    const kt_status st = kt_moe_create(e, &o, &m);
    const std::string msg = kt_last_error();
    if (st != KT_ERR_OUT_OF_MEMORY) _exit(4);
    if (msg.rfind("kt_moe_create: ", 0) != 0) _exit(5);
    _exit(0);
  }
  int status = 0;
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "child ended by signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: setup failed, 4: not KT_ERR_OUT_OF_MEMORY, 5: message lacks the call";
#endif
}

}  // namespace
}  // namespace kt_test
